"""The ``agent-memory`` command line.

    agent-memory cache ls [--prefix P]      agents with a stored cache, per model/KV format
    agent-memory cache show AGENT           one agent's cache: tokens, blocks, text
    agent-memory cache rm AGENT...          delete agents' caches (shared blocks stay)
    agent-memory cache gc                   remove temporary files and unreferenced blocks
    agent-memory cache du                   disk use per model/KV format
    agent-memory cache prune --older-than 7d --max-size 5GB   evict least recently used

Every command reads the cache directory (``--cache-dir``, default the settings') without
loading a model: a cache directory holds one store per model fingerprint (``kv/<fp>/``),
and each command goes over all of them. Saves and deletes take the store's directory lock,
so this is safe while an application is using the same directory.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.table import Table

from ..config import get_settings
from ..engine.storage.budget import StorageBudget, enforce, parse_age, parse_size
from ..engine.storage.catalog import Catalog
from ..engine.storage.remote import SharedBlockStore, open_store
from ..engine.storage.store import DiskBlockStore

if TYPE_CHECKING:
    from .repl import ChatOptions

T = TypeVar("T")

_HELP = {"help_option_names": ["-h", "--help"]}
app = typer.Typer(no_args_is_help=True, context_settings=_HELP, rich_markup_mode="markdown")
cache_app = typer.Typer(
    help="Inspect and manage stored agent caches: ls, show, du, rm, prune, gc.",
    no_args_is_help=True,
    context_settings=_HELP,
)
app.add_typer(cache_app, name="cache")


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
    notes "Summarise"`), `serve` (OpenAI-compatible /v1/chat/completions and /v1/completions,
    an agent per `prompt_cache_key`, `user` or X-Agent-ID; /v1/agents to list, fork, delete).

    **Models**: `models` lists the shipped ones (smollm2-135m, gemma3-270m) and converted
    ones; `convert FILE.gguf` converts a GGUF; `--model` also takes an mlx-lm directory.

    **Caches**: `cache ls | show | du` look (never change anything); `cache rm` deletes by
    id, --prefix or --thread; `cache prune --older-than 7d --max-size 5GB` evicts least
    recently used; `cache gc` cleans what a killed process left. `--store/--blocks` (or
    AGENT_MEMORY_STORE/BLOCKS) work on a store shared by several hosts.

    Settings come from AGENT_MEMORY_* variables (cache dir, model, disk budget: see the
    README). In Python: `ChatAgentMemory()` and `AgentMemorySaver()`.
    """


CacheDir = Annotated[
    Path | None,
    typer.Option("--cache-dir", help="Cache directory (default: AGENT_MEMORY_CACHE_DIR or ~/.cache/...)"),
]


def _console() -> Console:
    return Console(width=max(Console().width, 120))


Store = Annotated[
    str | None,
    typer.Option(envvar="AGENT_MEMORY_STORE", help="A shared store's PostgreSQL URL (with --blocks)"),
]
Blocks = Annotated[
    str | None,
    typer.Option(envvar="AGENT_MEMORY_BLOCKS", help="A shared store's s3:// URL for blocks (with --store)"),
]


def _stores(
    cache_dir: Path | None, store: str | None = None, blocks: str | None = None, *, read_only: bool = False
) -> Iterator[DiskBlockStore | SharedBlockStore]:
    """One store per model fingerprint, opened in turn (``_all_stores``)."""
    with _all_stores(cache_dir, store, blocks, read_only=read_only) as stores:
        yield from stores


@contextmanager
def _all_stores(
    cache_dir: Path | None, store: str | None = None, blocks: str | None = None, *, read_only: bool = False
) -> Iterator[list[DiskBlockStore | SharedBlockStore]]:
    """One store per model fingerprint: the directories under ``{cache_dir}/kv``, or with a
    shared store (``--store`` / ``--blocks``), every model it holds (this directory its
    local tier). ``read_only``: for commands that only look: a local directory is opened
    without recovery, lock or migration (a shared store is read through a local tier of
    this directory, which it may fill)."""
    if bool(store) != bool(blocks):
        raise typer.BadParameter(
            "a shared store needs both --store (postgresql://...) and --blocks (s3://...)"
        )
    root = Path(cache_dir or get_settings().cache_dir).expanduser() / "kv"
    fingerprints = {p.name for p in root.glob("*") if (p / "format.json").exists()}
    if store and blocks:
        catalog = Catalog(store)
        fingerprints |= catalog.fingerprints()
        catalog.close()
    opened: list[DiskBlockStore | SharedBlockStore] = []
    try:
        for fp in sorted(fingerprints):
            opened.append(open_store(root, fp, store, blocks, read_only=read_only and not store))
        yield opened
    finally:
        for one in opened:
            one.close()


