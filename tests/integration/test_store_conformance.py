"""The store conformance suite: what the engine asks of a block store (``storage.protocols``),
run against every backend the same way, as LangGraph's checkpoint-conformance does for
savers. ``local``: a directory (``DiskBlockStore``); ``shared``: PostgreSQL + an
S3-compatible server (SeaweedFS) with a directory in front (``SharedBlockStore``), real
servers. A second store opened over the same places stands for another process."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from langchain_agent_memory.engine.ops.runtime import mx
from langchain_agent_memory.engine.storage.blocks import AgentRecord, Block, BlockHash, block_hash
from langchain_agent_memory.engine.storage.protocols import BlockStore, take_lease
from langchain_agent_memory.engine.storage.remote import open_store

FP = "conformance-model"
Opener = Callable[[str], BlockStore]


@pytest.fixture(params=["local", "shared"])
def opener(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Opener]:
    """Opens the backend's store for a worker (its own local directory), all on one store."""
    urls: tuple[str | None, str | None] = (None, None)
    if request.param == "shared":
        urls = request.getfixturevalue("shared_store")
    opened: list[BlockStore] = []

    def open_one(worker: str) -> BlockStore:
        # The local backend has one directory: every "worker" shares it, as processes do.
        root = tmp_path / (worker if request.param == "shared" else "local")
        store = open_store(root, FP, *urls)
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
        store.put_block(blk)
        blocks.append(blk)
        parent, ids = blk.hash, ids + tokens
    record = AgentRecord(
        agent_id, [b.hash for b in blocks], ids, list(range(1, len(ids) + 1)), "x" * len(ids)
    )
    with store.locked():
        store.put_agent(record)
    return record, blocks


def _same(a: Block, b: Block) -> None:
    assert a.hash == b.hash and a.parent == b.parent and a.token_ids == b.token_ids
    assert sorted(a.tensors) == sorted(b.tensors)
    for name, x in a.tensors.items():
        assert b.tensors[name].dtype == x.dtype and mx.array_equal(b.tensors[name], x).item(), name


def test_blocks_round_trip_and_are_written_once(opener: Opener) -> None:
    store = opener("w1")
    blk = _block(None, [1, 2, 3], 0)
    assert not store.has_block(blk.hash) and not store.has_local_block(blk.hash)
    written = store.put_block(blk)
    assert written > blk.nbytes and store.put_block(blk) == 0  # content-addressed: once
    assert store.has_block(blk.hash) and store.has_local_block(blk.hash)
    assert store.local_bytes([blk.hash]) == written
    _same(blk, store.get_block(blk.hash))
    (group,) = store.read_blocks([blk.hash])
    for name, x in blk.tensors.items():
        assert mx.array_equal(group.tensor(name), x).item(), name


def test_a_committed_agent_is_what_another_worker_reads(opener: Opener) -> None:
    one = opener("w1")
    record, blocks = _agent(one, "thread 1:planner ✓", seed=1)
    other = opener("w2")
    back = other.get_agent("thread 1:planner ✓")
    assert back is not None and back.blocks == record.blocks and back.token_ids == record.token_ids
    assert back.text == record.text and back.token_ends == record.token_ends
    assert other.has_agent("thread 1:planner ✓") and not other.has_agent("nobody")
    assert other.get_agent("nobody") is None
    (group,) = other.read_blocks(back.blocks)  # the blocks reach the other worker too
    whole = {name: mx.concatenate([b.tensors[name] for b in blocks], axis=2) for name in blocks[0].tensors}
    for name, x in whole.items():
        assert mx.array_equal(group.tensor(name), x).item(), name
    assert other.agent_chain("thread 1:planner ✓") == record.blocks


def test_agents_are_listed_by_prefix(opener: Opener) -> None:
    store = opener("w1")
    for i, agent in enumerate(["t1:a", "t1:b", "t2:a"]):
        _agent(store, agent, seed=10 + i, n_blocks=1)
    assert sorted(r.agent_id for r in store.agents("t1:")) == ["t1:a", "t1:b"]
    assert sorted(r.agent_id for r in store.agents()) == ["t1:a", "t1:b", "t2:a"]


def test_a_record_replaced_names_its_new_blocks_and_a_deleted_one_is_gone(opener: Opener) -> None:
    store = opener("w1")
    first, _ = _agent(store, "agent", seed=20)
    assert store.begin("agent", store.seen_version("agent"))  # a live copy at the version seen is current
    longer, _ = _agent(store, "agent", seed=21, n_blocks=3)
    back = opener("w2").get_agent("agent")
    assert back is not None and back.blocks == longer.blocks != first.blocks
    assert store.is_referenced(longer.blocks[0])
    with store.locked():
        assert store.delete_agent("agent")
    assert opener("w3").get_agent("agent") is None and not store.has_agent("agent")
    assert not store.is_referenced(longer.blocks[0])


def test_a_request_that_ends_without_a_commit_gives_the_agent_back(opener: Opener) -> None:
    store = opener("w1")
    _agent(store, "leased", seed=30)
    assert store.begin("leased", store.seen_version("leased"))
    store.end("leased")
    other = opener("w2")
    assert other.get_agent("leased") is not None
    assert other.begin("leased", other.seen_version("leased"))  # not held by the first worker
    other.end("leased")


def test_agent_ids_that_could_name_paths_are_refused(opener: Opener) -> None:
    store = opener("w1")
    for bad in ["../x", "a/b", "", "x" * 300, "nul\x00"]:
        with pytest.raises(ValueError, match="agent_id"):
            store.get_agent(bad)
        with pytest.raises(ValueError, match="agent_id"):
            store.put_agent(AgentRecord(bad, [], [], [], ""))


def test_eviction_frees_this_workers_disk_least_recently_used_first(opener: Opener) -> None:
    store = opener("w1")
    old, _, _ = (_agent(store, agent, seed=40 + i)[0] for i, agent in enumerate(["old", "mid", "new"]))
    usage = store.usage()
    assert [a for a, _ in usage.agents][:3] == ["old", "mid", "new"] and usage.total == store.disk_bytes()
    held = store.local_bytes(old.blocks)
    with store.locked():
        freed, deleted = store.evict_agents(["old"])
    assert freed == held > 0 and sorted(deleted) == sorted(old.blocks)
    assert not any(store.has_local_block(h) for h in deleted)
    assert "old" not in [a for a, _ in store.usage().agents] and store.pinned() == set()


def test_a_lease_given_back_by_a_failed_request_lets_another_worker_commit(opener: Opener) -> None:
    one, two = opener("w1"), opener("w2")
    _agent(one, "contested", seed=50)
    assert two.get_agent("contested") is not None  # the second worker knows its version
    with (
        pytest.raises(RuntimeError, match="request failed"),
        take_lease(one, "contested", one.seen_version("contested")) as lease,
    ):
        assert lease.current
        raise RuntimeError("the request failed")
    record, _ = _agent(two, "contested", seed=51)  # not refused: the lease was given back
    back = opener("w3").get_agent("contested")
    assert back is not None and back.blocks == record.blocks
