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

import contextlib
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Protocol

from .agent_ids import validate_agent_id
from .blocks import AgentRecord, Block, BlockHash
from .objects import BlocksUnavailableError
from .protocols import LeaseHolder
from .reader import BlockGroup
from .store import DiskBlockStore


class TieredStore(Protocol):
    """A store with this worker's directory in front (``SharedBlockStore``)."""

    local: DiskBlockStore
    fingerprint: str

    def quarantine_block(self, h: BlockHash) -> Path | None: ...
    def locked(self) -> contextlib.AbstractContextManager[None]: ...


class TierLeases:
    """A shared store's leases as the model's thread sees them (``LocalTier.replication``):
    a request whose lease could not be taken before (``admissions``) goes on from what is
    here, so ``begin`` asks the store nothing; the give-back runs on the store's threads."""

    def __init__(self, replication: LeaseHolder) -> None:
        self.end = replication.end
        self.seen_version = replication.seen_version

    def begin(self, agent_id: str, version: int | None) -> bool:
        return True


class LocalTier:
    """``SharedBlockStore.local_tier()``: its reads answered from this worker's disk alone;
    what must still reach the store (a lease given back, a bad object replaced) is handed to
    the store's own threads (``replication.end``, ``quarantine_block``)."""

    def __init__(self, store: TieredStore, replication: LeaseHolder) -> None:
        self._store, self._local = store, store.local
        self.fingerprint = store.fingerprint
        self.replication = TierLeases(replication)
        self.maintenance = store.local.maintenance  # this worker's disk: all of it is here

    def has_block(self, h: BlockHash) -> bool:
        return self._local.has_block(h)

    def prior_of(self, h: BlockHash) -> BlockHash | None:
        self._here([h])
        return self._local.prior_of(h)

    def get_block(self, h: BlockHash, names: Sequence[str] | None = None) -> Block:
        self._here([h])
        return self._local.get_block(h, names)

    def read_blocks(
        self, hashes: Sequence[BlockHash], layers: Collection[int] | None = None
    ) -> list[BlockGroup]:
        self._here(hashes)
        return self._local.read_blocks(hashes, layers)

    def _here(self, hashes: Sequence[BlockHash]) -> None:
        """``BlocksUnavailableError`` (with how many leading ones are here) unless every one
        of ``hashes`` is on this worker's disk."""
        missing = [h for h in hashes if not self._local.has_block(h)]
        if missing:
            raise BlocksUnavailableError(
                f"shared store: {len(missing)} block(s) were not fetched before the request was admitted",
                self._local.leading_blocks(hashes),
            )

    def get_agent(self, agent_id: str) -> AgentRecord | None:
        """This worker's copy of the record (the newest one was read before the request
        reached the model's thread)."""
        validate_agent_id(agent_id)
        return self._local.get_agent(agent_id)

    def quarantine_block(self, h: BlockHash) -> Path | None:
        return self._store.quarantine_block(h)  # the store's copy is checked on its threads

    def locked(self) -> contextlib.AbstractContextManager[None]:
        return self._store.locked()
