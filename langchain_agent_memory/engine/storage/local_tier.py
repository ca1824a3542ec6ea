"""A shared store as the engine's model thread reads it: this worker's tier only.

With a shared store, a request's store work (its lease, the newest record, the blocks this
worker lacks) is done before the request reaches the model's thread
(``engine.requests.admissions``). There, a read that went to the network would stall every
agent of the worker for as long as the store took to answer, so the parts that run on that
thread (the agents' caches, the pool's reads) are handed this view instead of the store:
what is not on this worker's disk by then is missing, and the request prefills it.
A local store is its own local tier (``DiskBlockStore.local_tier``).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from ..ops.files import DirectoryLock
from .block_files import BlockFiles
from .blocks import Block, BlockHash
from .objects import BlocksUnavailableError
from .protocols import BlockStoreBlocks, LeaseHolder
from .reader import BlockGroup
from .store import DiskBlockStore


class TierLeases:
    """A shared store's leases as the model's thread sees them (``LocalTier.replication``):
    a request whose lease could not be taken before (``admissions``) goes on from what is
    here, so ``begin`` asks the store nothing; the give-back runs on the store's threads."""

    def __init__(self, replication: LeaseHolder) -> None:
        self.end = replication.end
        self.seen_version = replication.seen_version

    def begin(self, agent_id: str, version: int | None) -> bool:
        return True


class TierBlocks:
    """A shared store's blocks as the model's thread reads them (``LocalTier.blocks``): the
    files on this worker's disk (``files``) alone; a block not there is missing
    (``BlocksUnavailableError``: the request prefills it). A bad one is quarantined by the
    store's ``blocks`` (moved aside here, the store's copy checked on the store's threads)."""

    def __init__(self, files: BlockFiles, shared: BlockStoreBlocks) -> None:
        self.files = files
        self.fingerprint = files.fingerprint
        #: on this worker's disk: what the model's thread may read
        self.has = files.has
        self.quarantine = shared.quarantine

    def prior_of(self, h: BlockHash) -> BlockHash | None:
        self._here([h])
        return self.files.prior_of(h)

    def get(self, h: BlockHash, names: Sequence[str] | None = None) -> Block:
        self._here([h])
        return self.files.get(h, names)

    def read(self, hashes: Sequence[BlockHash], layers: Collection[int] | None = None) -> list[BlockGroup]:
        self._here(hashes)
        return self.files.read(hashes, layers)

    def _here(self, hashes: Sequence[BlockHash]) -> None:
        """``BlocksUnavailableError`` (with how many leading ones are here) unless every one
        of ``hashes`` is on this worker's disk."""
        missing = [h for h in hashes if not self.files.has(h)]
        if missing:
            raise BlocksUnavailableError(
                f"shared store: {len(missing)} block(s) were not fetched before the request was admitted",
                self.files.leading(hashes),
            )


class LocalTier:
    """``SharedBlockStore.local_tier()`` (a ``protocols.StoreReads``): its reads answered
    from this worker's disk alone; what must still reach the store (a lease given back, a
    bad object replaced) is handed to the store's own threads (``replication.end``,
    ``blocks.quarantine``)."""

    def __init__(self, local: DiskBlockStore, blocks: BlockStoreBlocks, replication: LeaseHolder) -> None:
        self.fingerprint = local.fingerprint
        self.blocks = TierBlocks(local.blocks, blocks)
        #: this worker's copies (the newest record was read before the request reached the
        #: model's thread)
        self.records = local.records
        self.replication = TierLeases(replication)
        self.maintenance = local.maintenance  # this worker's disk: all of it is here
        self._lock = local.locked()

    def locked(self) -> DirectoryLock:
        """This worker's directory lock (the store's)."""
        return self._lock
