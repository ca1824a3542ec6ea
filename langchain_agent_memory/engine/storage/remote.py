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

from ..ops.files import DirectoryLock
from ..ops.process import RUNTIME
from .catalog import Catalog
from .leases import Leases
from .local_tier import LocalTier
from .objects import ObjectBlocks, RemoteConfigError, RemoteUnavailableError
from .remote_blocks import Reach, SharedBlocks, SharedStats
from .remote_records import SharedRecords
from .remote_upkeep import SharedUpkeep
from .replication import SharedReplication
from .store import DiskBlockStore
from .store_config import StoreConfig

logger = logging.getLogger(__name__)


class SharedBlockStore:
    """Blocks and records shared through PostgreSQL and an object store, with this
    worker's directory (``local``, a ``DiskBlockStore``) as the tier in front. Callers use
    its roles (``protocols.BlockStore``): ``blocks`` (read through, uploaded: ``SharedBlocks``),
    ``records`` (read through, committed, pending saves: ``SharedRecords``), ``maintenance``
    (this worker's disk) and ``replication`` (what callers ask of a shared store only; a
    local store's is None); and its own parts: ``upkeep`` (garbage collection, verify),
    ``leases`` (a request's hold on an agent)."""

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
        self._lock = local.locked()
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
        if self.local.records.pending_agents():  # saved here by an earlier process, not uploaded
            self.records.pending.start()
        _OPEN.add(self)

    def local_tier(self) -> LocalTier:
        """This store as the engine's model thread reads it: this worker's copies only, so
        that a hung store stalls no model step (``local_tier``)."""
        return LocalTier(self.local, self.blocks, self.replication)

    def locked(self) -> DirectoryLock:
        """This worker's directory lock (a record's commit in the store is ordered by its
        version and lease, ``Catalog.commit``)."""
        return self._lock

    def close(self) -> None:
        _OPEN.discard(self)
        self.leases.close()
        self.records.pending.close()
        self.records.lanes.close()
        self._io.shutdown(wait=True)
        self.catalog.close()
        self.local.close()


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
            # Down or slow is not misconfigured: say which the cause is.
            if isinstance(exc, RemoteUnavailableError) and exc.unreachable:
                fix = "Start it (or wait until it answers; if it runs, check the URL's host and port)"
            else:
                fix = "Fix the setting"
            raise RemoteConfigError(
                f"the shared store cannot be used: {exc}. {fix}; or start anyway with lazy_store=True "
                "(AGENT_MEMORY_LAZY_STORE=1, agent-memory serve --lazy-store): replies then come from "
                "this worker's copies and saves upload once the store answers"
            ) from exc
    local = DiskBlockStore(root, fingerprint, tier=True)
    return SharedBlockStore(
        local, catalog, objects, worker_id=worker_id, read_timeout_s=read_timeout_s, grace_s=grace_s,
        handoff_wait_s=store.handoff_wait_s,
    )  # fmt: skip
