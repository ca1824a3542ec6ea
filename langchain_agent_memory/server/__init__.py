"""The OpenAI-compatible server: the package's ``server`` extra (see ``install_hint``), then
``agent-memory serve`` (see ``app``)."""

from __future__ import annotations

from ..config import install_hint

try:
    from .app import ServerConfig, create_app
except ImportError as exc:  # fastapi / uvicorn / sse-starlette are an optional extra
    raise ImportError(
        f"the server needs the package's [server] extra ({exc.name} is missing): {install_hint('server')}"
    ) from exc

__all__ = ["ServerConfig", "create_app", "install_hint"]
