"""What the ``agent-memory`` commands share: option types, the stores of a cache directory,
listings (table, text or JSON) and sizes."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.table import Table

from ..config import get_settings
from ..engine import ModelStore, StoreAdmin

T = TypeVar("T")

#: Every command takes -h as well as --help.
HELP = {"help_option_names": ["-h", "--help"]}


CacheDir = Annotated[
    Path | None,
    typer.Option("--cache-dir", help="Cache directory (default: AGENT_MEMORY_CACHE_DIR or ~/.cache/...)"),
]


def wide_console() -> Console:
    # emoji=False: an agent id such as "chat:notes:assistant" must not print a 🎶
    return Console(width=max(Console().width, 120), emoji=False)


Store = Annotated[
    str | None,
    typer.Option(envvar="AGENT_MEMORY_STORE", help="A shared store's PostgreSQL URL (with --blocks)"),
]
Blocks = Annotated[
    str | None,
    typer.Option(envvar="AGENT_MEMORY_BLOCKS", help="A shared store's s3:// URL for blocks (with --store)"),
]


def stores_of(
    cache_dir: Path | None, store: str | None = None, blocks: str | None = None, *, read_only: bool = False
) -> Iterator[ModelStore]:
    """One store per model fingerprint, opened in turn (``all_stores``)."""
    with all_stores(cache_dir, store, blocks, read_only=read_only) as admin:
        yield from admin.models


def cache_root(cache_dir: Path | None) -> Path:
    """The cache directory: ``--cache-dir``, else the settings' (``AGENT_MEMORY_CACHE_DIR``)."""
    return Path(cache_dir or get_settings().cache_dir).expanduser()


def all_stores(
    cache_dir: Path | None, store: str | None = None, blocks: str | None = None, *, read_only: bool = False
) -> StoreAdmin:
    """The cache directory's stores, one per model fingerprint (``StoreAdmin``): with a
    shared store (``--store`` / ``--blocks``), every model it holds (this directory its
    local tier). ``read_only``: for commands that only look. Half a shared store is a usage
    error."""
    if bool(store) != bool(blocks):
        raise typer.BadParameter(
            "a shared store needs both --store (postgresql://...) and --blocks (s3://...)"
        )
    return StoreAdmin(cache_root(cache_dir), store, blocks, read_only=read_only)


def checked(parse: Callable[[str], T], value: str | None, flag: str) -> T | None:
    """``value`` parsed, or a usage error naming ``flag``."""
    try:
        return None if value is None else parse(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint=flag) from None


def kv_bits_of(kv_bits: int) -> int | None:
    """``--kv-bits``: 4 or 8, or 16 for unquantized (None)."""
    if kv_bits not in (4, 8, 16):
        raise typer.BadParameter("give 4, 8 or 16", param_hint="--kv-bits")
    return None if kv_bits == 16 else kv_bits


Format = Annotated[
    str, typer.Option("--format", help="table (plain text when not a terminal), text, or json")
]


def emit(
    title: str,
    rows: list[dict[str, Any]],
    columns: list[str],
    fmt: str,
    right: set[str],
    group: str | None = None,
) -> None:
    """A listing: a table on a terminal, tab-separated lines elsewhere (pipes, files), or
    ``--format json`` (every field, machine-readable). ``group``: on a terminal, one table
    per value of that column, named in its title rather than repeated on every row."""
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
    groups = (
        {r[group]: [x for x in rows if x[group] == r[group]] for r in rows}
        if group and rows
        else {None: rows}
    )
    for value, members in groups.items():
        shown = [c for c in columns if c != group]
        table = Table(title=title if value is None else f"{title}: {value}")
        for col in shown:
            table.add_column(col, justify="right" if col in right else "left")
        for r in members:
            table.add_row(*(str(r[c]) for c in shown))
        wide_console().print(table)


def size_text(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


# ------------------------------------------------------------------ agent names


#: ``agent-memory chat`` / ``run --agent NAME`` keep NAME's conversation in the LangGraph
#: thread ``chat:NAME`` (checkpointed), and its KV cache under the id of that thread's one
#: node: ``chat:NAME:assistant``. Every cache command takes NAME as well as a full id.
def chat_thread(name: str) -> str:
    return f"chat:{name}"


def chat_cache_id(name: str) -> str:
    return f"{chat_thread(name)}:assistant"


def stored_id(opened: ModelStore, name: str) -> str | None:
    """The cache id ``name`` stands for in ``opened``: the id itself if it has a cache, else
    the cache of the ``chat`` / ``run`` agent ``name``; None if neither has one."""
    return next((i for i in (name, chat_cache_id(name)) if opened.has_agent(i)), None)


def thread_prefixes(thread: str) -> list[str]:
    """The id prefixes of a thread's agents: LangGraph's ``THREAD:node...``, and the
    ``chat`` / ``run`` agent ``THREAD``'s thread."""
    return [f"{thread}:", f"{chat_thread(thread)}:"]
