"""The OpenAI-compatible HTTP server (``agent-memory serve``).

Routes: ``POST /v1/chat/completions`` (JSON, or SSE with ``"stream": true``),
``GET /v1/models``, ``GET /health``. Each request runs on ``ChatAgentMemory`` under the
agent named by the ``X-Agent-ID`` header or the body's ``agent_id`` (``default`` when
neither is given), so one server keeps every client agent's KV cache, across restarts.

Errors come in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: 400
for a malformed or unsupported request, 401 without the bearer token (when one is set),
404 for an unknown model, 413 for a body over the limit.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from fastapi import Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..chat.model import ChatAgentMemory
from ..chat.replies import forced_tools
from ..engine.engine import ContextLengthError, Engine, GenerationParams
from ..engine.model.loading import DEFAULT_MODEL
from ..engine.storage.blocks import AgentRecord, is_internal, validate_agent_id
from . import replies
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    NamedToolChoice,
    SampledRequest,
    call_kwargs,
    penalty_kwargs,
    to_messages,
)

logger = logging.getLogger(__name__)
R = TypeVar("R", bound=SampledRequest)

DEFAULT_AGENT = "default"


@dataclass
class ServerConfig:
    """What ``agent-memory serve`` serves, and its limits."""

    models: list[str] = field(default_factory=lambda: [DEFAULT_MODEL])
    cache_dir: str | None = None
    kv_bits: Literal[4, 8] | None = 4
    kv_format: str | None = None
    hot_budget_mb: int = 512
    #: Most tokens (prompt and reply) an agent's context holds (None: the model's own).
    context_length: int | None = None
    #: Disk budget of the stored caches (``--max-disk-bytes`` / ``--cache-ttl``; None: the
    #: settings', else unbounded): least recently used agents are evicted.
    max_disk_bytes: int | str | None = None
    cache_ttl: float | str | None = None
    #: A store shared by several servers (postgresql:// records, s3:// blocks); None: the
    #: settings' (``AGENT_MEMORY_STORE`` / ``AGENT_MEMORY_BLOCKS``), else the cache directory.
    store: str | None = None
    blocks: str | None = None
    #: Bearer token every ``/v1`` request must carry (None: no auth; bind to loopback then).
    api_key: str | None = None
    max_body_bytes: int = 4 << 20
    #: Largest ``max_tokens`` a request may ask for, and what it gets when it asks nothing.
    max_tokens_limit: int = 4096
    default_max_tokens: int = 512
    #: The names clients use for the models (``--served-model-name``), one per model; None:
    #: the models' own names.
    served_names: list[str] | None = None
    #: Origins a browser may call from (CORS; ``["*"]``: any); empty: no CORS headers.
    allowed_origins: list[str] = field(default_factory=list)
    #: Sampling a request gets for what it leaves out (``--temperature`` ... on the CLI).
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0


class APIError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


def _error(status: int, message: str, code: str | None = None, param: str | None = None) -> JSONResponse:
    # OpenAI's shape: every client error is an ``invalid_request_error`` (a wrong key too),
    # told apart by ``code`` (``invalid_api_key``, ``model_not_found``, ...).
    kind = "server_error" if status >= 500 else "invalid_request_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(body, status_code=status, headers=headers)


class BodyLimit:
    """Refuses request bodies over ``max_bytes`` with a 413, declared or streamed."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        too_big = f"request body is over the server's limit of {self.max_bytes} bytes"
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await _error(413, too_big, "request_too_large")(scope, receive, send)
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:  # a chunked body: FastAPI turns this into the 413
                raise HTTPException(413, too_big)
            return message

        return await self.app(scope, limited, send)


def _validation_message(errors: list[Any]) -> tuple[str, str | None]:
    """The first problem of a validation error, as one line, and the field it is in."""
    if not errors:
        return "malformed request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}", None
    loc = [str(p) for p in first.get("loc", ())]
    if loc and loc[0] in ("body", "path", "query", "header"):
        loc = loc[1:]
    where = ".".join(loc)
    msg = first["msg"].removeprefix("Value error, ")
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return (f"{where}: {msg}" if where else msg) + more, where or None


