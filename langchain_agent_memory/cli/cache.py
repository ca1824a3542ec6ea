"""``agent-memory cache``: look at and manage stored agent caches.

    agent-memory cache ls [--prefix P] [--all]  agents with a stored cache (--all: @snapshot: ids too)
    agent-memory cache show AGENT           one agent's cache: tokens, blocks, text
    agent-memory cache rm AGENT...          delete agents' caches (shared blocks stay)
    agent-memory cache gc                   remove temporary files and unreferenced blocks
    agent-memory cache verify --store --blocks   every stored block's object there, repaired
    agent-memory cache du                   disk use per model/KV format
    agent-memory cache prune --older-than 7d --max-size 5GB   evict least recently used

Every command reads the cache directory (``--cache-dir``, default the settings') without
loading a model: a cache directory holds one store per model fingerprint (``kv/<fp>/``),
and each command goes over all of them. Saves and deletes take the store's directory lock,
so this is safe while an application is using the same directory.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Annotated

import typer

from ..engine import StorageBudget, is_internal, parse_age, parse_size
from .common import (
    HELP,
    Blocks,
    CacheDir,
    Format,
    Store,
    all_stores,
    cache_root,
    checked,
    emit,
    size_text,
    stored_id,
    stores_of,
    thread_prefixes,
    wide_console,
)

cache_app = typer.Typer(
    help="Inspect and manage stored agent caches: ls, show, du, rm, prune, gc, verify.",
    no_args_is_help=True,
    context_settings=HELP,
)


@cache_app.command("ls")
def ls(
    prefix: Annotated[str, typer.Option(help="Only agents whose id starts with this")] = "",
    all_: Annotated[
        bool, typer.Option("--all", help="Also the product's own entries (a checkpointer's @snapshot: ids)")
    ] = False,
    cache_dir: CacheDir = None,
    store: Store = None,
    blocks: Blocks = None,
    format: Format = "table",
) -> None:
    """List agents with a stored cache (never changes the store)."""
    rows = [
        {
            "model": opened.label,
            "fingerprint": opened.fingerprint,
            "agent": record.agent_id,
            "tokens": len(record.token_ids),
            "blocks": len(record.blocks),
            "updated": datetime.fromtimestamp(record.updated_at).strftime("%Y-%m-%d %H:%M:%S"),
        }
        for opened in stores_of(cache_dir, store, blocks, read_only=True)
        for record in opened.agents(prefix)
        if all_ or not is_internal(record.agent_id)
    ]
    columns = ["model", "agent", "tokens", "blocks", "updated"]
    emit("agent caches", rows, columns, format, {"tokens", "blocks"}, group="model")


@cache_app.command("show")
def show(
    agent: str, cache_dir: CacheDir = None, chars: int = 400, store: Store = None, blocks: Blocks = None
) -> None:
    """Show one agent's cache: tokens, blocks, and the start and end of its text."""
    found = False
    for opened in stores_of(cache_dir, store, blocks, read_only=True):
        cache_id = stored_id(opened, agent)
        record = opened.record(cache_id) if cache_id is not None else None
        if record is None:
            continue
        found = True
        console = wide_console()
        named = agent if cache_id == agent else f"{agent} (cache {cache_id})"
        console.print(f"[bold]{named}[/bold] in {opened.label}")
        console.print(f"tokens: {len(record.token_ids)}, blocks: {len(record.blocks)}")
        for h in record.blocks:
            here = opened.block_bytes(h)
            size = (
                size_text(here) if here is not None else "in the shared store" if opened.shared else "MISSING"
            )
            console.print(f"  {h[:16]}  {size}")
        text = record.text
        shown = text if len(text) <= 2 * chars else text[:chars] + "\n[...]\n" + text[-chars:]
        console.print(shown, markup=False)
    if not found:
        raise typer.BadParameter(f"no stored cache for agent {agent!r}", param_hint="AGENT")


