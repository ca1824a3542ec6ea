"""A store shared by workers on several hosts: records in PostgreSQL (``catalog``), blocks
in S3-compatible object storage (``objects``), this worker's disk in front of both.

``SharedBlockStore`` is a ``BlockStore``: the engine runs on it as on the local one.

- Reads are read-through: a block not on this worker's disk is fetched (in parallel, with
  a deadline) and written there; a record read from Postgres is mirrored in the local
  index, with the version it is. If blocks do not come in time the request reuses those
  it has and prefills the rest (``BlocksUnavailableError.available``).
- A save writes the blocks and the record locally first (marked pending), uploads the
  blocks the store lacks (catalog row, then conditional create of the object), then
  commits the record in one Postgres transaction that checks its version and the lease
  (``Catalog.commit``). A lost race raises ``CommitConflictError`` (the local copy is
  dropped: the next request reads the winner's). An unreachable store leaves the save
  pending: a background thread uploads it when the store answers again.
- A request takes the agent's lease (``begin``: one round trip, which also says whether
  this worker's live copy is still the newest); the commit gives it back.
- The engine's model thread never waits on the store: the store's work of a request
  (lease, record, blocks) is done before it reaches that thread
  (``engine.requests.admissions``); there, the parts read this worker's tier only, through
  ``local_tier()``. Nothing waits on a lease given back or a bad object replaced: those run
  on the store's threads.
- Nothing here deletes a block object except ``collect_garbage`` (grace period, row lock).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import uuid
import weakref
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path

from ..ops.files import DirectoryLock
from ..ops.process import RUNTIME
from .blocks import AgentRecord, Block, BlockHash
from .catalog import Catalog
from .leases import Leases
from .local_tier import LocalTier
from .objects import ObjectBlocks, RemoteConfigError, RemoteUnavailableError
from .reader import BlockGroup
from .remote_blocks import Reach, SharedBlocks, SharedStats, submit
from .remote_records import SharedRecords
from .remote_upkeep import SharedUpkeep
from .replication import SharedReplication
from .store import DiskBlockStore
from .store_config import StoreConfig

logger = logging.getLogger(__name__)


class SharedBlockStore:
    """Blocks and records shared through PostgreSQL and an object store, with this
    worker's directory (a ``DiskBlockStore``) as the tier in front. Its work is its parts':
    ``blocks`` (read through, uploaded), ``records`` (read through, committed, pending
    saves), ``upkeep`` (garbage collection, verify), ``leases`` (a request's hold on an
    agent), and ``replication``: what callers ask of a shared store only (a local store's
    is None)."""

    def __init__(
        self,
        local: DiskBlockStore,
        catalog: Catalog,
        objects: ObjectBlocks,
        *,
        worker_id: str | None = None,
        read_timeout_s: float = 5.0,
        lease_s: float = 10.0,
        grace_s: float = 3600.0,
        retry_s: float = 5.0,
        handoff_wait_s: float = 10.0,
    ) -> None:
        self.local, self.catalog, self.objects = local, catalog, objects
        self.fingerprint = local.fingerprint
        self.dir = local.dir
        self.worker_id = worker_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.stats = SharedStats()
        self.reach = Reach(self.stats)
        self._io = RUNTIME.pool("agent-memory-remote", 8)
        self.leases = Leases(catalog, self.fingerprint, self.worker_id, lease_s, handoff_wait_s, self._io)
        self.blocks = SharedBlocks(
            local, catalog, objects, self._io, self.reach, read_timeout_s=read_timeout_s
        )
        self.records = SharedRecords(
            local, catalog, self.blocks, self.leases, self.reach,
            worker_id=self.worker_id, lease_s=lease_s, retry_s=retry_s,
        )  # fmt: skip
        self.upkeep = SharedUpkeep(local, catalog, objects, self.blocks, grace_s=grace_s)
        #: this worker's disk (``DiskMaintenance``): its eviction forgets the copies here
        self.maintenance = local.maintenance
        self.maintenance.on_evict = self.records.forget
        self.replication = SharedReplication(
            local, catalog, self.leases, self.records, self.reach, self.stats, self._io
        )
        if self.local.pending_agents():  # saved here by an earlier process, not uploaded
            self.records.pending.start()
        _OPEN.add(self)

    def local_tier(self) -> LocalTier:
        """This store as the engine's model thread reads it: this worker's copies only, so
        that a hung store stalls no model step (``local_tier``)."""
        return LocalTier(self, self.replication)

    def locked(self) -> DirectoryLock:
        return self.local.locked()

    def close(self) -> None:
        _OPEN.discard(self)
        self.leases.close()
        self.records.pending.close()
        self.records.lanes.close()
        self._io.shutdown(wait=True)
        self.catalog.close()
        self.local.close()

    # ------------------------------------------------------------------ blocks (``blocks``)

    def has_block(self, h: BlockHash) -> bool:
        return h in self.blocks.stored([h])

    def put_block(self, block: Block) -> int:
        """Written to this worker's disk; uploaded when a record naming it commits."""
        return self.local.put_block(block)

    def prior_of(self, h: BlockHash) -> BlockHash | None:
        self.blocks.fetch([h])
        return self.local.prior_of(h)

    def get_block(self, h: BlockHash, names: Sequence[str] | None = None) -> Block:
        self.blocks.fetch([h])
        return self.local.get_block(h, names)

    def read_blocks(
        self, hashes: Sequence[BlockHash], layers: Collection[int] | None = None
    ) -> list[BlockGroup]:
        self.blocks.fetch(hashes)
        return self.local.read_blocks(hashes, layers)

    def delete_block(self, h: BlockHash) -> None:
        """This worker's copy only: objects go through ``collect_garbage``."""
        self.local.delete_block(h)

    def quarantine_block(self, h: BlockHash) -> Path | None:
        """Move a bad copy here aside and fetch the block again; if the store's copy is bad
        too, delete it there (its catalog row unmarked): the next save that needs the block
        uploads a sound one, as a local store's next save rewrites a quarantined file."""
        moved = self.local.quarantine_block(h)
        submit(self._io, self.blocks.replace_bad, h)  # nothing waits on the store's copy
        return moved

    # ------------------------------------------------------------------ records (``records``)

    def get_agent(self, agent_id: str) -> AgentRecord | None:
        return self.records.get_agent(agent_id)

    def has_agent(self, agent_id: str) -> bool:
        return self.records.has_agent(agent_id)

    def agents(self, prefix: str = "") -> Iterator[AgentRecord]:
        return self.records.agents(prefix)

    def put_agent(self, record: AgentRecord) -> int:
        return self.records.put_agent(record)

    def delete_agent(self, agent_id: str) -> bool:
        return self.records.delete_agent(agent_id)


