"""What the engine asks of a block store (``DiskBlockStore``, ``SharedBlockStore``): a store
is its roles, each a small protocol implemented once per backend and used by callers
directly (``store.blocks.get``, ``store.records.put``), never through the store:

- ``blocks`` (``BlockStoreBlocks``): block files, read (a shared store's read through this
  worker's disk) and quarantined; written to this worker's directory
  (``store.local.blocks.put``: a shared store's commit uploads those its record names).
- ``records`` (``BlockStoreRecords``): agent records.
- ``maintenance`` (``Maintenance``): this worker's disk: bytes, eviction, quarantined
  records, recovery.
- ``replication`` (``Replication``): the lease around a request, versions, saves waiting to
  upload: a shared store's only, absent (None) for a local one.
- ``local``: this worker's directory (a ``DiskBlockStore``: what only a directory has, its
  files' paths and sizes, the chains its records name, their sync state, is asked of
  ``local.blocks`` and ``local.records``); ``local_tier()``: the store as the engine's
  model thread reads it (``StoreReads``); ``locked()``, ``close()``.

``BlockStore`` is all of them: what a backend implements, and what the store conformance
suite (tests/integration/test_store_conformance.py) checks, role by role, on every
backend."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from .blocks import AgentRecord, Block, BlockHash, StoreUsage
from .index import RecoveryReport
from .reader import BlockGroup
from .status import StoreStatus

if TYPE_CHECKING:
    from .store import DiskBlockStore

logger = logging.getLogger(__name__)


class BlockStoreBlocks(Protocol):
    """Block files: content-addressed, immutable, written before any record names them
    (``BlockFiles``, a local store's; ``SharedBlocks``, read through this worker's disk;
    ``TierBlocks``, this worker's disk alone, for the model's thread)."""

    fingerprint: str

    def has(self, h: BlockHash) -> bool:
        """Whether block ``h`` can be read (a shared store: here or in the store)."""

    def prior_of(self, h: BlockHash) -> BlockHash | None:
        """The block of segment ``h``'s earlier rows (None: ``h`` is whole)."""

    def get(self, h: BlockHash, names: Sequence[str] | None = None) -> Block:
        """Block ``h`` (all tensors, or only ``names``), verified: ``BlockMissingError``,
        ``CacheFormatError``; never unverified data."""

    def read(self, hashes: Sequence[BlockHash], layers: Collection[int] | None = None) -> list[BlockGroup]:
        """Blocks ``hashes`` in order, verified, as groups of one tensor layout (``layers``:
        only these layers' tensors are needed)."""

    def quarantine(self, h: BlockHash) -> Path | None:
        """Move a bad copy of ``h`` aside (where it went; None: there was none)."""


class RecordReads(Protocol):
    """An agent's record, as the model's thread reads it (``StoreReads.records``)."""

    def get(self, agent_id: str) -> AgentRecord | None:
        """The agent's record (None: none); ``CacheFormatError`` if it is unreadable."""


class BlockStoreRecords(RecordReads, Protocol):
    """Agent records (``AgentIndex``, a local store's; ``SharedRecords``, a shared store's,
    whose ``put`` commits and gives the request's lease back)."""

    def put(self, record: AgentRecord) -> int:
        """Store ``record`` (its blocks stored first); the bytes written."""

    def has(self, agent_id: str) -> bool:
        """Whether the agent has a record (none is parsed)."""

    def delete(self, agent_id: str) -> bool:
        """Forget the agent's record (its blocks are the caller's: ``BlockWrites``)."""

    def list(self, prefix: str = "") -> Iterator[AgentRecord]:
        """Every readable record whose agent id starts with ``prefix``, by agent id."""


class Maintenance(Protocol):
    """This worker's disk: bytes, least-recently-used order and eviction, quarantined
    records, recovery after a crash (``maintenance.DiskMaintenance``, the one
    implementation; a shared store's is its local tier's, which also forgets in the shared
    records what it evicts)."""

    def disk_bytes(self) -> int: ...
    def oldest_use(self) -> float | None: ...
    def usage(self) -> StoreUsage: ...
    def evict_agents(self, agent_ids: Sequence[str]) -> tuple[int, list[BlockHash]]: ...
    def quarantine_agent(self, agent_id: str) -> Path | None: ...
    def clear_quarantine(self) -> int: ...
    def recover(self) -> RecoveryReport: ...


