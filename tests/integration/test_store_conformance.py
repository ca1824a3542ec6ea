"""The store conformance suite: what the engine asks of a block store (its roles,
``storage.protocols``: ``test_a_store_is_its_roles``), run against every backend the same
way, as LangGraph's checkpoint-conformance does for savers. ``local``: a directory
(``DiskBlockStore``); ``shared``: PostgreSQL + an S3-compatible server (SeaweedFS) with a
directory in front (``SharedBlockStore``), real servers. A second store opened over the
same places stands for another process. Where the backends differ by design (a shared
store's worker deletes or quarantines its own copies, the store keeps its own), a test says what each does."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import pytest

from langchain_agent_memory.engine.ops.runtime import mx
from langchain_agent_memory.engine.storage.block_files import BlockFiles
from langchain_agent_memory.engine.storage.blocks import (
    AgentRecord,
    Block,
    BlockHash,
    BlockMissingError,
    CacheFormatError,
    block_hash,
)
from langchain_agent_memory.engine.storage.index import AgentIndex
from langchain_agent_memory.engine.storage.objects import BlocksUnavailableError
from langchain_agent_memory.engine.storage.protocols import (
    BlockStore,
    BlockStoreBlocks,
    BlockStoreRecords,
    LeaseHolder,
    Maintenance,
    RecordReads,
    Replication,
    StoreReads,
    seen_version,
    take_lease,
)
from langchain_agent_memory.engine.storage.remote import SharedBlockStore, open_store
from langchain_agent_memory.engine.storage.store import DiskBlockStore
from langchain_agent_memory.engine.storage.store_config import StoreConfig

FP = "conformance-model"


class Opener(Protocol):
    def __call__(self, worker: str, *, reachable: bool = True) -> BlockStore: ...


@pytest.fixture(params=["local", "shared"])
def opener(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Opener]:
    """Opens the backend's store for a worker (its own local directory), all on one store;
    ``reachable=False``: a shared store whose database does not answer (started lazily)."""
    urls: tuple[str | None, str | None] = (None, None)
    if request.param == "shared":
        urls = request.getfixturevalue("shared_store")
    opened: list[BlockStore] = []

    def open_one(worker: str, *, reachable: bool = True) -> BlockStore:
        # The local backend has one directory: every "worker" shares it, as processes do.
        root = tmp_path / (worker if request.param == "shared" else "local")
        store_url, blocks_url = urls
        if not reachable and store_url is not None:  # no server listens on this socket
            store_url = f"postgresql:///gone?host={tmp_path / 'no-server'}&user=postgres&port=5432"
        store = open_store(root, FP, StoreConfig.of(store_url, blocks_url, lazy=not reachable))
        opened.append(store)
        return store

    yield open_one
    for store in opened:
        store.close()


def _block(parent: BlockHash | None, tokens: list[int], seed: int) -> Block:
    mx.random.seed(seed)
    n = len(tokens)
    tensors = {
        "L0.k.q": mx.random.randint(0, 2**31, (1, 2, n, 8)).astype(mx.uint32),
        "L0.k.scales": mx.random.normal((1, 2, n, 1)).astype(mx.float16),
        "L0.v": mx.random.normal((1, 2, n, 64)).astype(mx.bfloat16),
        "L1.k": mx.random.normal((1, 2, n, 64)).astype(mx.bfloat16),
        "L1.v": mx.random.normal((1, 2, n, 64)).astype(mx.bfloat16),
    }
    return Block(block_hash(parent, tokens, FP), parent, tokens, tensors)


def _agent(store: BlockStore, agent_id: str, seed: int, n_blocks: int = 2) -> tuple[AgentRecord, list[Block]]:
    """An agent committed as the engine does: its blocks first, then its record."""
    blocks, parent, ids = [], None, []
    for i in range(n_blocks):
        tokens = [seed * 1000 + i * 10 + j for j in range(4)]
        blk = _block(parent, tokens, seed * 100 + i)
        store.local.blocks.put(blk)
        blocks.append(blk)
        parent, ids = blk.hash, ids + tokens
    record = AgentRecord(
        agent_id, [b.hash for b in blocks], ids, list(range(1, len(ids) + 1)), "x" * len(ids)
    )
    with store.locked():
        store.records.put(record)
    return record, blocks


def _what(record: AgentRecord | None) -> tuple[object, ...] | None:
    """What a record stands for (not when it was written)."""
    return record and (record.agent_id, record.blocks, record.token_ids, record.text)


def _same(a: Block, b: Block) -> None:
    assert a.hash == b.hash and a.parent == b.parent and a.token_ids == b.token_ids
    assert sorted(a.tensors) == sorted(b.tensors)
    for name, x in a.tensors.items():
        assert b.tensors[name].dtype == x.dtype and mx.array_equal(b.tensors[name], x).item(), name


def test_blocks_round_trip_and_are_written_once(opener: Opener) -> None:
    store = opener("w1")
    blk = _block(None, [1, 2, 3], 0)
    assert not store.blocks.has(blk.hash) and not store.local.blocks.has(blk.hash)
    written = store.local.blocks.put(blk)
    assert written > blk.nbytes and store.local.blocks.put(blk) == 0  # content-addressed: once
    assert store.blocks.has(blk.hash) and store.local.blocks.has(blk.hash)
    assert store.local.blocks.local_bytes([blk.hash]) == written
    _same(blk, store.blocks.get(blk.hash))
    (group,) = store.blocks.read([blk.hash])
    for name, x in blk.tensors.items():
        assert mx.array_equal(group.tensor(name), x).item(), name


def test_a_committed_agent_is_what_another_worker_reads(opener: Opener) -> None:
    one = opener("w1")
    record, blocks = _agent(one, "thread 1:planner ✓", seed=1)
    other = opener("w2")
    back = other.records.get("thread 1:planner ✓")
    assert back is not None and back.blocks == record.blocks and back.token_ids == record.token_ids
    assert back.text == record.text and back.token_ends == record.token_ends
    assert other.records.has("thread 1:planner ✓") and not other.records.has("nobody")
    assert other.records.get("nobody") is None
    (group,) = other.blocks.read(back.blocks)  # the blocks reach the other worker too
    whole = {name: mx.concatenate([b.tensors[name] for b in blocks], axis=2) for name in blocks[0].tensors}
    for name, x in whole.items():
        assert mx.array_equal(group.tensor(name), x).item(), name
    assert other.local.records.agent_chain("thread 1:planner ✓") == record.blocks


def test_agents_are_listed_by_prefix(opener: Opener) -> None:
    store = opener("w1")
    for i, agent in enumerate(["t1:a", "t1:b", "t2:a"]):
        _agent(store, agent, seed=10 + i, n_blocks=1)
    assert sorted(r.agent_id for r in store.records.list("t1:")) == ["t1:a", "t1:b"]
    assert sorted(r.agent_id for r in store.records.list()) == ["t1:a", "t1:b", "t2:a"]


def test_a_record_replaced_names_its_new_blocks_and_a_deleted_one_is_gone(opener: Opener) -> None:
    store = opener("w1")
    first, _ = _agent(store, "agent", seed=20)
    # a live copy at the version seen is current
    assert take_lease(store.replication, "agent", seen_version(store.replication, "agent")).current
    longer, _ = _agent(store, "agent", seed=21, n_blocks=3)
    back = opener("w2").records.get("agent")
    assert back is not None and back.blocks == longer.blocks != first.blocks
    assert store.local.records.is_referenced(longer.blocks[0])
    with store.locked():
        assert store.records.delete("agent")
    assert opener("w3").records.get("agent") is None and not store.records.has("agent")
    assert not store.local.records.is_referenced(longer.blocks[0])


def test_a_request_that_ends_without_a_commit_gives_the_agent_back(opener: Opener) -> None:
    store = opener("w1")
    _agent(store, "leased", seed=30)
    lease = take_lease(store.replication, "leased", seen_version(store.replication, "leased"))
    assert lease.current
    lease.release()
    other = opener("w2")
    assert other.records.get("leased") is not None
    theirs = take_lease(other.replication, "leased", seen_version(other.replication, "leased"))
    assert theirs.current  # not held by the first worker
    theirs.release()


def _members(protocol: type) -> set[str]:
    """The attributes and methods a protocol (with those it extends) asks for."""
    names: set[str] = set()
    for cls in protocol.__mro__:
        if getattr(cls, "_is_protocol", False) and cls is not Protocol:
            names |= {n for n in [*vars(cls), *getattr(cls, "__annotations__", {})] if not n.startswith("_")}
    return names


def _plays(role: object, protocol: type) -> None:
    missing = sorted(n for n in _members(protocol) if not hasattr(role, n))
    assert not missing, f"{type(role).__name__} lacks {missing} of {protocol.__name__}"


def test_a_store_is_its_roles(opener: Opener) -> None:
    """Callers use a store's roles directly: each plays its protocol, on the store and on the
    view of its model thread; what only a directory has is its local store's; the store
    itself forwards nothing (no ``get_block``, ``put_agent``...: one name per operation)."""
    store = opener("w1")
    _plays(store, BlockStore)
    _plays(store.blocks, BlockStoreBlocks)
    _plays(store.records, BlockStoreRecords)
    _plays(store.maintenance, Maintenance)
    if store.replication is not None:
        _plays(store.replication, Replication)
    assert isinstance(store.local, DiskBlockStore) and store.local.local is store.local
    assert isinstance(store.local.blocks, BlockFiles) and isinstance(store.local.records, AgentIndex)
    assert store.blocks.fingerprint == store.fingerprint == FP
    tier = store.local_tier()
    _plays(tier, StoreReads)
    _plays(tier.blocks, BlockStoreBlocks)
    _plays(tier.records, RecordReads)
    _plays(tier.maintenance, Maintenance)
    if tier.replication is not None:
        _plays(tier.replication, LeaseHolder)
    with tier.locked(), store.locked():  # one directory lock, re-entrant in this thread
        pass
    roles = _members(BlockStoreBlocks) | _members(BlockStoreRecords) | {"get_block", "put_agent", "agents"}
    assert not [n for n in roles - {"fingerprint"} if hasattr(store, n)]


def test_only_a_shared_store_has_replication(opener: Opener) -> None:
    """A local store has no lease, version or upload: its ``replication`` is absent (None),
    not a set of no-ops; a shared store's takes leases and knows versions."""
    store = opener("w1")
    _agent(store, "versioned", seed=31)
    if not isinstance(store, SharedBlockStore):
        assert store.replication is None and seen_version(store.replication, "versioned") is None
        return
    assert store.replication is not None and store.replication.seen_version("versioned") == 1


