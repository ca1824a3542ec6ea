"""Shared fixtures: each real model is loaded once per test session."""

from __future__ import annotations

import pytest

from langchain_agent_memory.engine.model.loading import LoadedModel, load_model


@pytest.fixture(scope="session")
def smollm() -> LoadedModel:
    """SmolLM2-135M-Instruct, the default chat model (converted once into the cache dir)."""
    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def gemma() -> LoadedModel:
    """Gemma 3 270M, the base model with sliding-window attention."""
    return load_model("gemma3-270m")


#: Figures a test measured (kills, detections, ...), printed after the run: name -> text.
FIGURES: dict[str, str] = {}


@pytest.fixture(scope="session")
def figures() -> dict[str, str]:
    return FIGURES


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if FIGURES:
        terminalreporter.section("measured figures")
        for name, text in FIGURES.items():
            terminalreporter.write_line(f"{name}: {text}")