class LeaseHolder(Protocol):
    """Where a request's lease is taken (``begin``: whether a live copy at ``version`` is
    current) and given back without a commit (``end``), and the version of each agent this
    worker last read or wrote: a shared store's ``replication``, or its local tier's view
    of it. A local store has none: one directory has one writer at a time."""

    def begin(self, agent_id: str, version: int | None) -> bool: ...
    def end(self, agent_id: str) -> None: ...
    def seen_version(self, agent_id: str) -> int | None: ...


class Replication(LeaseHolder, Protocol):
    """What a store shared by workers adds (``storage.replication.SharedReplication``): the
    leases, the saves kept on this worker until the store takes them (never evicted:
    ``pinned``; bounded: ``bound_pending``), and its state for a readiness probe."""

    def pinned(self) -> set[str]: ...
    def bound_pending(self, max_bytes: int | None) -> None: ...
    def status(self) -> StoreStatus: ...


class StoreReads(Protocol):
    """What the engine's model thread reads of a store (``BlockStore.local_tier``): never a
    network round trip. A local store is its own; a shared store's is a ``LocalTier``
    (this worker's copies: a request's store work is done before it reaches that thread).
    Mutations that must not interleave with another process's run inside ``locked()``."""

    fingerprint: str

    @property
    def blocks(self) -> BlockStoreBlocks: ...
    @property
    def records(self) -> RecordReads: ...
    @property
    def replication(self) -> LeaseHolder | None: ...
    @property
    def maintenance(self) -> Maintenance: ...
    def locked(self) -> contextlib.AbstractContextManager[None]: ...


class BlockStore(Protocol):
    """A backend (local ``DiskBlockStore``, ``remote.SharedBlockStore``): its roles, and the
    view its model-thread readers get (``local_tier``); both pass the store conformance
    suite (tests/integration/test_store_conformance.py). Mutations that must not interleave
    with another process's (a commit: blocks then record; a delete: record then orphaned
    blocks) run inside ``with store.locked():``. ``local``: this worker's directory; a local
    store is its own."""

    fingerprint: str

    @property
    def blocks(self) -> BlockStoreBlocks: ...
    @property
    def records(self) -> BlockStoreRecords: ...
    @property
    def maintenance(self) -> Maintenance: ...
    @property
    def replication(self) -> Replication | None: ...
    @property
    def local(self) -> DiskBlockStore: ...
    def local_tier(self) -> StoreReads: ...
    def locked(self) -> contextlib.AbstractContextManager[None]: ...
    def close(self) -> None: ...


def seen_version(replication: LeaseHolder | None, agent_id: str) -> int | None:
    """The version of the agent this worker last read or wrote (None: none, or a local
    store, which has no versions)."""
    return None if replication is None else replication.seen_version(agent_id)


class Lease:
    """A request's hold on an agent (``take_lease``): ``current`` says whether a live copy at
    the version the caller holds is the newest. Given back exactly once: by ``release`` (a
    request that ends without a commit), or by the commit that ends it (``committed``: the
    store's ``records.put`` gives it back). As a context manager it is given back when its
    block raises. A local store's lease holds nothing (``store`` is None); a shared store's
    is a row in its catalog that other workers' requests wait on until it is given back or
    expires."""

    __slots__ = ("_done", "agent_id", "current", "store")

    def __init__(self, store: LeaseHolder | None, agent_id: str, current: bool) -> None:
        self.store, self.agent_id, self.current = store, agent_id, current
        self._done = False

    def release(self) -> None:
        if not self._done:
            self._done = True
            if self.store is not None:
                self.store.end(self.agent_id)

    def committed(self) -> None:
        self._done = True

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        if kind is not None:
            self.release()


def take_lease(replication: LeaseHolder | None, agent_id: str, version: int | None) -> Lease:
    """Take the agent's lease for a request that holds it at ``version`` (a store's
    ``replication``; None, a local store's: a lease that holds nothing, always current)."""
    if replication is None:
        return Lease(None, agent_id, True)
    return Lease(replication, agent_id, replication.begin(agent_id, version))
