"""OpenAI's Responses API on the agents' caches: ``POST /v1/responses`` (JSON, or SSE with
``"stream": true``), ``GET`` and ``DELETE /v1/responses/{id}``, ``GET
/v1/responses/{id}/input_items``, for the Codex CLI, the Agents SDK and
``ChatOpenAI(use_responses_api=True)``.

A response chain is an agent: a new chain's agent is its first response's id (or the agent
the request names: ``X-Agent-ID``, ``agent_id``, ``prompt_cache_key``, ``user``), and a
request with ``previous_response_id`` runs on that response's agent with the chain's
history read back from the stored responses (``responses_store``): the agent's cache holds
that history already, so the new turn is an EXTEND of it (hot, or warm after a restart),
never a re-prefill. ``store: false`` stores no response. A turn on an agent the request
names (the Codex CLI sends its whole history each turn with ``prompt_cache_key`` and
``store: false``) still runs on that agent and keeps its cache, as OpenAI's prompt cache
serves ``store: false`` requests: its next turn is an EXTEND. A turn on an unnamed chain
runs on a copy of the chain's agent (a fork: its blocks shared), deleted after the reply:
nothing could reach it again, and the chain's own agent stays as the stored chain left it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Literal

from fastapi import Depends, FastAPI, Header, Query, Request
from fastapi.responses import JSONResponse
from langchain_core.messages import AIMessage, BaseMessage, SystemMessage
from sse_starlette import EventSourceResponse

from ..chat.model import ChatAgentMemory
from ..chat.replies import forced_tools
from . import streams
from .agent_routes import Caller, agent_header, agent_of, served, valid_agent
from .context_scale import scaled, scaled_chunks
from .errors import APIError, as_api_errors, parse_body, warn, within_limit
from .replies import new_id
from .responses_protocol import ResponsesRequest, to_messages
from .responses_replies import OutputWriter, created_now, finished, input_items_page, skeleton
from .responses_store import ResponseStore, StoredResponse, open_response_store
from .served_models import ServedModels
from .streams import first_chunk, relay, sent

logger = logging.getLogger(__name__)


def add_responses_routes(
    app: FastAPI,
    models: ServedModels,
    authorize: Callable[..., Caller],
    limits: tuple[int, int],
    scale: float = 1.0,
) -> Callable[[], None]:
    """The routes; ``limits``: (default max tokens, most a request may ask); ``scale``: the
    prompt token counts told to clients (``context_scale``). Returns what closes the
    response stores."""
    default_tokens, max_tokens_limit = limits
    stores: dict[str, ResponseStore] = {}

    def store_of(model: str) -> ResponseStore:
        if model not in stores:  # where the model's agents are: a restart, another worker find its chains
            stores[model] = open_response_store(served(models, model).engine)
        return stores[model]

    def stored(model: str, rid: str) -> StoredResponse:
        record = store_of(model).get(rid)
        if record is None:
            raise APIError(404, f"response {rid!r} is not stored here", "response_not_found")
        return record

    @app.post("/v1/responses", response_model=None)
    async def create(
        request: Request,
        x_agent_id: str | None = Header(default=None),
        caller: Caller = Depends(authorize),  # noqa: B008 - FastAPI's dependency
    ) -> JSONResponse | EventSourceResponse:
        body = parse_body(ResponsesRequest, await request.body())
        llm = served(models, body.model)
        store = await asyncio.to_thread(store_of, body.model)
        rid, items = new_id("resp_"), body.items()
        chain_agent, history = None, []
        if body.previous_response_id:
            try:
                previous, history = await asyncio.to_thread(store.history, body.previous_response_id)
            except KeyError as exc:
                message = (
                    f"previous_response_id {body.previous_response_id!r}: response {exc} is not stored "
                    "here (sent with store: false, deleted, or kept by another server)"
                )
                raise APIError(404, message, "response_not_found", "previous_response_id") from None
            chain_agent = previous.agent_id
        named = bool(x_agent_id or body.agent_id or body.prompt_cache_key or body.user)
        if named:
            agent = agent_of(body, x_agent_id, caller)  # the one the request names
        else:
            agent = chain_agent or rid
            valid_agent(agent, caller)
        scratch = not body.store and not named  # see the module's docstring
        headers = {"X-Agent-ID": agent_header(agent)}
        with as_api_errors():
            tools, dropped_items = body.tool_set(), []
            messages: list[BaseMessage] = [SystemMessage(body.instructions)] if body.instructions else []
            messages += to_messages(history + items, dropped_items)
            asked = body.max_output_tokens or default_tokens
            max_tokens = within_limit(asked, max_tokens_limit, headers)
            kwargs = body.call_kwargs(agent, max_tokens, tools)  # checks tool_choice before the copy
            if scratch:
                kwargs["agent_id"] = await asyncio.to_thread(_scratch_copy, llm, agent, rid)
        runs_on = kwargs["agent_id"]
        if tools.dropped:
            warn(headers, f"tools left out, which this server's model cannot run: {', '.join(tools.dropped)}")
        if dropped_items:
            warn(headers, f"input items left out, of tools this model cannot run: {', '.join(dropped_items)}")
        if body.include:
            logger.debug("include items omitted (not made by this server): %s", ", ".join(body.include))
        echoed = {
            "model": body.model, "instructions": body.instructions,
            "previous_response_id": body.previous_response_id, "store": body.store,
            "tools": body.tools or [], "tool_choice": body.tool_choice,
            "temperature": llm.temperature if body.temperature is None else body.temperature,
            "top_p": llm.top_p if body.top_p is None else body.top_p,
            "max_output_tokens": body.max_output_tokens, "metadata": body.metadata or {}, "user": body.user,
        }  # fmt: skip
        base, writer = skeleton(rid, echoed, created_now()), OutputWriter(tools.call_name)

        async def done(reply: AIMessage) -> dict[str, Any]:
            """The whole response: stored (or the scratch copy dropped)."""
            response = finished(base, writer.items, reply)
            if body.store:
                record = StoredResponse(response, agent, items, body.previous_response_id)
                await asyncio.to_thread(store.put, record)
            if scratch:
                await asyncio.to_thread(llm.engine.admin.delete, runs_on)
            return response

        if not body.stream or forced_tools(kwargs.get("tools") or [], kwargs.get("tool_choice")):
            # A forced call is generated whole (see chat completions): its events at once.
            with as_api_errors():
                reply = scaled(await llm.ainvoke(messages, **kwargs), scale)
            events = [*writer.start(base), *writer.whole(reply), *writer.close(reply)]
            response = await done(reply)
            if not body.stream:
                return JSONResponse(response, headers=headers)
            events.append(_end(writer, response))
            return EventSourceResponse(sent(events), headers=headers, ping=streams.KEEPALIVE_S)
        chunks = aiter(scaled_chunks(llm.astream(messages, **kwargs), scale))
        first = await first_chunk(chunks)  # errors before it still get a status code (``streams``)
        events = _stream(first, chunks, writer, base, done)
        return EventSourceResponse(events, headers=headers, ping=streams.KEEPALIVE_S)

    auth = Depends(authorize)

    @app.get("/v1/responses/{rid}")
    async def get(rid: str, model: str | None = None, _: Caller = auth) -> dict[str, Any]:
        """A stored response (``model``: the served model it was made with; default the first)."""
        return (await asyncio.to_thread(stored, model or next(iter(models)), rid)).response

    @app.get("/v1/responses/{rid}/input_items")
    async def input_items(
        rid: str,
        order: Literal["asc", "desc"] = "desc",
        after: str | None = None,
        limit: int = Query(default=20, ge=1, le=100),
        model: str | None = None,
        _: Caller = auth,
    ) -> dict[str, Any]:
        """The input items response ``rid`` was made from (this turn's: the turns before it
        are the input items of the responses it continued)."""
        record = await asyncio.to_thread(stored, model or next(iter(models)), rid)
        try:
            return input_items_page(rid, record.input, order, after, limit)
        except KeyError:
            raise APIError(404, f"input item {after!r} is not one of response {rid!r}'s", "not_found",
                           "after") from None  # fmt: skip

    @app.delete("/v1/responses/{rid}")
    async def delete(rid: str, model: str | None = None, _: Caller = auth) -> dict[str, Any]:
        name = model or next(iter(models))
        await asyncio.to_thread(stored, name, rid)
        await asyncio.to_thread(store_of(name).delete, rid)
        return {"id": rid, "object": "response", "deleted": True}

    def close() -> None:
        for store in stores.values():
            store.close()

    return close


def _scratch_copy(llm: ChatAgentMemory, agent: str, rid: str) -> str:
    """A copy of ``agent``'s cache for a turn that keeps nothing (``store: false``)."""
    scratch = f"{agent}~{rid}"
    admin = llm.engine.admin
    if admin.has_agent(agent):
        admin.fork(agent, scratch)
    return scratch


