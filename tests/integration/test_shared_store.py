"""Workers on several hosts share agents through PostgreSQL and an S3-compatible object
store (``storage.shared``), against real servers the tests start (``services``): each
worker is a separate process with a local cache directory of its own."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from langchain_agent_memory.engine.engine import Engine, GenerationParams

WORKER = Path(__file__).parent / "shared_worker.py"
SYSTEM = "You are a careful assistant. " * 100


class Worker:
    """A worker process (``shared_worker.py``) driven over its stdin/stdout."""

    def __init__(self, cache_dir: Path, store: tuple[str, str], kv_bits: str = "16") -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), str(cache_dir), *store, kv_bits],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert json.loads(self._line()) == {"ready": True}

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited with {self.proc.wait()}")
        return line

    def __call__(self, op: str, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        reply = json.loads(self._line())
        if "error" in reply:
            raise RuntimeError(reply["trace"])
        return reply

    def generate(self, agent: str, prompt: str, max_tokens: int = 8) -> dict[str, Any]:
        return self("generate", agent=agent, prompt=prompt, max_tokens=max_tokens)

    def close(self) -> None:
        if self.proc.poll() is None:
            self("quit")
            self.proc.wait(timeout=60)


@pytest.fixture
def workers(tmp_path: Path, shared_store: tuple[str, str]) -> Iterator[Any]:
    made: list[Worker] = []

    def make(name: str, kv_bits: str = "16") -> Worker:
        made.append(Worker(tmp_path / name, shared_store, kv_bits))
        return made[-1]

    yield make
    for w in made:
        w.close()


def test_a_turn_on_one_worker_resumes_warm_on_another(workers: Any, tmp_path: Path) -> None:
    a, b = workers("a"), workers("b")
    turn1 = SYSTEM + "User: name three colours.\nAssistant:"
    first = a.generate("agent", turn1)
    turn2 = turn1 + first["text"] + "\nUser: and three animals?\nAssistant:"
    second = b.generate("agent", turn2)
    assert second["outcome"].startswith("warm"), second
    assert second["reused"] >= 0.95 * second["prompt_tokens"], second
    # The oracle: one worker alone, on a local store, at 16-bit KV.
    with Engine("smollm2-135m", cache_dir=tmp_path / "alone", kv_bits=None) as alone:
        solo1 = alone.generate("agent", turn1, GenerationParams(max_tokens=8))
        solo2 = alone.generate("agent", turn2, GenerationParams(max_tokens=8))
    assert (first["text"], second["text"]) == (solo1.text, solo2.text)
