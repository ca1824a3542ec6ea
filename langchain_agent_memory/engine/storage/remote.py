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
- The engine's model thread never waits on the store (``stay_local``): the store's work of
  a request (lease, record, blocks) is done before it reaches that thread
  (``engine.admissions``); there, calls read this worker's tier only.
- Nothing here deletes a block object except ``collect_garbage`` (grace period, row lock).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from ...config import get_settings
from ..ops.files import DirectoryLock, atomic_write_bytes
from .blocks import (
    Block,
    BlockHash,
    BlockMissingError,
    CacheFormatError,
    CacheWriteError,
    StoreUsage,
)
from .catalog import Catalog
from .leases import Leases
from .objects import BlocksUnavailableError, ObjectBlocks, RemoteConfigError, RemoteUnavailableError
from .reader import BlockGroup
from .remote_records import SharedRecords
from .remote_upkeep import SharedUpkeep
from .store import DiskBlockStore
from .urls import redacted

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(slots=True)
class SharedStats:
    blocks_fetched: int = 0
    bytes_fetched: int = 0
    blocks_uploaded: int = 0
    bytes_uploaded: int = 0
    commits: int = 0
    conflicts: int = 0
    pending_saves: int = 0  # saved here while the store was unreachable, not yet uploaded
    pending_dropped: int = 0  # waiting saves dropped here past ``max_pending_bytes``
    remote_failures: int = 0