def create_app(config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()
    models: dict[str, ChatAgentMemory] = {}

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        names = config.served_names or config.models
        if len(names) != len(config.models):
            raise ValueError(
                f"{len(names)} served model names for {len(config.models)} models: give one each"
            )
        for name, model in zip(names, config.models, strict=True):
            llm = ChatAgentMemory(
                model=model,
                temperature=config.temperature,
                top_p=config.top_p,
                top_k=config.top_k,
                min_p=config.min_p,
                cache_dir=config.cache_dir,
                kv_bits=config.kv_bits,
                kv_format=config.kv_format,
                hot_budget_mb=config.hot_budget_mb,
                store=config.store,
                blocks=config.blocks,
                max_disk_bytes=config.max_disk_bytes,
                cache_ttl=config.cache_ttl,
            )
            engine = await asyncio.to_thread(lambda llm=llm: llm.engine)  # load before serving
            if config.context_length is not None:
                engine.context_length = config.context_length
            logger.info("serving %s (KV cache %s)", name, engine.fingerprint)
            models[name] = llm
        yield
        # Saves run after the replies left: all of them written before the process ends
        # (SIGTERM re-raised by uvicorn ends it without the interpreter's exit hooks).
        for llm in models.values():
            try:
                await asyncio.to_thread(llm.engine.flush)
            except Exception:  # logged when it failed; the previous cache is intact
                logger.warning("a save of model %s failed before shutdown", llm.model)

    app = FastAPI(title="langchain-agent-memory", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    if config.allowed_origins:  # browsers calling from a web app
        app.add_middleware(
            CORSMiddleware,
            allow_origins=config.allowed_origins,
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=["X-Agent-ID"],
        )

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.code, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(list(exc.errors()))
        return _error(400, message, param=param)

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail))

    def authorize(authorization: str | None = Header(default=None)) -> None:
        if config.api_key is None:
            return
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), config.api_key.encode()):
            message = "missing or wrong API key: send 'Authorization: Bearer <key>'"
            raise APIError(401, message, "invalid_api_key")

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "models": list(models)}

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(name) for name in models]}

    @app.get("/v1/models/{name:path}", dependencies=[Depends(authorize)])
    async def get_model(name: str) -> dict[str, Any]:
        _served(models, name)
        return _model_card(name)

    # ------------------------------------------------------------------ agents' caches
    # (as llama.cpp's /slots: list, free, and fork them; ``model`` picks the engine, default
    # the first served model)

    def engine_of(model: str | None) -> Engine:
        return _served(models, model or next(iter(models))).engine

    @app.get("/v1/agents", dependencies=[Depends(authorize)])
    async def list_agents(model: str | None = None, prefix: str = "", all: bool = False) -> dict[str, Any]:
        """Agents with a cache; ``?all=true`` also lists the product's own entries (a
        checkpointer's ``@snapshot:`` ids)."""
        engine = engine_of(model)
        records = [
            r
            for r in await asyncio.to_thread(engine.agent_records, prefix)
            if all or not is_internal(r.agent_id)
        ]
        name = model or next(iter(models))
        return {"object": "list", "data": [_agent_card(engine, name, r) for r in records]}

    @app.delete("/v1/agents/{agent_id}", dependencies=[Depends(authorize)])
    async def delete_agent(agent_id: str, model: str | None = None) -> dict[str, Any]:
        engine = engine_of(model)
        _valid_agent(agent_id)
        with _as_api_errors():
            gone = await asyncio.to_thread(engine.delete, agent_id)
        if not gone:
            raise APIError(404, f"agent {agent_id!r} has no cache here", "agent_not_found", "agent_id")
        return {"id": agent_id, "object": "agent.deleted", "deleted": True}

    @app.post("/v1/agents/{agent_id}/fork", dependencies=[Depends(authorize)])
    async def fork_agent(agent_id: str, request: Request, model: str | None = None) -> dict[str, Any]:
        """Body ``{"to": "new-agent"}``: the new agent's cache stands for what this one's does
        (blocks shared, no tensor copied); an existing ``to`` is refused unless ``"replace": true``."""
        engine = engine_of(model)
        try:
            body = json.loads(await request.body() or b"{}")
            target, replace = body["to"], bool(body.get("replace", False))
        except (ValueError, KeyError, TypeError) as exc:
            raise APIError(400, 'send a JSON body {"to": "<new agent id>"}', param="to") from exc
        _valid_agent(agent_id)
        _valid_agent(target, "to")
        source = await asyncio.to_thread(engine.agent_record, agent_id)
        if source is None:
            raise APIError(404, f"agent {agent_id!r} has no cache here", "agent_not_found", "agent_id")
        if not replace and await asyncio.to_thread(engine.has_agent, target):
            raise APIError(409, f'agent {target!r} exists: send "replace": true to overwrite it', param="to")
        with _as_api_errors():
            await asyncio.to_thread(engine.set_agent, target, source)
        card = _agent_card(engine, model or next(iter(models)), source)
        return {**card, "id": target, "forked_from": agent_id}

    @app.post("/v1/completions", dependencies=[Depends(authorize)], response_model=None)
    async def completions(
        request: Request, x_agent_id: str | None = Header(default=None)
    ) -> JSONResponse | EventSourceResponse:
        """Plain text continued, exactly (a leading space kept): base models, raw prompts."""
        body = _parse(CompletionRequest, await request.body())
        llm = _served(models, body.model)
        agent = _agent_of(body, x_agent_id)
        max_tokens = _within_limit(body.max_tokens or 16, config.max_tokens_limit)
        params = GenerationParams(
            max_tokens=max_tokens,
            temperature=llm.temperature if body.temperature is None else body.temperature,
            top_p=llm.top_p if body.top_p is None else body.top_p,
            top_k=llm.top_k if body.top_k is None else max(0, body.top_k),
            min_p=llm.min_p if body.min_p is None else body.min_p,
            seed=body.seed,
            stop=body.stops or [],
            exact_text=True,
            **{**llm.penalties(), **penalty_kwargs(body)},
        )
        engine, headers, cid = llm.engine, {"X-Agent-ID": agent}, replies.new_id("cmpl-")
        if not body.stream:
            with _as_api_errors():
                result = await engine.agenerate(agent, body.text, params)
            return JSONResponse(replies.text_completion(cid, body.model, result), headers=headers)
        chunks = aiter(engine.astream(agent, body.text, params))
        with _as_api_errors():
            first = await anext(chunks)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = _events(first, chunks, lambda c: replies.text_chunks(cid, body.model, c, include_usage), [])
        return EventSourceResponse(events, headers=headers, ping=15)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)], response_model=None)
    async def chat_completions(
        request: Request, x_agent_id: str | None = Header(default=None)
    ) -> JSONResponse | EventSourceResponse:
        body = _parse(ChatCompletionRequest, await request.body())
        llm = _served(models, body.model)
        agent = _agent_of(body, x_agent_id)
        asked = body.max_completion_tokens or body.max_tokens or config.default_max_tokens
        max_tokens = _within_limit(asked, config.max_tokens_limit)
        if body.tools and isinstance(body.tool_choice, NamedToolChoice):
            wanted = body.tool_choice.function["name"]
            if wanted not in {t.function.name for t in body.tools}:
                message = f"tool_choice names {wanted!r}, which is not in tools"
                raise APIError(400, message, param="tool_choice")
        with _as_api_errors():
            messages = to_messages(body.messages)
        kwargs = call_kwargs(body, agent, max_tokens)
        headers = {"X-Agent-ID": agent}
        cid = replies.new_id()
        if not body.stream:
            with _as_api_errors():
                message = await llm.ainvoke(messages, stop=body.stops, **kwargs)
            return JSONResponse(replies.completion(cid, body.model, message), headers=headers)

        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        writer = replies.ChunkWriter(cid, body.model, include_usage)
        if forced_tools(kwargs.get("tools") or [], kwargs.get("tool_choice")):
            # A forced call streams no text (the reply is the call, held to its end): it is
            # generated whole, so that one cut off by max_tokens is sent as the call as far
            # as it went (a stream's chunks would give it back as text).
            with _as_api_errors():
                message = await llm.ainvoke(messages, stop=body.stops, **kwargs)
            sent = _sent([writer.first(), *writer.whole(message)])
            return EventSourceResponse(sent, headers=headers, ping=15)
        chunks = aiter(llm.astream(messages, stop=body.stops, **kwargs))
        with _as_api_errors():  # errors before the first token still get a status code
            first = await anext(chunks)
        events = _events(first, chunks, writer.text, [writer.first()])
        return EventSourceResponse(events, headers=headers, ping=15)

    return app


