"""The process's shared engines: one per (model, cache directory, KV format), so that
every chat model and checkpointer naming the same three shares its caches, pool and worker
thread."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .config import EngineConfig, EngineKey
from .engine import Engine
from .requests.worker import Worker

_SHARED: dict[EngineKey, Engine] = {}
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


def engine_key(model: str | Path | EngineConfig | None = None, **options: Any) -> EngineKey:
    """Which shared engine these arguments (``EngineConfig.resolve``'s) or this config name
    (``EngineConfig.key``)."""
    return _config(model, options).key


def shared_engine(model: str | Path | EngineConfig | None = None, **options: Any) -> Engine:
    """The process's one engine for a config's ``key`` (model, cache directory, KV format,
    shared store), built from the config, or from ``EngineConfig.resolve``'s arguments: every
    chat model and checkpointer naming the same shares its caches, pool and worker thread.
    Asked again: a larger ``hot_budget_bytes`` than the engine's raises it (a smaller one
    leaves it), and a disk budget given replaces the engine's (the latest wins)."""
    config = _config(model, options)
    home = _home()
    if not home.on_worker:
        # Built on a long-lived daemon thread, not the caller's: the first call often comes
        # from a LangGraph node's pool thread, and a thread that ran MLX work (loading the
        # model) and then *ends* during interpreter shutdown makes MLX abort (see Worker).
        return home.submit(shared_engine, config).result()
    key = config.key
    with _SHARED_LOCK:
        engine = _SHARED.get(key)
        if engine is not None:
            if config.hot_budget_asked and config.hot_budget_bytes > engine.pool.hot_budget_bytes:
                engine.pool.hot_budget_bytes = config.hot_budget_bytes
            disk = config.storage_budget
            if disk is not None and disk != engine.admin.storage_budget:
                engine.admin.storage_budget = disk
            return engine
        engine = Engine(config)
        watchers = [w() for w in _WATCHERS]
    for watcher in watchers:  # before anyone uses it (outside the lock: they may ask for engines)
        if watcher is not None:
            watcher(engine)
    with _SHARED_LOCK:
        _SHARED[key] = engine
    return engine


def _config(model: str | Path | EngineConfig | None, options: dict[str, Any]) -> EngineConfig:
    if isinstance(model, EngineConfig):
        if options:
            raise TypeError(f"a config and options at once: give one ({sorted(options)})")
        return model
    return EngineConfig.resolve(model, **options)


_HOME: Worker | None = None


def _home() -> Worker:
    """The daemon thread shared engines are built on (created on first use)."""
    global _HOME
    with _SHARED_LOCK:
        if _HOME is None:
            _HOME = Worker(name="agent-memory-init")
        return _HOME
