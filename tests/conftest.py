"""Shared fixtures: each real model is loaded once per test session."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from langchain_agent_memory.engine.engine import Engine, GenerationParams, GenerationResult
from langchain_agent_memory.engine.model.loading import LoadedModel, load_model


@pytest.fixture(scope="session")
def smollm() -> LoadedModel:
    """SmolLM2-135M-Instruct, the default chat model (converted once into the cache dir)."""
    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def gemma() -> LoadedModel:
    """Gemma 3 270M, the base model with sliding-window attention."""
    return load_model("gemma3-270m")


def run_together(
    engine: Engine, prompts: dict[str, str], params: GenerationParams
) -> dict[str, GenerationResult]:
    """Each agent's prompt on its own thread, all released at once (a barrier): the
    engine runs them concurrently, their decode steps batched."""
    results: dict[str, GenerationResult] = {}
    barrier = threading.Barrier(len(prompts))

    def run(agent: str) -> None:
        barrier.wait()
        results[agent] = engine.generate(agent, prompts[agent], params)

    threads = [threading.Thread(target=run, args=(a,)) for a in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


@pytest.fixture(scope="session")
def together() -> Callable[[Engine, dict[str, str], GenerationParams], dict[str, GenerationResult]]:
    """``run_together``: several agents' requests released at once."""
    return run_together


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
