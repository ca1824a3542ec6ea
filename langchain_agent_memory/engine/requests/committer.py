"""A finished turn's way down to the store: the loop's ``Committer`` turns the save a
request left (``CacheWrites.commit``) into a write job (``CacheWrites.write_job``: what to
write, nothing of the loop's), which the save thread stores (``write_record``); how it
ended comes back to the loop as a message (``Worker.post``), which keeps the blocks written
hot, forgets the save's queue and settles the turn's ``save_done``. Nothing climbs back up:
the admin room is not called, and no thread but the loop touches cache state."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

from ..caches.agent_state import PendingSave
from ..caches.agents import AgentCaches
from ..caches.cache_writes import Written, write_record
from ..results import Saved
from ..storage.block_writes import BlockWrites, WriteOutcome
from ..storage.budget import BudgetKeeper, EvictionReport, StorageBudget, enforce
from ..storage.protocols import BlockStore
from .commits import CommitFeed
from .saves import SaveQueue
from .worker import Worker


class Committer:
    """One engine's saves: queued by the loop, written by the save thread in order."""

    def __init__(
        self,
        *,
        caches: AgentCaches,
        store: BlockStore,
        saves: SaveQueue,
        loop: Worker,
        feed: CommitFeed,
        in_use: Callable[[], set[str]],
    ) -> None:
        self.caches, self.store, self.saves, self.loop, self.feed = caches, store, saves, loop, feed
        #: the I/O side's writer (the save thread's alone: saves, forks, deletes)
        self.writes = BlockWrites(store)
        #: the disk budget, kept after each save (on the save thread); ``in_use`` (agents
        #: never evicted: saves queued, requests in flight) is the loop's answer
        self.budget = BudgetKeeper(
            store, self.evict, lambda: loop.call(in_use), lambda: self.writes.bytes_written
        )

    def commit(self, save: PendingSave) -> Future[Saved]:
        """Queue ``save``'s write (on the loop). The future says, once the loop has taken in
        how it ended, whether the record was stored: True, ``"local"`` (on this worker, its
        upload to the shared store pending) or False (another worker's save won)."""
        job = self.caches.writes.write_job(save)
        done: Future[Saved] = Future()
        agent_id = save.record.agent_id
        what = f"agent {agent_id!r}'s cache"

        def write() -> None:  # on the save thread
            written, saved = Written(False, WriteOutcome()), False
            error: BaseException | None = None
            try:
                written = write_record(job, self.writes)
                error = written.error
                if error is None and written.stored:
                    try:
                        self.feed.committed(job.record)
                        self.budget.saved()
                        saved = "local" if self.store.local.records.upload_pending(agent_id) else True
                    except Exception as exc:  # stored all the same: the record stands
                        error = exc
            except BaseException as exc:
                # Whatever ended the write (an interrupt too, which ``write_record`` does not
                # take for a failed save), the loop hears of it: otherwise the save stays
                # queued there and ``flush`` waits for it forever.
                error = exc
            finally:
                if error is not None:  # reported, and let go of this thread's frames, first
                    self.saves.failed(error, what)
                self.loop.post(self._written, save, written, saved, error, done)

        self.saves.submit(write, what, done)
        return done

    def evict(self, budget: StorageBudget, in_use: set[str], low_water: float) -> EvictionReport:
        """Bring the store within ``budget`` (``budget.enforce``; on the save thread), never
        evicting ``in_use``; the loop then forgets the evicted agents in memory too."""
        with self.store.locked():
            report = enforce([self.store], budget, in_use=lambda _, a: a in in_use, low_water=low_water)
        self.loop.post(self.caches.forget_evicted, report)
        return report

    def _written(
        self,
        save: PendingSave,
        written: Written,
        saved: Saved,
        error: BaseException | None,
        done: Future[Saved],
    ) -> None:
        """On the loop: the write ended."""
        try:
            self.caches.writes.written(save, written)
        finally:
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(saved)