def _end(writer: OutputWriter, response: dict[str, Any]) -> dict[str, str]:
    kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
    return writer.event(kind, response=response)


def _stream(
    first: Any,
    chunks: AsyncIterator[Any],
    writer: OutputWriter,
    base: dict[str, Any],
    done: Callable[[AIMessage], Awaitable[dict[str, Any]]],
) -> AsyncIterator[dict[str, str]]:
    """A streamed response's SSE events (``streams.relay``): the last chunk closes its items,
    then the whole response (stored) ends it; a failure after the status line was sent is a
    ``response.failed`` event."""
    replies: list[AIMessage] = []

    def render(chunk: Any) -> list[dict[str, str]]:
        out = writer.chunk(chunk)
        if chunk.chunk_position == "last":
            reply = AIMessage(
                content="", tool_calls=chunk.tool_calls, invalid_tool_calls=chunk.invalid_tool_calls,
                usage_metadata=chunk.usage_metadata, response_metadata=chunk.response_metadata,
            )  # fmt: skip
            replies.append(reply)
            out += writer.close(reply)
        return out

    async def tail() -> list[dict[str, str]]:
        return [_end(writer, await done(replies[-1]))] if replies else []

    def failed(exc: Exception) -> list[dict[str, str]]:
        response = {**base, "status": "failed", "error": {"code": "server_error", "message": str(exc)}}
        return [writer.event("response.failed", response=response)]

    return relay(first, chunks, render, failed, head=writer.start(base), tail=tail)
