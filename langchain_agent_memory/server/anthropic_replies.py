"""LangChain reply messages -> Anthropic Messages objects: a whole ``message``, and the SSE
events of a streamed one in Anthropic's order (``message_start``; per content block
``content_block_start``, its deltas, ``content_block_stop``; ``message_delta`` with the stop
reason and usage; ``message_stop``).

Usage: the agent's cache is the prompt cache. ``cache_read_input_tokens`` are the prompt
tokens the agent's stored cache gave (no prefill); ``cache_creation_input_tokens`` the ones
this turn prefilled, all of which the turn's save keeps for the next (so ``input_tokens``,
what was read and not cached, is 0). Their sum is the prompt, as Anthropic's clients add it
up. Each message also carries ``agent_memory`` (the agent, what its cache gave, the times),
as the chat completions replies do.
"""

from __future__ import annotations

import json
from typing import Any

from langchain_core.messages import AIMessage, AIMessageChunk

from .anthropic_protocol import tool_input
from .replies import agent_memory, new_id

#: A block as it opens, by type.
_EMPTY = {
    "thinking": {"type": "thinking", "thinking": "", "signature": ""},
    "text": {"type": "text", "text": ""},
}
#: Engine finish reasons -> Anthropic stop reasons (a timeout ends the reply early, as a
#: length limit does).
_STOP = {"stop": "end_turn", "length": "max_tokens", "timeout": "max_tokens", "cancelled": "end_turn"}


def stop_reason(message: AIMessage) -> tuple[str, str | None]:
    """The reply's ``stop_reason`` and ``stop_sequence``."""
    meta = message.response_metadata
    reason = _STOP.get(meta.get("finish_reason", "stop"), "end_turn")
    if reason == "max_tokens":
        return reason, None
    if message.tool_calls:
        return "tool_use", None
    sequence = meta.get("stop_sequence")
    return ("stop_sequence", sequence) if sequence else (reason, None)


def usage(message: AIMessage) -> dict[str, int]:
    u = message.usage_metadata or {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0}
    cached = (u.get("input_token_details") or {}).get("cache_read", 0)
    return {
        "input_tokens": 0,
        "output_tokens": u["output_tokens"],
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": max(0, u["input_tokens"] - cached),
    }


def tool_uses(message: AIMessage) -> list[dict[str, Any]]:
    """The reply's calls as ``tool_use`` blocks; one cut off by ``max_tokens`` (it did not
    parse) with the input it could read ({} if none)."""
    calls = [(c["id"], c["name"], c["args"]) for c in message.tool_calls]
    calls += [(c["id"], c["name"] or "", tool_input(c["args"])) for c in message.invalid_tool_calls]
    return [
        {"type": "tool_use", "id": cid or new_id("toolu_"), "name": name, "input": args}
        for cid, name, args in calls
    ]


def content(message: AIMessage) -> list[dict[str, Any]]:
    """The reply's content blocks: its reasoning (a thinking model's), its text, its calls."""
    blocks: list[dict[str, Any]] = []
    thought = message.additional_kwargs.get("reasoning_content")
    if thought:
        blocks.append({"type": "thinking", "thinking": thought, "signature": ""})
    if message.text:
        blocks.append({"type": "text", "text": message.text})
    return blocks + tool_uses(message)


def message(mid: str, model: str, reply: AIMessage) -> dict[str, Any]:
    """A whole Anthropic ``message``."""
    reason, sequence = stop_reason(reply)
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content(reply),
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(reply),
        "agent_memory": agent_memory(reply),
    }


def event(kind: str, **data: Any) -> dict[str, str]:
    """One SSE event as ``sse_starlette`` sends it (``event:`` line and JSON data)."""
    return {"event": kind, "data": json.dumps({"type": kind, **data}, ensure_ascii=False)}


class EventWriter:
    """The SSE events of one streamed reply: blocks opened as their first piece comes
    (reasoning before text), each closed before the next opens, the calls at the end."""

    def __init__(self, mid: str, model: str) -> None:
        self.mid, self.model = mid, model
        self.index = -1  # the open block's (-1: none yet)
        self.open: str | None = None  # its type

    def start(self) -> list[dict[str, str]]:
        head = {"id": self.mid, "type": "message", "role": "assistant", "model": self.model, "content": [],
                "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": 0, "output_tokens": 0}}  # fmt: skip
        return [event("message_start", message=head)]

    def chunk(self, chunk: AIMessageChunk) -> list[dict[str, str]]:
        """The events of one LangChain chunk (the last one closes the message)."""
        out = []
        thought = chunk.additional_kwargs.get("reasoning_content")
        if thought:
            out += self._piece("thinking", {"type": "thinking_delta", "thinking": thought})
        if chunk.text:
            out += self._piece("text", {"type": "text_delta", "text": chunk.text})
        if chunk.chunk_position != "last":
            return out
        whole = AIMessage(
            content="",
            tool_calls=chunk.tool_calls,
            invalid_tool_calls=chunk.invalid_tool_calls,
            usage_metadata=chunk.usage_metadata,
            response_metadata=chunk.response_metadata,
        )
        return out + self.close(whole)

    def whole(self, reply: AIMessage) -> list[dict[str, str]]:
        """Every event of a reply generated whole (a forced tool call)."""
        out = self.start()
        thought = reply.additional_kwargs.get("reasoning_content")
        if thought:
            out += self._piece("thinking", {"type": "thinking_delta", "thinking": thought})
        if reply.text:
            out += self._piece("text", {"type": "text_delta", "text": reply.text})
        return out + self.close(reply)

    def close(self, whole: AIMessage) -> list[dict[str, str]]:
        """The open block closed, the calls (known whole now) as blocks, the stop reason
        and usage, the end."""
        out = self._end_block()
        for use in tool_uses(whole):
            self.index += 1
            out.append(event("content_block_start", index=self.index, content_block={**use, "input": {}}))
            partial = json.dumps(use["input"], ensure_ascii=False)
            delta = {"type": "input_json_delta", "partial_json": partial}
            out.append(event("content_block_delta", index=self.index, delta=delta))
            out.append(event("content_block_stop", index=self.index))
        reason, sequence = stop_reason(whole)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        out.append(event("message_delta", delta=delta, usage=usage(whole), agent_memory=agent_memory(whole)))
        out.append(event("message_stop"))
        return out

    def _piece(self, kind: str, delta: dict[str, Any]) -> list[dict[str, str]]:
        out = []
        if self.open != kind:
            out += self._end_block()
            self.index += 1
            self.open = kind
            block = _EMPTY[kind]
            out.append(event("content_block_start", index=self.index, content_block=block))
        out.append(event("content_block_delta", index=self.index, delta=delta))
        return out

    def _end_block(self) -> list[dict[str, str]]:
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":  # a local model's reasoning carries no signature
            signed = {"type": "signature_delta", "signature": ""}
            out.append(event("content_block_delta", index=self.index, delta=signed))
        out.append(event("content_block_stop", index=self.index))
        self.open = None
        return out
