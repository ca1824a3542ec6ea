"""The administration of agents' stored caches (``Engine.admin``): records, forks, deletes,
prefetch, what they hold, the disk budget, and the write of each request's save. Everything
here goes through the engine's save thread or its store, never the model's thread, except
``prefetch`` (which yields to requests; a shared store's part of it runs before, on
``admissions``' threads)."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Collection, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from .caches.agent_state import PendingSave
from .caches.agents import AgentCaches
from .caches.schedule import Schedule
from .requests.admissions import StoreAdmissions
from .requests.commits import CommitFeed
from .requests.saves import SaveQueue
from .requests.worker import Worker
from .results import Saved
from .storage.blocks import AgentRecord, BlockHash
from .storage.budget import BudgetKeeper, StorageBudget
from .storage.protocols import BlockStore

logger = logging.getLogger(__name__)


def shared_blocks(records: Iterable[AgentRecord]) -> set[BlockHash]:
    """The blocks more than one of ``records`` names (``AgentInfo.shared_bytes``)."""
    holders = Counter(h for record in records for h in set(record.blocks))
    return {h for h, n in holders.items() if n > 1}


@dataclass(frozen=True, slots=True)
class AgentInfo:
    """An agent's stored cache as a caller sees it (``Engine.agent_info``)."""

    record: AgentRecord
    #: bytes of its blocks in this engine's local directory (blocks shared with other
    #: agents count for each; a shared store's blocks not fetched here count nothing)
    local_bytes: int
    #: of them, the bytes of blocks other agents name too (a fork's, a common prompt's):
    #: ``local_bytes - shared_bytes`` is what deleting this agent frees (``agent_info``'s
    #: ``shared``; 0 when not asked)
    shared_bytes: int = 0

    @property
    def own_bytes(self) -> int:
        """Bytes of the blocks only this agent names: what deleting it frees here."""
        return self.local_bytes - self.shared_bytes


