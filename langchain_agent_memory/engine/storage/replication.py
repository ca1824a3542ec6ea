"""What a store shared by workers adds to a local one (``SharedBlockStore.replication``):
the lease around a request, the version of each agent this worker last read or wrote, and
the saves kept on this worker until the store takes them. A local store has none
(``replication is None``): one directory has one writer at a time, so there is no lease
to take, no version to compare and nothing to upload; callers check for it instead of
calling no-ops."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from .catalog import Catalog
from .leases import Leases
from .objects import RemoteUnavailableError
from .remote_blocks import Reach, SharedStats, submit
from .remote_records import SharedRecords
from .status import StoreStatus
from .store import DiskBlockStore


class SharedReplication:
    """A shared store's replication: ``leases`` (a request's hold on an agent, a row in the
    catalog), ``records`` (the versions committed, the saves waiting to upload) and this
    worker's ``local`` index, which keeps the version it last saw of each agent."""

    def __init__(
        self,
        local: DiskBlockStore,
        catalog: Catalog,
        leases: Leases,
        records: SharedRecords,
        reach: Reach,
        stats: SharedStats,
        io: ThreadPoolExecutor,
    ) -> None:
        self._local = local
        self._catalog = catalog
        self._leases = leases
        self._records = records
        self._reach = reach
        self._stats = stats
        self._io = io
        #: the saves kept on this worker until the store takes them (``flush``, ``nbytes``,
        #: ``upload_before_exit``)
        self.pending = records.pending

    @property
    def reachable(self) -> bool:
        """Whether the store answered its last call (False: the circuit is open, and this
        worker serves from its local tier)."""
        return self._catalog.healthy

    def status(self) -> StoreStatus:
        """Reachable, and the saves waiting to upload (their bytes read from this worker's
        index only when there are some): nothing here waits on the store or a save."""
        pending = self._stats.pending_saves
        return StoreStatus(True, self.reachable, pending, self.pending.nbytes() if pending else 0)

    # ------------------------------------------------------------------ a request's lease

    def begin(self, agent_id: str, version: int | None) -> bool:
        """Take the agent's lease for a request (waiting for another worker's save in flight:
        ``Leases.take``); False if a live copy at ``version`` is stale (another worker
        committed since). Unreachable: True (work from what is here)."""
        try:
            current = self._leases.take(agent_id)
        except RemoteUnavailableError as exc:
            self._reach.down(exc)
            return True
        return current == version or self._records.is_own_save(agent_id, version, current)

    def seen_version(self, agent_id: str) -> int | None:
        """The store's version of the agent this worker last read or wrote (None: none)."""
        state = self._local.records.sync_state(agent_id)
        return state[0] if state else None

    def end(self, agent_id: str) -> None:
        """Give the lease back after a request that did not commit (the last of this
        worker's on the agent), on the store's threads: nothing waits on it, and a request
        that starts meanwhile takes the row again (``Leases.give_back``)."""
        if self._leases.done(agent_id):
            submit(self._io, self._leases.give_back, agent_id)

    # ------------------------------------------------------------------ saves waiting to upload

    def pinned(self) -> set[str]:
        """Agents eviction must keep whatever their age: saves made while the store was
        unreachable, the only copy until uploaded."""
        return set(self._local.records.pending_agents())

    def bound_pending(self, max_bytes: int | None) -> None:
        """Keep at most ``max_bytes`` of saves waiting to upload on this worker (None: no
        bound): past it the oldest are dropped, loudly (``PendingSaves.bound``)."""
        self.pending.max_bytes = max_bytes
