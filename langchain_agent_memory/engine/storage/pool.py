"""The block pool: blocks shared between agents, with a hot tier in memory under a byte
budget (LRU) over the store. The memory tier is the engine loop's (``ops.owner``); what is
written to the store is ``block_writes``' (on the I/O thread), whose outcome the loop
applies here."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from ..ops.owner import CHECK_OWNER, Owner, check_owner
from .block_writes import WriteOutcome
from .blocks import Block, BlockHash
from .protocols import BlockStore


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
    """Blocks in memory over ``store``: read (``get``) on the engine's loop, through the
    store's ``local_tier`` (never a network round trip); the blocks saves wrote kept hot
    (``apply``) on the loop too."""

    def __init__(self, store: BlockStore, hot_budget_bytes: int, owner: Owner | None = None) -> None:
        self.store, self.reads = store, store.local_tier()
        self.hot_budget_bytes = hot_budget_bytes
        self._hot: OrderedDict[BlockHash, Block] = OrderedDict()
        self._hot_bytes = 0
        self.stats = PoolStats()
        #: the loop that alone reads and writes the memory tier (``ops.owner``): no lock
        self.owner = owner

    # ------------------------------------------------------------------ reads

    def get(self, h: BlockHash) -> tuple[Block, bool]:
        """The block and whether it came from memory (True) or from the store (False)."""
        if CHECK_OWNER:
            check_owner(self.owner, "BlockPool.get")
        block = self._hot.get(h)
        if block is not None:
            self._hot.move_to_end(h)  # touch: most recently used last
            self.stats.hits += 1
            return block, True
        block = self.reads.blocks.get(h)
        self.stats.misses += 1
        self.admit(block)
        return block, False

    def is_hot(self, h: BlockHash) -> bool:
        return h in self._hot

    def hot_block(self, h: BlockHash) -> Block | None:
        return self._hot.get(h)

    # ------------------------------------------------------------------ writes

    def apply(self, outcome: WriteOutcome, admit: bool = True) -> None:
        """Bring the memory tier in step with what store writes did (``BlockWrites``, on the
        I/O thread): the blocks written kept hot (with ``admit``), the deleted ones forgotten."""
        self.stats.bytes_written += outcome.bytes_written
        self.stats.blocks_written += len(outcome.written)
        if admit:
            for block in outcome.written:
                self.admit(block)
        for h in outcome.deleted:
            self.forget(h)
        self.stats.blocks_deleted += len(outcome.deleted)

    def forget(self, h: BlockHash) -> None:
        """Drop the memory copy only (the file stays)."""
        if CHECK_OWNER:
            check_owner(self.owner, "BlockPool.forget")
        block = self._hot.pop(h, None)
        if block is not None:
            self._hot_bytes -= block.nbytes

    # ------------------------------------------------------------------ hot tier

    def admit(self, block: Block) -> None:
        """Keep ``block`` in memory, the most recently used; the least recently used ones
        leave past the budget (still on disk)."""
        if CHECK_OWNER:
            check_owner(self.owner, "BlockPool.admit")
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