class AgentAdmin:
    """Agents' stored caches, one engine's: built by ``Engine`` over its parts; what a
    caller reads or changes here waits for the saves queued before it (the save thread
    runs changes in order), never for the model's thread (except ``prefetch``)."""

    def __init__(
        self,
        *,
        caches: AgentCaches,
        store: BlockStore,
        saves: SaveQueue,
        feed: CommitFeed,
        worker: Worker,
        admissions: StoreAdmissions | None,
        in_use: Callable[[], set[str]],
        bytes_written: Callable[[], int],
        check_open: Callable[[], None],
    ) -> None:
        self.agents, self._store, self._save_queue, self._feed = caches, store, saves, feed
        self._worker, self._admissions, self._check_open = worker, admissions, check_open
        self._budget = BudgetKeeper(store, caches.evict, in_use, bytes_written)

    @property
    def storage_budget(self) -> StorageBudget | None:
        """The disk budget this engine keeps its store within (None: unbounded)."""
        return self._budget.budget

    @storage_budget.setter
    def storage_budget(self, budget: StorageBudget | None) -> None:
        self._budget.budget = budget
        if self._store.replication is not None:  # a shared store's saves waiting to upload
            self._store.replication.bound_pending(budget.max_bytes if budget is not None else None)

    @property
    def store(self) -> Any:
        """The engine's block store, once every save queued so far is in it."""
        self._save_queue.wait()
        return self._store

    @property
    def schedule(self) -> Schedule:
        """What the engine is told of its agents' next turns, which decides the hot tier's
        evictions (``caches.schedule``): a graph's checkpointer says which agents run next
        and which wait on a human; a chat model, which replies made tool calls."""
        return self.agents.hot.schedule

    def hot_agents(self, prefix: str = "") -> list[str]:
        """The agents live in memory whose ids start with ``prefix`` (least recently used
        first): what a request for them reads without any I/O."""
        return self.agents.hot.ids(prefix)

    def settle_commits(self) -> None:
        """Wait until every reply so far is saved and subscribers have heard it."""
        self._save_queue.wait()
        self._feed.settle()

    def disk_bytes(self) -> int:
        """Bytes this engine's store holds on disk (what ``max_disk_bytes`` bounds)."""
        return self.store.maintenance.disk_bytes()

    # ------------------------------------------------------------------ agents' caches

    def prefetch(self, agent_ids: Iterable[str]) -> Future[int]:
        """Load these agents' caches into memory in the background (on the worker thread),
        in the order given, so each one's next request starts hot; agents already live or
        without a cache are skipped; a request that arrives meanwhile goes first. The future
        gives how many were loaded."""
        self._check_open()
        done: Future[int] = Future()
        wanted = list(agent_ids)
        if self._admissions is None:
            self._worker.submit(self._prefetch_some, wanted, 0, done)
        else:  # a shared store's records and blocks first, off the model's thread
            fetched = self._admissions.prefetch(wanted)
            fetched.add_done_callback(lambda _: self._worker.submit(self._prefetch_some, wanted, 0, done))
        return done

    def _prefetch_some(self, wanted: list[str], loaded: int, done: Future[int]) -> None:
        try:
            with self.agents.lock:
                for i, agent_id in enumerate(wanted):
                    if i and self._worker.has_waiting:  # a request waits: let it run first
                        self._worker.submit(self._prefetch_some, wanted[i:], loaded, done)
                        return
                    loaded += self.agents.load_hot(agent_id)
            done.set_result(loaded)
        except Exception as exc:  # a prefetch is an optimisation: report, never hang a waiter
            logger.warning("prefetch failed: %s", exc)
            done.set_exception(exc)

    def agent_records(self, prefix: str = "", *, wait: bool = True) -> list[AgentRecord]:
        """The stored records of every agent whose id starts with ``prefix``, the saves
        queued so far included; ``wait=False``: as the store holds them now, without waiting
        for those saves (a server's list, which must answer while a large one is written)."""
        store = self.store if wait else self._store
        return list(store.agents(prefix))  # the store's reads: not the model steps' lock

    def agent_record(self, agent_id: str) -> AgentRecord | None:
        """The agent's stored record (None: no cache), its saves queued so far included."""
        return self.store.get_agent(agent_id)

    def has_agent(self, agent_id: str) -> bool:
        """Whether the agent has a stored cache (no record is parsed)."""
        return bool(self.store.has_agent(agent_id))

    def agent_info(self, agent: str | AgentRecord, shared: Collection[str] = frozenset()) -> AgentInfo | None:
        """An agent's record and the bytes of its blocks on this engine's disk; those of
        ``shared`` (blocks other agents name too: ``shared_blocks``) apart."""
        record = self.agent_record(agent) if isinstance(agent, str) else agent
        if record is None:
            return None
        blocks = set(record.blocks)
        common = [h for h in blocks if h in shared]
        return AgentInfo(
            record,
            self._store.local.local_bytes(blocks),
            self._store.local.local_bytes(common) if common else 0,
        )

    def set_agent(self, agent_id: str, source: AgentRecord) -> None:
        """Make ``agent_id``'s cache stand for what ``source`` does: a fork, a snapshot or a
        restore (blocks shared, no tensor copied), after the saves queued before it."""
        self._save_queue.call(lambda: self.agents.set_agent(agent_id, source))

    def fork(self, agent_id: str, to: str) -> AgentRecord:
        """Make agent ``to``'s cache stand for what ``agent_id``'s stored one does when the
        fork runs (after the saves queued before it; blocks shared, no tensor copied): a
        save or delete racing it cannot leave ``to`` naming freed blocks. Returns the
        source's record; ``AgentNotFoundError`` if ``agent_id`` has none (then, or deleted
        first by a racing request)."""
        return self._save_queue.call(lambda: self.agents.fork(agent_id, to))

    def delete(self, agent_id: str) -> bool:
        """Forget an agent's cache (memory and disk); shared blocks stay for other agents.
        Runs after the saves queued before it (on the save thread)."""
        return self._save_queue.call(lambda: self.agents.delete(agent_id))

    def cached_tokens(self, agent_id: str) -> int:
        return self.agents.cached_tokens(agent_id)

    def cached_text(self, agent_id: str) -> str:
        """The text the agent's cache stands for (prompt and kept reply), or ""."""
        return self.agents.cached_text(agent_id)

    def drop_hot(self, agent_id: str | None = None) -> None:
        """Forget live caches (one agent, or all): the next request reloads from blocks."""
        self._save_queue.wait()
        self.agents.drop_hot(agent_id)

    def queue_save(self, save: PendingSave) -> Future[Saved]:
        """A request ended (on the worker): its write goes to the save thread. The future
        says whether the record was stored: True, ``"local"`` (on this worker, its upload to
        the shared store pending) or False (another worker's save won)."""

        def write() -> Saved:
            record = self.agents.write(save)
            if record is None:
                return False
            self._feed.committed(record)
            self._budget.saved()
            return "local" if self._store.local.upload_pending(record.agent_id) else True

        return self._save_queue.submit(write, f"agent {save.record.agent_id!r}'s cache")

    def disk_stats(self) -> dict[str, object] | None:
        """The disk budget's figures (None: no budget kept)."""
        return self._budget.stats()
