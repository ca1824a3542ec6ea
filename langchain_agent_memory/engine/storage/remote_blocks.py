"""The blocks role of ``SharedBlockStore`` (``SharedBlocks``, its ``blocks``:
``protocols.BlockStoreBlocks``): blocks read through this worker's disk (fetched in
parallel, with a deadline), uploaded from it (catalog row, then conditional create of the
object), a bad copy replaced; and what every part of the shared store shares: its counters
(``SharedStats``) and what this worker last heard from the store (``Reach``)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Executor, Future, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from ..ops.files import atomic_write_bytes
from .blocks import Block, BlockHash, BlockMissingError, CacheFormatError, CacheWriteError
from .catalog import Catalog
from .objects import BlocksUnavailableError, ObjectBlocks, RemoteUnavailableError
from .reader import BlockGroup
from .store import DiskBlockStore

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
    pending_dropped: int = 0  # waiting saves dropped here past ``bound_pending``
    remote_failures: int = 0


class Reach:
    """Whether this worker has said the store is unreachable (once per outage)."""

    def __init__(self, stats: SharedStats) -> None:
        self.stats = stats
        self._said_down = False

    def down(self, exc: BaseException) -> bool:
        """A call to the store failed; whether it is the first since the store last answered
        a commit (the outage is said then, once)."""
        self.stats.remote_failures += 1
        if self._said_down:
            return False
        self._said_down = True
        logger.warning("shared store unreachable (%s); working from this worker's copies", exc)
        return True

    def up(self) -> None:
        self._said_down = False


class SharedBlocks:
    """Blocks of a shared store: in ``objects`` (their rows in ``catalog``), read through
    ``local``, this worker's disk, on the ``io`` threads. A block is written to this
    worker's disk (``local.blocks.put``) and uploaded by the commit of a record naming it;
    an object is deleted only by ``collect_garbage``."""

    def __init__(
        self,
        local: DiskBlockStore,
        catalog: Catalog,
        objects: ObjectBlocks,
        io: Executor,
        reach: Reach,
        *,
        read_timeout_s: float,
    ) -> None:
        self.local, self.catalog, self.objects, self.io, self.reach = local, catalog, objects, io, reach
        self.fingerprint = local.fingerprint
        self.stats = reach.stats
        self.read_timeout_s = read_timeout_s

    # ------------------------------------------------------------------ the blocks role

    def has(self, h: BlockHash) -> bool:
        """On this worker's disk or in the store (``stored``)."""
        return h in self.stored([h])

    def prior_of(self, h: BlockHash) -> BlockHash | None:
        """The block of segment ``h``'s earlier rows (None: whole); ``h`` fetched if need be."""
        self.fetch([h])
        return self.local.blocks.prior_of(h)

    def get(self, h: BlockHash, names: Sequence[str] | None = None) -> Block:
        self.fetch([h])
        return self.local.blocks.get(h, names)

    def read(self, hashes: Sequence[BlockHash], layers: Collection[int] | None = None) -> list[BlockGroup]:
        self.fetch(hashes)
        return self.local.blocks.read(hashes, layers)

    def quarantine(self, h: BlockHash) -> Path | None:
        """Move a bad copy here aside and fetch the block again; if the store's copy is bad
        too, delete it there (its catalog row unmarked): the next save that needs the block
        uploads a sound one, as a local store's next save rewrites a quarantined file."""
        moved = self.local.blocks.quarantine(h)
        submit(self.io, self.replace_bad, h)  # nothing waits on the store's copy
        return moved

    # ------------------------------------------------------------------ fetch, upload

    def stored(self, hashes: Sequence[BlockHash]) -> set[BlockHash]:
        """Which of ``hashes`` are on this worker's disk or in the store (one round trip;
        this worker's alone while the store is unreachable)."""
        here = {h for h in hashes if self.local.blocks.has(h)}
        rest = [h for h in hashes if h not in here]
        if rest:
            try:
                here.update(self.catalog.has_blocks(self.fingerprint, rest))
            except RemoteUnavailableError as exc:
                self.reach.down(exc)
        return here

    def prefetch(self, hashes: Sequence[BlockHash]) -> bool:
        """Bring ``hashes`` to this worker's disk ahead of the request that reads them;
        False if the store did not deliver them all in time (that request reuses the leading
        ones that came and prefills the rest)."""
        try:
            self.fetch(hashes)
        except (BlocksUnavailableError, BlockMissingError):
            return False
        return True

    def fetch(self, hashes: Sequence[BlockHash]) -> None:
        """Bring ``hashes`` to this worker's disk; ``BlocksUnavailableError`` (with how many
        leading ones are here) if the store does not deliver them within the deadline."""
        missing = [h for h in hashes if not self.local.blocks.has(h)]
        if not missing:
            return
        self._download_all(hashes, missing)
        # A segment is read with the blocks of its earlier rows: bring those too.
        priors = [p for h in missing if (p := self.local.blocks.prior_of(h)) is not None]
        if priors := [p for p in priors if not self.local.blocks.has(p)]:
            self.fetch(priors)

    def _download_all(self, hashes: Sequence[BlockHash], missing: list[BlockHash]) -> None:
        futures = {h: self.io.submit(self._download, h) for h in missing}
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
            self.local.records.note_blocks(missing)  # counted in this worker's disk use
            return
        available = self.local.blocks.leading(hashes)
        if isinstance(failed, BlockMissingError):
            raise failed
        self.reach.down(failed)
        raise BlocksUnavailableError(f"shared store: {failed}", available)

    def _download(self, h: BlockHash) -> None:
        data = self.objects.get(self.objects.key(self.fingerprint, h))
        if data is None:
            # The catalog said stored: repair it (the next save that needs the block uploads
            # it again; a worker that has it locally can, with ``verify``).
            with contextlib.suppress(RemoteUnavailableError):
                self.catalog.unstore(self.fingerprint, [h])
            logger.warning("block %s is missing from the object store: marked missing in the catalog", h[:12])
            raise BlockMissingError(f"block {h[:12]} is missing from the object store {self.objects.url}")
        atomic_write_bytes(self.local.blocks.path(h), data)
        self.stats.blocks_fetched += 1
        self.stats.bytes_fetched += len(data)

    def upload(self, hashes: Sequence[BlockHash], *, check: bool = True) -> None:
        """Upload the blocks of ``hashes`` the store lacks, from this worker's disk."""
        wanted = list(dict.fromkeys(hashes))
        have = self.catalog.has_blocks(self.fingerprint, wanted) if check else set()
        todo = [h for h in wanted if h not in have]
        if not todo:
            return
        for f in [submit(self.io, self._upload_one, h) for h in todo]:
            f.result()
        self.catalog.block_stored(self.fingerprint, todo)

    def _upload_one(self, h: BlockHash) -> None:
        path = self.local.blocks.path(h)
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

    def replace_bad(self, h: BlockHash) -> None:
        """Fetch block ``h`` again (its bad copy here was quarantined); if the store's copy
        is bad too, delete it there."""
        try:
            self.fetch([h])
            self.local.blocks.get(h)
        except RemoteUnavailableError:
            pass
        except CacheFormatError as exc:
            self.local.blocks.quarantine(h)
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


def submit(pool: Executor, fn: Callable[..., T], *args: Any) -> Future[T]:
    """``pool.submit``, or the call made here when the pool takes no more work (its store is
    closing): a save's uploads must still be made (one at a time, on the saving thread)."""
    try:
        return pool.submit(fn, *args)
    except RuntimeError:
        done: Future[T] = Future()
        try:
            done.set_result(fn(*args))
        except BaseException as exc:
            done.set_exception(exc)
        return done
