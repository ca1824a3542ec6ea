"""LangChain messages -> the prompt text the engine matches and caches, and model output ->
text and tool calls.

Rendering goes through the model's own chat template. Templates that cannot show tools
(SmolLM2's is plain ChatML) get them in the widely used Hermes / Qwen format, which this
module documents and parses:

- the tools are listed in the system message, one JSON signature per line inside
  ``<tools></tools>``;
- the model answers a call as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
- an AI message's earlier tool calls are written back the same way, and a tool message's
  content is wrapped in ``<tool_response></tool_response>`` (role ``tool``).

A model without a chat template (a base model such as Gemma 3 270M) gets a plain
transcript: ``System: ...``, ``User: ...``, ``Assistant: ...`` blocks separated by blank
lines, and the generation prompt ``Assistant:``.

Rendering is deterministic and append-only: the prompt of turn N+1 starts with turn N's
prompt plus the reply, so the engine extends the cache instead of re-reading it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.messages import BaseMessage

from .messages import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    TOOLS_INSTRUCTION,
    TOOLS_PREAMBLE,
    TRANSCRIPT_TURN_END,
    parse_reply,
    schema_system_text,
    text_of,
    to_dicts,
    tool_call_text,
    tools_system_text,
    with_listing,
)
from .tool_formats import native_dicts, tool_format

__all__ = [
    "TOOLS_INSTRUCTION",
    "TOOLS_PREAMBLE",
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "TRANSCRIPT_TURN_END",
    "parse_reply",
    "render",
    "schema_system_text",
    "text_of",
    "to_dicts",
    "tool_call_text",
    "tools_system_text",
    "transcript",
    "with_listing",
]


def render(
    tokenizer: Any,
    messages: Sequence[BaseMessage],
    tools: Sequence[dict[str, Any]] | None = None,
    response_schema: dict[str, Any] | None = None,
    *,
    generation_prompt: bool = True,
    **template_kwargs: Any,
) -> str:
    """The prompt text for ``messages`` (ending with the assistant's generation prompt unless
    ``generation_prompt`` is False), in the template's own tool format where it has one
    (``tool_formats``), else Hermes."""
    if not messages:
        raise ValueError("no messages to send: pass at least one message")
    if not getattr(tokenizer, "chat_template", None):
        return transcript(to_dicts(messages, tools, response_schema))
    fmt = tool_format(tokenizer)
    if fmt.native:
        dicts = native_dicts(fmt, messages)
        if response_schema is not None:
            with_listing(dicts, schema_system_text(response_schema))
        kwargs = {"tools": list(tools)} if tools else {}
        return tokenizer.apply_chat_template(
            dicts, add_generation_prompt=generation_prompt, tokenize=False, **kwargs, **template_kwargs
        )
    dicts = to_dicts(messages, tools, response_schema)
    try:
        return tokenizer.apply_chat_template(
            dicts, add_generation_prompt=generation_prompt, tokenize=False, **template_kwargs
        )
    except Exception:
        if not any(d["role"] == "tool" for d in dicts):
            raise
        # A strict template without tool syntax (user / assistant turns only): tool results
        # go in as user turns, still wrapped in <tool_response>.
        dicts = [{**d, "role": "user"} if d["role"] == "tool" else d for d in dicts]
        return tokenizer.apply_chat_template(
            dicts, add_generation_prompt=generation_prompt, tokenize=False, **template_kwargs
        )


def transcript(dicts: Sequence[dict[str, str]]) -> str:
    names = {"system": "System", "user": "User", "assistant": "Assistant", "tool": "Tool"}
    blocks = [f"{names.get(d['role'], d['role'].title())}: {d['content']}" for d in dicts]
    return "\n\n".join([*blocks, "Assistant:"])