def _checked(parse: Callable[[str], T], value: str | None, flag: str) -> T | None:
    """``value`` parsed, or a usage error naming ``flag``."""
    try:
        return None if value is None else parse(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint=flag) from None


def _kv_bits(kv_bits: int) -> int | None:
    """``--kv-bits``: 4 or 8, or 16 for unquantized (None)."""
    if kv_bits not in (4, 8, 16):
        raise typer.BadParameter("give 4, 8 or 16", param_hint="--kv-bits")
    return None if kv_bits == 16 else kv_bits


Format = Annotated[
    str, typer.Option("--format", help="table (plain text when not a terminal), text, or json")
]


def _emit(title: str, rows: list[dict[str, Any]], columns: list[str], fmt: str, right: set[str]) -> None:
    """A listing: a table on a terminal, tab-separated lines elsewhere (pipes, files), or
    ``--format json`` (every field, machine-readable)."""
    if fmt == "json":
        typer.echo(json.dumps(rows, indent=2, default=str))
        return
    if fmt not in ("table", "text"):
        raise typer.BadParameter("give table, text or json", param_hint="--format")
    if fmt == "text" or not sys.stdout.isatty():
        typer.echo("\t".join(columns))
        for r in rows:
            typer.echo("\t".join(str(r[c]) for c in columns))
        return
    table = Table(title=title)
    for col in columns:
        table.add_column(col, justify="right" if col in right else "left")
    for r in rows:
        table.add_row(*(str(r[c]) for c in columns))
    _console().print(table)


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


@cache_app.command("ls")
def ls(
    prefix: Annotated[str, typer.Option(help="Only agents whose id starts with this")] = "",
    cache_dir: CacheDir = None,
    store: Store = None,
    blocks: Blocks = None,
    format: Format = "table",
) -> None:
    """List agents with a stored cache (never changes the store)."""
    rows = [
        {
            "model": opened.fingerprint,
            "agent": record.agent_id,
            "tokens": len(record.token_ids),
            "blocks": len(record.blocks),
            "updated": datetime.fromtimestamp(record.updated_at).strftime("%Y-%m-%d %H:%M:%S"),
        }
        for opened in _stores(cache_dir, store, blocks, read_only=True)
        for record in opened.agents(prefix)
    ]
    _emit(
        "agent caches", rows, ["model", "agent", "tokens", "blocks", "updated"], format, {"tokens", "blocks"}
    )


@cache_app.command("show")
def show(
    agent: str, cache_dir: CacheDir = None, chars: int = 400, store: Store = None, blocks: Blocks = None
) -> None:
    """Show one agent's cache: tokens, blocks, and the start and end of its text."""
    found = False
    for opened in _stores(cache_dir, store, blocks, read_only=True):
        record = opened.get_agent(agent)
        if record is None:
            continue
        found = True
        console = _console()
        console.print(f"[bold]{agent}[/bold] in {opened.fingerprint}")
        console.print(f"tokens: {len(record.token_ids)}, blocks: {len(record.blocks)}")
        for h in record.blocks:
            path = opened.block_path(h)
            here = _size(path.stat().st_size) if path.exists() else None
            size = here or ("in the shared store" if isinstance(opened, SharedBlockStore) else "MISSING")
            console.print(f"  {h[:16]}  {size}")
        text = record.text
        shown = text if len(text) <= 2 * chars else text[:chars] + "\n[...]\n" + text[-chars:]
        console.print(shown, markup=False, highlight=False)
    if not found:
        raise typer.BadParameter(f"no stored cache for agent {agent!r}", param_hint="AGENT")


