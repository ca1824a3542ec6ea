"""The block pool: blocks shared between agents, with a hot tier in memory under a byte
budget (LRU) over the store.

Which blocks are still needed is the store's index (every agent record's references,
across processes), not a count kept here: a block is deleted when a chain change leaves
no record naming it, checked under the store's directory lock.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from .store import Block, BlockHash, BlockStore

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class PoolStats:
    hot_blocks: int = 0
    hot_bytes: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_written: int = 0
    blocks_written: int = 0
    blocks_deleted: int = 0


class BlockPool:
    def __init__(self, store: BlockStore, hot_budget_bytes: int) -> None:
        self.store = store
        self.hot_budget_bytes = hot_budget_bytes
        self._hot: OrderedDict[BlockHash, Block] = OrderedDict()
        self._hot_bytes = 0
        self.stats = PoolStats()

    # ------------------------------------------------------------------ reads

    def get(self, h: BlockHash) -> tuple[Block, bool]:
        """The block and whether it came from memory (True) or from the store (False)."""
        block = self._hot.get(h)
        if block is not None:
            self._hot.move_to_end(h)  # touch: most recently used last
            self.stats.hits += 1
            return block, True
        block = self.store.get_block(h)
        self.stats.misses += 1
        self._admit(block)
        return block, False

    def is_hot(self, h: BlockHash) -> bool:
        return h in self._hot

    def hot_block(self, h: BlockHash) -> Block | None:
        return self._hot.get(h)

    # ------------------------------------------------------------------ writes

    def put(self, block: Block) -> int:
        """Persist ``block`` (no-op if stored) and keep it hot; return bytes written."""
        written = self.store.put_block(block)
        if written:
            self.stats.bytes_written += written
            self.stats.blocks_written += 1
        self._admit(block)
        return written

    def release(self, old: Iterable[BlockHash], new: Iterable[BlockHash] = ()) -> None:
        """A chain changed from ``old`` to ``new`` (its record is already stored): delete
        the blocks of ``old`` that no agent record names any more."""
        keep = set(new)
        with self.store.locked():
            for h in dict.fromkeys(old):
                if h not in keep and not self.store.is_referenced(h):
                    self._drop(h)

    def forget(self, h: BlockHash) -> None:
        """Drop the memory copy only (the file stays)."""
        block = self._hot.pop(h, None)
        if block is not None:
            self._hot_bytes -= block.nbytes

    def _drop(self, h: BlockHash) -> None:
        self.forget(h)
        self.store.delete_block(h)
        self.stats.blocks_deleted += 1

    # ------------------------------------------------------------------ hot tier

    def _admit(self, block: Block) -> None:
        if block.hash in self._hot:
            self._hot.move_to_end(block.hash)
            return
        self._hot[block.hash] = block
        self._hot_bytes += block.nbytes
        while self._hot_bytes > self.hot_budget_bytes and len(self._hot) > 1:
            _, evicted = self._hot.popitem(last=False)  # least recently used
            self._hot_bytes -= evicted.nbytes
            self.stats.evictions += 1  # still on disk: only the memory copy goes

    def hot_hashes(self) -> list[BlockHash]:
        """Hot blocks, least recently used first (the eviction order)."""
        return list(self._hot)

    def snapshot_stats(self) -> PoolStats:
        self.stats.hot_blocks = len(self._hot)
        self.stats.hot_bytes = self._hot_bytes
        return self.stats