class SharedBlockStore(SharedRecords, SharedUpkeep):
    """Blocks and records shared through PostgreSQL and an object store, with this
    worker's directory (a ``DiskBlockStore``) as the tier in front."""

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
        handoff_wait_s: float | None = None,
    ) -> None:
        self.local, self.catalog, self.objects = local, catalog, objects
        self.fingerprint = local.fingerprint
        self.dir = local.dir
        self.worker_id = worker_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.read_timeout_s = read_timeout_s
        self.lease_s = lease_s
        self.grace_s = grace_s
        self.retry_s = retry_s
        self.stats = SharedStats()
        self._io = ThreadPoolExecutor(max_workers=8, thread_name_prefix="agent-memory-remote")
        self._uploader: threading.Thread | None = None
        self._closed = threading.Event()
        self._pushing = threading.RLock()
        #: agent -> (version a pending save was based on, version its upload made): a live
        #: copy at the first is the second (this worker's own save, uploaded later).
        self._uploaded: dict[str, tuple[int | None, int]] = {}
        self._said_down = False
        if handoff_wait_s is None:
            handoff_wait_s = get_settings().handoff_wait_s
        self.leases = Leases(catalog, self.fingerprint, self.worker_id, lease_s, handoff_wait_s)
        #: Threads whose calls never wait on the store (``stay_local``).
        self._local_threads: set[int] = set()
        if self.local.pending_agents():  # saved here by an earlier process, not uploaded
            self._start_uploader()
        _OPEN.add(self)

    @property
    def reachable(self) -> bool:
        """Whether the store answered its last call (False: the circuit is open, and this
        worker serves from its local tier)."""
        return self.catalog.healthy

    def stay_local(self) -> None:
        """From now on, calls made on the calling thread never wait on the store: they read
        this worker's tier only, and what must still reach the store (a lease given back, a
        bad object replaced) goes to a thread of the store's. The engine registers its model
        thread, so that a hung store stalls no model step (``engine.admissions`` takes the
        lease, reads the record and fetches the blocks before a request reaches it)."""
        self._local_threads.add(threading.get_ident())

    def _store_side(self, call: Callable[[str], None], arg: str) -> None:
        """``call(arg)``, a call to the store: here, or on the store's threads where this is
        a ``stay_local`` one (nothing waits on its outcome)."""
        if self._here_only:
            _submit(self._io, call, arg)
        else:
            call(arg)

    @property
    def recovery(self):
        return self.local.recovery

    def locked(self) -> DirectoryLock:
        return self.local.locked()

    def close(self) -> None:
        self._closed.set()
        _OPEN.discard(self)
        self.leases.close()
        if self._uploader is not None:
            self._uploader.join(timeout=self.retry_s + 1)
        self._io.shutdown(wait=True)
        self.catalog.close()
        self.local.close()

    # ------------------------------------------------------------------ requests

    def begin(self, agent_id: str, version: int | None) -> bool:
        """Take the agent's lease for a request (waiting for another worker's save in flight:
        ``Leases.take``); False if a live copy at ``version`` is stale (another worker
        committed since). Unreachable, or on a ``stay_local`` thread: True (work from what
        is here)."""
        if self._here_only:
            return True
        try:
            current = self.leases.take(agent_id)
        except RemoteUnavailableError as exc:
            self._down(exc)
            return True
        return current == version or self._uploaded.get(agent_id) == (version, current)

    def seen_version(self, agent_id: str) -> int | None:
        state = self.local.sync_state(agent_id)
        return state[0] if state else None

    def end(self, agent_id: str) -> None:
        """Give the lease back after a request that did not commit (the last of this
        worker's on the agent)."""
        if self.leases.done(agent_id):
            self._store_side(self.leases.give_back, agent_id)

    # ------------------------------------------------------------------ blocks

    def block_path(self, h: BlockHash) -> Path:
        return self.local.block_path(h)

    def local_bytes(self, hashes: Iterable[BlockHash]) -> int:
        return self.local.local_bytes(hashes)

    def has_local_block(self, h: BlockHash) -> bool:
        return self.local.has_block(h)

    def has_block(self, h: BlockHash) -> bool:
        return h in self.stored([h])

    def stored(self, hashes: Sequence[BlockHash]) -> set[BlockHash]:
        """Which of ``hashes`` are on this worker's disk or in the store (one round trip;
        this worker's alone on a ``stay_local`` thread or while the store is unreachable)."""
        here = {h for h in hashes if self.local.has_block(h)}
        rest = [h for h in hashes if h not in here]
        if rest and not self._here_only:
            try:
                here.update(self.catalog.has_blocks(self.fingerprint, rest))
            except RemoteUnavailableError as exc:
                self._down(exc)
        return here

    def prefetch(self, hashes: Sequence[BlockHash]) -> bool:
        """Bring ``hashes`` to this worker's disk ahead of the request that reads them;
        False if the store did not deliver them all in time (that request reuses the leading
        ones that came and prefills the rest)."""
        try:
            self._fetch(hashes)
        except (BlocksUnavailableError, BlockMissingError):
            return False
        return True

    def put_block(self, block: Block) -> int:
        """Written to this worker's disk; uploaded when a record naming it commits."""
        return self.local.put_block(block)

    def get_block(self, h: BlockHash, names: Sequence[str] | None = None) -> Block:
        self._fetch([h])
        return self.local.get_block(h, names)

    def read_blocks(
        self, hashes: Sequence[BlockHash], layers: Collection[int] | None = None
    ) -> list[BlockGroup]:
        self._fetch(hashes)
        return self.local.read_blocks(hashes, layers)

    def _fetch(self, hashes: Sequence[BlockHash]) -> None:
        """Bring ``hashes`` to this worker's disk; ``BlocksUnavailableError`` (with how many
        leading ones are here) if the store does not deliver them within the deadline."""
        missing = [h for h in hashes if not self.local.has_block(h)]
        if not missing:
            return
        if self._here_only:
            raise BlocksUnavailableError(
                f"shared store: {len(missing)} block(s) were not fetched before the request was admitted",
                self._leading_here(hashes),
            )
        futures = {h: self._io.submit(self._download, h) for h in missing}
        done, _ = wait(futures.values(), timeout=self.read_timeout_s)
        failed: BaseException | None = None
        for h, f in futures.items():
            if f not in done:
                failed = failed or RemoteUnavailableError(
                    f"block {h[:12]} did not arrive in {self.read_timeout_s} s"
                )
            elif f.exception() is not None:
                failed = failed or f.exception()
        if failed is None:
            self.local.note_blocks(missing)  # counted in this worker's disk use
            return
        available = self._leading_here(hashes)
        if isinstance(failed, BlockMissingError):
            raise failed
        self._down(failed)
        raise BlocksUnavailableError(f"shared store: {failed}", available)

    def _leading_here(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading ``hashes`` are on this worker's disk."""
        return next((i for i, h in enumerate(hashes) if not self.local.has_block(h)), len(hashes))

    def _download(self, h: BlockHash) -> None:
        data = self.objects.get(self.objects.key(self.fingerprint, h))
        if data is None:
            # The catalog said stored: repair it (the next save that needs the block uploads
            # it again; a worker that has it locally can, with ``verify``).
            with contextlib.suppress(RemoteUnavailableError):
                self.catalog.unstore(self.fingerprint, [h])
            logger.warning("block %s is missing from the object store: marked missing in the catalog", h[:12])
            raise BlockMissingError(f"block {h[:12]} is missing from the object store {self.objects.url}")
        atomic_write_bytes(self.local.block_path(h), data)
        self.stats.blocks_fetched += 1
        self.stats.bytes_fetched += len(data)

    def _upload(self, hashes: Sequence[BlockHash], *, check: bool = True) -> None:
        """Upload the blocks of ``hashes`` the store lacks, from this worker's disk."""
        wanted = list(dict.fromkeys(hashes))
        have = self.catalog.has_blocks(self.fingerprint, wanted) if check else set()
        todo = [h for h in wanted if h not in have]
        if not todo:
            return
        for f in [_submit(self._io, self._upload_one, h) for h in todo]:
            f.result()
        self.catalog.block_stored(self.fingerprint, todo)

    def _upload_one(self, h: BlockHash) -> None:
        path = self.local.block_path(h)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise CacheWriteError(
                f"block {h[:12]} is neither in the shared store nor on this worker; the cache was not "
                "saved (the next request prefills)"
            ) from None
        self.catalog.add_block(self.fingerprint, h, len(data))  # before the object: GC sees it
        if self.objects.put_new(self.objects.key(self.fingerprint, h), data):
            self.stats.blocks_uploaded += 1
            self.stats.bytes_uploaded += len(data)

    def delete_block(self, h: BlockHash) -> None:
        """This worker's copy only: objects go through ``collect_garbage``."""
        self.local.delete_block(h)

    def quarantine_block(self, h: BlockHash) -> Path | None:
        """Move a bad copy here aside and fetch the block again; if the store's copy is bad
        too, delete it there (its catalog row unmarked): the next save that needs the block
        uploads a sound one, as a local store's next save rewrites a quarantined file."""
        moved = self.local.quarantine_block(h)
        self._store_side(self._replace_bad, h)
        return moved

    def _replace_bad(self, h: BlockHash) -> None:
        """Fetch block ``h`` again; if the store's copy is bad too, delete it there."""
        try:
            self._fetch([h])
            self.local.get_block(h)
        except RemoteUnavailableError:
            pass
        except CacheFormatError as exc:
            self.local.quarantine_block(h)
            try:
                self.catalog.unstore(self.fingerprint, [h])
                self.objects.delete(self.objects.key(self.fingerprint, h))
            except RemoteUnavailableError:
                return
            logger.warning(
                "block %s is unusable in the object store too (%s): deleted there; the next save that "
                "needs it uploads a sound copy",
                h[:12],
                exc,
            )

    def block_hashes(self) -> Iterator[BlockHash]:
        return self.local.block_hashes()

    def is_referenced(self, h: BlockHash) -> bool:
        """Whether a record on this worker names ``h`` (its local copy is kept while one does)."""
        return self.local.is_referenced(h)

    def refcount(self, h: BlockHash) -> int:
        return self.local.refcount(h)

    def referenced_blocks(self) -> set[BlockHash]:
        return self.local.referenced_blocks()

    def recover(self):
        return self.local.recover()

    # ------------------------------------------------------------------ this worker's disk

    def disk_bytes(self) -> int:
        return self.local.disk_bytes()

    def usage(self) -> StoreUsage:
        return self.local.usage()

    def oldest_use(self) -> float | None:
        return self.local.oldest_use()

    def pinned(self) -> set[str]:
        """Saves made while the store was unreachable: the only copy until uploaded."""
        return set(self.local.pending_agents())

    def evict_agents(self, agent_ids: Sequence[str]) -> tuple[int, list[BlockHash]]:
        """Drop this worker's copies only: the store keeps the agents (their next request
        reads them through, as on any other worker)."""
        for agent in agent_ids:
            self._uploaded.pop(agent, None)
        return self.local.evict_agents(agent_ids)

    def clear_quarantine(self) -> int:
        return self.local.clear_quarantine()

    # ------------------------------------------------------------------ health

    def _down(self, exc: BaseException) -> None:
        self.stats.remote_failures += 1
        if not self._said_down:
            self._said_down = True
            logger.warning("shared store unreachable (%s); working from this worker's copies", exc)

    def upload_before_exit(self, deadline: float) -> None:
        """Upload the saves kept here and not yet in the store (a store that was out of
        reach, another worker's lease), until ``deadline`` (``time.monotonic``); say what is
        left: the next engine on this directory uploads it."""
        for agent_id in self.local.pending_agents():
            if time.monotonic() >= deadline:
                break
            try:
                self._push_pending(agent_id)
            except RemoteUnavailableError:
                break
        left = self.local.pending_agents()
        if left:
            logger.warning(
                "%d agent(s)' last saves (%s) are kept on this worker (%s) but not in the shared store: "
                "it did not take them before the process ended; the next engine on this directory "
                "uploads them",
                len(left), ", ".join(map(repr, left[:5])) + (" ..." if len(left) > 5 else ""), self.dir,
            )  # fmt: skip


#: Shared stores open in this process (``upload_before_exit`` at interpreter exit).
_OPEN: weakref.WeakSet[SharedBlockStore] = weakref.WeakSet()


def _submit(pool: ThreadPoolExecutor, fn: Callable[..., T], *args: Any) -> Future[T]:
    """``pool.submit``, or the call made here when the pool takes no more work: at interpreter
    exit concurrent.futures refuses new work, and a save's uploads must still be made (one
    at a time, on the saving thread)."""
    try:
        return pool.submit(fn, *args)
    except RuntimeError:
        done: Future[T] = Future()
        try:
            done.set_result(fn(*args))
        except BaseException as exc:
            done.set_exception(exc)
        return done


def upload_before_exit(deadline: float) -> None:
    """At interpreter exit, after the saves queued have run (``engine.saves``): upload what
    every open shared store keeps locally and not in the store yet, until ``deadline``."""
    for store in list(_OPEN):
        with contextlib.suppress(Exception):
            store.upload_before_exit(deadline)


def open_store(
    root: str | os.PathLike[str],
    fingerprint: str,
    store: str | None = None,
    blocks: str | None = None,
    *,
    read_timeout_s: float = 5.0,
    grace_s: float = 3600.0,
    worker_id: str | None = None,
    read_only: bool = False,
    lazy: bool | None = None,
) -> DiskBlockStore | SharedBlockStore:
    """The local store under ``root``, or a shared one (``store``: a postgresql:// URL for
    the records, ``blocks``: an s3:// URL for the blocks) with it as the local tier.
    ``read_only``: a local store opened only to look (no recovery, lock or migration).

    A shared store is checked first (the database answers and is bound to this bucket, a
    probe object can be written): a wrong setting fails here with its whole cause
    (``RemoteConfigError``), not as saves pending forever. ``lazy`` (default the settings'
    ``AGENT_MEMORY_LAZY_STORE``): start anyway, serving from the local tier."""
    if not store and not blocks:
        return DiskBlockStore(root, fingerprint, read_only=read_only)
    if not (store and blocks):
        raise RemoteConfigError(
            "a shared store needs both store='postgresql://...' (records) and blocks='s3://...' (blocks); "
            f"got store={redacted(store or '')!r}, blocks={redacted(blocks or '')!r}"
        )
    catalog = Catalog(store, timeout_s=read_timeout_s)
    objects = ObjectBlocks(blocks, timeout_s=read_timeout_s)
    if not (get_settings().lazy_store if lazy is None else lazy):
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
        local, catalog, objects, worker_id=worker_id, read_timeout_s=read_timeout_s, grace_s=grace_s
    )
