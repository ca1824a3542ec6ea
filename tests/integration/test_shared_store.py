"""Workers on several hosts share agents through PostgreSQL and an S3-compatible object
store (``storage.remote``), against real servers the tests start (``services``): each
worker is a separate process with a local cache directory of its own."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from services import PostgresServer, SeaweedServer
from workers import GRAPH, SYSTEM, TWO_PROCESSES, WORKER, Proc
from workers import objects_all_named as _objects_all_named
from workers import solo as _solo
from workers import store_is_whole as _store_is_whole

from langchain_agent_memory import corpus
from langchain_agent_memory.engine.engine import Engine, GenerationParams
from langchain_agent_memory.engine.storage.objects import ObjectBlocks

#: A turn long enough that its save is still in flight when the next request comes.
LONG = "Read this.\n\n" + corpus.apache_license()[:6000] + "\nUser: what is it called?\nAssistant:"


@pytest.fixture
def workers(tmp_path: Path, shared_store: tuple[str, str]) -> Iterator[Any]:
    """``workers(name)``: a worker process on the shared store, cache directory ``name``."""
    made: list[Proc] = []

    def make(
        name: str, script: Path = WORKER, store: tuple[str, str] = shared_store, model: Path | None = None
    ) -> Proc:
        extra = ["16", *([str(model)] if model else [])] if script == WORKER else []
        made.append(Proc(script, str(tmp_path / name), *store, *extra))
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
    assert [first["text"], second["text"]] == _solo(tmp_path, [turn1, turn2])
    # Back on A: its live copy is stale (B saved since): it reads B's save, warm.
    turn3 = turn2 + second["text"] + "\nUser: and three cities?\nAssistant:"
    third = a.generate("agent", turn3)
    assert third["outcome"].startswith("warm") and third["reused"] >= 0.95 * third["prompt_tokens"], third


def test_a_hand_off_right_after_a_reply_resumes_warm(
    workers: Any, tmp_path: Path, figures: dict[str, str]
) -> None:
    """A load balancer sends turn 2 to worker B milliseconds after worker A replied to turn 1,
    while A's save is still in flight (a server replies first, then saves): B waits for that
    save's commit (A holds the agent's lease until it) and resumes warm from it, instead of
    prefilling the whole context; its reply is the one a single worker gives."""
    a, b = workers("a"), workers("b")
    turn1 = LONG
    first = a.generate("agent", turn1, wait_saved=False)
    assert first["saved"] == "pending"
    turn2 = turn1 + first["text"] + "\nUser: and who wrote it?\nAssistant:"
    t0 = time.perf_counter()
    b.send({"op": "generate", "agent": "agent", "prompt": turn2, "max_tokens": 8})
    sent_ms = (time.perf_counter() - t0) * 1e3
    second = b.receive()
    assert second["outcome"].startswith("warm") and second["reused"] >= 0.95 * second["prompt_tokens"], second
    assert [first["text"], second["text"]] == _solo(tmp_path, [turn1, turn2])
    waited = b("stats")
    figures["hand-off within 10 ms"] = (
        f"turn 2 sent to B {sent_ms:.1f} ms after A's reply (A's save in flight): {second['outcome']} "
        f"{second['reused']} of {second['prompt_tokens']} tokens, TTFT {second['ttft_s']:.2f} s, "
        f"B waited {waited['handoff_waited_s']:.2f} s for A's commit ({waited['handoff_waits']} wait)"
    )


def test_a_running_turn_keeps_its_lease_while_its_earlier_save_commits(
    tmp_path: Path, shared_store: tuple[str, str]
) -> None:
    """Turn 2 starts on the worker while turn 1's save is in flight; turn 1's commit must not
    delete the lease turn 2 holds (another worker could otherwise start a turn on the agent
    meanwhile). The lease goes with turn 2's own commit."""
    import psycopg

    store, blocks = shared_store
    prompt = LONG

    def lease_and_version(engine: Engine) -> tuple[bool, int | None]:
        with psycopg.connect(store, autocommit=True) as c:
            lease = c.execute(
                "SELECT 1 FROM am_leases WHERE agent_id = 'agent' AND expires_at >= now()"
            ).fetchone()
            row = c.execute("SELECT version FROM am_agents WHERE agent_id = 'agent'").fetchone()
        return lease is not None, row[0] if row else None

    with Engine("smollm2-135m", cache_dir=tmp_path / "w", kv_bits=None, store=store, blocks=blocks) as engine:
        first = engine.generate("agent", prompt, GenerationParams(max_tokens=4))
        seen: list[tuple[bool, int | None]] = []
        turn2 = prompt + first.text + "\nUser: who wrote it? Answer at length.\nAssistant:"
        for chunk in engine.stream("agent", turn2, GenerationParams(max_tokens=40)):
            if chunk.result is None:
                seen.append(lease_and_version(engine))
        assert chunk.result is not None and chunk.result.wait_saved() is True
        after = lease_and_version(engine)
    committed_while_running = [lease for lease, version in seen if version == 1]
    assert committed_while_running, f"turn 1's save committed after turn 2 ended: {seen}"
    assert all(committed_while_running), seen  # the lease stayed while turn 2 ran
    assert after == (False, 2)  # turn 2's commit gave it back


