"""Shared fixtures: each real model is loaded once per test session."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

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


def _postgres_bin(name: str) -> str | None:
    import glob
    import shutil

    found = shutil.which(name) or sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return found if isinstance(found, str) else (found[-1] if found else None)


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A real PostgreSQL server for the session, on a unix socket in a temp directory (it
    refuses to run as root: started as the ``postgres`` user). ``.ci/run`` installs it; where
    it is missing the tests that need it are skipped, unless ``AGENT_MEMORY_REQUIRE_SERVICES``
    is set (CI), where that fails them."""
    import os
    import subprocess
    import tempfile
    from pathlib import Path

    initdb, pg_ctl = _postgres_bin("initdb"), _postgres_bin("pg_ctl")
    if initdb is None or pg_ctl is None:
        message = "PostgreSQL is not installed (Debian: apt-get install postgresql-15)"
        if os.environ.get("AGENT_MEMORY_REQUIRE_SERVICES"):
            pytest.fail(message)
        pytest.skip(message)
    # Not under pytest's temp root: the postgres user cannot enter that (mode 0700).
    root = Path(tempfile.mkdtemp(prefix="agent-memory-pg-"))
    root.chmod(0o777)
    as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    subprocess.run([*as_user, initdb, "-D", str(root / "data"), "-A", "trust", "-U", "postgres"],
                   check=True, capture_output=True)  # fmt: skip
    options = f"-k {root} -c listen_addresses='' -c fsync=off"
    subprocess.run([*as_user, pg_ctl, "-D", str(root / "data"), "-o", options, "-l", str(root / "log"), "-w",
                    "start"], check=True, capture_output=True)  # fmt: skip
    try:
        yield f"postgresql:///postgres?host={root}&user=postgres"
    finally:
        subprocess.run(
            [*as_user, pg_ctl, "-D", str(root / "data"), "-m", "immediate", "stop"], capture_output=True
        )
