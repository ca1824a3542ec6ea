"""Each model's own tool-call format (``tool_formats``): random-weight models of four
families, each given a chat template written here in its family's tool syntax, get their
tools through the template, forced calls decoded in that syntax (so even random weights
produce a valid call), calls and results written back as the template expects; SmolLM2's
plain ChatML keeps the Hermes fallback."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from tool_templates import CASES

from langchain_agent_memory import ChatAgentMemory
from langchain_agent_memory.chat import prompt
from langchain_agent_memory.chat.tool_formats import HERMES, tool_format
from langchain_agent_memory.engine.model.loading import LoadedModel
from langchain_agent_memory.testing.random_model import SMALL_CONFIGS, write_random_model


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


@pytest.fixture(scope="module")
def family_model(tmp_path_factory: pytest.TempPathFactory, smollm: LoadedModel) -> Callable[[str], Path]:
    root = tmp_path_factory.mktemp("tool-formats")
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            out = write_random_model(SMALL_CONFIGS[family], root / family, smollm.path, seed=3)
            config_path = out / "tokenizer_config.json"
            config = json.loads(config_path.read_text())
            config["chat_template"] = CASES[family][0]
            config_path.write_text(json.dumps(config))
            (out / "chat_template.jinja").unlink(missing_ok=True)
            built[family] = out
        return built[family]

    return get


@pytest.mark.parametrize("family", sorted(CASES))
def test_each_family_calls_tools_in_its_own_format(
    family: str, family_model: Callable[[str], Path], tmp_path: Path
) -> None:
    _, fmt_name, listing = CASES[family]
    llm = ChatAgentMemory(model=str(family_model(family)), cache_dir=str(tmp_path), max_tokens=300)
    tok = llm.engine.tokenizer
    fmt = tool_format(tok)
    assert fmt.name == fmt_name and fmt.native
    question = [SystemMessage("You check the weather."), HumanMessage("Weather in Paris?")]
    rendered = prompt.render(tok, question, [_openai(get_weather)])
    assert listing in rendered and "get_weather" in rendered
    assert prompt.TOOLS_PREAMBLE not in rendered  # the template's listing, not the Hermes fallback
    # A forced call: decoded in the family's syntax, so it parses even from random weights.
    reply = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(question)
    assert reply.tool_calls and reply.tool_calls[0]["name"] == "get_weather", reply
    assert isinstance(reply.tool_calls[0]["args"].get("city"), str)
    # The call and its result go back through the template (Mistral's 9-character ids too).
    result = ToolMessage("sunny, 24 C", tool_call_id=reply.tool_calls[0]["id"], name="get_weather")
    history = [*question, reply, result]
    again = llm.bind_tools([get_weather]).invoke(history, max_tokens=4)
    assert again.usage_metadata is not None and again.usage_metadata["input_tokens"] > 0


def test_smollm2_keeps_the_hermes_fallback(smollm: LoadedModel) -> None:
    assert tool_format(smollm.tokenizer) is HERMES
    rendered = prompt.render(smollm.tokenizer, [HumanMessage("Weather?")], [_openai(get_weather)])
    assert prompt.TOOLS_PREAMBLE in rendered


def _openai(t: object) -> dict:
    from langchain_core.utils.function_calling import convert_to_openai_tool

    return convert_to_openai_tool(t)  # type: ignore[arg-type]


def test_ai_messages_without_calls_render_as_text(
    family_model: Callable[[str], Path], tmp_path: Path
) -> None:
    llm = ChatAgentMemory(model=str(family_model("qwen3")), cache_dir=str(tmp_path), max_tokens=2)
    rendered = prompt.render(
        llm.engine.tokenizer, [HumanMessage("Hi"), AIMessage("Hello!"), HumanMessage("Bye")]
    )
    assert "Hello!" in rendered and "<tool_call>" not in rendered.split("Hello!")[1]
