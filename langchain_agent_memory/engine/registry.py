"""The process's shared engines: one per (model, cache directory, KV format), so that
every chat model and checkpointer naming the same three shares its caches, pool and worker
thread. The registry is a stock of the process runtime (``ops.process``): its shutdown
closes the engines and forgets them and their watchers."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from .config import EngineConfig, EngineKey
from .engine import Engine
from .ops.process import RUNTIME
from .requests.worker import Worker

T = TypeVar("T")

Watcher = Callable[[Engine], None]


class EngineRegistry:
    """The shared engines and their watchers. Both tables are read and written on the
    registry's home thread only, so no lock guards them: shared engines are built there, a
    long-lived daemon thread lent by the runtime, not the caller's (the first call often
    comes from a LangGraph node's pool thread, and a thread that ran MLX work, loading the
    model, and then *ends* during interpreter shutdown makes MLX abort: see ``Worker``)."""

    def __init__(self) -> None:
        self.home = Worker(name="agent-memory-init")
        self.engines: dict[EngineKey, Engine] = {}
        #: Called with every shared engine, those built already and those built later (weakly
        #: held: a watcher that is collected stops being called).
        self.watchers: list[weakref.WeakMethod[Watcher]] = []

    def at_home(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the home thread (here if this is it: a watcher asking for engines)."""
        if self.home.on_worker:
            return fn(*args)
        return self.home.submit(fn, *args).result()

    def shared(self, config: EngineConfig) -> Engine:
        """On the home thread: ``shared_engine``."""
        engine = self.engines.get(config.key)
        if engine is not None:
            if config.hot_budget_asked and config.hot_budget_bytes > engine.pool.hot_budget_bytes:
                engine.pool.hot_budget_bytes = config.hot_budget_bytes
            disk = config.storage_budget
            if disk is not None and disk != engine.admin.storage_budget:
                engine.admin.storage_budget = disk
            return engine
        engine = Engine(config)
        for watcher in list(self.watchers):  # before anyone uses it
            callback = watcher()
            if callback is not None:
                callback(engine)
        self.engines[config.key] = engine
        return engine

    def watch(self, callback: Watcher) -> None:
        """On the home thread: ``watch_engines``."""
        self.watchers.append(weakref.WeakMethod(callback))  # type: ignore[arg-type]
        for engine in list(self.engines.values()):
            callback(engine)

    def unwatch(self, callback: Watcher) -> None:
        """On the home thread: ``unwatch_engines``."""
        self.watchers = [w for w in self.watchers if w() is not None and w() != callback]

    def close(self) -> None:
        """Close the shared engines, forget them and the watchers, give the home thread back."""
        engines = self.at_home(self._forget)
        for engine in engines:
            engine.close()
        self.home.stop()

    def _forget(self) -> list[Engine]:
        engines = list(self.engines.values())
        self.engines.clear()
        self.watchers.clear()
        return engines


def engine_registry() -> EngineRegistry:
    """The process's registry (made on first use)."""
    return RUNTIME.stock("engine registry", EngineRegistry, EngineRegistry.close)


def watch_engines(callback: Watcher) -> None:
    """Call the bound method ``callback`` with every shared engine of this process, now for
    those that exist and later for each new one, before anyone else uses it (a checkpointer
    then hears every commit without building an engine itself). It is called on the
    registry's thread."""
    registry = engine_registry()
    registry.at_home(registry.watch, callback)


def unwatch_engines(callback: Watcher) -> None:
    registry = engine_registry()
    registry.at_home(registry.unwatch, callback)


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
    registry = engine_registry()
    return registry.at_home(registry.shared, _config(model, options))


def shutdown() -> None:
    """End what this process holds of the engine: every engine still open is closed (raises
    while one has requests in progress), the shared engines and their watchers are
    forgotten, the loaded models unloaded, the block reader's pools and buffers freed and
    every thread the engine started ended; memory goes back to the system. What is stored
    stays on disk, and a new engine afterwards starts afresh. The interpreter's exit does
    what it safely can without it (the saves still queued are written)."""
    RUNTIME.shutdown()


def _config(model: str | Path | EngineConfig | None, options: dict[str, Any]) -> EngineConfig:
    if isinstance(model, EngineConfig):
        if options:
            raise TypeError(f"a config and options at once: give one ({sorted(options)})")
        return model
    return EngineConfig.resolve(model, **options)