@cache_app.command("rm")
def rm(
    agents: Annotated[list[str] | None, typer.Argument(help="Agent ids to delete")] = None,
    prefix: Annotated[str | None, typer.Option(help="Every agent whose id starts with this")] = None,
    thread: Annotated[
        str | None, typer.Option(help="Every agent of a LangGraph thread (ids 'THREAD:node...')")
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Say what would be deleted; delete nothing")
    ] = False,
    yes: Annotated[
        bool, typer.Option("--yes", "-y", help="Delete a --prefix/--thread selection without asking")
    ] = False,
    cache_dir: CacheDir = None,
    store: Store = None,
    blocks: Blocks = None,
) -> None:
    """Delete agents' caches, by id, --prefix or --thread; blocks other agents share stay."""
    from ..engine.storage.pool import BlockPool

    if not agents and prefix is None and thread is None:
        raise typer.BadParameter("name agents, or select them with --prefix or --thread")
    selector = f"{thread}:" if thread is not None else prefix
    deleted = 0
    for opened in _stores(cache_dir, store, blocks):
        chosen = list(agents or [])
        if selector is not None:
            chosen += [r.agent_id for r in opened.agents(selector)]
        chosen = list(dict.fromkeys(chosen))
        if dry_run:
            for agent in chosen:
                typer.echo(f"would delete {agent} ({opened.fingerprint})")
            continue
        if (
            selector is not None
            and chosen
            and not yes
            and not typer.confirm(f"delete {len(chosen)} agent cache(s)?")
        ):
            raise typer.Exit(code=1)
        pool = BlockPool(opened, hot_budget_bytes=0)
        deleted += sum(pool.delete_agent(agent) for agent in chosen)
    if dry_run:
        return
    typer.echo(f"deleted {deleted} agent cache(s)")
    if not deleted:
        raise typer.Exit(code=1)


@cache_app.command("gc")
def gc(
    cache_dir: CacheDir = None,
    store: Store = None,
    blocks: Blocks = None,
    grace_hours: Annotated[
        float, typer.Option(help="Shared store: delete block objects unreferenced for at least this long")
    ] = 1.0,
) -> None:
    """Remove temporary files and blocks no agent names (what a killed process left); with a
    shared store, also its block objects no record names (after the grace period)."""
    temps = orphans = collected = 0
    for opened in _stores(cache_dir, store, blocks):  # opening recovers; run it again for what came since
        report = opened.recover()
        temps += opened.recovery.temp_files_removed + report.temp_files_removed
        orphans += opened.recovery.orphan_blocks_removed + report.orphan_blocks_removed
        if isinstance(opened, SharedBlockStore):
            done = opened.collect_garbage(grace_s=grace_hours * 3600)
            collected += done.blocks_collected + done.stray_objects_removed
    shared = f" and {collected} block object(s) from the shared store" if store else ""
    _console().print(f"removed {temps} temporary file(s) and {orphans} unreferenced block(s){shared}")


@cache_app.command("du")
def du(cache_dir: CacheDir = None, format: Format = "table") -> None:
    """Disk use per model / KV format, as a disk budget counts it: the blocks agents name,
    the index and quarantined files (never changes the store)."""
    rows = []
    for store in _stores(cache_dir, read_only=True):
        usage = store.usage()
        quarantine = store.dir / "quarantine"
        bad = len(list(quarantine.iterdir())) if quarantine.is_dir() else 0
        rows.append({
            "model": store.fingerprint, "agents": len(usage.agents), "blocks": len(usage.sizes),
            "bytes": usage.total, "size": _size(usage.total), "quarantined": bad,
        })  # fmt: skip
    _emit("cache disk use", rows, ["model", "agents", "blocks", "size", "quarantined"], format,
          {"agents", "blocks", "size", "quarantined"})  # fmt: skip


