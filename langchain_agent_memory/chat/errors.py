"""The engine's errors as LangChain's, where it has one (the engine knows no LangChain),
and the error for an argument a model does not have."""

from __future__ import annotations

import contextlib
import difflib
from collections.abc import Iterator
from typing import Any

from langchain_core.exceptions import ContextOverflowError
from pydantic import BaseModel

from ..engine import ContextLengthError as EngineContextLengthError


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


def refuse_unknown_arguments(model: type[BaseModel], values: Any) -> Any:
    """``values`` unchanged if ``model`` has a field (or alias) for each; else a
    ``ValueError`` naming each unknown one with the nearest known name."""
    if not isinstance(values, dict):
        return values
    known = set(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias}
    unknown = sorted(k for k in values if k not in known)
    if unknown:
        hints = []
        for key in unknown:
            near = difflib.get_close_matches(key, sorted(known), n=1)
            hints.append(f"{key!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
        raise ValueError(
            f"{model.__name__} got unknown argument(s): {', '.join(hints)}; its arguments are "
            f"listed in help({model.__name__}) (per-call options go to invoke(..., key=value))"
        )
    return values
