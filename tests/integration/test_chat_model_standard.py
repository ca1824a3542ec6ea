"""LangChain's standard chat-model suites on the real default model (SmolLM2-135M).

An ``xfail`` here is a test the 135M model fails on what it *says*, never on the plumbing;
each reason states what the model did (measured when the mark was written).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from langchain_agent_memory import ChatAgentMemory


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


class TestChatAgentMemoryIntegration(ChatModelIntegrationTests):
    @pytest.fixture(autouse=True)
    def _cache_dir(self, cache_dir: Path) -> None:
        self._dir = str(cache_dir)

    @property
    def chat_model_class(self) -> type[ChatAgentMemory]:
        return ChatAgentMemory

    @property
    def chat_model_params(self) -> dict:
        return {"model": "smollm2-135m", "cache_dir": self._dir}

    @property
    def model_override_value(self) -> str:
        return "gemma3-270m"

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True
