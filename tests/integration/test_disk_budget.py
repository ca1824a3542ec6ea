"""Bounded cache storage on the real default model and real files: a byte budget over many
agents keeps the directory under it, evicting least recently used agents first and never
one a request is using; a time to live; ``agent-memory cache prune``; the index migration."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from langchain_agent_memory import corpus
from langchain_agent_memory.chat.model import ChatAgentMemory
from langchain_agent_memory.cli.main import app
from langchain_agent_memory.engine.engine import Engine, GenerationParams
from langchain_agent_memory.engine.model.loading import LoadedModel
from langchain_agent_memory.engine.storage.budget import StorageBudget, parse_age, parse_size
from langchain_agent_memory.engine.storage.store import DiskBlockStore
from langchain_agent_memory.graph.saver import AgentMemorySaver

ONE = GenerationParams(max_tokens=1)
WORDS = corpus.apache_license().split()


def _prompt(i: int) -> str:
    """A short prompt of its own for agent ``i`` (one partial block: a file of its own)."""
    return f"Agent {i} notes: " + " ".join(WORDS[i * 20 : i * 20 + 25])


def _dir_bytes(root: Path) -> int:
    """What the cache directory holds, every file counted (as ``du --apparent-size``)."""
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def test_a_budget_over_50_agents_keeps_the_directory_under_it_lru_first_never_one_in_use(
    smollm: LoadedModel, tmp_path: Path, figures: dict[str, str]
) -> None:
    engine = Engine("smollm2-135m", cache_dir=tmp_path)
    engine.generate("busy", "Count on: " + " ".join(WORDS[:40]), ONE)
    engine.generate("a0", _prompt(0), ONE)
    one_agent = engine.admin.disk_bytes() // 2
    budget = 12 * one_agent  # about a dozen agents fit
    engine.admin.storage_budget = StorageBudget(max_bytes=budget)

    # "busy" is the least recently used agent, and in use (decoding) the whole time.
    stream = engine.stream("busy", "Count on: " + " ".join(WORDS[:40]), GenerationParams(max_tokens=4000))
    next(stream)
    stop = threading.Event()

    def decode_until_stopped() -> None:
        for _ in stream:
            if stop.is_set():
                break
        stream.close()

    busy = threading.Thread(target=decode_until_stopped)
    busy.start()
    used: list[str] = []  # the order of last use
    largest = 0
    try:
        for i in range(1, 50):
            engine.generate(f"a{i}", _prompt(i), ONE)
            used.append(f"a{i}")
            if i == 20:  # a3 used again: now more recent than a4..a20
                engine.generate("a3", _prompt(3) + " More.", ONE)
                used.remove("a3")
                used.append("a3")
            # After each save the directory is within the budget (the engine's own count
            # and every file under the cache directory).
            assert engine.admin.disk_bytes() <= budget
            largest = max(largest, _dir_bytes(tmp_path / "kv"))
            assert largest <= budget
            assert engine.admin.store.records.has("busy"), f"agent in use evicted after a{i}"
    finally:
        stop.set()
        busy.join(timeout=120)
    assert not busy.is_alive()

    disk = engine.stats()["disk"]
    evicted = disk["recently_evicted"]
    assert "busy" not in evicted and disk["evicted_agents"] >= 30
    # Evicted least recently used first: in the order of last use, a3 after a20.
    order = ["a0", *used]
    assert evicted == sorted(evicted, key=order.index)
    assert evicted.index("a3") > evicted.index("a20") if "a3" in evicted else True
    survivors = [r.agent_id for r in engine.admin.agent_records() if r.agent_id.startswith("a")]
    assert sorted(survivors, key=order.index) == order[-len(survivors) :]
    # Nothing evicted beyond what the budget needed: the kept agents fill it but for about
    # one agent's room (how many they are depends on how far "busy" decoded before it was
    # stopped: its last save is larger the longer it ran).
    engine.flush()
    assert len(survivors) >= 2 and engine.admin.disk_bytes() >= budget - 2 * one_agent
    # An evicted agent prefills again (cold), a kept one resumes warm from disk.
    engine.admin.drop_hot()
    again = engine.generate("a1", _prompt(1) + " Again.", ONE)
    kept = engine.generate(order[-1], _prompt(49) + " Again.", ONE)
    assert again.reused_tokens == 0 and kept.reused_tokens > 0
    figures["disk budget"] = (
        f"51 agents, budget {budget / 1e6:.1f} MB: directory at most {largest / 1e6:.2f} MB after any save, "
        f"{disk['evicted_agents']} evicted least recently used first, the agent in use never; "
        f"{len(survivors)} kept, {engine.admin.disk_bytes() / 1e6:.2f} MB at the end"
    )
    engine.close()


def test_a_time_to_live_evicts_agents_unused_for_longer(smollm: LoadedModel, tmp_path: Path) -> None:
    llm = ChatAgentMemory(cache_dir=str(tmp_path), max_tokens=1, cache_ttl=1.5)
    llm.invoke("Hello there, old agent.", agent_id="old")
    time.sleep(1.6)
    llm.invoke("Hello there, new agent.", agent_id="new")
    ids = {r.agent_id for r in llm.engine.admin.agent_records()}
    assert ids == {"new"}
    llm.engine.admin.storage_budget = None


def test_budget_values_are_parsed_or_refused_clearly() -> None:
    assert parse_size("5GB") == 5 * 10**9 and parse_size("512MiB") == 512 << 20 and parse_size(100) == 100
    assert parse_age("7d") == 7 * 86400 and parse_age("12h") == 43200 and parse_age("90") == 90
    with pytest.raises(ValueError, match="not a size"):
        parse_size("5 parsecs")
    with pytest.raises(ValueError, match="not a duration"):
        parse_age("soon")
    with pytest.raises(ValueError):
        ChatAgentMemory(max_disk_bytes="lots")


def test_cache_prune_evicts_lru_first_and_dry_run_changes_nothing(
    smollm: LoadedModel, tmp_path: Path
) -> None:
    engine = Engine("smollm2-135m", cache_dir=tmp_path)
    for i in range(4):
        engine.generate(f"p{i}", _prompt(i), ONE)
    engine.generate("p0", _prompt(0) + " Later.", ONE)  # p0 is now the most recent
    total = engine.admin.disk_bytes()
    engine.close()
    runner = CliRunner()
    args = ["cache", "prune", "--cache-dir", str(tmp_path), "--max-size", f"{total * 3 // 4}B"]
    before = _dir_bytes(tmp_path / "kv")
    dry = runner.invoke(app, [*args, "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert "would evict p1" in dry.output and "p0" not in dry.output
    assert _dir_bytes(tmp_path / "kv") == before
    done = runner.invoke(app, args)
    assert done.exit_code == 0, done.output
    assert "evicted p1" in done.output
    assert _dir_bytes(tmp_path / "kv") <= total * 3 // 4
    left = runner.invoke(app, ["cache", "ls", "--cache-dir", str(tmp_path), "--format", "json"])
    assert "p0" in left.output and "p1" not in left.output
    time.sleep(1.1)
    # every agent left would go: asked first (no answer here is a no), then with --yes
    asked = runner.invoke(app, ["cache", "prune", "--cache-dir", str(tmp_path), "--older-than", "1s"])
    assert "p0" in runner.invoke(app, ["cache", "ls", "--cache-dir", str(tmp_path)]).output, asked.output
    old = runner.invoke(app, ["cache", "prune", "--cache-dir", str(tmp_path), "--older-than", "1s", "--yes"])
    assert old.exit_code == 0 and "evicted 0 agent" not in old.output
    listed = runner.invoke(app, ["cache", "ls", "--cache-dir", str(tmp_path), "--format", "json"])
    assert json.loads(listed.output) == []
    bad = runner.invoke(app, ["cache", "prune", "--cache-dir", str(tmp_path), "--max-size", "big"])
    assert bad.exit_code != 0 and "--max-size" in bad.output


def test_an_index_of_the_previous_schema_is_migrated_with_last_use_and_sizes(
    smollm: LoadedModel, tmp_path: Path
) -> None:
    engine = Engine("smollm2-135m", cache_dir=tmp_path)
    engine.generate("m1", _prompt(1), ONE)
    engine.generate("m2", _prompt(2), ONE)
    expected, fp = engine.admin.disk_bytes(), engine.fingerprint
    stamps = {r.agent_id: r.updated_at for r in engine.admin.agent_records()}
    engine.close()
    index = tmp_path / "kv" / fp / "index.sqlite"
    with sqlite3.connect(index) as db:  # back to schema 2, as the previous version wrote it
        db.executescript(
            "DROP INDEX agents_used; ALTER TABLE agents DROP COLUMN used_at; DROP TABLE block_sizes; "
            "PRAGMA user_version = 2;"
        )
    store = DiskBlockStore(tmp_path / "kv", fp)
    usage = store.maintenance.usage()
    assert dict(usage.agents) == pytest.approx(stamps)
    assert store.maintenance.disk_bytes() == usage.total == pytest.approx(expected, rel=0.05)
    store.close()


def test_the_savers_budget_applies_to_the_engines_of_its_directory(
    smollm: LoadedModel, tmp_path: Path
) -> None:
    with AgentMemorySaver(cache_dir=tmp_path, max_disk_bytes="2GB", cache_ttl="30d"):
        llm = ChatAgentMemory(cache_dir=str(tmp_path))  # no budget of its own
        assert llm.engine.admin.storage_budget == StorageBudget(max_bytes=2 * 10**9, ttl_s=30 * 86400)