@cache_app.command("prune")
def prune(
    older_than: Annotated[
        str | None, typer.Option(help="Evict agents unused for this long (e.g. 7d, 12h, 30m)")
    ] = None,
    max_size: Annotated[
        str | None,
        typer.Option(help="Then evict least recently used agents until all caches fit (e.g. 5GB, 500MB)"),
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Say what would be evicted; evict nothing")
    ] = False,
    cache_dir: CacheDir = None,
    store: Store = None,
    blocks: Blocks = None,
) -> None:
    """Evict agent caches least recently used first: those unused for --older-than, then
    more until every model's caches together fit --max-size (blocks other agents share stay;
    LangGraph checkpoints stay: a thread resumed from an evicted cache prefills). With a
    shared store, only this directory's copies go."""
    budget = StorageBudget.of(
        _checked(parse_size, max_size, "--max-size"), _checked(parse_age, older_than, "--older-than")
    )
    if budget is None:
        raise typer.BadParameter("give --older-than and/or --max-size")
    with _all_stores(cache_dir, store, blocks) as stores, contextlib.ExitStack() as locks:
        for one in stores:  # no save of another process lands between the plan and the deletes
            locks.enter_context(one.locked())
        report = enforce(stores, budget, dry_run=dry_run)
    verb = "would evict" if dry_run else "evicted"
    for fp, agent in report.evicted:
        typer.echo(f"{verb} {agent} ({fp})")
    typer.echo(
        f"{verb} {len(report.evicted)} agent cache(s) ({report.expired} unused for longer than "
        f"{older_than or 'any limit'}): {_size(report.bytes_before)} -> {_size(report.bytes_after)}"
    )
    if report.over_budget:
        typer.echo(
            f"still over {max_size}: what is left cannot be evicted (saves not yet uploaded)", err=True
        )
        raise typer.Exit(code=1)


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

    from ..engine.model.gguf_convert import UnsupportedGGUFError, convert_gguf
    from ..engine.model.loading import conversion_progress, resolve_model_dir
    from ..engine.ops import device

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
    _console().print(f"{target}  ({_size(size)}, {time.perf_counter() - t0:.1f} s)")


def _chat_options(
    agent: str, model: str | None, system: str | None, max_tokens: int, temperature: float, kv_bits: int,
    cache_dir: Path | None,
) -> ChatOptions:  # fmt: skip
    """``chat`` / ``run``'s options, the agent id checked."""
    from ..engine.storage.blocks import validate_agent_id
    from .repl import ChatOptions

    try:
        validate_agent_id(agent)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--agent") from exc
    return ChatOptions(
        agent=agent, model=model, system=system, max_tokens=max_tokens, temperature=temperature,
        kv_bits=_kv_bits(kv_bits), cache_dir=str(cache_dir) if cache_dir else None,
    )  # fmt: skip


@app.command("chat")
def chat(
    agent: Annotated[str, typer.Option("--agent", "-a", help="Whose conversation (and KV cache)")] = "chat",
    model: Annotated[str | None, typer.Option("--model", "-m", help="Model (default the settings')")] = None,
    system: Annotated[str | None, typer.Option(help="System prompt (sent on every turn)")] = None,
    max_tokens: Annotated[int, typer.Option(min=1, help="Most tokens per reply")] = 256,
    temperature: Annotated[float, typer.Option(min=0.0, help="0: greedy")] = 0.0,
    kv_bits: Annotated[int, typer.Option(help="KV cache bits: 4, 8, or 16 (unquantized)")] = 4,
    cache_dir: CacheDir = None,
) -> None:
    """Talk with one agent in the terminal; quit and come back later: it resumes warm."""
    from .repl import run

    run(_chat_options(agent, model, system, max_tokens, temperature, kv_bits, cache_dir), _console())


@app.command("run")
def run_once(
    question: Annotated[
        str | None, typer.Argument(help="What to ask (stdin, when piped, comes first)")
    ] = None,
    agent: Annotated[str, typer.Option("--agent", "-a", help="Whose conversation (and KV cache)")] = "chat",
    model: Annotated[str | None, typer.Option("--model", "-m", help="Model (default the settings')")] = None,
    system: Annotated[str | None, typer.Option(help="System prompt (sent on every turn)")] = None,
    max_tokens: Annotated[int, typer.Option(min=1, help="Most tokens in the reply")] = 256,
    temperature: Annotated[float, typer.Option(min=0.0, help="0: greedy")] = 0.0,
    kv_bits: Annotated[int, typer.Option(help="KV cache bits: 4, 8, or 16 (unquantized)")] = 4,
    cache_dir: CacheDir = None,
) -> None:
    """Ask one agent one question and stream the answer: `cat notes.md | agent-memory run
    --agent notes "Summarise"`. The turn joins the agent's conversation (the same as `chat
    --agent`): the next run resumes it from its cache. How the cache served it (hot, warm or
    cold) goes to stderr."""
    from .repl import ChatSession, describe

    options = _chat_options(agent, model, system, max_tokens, temperature, kv_bits, cache_dir)
    piped = "" if sys.stdin is None or sys.stdin.isatty() else sys.stdin.read()
    text = "\n\n".join(part.strip() for part in (piped, question or "") if part and part.strip())
    if not text:
        raise typer.BadParameter(
            "ask something: a QUESTION argument, or text on stdin", param_hint="QUESTION"
        )
    session = ChatSession(options)
    reply = session.ask(text, lambda t: (sys.stdout.write(t), sys.stdout.flush()))
    sys.stdout.write("\n")
    typer.echo(describe(reply), err=True)


