"""BlockPool: exact LRU eviction order under the byte budget, evicted blocks still on disk;
BlockWrites: blocks deleted once no agent record (of any process) names them, and the pool's
memory tier following what the writes did (``BlockPool.apply``)."""

from __future__ import annotations

from pathlib import Path

from langchain_agent_memory.engine.ops.runtime import mx
from langchain_agent_memory.engine.storage.block_writes import BlockWrites, WriteOutcome
from langchain_agent_memory.engine.storage.blocks import AgentRecord, Block, block_hash
from langchain_agent_memory.engine.storage.pool import BlockPool
from langchain_agent_memory.engine.storage.store import DiskBlockStore

FP = "m"


def _block(i: int, parent=None) -> Block:
    t = mx.full((1, 1, 4, 16), float(i), dtype=mx.float16)  # 128 bytes
    return Block(block_hash(parent, [i], FP), parent, [i], {"L0.k": t})


def test_lru_eviction_order_and_disk_fallback(tmp_path: Path) -> None:
    store = DiskBlockStore(tmp_path, FP)
    pool = BlockPool(store, hot_budget_bytes=3 * 128)
    b = [_block(i) for i in range(5)]
    writes = BlockWrites(store)
    for blk in b[:3]:
        writes.put(blk)
        pool.admit(blk)
    pool.get(b[0].hash)  # touch: b0 becomes most recent
    for blk in b[3:]:
        writes.put(blk)
    pool.admit(b[3])  # evicts the least recently used: b1
    assert pool.hot_hashes() == [b[2].hash, b[0].hash, b[3].hash]
    pool.admit(b[4])  # then b2
    assert pool.hot_hashes() == [b[0].hash, b[3].hash, b[4].hash]
    assert pool.snapshot_stats().evictions == 2
    block, from_memory = pool.get(b[1].hash)  # evicted from memory, not from disk
    assert not from_memory and mx.array_equal(block.tensors["L0.k"], b[1].tensors["L0.k"]).item()
    assert pool.hot_hashes()[-1] == b[1].hash


def test_release_deletes_only_blocks_no_record_names(tmp_path: Path) -> None:
    store = DiskBlockStore(tmp_path, FP)
    shared, mine, theirs = _block(1), _block(2), _block(3)
    pool = BlockPool(store, hot_budget_bytes=1 << 20)
    writes, outcome = BlockWrites(store), WriteOutcome()
    for blk in (shared, mine, theirs):
        writes.put(blk, outcome)
    pool.apply(outcome)
    assert pool.snapshot_stats().blocks_written == 3
    store.records.put(AgentRecord("a", [shared.hash, mine.hash], [1, 2], [1, 2], "xy"))
    store.records.put(AgentRecord("b", [shared.hash, theirs.hash], [1, 3], [1, 2], "xz"))
    assert store.records.refcount(shared.hash) == 2
    store.records.delete("a")
    deleted = WriteOutcome()
    writes.release([shared.hash, mine.hash], into=deleted)  # agent a deleted
    pool.apply(deleted)
    assert deleted.deleted == [mine.hash]
    assert not store.blocks.has(mine.hash) and not pool.is_hot(mine.hash) and pool.is_hot(shared.hash)
    assert store.blocks.has(shared.hash) and store.blocks.has(theirs.hash)


def test_references_are_seen_by_another_process(tmp_path: Path) -> None:
    store = DiskBlockStore(tmp_path, FP)
    blk = _block(1)
    store.blocks.put(blk)
    store.records.put(AgentRecord("a", [blk.hash], [1], [1], "x"))
    other = DiskBlockStore(tmp_path, FP)  # as a second process opens it
    other.records.put(AgentRecord("b", [blk.hash], [1], [1], "x"))
    store.records.delete("a")
    BlockWrites(store).release([blk.hash])  # b, written by the other, still names it
    assert store.blocks.has(blk.hash) and store.records.refcount(blk.hash) == 1