async def _events(
    first: Any, chunks: AsyncIterator[Any], render: Callable[[Any], list[dict[str, Any]]], head: list[Any]
) -> AsyncIterator[dict[str, str]]:
    """A reply's SSE events: ``head``, then what ``render`` makes of each stream chunk, then
    ``[DONE]``; a failure after the status line was sent goes in the stream."""
    try:
        for out in head:
            yield {"data": json.dumps(out)}
        chunk = first
        while True:
            for out in render(chunk):
                yield {"data": json.dumps(out, ensure_ascii=False)}
            try:
                chunk = await anext(chunks)
            except StopAsyncIteration:
                break
            except Exception as exc:  # the status line is sent: the error goes in the stream
                logger.exception("generation failed mid-stream")
                error = {"message": f"generation failed: {exc}", "type": "server_error", "code": None}
                yield {"data": json.dumps({"error": error})}
                return
        yield {"data": "[DONE]"}
    finally:  # the client went away: closing the stream stops decoding
        await chunks.aclose()  # type: ignore[attr-defined]


async def _sent(chunks: list[dict[str, Any]]) -> AsyncIterator[dict[str, str]]:
    """A reply generated whole, as SSE events."""
    for out in chunks:
        yield {"data": json.dumps(out, ensure_ascii=False)}
    yield {"data": "[DONE]"}


