"""The OpenAI-compatible server: ``pip install 'langchain-agent-memory[server]'``, then
``agent-memory serve`` (see ``app``)."""

from __future__ import annotations

try:
    from .app import ServerConfig, create_app
except ImportError as exc:  # fastapi / uvicorn / sse-starlette are an optional extra
    raise ImportError(
        f"the server needs the [server] extra ({exc.name} is missing): "
        "pip install 'langchain-agent-memory[server]'"
    ) from exc

__all__ = ["ServerConfig", "create_app"]
