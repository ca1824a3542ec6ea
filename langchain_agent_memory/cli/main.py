"""The ``agent-memory`` command line: ``chat``, ``run``, ``serve``, ``models``, ``convert``,
and ``cache`` (``cli/cache.py``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from ..config import get_settings
from ..engine import parse_age, parse_size

if TYPE_CHECKING:
    from ..server import ServerConfig
    from .repl import ChatOptions

from .cache import cache_app
from .common import HELP, Blocks, CacheDir, Store, checked, kv_bits_of, size_text, wide_console
from .models import models

app = typer.Typer(no_args_is_help=True, context_settings=HELP, rich_markup_mode="markdown")


def _show_version(value: bool) -> None:
    if value:
        from .. import __version__

        typer.echo(f"agent-memory (langchain-agent-memory) {__version__}")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_show_version, is_eager=True, help="Print the version and exit"),
    ] = False,
) -> None:
    """Local LLM agents that remember: each agent keeps its KV cache (4-bit, on disk), so it
    resumes in milliseconds instead of re-reading its context.

    **Talk and serve**: `chat --agent A` (a terminal conversation that resumes warm), `run
    --agent A "question"` (one answer, stdin too: `cat notes.md | agent-memory run --agent
    notes "Summarise"`), `serve` (OpenAI's /v1/chat/completions, /v1/completions and
    /v1/responses, Anthropic's /v1/messages: Claude Code and the Codex CLI too; an agent per
    `prompt_cache_key`, `user` or X-Agent-ID; /v1/agents to list, fork, delete).

    **Models**: `models` lists the shipped ones (smollm2-135m, gemma3-270m), converted ones,
    those in the Hugging Face cache, and which mlx-lm families run; `models --check MODEL`
    checks one; `convert FILE.gguf` converts a GGUF; `--model` also takes an mlx-lm
    directory or a Hugging Face repo id (`mlx-community/...`).

    **Caches**: `cache ls | show | du` look (never change anything); `cache rm` deletes by
    id, --prefix or --thread; `cache prune --older-than 7d --max-size 5GB` evicts least
    recently used; `cache gc` cleans what a killed process left. `--store/--blocks` (or
    AGENT_MEMORY_STORE/BLOCKS) work on a store shared by several hosts.

    Settings come from AGENT_MEMORY_* variables (cache dir, model, disk budget: see the
    README). In Python: `ChatAgentMemory()` and `AgentMemorySaver()`.
    """


app.add_typer(cache_app, name="cache")


@app.command("convert")
def convert(
    gguf: Annotated[str, typer.Argument(help="A .gguf file, or a shipped model name")],
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="Output directory (default: where models load from)")
    ] = None,
    dtype: Annotated[
        str | None,
        typer.Option(help="Weight dtype: float32, bfloat16 or float16 (default: by device)"),
    ] = None,
    cache_dir: CacheDir = None,
) -> None:
    """Convert a GGUF model into an mlx-lm directory (what --model then loads at once)."""
    import time

    from ..engine import UnsupportedGGUFError, conversion_progress, convert_gguf, device, resolve_model_dir

    dtype = dtype or device.weight_dtype()
    if dtype not in ("float32", "bfloat16", "float16"):
        raise typer.BadParameter("give float32, bfloat16 or float16", param_hint="--dtype")
    t0 = time.perf_counter()
    try:
        if out is None:
            root = Path(cache_dir).expanduser() if cache_dir else None
            target, _ = resolve_model_dir(gguf, cache_dir=root, weight_dtype=dtype)
        elif out.exists():
            raise typer.BadParameter(f"{out} exists: remove it or give another --out", param_hint="--out")
        else:
            target = convert_gguf(gguf, out, dtype=dtype, progress=conversion_progress)
    except (UnsupportedGGUFError, ValueError, FileNotFoundError, ModuleNotFoundError) as exc:
        raise typer.BadParameter(str(exc), param_hint="GGUF") from exc
    size = sum(f.stat().st_size for f in target.iterdir() if f.is_file())
    wide_console().print(f"{target}  ({size_text(size)}, {time.perf_counter() - t0:.1f} s)")


def _chat_options(
    agent: str, model: str | None, system: str | None, max_tokens: int, temperature: float,
    repetition_penalty: float, kv_bits: int, cache_dir: Path | None,
) -> ChatOptions:  # fmt: skip
    """``chat`` / ``run``'s options, the agent id checked."""
    from ..engine import validate_agent_id
    from .repl import ChatOptions

    try:
        validate_agent_id(agent)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--agent") from exc
    return ChatOptions(
        agent=agent, model=model, system=system, max_tokens=max_tokens, temperature=temperature,
        repetition_penalty=None if repetition_penalty == 1.0 else repetition_penalty,
        kv_bits=kv_bits_of(kv_bits), cache_dir=str(cache_dir) if cache_dir else None,
    )  # fmt: skip