def test_agent_ids_that_could_name_paths_are_refused(opener: Opener) -> None:
    store = opener("w1")
    for bad in ["../x", "a/b", "", "x" * 300, "nul\x00"]:
        with pytest.raises(ValueError, match="agent_id"):
            store.records.get(bad)
        with pytest.raises(ValueError, match="agent_id"):
            store.records.put(AgentRecord(bad, [], [], [], ""))


def test_eviction_frees_this_workers_disk_least_recently_used_first(opener: Opener) -> None:
    store = opener("w1")
    old, _, _ = (_agent(store, agent, seed=40 + i)[0] for i, agent in enumerate(["old", "mid", "new"]))
    usage = store.maintenance.usage()
    assert [a for a, _ in usage.agents][:3] == [
        "old",
        "mid",
        "new",
    ] and usage.total == store.maintenance.disk_bytes()
    held = store.local.blocks.local_bytes(old.blocks)
    with store.locked():
        freed, deleted = store.maintenance.evict_agents(["old"])
    assert freed == held > 0 and sorted(deleted) == sorted(old.blocks)
    assert not any(store.local.blocks.has(h) for h in deleted)
    assert "old" not in [a for a, _ in store.maintenance.usage().agents] and _pinned(store) == set()


def test_a_lease_given_back_by_a_failed_request_lets_another_worker_commit(opener: Opener) -> None:
    one, two = opener("w1"), opener("w2")
    _agent(one, "contested", seed=50)
    assert two.records.get("contested") is not None  # the second worker knows its version
    with (
        pytest.raises(RuntimeError, match="request failed"),
        take_lease(one.replication, "contested", seen_version(one.replication, "contested")) as lease,
    ):
        assert lease.current
        raise RuntimeError("the request failed")
    record, _ = _agent(two, "contested", seed=51)  # not refused: the lease was given back
    back = opener("w3").records.get("contested")
    assert back is not None and back.blocks == record.blocks