#: Shared stores open in this process (``upload_before_exit`` at interpreter exit).
_OPEN: weakref.WeakSet[SharedBlockStore] = weakref.WeakSet()


def upload_before_exit(deadline: float) -> None:
    """At interpreter exit, after the saves queued have run (``engine.saves``): upload what
    every open shared store keeps locally and not in the store yet, until ``deadline``."""
    for store in list(_OPEN):
        with contextlib.suppress(Exception):
            store.replication.pending.upload_before_exit(deadline)


def open_store(
    root: str | os.PathLike[str],
    fingerprint: str,
    store: StoreConfig | None = None,
    *,
    read_timeout_s: float = 5.0,
    grace_s: float = 3600.0,
    worker_id: str | None = None,
    read_only: bool = False,
) -> DiskBlockStore | SharedBlockStore:
    """The local store under ``root``, or a shared one (``store``: its records' and blocks'
    URLs) with it as the local tier. ``read_only``: a local store opened only to look (no
    recovery, lock or migration).

    A shared store is checked first (the database answers and is bound to this bucket, a
    probe object can be written): a wrong setting fails here with its whole cause
    (``RemoteConfigError``), not as saves pending forever; unless ``store.lazy``: start
    anyway, serving from the local tier."""
    if store is None:
        return DiskBlockStore(root, fingerprint, read_only=read_only)
    catalog = Catalog(store.records, timeout_s=read_timeout_s)
    objects = ObjectBlocks(store.blocks, timeout_s=read_timeout_s)
    if not store.lazy:
        try:
            objects.check()
            catalog.bind_blocks(objects.identity)
        except (RemoteUnavailableError, RemoteConfigError) as exc:
            catalog.close()
            raise RemoteConfigError(
                f"the shared store cannot be used: {exc}. Fix the setting; or start anyway with "
                "lazy_store=True (AGENT_MEMORY_LAZY_STORE=1, agent-memory serve --lazy-store): replies "
                "then come from this worker's copies and saves upload once the store answers"
            ) from exc
    local = DiskBlockStore(root, fingerprint, tier=True)
    return SharedBlockStore(
        local, catalog, objects, worker_id=worker_id, read_timeout_s=read_timeout_s, grace_s=grace_s,
        handoff_wait_s=store.handoff_wait_s,
    )  # fmt: skip
