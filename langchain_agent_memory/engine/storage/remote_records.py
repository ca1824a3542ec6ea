"""The records role of ``SharedBlockStore`` (``SharedRecords``, its ``records``:
``protocols.BlockStoreRecords``): agent records read through PostgreSQL and mirrored in this
worker's index, saves made here first and pushed to the store (compare-and-swap on the
version this worker last saw), saves left pending while the store is unreachable and
uploaded by a background thread (``PendingSaves``).

One agent's record work runs in order, on the store's lanes (``ops.lanes``): its read of the
catalog and the mirror here, its save and upload, the upload of a save left pending, its
delete. A read that answered before another worker's commit must not mirror its older
record over the newer one a later read brought (a request would plan from it and find its
blocks missing), nor over this worker's save in flight; two uploads of one agent must not
race each other's commit. Different agents' work never waits for each other: a request for
an agent with nothing to upload goes ahead while another agent's upload waits on a hung
database."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

from ..errors import BlockMissingError, CommitConflictError
from ..ops.lanes import Lanes
from ..ops.process import RUNTIME, Loan
from .agent_ids import validate_agent_id
from .blocks import AgentRecord, BlockHash, CacheFormatError, CacheWriteError, parse_record
from .catalog import Catalog
from .leases import Leases
from .objects import RemoteUnavailableError
from .remote_blocks import Reach, SharedBlocks, SharedStats
from .store import DiskBlockStore

logger = logging.getLogger(__name__)

#: Threads of the lanes: as many as the callers that may wait on them at once (admissions'
#: four, the save thread, the uploader, an admin call, a prefetch).
LANE_THREADS = 8


class SharedRecords:
    """Agent records of a shared store: in ``catalog``, mirrored in ``local`` (this worker's
    index), their blocks uploaded by ``blocks``, a request's lease in ``leases``."""

    def __init__(
        self,
        local: DiskBlockStore,
        catalog: Catalog,
        blocks: SharedBlocks,
        leases: Leases,
        reach: Reach,
        *,
        worker_id: str,
        lease_s: float,
        retry_s: float,
    ) -> None:
        self.local, self.catalog, self.blocks, self.leases, self.reach = local, catalog, blocks, leases, reach
        self.fingerprint = local.fingerprint
        self.stats = reach.stats
        self.worker_id = worker_id
        self.lease_s = lease_s
        #: each agent's record work, in order (the module's docstring)
        self.lanes = Lanes("agent-memory-records", LANE_THREADS)
        self.pending = PendingSaves(local, self.stats, self.push_pending, retry_s=retry_s)
        #: agent -> (version a pending save was based on, version its upload made): a live
        #: copy at the first is the second (this worker's own save, uploaded later).
        self._uploaded: dict[str, tuple[int | None, int]] = {}

    def is_own_save(self, agent_id: str, version: int | None, current: int | None) -> bool:
        """Whether the store's ``current`` version of the agent is this worker's own save,
        made over ``version`` and uploaded later (a live copy at ``version`` is current)."""
        return self._uploaded.get(agent_id) == (version, current)

    def forget(self, agent_id: str) -> None:
        """This worker's copy of the agent is gone (evicted)."""
        self._uploaded.pop(agent_id, None)

    def get(self, agent_id: str) -> AgentRecord | None:
        """The agent's record in the store (mirrored here), or this worker's copy if the store
        is unreachable."""
        validate_agent_id(agent_id)
        return self.lanes.call(agent_id, self._read, agent_id)

    def _read(self, agent_id: str) -> AgentRecord | None:
        """``get``, in the agent's lane."""
        try:
            self._push_pending(agent_id)
            got = self.catalog.get(self.fingerprint, agent_id)
        except RemoteUnavailableError as exc:
            self.reach.down(exc)
            return self.local.records.get(agent_id)
        state = self.local.records.sync_state(agent_id)
        if got is None:
            if self.local.records.has(agent_id) and not (state and state[1]):
                self.local.records.delete(agent_id)  # deleted on another worker
            return None
        raw, version = got
        if state == (version, False) and self.local.records.has(agent_id):
            with contextlib.suppress(CacheFormatError):
                return self.local.records.get(agent_id)
        self.local.records.set_sync(agent_id, version, False)  # the next save replaces even an unreadable one
        record = parse_record(raw, f"agent record {agent_id!r}")
        if record.agent_id != agent_id:
            raise CacheFormatError(f"agent record {agent_id!r} holds agent {record.agent_id!r}")
        self.local.records.put(record, sync=(version, False))
        return record

    def has(self, agent_id: str) -> bool:
        """Whether the store has the agent, or this worker a save of it not uploaded yet."""
        if self.local.records.upload_pending(agent_id):
            return True
        try:
            return self.catalog.has(self.fingerprint, agent_id)
        except RemoteUnavailableError as exc:
            self.reach.down(exc)
            return self.local.records.has(agent_id)

    def list(self, prefix: str = "") -> Iterator[AgentRecord]:
        """The store's records, with this worker's saves it has not taken yet in their place
        (they are the newest: an agent saved here while the store was out of reach, or
        leased by another worker, is listed, not missing until its upload)."""
        try:
            rows = self.catalog.agents(self.fingerprint, prefix)
        except RemoteUnavailableError as exc:
            self.reach.down(exc)
            yield from self.local.records.list(prefix)
            return
        listed: dict[str, AgentRecord] = {}
        for agent_id, raw, _ in rows:
            try:
                listed[agent_id] = parse_record(raw, f"agent record {agent_id!r}")
            except CacheFormatError as exc:
                logger.warning("skipping unreadable agent record: %s", exc)
        for agent_id in self.local.records.pending_agents():
            if agent_id.startswith(prefix):
                with contextlib.suppress(CacheFormatError):  # unreadable: said when it is read
                    mine = self.local.records.get(agent_id)
                    if mine is not None:
                        listed[agent_id] = mine
        yield from (listed[a] for a in sorted(listed))

    def put(self, record: AgentRecord) -> int:
        """Save ``record`` here (pending), then in the store (compare-and-swap on the version
        this worker last saw). ``CommitConflictError`` if another worker's save won; an
        unreachable store leaves it pending (uploaded later) and returns normally."""
        written, stored = self.lanes.call(record.agent_id, self._save, record)
        if not stored:
            # Left pending: bounded, here (under the directory lock the caller holds, which a
            # lane must not wait for), and loudly once per outage (``_push``).
            self.pending.bound()
        # The request's lease ends with its commit (or its save kept here); a save that
        # raised leaves it to the request (``Lease.release``): given back exactly once.
        self.leases.done(record.agent_id)
        return written

    def _save(self, record: AgentRecord) -> tuple[int, bool]:
        """``put``'s write here and upload, in the agent's lane: the bytes written,
        and whether the store took it."""
        state = self.local.records.sync_state(record.agent_id)
        base = state[0] if state else None
        written = self.local.records.put(record, sync=(base, True))
        return written, self._push(record, base)

    def _push(self, record: AgentRecord, base: int | None, *, pending: bool = False) -> bool:
        """Upload a locally saved record; False if the store is unreachable (still pending)
        or, for a ``pending`` save, another worker holds the agent's lease (retried later)."""
        try:
            self.blocks.upload(record.blocks)
            # Another worker's lease: its request is running (it commits, or gives the lease
            # back, soon) or it died (its lease expires within ``lease_s``, no heartbeat
            # renews it): a save waits that long, on the save thread, for a true outcome.
            lease_wait = time.monotonic() + (0.0 if pending else self.lease_s + 1.0)
            attempts = 0
            own = 0 if pending else 1  # a pending save's request has ended
            while True:
                try:
                    done = self.catalog.commit(
                        self.fingerprint, record.agent_id,
                        lambda now: replace(record, updated_at=now).to_json(),
                        record.blocks, base, self.worker_id,
                        release=not self.leases.others(record.agent_id, own),
                    )  # fmt: skip
                    self.leases.renew_if_held(record.agent_id, own)
                    break
                except BlockMissingError as exc:  # collected meanwhile: upload again, retry
                    self.blocks.upload([BlockHash(h) for h in exc.missing], check=False)
                except CommitConflictError as exc:
                    if exc.leased and time.monotonic() < lease_wait:
                        time.sleep(0.25)
                        continue
                    rebased = None if exc.leased else self._rebase(record)
                    if rebased is None:
                        raise
                    base = rebased
                attempts += 1
                if attempts >= 4:
                    raise RemoteUnavailableError("the commit kept meeting concurrent changes; retrying later")
        except RemoteUnavailableError as exc:
            first = self.reach.down(exc)
            # A new save left pending: said, loudly once per outage (``put`` bounds them).
            if not pending:
                logger.log(
                    logging.WARNING if first else logging.INFO,
                    "agent %r: shared store unreachable (%s); the cache is saved on this worker and is "
                    "uploaded when the store answers again",
                    record.agent_id,
                    exc,
                )
            self.pending.start()
            return False
        except CommitConflictError as exc:
            if exc.leased:  # another worker holds the agent: kept here, uploaded once it is free
                if not pending:
                    logger.warning(
                        "agent %r: another worker is running it (%s; its lease is still renewed after "
                        "%g s); this save is kept on this worker and uploaded once the lease is free",
                        record.agent_id, exc, self.lease_s,
                    )  # fmt: skip
                self.pending.start()
                return False
            self.stats.conflicts += 1
            self.local.records.delete(record.agent_id)  # the winner's record is read next time
            raise
        if pending:
            state = self.local.records.sync_state(record.agent_id)
            self._uploaded[record.agent_id] = (state[0] if state else None, done.version)
        record.updated_at = done.updated_at  # Postgres's clock: links to checkpoints use it
        self.local.records.set_sync(record.agent_id, done.version, False)
        self.stats.commits += 1
        self.reach.up()
        return True

    def _rebase(self, record: AgentRecord) -> int | None:
        """The store's version to commit ``record`` over if it continues what the store holds
        (its text extends the stored one: a save made while the store was unreachable, or
        one based on an older read, is the newer state of the same conversation); None if
        the two diverge (a real conflict: the stored one stands)."""
        got = self.catalog.get(self.fingerprint, record.agent_id)
        if got is None:
            return None
        try:
            stored = parse_record(got[0], f"agent record {record.agent_id!r}")
        except CacheFormatError:
            return got[1]  # an unreadable record: replaced
        return got[1] if _continues(record.text, stored.text) else None

    def push_pending(self, agent_id: str) -> None:
        """Upload this agent's pending save (the uploader's, before the process exits)."""
        self.lanes.call(agent_id, self._push_pending, agent_id)

    def _push_pending(self, agent_id: str) -> None:
        """Upload the agent's save left pending, if any, in the agent's lane (a request's read
        does first: it is the newest); ``RemoteUnavailableError`` while the store cannot take
        it."""
        state = self.local.records.sync_state(agent_id)
        if not (state and state[1]):
            return
        try:
            record = self.local.records.get(agent_id)
            if record is None:
                self.local.records.set_sync(agent_id, state[0], False)
                return
            if not self._push(record, state[0], pending=True):
                raise RemoteUnavailableError("the store is still unreachable, or the agent is leased")
        except CommitConflictError as exc:
            logger.warning(
                "agent %r: a save made while the shared store was unreachable lost to a newer save by "
                "another worker (%s); that one is kept",
                agent_id,
                exc,
            )

    def delete(self, agent_id: str) -> bool:
        validate_agent_id(agent_id)
        return self.lanes.call(agent_id, self._delete, agent_id)

    def _delete(self, agent_id: str) -> bool:
        try:
            gone = self.catalog.delete(self.fingerprint, agent_id)
        except RemoteUnavailableError as exc:
            raise CacheWriteError(
                f"could not delete agent {agent_id!r}: {exc}; nothing was deleted, retry when the "
                "store answers"
            ) from exc
        return self.local.records.delete(agent_id) or gone


