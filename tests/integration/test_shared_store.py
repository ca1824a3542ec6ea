"""Workers on several hosts share agents through PostgreSQL and an S3-compatible object
store (``storage.shared``), against real servers the tests start (``services``): each
worker is a separate process with a local cache directory of its own."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from services import PostgresServer, SeaweedServer

from langchain_agent_memory.engine.engine import Engine, GenerationParams
from langchain_agent_memory.engine.storage.catalog import Catalog
from langchain_agent_memory.engine.storage.objects import ObjectBlocks
from langchain_agent_memory.engine.storage.store import AgentRecord

HERE = Path(__file__).parent
WORKER, GRAPH, TWO_PROCESSES = HERE / "shared_worker.py", HERE / "graph_worker.py", HERE / "concurrent_child.py"
SYSTEM = "You are a careful assistant. " * 100


class Proc:
    """A worker process driven over stdin/stdout, one JSON line each way."""

    def __init__(self, script: Path, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(script), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.receive() == {"ready": True}

    def send(self, cmd: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def receive(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited with {self.proc.wait()}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(reply["trace"])
        return reply

    def __call__(self, op: str, **args: Any) -> dict[str, Any]:
        self.send({"op": op, **args})
        return self.receive()

    def generate(self, agent: str, prompt: str, max_tokens: int = 8) -> dict[str, Any]:
        return self("generate", agent=agent, prompt=prompt, max_tokens=max_tokens)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.send({"op": "quit"})
            self.proc.wait(timeout=60)


@pytest.fixture
def workers(tmp_path: Path, shared_store: tuple[str, str]) -> Iterator[Any]:
    """``workers(name)``: a worker process on the shared store, cache directory ``name``."""
    made: list[Proc] = []

    def make(name: str, script: Path = WORKER, store: tuple[str, str] = shared_store) -> Proc:
        extra = ["16"] if script == WORKER else []
        made.append(Proc(script, str(tmp_path / name), *store, *extra))
        return made[-1]

    yield make
    for w in made:
        w.close()


def _solo(tmp_path: Path, turns: list[str]) -> list[str]:
    """The oracle: the texts one worker alone gets, on a local store, at 16-bit KV."""
    with Engine("smollm2-135m", cache_dir=tmp_path / "alone", kv_bits=None) as alone:
        return [alone.generate("agent", t, GenerationParams(max_tokens=8)).text for t in turns]


def _store_is_whole(shared_store: tuple[str, str], fingerprint: str) -> list[AgentRecord]:
    """Every record parses and names only blocks whose objects exist; returns the records."""
    catalog, objects = Catalog(shared_store[0]), ObjectBlocks(shared_store[1])
    try:
        assert catalog.dangling(fingerprint) == 0
        records = [AgentRecord.from_json(raw) for _, raw, _ in catalog.agents(fingerprint)]
        for record in records:
            for h in record.blocks:
                assert objects.get(objects.key(fingerprint, h)) is not None, (record.agent_id, h)
        return records
    finally:
        catalog.close()


def _objects_all_named(shared_store: tuple[str, str], fingerprint: str) -> None:
    catalog, objects = Catalog(shared_store[0]), ObjectBlocks(shared_store[1])
    try:
        named = {h for _, raw, _ in catalog.agents(fingerprint) for h in AgentRecord.from_json(raw).blocks}
        stored = {objects.hash_of(o.key) for o in objects.list(fingerprint)}
        assert stored == named, f"{len(stored - named)} orphan objects, {len(named - stored)} missing"
    finally:
        catalog.close()


def test_a_turn_on_one_worker_resumes_warm_on_another(workers: Any, tmp_path: Path) -> None:
    a, b = workers("a"), workers("b")
    turn1 = SYSTEM + "User: name three colours.\nAssistant:"
    first = a.generate("agent", turn1)
    turn2 = turn1 + first["text"] + "\nUser: and three animals?\nAssistant:"
    second = b.generate("agent", turn2)
    assert second["outcome"].startswith("warm"), second
    assert second["reused"] >= 0.95 * second["prompt_tokens"], second
    assert [first["text"], second["text"]] == _solo(tmp_path, [turn1, turn2])
    # Back on A: its live copy is stale (B saved since): it reads B's save, warm.
    turn3 = turn2 + second["text"] + "\nUser: and three cities?\nAssistant:"
    third = a.generate("agent", turn3)
    assert third["outcome"].startswith("warm") and third["reused"] >= 0.95 * third["prompt_tokens"], third


def test_graph_phases_alternate_between_workers(workers: Any) -> None:
    a, b = workers("a", GRAPH), workers("b", GRAPH)
    phases = ["Plan a trip to Rome.", "Make it cheaper.", "Add a museum.", "Summarise the plan."]
    for i, message in enumerate(phases):
        worker = (a, b)[i % 2]
        worker.send({"thread": "trip", "message": message})
        out = worker.receive()
        if i == 0:
            assert out["caches"] == ["cold", "cold"], out
            continue
        # Warm, or hot: the saver's prefetch loaded the thread's agents from the shared
        # store in the background when the run read its checkpoint.
        assert all(c.startswith(("warm", "hot")) for c in out["caches"]), (i, out)
        assert all(c >= 0.8 * n for c, n in zip(out["cached"], out["inputs"], strict=True)), (i, out)


def test_two_workers_racing_on_one_agent(workers: Any, shared_store: tuple[str, str]) -> None:
    a, b, c = workers("a"), workers("b"), workers("c")
    base = SYSTEM + "User: tell me a story.\nAssistant:"
    a.generate("x", base)
    for round_ in range(3):
        prompts = {w: base + f" (take {round_}{name})" for w, name in ((a, "a"), (b, "b"))}
        for w, p in prompts.items():
            w.send({"op": "generate", "agent": "x", "prompt": p, "max_tokens": 48})
        replies = {w: w.receive() for w in prompts}
        saved = [w for w, r in replies.items() if r["saved"]]
        assert len(saved) == 1, replies  # one commit wins, the other is told it lost
        winner, loser = saved[0], next(w for w in prompts if w is not saved[0])
        # No torn record: the store holds the winner's turn, whole; a third worker resumes it.
        stored = c("record", agent="x")["text"]
        assert stored.startswith(prompts[winner]) and not stored.startswith(prompts[loser])
        resumed = c.generate("x", stored + " The end.")
        assert resumed["outcome"].startswith("warm"), resumed
        assert resumed["reused"] >= 0.99 * resumed["prompt_tokens"], resumed


def test_sigkill_mid_save_loses_nothing(workers: Any, tmp_path: Path, shared_store: tuple[str, str]) -> None:
    rng = random.Random(20)
    kills = 0
    for _ in range(20):
        w = workers("crashing")  # the same host's worker, restarted: same local directory
        w.send({"op": "turns", "agents": 3, "prompt": SYSTEM})
        deadline = time.monotonic() + rng.uniform(0.3, 1.5)
        while time.monotonic() < deadline:
            w.receive()  # a turn done (its save committed or pending)
        w.kill()
        kills += 1
    survivor = workers("crashing")
    assert survivor("flush")["pending"] == 0
    fp = survivor("stats")["fingerprint"]
    records = _store_is_whole(shared_store, fp)
    assert len(records) == 3
    fresh = workers("fresh")
    for record in records:  # old or new, each resumes whole
        out = fresh.generate(record.agent_id, record.text, max_tokens=1)
        assert out["outcome"].startswith("warm"), out
    survivor("gc", grace=0)
    _objects_all_named(shared_store, fp)
