"""The administration of agents' stored caches (``Engine.admin``): records, forks, deletes,
prefetch, what they hold, the disk budget. Two kinds of verbs: what the store holds runs on
the engine's save thread (after the saves queued before it) or reads the store; what memory
holds (the hot tier, the pool's tier, live copies) is a message the engine's loop answers
(``Worker.call``), which owns that state. A fork, a restore or a delete is both: the store's
part on the save thread, then the loop forgets the live copy. Saves are not written here
(``requests.committer``)."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Collection, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from .caches.agent_state import record_tokens
from .caches.agents import AgentCaches
from .caches.schedule import Schedule
from .prefix import TokenizedText
from .requests.admissions import StoreAdmissions
from .requests.commits import CommitFeed
from .requests.saves import SaveQueue
from .requests.worker import Worker
from .storage.agent_ids import validate_agent_id
from .storage.block_writes import BlockWrites, WriteOutcome
from .storage.blocks import AgentRecord, BlockHash
from .storage.budget import BudgetKeeper, StorageBudget
from .storage.protocols import BlockStore, seen_version, take_lease

T = TypeVar("T")

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
    caller reads or changes in the store waits for the saves queued before it (the save
    thread runs changes in order); what it reads or changes in memory is the loop's answer."""

    def __init__(
        self,
        *,
        caches: AgentCaches,
        store: BlockStore,
        saves: SaveQueue,
        feed: CommitFeed,
        worker: Worker,
        admissions: StoreAdmissions | None,
        writes: BlockWrites,
        budget: BudgetKeeper,
        check_open: Callable[[], None],
    ) -> None:
        self.agents, self._store, self._save_queue, self._feed = caches, store, saves, feed
        self._worker, self._admissions, self._check_open = worker, admissions, check_open
        #: the save thread's writer (shared with the saves: one thread writes)
        self._writes = writes
        self._budget = budget

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
        return self._worker.call(self.agents.hot.ids, prefix)

    def settle_commits(self) -> None:
        """Wait until every reply so far is saved and subscribers have heard it."""
        self.settle_saves()
        self._feed.settle()

    def settle_saves(self) -> None:
        """Wait until every save queued so far is written and the loop has taken in how
        each ended (its blocks kept hot, its turn's ``save_done`` settled)."""
        self._save_queue.wait()
        self._worker.call(lambda: None)  # the saves' messages were posted before this one

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
        else:  # a shared store's records and blocks first, off the loop
            fetched = self._admissions.prefetch(wanted, self._worker.call(self.agents.held_blocks))
            fetched.add_done_callback(lambda _: self._worker.submit(self._prefetch_some, wanted, 0, done))
        return done

    def _prefetch_some(self, wanted: list[str], loaded: int, done: Future[int]) -> None:
        try:
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
        queued so far included; ``wait=False``: without waiting for those saves (a server's
        list, which must answer while a large one is written): the store's records, and
        those of the saves not written yet in their place (the loop's published map), so
        that a turn answered is listed before its save lands."""
        if wait:
            return list(self.store.records.list(prefix))
        # The map first: a save written between the two reads is then in the store's list.
        saving = {a: r for a, r in self.agents.writes.saving_records.items() if a.startswith(prefix)}
        merged = {r.agent_id: r for r in self._store.records.list(prefix)} | saving
        return sorted(merged.values(), key=lambda r: r.agent_id)

    def agent_record(self, agent_id: str) -> AgentRecord | None:
        """The agent's stored record (None: no cache), its saves queued so far included."""
        return self.store.records.get(agent_id)

    def has_agent(self, agent_id: str) -> bool:
        """Whether the agent has a stored cache (no record is parsed)."""
        return bool(self.store.records.has(agent_id))

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
            self._store.local.blocks.local_bytes(blocks),
            self._store.local.blocks.local_bytes(common) if common else 0,
        )

    def set_agent(self, agent_id: str, source: AgentRecord) -> None:
        """Make ``agent_id``'s cache stand for what ``source`` does: a fork, a snapshot or a
        restore (blocks shared, no tensor copied), after the saves queued before it."""
        self._point(agent_id, lambda into: self._writes.set_agent(source.named(agent_id), into))

    def fork(self, agent_id: str, to: str) -> AgentRecord:
        """Make agent ``to``'s cache stand for what ``agent_id``'s stored one does when the
        fork runs (after the saves queued before it; blocks shared, no tensor copied): a
        save or delete racing it cannot leave ``to`` naming freed blocks. Returns the
        source's record; ``AgentNotFoundError`` if ``agent_id`` has none (then, or deleted
        first by a racing request)."""
        validate_agent_id(agent_id)
        return self._point(to, lambda into: self._writes.fork(agent_id, lambda src: src.named(to), into))

    def delete(self, agent_id: str) -> bool:
        """Forget an agent's cache (memory and disk); shared blocks stay for other agents.
        Runs after the saves queued before it (on the save thread)."""
        return self._rewrite(agent_id, lambda into: self._writes.delete_agent(agent_id, into))

    def _point(self, agent_id: str, write: Callable[[WriteOutcome], T]) -> T:
        """``write`` a new record for ``agent_id`` under its lease (on the save thread)."""
        validate_agent_id(agent_id)

        def leased(into: WriteOutcome) -> T:
            replication = self._store.replication
            with take_lease(replication, agent_id, seen_version(replication, agent_id)) as lease:
                if not lease.current:
                    self.agents.read_record(agent_id, self._store)  # a shared store's newer one: replaced
                done = write(into)
                lease.committed()
                return done

        return self._rewrite(agent_id, leased)

    def _rewrite(self, agent_id: str, write: Callable[[WriteOutcome], T]) -> T:
        """``write`` (on the save thread, after the saves queued before it), then the loop
        forgets the agent's live copy, which stands for the old text (even if it failed)."""
        outcome = WriteOutcome()
        try:
            return self._save_queue.call(lambda: write(outcome))
        finally:
            self._worker.call(self.agents.forget_agent, agent_id, outcome)

    def cached_tokens(self, agent_id: str) -> int:
        return len(self.cached(agent_id))

    def cached_text(self, agent_id: str) -> str:
        """The text the agent's cache stands for (prompt and kept reply), or ""."""
        return self.cached(agent_id).text

    def cached(self, agent_id: str) -> TokenizedText:
        """The text and tokens the agent's cache stands for (empty: none): its live copy's
        (the loop's answer), else its stored record's (read here: a round trip)."""
        live = self._worker.call(self.agents.live_tokens, agent_id)
        if live is not None:
            return live
        record = self.agents.read_record(agent_id, self._store)
        return record_tokens(record) if record is not None else TokenizedText("")

    def drop_hot(self, agent_id: str | None = None) -> None:
        """Forget live caches (one agent, or all): the next request reloads from blocks."""
        self.settle_saves()
        self._worker.call(self.agents.drop_hot, agent_id)

    def clear_memory(self) -> None:
        """Forget every live cache and the pool's memory tier (what is stored stays): the
        next requests read their blocks from disk, as after a restart."""
        self.settle_saves()
        self._worker.call(self.agents.clear_memory)

    def disk_stats(self) -> dict[str, object] | None:
        """The disk budget's figures (None: no budget kept)."""
        return self._budget.stats()
