"""The process's shared engines: one per (model, cache directory, KV format), so that
every chat model and checkpointer naming the same three shares its caches, pool and worker
thread."""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from ..config import get_settings
from .engine import Engine
from .kv import KVQuant
from .kv import kv_format as kv_format_of
from .model.loading import load_model, resolve_model_dir
from .storage.budget import StorageBudget
from .worker import Worker

_SHARED: dict[tuple[Path, Path, str, str | None, str | None], Engine] = {}
_SHARED_LOCK = threading.Lock()
#: Called with every shared engine, those built already and those built later (weakly held:
#: a watcher that is collected stops being called).
_WATCHERS: list[weakref.WeakMethod[Callable[[Engine], None]]] = []


def watch_engines(callback: Callable[[Engine], None]) -> None:
    """Call the bound method ``callback`` with every shared engine of this process, now for
    those that exist and later for each new one, before anyone else uses it (a checkpointer
    then hears every commit without building an engine itself)."""
    with _SHARED_LOCK:
        _WATCHERS.append(weakref.WeakMethod(callback))  # type: ignore[arg-type]
        existing = list(_SHARED.values())
    for engine in existing:
        callback(engine)


def unwatch_engines(callback: Callable[[Engine], None]) -> None:
    with _SHARED_LOCK:
        _WATCHERS[:] = [w for w in _WATCHERS if w() is not None and w() != callback]


def engine_key(
    model: str | Path | None = None,
    *,
    cache_dir: str | Path | None = None,
    kv_bits: int | None = 4,
    kv_format: str | KVQuant | None = None,
    store: str | None = None,
    blocks: str | None = None,
    lazy_store: bool | None = None,
) -> tuple[Path, Path, str, str | None, str | None]:
    """Which shared engine these arguments name (``Engine.key``): model directory, cache
    directory, KV format and shared store (not ``lazy_store``: how the store starts).
    Resolving the model converts a GGUF on first use, like loading it."""
    path, _ = resolve_model_dir(model)
    settings = get_settings()
    root = Path(cache_dir or settings.cache_dir).expanduser().resolve()
    quant = kv_format_of(kv_format if kv_format is not None else kv_bits)
    return path, root, quant.label, store or settings.store, blocks or settings.blocks


def shared_engine(
    model: str | Path | None = None,
    *,
    cache_dir: str | Path | None = None,
    kv_bits: int | None = 4,
    kv_format: str | KVQuant | None = None,
    hot_budget_bytes: int | None = None,
    store: str | None = None,
    blocks: str | None = None,
    max_disk_bytes: int | str | None = None,
    cache_ttl: float | str | timedelta | None = None,
    lazy_store: bool | None = None,
) -> Engine:
    """The process's one engine for (model, cache directory, KV format, shared store): every
    chat model and checkpointer naming the same shares its caches, pool and worker thread. A
    larger ``hot_budget_bytes`` than the engine's raises it; a smaller one leaves it.
    ``store`` / ``blocks``: a shared store's URLs (default: the settings'). A disk budget
    (``max_disk_bytes`` / ``cache_ttl``) given replaces the engine's (the latest wins).
    ``lazy_store``: a shared store that does not answer at start leaves the engine serving
    from its own directory (default: the settings'); read when the engine is built."""
    home = _home()
    if not home.on_worker:
        # Built on a long-lived daemon thread, not the caller's: the first call often comes
        # from a LangGraph node's pool thread, and a thread that ran MLX work (loading the
        # model) and then *ends* during interpreter shutdown makes MLX abort (see Worker).
        build = functools.partial(
            shared_engine, model, cache_dir=cache_dir, kv_bits=kv_bits, kv_format=kv_format,
            hot_budget_bytes=hot_budget_bytes, store=store, blocks=blocks,
            max_disk_bytes=max_disk_bytes, cache_ttl=cache_ttl, lazy_store=lazy_store,
        )  # fmt: skip
        return home.submit(build).result()
    lm = load_model(model)
    root = Path(cache_dir or get_settings().cache_dir).expanduser().resolve()
    quant = kv_format_of(kv_format if kv_format is not None else kv_bits)
    settings = get_settings()
    key = (lm.path, root, quant.label, store or settings.store, blocks or settings.blocks)
    with _SHARED_LOCK:
        engine = _SHARED.get(key)
        if engine is not None:
            if hot_budget_bytes is not None and hot_budget_bytes > engine.pool.hot_budget_bytes:
                engine.pool.hot_budget_bytes = hot_budget_bytes
            disk = StorageBudget.of(max_disk_bytes, cache_ttl)
            if disk is not None and disk != engine.storage_budget:
                engine.storage_budget = disk
            return engine
        engine = Engine(
            model, cache_dir=root, kv_format=quant, store=key[3], blocks=key[4],
            max_disk_bytes=max_disk_bytes, cache_ttl=cache_ttl, lazy_store=lazy_store,
            **_budget(hot_budget_bytes),
        )  # fmt: skip
        watchers = [w() for w in _WATCHERS]
    for watcher in watchers:  # before anyone uses it (outside the lock: they may ask for engines)
        if watcher is not None:
            watcher(engine)
    with _SHARED_LOCK:
        _SHARED[key] = engine
    return engine


_HOME: Worker | None = None


def _home() -> Worker:
    """The daemon thread shared engines are built on (created on first use)."""
    global _HOME
    with _SHARED_LOCK:
        if _HOME is None:
            _HOME = Worker(name="agent-memory-init")
        return _HOME


def _budget(hot_budget_bytes: int | None) -> dict[str, int]:
    return {} if hot_budget_bytes is None else {"hot_budget_bytes": hot_budget_bytes}