#: ``chat`` / ``run``'s defaults: the small shipped models loop under plain greedy decoding
#: until the cap (as Ollama does, a mild repetition penalty by default; 1.0 turns it off).
MAX_TOKENS, REPETITION_PENALTY = 128, 1.1
RepetitionPenalty = Annotated[
    float,
    typer.Option(min=1.0, help="Penalise repeating recent tokens (1.0: off); small models loop without"),
]
AgentName = Annotated[str, typer.Option("--agent", "-a", help="Whose conversation (and KV cache)")]
ModelName = Annotated[str | None, typer.Option("--model", "-m", help="Model (default the settings')")]
SystemPrompt = Annotated[str | None, typer.Option(help="System prompt (sent on every turn)")]
MaxTokens = Annotated[int, typer.Option(min=1, help="Most tokens in a reply")]
Temperature = Annotated[float, typer.Option(min=0.0, help="0: greedy")]
KvBits = Annotated[int, typer.Option(help="KV cache bits: 4, 8, or 16 (unquantized)")]


@app.command("chat")
def chat(
    agent: AgentName = "chat",
    model: ModelName = None,
    system: SystemPrompt = None,
    max_tokens: MaxTokens = MAX_TOKENS,
    temperature: Temperature = 0.0,
    repetition_penalty: RepetitionPenalty = REPETITION_PENALTY,
    kv_bits: KvBits = 4,
    cache_dir: CacheDir = None,
) -> None:
    """Talk with one agent in the terminal; quit and come back later: it resumes warm."""
    from .repl import run

    options = _chat_options(
        agent, model, system, max_tokens, temperature, repetition_penalty, kv_bits, cache_dir
    )
    run(options, wide_console())


@app.command("run")
def run_once(
    question: Annotated[
        str | None, typer.Argument(help="What to ask (stdin, when piped, comes first)")
    ] = None,
    agent: AgentName = "chat",
    model: ModelName = None,
    system: SystemPrompt = None,
    max_tokens: MaxTokens = MAX_TOKENS,
    temperature: Temperature = 0.0,
    repetition_penalty: RepetitionPenalty = REPETITION_PENALTY,
    kv_bits: KvBits = 4,
    cache_dir: CacheDir = None,
) -> None:
    """Ask one agent one question and stream the answer: `cat notes.md | agent-memory run
    --agent notes "Summarise"`. The turn joins the agent's conversation (the same as `chat
    --agent`): the next run resumes it from its cache. How the cache served it (hot, warm or
    cold) goes to stderr."""
    from .repl import ChatSession, describe

    options = _chat_options(
        agent, model, system, max_tokens, temperature, repetition_penalty, kv_bits, cache_dir
    )
    piped = "" if sys.stdin is None or sys.stdin.isatty() else sys.stdin.read()
    text = "\n\n".join(part.strip() for part in (piped, question or "") if part and part.strip())
    if not text:
        raise typer.BadParameter(
            "ask something: a QUESTION argument, or text on stdin", param_hint="QUESTION"
        )
    session = ChatSession(options)
    reply = session.ask(text, lambda t: (sys.stdout.write(t), sys.stdout.flush()))
    sys.stdout.write("\n")
    typer.echo(describe(reply, agent), err=True)


