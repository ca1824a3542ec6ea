"""Constrained decoding: only tokens a grammar allows can be sampled (llguidance).

Used for a forced tool call (``tool_choice``) and for JSON-schema structured output: the
small shipped models cannot be relied on to write a valid call or object unprompted, so
the sampler is masked to the grammar, token by token. The grammar's own end admits only
the end-of-turn token, so a constrained reply ends as soon as it is complete.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from ..ops.runtime import mx

#: Compact JSON ({"a": 1, "b": [2, 3]}): no free whitespace for a small model to ramble in.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class TokenConstraint(Protocol):
    def mask(self, logits: mx.array) -> mx.array: ...
    def advance(self, token: int) -> None: ...


@functools.lru_cache(maxsize=8)
def _ll_tokenizer(hf_tokenizer: Any, eos: tuple[int, ...]) -> Any:
    import llguidance.hf

    return llguidance.hf.from_tokenizer(hf_tokenizer, eos_token=list(eos))  # ~1 s: cached


class GrammarConstraint:
    """A ``TokenConstraint`` for an llguidance grammar (see the ``*_grammar`` helpers)."""

    def __init__(self, tokenizer: Any, grammar: str) -> None:
        import llguidance

        hf = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's TokenizerWrapper
        ll_tokenizer = _ll_tokenizer(hf, tuple(tokenizer.eos_token_ids))
        self._matcher = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
        if self._matcher.is_error():
            raise ValueError(f"invalid output grammar: {self._matcher.get_error()}")

    def mask(self, logits: mx.array) -> mx.array:
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little").astype(bool)
        n = logits.shape[-1]
        allowed = np.pad(allowed, (0, max(0, n - allowed.size)))[:n]  # padded vocab rows: never
        return mx.where(mx.array(allowed), logits, -mx.inf)

    def advance(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            raise RuntimeError(f"constrained decoding rejected token {token}: {self._matcher.get_error()}")


#: Strings a schema leaves unbounded are capped at this many characters by default: greedy
#: decoding of a small model can loop inside a string ("A cat is a cat, a cat is a cat, ...")
#: until ``max_tokens`` cuts the object short; capped, the string closes and the object
#: completes. ``ChatAgentMemory(max_string_chars=...)`` sets another cap, or none.
MAX_FREE_STRING_CHARS = 200


def bounded_strings(schema: Any, limit: int | None = MAX_FREE_STRING_CHARS) -> Any:
    """A copy of ``schema`` where every plain string (no length, pattern, format, enum or
    const) has ``maxLength: limit`` (``None``: ``schema`` as it is).

    >>> bounded_strings({"type": "object", "properties": {"a": {"type": "string"}}}, 9)
    {'type': 'object', 'properties': {'a': {'type': 'string', 'maxLength': 9}}}
    """
    if limit is None:
        return schema
    if isinstance(schema, list):
        return [bounded_strings(x, limit) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: bounded_strings(v, limit) for k, v in schema.items()}
    free = not any(k in schema for k in ("maxLength", "pattern", "format", "enum", "const"))
    if schema.get("type") == "string" and free:
        out["maxLength"] = limit
    return out


def closed_objects(schema: Any) -> Any:
    """A copy of ``schema`` where every object that lists its properties and says nothing
    of others has ``additionalProperties: false``: JSON Schema's default lets a decoder add
    keys until ``max_tokens`` runs out (a Pydantic model's schema says nothing of them, and
    the model would go on inventing fields), where what is wanted is the schema's own.

    >>> closed_objects({"type": "object", "properties": {"a": {"type": "integer"}}})
    {'type': 'object', 'properties': {'a': {'type': 'integer'}}, 'additionalProperties': False}
    """
    if isinstance(schema, list):
        return [closed_objects(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed_objects(v) for k, v in schema.items()}
    if "properties" in schema and "additionalProperties" not in schema and "patternProperties" not in schema:
        out["additionalProperties"] = False
    return out


def json_schema_grammar(schema: dict[str, Any], max_string_chars: int | None = MAX_FREE_STRING_CHARS) -> str:
    """A grammar for one JSON value valid under ``schema``: free strings bounded, objects
    closed to the keys they list (see above)."""
    import llguidance

    bounded = bounded_strings(closed_objects(schema), max_string_chars)
    return llguidance.LLMatcher.grammar_from_json_schema(bounded, defaults=JSON_OPTIONS)


def tool_call_grammar(
    tools: Sequence[dict[str, Any]],
    open_tag: str,
    close_tag: str,
    args_key: str = "arguments",
    max_string_chars: int | None = MAX_FREE_STRING_CHARS,
) -> str:
    """A grammar for exactly one call ``open_tag{"name": ..., "arguments": {...}}close_tag``
    to one of ``tools`` (OpenAI-format tool dicts), arguments valid under its schema
    (``args_key``: what the format calls them, e.g. Llama 3's ``parameters``)."""
    import llguidance

    options = []
    for tool in tools:
        fn = tool["function"]
        # A forced call names only declared arguments, unless the schema says otherwise.
        params = {
            "additionalProperties": False,
            **closed_objects(fn.get("parameters") or {"type": "object", "properties": {}}),
        }
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, args_key: params},
                "required": ["name", args_key],
                "additionalProperties": False,
            }
        )
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    schema = {**bounded_strings(schema, max_string_chars), "x-guidance": JSON_OPTIONS}
    head, tail = (
        (json.dumps(open_tag) + " " if open_tag else ""),
        (" " + json.dumps(close_tag) if close_tag else ""),
    )
    lark = f"start: {head}call{tail}\ncall: %json {json.dumps(schema)}\n"
    return llguidance.LLMatcher.grammar_from_lark(lark)
