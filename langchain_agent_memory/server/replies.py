"""LangChain reply messages -> OpenAI Chat Completions objects (``chat.completion`` and
the ``chat.completion.chunk`` stream).

Besides the standard fields, each reply carries ``agent_memory``: the agent, what its
cache gave (``cold``, ``hot-extend``, ``warm-exact``, ...) and the server-side times, so a
client sees whether it was served from memory.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from langchain_core.messages import AIMessage, AIMessageChunk

from ..engine import GenerationResult, StreamChunk

#: Engine finish reasons -> OpenAI's (a timeout ends the reply early, as a length limit does).
_FINISH = {"stop": "stop", "length": "length", "timeout": "length", "cancelled": "stop"}
#: response_metadata keys copied into ``agent_memory``.
_META = (
    "agent_id",
    "cache",
    "loaded_from",
    "cached_tokens",
    "cache_saved",
    "time_to_first_token_s",
    "prefill_s",
    "decode_s",
)


def new_id(prefix: str = "chatcmpl-") -> str:
    return prefix + uuid.uuid4().hex[:24]


def usage(message: AIMessage) -> dict[str, Any]:
    u = message.usage_metadata or {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0}
    cached = (u.get("input_token_details") or {}).get("cache_read", 0)
    return {
        "prompt_tokens": u["input_tokens"],
        "completion_tokens": u["output_tokens"],
        "total_tokens": u["total_tokens"],
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def finish_reason(message: AIMessage) -> str:
    """OpenAI's: ``tool_calls`` for a reply that calls a tool, ``length`` for one cut short
    (a call it was making is returned as far as it went, see ``tool_calls``)."""
    reason = _FINISH.get(message.response_metadata.get("finish_reason", "stop"), "stop")
    if message.tool_calls or (message.invalid_tool_calls and reason != "length"):
        return "tool_calls"
    return reason


def agent_memory(message: AIMessage) -> dict[str, Any]:
    return {k: message.response_metadata[k] for k in _META if k in message.response_metadata}


def tool_calls(message: AIMessage) -> list[dict[str, Any]]:
    """The reply's calls; one that did not parse (a forced call cut off by ``max_tokens``)
    with its arguments' text as far as it went, as OpenAI returns it (``ChatOpenAI`` makes
    it an ``invalid_tool_calls`` entry)."""
    valid = [(c["id"], c["name"], json.dumps(c["args"], ensure_ascii=False)) for c in message.tool_calls]
    invalid = [(c["id"], c["name"] or "", c["args"] or "") for c in message.invalid_tool_calls]
    return [
        {"id": cid or new_id("call_"), "type": "function", "function": {"name": name, "arguments": args}}
        for cid, name, args in valid + invalid
    ]


def completion(cid: str, model: str, message: AIMessage) -> dict[str, Any]:
    """A whole ``chat.completion``."""
    reply: dict[str, Any] = {"role": "assistant", "content": message.text or None}
    thought = message.additional_kwargs.get("reasoning_content")
    if thought:  # as vLLM, llama.cpp and DeepSeek's API return a thinking model's reasoning
        reply["reasoning_content"] = thought
    calls = tool_calls(message)
    if calls:
        reply["tool_calls"] = calls
    elif reply["content"] is None:
        reply["content"] = ""
    return {
        "id": cid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": 0, "message": reply, "finish_reason": finish_reason(message), "logprobs": None}
        ],
        "usage": usage(message),
        "agent_memory": agent_memory(message),
    }


class ChunkWriter:
    """``chat.completion.chunk`` objects for one streamed reply."""

    def __init__(self, cid: str, model: str, include_usage: bool) -> None:
        self.cid, self.model, self.include_usage = cid, model, include_usage
        self.created = int(time.time())

    def _chunk(self, delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        return {
            "id": self.cid,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            **extra,
        }

    def first(self) -> dict[str, Any]:
        return self._chunk({"role": "assistant", "content": ""})

    def text(self, chunk: AIMessageChunk) -> list[dict[str, Any]]:
        """The chunks for one LangChain chunk (the last one closes the reply)."""
        thought = chunk.additional_kwargs.get("reasoning_content")
        out = [self._chunk({"reasoning_content": thought})] if thought else []
        if chunk.text:
            out.append(self._chunk({"content": chunk.text}))
        if chunk.chunk_position != "last":
            return out
        whole = AIMessage(
            content="",
            tool_calls=chunk.tool_calls,
            usage_metadata=chunk.usage_metadata,
            response_metadata=chunk.response_metadata,
        )
        return out + self.close(whole)

    def whole(self, message: AIMessage) -> list[dict[str, Any]]:
        """The chunks after ``first`` for a reply generated whole (a forced tool call)."""
        return [*([self._chunk({"content": message.text})] if message.text else []), *self.close(message)]

    def close(self, whole: AIMessage) -> list[dict[str, Any]]:
        """The last chunks: the reply's tool calls (all of it is known now), the finish
        reason, the usage if asked for."""
        out = []
        calls = tool_calls(whole)
        if calls:
            out.append(self._chunk({"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}))
        out.append(self._chunk({}, finish_reason(whole), agent_memory=agent_memory(whole)))
        if self.include_usage:
            out.append({**self._chunk({}), "choices": [], "usage": usage(whole)})
        return out


# ------------------------------------------------------------------ plain completions


def text_completion(cid: str, model: str, result: GenerationResult) -> dict[str, Any]:
    """``POST /v1/completions``'s reply (``text_completion``) from an engine result."""
    return {
        "id": cid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": 0, "text": result.text, "logprobs": None, "finish_reason": _text_finish(result)}
        ],
        "usage": text_usage(result),
        "agent_memory": {
            "cache": str(result.outcome),
            "loaded_from": result.outcome.loaded_from,
            "cached_tokens": result.reused_tokens,
            "cache_saved": result.saved,
            "time_to_first_token_s": round(result.timings.ttft_s, 4),
        },
    }


def text_chunks(cid: str, model: str, chunk: StreamChunk, include_usage: bool) -> list[dict[str, Any]]:
    """What one engine stream chunk of a plain completion sends: its text (the last one with
    the finish reason), then the usage chunk if asked for."""
    out = [text_chunk(cid, model, chunk.text, chunk.result)] if chunk.text or chunk.result else []
    if chunk.result is not None and include_usage:
        out.append({**text_chunk(cid, model, ""), "choices": [], "usage": text_usage(chunk.result)})
    return out


def text_chunk(cid: str, model: str, text: str, result: GenerationResult | None = None) -> dict[str, Any]:
    """One streamed piece of a plain completion (the last carries the finish reason)."""
    finish = _text_finish(result) if result is not None else None
    return {
        "id": cid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
    }


def text_usage(result: GenerationResult) -> dict[str, Any]:
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": result.prompt_tokens + result.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": result.reused_tokens},
    }


def _text_finish(result: GenerationResult) -> str:
    return _FINISH.get(result.finish_reason, "stop")