def test_a_hybrid_agent_resumes_warm_on_another_worker_from_the_shared_snapshots(
    workers: Any, tmp_path: Path, shared_store: tuple[str, str], smollm: Any
) -> None:
    """A hybrid model's agent (random-weight Qwen3-Next: Gated DeltaNet layers among attention
    layers) saved by one worker resumes on another from the recurrent-state snapshots in the
    object store, as the uninterrupted run on one local engine (16-bit)."""
    from langchain_agent_memory.testing.random_model import HYBRID_CONFIGS, write_random_model

    model = write_random_model(HYBRID_CONFIGS["qwen3_next"], tmp_path / "qwen3_next", smollm.path, seed=7)
    a, b = workers("a", model=model), workers("b", model=model)
    turn1 = SYSTEM + "User: name three colours.\nAssistant:"
    first = a.generate("agent", turn1)
    turn2 = turn1 + first["text"] + "\nUser: and three animals?\nAssistant:"
    second = b.generate("agent", turn2)
    assert second["outcome"].startswith("warm") and second["reused"] >= 0.9 * second["prompt_tokens"], second
    with Engine(model, cache_dir=tmp_path / "alone", kv_bits=None) as alone:
        solo = [alone.generate("agent", t, GenerationParams(max_tokens=8)).text for t in (turn1, turn2)]
    assert [first["text"], second["text"]] == solo
    records = _store_is_whole(shared_store, b("stats")["fingerprint"])
    assert any(r.states for r in records)  # the snapshots are objects the records name
    b("gc", grace=0)  # turn 1's last block and snapshots, replaced by turn 2's, are collected
    _objects_all_named(shared_store, b("stats")["fingerprint"])


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


