"""Worker processes on a shared store for the distributed tests (``shared_worker.py``,
driven one JSON line each way) and the checks made of the store they leave."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from langchain_agent_memory.engine.engine import Engine, GenerationParams
from langchain_agent_memory.engine.storage.blocks import AgentRecord
from langchain_agent_memory.engine.storage.catalog import Catalog
from langchain_agent_memory.engine.storage.objects import ObjectBlocks

HERE = Path(__file__).parent / "integration"
WORKER, GRAPH = HERE / "shared_worker.py", HERE / "graph_worker.py"
TWO_PROCESSES = HERE / "concurrent_child.py"
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

    def generate(
        self, agent: str, prompt: str, max_tokens: int = 8, *, wait_saved: bool = True
    ) -> dict[str, Any]:
        return self("generate", agent=agent, prompt=prompt, max_tokens=max_tokens, wait_saved=wait_saved)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.send({"op": "quit"})
            self.proc.wait(timeout=60)


def solo(tmp_path: Path, turns: list[str]) -> list[str]:
    """The oracle: the texts one worker alone gets, on a local store, at 16-bit KV."""
    with Engine("smollm2-135m", cache_dir=tmp_path / "alone", kv_bits=None) as alone:
        return [alone.generate("agent", t, GenerationParams(max_tokens=8)).text for t in turns]


def store_is_whole(shared_store: tuple[str, str], fingerprint: str) -> list[AgentRecord]:
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


def objects_all_named(shared_store: tuple[str, str], fingerprint: str) -> None:
    catalog, objects = Catalog(shared_store[0]), ObjectBlocks(shared_store[1])
    try:
        named = {h for _, raw, _ in catalog.agents(fingerprint) for h in AgentRecord.from_json(raw).blocks}
        stored = {objects.hash_of(o.key) for o in objects.list(fingerprint)}
        assert stored == named, f"{len(stored - named)} orphan objects, {len(named - stored)} missing"
    finally:
        catalog.close()
