"""Crash safety of the cache store: a process saving, forking and deleting agent caches
is SIGKILLed at random moments (40 times by default; ``CRASH_KILLS`` sets it), and after
every kill the directory must hold, for each agent, its last completed state or the state
the killed operation was writing (never a mix, never a lost committed cache), every block
a record names must be present and verify (checksum, hash), the index and the block files
must agree, and the temporary files of the interrupted write must be gone once the store
is opened again."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

from langchain_agent_memory.engine.ops.files import TEMP_PREFIX
from langchain_agent_memory.engine.storage.store import DiskBlockStore

sys.path.insert(0, str(Path(__file__).parent))
from crash_child import AGENTS, FINGERPRINT, record_digest

CHILD = Path(__file__).parent / "crash_child.py"


def _replay(journal: Path, states: dict[str, str | None]) -> tuple[str, str | None] | None:
    """Apply one run's completed operations to ``states`` (agent -> state); return the
    operation in flight when it was killed (agent, the state it was writing), if any."""
    pending: dict[int, tuple[str, str | None]] = {}
    for line in journal.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by the kill: its operation had not started
        if "agent" in entry:
            pending[entry["seq"]] = (entry["agent"], entry["intent"])
        elif entry.get("done"):
            agent, state = pending.pop(entry["seq"])
            states[agent] = state
    return next(iter(pending.values()), None)


def _kill_after(args: list[object], seconds: float) -> int:
    """Start ``python *args``, wait for its ``ready`` line, SIGKILL it ``seconds`` later (if
    it is still running); its exit code."""
    child = subprocess.Popen([sys.executable, *map(str, args)], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    try:
        child.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        child.kill()  # SIGKILL
    return child.wait()


def test_random_sigkills_during_saves_lose_nothing(tmp_path: Path, figures: dict[str, str]) -> None:
    kills = int(os.environ.get("CRASH_KILLS", "40"))  # CRASH_KILLS=1000 for a long run
    rng = random.Random(1234)
    states: dict[str, str | None] = {}  # each agent's committed state, as the journals say
    counts: Counter[str] = Counter()
    for i in range(kills):
        journal = tmp_path / f"journal-{i}.jsonl"
        code = _kill_after([CHILD, tmp_path / "cache", journal, i], rng.uniform(0.0, 0.25))
        assert code == -9, "the saver process died on its own"
        counts["kills"] += 1

        store = DiskBlockStore(tmp_path / "cache", FINGERPRINT)  # what the next process does first
        counts["temp files removed"] += store.recovery.temp_files_removed
        counts["orphan blocks removed"] += store.recovery.orphan_blocks_removed
        in_flight = _replay(journal, states)
        counts["killed mid-operation"] += in_flight is not None
        for agent in AGENTS:
            record = store.records.get(agent)
            allowed = {states.get(agent)}
            if in_flight is not None and in_flight[0] == agent:
                allowed.add(in_flight[1])
            state = record_digest(record)
            assert state in allowed, f"kill {i}: {agent} is at {state}, expected one of {allowed}"
            if in_flight is not None and in_flight[0] == agent:
                counts["killed writes found complete"] += state == in_flight[1] != states.get(agent)
                states[agent] = state  # old or new: the next run starts from what is there
            if record is not None:
                counts["records checked"] += 1
                for h in record.blocks:
                    store.blocks.get(h)  # present, checksum and hash verified
                    counts["block files verified"] += 1
        assert set(store.blocks.hashes()) == store.records.referenced_blocks(), (
            f"kill {i}: index and files disagree"
        )
        assert not [p for p in store.dir.rglob(f"{TEMP_PREFIX}*") if p.is_file()], (
            f"kill {i}: temp files left"
        )
        store.close()
    assert counts["killed mid-operation"] >= kills // 2  # the kills did land during saves
    figures["crash safety"] = ", ".join(f"{v} {k}" for k, v in counts.items()) + ", 0 violations"


BACKGROUND_CHILD = Path(__file__).parent / "background_save_child.py"


def test_sigkills_during_background_saves_leave_each_agent_old_or_new(
    smollm: object, tmp_path: Path, figures: dict[str, str]
) -> None:
    """An engine whose saves run after the replies left (``engine.saves``), SIGKILLed at
    random moments (8 times by default; ``CRASH_SAVE_KILLS`` sets it): every agent's record
    is the state of one of its turns, never older than the last ``flush`` said was durable,
    every block it names verifies, and the index and the files agree."""
    from langchain_agent_memory.engine.engine import Engine

    kills = int(os.environ.get("CRASH_SAVE_KILLS", "8"))
    rng = random.Random(4321)
    cache = tmp_path / "cache"
    prompts: dict[str, dict[int, str]] = {}
    flushed: dict[str, int] = {}
    counts: Counter[str] = Counter()
    fingerprint = Engine("smollm2-135m", cache_dir=cache).fingerprint
    for i in range(kills):
        journal = tmp_path / f"journal-{i}.jsonl"
        code = _kill_after([BACKGROUND_CHILD, cache, journal, i], rng.uniform(0.5, 4.0))
        assert code == -9, "the engine's process died on its own"
        counts["kills"] += 1
        base = {a: max(p, default=0) for a, p in prompts.items()}  # turns of earlier runs
        for line in journal.read_text().splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "flushed" in entry:
                for agent, turn in entry["flushed"].items():
                    if turn:  # a turn of this run (an earlier run's last one may be lost)
                        flushed[agent] = base.get(agent, 0) + turn
            else:
                agent = entry["agent"]
                prompts.setdefault(agent, {})[base.get(agent, 0) + entry["turn"]] = entry["prompt"]
        store = DiskBlockStore(cache / "kv", fingerprint)  # recovery runs on open
        for agent, turns in prompts.items():
            record = store.records.get(agent)
            at = [t for t, p in turns.items() if record is not None and record.text.startswith(p)]
            newest = max(at) if at else 0
            assert record is None or at, f"kill {i}: {agent!r} stands for none of its turns"
            assert newest >= flushed.get(agent, 0), (
                f"kill {i}: {agent!r} lost a flushed save ({newest} < {flushed.get(agent)}; "
                f"record: {None if record is None else record.text[-80:]!r})"
            )
            if record is not None:
                counts["records checked"] += 1
                for h in record.blocks:
                    store.blocks.get(h)  # present, checksum and hash verified
        assert set(store.blocks.hashes()) == store.records.referenced_blocks(), (
            f"kill {i}: index and files disagree"
        )
        store.close()
    figures["background saves killed"] = ", ".join(f"{v} {k}" for k, v in counts.items()) + ", 0 violations"
