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


#: What ``invoke(..., key=value)``, ``stream`` and ``bind`` take (``ChatAgentMemory._request``).
CALL_OPTIONS = frozenset({
    "model", "agent_id", "tools", "tool_choice", "response_format", "chat_template_kwargs",
    "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
    "presence_penalty", "frequency_penalty", "seed", "max_string_chars", "wait_for_save",
    "stop",
})  # fmt: skip
#: Passed by LangChain's own helpers (``create_agent``, ``with_structured_output``) for hosted
#: models; nothing to do here: every tool call is decoded under its schema, one at a time.
IGNORED_CALL_OPTIONS = frozenset(
    {"parallel_tool_calls", "strict", "stream_usage", "ls_structured_output_format"}
)


def refuse_unknown_call_options(options: dict[str, Any]) -> None:
    """A ``ValueError`` naming each per-call option a chat model does not take, with the
    nearest it does (``max_token=3`` would otherwise be ignored: the reply not capped)."""
    unknown = sorted(k for k in options if k not in CALL_OPTIONS and k not in IGNORED_CALL_OPTIONS)
    if unknown:
        raise ValueError(
            f"unknown per-call option(s): {_with_hints(unknown, CALL_OPTIONS)}; a call takes "
            f"{', '.join(sorted(CALL_OPTIONS))}"
        )


def _with_hints(unknown: list[str], known: set[str] | frozenset[str]) -> str:
    hints = []
    for key in unknown:
        near = difflib.get_close_matches(key, sorted(known), n=1)
        hints.append(f"{key!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
    return ", ".join(hints)


def refuse_unknown_arguments(model: type[BaseModel], values: Any) -> Any:
    """``values`` unchanged if ``model`` has a field (or alias) for each; else a
    ``ValueError`` naming each unknown one with the nearest known name."""
    if not isinstance(values, dict):
        return values
    known = set(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias}
    unknown = sorted(k for k in values if k not in known)
    if unknown:
        raise ValueError(
            f"{model.__name__} got unknown argument(s): {_with_hints(unknown, known)}; its arguments are "
            f"listed in help({model.__name__}) (per-call options go to invoke(..., key=value))"
        )
    return values
