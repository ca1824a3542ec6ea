"""The OpenAI-compatible server: the package's ``server`` extra (see ``install_hint``), then
``agent-memory serve`` (see ``app``)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, requires


def install_hint(extra: str) -> str:
    """A pip command that installs ``extra``'s requirements, read from the installed
    package's own metadata. NOTE: ``pip install 'langchain-agent-memory[server]'`` fails
    (the package is not on PyPI), and a user may hold a clone, a wheel or an editable
    install: the requirements themselves install from any of those."""
    markers = (f"extra == '{extra}'", f'extra == "{extra}"')
    try:
        listed = requires("langchain-agent-memory") or []
    except PackageNotFoundError:  # run from a source tree that was never installed
        listed = []
    wanted = [r.partition(";")[0].strip() for r in listed if any(m in r.partition(";")[2] for m in markers)]
    if not wanted:
        return f"pip install -e '.[{extra}]' in a clone of the repository"
    return "pip install " + " ".join(f"'{w}'" for w in wanted)


try:
    from .app import ServerConfig, create_app
except ImportError as exc:  # fastapi / uvicorn / sse-starlette are an optional extra
    raise ImportError(
        f"the server needs the package's [server] extra ({exc.name} is missing): {install_hint('server')}"
    ) from exc

__all__ = ["ServerConfig", "create_app", "install_hint"]
