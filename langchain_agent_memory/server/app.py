"""The OpenAI-compatible HTTP server (``agent-memory serve``).

Routes: ``POST /v1/chat/completions`` (JSON, or SSE with ``"stream": true``),
``POST /v1/completions``, Anthropic's ``POST /v1/messages`` (``anthropic_routes``), OpenAI's
Responses (``/v1/responses``: ``responses_routes``),
``GET /v1/models``, ``/v1/agents`` (``agent_routes``), ``GET /metrics`` (``metrics``),
``GET /dashboard`` (``dashboard``),
``GET /health``, ``GET /ready``, and ``GET /``: where to go from there.
Each request runs on ``ChatAgentMemory`` under the agent named by the ``X-Agent-ID`` header
or the body's ``agent_id`` (``default`` when neither is given), so one server keeps every
client agent's KV cache, across restarts.

Errors come in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}`` (under
``/v1/messages``, Anthropic's): 400 for a malformed or unsupported request, 401 without the
key (when one is set), 404 for an unknown model, 413 for a body over the limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from fastapi import Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException

from ..chat.model import ChatAgentMemory
from ..chat.replies import forced_tools
from ..engine import DEFAULT_MODEL, GenerationParams, StreamChunk
from . import replies, streams
from .agent_routes import Caller, add_agent_routes, agent_header, agent_of, authorizer, served
from .anthropic_routes import add_messages_routes
from .context_scale import scaled, scaled_chunks
from .dashboard import add_dashboard_routes, keep_disk_history
from .errors import (
    APIError,
    BodyLimit,
    as_api_errors,
    error_response,
    parse_body,
    validation_message,
    within_limit,
)
from .metrics import EngineCollector, ReplyMetrics, RequestCounter
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    NamedToolChoice,
    SampledRequest,
    call_kwargs,
    penalty_kwargs,
    to_messages,
)
from .responses_routes import add_responses_routes
from .served_models import ServedModels, check_aliases, codex_catalog
from .streams import first_chunk, relay, sent

logger = logging.getLogger(__name__)
R = TypeVar("R", bound=SampledRequest)


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
    #: Start with the shared store out of reach (serve from the cache directory, upload once
    #: it answers) instead of failing (``--lazy-store``; None: ``AGENT_MEMORY_LAZY_STORE``).
    lazy_store: bool | None = None
    #: Bearer token every ``/v1`` request must carry (None: no auth; bind to loopback then).
    #: With a key, ``/docs`` and ``/openapi.json`` want it too.
    api_key: str | None = None
    #: Keys limited to agents whose ids start with a prefix (key -> prefix: ``agent_routes``).
    scoped_keys: dict[str, str] = field(default_factory=dict)
    #: Whether ``/docs`` and ``/openapi.json`` are served at all.
    docs: bool = True
    max_body_bytes: int = 4 << 20
    #: Largest ``max_tokens`` a request may ask for, and what it gets when it asks nothing.
    max_tokens_limit: int = 4096
    default_max_tokens: int = 512
    #: The names clients use for the models (``--served-model-name``), one per model; None:
    #: the models' own names.
    served_names: list[str] | None = None
    #: Other names that reach a served model: shell-style pattern -> served name
    #: (``--model-alias 'claude-*=smollm2-135m'``; ``served_models``).
    model_aliases: dict[str, str] = field(default_factory=dict)
    #: Origins a browser may call from (CORS; ``["*"]``: any); empty: no CORS headers.
    allowed_origins: list[str] = field(default_factory=list)
    #: ``GET /metrics`` without the API key (a Prometheus scraper on a private network).
    metrics_public: bool = False
    #: Prompt token counts told to clients times this (``context_scale``): a harness that
    #: assumes a bigger context than the model's compacts in time (e.g. 200K / 8K = 25).
    context_scale: float = 1.0
    #: Sampling a request gets for what it leaves out (``--temperature`` ... on the CLI).
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0


def create_app(config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()
    if not config.context_scale > 0:
        raise ValueError(f"context_scale must be above 0, not {config.context_scale}")
    scale = config.context_scale
    check_aliases(config.model_aliases, config.served_names or config.models)
    models = ServedModels(config.model_aliases)
    registry = CollectorRegistry()  # the app's own: two apps in one process keep apart
    reply_metrics = ReplyMetrics(registry)
    registry.register(EngineCollector(lambda: {name: llm.engine for name, llm in models.items()}))

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
                lazy_store=config.lazy_store,
                max_disk_bytes=config.max_disk_bytes,
                cache_ttl=config.cache_ttl,
                callbacks=[reply_metrics.handler(name)],
            )
            engine = await asyncio.to_thread(lambda llm=llm: llm.engine)  # load before serving
            if config.context_length is not None:
                engine.context_length = config.context_length
            logger.info("serving %s (KV cache %s)", name, engine.fingerprint)
            models[name] = llm
        sampler = asyncio.create_task(keep_disk_history(models, reply_metrics.history))
        yield
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
        # Saves run after the replies left: all of them written before the process ends
        # (SIGTERM re-raised by uvicorn ends it without the interpreter's exit hooks).
        for llm in models.values():
            try:
                await asyncio.to_thread(llm.engine.flush)
            except Exception:  # logged when it failed; the previous cache is intact
                logger.warning("a save of model %s failed before shutdown", llm.model)
        close_responses()

    # With an API key the API's description wants it too (it names every route); docs=False
    # serves none.
    open_docs = config.docs and config.api_key is None and not config.scoped_keys
    app = FastAPI(
        title="langchain-agent-memory",
        lifespan=lifespan,
        docs_url="/docs" if open_docs else None,
        openapi_url="/openapi.json" if open_docs else None,
        redoc_url=None,
    )
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    app.add_middleware(RequestCounter, registry=registry)  # outermost: refused bodies counted too
    if config.allowed_origins:  # browsers calling from a web app
        app.add_middleware(
            CORSMiddleware,
            allow_origins=config.allowed_origins,
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=["X-Agent-ID"],
        )

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.code, exc.param, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(exc.errors()))
        return error_response(400, message, param=param, path=request.url.path)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), path=request.url.path)

    authorize = authorizer(config.api_key, dict(config.scoped_keys))

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def front_door() -> dict[str, Any]:
        """Where to go from here (no key; HEAD too, as Claude Code probes its base URL)."""
        return {
            "name": "agent-memory serve",
            "models": list(models),
            "dashboard": "/dashboard",
            "api_docs": "/docs" if config.docs else None,
            "endpoints": [*_ENDPOINTS, "/metrics", "/health", "/ready"],
            "guide": "docs/guides/server.md (in the repository)",
        }

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "models": list(models)}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        """Readiness (for a load balancer; no key): 503 while a shared store is out of reach
        (this server then serves from its own copies), with the saves waiting to upload."""
        out, ok = {}, True
        for name, llm in models.items():
            status = llm.engine.status()  # never waits on the saves queued
            out[name] = {"shared_store": status.shared, "reachable": status.reachable,
                         "pending_saves": status.pending_saves, "pending_bytes": status.pending_bytes,
                         "queued_saves": status.queued_saves}  # fmt: skip
            ok = ok and status.reachable
        body = {"status": "ready" if ok else "store unreachable", "models": out}
        return JSONResponse(body, status_code=200 if ok and models else 503)

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def list_models() -> dict[str, Any]:
        """OpenAI's list (``data``) and, beside it, the metadata the Codex CLI reads (``models``:
        ``served_models.codex_catalog``)."""
        cards = [_model_card(name) for name in models]
        return {"object": "list", "data": cards, "models": codex_catalog(models, scale)}

    @app.get("/v1/models/{name:path}", dependencies=[Depends(authorize)])
    async def get_model(name: str) -> dict[str, Any]:
        served(models, name)
        return _model_card(name)

    metrics_auth = [] if config.metrics_public else [Depends(authorize)]

    @app.get("/metrics", dependencies=metrics_auth, include_in_schema=False)
    async def metrics() -> Response:
        """Prometheus' text format (``metrics``)."""
        body = await asyncio.to_thread(generate_latest, registry)  # reads the stores
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    add_agent_routes(app, models, authorize)
    add_dashboard_routes(app, models, authorize, reply_metrics)
    add_messages_routes(app, models, authorize, config.max_tokens_limit, scale)
    close_responses = add_responses_routes(
        app, models, authorize, (config.default_max_tokens, config.max_tokens_limit), scale
    )
    if config.docs and not open_docs:

        @app.get("/openapi.json", include_in_schema=False, dependencies=[Depends(authorize)])
        async def openapi() -> dict[str, Any]:
            return app.openapi()

        @app.get("/docs", include_in_schema=False, dependencies=[Depends(authorize)])
        async def docs() -> HTMLResponse:
            return get_swagger_ui_html(openapi_url="/openapi.json", title=app.title)

    @app.post("/v1/completions", response_model=None)
    async def completions(
        request: Request,
        x_agent_id: str | None = Header(default=None),
        caller: Caller = Depends(authorize),  # noqa: B008 - FastAPI's dependency
    ) -> JSONResponse | EventSourceResponse:
        """Plain text continued, exactly (a leading space kept): base models, raw prompts."""
        body = parse_body(CompletionRequest, await request.body())
        llm = served(models, body.model)
        agent = agent_of(body, x_agent_id, caller)
        headers = {"X-Agent-ID": agent_header(agent)}
        max_tokens = within_limit(body.max_tokens or 16, config.max_tokens_limit, headers)
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
            wait_for_save=body.wait_for_save,
        )
        engine, cid = llm.engine, replies.new_id("cmpl-")
        if not body.stream:
            with as_api_errors():
                result = await engine.agenerate(agent, body.text, params)
            reply_metrics.result(body.model, result, agent)
            return JSONResponse(replies.text_completion(cid, body.model, result), headers=headers)
        chunks = aiter(engine.astream(agent, body.text, params))
        first = await first_chunk(chunks)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def render(chunk: StreamChunk) -> list[dict[str, Any]]:
            if chunk.result is not None:
                reply_metrics.result(body.model, chunk.result, agent)
            return replies.text_chunks(cid, body.model, chunk, include_usage)

        events = _stream(first, chunks, render, [])
        return EventSourceResponse(events, headers=headers, ping=streams.KEEPALIVE_S)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(
        request: Request,
        x_agent_id: str | None = Header(default=None),
        caller: Caller = Depends(authorize),  # noqa: B008 - FastAPI's dependency
    ) -> JSONResponse | EventSourceResponse:
        body = parse_body(ChatCompletionRequest, await request.body())
        llm = served(models, body.model)
        agent = agent_of(body, x_agent_id, caller)
        asked = body.max_completion_tokens or body.max_tokens or config.default_max_tokens
        headers = {"X-Agent-ID": agent_header(agent)}
        max_tokens = within_limit(asked, config.max_tokens_limit, headers)
        if body.tools and isinstance(body.tool_choice, NamedToolChoice):
            wanted = body.tool_choice.function["name"]
            if wanted not in {t.function.name for t in body.tools}:
                message = f"tool_choice names {wanted!r}, which is not in tools"
                raise APIError(400, message, param="tool_choice")
        with as_api_errors():
            messages = to_messages(body.messages)
        kwargs = call_kwargs(body, agent, max_tokens)
        cid = replies.new_id()
        if not body.stream:
            with as_api_errors():
                message = scaled(await llm.ainvoke(messages, stop=body.stops, **kwargs), scale)
            return JSONResponse(replies.completion(cid, body.model, message), headers=headers)

        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        writer = replies.ChunkWriter(cid, body.model, include_usage)
        if forced_tools(kwargs.get("tools") or [], kwargs.get("tool_choice")):
            # A forced call streams no text (the reply is the call, held to its end): it is
            # generated whole, so that one cut off by max_tokens is sent as the call as far
            # as it went (a stream's chunks would give it back as text).
            with as_api_errors():
                message = scaled(await llm.ainvoke(messages, stop=body.stops, **kwargs), scale)
            whole = [*map(_data, [writer.first(), *writer.whole(message)]), {"data": "[DONE]"}]
            return EventSourceResponse(sent(whole), headers=headers, ping=streams.KEEPALIVE_S)
        chunks = aiter(scaled_chunks(llm.astream(messages, stop=body.stops, **kwargs), scale))
        first = await first_chunk(chunks)  # errors before it still get a status code (``streams``)
        events = _stream(first, chunks, writer.text, [writer.first()])
        return EventSourceResponse(events, headers=headers, ping=streams.KEEPALIVE_S)

    return app


def _data(out: dict[str, Any]) -> dict[str, str]:
    return {"data": json.dumps(out, ensure_ascii=False)}


def _stream(
    first: Any, chunks: AsyncIterator[Any], render: Callable[[Any], list[dict[str, Any]]], head: list[Any]
) -> AsyncIterator[dict[str, str]]:
    """A reply's SSE events (``streams.relay``): ``head``, what ``render`` makes of each
    chunk, then ``[DONE]``; a failure after the status line was sent goes in the stream."""

    def failed(exc: Exception) -> list[dict[str, str]]:
        return [
            _data({"error": {"message": f"generation failed: {exc}", "type": "server_error", "code": None}})
        ]

    async def done() -> list[dict[str, str]]:
        return [{"data": "[DONE]"}]

    head = [_data(out) for out in head]
    return relay(first, chunks, lambda c: [_data(out) for out in render(c)], failed, head=head, tail=done)


_ENDPOINTS = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/models",
    "/v1/agents",
]


def _model_card(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "agent-memory"}
