"""The process's shared engines: one per (model, cache directory, KV format), so that
every chat model and checkpointer naming the same three shares its caches, pool and worker
thread."""

from __future__ import annotations

import functools
import threading
from pathlib import Path

from ..config import get_settings
from .engine import Engine
from .kv import KVQuant
from .kv import kv_format as kv_format_of
from .model.loading import load_model
from .worker import Worker

_SHARED: dict[tuple[Path, Path, str], Engine] = {}
_SHARED_LOCK = threading.Lock()


def shared_engine(
    model: str | Path | None = None,
    *,
    cache_dir: str | Path | None = None,
    kv_bits: int | None = 4,
    kv_format: str | KVQuant | None = None,
    hot_budget_bytes: int | None = None,
) -> Engine:
    """The process's one engine for (model, cache directory, KV format): every chat model
    and checkpointer naming the same three shares its caches, pool and worker thread. A
    larger ``hot_budget_bytes`` than the engine's raises it; a smaller one leaves it."""
    home = _home()
    if not home.on_worker:
        # Built on a long-lived daemon thread, not the caller's: the first call often comes
        # from a LangGraph node's pool thread, and a thread that ran MLX work (loading the
        # model) and then *ends* during interpreter shutdown makes MLX abort (see Worker).
        build = functools.partial(
            shared_engine, model, cache_dir=cache_dir, kv_bits=kv_bits, kv_format=kv_format,
            hot_budget_bytes=hot_budget_bytes,
        )  # fmt: skip
        return home.submit(build).result()
    lm = load_model(model)
    root = Path(cache_dir or get_settings().cache_dir).expanduser().resolve()
    quant = kv_format_of(kv_format if kv_format is not None else kv_bits)
    key = (lm.path, root, quant.label)
    with _SHARED_LOCK:
        engine = _SHARED.get(key)
        if engine is None:
            engine = Engine(model, cache_dir=root, kv_format=quant, **_budget(hot_budget_bytes))
            _SHARED[key] = engine
        elif hot_budget_bytes is not None and hot_budget_bytes > engine.pool.hot_budget_bytes:
            engine.pool.hot_budget_bytes = hot_budget_bytes
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
