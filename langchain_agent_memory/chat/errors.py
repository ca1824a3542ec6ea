"""The engine's errors as LangChain's, where it has one (the engine knows no LangChain)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from langchain_core.exceptions import ContextOverflowError

from ..engine.engine import ContextLengthError as EngineContextLengthError


class ContextLengthError(EngineContextLengthError, ContextOverflowError):
    """The prompt does not fit the model's context window: LangChain's
    ``ContextOverflowError`` (its middleware catches it: trim or summarise, then retry) and
    the engine's ``ContextLengthError``."""


@contextlib.contextmanager
def langchain_errors() -> Iterator[None]:
    """The engine's errors as LangChain's where it has one (the engine knows no LangChain)."""
    try:
        yield
    except EngineContextLengthError as exc:
        if isinstance(exc, ContextLengthError):
            raise
        raise ContextLengthError(str(exc)) from exc