@pytest.mark.parametrize("handoff", ["0", "10"])
def test_two_workers_racing_on_one_agent(
    workers: Any, shared_store: tuple[str, str], handoff: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two workers get a turn of one agent at once. Waiting for the other's save in flight
    (``handoff_wait_s`` 10, the default), the second runs after the first's commit: both are
    saved, the store holds the later one. Not waiting (0), they race: one commit wins, the
    other is told it lost. Either way no torn record, and a third worker resumes it warm."""
    monkeypatch.setenv("AGENT_MEMORY_HANDOFF_WAIT_S", handoff)
    a, b, c = workers("a"), workers("b"), workers("c")
    base = SYSTEM + "User: tell me a story.\nAssistant:"
    a.generate("x", base)
    for round_ in range(3):
        prompts = {w: base + f" (take {round_}{name})" for w, name in ((a, "a"), (b, "b"))}
        for w, p in prompts.items():
            w.send({"op": "generate", "agent": "x", "prompt": p, "max_tokens": 48})
        replies = {w: w.receive() for w in prompts}
        saved = [w for w, r in replies.items() if r["saved"]]
        stored = c("record", agent="x")["text"]
        if handoff == "0":
            assert len(saved) == 1, replies  # one commit wins, the other is told it lost
            winner, loser = saved[0], next(w for w in prompts if w is not saved[0])
            assert stored.startswith(prompts[winner]) and not stored.startswith(prompts[loser])
        else:
            assert len(saved) == 2, replies  # one after the other: both kept
            assert any(stored.startswith(p) for p in prompts.values()), stored
        resumed = c.generate("x", stored + " The end.")
        assert resumed["outcome"].startswith("warm"), resumed
        assert resumed["reused"] >= 0.99 * resumed["prompt_tokens"], resumed


def test_sigkill_mid_save_loses_nothing(workers: Any, tmp_path: Path, shared_store: tuple[str, str]) -> None:
    rng = random.Random(20)
    for _ in range(6):  # every restart loads the model: 6 random kills, ~3 s each
        w = workers("crashing")  # the same host's worker, restarted: same local directory
        w.send({"op": "turns", "agents": 3, "prompt": SYSTEM})
        deadline = time.monotonic() + rng.uniform(0.3, 1.5)
        while time.monotonic() < deadline:
            w.receive()  # a turn done (its save durable: committed, or pending upload)
        w.kill()
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


@pytest.mark.parametrize("down", ["postgres", "object store"])
def test_a_store_stopped_mid_run(down: str, tmp_path: Path) -> None:
    """Replies still come (prefill where blocks are out of reach, same text at 16-bit KV),
    saves wait on the worker and upload once the store is back; nothing is lost."""
    pg, s3 = PostgresServer(), SeaweedServer()  # servers of its own: this test stops one
    made: list[Proc] = []
    try:
        store = (pg.new_database("down"), s3.new_bucket("down"))
        a, b = (Proc(WORKER, str(tmp_path / n), *store, "16") for n in "ab")
        made += [a, b]
        turn1 = {g: SYSTEM + f"User: tell me about {g}.\nAssistant:" for g in ("owls", "bees")}
        first = {g: a.generate(g, p) for g, p in turn1.items()}
        turn2 = {g: turn1[g] + first[g]["text"] + "\nUser: go on.\nAssistant:" for g in turn1}
        (pg if down == "postgres" else s3).stop()
        second = {"owls": a.generate("owls", turn2["owls"]), "bees": b.generate("bees", turn2["bees"])}
        assert all(r["saved"] for r in second.values()), second
        assert a("stats")["pending_saves"] == 1 and b("stats")["pending_saves"] == 1
        assert second["bees"]["reused"] == 0  # B had none of its blocks: prefilled, replied
        for g in turn1:
            assert [first[g]["text"], second[g]["text"]] == _solo(tmp_path / g, [turn1[g], turn2[g]])
        (pg if down == "postgres" else s3).start()
        deadline = time.monotonic() + 60
        while (a("flush")["pending"], b("flush")["pending"]) != (0, 0):
            assert time.monotonic() < deadline, "pending saves were not uploaded"
            time.sleep(1)
        c = Proc(WORKER, str(tmp_path / "c"), *store, "16")
        made.append(c)
        for g in turn1:  # both second turns reached the store: each resumes warm elsewhere
            turn3 = turn2[g] + second[g]["text"] + "\nUser: thanks.\nAssistant:"
            out = c.generate(g, turn3)
            assert out["outcome"].startswith("warm") and out["reused"] >= 0.95 * out["prompt_tokens"], out
        _store_is_whole(store, c("stats")["fingerprint"])
    finally:
        for w in made:
            w.kill()
        pg.close()
        s3.close()


def test_gc_while_another_worker_forks(workers: Any, shared_store: tuple[str, str]) -> None:
    a, b = workers("a"), workers("b")
    a.generate("base", SYSTEM + "User: begin.\nAssistant:")
    a.send({"op": "churn", "agent": "base", "seconds": 8})
    # A grace of 2 s (1 h by default): longer than an upload takes to be committed, so GC
    # also collects what the forks uploaded and replaced a moment ago, as they run.
    b.send({"op": "gcloop", "seconds": 8, "grace": 2})
    forks, gc = a.receive(), b.receive()
    assert forks["forks"] >= 3 and gc["rounds"] >= 3 and gc["collected"] > 0, (forks, gc)
    assert a("flush")["pending"] == 0
    fp = a("stats")["fingerprint"]
    records = _store_is_whole(shared_store, fp)  # no committed block was collected
    fresh = workers("fresh")
    for record in records:
        out = fresh.generate(record.agent_id, record.text, max_tokens=1)
        assert out["outcome"].startswith("warm"), out
    b("gc", grace=0)
    _objects_all_named(shared_store, fp)


def test_an_app_and_a_cleanup_worker_share_a_store(tmp_path: Path, shared_store: tuple[str, str]) -> None:
    """``test_two_processes`` on the shared store: the cleanup also collects garbage as it
    goes (grace 2 s), and the invariant is checked in one snapshot of PostgreSQL."""
    procs = {
        role: subprocess.Popen(
            [sys.executable, str(TWO_PROCESSES), role, str(tmp_path / role), "20", *shared_store],
            stdout=subprocess.PIPE,
            text=True,
        )
        for role in ("app", "cleanup")
    }
    outputs = {role: proc.communicate(timeout=300)[0] for role, proc in procs.items()}
    assert all(proc.returncode == 0 for proc in procs.values()), outputs
    summaries = {role: json.loads(out.strip().splitlines()[-1]) for role, out in outputs.items()}
    ops = {k: v for s in summaries.values() for k, v in s["ops"].items()}
    assert (
        ops.get("cleanup deletes", 0) >= 5
        and sum(v for k, v in ops.items() if k.startswith("app turns")) >= 10
    )
    assert "records naming a missing block" not in ops, ops
    warnings = [w for s in summaries.values() for w in s["warnings"]]
    assert not [w for w in warnings if "corrupt" in w or "checksum" in w or "unreadable" in w], warnings
    with Engine(
        "smollm2-135m", cache_dir=tmp_path / "after", store=shared_store[0], blocks=shared_store[1]
    ) as e:
        records = _store_is_whole(shared_store, e.fingerprint)
        for record in records:
            assert (
                str(e.generate(record.agent_id, record.text, GenerationParams(max_tokens=1)).outcome)
                != "cold"
            )
        e.admin.store.upkeep.collect_garbage(grace_s=0)
        _objects_all_named(shared_store, e.fingerprint)


def test_a_corrupt_object_is_detected_replaced_and_resumed(
    workers: Any, tmp_path: Path, shared_store: tuple[str, str]
) -> None:
    a = workers("a")
    turn1 = SYSTEM + "User: name a river.\nAssistant:"
    first = a.generate("agent", turn1)
    fp = a("stats")["fingerprint"]
    (record,) = _store_is_whole(shared_store, fp)
    objects = ObjectBlocks(shared_store[1])
    key = objects.key(fp, record.blocks[0])
    data = bytearray(objects.get(key) or b"")
    data[-100] ^= 0xFF  # a flipped bit in the tensors: the header's checksum no longer holds
    objects.delete(key)
    objects.put_new(key, bytes(data))
    b = workers("b")
    turn2 = turn1 + first["text"] + "\nUser: and a mountain?\nAssistant:"
    second = b.generate("agent", turn2)  # detected, prefilled: the same text as one worker's
    assert second["reused"] == 0 and [first["text"], second["text"]] == _solo(tmp_path, [turn1, turn2])
    _store_is_whole(shared_store, fp)  # B's save uploaded a sound copy
    out = workers("c").generate("agent", turn2 + second["text"] + "\nUser: thanks.\nAssistant:")
    assert out["outcome"].startswith("warm") and out["reused"] >= 0.95 * out["prompt_tokens"], out


def test_verify_does_not_mark_missing_a_block_uploaded_while_it_ran(
    tmp_path: Path, shared_store: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``verify`` lists the objects, then reads the catalog's stored blocks: a block another
    worker uploaded in between is in the second and not the first. It is looked up alone and
    kept (it was marked missing, and a fork naming it then failed as "gone")."""
    store, blocks = shared_store
    with Engine("smollm2-135m", cache_dir=tmp_path / "a", store=store, blocks=blocks) as a:
        a.generate("x", SYSTEM + "User: name a river.\nAssistant:", GenerationParams(max_tokens=4))
        a.flush()
        monkeypatch.setattr(a.admin.store.objects, "list", lambda fp: iter(()))  # listed before the uploads
        report = a.admin.store.upkeep.verify(repair=True)
        assert report.checked > 0 and report.missing == 0 and report.marked_missing == 0, report
        monkeypatch.undo()
        a.admin.fork("x", "x-fork")
    with Engine("smollm2-135m", cache_dir=tmp_path / "b", store=store, blocks=blocks) as b:
        forked = b.admin.store.records.get("x-fork")
        assert forked is not None
        out = b.generate("x-fork", forked.text + " More?", GenerationParams(max_tokens=2))
        assert str(out.outcome).startswith("warm"), out.outcome


def test_the_cache_commands_read_the_shared_store(
    workers: Any, tmp_path: Path, shared_store: tuple[str, str]
) -> None:
    from typer.testing import CliRunner

    from langchain_agent_memory.cli.main import app

    a = workers("a")
    a.generate("t1:writer", SYSTEM + "User: hi\nAssistant:")
    a("delete", agent="t1:writer")  # its blocks stay until collected
    a.generate("t1:editor", "Edit this. " * 40)
    shared = ["--store", shared_store[0], "--blocks", shared_store[1], "--cache-dir", str(tmp_path / "admin")]
    listed = CliRunner().invoke(app, ["cache", "ls", *shared])
    assert listed.exit_code == 0 and "t1:editor" in listed.output and "t1:writer" not in listed.output
    one_sided = CliRunner().invoke(app, ["cache", "ls", "--store", shared_store[0]])
    assert one_sided.exit_code != 0 and "--blocks" in one_sided.output
    gc = CliRunner().invoke(app, ["cache", "gc", *shared, "--grace-hours", "0"])
    assert gc.exit_code == 0, gc.output
    assert int(gc.output.split(" and ")[-1].split()[0]) >= 2, gc.output  # the writer's own blocks
    _objects_all_named(shared_store, a("stats")["fingerprint"])


def test_a_disk_budget_bounds_the_local_tier_and_the_store_keeps_everything(
    tmp_path: Path, shared_store: tuple[str, str]
) -> None:
    from langchain_agent_memory.engine.storage.budget import StorageBudget

    one = GenerationParams(max_tokens=1)
    prompts = {f"x{i}": f"Worker note {i}: " + "the river runs to the sea. " * 12 for i in range(6)}
    with Engine("smollm2-135m", cache_dir=tmp_path / "w", store=shared_store[0], blocks=shared_store[1]) as e:
        e.generate("x0", prompts["x0"], one)
        e.admin.storage_budget = StorageBudget(max_bytes=3 * e.admin.disk_bytes())
        for agent in list(prompts)[1:]:
            e.generate(agent, prompts[agent], one)
            assert e.admin.disk_bytes() <= e.admin.storage_budget.max_bytes
        evicted = e.stats()["disk"]["recently_evicted"]
        assert evicted and evicted[0] == "x0"
        assert {r.agent_id for r in _store_is_whole(shared_store, e.fingerprint)} == set(prompts)
        e.admin.drop_hot()
        back = e.generate("x0", prompts["x0"] + " More.", one)  # read through from the store
        assert back.outcome.source.value == "warm" and back.reused_tokens > 0