@app.command("serve")
def serve(
    model: Annotated[
        list[str] | None,
        typer.Option("--model", "-m", help="Model to serve (repeat for several); default the settings'"),
    ] = None,
    host: Annotated[str, typer.Option(help="Interface to bind (0.0.0.0: all; set --api-key)")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port")] = 8000,
    api_key: Annotated[
        list[str] | None,
        typer.Option(
            envvar="AGENT_MEMORY_API_KEY",
            help="Bearer token every /v1 request must carry; KEY:PREFIX (repeatable) limits a key "
            "to agents whose ids start with PREFIX (one tenant's); a key holds no ':'",
        ),
    ] = None,
    docs: Annotated[bool, typer.Option(help="Serve /docs and /openapi.json (behind the key, if set)")] = True,
    lazy_store: Annotated[
        bool,
        typer.Option(
            help="Start even if the shared store is out of reach (serve from the local tier meanwhile)"
        ),
    ] = False,
    metrics_public: Annotated[
        bool, typer.Option(help="Serve /metrics (Prometheus) without the API key, for a scraper")
    ] = False,
    context_scale: Annotated[
        float,
        typer.Option(
            min=0.001,
            help="Multiply the prompt token counts told to clients: a harness that assumes a bigger "
            "context (Claude Code: 200K) compacts when the model's is full (200K / 8K: 25)",
        ),
    ] = 1.0,
    kv_bits: KvBits = 4,
    kv_format: Annotated[
        str | None, typer.Option(help="A KV format preset instead of --kv-bits (e.g. k6v4-rot-h4, q8, fp16)")
    ] = None,
    served_model_name: Annotated[
        list[str] | None,
        typer.Option(help="The name clients use for each --model (repeat, in the same order)"),
    ] = None,
    model_alias: Annotated[
        list[str] | None,
        typer.Option(
            help="Another name that reaches a served model, PATTERN=NAME (e.g. 'claude-*=smollm2-135m' "
            "for Claude Code's models); repeat"
        ),
    ] = None,
    allowed_origins: Annotated[
        list[str] | None, typer.Option(help="Origins browsers may call from (CORS; '*': any); repeat")
    ] = None,
    temperature: Annotated[float, typer.Option(min=0.0, help="Default temperature (0: greedy)")] = 0.0,
    top_p: Annotated[float, typer.Option(min=0.0, max=1.0, help="Default top-p")] = 1.0,
    top_k: Annotated[int, typer.Option(min=0, help="Default top-k (0: off)")] = 0,
    min_p: Annotated[float, typer.Option(min=0.0, max=1.0, help="Default min-p (0: off)")] = 0.0,
    max_body_mb: Annotated[float, typer.Option(help="Largest request body, in MB")] = 4.0,
    max_tokens_limit: Annotated[int, typer.Option(help="Largest max_tokens a request may ask")] = 4096,
    hot_budget_mb: Annotated[int, typer.Option(help="Memory for in-memory KV blocks, in MB")] = 512,
    context_length: Annotated[
        int | None,
        typer.Option(min=2, help="Most tokens (prompt and reply) per agent (default: the model's)"),
    ] = None,
    max_disk_bytes: Annotated[
        str | None,
        typer.Option(
            envvar="AGENT_MEMORY_MAX_DISK_BYTES",
            help="Disk budget of the stored caches (e.g. 5GB): least recently used agents are evicted",
        ),
    ] = None,
    cache_ttl: Annotated[
        str | None,
        typer.Option(
            envvar="AGENT_MEMORY_CACHE_TTL", help="Evict caches unused for this long (e.g. 7d, 12h)"
        ),
    ] = None,
    log_level: Annotated[
        str, typer.Option(help="Log level of uvicorn and the server (debug names the fields it ignored)")
    ] = "info",
    cache_dir: CacheDir = None,
    store: Store = None,
    blocks: Blocks = None,
) -> None:
    """Serve OpenAI's Chat Completions, Completions and Responses APIs and Anthropic's Messages
    API (Claude Code, the Codex CLI, the SDKs); each agent keeps its KV cache."""
    if bool(store) != bool(blocks):
        raise typer.BadParameter("give both --store (postgresql://...) and --blocks (s3://...), or neither")
    try:
        import uvicorn

        from ..server import ServerConfig, create_app
        from ..server.agent_routes import parse_scoped_key
        from ..server.served_models import parse_alias
    except ImportError as exc:
        raise typer.BadParameter(str(exc), param_hint="serve") from exc

    keys = [k for k in api_key or [] if ":" not in k]
    if len(keys) > 1:
        raise typer.BadParameter(
            "one --api-key may see every agent; give the others a :PREFIX", param_hint="--api-key"
        )
    try:
        scoped = dict(parse_scoped_key(k) for k in api_key or [] if ":" in k)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--api-key") from exc
    try:
        aliases = dict(parse_alias(a) for a in model_alias or [])
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--model-alias") from exc
    if served_model_name and len(served_model_name) != len(model or [None]):
        raise typer.BadParameter("give one --served-model-name per --model", param_hint="--served-model-name")
    config = ServerConfig(
        models=model or [get_settings().model],
        cache_dir=str(cache_dir) if cache_dir else None,
        kv_bits=kv_bits_of(kv_bits),  # type: ignore[arg-type]
        kv_format=kv_format,
        served_names=served_model_name or None,
        model_aliases=aliases,
        allowed_origins=allowed_origins or [],
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        api_key=keys[0] if keys else None,
        scoped_keys=scoped,
        docs=docs,
        max_body_bytes=int(max_body_mb * (1 << 20)),
        max_tokens_limit=max_tokens_limit,
        hot_budget_mb=hot_budget_mb,
        context_length=context_length,
        max_disk_bytes=checked(parse_size, max_disk_bytes, "--max-disk-bytes"),
        cache_ttl=checked(parse_age, cache_ttl, "--cache-ttl"),
        store=store,
        blocks=blocks,
        lazy_store=lazy_store or None,  # unset: the settings' (AGENT_MEMORY_LAZY_STORE)
        metrics_public=metrics_public,
        context_scale=context_scale,
    )
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        wide_console().print(
            f"[yellow]warning:[/yellow] serving on {host} without --api-key: anyone can use it"
        )
    wide_console().print(startup_summary(config, host, port), highlight=False)
    try:
        served_app = create_app(config)
    except ValueError as exc:  # an alias to a model not served
        raise typer.BadParameter(str(exc), param_hint="--model-alias") from exc
    _log_to_stderr(log_level)
    uvicorn.run(served_app, host=host, port=port, log_level=log_level)


def _log_to_stderr(level: str) -> None:
    """The server's own log lines (a clamped ``max_tokens``, tools left out, fields ignored)
    on stderr beside uvicorn's, at its level: this package's loggers only."""
    import logging

    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)-9s %(message)s"))
    root = logging.getLogger("langchain_agent_memory")
    root.addHandler(handler)
    root.setLevel(level.upper())


