"""The store side of the block pool: what a save, a fork, a restore or a delete writes, run
on the engine's I/O thread (the save thread) or a command-line tool's. It touches no memory
tier: each write says what it did (``WriteOutcome``: the blocks written, the blocks
deleted), and the engine's loop, which owns the pool's memory tier, brings that tier in step
(``BlockPool.apply``).

Which blocks are still needed is the store's index (every agent record's references,
across processes), not a count kept here: a block is deleted when a chain change leaves
no record naming it, checked under the store's directory lock.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

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


@dataclass(slots=True)
class WriteOutcome:
    """What store writes did, for the pool's memory tier (``BlockPool.apply``)."""

    #: the blocks written (the memory tier may keep them)
    written: list[Block] = field(default_factory=list)
    bytes_written: int = 0
    #: the blocks deleted (their memory copies go)
    deleted: list[BlockHash] = field(default_factory=list)


class BlockWrites:
    """Writes to ``store``: blocks, then the records naming them, then the blocks nothing
    names any more. ``bytes_written``: all this writer wrote (what the disk budget counts)."""

    def __init__(self, store: BlockStore) -> None:
        self.store = store
        self.bytes_written = 0

    def put(self, block: Block, into: WriteOutcome | None = None) -> int:
        """Persist ``block`` (no-op if stored); return bytes written."""
        written = self.store.local.blocks.put(block)  # a shared store's: uploaded by its commit
        self.bytes_written += written
        if written and into is not None:
            into.written.append(block)
            into.bytes_written += written
        return written

    def save_agent(
        self,
        record: AgentRecord,
        block_of: Callable[[int], Block],
        old: Iterable[BlockHash] = (),
        into: WriteOutcome | None = None,
        in_hand: Mapping[BlockHash, Block] | None = None,
    ) -> int:
        """Persist ``record``: first each of its blocks not yet stored (``block_of(i)`` builds
        block ``i``), then the record, then delete the blocks it replaced (``old``, and those
        of the stored record) that nothing names any more. A crash at any point leaves the old
        record or the new one, each with all of its blocks. Under the directory lock, so that
        another process's delete cannot remove a block between the check that it exists and
        the record naming it. Returns the bytes written; raises ``CacheWriteError`` (the old
        record and its blocks untouched) if the disk refuses a write. ``in_hand``: blocks
        held in memory (the saves', the pool's), whose headers need no read."""
        written, new_blocks = 0, []
        with self.store.locked():
            replaced = set(old) | set(self.store.local.records.agent_chain(record.agent_id))
            try:
                # The record names what reading its chain takes: its segments' earlier blocks
                # (each checked below like the rest: another process may have deleted one).
                record.set_priors(self._priors(record.chain, block_of, in_hand or {}))
                for i, h in enumerate(record.blocks):
                    if not self.store.blocks.has(h):
                        written += self.put(block_of(i), into)
                        new_blocks.append(h)
                written += self.store.records.put(record)
            except (OSError, sqlite3.Error, CacheWriteError) as exc:
                self.release(new_blocks, into=into)  # written for a record that was not
                if isinstance(exc, CacheWriteError):
                    raise
                raise CacheWriteError(
                    f"could not save agent {record.agent_id!r}'s cache: {exc}. Its previous cache "
                    "is intact; free disk space (or fix the cache directory's permissions) and retry"
                ) from exc
            self.release(replaced, record.blocks, into=into)
        return written

    def _priors(
        self, chain: list[BlockHash], block_of: Callable[[int], Block], in_hand: Mapping[BlockHash, Block]
    ) -> dict[BlockHash, BlockHash]:
        """Each segment of ``chain`` -> the block of its earlier rows, and so on back to a
        whole block (``Block.rows_from``): from the blocks in hand (the save's, the memory
        tier's), else from the stored blocks' headers."""

        def prior(i: int | None, h: BlockHash) -> BlockHash | None:
            block = None
            if i is not None:
                with contextlib.suppress(CacheWriteError, BlockMissingError):
                    block = block_of(i)
            block = block or in_hand.get(h)
            return self.store.blocks.prior_of(h) if block is None else block.prior(self.store.fingerprint)

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

    def set_agent(self, record: AgentRecord, into: WriteOutcome | None = None) -> None:
        """Store ``record``, whose blocks are all stored already (a fork, a snapshot, a
        restore: blocks are shared, none is copied)."""

        def gone(i: int) -> Block:  # save_agent found block i missing: nothing is written
            raise BlockMissingError(
                f"cannot point agent {record.agent_id!r} at its {len(record.blocks)} blocks: block {i} "
                "is gone (deleted by another process?)"
            )

        self.save_agent(record, gone, into=into)

    def fork(
        self,
        source_id: str,
        record_of: Callable[[AgentRecord], AgentRecord],
        into: WriteOutcome | None = None,
    ) -> AgentRecord:
        """Store ``record_of(source)``, a record naming the blocks of agent ``source_id``'s
        stored record, read under the directory lock with the write: a save or a delete of
        the source (this process's or another's) cannot free those blocks in between.
        ``AgentNotFoundError`` if the source has no record. Returns the source's record."""
        with self.store.locked():
            source = self.store.records.get(source_id)
            if source is None:
                raise AgentNotFoundError(f"agent {source_id!r} has no stored cache")
            self.set_agent(record_of(source), into)
        return source

    def delete_agent(self, agent_id: str, into: WriteOutcome | None = None) -> bool:
        """Delete an agent's record (even an unreadable one) and the blocks only it named."""
        with self.store.locked():
            chain = self.store.local.records.agent_chain(agent_id)
            gone = self.store.records.delete(agent_id)
            self.release(chain, into=into)
        return gone

    def release(
        self, old: Iterable[BlockHash], new: Iterable[BlockHash] = (), into: WriteOutcome | None = None
    ) -> None:
        """A chain changed from ``old`` to ``new`` (its record is already stored): delete
        the blocks of ``old`` that no agent record names any more."""
        keep = set(new)
        with self.store.locked():
            for h in dict.fromkeys(old):
                if h not in keep and not self.store.local.records.is_referenced(h):
                    self.store.local.blocks.delete(h)  # this worker's copy (objects: ``collect_garbage``)
                    if into is not None:
                        into.deleted.append(h)
