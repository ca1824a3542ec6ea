"""The Hermes / Qwen tool format and LangChain messages as chat-template dicts: what
``prompt`` renders with and what ``tool_formats`` builds on (see ``prompt`` for the format).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from typing import Any

from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.messages.tool import InvalidToolCall, ToolCall

TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
TOOLS_INSTRUCTION = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>\n", "\n</tool_call>"
#: Where a transcript-rendered turn ends: a stop sequence for base models.
TRANSCRIPT_TURN_END = "\n\nUser:"

_TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def text_of(content: str | list[Any]) -> str:
    """The text of a message's content (a string, or a list of parts of which the text
    parts are kept); non-text parts are refused, since the shipped models read text only."""
    if isinstance(content, str):
        return content
    out = []
    for part in content:
        if isinstance(part, str):
            out.append(part)
        elif isinstance(part, dict) and part.get("type") in ("text", "text-plain") and "text" in part:
            out.append(str(part["text"]))
        elif isinstance(part, dict) and part.get("type") in ("tool_use", "tool_call", "reasoning"):
            continue  # carried in AIMessage.tool_calls / not shown to the model again
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(
                f"message content part of type {kind!r} is not supported: this model reads text only"
            )
    return "".join(out)


def tool_call_text(call: ToolCall | dict[str, Any]) -> str:
    payload = {"name": call["name"], "arguments": call.get("args", {})}
    return TOOL_CALL_OPEN + json.dumps(payload, ensure_ascii=False) + TOOL_CALL_CLOSE


def tools_system_text(tools: Sequence[dict[str, Any]]) -> str:
    """The tool listing appended to the system message (OpenAI-format tool dicts)."""
    lines = [json.dumps(t, ensure_ascii=False, sort_keys=True) for t in tools]
    return TOOLS_PREAMBLE + "\n".join(lines) + TOOLS_INSTRUCTION


def schema_system_text(schema: dict[str, Any]) -> str:
    """The instruction appended to the system message for JSON-schema output."""
    return "Reply with one JSON object that satisfies this JSON schema:\n" + json.dumps(
        schema, sort_keys=True
    )


def to_dicts(
    messages: Sequence[BaseMessage],
    tools: Sequence[dict[str, Any]] | None,
    response_schema: dict[str, Any] | None = None,
) -> list[dict[str, str]]:
    """Role / content dicts for a chat template; tools (or the schema a JSON reply must
    follow) go into the first system message."""
    out: list[dict[str, str]] = []
    for m in messages:
        if isinstance(m, SystemMessage):
            out.append({"role": "system", "content": text_of(m.content)})
        elif isinstance(m, HumanMessage):
            out.append({"role": "user", "content": text_of(m.content)})
        elif isinstance(m, AIMessage):
            parts = [text_of(m.content)] + [tool_call_text(c) for c in m.tool_calls]
            out.append({"role": "assistant", "content": "\n".join(p for p in parts if p)})
        elif isinstance(m, ToolMessage):
            out.append(
                {"role": "tool", "content": f"<tool_response>\n{text_of(m.content)}\n</tool_response>"}
            )
        elif isinstance(m, ChatMessage):
            out.append({"role": m.role, "content": text_of(m.content)})
        else:
            raise ValueError(f"unsupported message type {type(m).__name__}")
    listing = tools_system_text(tools) if tools else None
    if response_schema is not None:
        listing = schema_system_text(response_schema)
    if listing:
        with_listing(out, listing)
    return out


def with_listing(dicts: list[dict[str, Any]], listing: str) -> None:
    """Append ``listing`` to the first system message (one is inserted if there is none)."""
    if dicts and dicts[0]["role"] == "system":
        dicts[0] = {**dicts[0], "content": dicts[0]["content"] + "\n\n" + listing}
    else:
        dicts.insert(0, {"role": "system", "content": listing})


def parse_reply(text: str) -> tuple[str, list[ToolCall], list[InvalidToolCall]]:
    """Split a reply into its text and the tool calls it makes (Hermes format)."""
    calls: list[ToolCall] = []
    invalid: list[InvalidToolCall] = []
    for raw in _TOOL_CALL_RE.findall(text):
        call_id = "call_" + uuid.uuid4().hex[:24]
        try:
            payload = json.loads(raw)
            name, args = payload["name"], payload.get("arguments", payload.get("parameters", {}))
            if isinstance(args, str):
                args = json.loads(args)
            if not isinstance(name, str) or not isinstance(args, dict):
                raise TypeError("name must be a string and arguments an object")
            calls.append(ToolCall(name=name, args=args, id=call_id, type="tool_call"))
        except (ValueError, KeyError, TypeError) as exc:
            invalid.append(
                InvalidToolCall(
                    name=None,
                    args=raw,
                    id=call_id,
                    error=f"unparsable tool call: {exc}",
                    type="invalid_tool_call",
                )
            )
    content = _TOOL_CALL_RE.sub("", text).strip() if (calls or invalid) else text
    return content, calls, invalid
