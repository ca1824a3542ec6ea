"""LangChain's standard chat-model suites on the real default model (SmolLM2-135M).

An ``xfail`` here is a test the 135M model fails on what it *says*, never on the plumbing;
each reason states what the model did (measured when the mark was written).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import AIMessage, HumanMessage
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from langchain_agent_memory import ChatAgentMemory, corpus


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("standard-suite")


class TestChatAgentMemoryUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatAgentMemory]:
        return ChatAgentMemory

    @property
    def chat_model_params(self) -> dict:
        return {"model": "smollm2-135m"}

    @property
    def model_override_value(self) -> str:
        return "gemma3-270m"

    @pytest.mark.xfail(
        strict=True,
        reason="dumpd matches the snapshot, but the suite's load() allows only classes in "
        "langchain_core's own mapping; ChatAgentMemory loads back with allowed_objects=[ChatAgentMemory] "
        "(test_langchain_conventions.py::test_the_chat_model_serializes_and_loads_back)",
    )
    def test_serdes(self, model: Any, snapshot: Any) -> None:
        super().test_serdes(model, snapshot)


class TestChatAgentMemoryIntegration(ChatModelIntegrationTests):
    @pytest.fixture(autouse=True)
    def _cache_dir(self, cache_dir: Path) -> None:
        self._dir = str(cache_dir)

    @property
    def chat_model_class(self) -> type[ChatAgentMemory]:
        return ChatAgentMemory

    @property
    def chat_model_params(self) -> dict:
        # Free JSON strings capped at 64 characters instead of 200: SmolLM2 fills every string
        # of the suite's jokes to the cap ("The cat was a cat and it was a cat and ..."), and at
        # 200 its structured-output tests took ~5.5 of the suite's minutes.
        return {"model": "smollm2-135m", "cache_dir": self._dir, "max_string_chars": 64}

    @property
    def model_override_value(self) -> str:
        return "gemma3-270m"

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True

    @pytest.mark.parametrize("model", [{}, {"output_version": "v1"}], indirect=True)
    @pytest.mark.xfail(
        reason="SmolLM2-135M does not call a tool unless forced: asked 'What is the weather in "
        "San Francisco, CA?' with get_weather bound (tool_choice auto) it answered in text, 'The "
        "weather in San Francisco, CA, is a combination of the San Francisco Snow Fall and the San "
        "Francisco Snow City.' Forced tool_choice always yields a valid call (test_tool_choice).",
        strict=True,
    )
    def test_agent_loop(self, model: ChatAgentMemory) -> None:
        super().test_agent_loop(model)

    @property
    def supported_usage_metadata_details(self) -> dict:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        """The second of two identical calls reads all but the last prompt token from the
        cache (the last is re-run for its logits)."""
        llm = ChatAgentMemory(**self.chat_model_params, agent_id=f"cache-read-{stream}", max_tokens=4)
        messages = [HumanMessage("Summarise:\n\n" + corpus.apache_license()[:1500])]
        llm.invoke(messages)
        if not stream:
            second = llm.invoke(messages)
        else:
            chunks = list(llm.stream(messages))
            second = chunks[0]
            for c in chunks[1:]:
                second = second + c
        usage = second.usage_metadata
        assert usage is not None and usage["input_token_details"]["cache_read"] >= usage["input_tokens"] - 8
        return second  # type: ignore[return-value]