@cache_app.command("rm")
def rm(
    agents: Annotated[
        list[str] | None, typer.Argument(help="Agent ids (or chat/run --agent names) to delete")
    ] = None,
    prefix: Annotated[str | None, typer.Option(help="Every agent whose id starts with this")] = None,
    thread: Annotated[
        str | None,
        typer.Option(help="Every agent of a LangGraph thread (ids 'THREAD:node...'), or of a chat/run agent"),
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
    if not agents and prefix is None and thread is None:
        raise typer.BadParameter("name agents, or select them with --prefix or --thread")
    selectors = thread_prefixes(thread) if thread is not None else [prefix] if prefix is not None else []
    deleted = 0
    for opened in stores_of(cache_dir, store, blocks):
        named = [(name, stored_id(opened, name)) for name in agents or []]
        for name, cache_id in named:
            if cache_id is None:
                typer.echo(f"no stored cache for {name} ({opened.label})", err=True)
        chosen = [cache_id for _, cache_id in named if cache_id is not None]
        for selector in selectors:
            chosen += [r.agent_id for r in opened.agents(selector)]
        chosen = list(dict.fromkeys(chosen))
        if dry_run:
            for agent in chosen:
                typer.echo(f"would delete {agent} ({opened.label})")
            continue
        if selectors and chosen and not yes and not typer.confirm(f"delete {len(chosen)} agent cache(s)?"):
            raise typer.Exit(code=1)
        deleted += opened.delete_agents(chosen)
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
    for opened in stores_of(cache_dir, store, blocks):  # opening recovers; run it again for what came since
        done = opened.collect_garbage(grace_s=grace_hours * 3600)
        temps += done.temp_files
        orphans += done.orphan_blocks
        collected += done.shared_objects
    shared = f" and {collected} block object(s) from the shared store" if store else ""
    wide_console().print(f"removed {temps} temporary file(s) and {orphans} unreferenced block(s){shared}")


@cache_app.command("verify")
def verify(
    store: Store = None,
    blocks: Blocks = None,
    cache_dir: CacheDir = None,
    repair: Annotated[
        bool, typer.Option(help="Upload what this cache directory has; mark the rest missing")
    ] = True,
) -> None:
    """Check the stored blocks. This cache directory: every block agents name is read and its
    checksums compared; a damaged one is quarantined (with --repair: the agents naming it
    prefill what it held) and exits 1. A shared store (--store, --blocks): every block the
    catalog says is stored is checked against the object store and what is missing repaired
    (uploaded again from this cache directory's copy, else marked missing: the agents naming
    it prefill, and their next save uploads it); exits 1 if any reference is left to a block
    the store does not hold."""
    if not (store or blocks):  # half a shared store is refused by ``all_stores``
        _verify_local(cache_dir, repair)
        return
    rows, dangling = [], 0
    for opened in stores_of(cache_dir, store, blocks):
        r = opened.verify_shared(repair)
        if r is not None:
            dangling += r.dangling
            rows.append({
                "model": opened.label, "checked": r.checked, "missing": r.missing,
                "uploaded": r.uploaded, "marked missing": r.marked_missing, "dangling": r.dangling,
            })  # fmt: skip
    columns = ["model", "checked", "missing", "uploaded", "marked missing", "dangling"]
    emit("shared store blocks", rows, columns, "table", set(columns[1:]))
    if dangling:
        raise typer.Exit(1)


def _verify_local(cache_dir: Path | None, repair: bool) -> None:
    """``verify`` of this cache directory: every named block read back and checked; exits 1
    if one was damaged (missing ones, quarantined before, are reported: their agents
    prefill what they held)."""
    rows, damaged = [], 0
    with all_stores(cache_dir) as admin:
        for opened in admin.models:

            def say(h: str, exc: Exception, label: str = opened.label) -> None:
                typer.echo(f"damaged: {h[:16]} ({label}): {exc}", err=True)

            check = opened.check_blocks(repair, say)
            damaged += len(check.damaged)
            rows.append({"model": opened.label, "checked": check.checked, "damaged": len(check.damaged),
                         "quarantined": check.quarantined, "missing": check.missing})  # fmt: skip
    columns = ["model", "checked", "damaged", "quarantined", "missing"]
    emit("stored blocks", rows, columns, "table", set(columns[1:]))
    if damaged:
        raise typer.Exit(1)


@cache_app.command("du")
def du(cache_dir: CacheDir = None, format: Format = "table") -> None:
    """Disk use of the cache directory: per model / KV format as a disk budget counts it (the
    blocks agents name, the index, quarantined files), then the converted models and GGUF
    downloads kept beside them, and the total (never changes anything)."""
    rows = []
    for opened in stores_of(cache_dir, read_only=True):
        use = opened.disk_use()
        rows.append({
            "model": opened.label, "agents": use.agents, "blocks": use.blocks,
            "bytes": use.bytes, "size": size_text(use.bytes), "quarantined": use.quarantined,
        })  # fmt: skip
    root = cache_root(cache_dir)
    for name, what in (("models", "converted models"), ("gguf", "GGUF downloads")):
        size = sum(f.stat().st_size for f in (root / name).rglob("*") if f.is_file())
        if size:
            rows.append({"model": f"{name}/ ({what})", "agents": "", "blocks": "", "bytes": size,
                         "size": size_text(size), "quarantined": ""})  # fmt: skip
    total = sum(r["bytes"] for r in rows)
    rows.append({"model": f"total ({root})", "agents": "", "blocks": "", "bytes": total,
                 "size": size_text(total), "quarantined": ""})  # fmt: skip
    emit("cache disk use", rows, ["model", "agents", "blocks", "size", "quarantined"], format,
          {"agents", "blocks", "size", "quarantined"})  # fmt: skip


def _with_unit(value: str | None, flag: str, examples: str) -> str | None:
    """``value`` as given, refused where it is a bare number: ``--max-size 5`` read as bytes
    evicted every cache, and a bare ``--older-than 7`` says neither days nor seconds."""
    if value is not None and value.strip().replace(".", "", 1).isdigit():
        raise typer.BadParameter(f"{value!r} has no unit: write e.g. {examples}", param_hint=flag)
    return value


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
    yes: Annotated[
        bool, typer.Option("--yes", "-y", help="Evict even when that is every agent's cache, without asking")
    ] = False,
    cache_dir: CacheDir = None,
    store: Store = None,
    blocks: Blocks = None,
) -> None:
    """Evict agent caches least recently used first: those unused for --older-than, then
    more until every model's caches together fit --max-size (blocks other agents share stay;
    LangGraph checkpoints stay: a thread resumed from an evicted cache prefills). With a
    shared store, only this directory's copies go. Sizes and ages take a unit (5GB, 7d);
    a prune that would evict every agent asks first (--yes: don't)."""
    budget = StorageBudget.of(
        checked(parse_size, _with_unit(max_size, "--max-size", "5GB, 500MB, 2GiB"), "--max-size"),
        checked(parse_age, _with_unit(older_than, "--older-than", "7d, 12h, 30m"), "--older-than"),
    )
    if budget is None:
        raise typer.BadParameter("give --older-than and/or --max-size")

    def evict_every(every: int) -> bool:
        # NOTE: a size read as bytes once deleted all 26 agents' caches; a prune that
        # empties the store is said first (a pipe or a script answers no: --yes)
        return typer.confirm(f"this evicts every agent's cache ({every}); go on?", default=False, err=True)

    with all_stores(cache_dir, store, blocks) as admin:
        report = admin.prune(budget, dry_run=dry_run, confirm_all=None if yes else evict_every)
        labels = {opened.fingerprint: opened.label for opened in admin.models}
    if report.refused:
        typer.echo("nothing evicted (--yes evicts every agent's cache without asking)", err=True)
        raise typer.Exit(code=1)
    verb = "would evict" if dry_run else "evicted"
    agents = [(fp, agent) for fp, agent in report.evicted if not is_internal(agent)]
    for fp, agent in agents:
        typer.echo(f"{verb} {agent} ({labels[fp]})")
    # A checkpointer's snapshots (``@snapshot:`` ids) go with the caches: counted apart.
    snapshots = len(report.evicted) - len(agents)
    also = f" and {snapshots} checkpoint snapshot(s)" if snapshots else ""
    typer.echo(
        f"{verb} {len(agents)} agent cache(s){also} ({report.expired} unused for longer than "
        f"{older_than or 'any limit'}): {'would free' if dry_run else 'freed'} {size_text(report.freed)} "
        f"of {size_text(report.bytes_before)}"
    )
    if report.over_budget:
        typer.echo(
            f"still over {max_size}: what is left cannot be evicted"
            + (" (saves not yet uploaded to the shared store)" if store else ""),
            err=True,
        )
        raise typer.Exit(code=1)