@contextmanager
def _as_api_errors() -> Iterator[None]:
    """Turns a ``ValueError`` (what the request asks cannot be done) into a 400, and any
    other failure into a 500 with its message."""
    try:
        yield
    except ContextLengthError as exc:
        raise APIError(400, str(exc), "context_length_exceeded", "messages") from exc
    except ValueError as exc:
        raise APIError(400, str(exc)) from exc
    except APIError:
        raise
    except Exception as exc:
        # e.g. CacheWriteError (disk full), whose message says what to do. Answered here,
        # not by an app-wide handler: Starlette re-raises those, and uvicorn then drops
        # the client's keep-alive connection.
        logger.exception("request failed")
        raise APIError(500, f"generation failed: {exc}") from exc


def _parse(kind: type[R], raw: bytes) -> R:
    """A request body, parsed here rather than by FastAPI: a JSON body is read whatever its
    Content-Type (curl -d sends a form type) and errors keep OpenAI's shape."""
    try:
        return kind.model_validate_json(raw)
    except ValidationError as exc:
        message, param = _validation_message(exc.errors())
        raise APIError(400, message, param=param) from exc


def _within_limit(max_tokens: int, limit: int) -> int:
    if max_tokens > limit:
        raise APIError(
            400, f"max_tokens {max_tokens} is over this server's limit of {limit}", param="max_tokens"
        )
    return max_tokens


def _served(models: dict[str, ChatAgentMemory], name: str) -> ChatAgentMemory:
    llm = models.get(name)
    if llm is None:
        raise APIError(
            404, f"model {name!r} is not served here; served: {', '.join(models)}", "model_not_found", "model"
        )
    return llm


def _agent_of(body: SampledRequest, header: str | None) -> str:
    """The agent a request's cache belongs to: ``prompt_cache_key``, else the ``X-Agent-ID``
    header / ``agent_id`` field (which must agree), else ``user``, else the default. An
    explicit choice wins over ``user``: an app that always sends ``user`` would otherwise
    fold all of its agents into one cache."""
    if header and body.agent_id and header != body.agent_id:
        message = f"X-Agent-ID header {header!r} and body agent_id {body.agent_id!r} differ: send one"
        raise APIError(400, message, param="agent_id")
    chosen = [(f, v) for f, v in (("prompt_cache_key", body.prompt_cache_key),
              ("agent_id", header or body.agent_id), ("user", body.user)) if v]  # fmt: skip
    field, agent = chosen[0] if chosen else ("agent_id", DEFAULT_AGENT)
    try:
        return validate_agent_id(agent)
    except ValueError as exc:
        raise APIError(400, f"{field}: {exc}", param=field) from exc


def _valid_agent(agent_id: str, param: str = "agent_id") -> None:
    try:
        validate_agent_id(agent_id)
    except ValueError as exc:
        raise APIError(400, str(exc), param=param) from exc


def _agent_card(engine: Engine, model: str, record: AgentRecord) -> dict[str, Any]:
    """An agent's cache as ``GET /v1/agents`` lists it (bytes: its blocks on this server's
    disk; blocks shared with other agents count for each)."""
    info = engine.agent_info(record)
    assert info is not None
    return {
        "id": record.agent_id,
        "object": "agent",
        "model": model,
        "tokens": len(record.token_ids),
        "blocks": len(record.blocks),
        "bytes": info.local_bytes,
        "last_used_at": int(record.updated_at),
    }


def _model_card(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "agent-memory"}
