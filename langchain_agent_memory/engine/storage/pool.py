"""The block pool: blocks shared between agents, with a hot tier in memory under a byte
budget (LRU) over the store.

Which blocks are still needed is the store's index (every agent record's references,
across processes), not a count kept here: a block is deleted when a chain change leaves
no record naming it, checked under the store's directory lock.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..errors import RemoteUnavailableError
from .blocks import (
    AgentNotFoundError,
    AgentRecord,
    Block,
    BlockHash,
    BlockMissingError,
    CacheFormatError,
    CacheWriteError,
)
from .protocols import BlockStore

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
    """Blocks in memory over ``store``: read (``get``) on the engine's model thread, through
    the store's ``local_tier`` (never a network round trip); written by saves on theirs."""

    def __init__(self, store: BlockStore, hot_budget_bytes: int) -> None:
        self.store, self.reads = store, store.local_tier()
        self.hot_budget_bytes = hot_budget_bytes
        self._hot: OrderedDict[BlockHash, Block] = OrderedDict()
        self._hot_bytes = 0
        self.stats = PoolStats()
        # The memory tier is read on the worker thread and filled by saves on their own.
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ reads

    def get(self, h: BlockHash) -> tuple[Block, bool]:
        """The block and whether it came from memory (True) or from the store (False)."""
        with self._lock:
            block = self._hot.get(h)
            if block is not None:
                self._hot.move_to_end(h)  # touch: most recently used last
                self.stats.hits += 1
                return block, True
        block = self.reads.get_block(h)
        self.stats.misses += 1
        self._admit(block)
        return block, False

    def is_hot(self, h: BlockHash) -> bool:
        with self._lock:
            return h in self._hot

    def hot_block(self, h: BlockHash) -> Block | None:
        with self._lock:
            return self._hot.get(h)

    # ------------------------------------------------------------------ writes

    def put(self, block: Block, admit: bool = True) -> int:
        """Persist ``block`` (no-op if stored) and, with ``admit``, keep it hot; return bytes
        written."""
        written = self.store.put_block(block)
        if written:
            self.stats.bytes_written += written
            self.stats.blocks_written += 1
        if admit:
            self._admit(block)
        return written

    def save_agent(
        self,
        record: AgentRecord,
        block_of: Callable[[int], Block],
        old: Iterable[BlockHash] = (),
        admit: bool = True,
    ) -> int:
        """Persist ``record``: first each of its blocks not yet stored (``block_of(i)`` builds
        block ``i``), then the record, then delete the blocks it replaced (``old``, and those
        of the stored record) that nothing names any more. A crash at any point leaves the old
        record or the new one, each with all of its blocks. Under the directory lock, so that
        another process's delete cannot remove a block between the check that it exists and
        the record naming it. Returns the bytes written; raises ``CacheWriteError`` (the old
        record and its blocks untouched) if the disk refuses a write. ``admit``: keep the
        blocks written in the memory tier (not where live caches hold the same data)."""
        written, new_blocks = 0, []
        with self.store.locked():
            replaced = set(old) | set(self.store.local.agent_chain(record.agent_id))
            try:
                # The record names what reading its chain takes: its segments' earlier blocks
                # (each checked below like the rest: another process may have deleted one).
                record.set_priors(self._priors(record.chain, block_of))
                for i, h in enumerate(record.blocks):
                    if not self.store.has_block(h):
                        written += self.put(block_of(i), admit)
                        new_blocks.append(h)
                written += self.store.put_agent(record)
            except (OSError, sqlite3.Error, CacheWriteError) as exc:
                self.release(new_blocks)  # written for a record that was not
                if isinstance(exc, CacheWriteError):
                    raise
                raise CacheWriteError(
                    f"could not save agent {record.agent_id!r}'s cache: {exc}. Its previous cache "
                    "is intact; free disk space (or fix the cache directory's permissions) and retry"
                ) from exc
            self.release(replaced, record.blocks)
        return written

    def _priors(self, chain: list[BlockHash], block_of: Callable[[int], Block]) -> dict[BlockHash, BlockHash]:
        """Each segment of ``chain`` -> the block of its earlier rows, and so on back to a
        whole block (``Block.rows_from``): from the blocks in hand (the save's, the memory
        tier's), else from the stored blocks' headers."""

        def prior(i: int | None, h: BlockHash) -> BlockHash | None:
            block = None
            if i is not None:
                with contextlib.suppress(CacheWriteError, BlockMissingError):
                    block = block_of(i)
            block = block or self.hot_block(h)
            return self.store.prior_of(h) if block is None else block.prior(self.store.fingerprint)

        priors: dict[BlockHash, BlockHash] = {}
        try:
            for i, h in enumerate(chain):
                p = prior(i, h)
                while p is not None and h not in priors:
                    priors[h], h = p, p
                    p = prior(None, h)
        except (CacheFormatError, RemoteUnavailableError) as exc:  # BlocksUnavailableError too
            raise CacheWriteError(
                f"a block of this cache continues one that is gone, damaged or out of reach ({exc}); "
                "the cache was not saved (its next request reads what is stored, or prefills)"
            ) from exc
        return priors

    def set_agent(self, record: AgentRecord) -> None:
        """Store ``record``, whose blocks are all stored already (a fork, a snapshot, a
        restore: blocks are shared, none is copied)."""

        def gone(i: int) -> Block:  # save_agent found block i missing: nothing is written
            raise BlockMissingError(
                f"cannot point agent {record.agent_id!r} at its {len(record.blocks)} blocks: block {i} "
                "is gone (deleted by another process?)"
            )

        self.save_agent(record, gone)

    def fork(self, source_id: str, record_of: Callable[[AgentRecord], AgentRecord]) -> AgentRecord:
        """Store ``record_of(source)``, a record naming the blocks of agent ``source_id``'s
        stored record, read under the directory lock with the write: a save or a delete of
        the source (this process's or another's) cannot free those blocks in between.
        ``AgentNotFoundError`` if the source has no record. Returns the source's record."""
        with self.store.locked():
            source = self.store.get_agent(source_id)
            if source is None:
                raise AgentNotFoundError(f"agent {source_id!r} has no stored cache")
            self.set_agent(record_of(source))
        return source

    def delete_agent(self, agent_id: str) -> bool:
        """Delete an agent's record (even an unreadable one) and the blocks only it named."""
        with self.store.locked():
            chain = self.store.local.agent_chain(agent_id)
            gone = self.store.delete_agent(agent_id)
            self.release(chain)
        return gone

    def release(self, old: Iterable[BlockHash], new: Iterable[BlockHash] = ()) -> None:
        """A chain changed from ``old`` to ``new`` (its record is already stored): delete
        the blocks of ``old`` that no agent record names any more."""
        keep = set(new)
        with self.store.locked():
            for h in dict.fromkeys(old):
                if h not in keep and not self.store.local.is_referenced(h):
                    self._drop(h)

    def forget(self, h: BlockHash) -> None:
        """Drop the memory copy only (the file stays)."""
        with self._lock:
            block = self._hot.pop(h, None)
            if block is not None:
                self._hot_bytes -= block.nbytes

    def _drop(self, h: BlockHash) -> None:
        self.forget(h)
        self.store.delete_block(h)
        self.stats.blocks_deleted += 1

    # ------------------------------------------------------------------ hot tier

    def _admit(self, block: Block) -> None:
        with self._lock:
            self._admit_locked(block)

    def _admit_locked(self, block: Block) -> None:
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
        with self._lock:
            return list(self._hot)

    def snapshot_stats(self) -> PoolStats:
        self.stats.hot_blocks = len(self._hot)
        self.stats.hot_bytes = self._hot_bytes
        return self.stats