def _pinned(store: BlockStore) -> set[str]:
    """The agents eviction keeps whatever their age: a shared store's saves not uploaded."""
    return store.replication.pinned() if store.replication is not None else set()


def _damage(path: Path) -> bytes:
    """Flip the last byte of a block file (its tensor data): its checksum no longer holds."""
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(data)
    return bytes(data)


def test_a_deleted_block_is_gone_from_this_worker(opener: Opener) -> None:
    store = opener("w1")
    assert list(store.local.blocks.hashes()) == []
    record, blocks = _agent(store, "owner", seed=60)
    loose = _block(None, [6, 0, 1], 61)  # written, named by no record (a save cut short)
    store.local.blocks.put(loose)
    assert sorted(store.local.blocks.hashes()) == sorted([*record.blocks, loose.hash])
    named = record.blocks[-1]
    for h in (loose.hash, named):
        store.local.blocks.delete(h)
        assert not store.local.blocks.has(h) and h not in set(store.local.blocks.hashes())
    store.local.blocks.delete(loose.hash)  # already gone: nothing to do
    assert sorted(store.local.blocks.hashes()) == sorted(record.blocks[:-1])
    assert not store.blocks.has(loose.hash)
    with pytest.raises(BlockMissingError, match="is missing"):
        store.blocks.get(loose.hash)
    if isinstance(store, SharedBlockStore):  # this worker's copy only: read through again
        assert store.blocks.has(named)
        _same(blocks[-1], store.blocks.get(named))
        assert store.local.blocks.has(named)
    else:
        assert not store.blocks.has(named)
        with pytest.raises(BlockMissingError, match="is missing"):
            store.blocks.get(named)


