"""Prompt rendering and reply parsing (prompt.py) with the shipped models' real tokenizers:
the documented tool format, append-only rendering (so a next turn extends the cache), and
text-only content."""

from __future__ import annotations

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage

from langchain_agent_memory.chat import prompt
from langchain_agent_memory.engine.model.loading import LoadedModel

TOOLS = [
    {"type": "function", "function": {"name": "add", "description": "Add.", "parameters": {"type": "object"}}}
]


def test_a_generated_call_renders_back_to_the_same_text(smollm: LoadedModel) -> None:
    """What the model wrote is what the next turn's prompt shows: the cache extends."""
    generated = prompt.tool_call_text({"name": "add", "args": {"a": 2, "b": 3}})
    _, calls, _ = prompt.parse_reply(generated)
    rendered = prompt.render(smollm.tokenizer, [HumanMessage("2+3?"), AIMessage("", tool_calls=calls)])
    assert f"<|im_start|>assistant\n{generated}<|im_end|>" in rendered


def test_rendering_is_append_only(smollm: LoadedModel) -> None:
    turn1 = [SystemMessage("Be brief."), HumanMessage("Hi")]
    p1 = prompt.render(smollm.tokenizer, turn1, TOOLS)
    p2 = prompt.render(smollm.tokenizer, [*turn1, AIMessage("Hello!"), HumanMessage("Bye")], TOOLS)
    assert p2.startswith(p1 + "Hello!")


def test_tools_and_tool_results_are_shown(smollm: LoadedModel) -> None:
    msgs = [HumanMessage("2+3?"), ToolMessage("5", tool_call_id="c1")]
    text = prompt.render(smollm.tokenizer, msgs, TOOLS)
    assert text.startswith("<|im_start|>system\n# Tools") and '"name": "add"' in text
    assert "<|im_start|>tool\n<tool_response>\n5\n</tool_response>" in text


def test_base_models_get_a_transcript(gemma: LoadedModel) -> None:
    text = prompt.render(gemma.tokenizer, [SystemMessage("Be brief."), HumanMessage("Hi")])
    assert text == "System: Be brief.\n\nUser: Hi\n\nAssistant:"


def test_non_text_content_is_refused_with_a_reason(smollm: LoadedModel) -> None:
    with pytest.raises(ValueError, match="reads text only"):
        prompt.render(smollm.tokenizer, [HumanMessage([{"type": "image", "url": "x"}])])
    with pytest.raises(ValueError, match="at least one message"):
        prompt.render(smollm.tokenizer, [])
