"""LangChain reply messages -> OpenAI Responses objects: a whole ``response`` and the SSE
events of a streamed one (``response.created``, ``response.in_progress``, per output item
``response.output_item.added`` / its deltas / ``...done``, ``response.completed`` or
``response.incomplete``), each numbered (``sequence_number``).

Output items: the reasoning of a thinking model (``reasoning``), the text (``message`` with
one ``output_text`` part), the calls (``function_call``). ``usage.input_tokens_details.
cached_tokens`` are the prompt tokens the agent's cache gave. Each response also carries
``agent_memory`` (the agent, what its cache gave, the times), as chat completions do.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from langchain_core.messages import AIMessage, AIMessageChunk

from .replies import agent_memory, new_id, tool_calls


def usage(reply: AIMessage) -> dict[str, Any]:
    u = reply.usage_metadata or {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0}
    cached = (u.get("input_token_details") or {}).get("cache_read", 0)
    return {
        "input_tokens": u["input_tokens"],
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": u["output_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u["total_tokens"],
    }


def skeleton(rid: str, request: dict[str, Any], created: int) -> dict[str, Any]:
    """A response in progress: what ``response.created`` carries, and what the final one
    fills in (``finished``). ``request``: the request's echoed fields."""
    return {
        "id": rid, "object": "response", "created_at": created, "status": "in_progress", "error": None,
        "incomplete_details": None, "output": [], "usage": None, "parallel_tool_calls": True,
        "text": {"format": {"type": "text"}}, "truncation": "disabled",
        "reasoning": {"effort": None, "summary": None},
        **request,
    }  # fmt: skip


def finished(base: dict[str, Any], output: list[dict[str, Any]], reply: AIMessage) -> dict[str, Any]:
    """The whole response once ``reply`` is done."""
    cut = reply.response_metadata.get("finish_reason") in ("length", "timeout")
    return {
        **base,
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "output": output,
        "usage": usage(reply),
        "agent_memory": agent_memory(reply),
    }


