"""langchain-agent-memory: persistent 4-bit KV caches for LangChain / LangGraph agents on MLX."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# NOTE: first, before anything can import mlx: loads a fast BLAS into the process (see
# engine/ops/runtime.py; ``engine/__init__.py`` imports it too, so any import path gets it first).
from .engine.ops import runtime as _runtime  # noqa: F401  # isort: skip

if TYPE_CHECKING:
    from .chat.errors import ContextLengthError
    from .chat.model import ChatAgentMemory
    from .engine import DEFAULT_MODEL, SHIPPED_MODELS, LoadedModel, load_model
    from .graph.saver import AgentMemorySaver

# The public names are imported on first use (PEP 562): LangChain / LangGraph take ~1.2 s to
# import, which a process that only touches the engine or its store (the CLI's cache commands,
# a cleanup worker, a server child) should not pay.
_LAZY = {
    "ChatAgentMemory": ".chat.model",
    "AgentMemorySaver": ".graph.saver",
    "ContextLengthError": ".chat.errors",
    "DEFAULT_MODEL": ".engine",
    "SHIPPED_MODELS": ".engine",
    "LoadedModel": ".engine",
    "load_model": ".engine",
}

__all__ = [
    "DEFAULT_MODEL",
    "SHIPPED_MODELS",
    "AgentMemorySaver",
    "ChatAgentMemory",
    "ContextLengthError",
    "LoadedModel",
    "load_model",
]
__version__ = "0.1.0"


#: Modules users import from the package root (the quickstart's text).
_MODULES = {"corpus": ".testing.corpus"}


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        value = importlib.import_module(_MODULES[name], __name__)
        globals()[name] = value
        return value
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