def startup_summary(config: ServerConfig, host: str, port: int) -> str:
    """What ``serve`` serves, said before uvicorn's own lines: models, KV format, where the
    caches live, the store, whether keys are required, where the API docs are."""
    base = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    names = config.served_names or config.models
    models = ", ".join(n if n == m else f"{n} ({m})" for n, m in zip(names, config.models, strict=True))
    kv = config.kv_format or ("16-bit" if config.kv_bits is None else f"{config.kv_bits}-bit class")
    keys = "required" if config.api_key or config.scoped_keys else "off (anyone who can connect may call)"
    store = f"{config.store} + {config.blocks}" if config.store else "the cache directory"
    if config.model_aliases:
        models += "; also as " + ", ".join(f"{p} -> {n}" for p, n in config.model_aliases.items())
    keyed = config.api_key or config.scoped_keys
    metrics = "behind the key" if keyed and not config.metrics_public else "no key"
    lines = [
        f"agent-memory serve: {models}",
        f"  KV format:  {kv}",
        f"  caches:     {config.cache_dir or get_settings().cache_dir}",
        f"  store:      {store}",
        f"  API keys:   {keys}",
        f"  endpoints:  {base}/v1/chat/completions, {base}/v1/completions, {base}/v1/messages, "
        f"{base}/v1/responses, {base}/v1/agents, {base}/dashboard",
        f"  metrics:    {base}/metrics ({metrics})",
        f"  API docs:   {base + '/docs' if config.docs else 'off (--no-docs)'}",
    ]
    if config.context_scale != 1.0:
        lines.insert(6, f"  context:    prompt token counts told x{config.context_scale:g} (--context-scale)")
    return "\n".join(lines)


app.command("models")(models)


def main() -> None:
    """The ``agent-memory`` command. A user's mistake (a ``ValueError`` that names the bad
    value and the fix: an unknown model, an empty model directory; a missing file) is one
    line on stderr and exit status 2, not a traceback; anything else is a bug and keeps its
    traceback."""
    try:
        app()
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)  # without LangGraph's notes on where it ran
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