class OutputWriter:
    """A reply's output items, built as its pieces come (streamed: each piece's events).
    ``call_name``: a called tool's ``name`` (and ``namespace``) as the client named it
    (``responses_protocol.ToolSet.call_name``)."""

    def __init__(self, call_name: Callable[[str], dict[str, str]] | None = None) -> None:
        self.call_name = call_name or (lambda name: {"name": name})
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # closed ones
        self.open: dict[str, Any] | None = None  # the item being streamed

    def event(self, kind: str, **data: Any) -> dict[str, str]:
        """One SSE event as ``sse_starlette`` sends it, numbered."""
        self.seq += 1
        payload = {"type": kind, "sequence_number": self.seq, **data}
        return {"event": kind, "data": json.dumps(payload, ensure_ascii=False)}

    def start(self, base: dict[str, Any]) -> list[dict[str, str]]:
        return [
            self.event("response.created", response=base),
            self.event("response.in_progress", response=base),
        ]

    def chunk(self, chunk: AIMessageChunk) -> list[dict[str, str]]:
        """The events of one LangChain chunk, the last excepted (``close``)."""
        out = []
        thought = chunk.additional_kwargs.get("reasoning_content")
        if thought:
            out += self._piece("reasoning", thought)
        if chunk.text:
            out += self._piece("message", chunk.text)
        return out

    def whole(self, reply: AIMessage) -> list[dict[str, str]]:
        """The events of a reply generated whole, its calls excepted (``close``)."""
        return self.chunk(AIMessageChunk(reply.text, additional_kwargs=reply.additional_kwargs))

    def close(self, reply: AIMessage) -> list[dict[str, str]]:
        """The open item closed, then the calls (known whole now) as items."""
        out = self._end()
        for call in tool_calls(reply):
            fn = call["function"]
            item = {
                "type": "function_call",
                "id": new_id("fc_"),
                "call_id": call["id"],
                **self.call_name(fn["name"]),
                "arguments": fn["arguments"],
                "status": "completed",
            }
            at, where = len(self.items), {"item_id": item["id"], "output_index": len(self.items)}
            opening = {**item, "arguments": "", "status": "in_progress"}
            out.append(self.event("response.output_item.added", output_index=at, item=opening))
            out.append(self.event("response.function_call_arguments.delta", **where, delta=fn["arguments"]))
            done = {"name": item["name"], "arguments": fn["arguments"]}
            out.append(self.event("response.function_call_arguments.done", **where, **done))
            out.append(self.event("response.output_item.done", output_index=at, item=item))
            self.items.append(item)
        return out

    def _piece(self, kind: str, text: str) -> list[dict[str, str]]:
        out = []
        if self.open is None or self.open["type"] != kind:
            out += self._end()
            self.open = _new_item(kind)
            at = len(self.items)
            out.append(self.event("response.output_item.added", output_index=at, item=_empty(self.open)))
            if kind == "message":
                part = {"type": "output_text", "text": "", "annotations": []}
                out.append(self.event("response.content_part.added", item_id=self.open["id"], output_index=at,
                                      content_index=0, part=part))  # fmt: skip
        part = self.open["content"][0]
        part["text"] += text
        delta = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        out.append(self.event(delta, item_id=self.open["id"], output_index=len(self.items), content_index=0,
                              delta=text, **({"logprobs": []} if kind == "message" else {})))  # fmt: skip
        return out

    def _end(self) -> list[dict[str, str]]:
        item = self.open
        if item is None:
            return []
        at, part = len(self.items), item["content"][0]
        where = {"item_id": item["id"], "output_index": at, "content_index": 0}
        if item["type"] == "message":
            out = [self.event("response.output_text.done", **where, text=part["text"], logprobs=[]),
                   self.event("response.content_part.done", **where, part=part)]  # fmt: skip
        else:
            out = [self.event("response.reasoning_text.done", **where, text=part["text"])]
        item["status"] = "completed"
        out.append(self.event("response.output_item.done", output_index=at, item=item))
        self.items.append(item)
        self.open = None
        return out


def _new_item(kind: str) -> dict[str, Any]:
    if kind == "reasoning":
        return {"type": "reasoning", "id": new_id("rs_"), "summary": [],
                "content": [{"type": "reasoning_text", "text": ""}]}  # fmt: skip
    return {"type": "message", "id": new_id("msg_"), "status": "in_progress", "role": "assistant",
            "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}  # fmt: skip


def _empty(item: dict[str, Any]) -> dict[str, Any]:
    """An item as it opens (no content yet)."""
    return {**item, "content": []}


def created_now() -> int:
    return int(time.time())


def input_items_page(
    rid: str, items: list[dict[str, Any]], order: str, after: str | None, limit: int
) -> dict[str, Any]:
    """``GET /v1/responses/{id}/input_items``: the input items a response was made from, as
    OpenAI lists them (newest first unless ``order`` is ``asc``; ``after`` an item id, ``limit``
    a page). An item the client sent without an id gets one from the response's id and its
    place, the same at every read. ``KeyError``: ``after`` is not one of them."""
    listed = [_listed(rid, i, item) for i, item in enumerate(items)]
    if order == "desc":
        listed.reverse()
    if after is not None:
        at = next((k for k, item in enumerate(listed) if item["id"] == after), None)
        if at is None:
            raise KeyError(after)
        listed = listed[at + 1 :]
    page = listed[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(listed) > limit,
    }


def _listed(rid: str, index: int, item: dict[str, Any]) -> dict[str, Any]:
    kind = item.get("type", "message")
    out = {"type": kind, **item}
    if kind == "message":
        if isinstance(out.get("content"), str):
            text_type = "output_text" if out.get("role") == "assistant" else "input_text"
            out["content"] = [{"type": text_type, "text": out["content"]}]
        out.setdefault("status", "completed")
    out.setdefault("id", f"{'msg' if kind == 'message' else 'item'}_{rid.removeprefix('resp_')}_{index}")
    return out