def test_block_hashes_are_the_blocks_on_this_workers_disk(opener: Opener) -> None:
    one = opener("w1")
    record, _ = _agent(one, "listed", seed=62)
    other = opener("w2")
    other.blocks.read(record.blocks)  # read through, where the blocks were elsewhere
    assert set(record.blocks) <= set(other.local.blocks.hashes())
    assert all(other.local.blocks.has(h) for h in other.local.blocks.hashes())


def test_a_save_the_store_cannot_take_yet_waits_on_this_worker_until_it_answers(opener: Opener) -> None:
    away = opener("w1", reachable=False)
    record, _ = _agent(away, "offline", seed=70)
    waits = away.local.records.upload_pending("offline")
    assert waits == isinstance(away, SharedBlockStore)  # a local store has no store to wait for
    assert _pinned(away) == ({"offline"} if waits else set())  # the only copy: never evicted
    mine = away.records.get("offline")  # this worker goes on from its own save
    assert mine is not None and mine.blocks == record.blocks
    if away.replication is not None:
        status = away.replication.status()  # what a readiness probe reads: no call to the store
        assert status.shared and not status.reachable
        assert (status.pending_saves, status.pending_bytes > 0) == (1, True)
        away.replication.bound_pending(1)  # past it the oldest waiting saves go, never the newest
        assert away.local.records.upload_pending("offline") and away.records.get("offline") is not None
        away.replication.bound_pending(None)
    away.close()
    back = opener("w1")  # the same worker, the store answering again
    assert back.local.records.upload_pending("offline") == waits
    assert back.records.get("offline") is not None  # a pending save is uploaded before the read
    assert not back.local.records.upload_pending("offline") and _pinned(back) == set()
    if back.replication is not None:
        assert back.replication.status().reachable and back.replication.status().pending_saves == 0
    assert not back.local.records.upload_pending("never saved")
    theirs = opener("w2").records.get("offline")
    assert theirs is not None and theirs.blocks == record.blocks