@app.command("serve")
def serve(
    model: Annotated[
        list[str] | None,
        typer.Option("--model", "-m", help="Model to serve (repeat for several); default the settings'"),
    ] = None,
    host: Annotated[str, typer.Option(help="Interface to bind (0.0.0.0: all; set --api-key)")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port")] = 8000,
    api_key: Annotated[
        str | None,
        typer.Option(envvar="AGENT_MEMORY_API_KEY", help="Bearer token every /v1 request must carry"),
    ] = None,
    kv_bits: Annotated[int, typer.Option(help="KV cache bits: 4, 8, or 16 (unquantized)")] = 4,
    kv_format: Annotated[
        str | None, typer.Option(help="A KV format preset instead of --kv-bits (e.g. k6v4-rot-h4, q8, fp16)")
    ] = None,
    served_model_name: Annotated[
        list[str] | None,
        typer.Option(help="The name clients use for each --model (repeat, in the same order)"),
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
    log_level: Annotated[str, typer.Option(help="uvicorn log level")] = "info",
    cache_dir: CacheDir = None,
    store: Store = None,
    blocks: Blocks = None,
) -> None:
    """Serve the OpenAI Chat Completions API; each agent (X-Agent-ID) keeps its KV cache."""
    if bool(store) != bool(blocks):
        raise typer.BadParameter("give both --store (postgresql://...) and --blocks (s3://...), or neither")
    try:
        import uvicorn

        from ..server import ServerConfig, create_app
    except ImportError as exc:
        raise typer.BadParameter(str(exc), param_hint="serve") from exc
    from ..config import get_settings

    if served_model_name and len(served_model_name) != len(model or [None]):
        raise typer.BadParameter("give one --served-model-name per --model", param_hint="--served-model-name")
    config = ServerConfig(
        models=model or [get_settings().model],
        cache_dir=str(cache_dir) if cache_dir else None,
        kv_bits=_kv_bits(kv_bits),  # type: ignore[arg-type]
        kv_format=kv_format,
        served_names=served_model_name or None,
        allowed_origins=allowed_origins or [],
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        api_key=api_key,
        max_body_bytes=int(max_body_mb * (1 << 20)),
        max_tokens_limit=max_tokens_limit,
        hot_budget_mb=hot_budget_mb,
        context_length=context_length,
        max_disk_bytes=_checked(parse_size, max_disk_bytes, "--max-disk-bytes"),
        cache_ttl=_checked(parse_age, cache_ttl, "--cache-ttl"),
        store=store,
        blocks=blocks,
    )
    if host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        _console().print(f"[yellow]warning:[/yellow] serving on {host} without --api-key: anyone can use it")
    uvicorn.run(create_app(config), host=host, port=port, log_level=log_level)


@app.command("models")
def models(
    cache_dir: CacheDir = None,
    format: Annotated[str, typer.Option("--format", help="table or json")] = "table",
) -> None:
    """List the shipped models (usable by name) and the models converted into the cache
    directory (GGUF conversions, usable by their directory)."""
    from ..engine.model.loading import SHIPPED_MODELS

    rows = [
        {
            "name": m.name,
            "kind": "shipped",
            "context": m.context_length,
            "chat": m.chat,
            "about": m.description,
        }
        for m in SHIPPED_MODELS.values()
    ]
    converted = Path(cache_dir or get_settings().cache_dir).expanduser() / "models"
    for d in sorted(p for p in converted.glob("*") if (p / "config.json").exists()):
        try:
            config = json.loads((d / "config.json").read_text())
        except ValueError:
            continue
        context = config.get("max_position_embeddings") or config.get("text_config", {}).get(
            "max_position_embeddings"
        )
        rows.append({"name": str(d), "kind": "converted", "context": context, "chat": None,
                     "about": config.get("model_type", "")})  # fmt: skip
    if format == "json":
        typer.echo(json.dumps(rows, indent=2))
        return
    if format != "table":
        raise typer.BadParameter("give table or json", param_hint="--format")
    table = Table(title="models")
    for col in ("name", "kind", "context", "about"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["name"], r["kind"], str(r["context"] or "?"), r["about"])
    _console().print(table)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
