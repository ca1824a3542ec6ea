"""Shared fixtures: each real model is loaded once per test session."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

# Before mlx starts: mlx's CUDA build runs float32 matmuls of two or more rows at TF32
# precision by default (one row stays float32), so a batched decode step differs from the
# same step alone by ~3e-4 before any engine code runs (measured on the H100), and a random
# model's near-tied expert router then flips. The oracles compare at true float32.
os.environ.setdefault("MLX_ENABLE_TF32", "0")
# Before the engine is imported: every mutation of an engine's cache state must run on its
# loop thread; one from another thread raises ``OwnerError`` where it happens (``ops.owner``).
os.environ.setdefault("AGENT_MEMORY_OWNER_CHECK", "raise")

import pytest
from services import PostgresServer, SeaweedServer

from langchain_agent_memory.engine import load_model
from langchain_agent_memory.engine.engine import Engine, GenerationParams, GenerationResult
from langchain_agent_memory.engine.model.loading import LoadedModel
from langchain_agent_memory.testing.model_matrix import run_together


@pytest.fixture(scope="session")
def smollm() -> LoadedModel:
    """SmolLM2-135M-Instruct, the default chat model (converted once into the cache dir)."""
    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def gemma() -> LoadedModel:
    """Gemma 3 270M, the base model with sliding-window attention."""
    return load_model("gemma3-270m")


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


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """A real PostgreSQL server for the session (``services``)."""
    server = PostgresServer()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def postgres_url(postgres: PostgresServer) -> str:
    return postgres.url


@pytest.fixture(scope="session")
def seaweed() -> Iterator[SeaweedServer]:
    """A real S3-compatible server (SeaweedFS) for the session (``services``)."""
    server = SeaweedServer()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def shared_store(
    postgres: PostgresServer, seaweed: SeaweedServer, request: pytest.FixtureRequest
) -> tuple[str, str]:
    """``(store, blocks)`` URLs of a fresh shared store: a database and a bucket of its own."""
    import hashlib

    name = "t" + hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:16]
    return postgres.new_database(name), seaweed.new_bucket(name)