def _continues(new: str, old: str) -> bool:
    """Whether ``new`` goes on from ``old``, whitespace aside (a reply's leading space is
    trimmed when it is returned, so a prompt built from it may differ there)."""
    a, b = "".join(new.split()), "".join(old.split())
    return len(a) > len(b) and a.startswith(b)


class PendingSaves:
    """Saves kept on this worker that the store has not taken yet (it was unreachable, or
    another worker held the agent's lease): their bytes, bounded by ``max_bytes``, and the
    thread that uploads them (``flush``, every ``retry_s`` until none is left). ``push``
    uploads one agent's (``RemoteUnavailableError`` while the store cannot take it)."""

    def __init__(
        self, local: DiskBlockStore, stats: SharedStats, push: Callable[[str], None], *, retry_s: float
    ) -> None:
        self.local, self.stats, self._push, self.retry_s = local, stats, push, retry_s
        #: Bytes of saves waiting to upload this worker keeps at most (None: no bound).
        self.max_bytes: int | None = None
        self._uploader: Loan | None = None
        self._closed = threading.Event()

    def nbytes(self) -> int:
        """Bytes of the blocks named by saves not uploaded yet (on this worker's disk)."""
        blocks: set[BlockHash] = set()
        for agent_id in self.local.records.pending_agents():
            with contextlib.suppress(Exception):  # deleted or quarantined meanwhile
                blocks.update(self.local.records.agent_chain(agent_id))
        return self.local.blocks.local_bytes(blocks)

    def bound(self) -> None:
        """Past ``max_bytes`` of saves waiting to upload, drop the oldest of them from
        this worker (never the newest, never a committed record: the store keeps the last
        version uploaded), loudly: a store that stays away must not fill the disk."""
        limit = self.max_bytes
        waiting = self.local.records.pending_agents()  # least recently saved first
        while limit is not None and len(waiting) > 1 and self.nbytes() > limit:
            victim = waiting.pop(0)
            self.local.maintenance.evict_agents([victim])
            self.stats.pending_dropped += 1
            logger.error(
                "agent %r: its save could not be uploaded and this worker's saves waiting to upload "
                "are over %d bytes: dropped here (the shared store keeps its last uploaded version)",
                victim, limit,
            )  # fmt: skip
        self.stats.pending_saves = len(waiting)

    def flush(self) -> int:
        """Upload every save made while the store was unreachable; how many are left."""
        for agent_id in self.local.records.pending_agents():
            try:
                self._push(agent_id)
            except RemoteUnavailableError:
                break
        left = len(self.local.records.pending_agents())
        self.stats.pending_saves = left
        return left

    def upload_before_exit(self, deadline: float) -> None:
        """Upload the saves kept here and not yet in the store (a store that was out of
        reach, another worker's lease), until ``deadline`` (``time.monotonic``); say what is
        left: the next engine on this directory uploads it."""
        for agent_id in self.local.records.pending_agents():
            if time.monotonic() >= deadline:
                break
            try:
                self._push(agent_id)
            except RemoteUnavailableError:
                break
        left = self.local.records.pending_agents()
        if left:
            logger.warning(
                "%d agent(s)' last saves (%s) are kept on this worker (%s) but not in the shared store: "
                "it did not take them before the process ended; the next engine on this directory "
                "uploads them",
                len(left), ", ".join(map(repr, left[:5])) + (" ..." if len(left) > 5 else ""), self.local.dir,
            )  # fmt: skip

    def start(self) -> None:
        if self._uploader is not None and self._uploader.is_alive():
            return
        self._uploader = RUNTIME.lend(self._loop, "agent-memory-uploader", self._closed.set)

    def _loop(self) -> None:
        while not self._closed.wait(self.retry_s):
            try:
                if self.flush() == 0:
                    logger.info("shared store: every pending save is uploaded")
                    return
            except Exception:  # keep retrying; never lose the pending saves
                logger.exception("uploading pending saves failed; retrying")

    def close(self) -> None:
        """Stop the uploader (what it has not uploaded stays pending on this worker's disk)."""
        self._closed.set()
        if self._uploader is not None:
            self._uploader.join(timeout=self.retry_s + 1)
