"""Anthropic's Messages API on the agents' caches: ``POST /v1/messages`` (JSON, or SSE with
``"stream": true``) and ``POST /v1/messages/count_tokens``, for Claude Code and other
Anthropic-SDK clients (``anthropic.Anthropic(base_url=...)``, LangChain's ``ChatAnthropic``).

A request runs on ``ChatAgentMemory`` as a chat completion does (``anthropic_protocol``:
the agent, the messages, the call), its reply comes back in Anthropic's shapes
(``anthropic_replies``), and its errors too (``errors``: ``{"type": "error", "error":
{"type", "message"}}``). The key goes in ``x-api-key`` (Anthropic's clients) or as a bearer
token.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import Depends, FastAPI, Header, Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse

from ..chat.replies import forced_tools
from . import anthropic_replies, streams
from .agent_routes import Caller, agent_header, agent_of, served
from .anthropic_protocol import CountTokensRequest, MessagesRequest
from .anthropic_replies import EventWriter, event
from .context_scale import scaled, scaled_chunks
from .errors import as_api_errors, parse_body, warn, within_limit
from .replies import new_id
from .served_models import ServedModels
from .streams import first_chunk, relay, sent


def add_messages_routes(
    app: FastAPI,
    models: ServedModels,
    authorize: Callable[..., Caller],
    max_tokens_limit: int,
    scale: float = 1.0,
) -> None:
    """The routes; ``scale``: the prompt token counts told to clients (``context_scale``)."""

    @app.post("/v1/messages", response_model=None)
    async def messages(
        request: Request,
        x_agent_id: str | None = Header(default=None),
        caller: Caller = Depends(authorize),  # noqa: B008 - FastAPI's dependency
    ) -> JSONResponse | EventSourceResponse:
        body = parse_body(MessagesRequest, await request.body())
        llm = served(models, body.model)
        agent = agent_of(body, x_agent_id, caller)
        with as_api_errors():
            history = body.to_messages()
        headers = {"X-Agent-ID": agent_header(agent)}
        kwargs = body.call_kwargs(agent, within_limit(body.max_tokens, max_tokens_limit, headers))
        dropped = body.dropped_tools()
        if dropped:
            warn(headers, f"tools left out, run by Anthropic's servers only: {', '.join(dropped)}")
        writer = EventWriter(new_id("msg_"), body.model)
        if not body.stream:
            with as_api_errors():
                reply = scaled(await llm.ainvoke(history, **kwargs), scale)
            return JSONResponse(anthropic_replies.message(writer.mid, body.model, reply), headers=headers)
        if forced_tools(kwargs.get("tools") or [], kwargs.get("tool_choice")):
            # A forced call is generated whole (see chat completions): its events at once.
            with as_api_errors():
                reply = scaled(await llm.ainvoke(history, **kwargs), scale)
            return EventSourceResponse(sent(writer.whole(reply)), headers=headers, ping=streams.KEEPALIVE_S)
        chunks = aiter(scaled_chunks(llm.astream(history, **kwargs), scale))
        first = await first_chunk(chunks)  # errors before it still get a status code (``streams``)
        events = relay(first, chunks, writer.chunk, _error, head=writer.start())
        return EventSourceResponse(events, headers=headers, ping=streams.KEEPALIVE_S)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request, _: Caller = Depends(authorize)) -> dict[str, Any]:  # noqa: B008
        """The tokens a request of these messages (and tools) reads, its generation prompt aside."""
        body = parse_body(CountTokensRequest, await request.body())
        llm = served(models, body.model)
        with as_api_errors():
            history, tools = body.to_messages(), body.openai_tools() or None
            count = await asyncio.to_thread(llm.get_num_tokens_from_messages, history, tools)
        return {"input_tokens": round(count * scale)}


def _error(exc: Exception) -> list[dict[str, str]]:
    return [event("error", error={"type": "api_error", "message": f"generation failed: {exc}"})]
