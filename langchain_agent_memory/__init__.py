"""langchain-agent-memory: persistent 4-bit KV caches for LangChain / LangGraph agents on MLX."""

# NOTE: first, before anything can import mlx: loads a fast BLAS into the process (see
# engine/runtime.py; ``engine/__init__.py`` imports it too, so any import path gets it first).
from .engine import runtime as _runtime  # noqa: F401  # isort: skip
from .chat_model import ChatAgentMemory
from .checkpoint import AgentMemorySaver
from .engine.model.loading import DEFAULT_MODEL, SHIPPED_MODELS, LoadedModel, load_model

__all__ = [
    "DEFAULT_MODEL",
    "SHIPPED_MODELS",
    "AgentMemorySaver",
    "ChatAgentMemory",
    "LoadedModel",
    "load_model",
]
__version__ = "0.1.0"
