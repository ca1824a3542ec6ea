"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}`` (in
Anthropic's, ``{"type": "error", "error": {"type", "message"}}``, under ``/v1/messages``),
and the request checks that answer with them (a body over the limit, a malformed body, a
failure turned into a status code)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..engine import (
    AgentNotFoundError,
    CacheWriteError,
    CommitConflictError,
    ContextLengthError,
    RemoteUnavailableError,
)

logger = logging.getLogger(__name__)
R = TypeVar("R", bound=BaseModel)


class APIError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


#: Anthropic's error types by status (anything else: ``invalid_request_error`` / ``api_error``).
_ANTHROPIC_TYPES = {
    401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
}  # fmt: skip


def speaks_anthropic(path: str) -> bool:
    """Whether a route answers in Anthropic's shapes (``anthropic_routes``)."""
    return path.startswith("/v1/messages")


def error_response(
    status: int, message: str, code: str | None = None, param: str | None = None, path: str = ""
) -> JSONResponse:
    body: dict[str, Any]
    if speaks_anthropic(path):
        kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
        body = {"type": "error", "error": {"type": kind, "message": message}}
    else:
        # OpenAI's shape: every client error is an ``invalid_request_error`` (a wrong key
        # too), told apart by ``code`` (``invalid_api_key``, ``model_not_found``, ...).
        kind = "server_error" if status >= 500 else "invalid_request_error"
        body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    if status == 503:  # the shared store is out of reach: a retry may succeed
        headers = {"Retry-After": "5"}
    return JSONResponse(body, status_code=status, headers=headers)


class BodyLimit:
    """Refuses request bodies over ``max_bytes`` with a 413, declared or streamed."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        too_big = f"request body is over the server's limit of {self.max_bytes} bytes"
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            refused = error_response(413, too_big, "request_too_large", path=scope.get("path", ""))
            return await refused(scope, receive, send)
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:  # a chunked body: FastAPI turns this into the 413
                raise HTTPException(413, too_big)
            return message

        return await self.app(scope, limited, send)


def validation_message(errors: list[Any]) -> tuple[str, str | None]:
    """The first problem of a validation error, as one line, and the field it is in."""
    if not errors:
        return "malformed request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        said = first.get("ctx", {}).get("error", first["msg"])
        if "hex escape" in said and _lone_surrogate(first.get("input")):
            return (
                "request body holds a lone UTF-16 surrogate escape (e.g. \\ud800 without its pair) in a "
                f"string: that is no Unicode text. Send the text as UTF-8, or escape both halves of the "
                f"pair ({said})"
            ), None
        return f"request body is not valid JSON: {said}", None
    loc = [str(p) for p in first.get("loc", ())]
    if loc and loc[0] in ("body", "path", "query", "header"):
        loc = loc[1:]
    where = ".".join(loc)
    msg = first["msg"].removeprefix("Value error, ")
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return (f"{where}: {msg}" if where else msg) + more, where or None


@contextmanager
def as_api_errors() -> Iterator[None]:
    """Turns a ``ValueError`` (what the request asks cannot be done) into a 400, an agent
    with no cache into a 404, a shared store out of reach into a 503, another worker's
    write of the agent into a 409, a disk that refuses a write into a 507, and any other
    failure into a 500 with its message."""
    try:
        yield
    except ContextLengthError as exc:
        raise APIError(400, str(exc), "context_length_exceeded", "messages") from exc
    except AgentNotFoundError as exc:
        raise APIError(404, f"{exc}: no cache here", "agent_not_found", "agent_id") from exc
    except ValueError as exc:
        raise APIError(400, str(exc)) from exc
    except APIError:
        raise
    except Exception as exc:
        if isinstance(exc, RemoteUnavailableError) or isinstance(exc.__cause__, RemoteUnavailableError):
            # The shared store did not answer: nothing was done, and a retry may succeed.
            raise APIError(503, str(exc), "store_unavailable") from exc
        if isinstance(exc, CommitConflictError):  # another worker holds or just saved the agent
            raise APIError(409, f"{exc}; retry", "conflict") from exc
        if isinstance(exc, CacheWriteError):
            # The disk refused a write (full, permissions): the previous cache is intact and
            # the message says what to free or fix; 507 Insufficient Storage, not a server bug.
            raise APIError(507, str(exc), "insufficient_storage") from exc
        # Answered here, not by an app-wide handler: Starlette re-raises those, and uvicorn
        # then drops the client's keep-alive connection.
        logger.exception("request failed")
        raise APIError(500, f"generation failed: {exc}") from exc


def parse_body(kind: type[R], raw: bytes) -> R:
    """A request body, parsed here rather than by FastAPI: a JSON body is read whatever its
    Content-Type (curl -d sends a form type) and errors keep OpenAI's shape. Top-level fields
    the request type does not know (``context_management``, ``client_metadata``, ...) are
    ignored, and named in a debug log line: clients add fields faster than servers learn
    them (a request type keeps them with ``extra="allow"``)."""
    try:
        body = kind.model_validate_json(raw)
    except ValidationError as exc:
        message, param = validation_message(exc.errors())
        raise APIError(400, message, param=param) from exc
    if body.model_extra:
        logger.debug("%s: ignored fields %s", kind.__name__, ", ".join(sorted(body.model_extra)))
    return body


#: The reply header that says a request's ``max_tokens`` was over the server's limit.
CLAMPED_HEADER = "X-Max-Tokens-Clamped"
#: The reply header that tells the client what of its request was left out (tools the model
#: cannot run, ...), as the server's log does.
WARNING_HEADER = "X-Agent-Memory-Warning"


def warn(headers: dict[str, str], message: str) -> None:
    """Log ``message`` as a warning and tell the client (``WARNING_HEADER``; several are
    joined with "; "; a header carries ASCII, so other characters are escaped)."""
    logger.warning("%s", message)
    text = message.encode("ascii", "backslashreplace").decode("ascii")
    headers[WARNING_HEADER] = f"{headers[WARNING_HEADER]}; {text}" if WARNING_HEADER in headers else text


def within_limit(max_tokens: int, limit: int, headers: dict[str, str]) -> int:
    """``max_tokens``, or ``limit`` where it asks more: clamped, never refused (harnesses ask
    for the most their hosted model writes, Claude Code 32000 or 64000). The reply's
    ``X-Max-Tokens-Clamped`` header (added to ``headers``) and an info log line say so."""
    if max_tokens <= limit:
        return max_tokens
    logger.info("max_tokens %d is over this server's limit (--max-tokens-limit): %d", max_tokens, limit)
    headers[CLAMPED_HEADER] = f"{limit}; asked {max_tokens}, over --max-tokens-limit"
    return limit


def _lone_surrogate(body: object) -> bool:
    """Whether a JSON body's text escapes half of a UTF-16 surrogate pair on its own (JSON's
    grammar allows it; no Unicode text holds one)."""
    import re

    if not isinstance(body, bytes | str):
        return False
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    pairs = r"\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}"
    return re.search(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}", re.sub(pairs, "", text)) is not None