def test_a_save_waiting_to_upload_is_listed_with_the_stores_agents(opener: Opener) -> None:
    away = opener("w1", reachable=False)
    _agent(away, "offline", seed=71)
    waits = away.local.records.upload_pending("offline")
    away.close()
    _agent(opener("w2"), "theirs", seed=72)
    back = opener("w1")  # the store answers again; the save has not been uploaded yet
    listed = [r.agent_id for r in back.records.list()]
    assert listed == ["offline", "theirs"]  # sorted, as the store lists them
    assert back.records.has("offline")  # a fork's or a delete's check finds it too
    assert back.local.records.upload_pending("offline") == waits  # listing it uploads nothing


@pytest.mark.parametrize("opener", ["shared"], indirect=True)  # one directory has no copy to fall behind
def test_a_read_that_answered_before_another_workers_commit_never_mirrors_over_the_newer_one(
    opener: Opener, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two reads of one agent race on a worker (a graph's prefetch and a request's
    admission): the one the store answered before another worker's commit must not write its
    older record here over the newer one, which the model's thread plans from."""
    mine, theirs = opener("w1"), opener("w2")
    assert isinstance(mine, SharedBlockStore)
    _agent(mine, "x", seed=80)
    assert theirs.records.get("x") is not None  # the other worker goes on from version 1
    catalog, answered, go_on = mine.records.catalog, threading.Event(), threading.Event()
    plain_get = catalog.get

    def late_get(fp: str, agent_id: str) -> tuple[str, int] | None:  # answers now, returns late
        got = plain_get(fp, agent_id)
        if not answered.is_set():
            answered.set()
            go_on.wait(10)
        return got

    monkeypatch.setattr(catalog, "get", late_get)
    early = threading.Thread(target=mine.records.get, args=("x",))
    early.start()
    assert answered.wait(10)  # version 1 read, not yet mirrored
    newer, _ = _agent(theirs, "x", seed=81, n_blocks=3)  # version 2, committed by the other
    late = threading.Thread(target=mine.records.get, args=("x",))
    late.start()
    time.sleep(0.5)  # the later read reads version 2 meanwhile (or waits for the early one)
    go_on.set()
    early.join(10)
    late.join(10)
    here = mine.local.records.get("x")  # what the model's thread plans from
    assert here is not None and here.blocks == newer.blocks


def test_oldest_use_is_the_least_recently_used_agents_last_use(opener: Opener) -> None:
    store = opener("w1")
    assert store.maintenance.oldest_use() is None  # no agent
    start = time.time()
    _agent(store, "first", seed=80, n_blocks=1)
    between = time.time()
    _agent(store, "second", seed=81, n_blocks=1)
    oldest = store.maintenance.oldest_use()
    assert oldest is not None and start <= oldest <= between
    assert oldest == store.maintenance.usage().agents[0][1]  # what eviction plans with
    with store.locked():
        store.records.delete("first")
    second = store.maintenance.oldest_use()
    assert second is not None and second >= between
    with store.locked():
        store.records.delete("second")
    assert store.maintenance.oldest_use() is None


def test_a_bad_block_is_moved_aside_and_never_read_again(opener: Opener) -> None:
    store = opener("w1")
    _, blocks = _agent(store, "damaged", seed=90)
    loose = _block(None, [9, 0, 1], 91)
    store.local.blocks.put(loose)
    for blk in (loose, blocks[0]):
        bad = _damage(store.local.blocks.path(blk.hash))
        with pytest.raises(CacheFormatError, match="checksum"):
            store.blocks.get(blk.hash)
        moved = store.blocks.quarantine(blk.hash)
        assert moved is not None and moved.parent.name == "quarantine" and moved.read_bytes() == bad
    assert not store.local.blocks.has(loose.hash)
    with pytest.raises(BlockMissingError, match="is missing"):
        store.blocks.get(loose.hash)
    if isinstance(store, SharedBlockStore):  # a sound copy was fetched from the store
        _same(blocks[0], store.blocks.get(blocks[0].hash))
    else:  # lost here: the agent prefills those tokens, its next save rewrites the block
        with pytest.raises(BlockMissingError, match="is missing"):
            store.blocks.get(blocks[0].hash)
    assert store.blocks.quarantine(block_hash(None, [9, 9, 9], FP)) is None  # nothing to move


def test_a_quarantined_record_is_moved_aside_and_its_blocks_kept(opener: Opener) -> None:
    store = opener("w1")
    record, _ = _agent(store, "unreadable", seed=100)
    moved = store.maintenance.quarantine_agent("unreadable")
    assert moved is not None and moved.parent.name == "quarantine"
    assert json.loads(moved.read_text())["agent_id"] == "unreadable"  # kept for inspection
    assert all(store.local.blocks.has(h) for h in record.blocks)  # the next save reuses them
    assert store.maintenance.quarantine_agent("nobody") is None
    with pytest.raises(ValueError, match="agent_id"):
        store.maintenance.quarantine_agent("../x")
    back = store.records.get("unreadable")
    if isinstance(store, SharedBlockStore):  # this worker's copy only: the store's is read again
        assert back is not None and back.blocks == record.blocks
    else:
        assert back is None and not store.records.has("unreadable")


def test_clearing_the_quarantine_frees_its_bytes(opener: Opener) -> None:
    store = opener("w1")
    assert store.maintenance.clear_quarantine() == 0  # nothing quarantined
    _agent(store, "cleared", seed=110)
    loose = _block(None, [1, 1, 0], 111)
    store.local.blocks.put(loose)
    moved = [store.blocks.quarantine(loose.hash), store.maintenance.quarantine_agent("cleared")]
    held = sum(p.stat().st_size for p in moved if p is not None)
    assert held > 0 and store.maintenance.usage().quarantine_bytes == held
    before = store.maintenance.disk_bytes()
    assert store.maintenance.clear_quarantine() == held  # the bytes freed
    assert not any(p.exists() for p in moved if p is not None)
    assert store.maintenance.usage().quarantine_bytes == 0 and store.maintenance.disk_bytes() == before - held
    assert store.maintenance.clear_quarantine() == 0


def test_the_model_threads_view_reads_only_what_this_worker_has(opener: Opener) -> None:
    """``local_tier()``: what the engine's model thread reads, never a round trip. A local
    store's is the store; a shared store's answers from this worker's copies, so that a
    record or block not brought here (by a request's admission) is missing, not fetched."""
    one = opener("w1")
    record, blocks = _agent(one, "viewed ✓", seed=120)
    mine = one.local_tier()
    assert _what(mine.records.get("viewed ✓")) == _what(record) and mine.blocks.has(blocks[0].hash)
    _same(blocks[1], mine.blocks.get(blocks[1].hash))
    with pytest.raises(ValueError, match="agent_id"):
        mine.records.get("../viewed")
    two = opener("w2")
    theirs = two.local_tier()
    if isinstance(two, SharedBlockStore):
        assert theirs.records.get("viewed ✓") is None and not theirs.blocks.has(blocks[0].hash)
        with pytest.raises(BlocksUnavailableError) as missing:
            theirs.blocks.read([b.hash for b in blocks])
        assert missing.value.available == 0
        assert _what(two.records.get("viewed ✓")) == _what(record)  # the store read through: mirrored here
        assert _what(theirs.records.get("viewed ✓")) == _what(record)
        assert not theirs.blocks.has(blocks[0].hash)
        two.blocks.read([blocks[0].hash])  # fetched: the first block is here, the second not
        with pytest.raises(BlocksUnavailableError) as missing:
            theirs.blocks.read([b.hash for b in blocks])
        assert missing.value.available == 1
        two.blocks.read([b.hash for b in blocks])
    assert _what(theirs.records.get("viewed ✓")) == _what(record)
    (group, *_) = theirs.blocks.read([b.hash for b in blocks])
    assert mx.array_equal(group.tensor("L1.k")[:, :, :4], blocks[0].tensors["L1.k"]).item()
    with take_lease(theirs.replication, "viewed ✓", seen_version(theirs.replication, "viewed ✓")) as lease:
        assert lease.current  # this worker's copy is what it serves
    lease.release()
