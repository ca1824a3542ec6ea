"""langchain-agent-memory: persistent 4-bit KV caches for LangChain / LangGraph agents on MLX."""

# NOTE: first, before anything can import mlx: loads a fast BLAS into the process
# (see engine/runtime.py). Every module of the package is imported after this line.
from .chat_model import ChatAgentMemory
from .checkpoint import AgentMemorySaver
from .engine import runtime as _runtime  # noqa: F401
from .engine.models import DEFAULT_MODEL, SHIPPED_MODELS, LoadedModel, load_model

__all__ = [
    "DEFAULT_MODEL",
    "SHIPPED_MODELS",
    "AgentMemorySaver",
    "ChatAgentMemory",
    "LoadedModel",
    "load_model",
]
__version__ = "0.1.0"
