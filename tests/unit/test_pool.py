"""BlockPool: exact LRU eviction order under the byte budget, refcounts from agent
records, orphans freed from disk, evicted blocks still on disk."""

from __future__ import annotations

from pathlib import Path

from langchain_agent_memory.engine.pool import BlockPool
from langchain_agent_memory.engine.runtime import mx
from langchain_agent_memory.engine.store import AgentRecord, Block, DiskBlockStore, block_hash

FP = "m"


def _block(i: int, parent=None) -> Block:
    t = mx.full((1, 1, 4, 16), float(i), dtype=mx.float16)  # 128 bytes
    return Block(block_hash(parent, [i], FP), parent, [i], {"L0.k": t})


def test_lru_eviction_order_and_disk_fallback(tmp_path: Path) -> None:
    store = DiskBlockStore(tmp_path, FP)
    pool = BlockPool(store, hot_budget_bytes=3 * 128)
    b = [_block(i) for i in range(5)]
    for blk in b[:3]:
        pool.put(blk)
    pool.get(b[0].hash)  # touch: b0 becomes most recent
    pool.put(b[3])  # evicts the least recently used: b1
    assert pool.hot_hashes() == [b[2].hash, b[0].hash, b[3].hash]
    pool.put(b[4])  # then b2
    assert pool.hot_hashes() == [b[0].hash, b[3].hash, b[4].hash]
    assert pool.snapshot_stats().evictions == 2
    block, from_memory = pool.get(b[1].hash)  # evicted from memory, not from disk
    assert not from_memory and mx.array_equal(block.tensors["L0.k"], b[1].tensors["L0.k"]).item()
    assert pool.hot_hashes()[-1] == b[1].hash


def test_refcounts_free_orphans_only(tmp_path: Path) -> None:
    store = DiskBlockStore(tmp_path, FP)
    shared, mine, theirs = _block(1), _block(2), _block(3)
    pool = BlockPool(store, hot_budget_bytes=1 << 20)
    for blk in (shared, mine, theirs):
        pool.put(blk)
    pool.set_chain([], [shared.hash, mine.hash])
    pool.set_chain([], [shared.hash, theirs.hash])
    assert pool.refcount(shared.hash) == 2
    pool.set_chain([shared.hash, mine.hash], [])  # agent A deleted
    assert not store.has_block(mine.hash)
    assert store.has_block(shared.hash) and store.has_block(theirs.hash)


def test_refcounts_are_rebuilt_from_agent_records(tmp_path: Path) -> None:
    store = DiskBlockStore(tmp_path, FP)
    blk = _block(1)
    store.put_block(blk)
    store.put_agent(AgentRecord("a", [blk.hash], [1], [1], "x"))
    store.put_agent(AgentRecord("b", [blk.hash], [1], [1], "x"))
    assert BlockPool(store, 1 << 20).refcount(blk.hash) == 2  # a new process counts again
