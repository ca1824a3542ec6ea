"""A thinking model's reasoning is split out of ``content`` (``reasoning``): a random-weight
Qwen 3 model with a template written here whose generation prompt opens ``<think>`` unless
``enable_thinking`` is False (as Qwen 3's does): what it writes is reasoning until it
closes the tag, in ``invoke`` and in ``stream`` alike; ``chat_template_kwargs`` reach the
template. (mlx-lm passes ``enable_thinking`` itself: True where the vocabulary has think
tokens, as Qwen 3's does; SmolLM2's tokenizer, used here, has none, so the tests say it.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage

from langchain_agent_memory import ChatAgentMemory
from langchain_agent_memory.engine.model.loading import LoadedModel
from langchain_agent_memory.testing.random_model import SMALL_CONFIGS, write_random_model

THINKING = """{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% else %}<think>
{% endif %}{% endif %}"""


@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory, smollm: LoadedModel) -> Path:
    out = write_random_model(
        SMALL_CONFIGS["qwen3"], tmp_path_factory.mktemp("thinker") / "m", smollm.path, seed=5
    )
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = THINKING
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    (out / "chat_template.jinja").unlink(missing_ok=True)
    return out


def test_reasoning_goes_to_reasoning_content(thinker: Path, tmp_path: Path) -> None:
    thinking = {"enable_thinking": True}
    llm = ChatAgentMemory(
        model=str(thinker), cache_dir=str(tmp_path), max_tokens=12, chat_template_kwargs=thinking
    )
    assert llm.profile is not None and llm.profile["reasoning_output"]
    question = [HumanMessage("List three colors.")]  # (some prompts get only whitespace from these weights)
    reply = llm.invoke(question, agent_id="a")
    thought = reply.additional_kwargs.get("reasoning_content")
    assert thought and reply.content == ""  # random weights never close the tag in 12 tokens
    assert {"type": "reasoning", "reasoning": thought} in reply.content_blocks
    # streamed: the same reasoning, in reasoning chunks
    chunks = list(llm.stream(question, agent_id="b"))
    total: AIMessageChunk = chunks[0]
    for c in chunks[1:]:
        total += c
    assert total.additional_kwargs.get("reasoning_content") == thought and total.content == ""
    # left in the content when asked
    raw = ChatAgentMemory(
        model=str(thinker),
        cache_dir=str(tmp_path),
        max_tokens=12,
        reasoning=False,
        chat_template_kwargs=thinking,
    )
    kept = raw.invoke(question, agent_id="c")
    assert kept.content == thought or thought in str(kept.content)


def test_chat_template_kwargs_reach_the_template(thinker: Path, tmp_path: Path) -> None:
    llm = ChatAgentMemory(
        model=str(thinker),
        cache_dir=str(tmp_path),
        max_tokens=6,
        chat_template_kwargs={"enable_thinking": False},
    )
    reply = llm.invoke([HumanMessage("What is 2 + 2?")], agent_id="d")
    assert isinstance(reply, AIMessage) and "reasoning_content" not in reply.additional_kwargs
    assert reply.content  # the answer, not reasoning
    # per call, too
    thinking = llm.invoke(
        [HumanMessage("And 3 + 3?")], agent_id="e", chat_template_kwargs={"enable_thinking": True}
    )
    assert thinking.additional_kwargs.get("reasoning_content") and thinking.content == ""


def test_server_replies_carry_reasoning_content() -> None:
    """OpenAI-compatible replies give the reasoning as ``reasoning_content`` (vLLM, llama.cpp
    and DeepSeek's convention), whole and streamed."""
    from langchain_agent_memory.server import replies

    message = AIMessage(content="4", additional_kwargs={"reasoning_content": "2 + 2 = 4."})
    whole = replies.completion("id", "m", message)["choices"][0]["message"]
    assert whole["reasoning_content"] == "2 + 2 = 4." and whole["content"] == "4"
    writer = replies.ChunkWriter("id", "m", include_usage=False)
    deltas = [
        c["choices"][0]["delta"]
        for c in writer.text(AIMessageChunk(content="", additional_kwargs={"reasoning_content": "2 + 2"}))
    ]
    deltas += [
        c["choices"][0]["delta"] for c in writer.text(AIMessageChunk(content="4", chunk_position="last"))
    ]
    assert deltas[0] == {"reasoning_content": "2 + 2"} and {"content": "4"} in deltas
