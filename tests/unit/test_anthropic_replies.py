"""A thinking model's reply in Anthropic's shapes: its reasoning as a ``thinking`` block
before the text, in the whole message and in the stream's events (no model needed: the
shipped ones do not think)."""

from __future__ import annotations

import json

from langchain_core.messages import AIMessage, AIMessageChunk

from langchain_agent_memory.server.anthropic_replies import EventWriter, message

META = {"finish_reason": "stop", "stop_sequence": None, "cache": "hot-extend"}
USAGE = {
    "input_tokens": 50,
    "output_tokens": 7,
    "total_tokens": 57,
    "input_token_details": {"cache_read": 40},
}


def test_a_reasoning_reply_is_a_thinking_block_then_text() -> None:
    reply = AIMessage(
        "Paris.", additional_kwargs={"reasoning_content": "The capital of France."},
        usage_metadata=USAGE, response_metadata=META,
    )  # fmt: skip
    out = message("msg_1", "m", reply)
    assert [b["type"] for b in out["content"]] == ["thinking", "text"]
    assert out["content"][0]["thinking"] == "The capital of France."
    assert out["usage"] == {"input_tokens": 0, "output_tokens": 7, "cache_read_input_tokens": 40,
                            "cache_creation_input_tokens": 10}  # fmt: skip
    assert out["stop_reason"] == "end_turn" and out["agent_memory"]["cache"] == "hot-extend"


def test_streamed_reasoning_closes_its_block_before_the_text_opens() -> None:
    writer = EventWriter("msg_1", "m")
    events = writer.start()
    events += writer.chunk(AIMessageChunk("", additional_kwargs={"reasoning_content": "Think."}))
    events += writer.chunk(AIMessageChunk("Par"))
    events += writer.chunk(
        AIMessageChunk("is.", chunk_position="last", usage_metadata=USAGE, response_metadata=META)
    )
    seen = [(e["event"], json.loads(e["data"])) for e in events]
    kinds = [k for k, _ in seen]
    assert kinds == [
        "message_start",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop",
    ]  # fmt: skip
    assert seen[1][1]["content_block"]["type"] == "thinking" and seen[1][1]["index"] == 0
    assert seen[3][1]["delta"]["type"] == "signature_delta"
    assert seen[5][1]["content_block"]["type"] == "text" and seen[5][1]["index"] == 1
    assert seen[9][1]["delta"]["stop_reason"] == "end_turn"
