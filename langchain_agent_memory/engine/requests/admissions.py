"""A shared store's part of a request, done before the request reaches the model's thread.

With a shared store, finding an agent's cache takes round trips (``storage.remote``): the
agent's lease, which also says whether this worker's live copy is still the newest; its
record, where another worker saved it since; the blocks this worker's disk lacks. Made on
the model's thread, they stalled every agent of the worker for as long as the store took
to answer: a hung database held every decode step for its deadline. ``StoreAdmissions``
makes them on threads of its own and then hands the request to the model's thread, whose
parts read this worker's tier only (``SharedBlockStore.local_tier``). A store that does not
answer in time costs that request a longer prefill, never another agent a step.

The requests of one agent reach the scheduler in the order they came (each waits for the
one before it); those of different agents do not wait for each other.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from ..caches.agent_state import AgentState, record_tokens
from ..caches.agents import AgentCaches, AgentView, own_cache
from ..caches.prefix_index import OwnCache, Prompt, longest_prefix
from ..ops.process import RUNTIME
from ..storage.blocks import BlockHash
from ..storage.protocols import Lease, seen_version, take_lease
from ..storage.remote import SharedBlockStore
from .steps import Request

logger = logging.getLogger(__name__)

#: Requests prepared at once: each mostly waits on the network (a lease, a record, a
#: fetch that runs on the store's own download threads).
THREADS = 4


class StoreAdmissions:
    """Takes each request's lease and brings its record and blocks to this worker, then
    queues it for the model's thread (``queue``)."""

    def __init__(
        self,
        caches: AgentCaches,
        store: SharedBlockStore,
        queue: Callable[[Request], object],
        post: Callable[..., None],
    ) -> None:
        self.caches, self.store, self._queue, self._post = caches, store, queue, post
        self._pool = RUNTIME.pool("agent-memory-admit", THREADS)
        # The bookkeeping below is the loop's (``submit`` runs there, a preparation's end is
        # posted there: ``post``): no lock.
        #: agent -> its latest request's preparation (the next one waits for it)
        self._last: dict[str, Future[None]] = {}
        self._preparing: Counter[str] = Counter()

    def submit(self, request: Request, view: AgentView) -> None:
        """Prepare ``request`` (handed over by the loop with what it knows of the agent)."""
        agent_id = request.agent_id
        before = self._last.get(agent_id)
        future = self._pool.submit(self._prepare, request, view, before)
        self._last[agent_id] = future
        self._preparing[agent_id] += 1
        future.add_done_callback(lambda done: self._post(self._settled, agent_id, done))

    def _settled(self, agent_id: str, future: Future[None]) -> None:
        """On the loop: a preparation ended (its request is queued there before this)."""
        self._preparing -= Counter([agent_id])
        if self._last.get(agent_id) is future:
            del self._last[agent_id]

    def busy(self) -> set[str]:
        """Agents with a request being prepared (not in the scheduler yet; on the loop)."""
        return set(self._preparing)

    def prefetch(self, agent_ids: Sequence[str], held: frozenset[BlockHash]) -> Future[None]:
        """Bring these agents' newest records and blocks to this worker (for
        ``Engine.prefetch``, which then loads them on the loop); ``held``: the blocks in
        memory when it was asked (the loop's ``held_blocks``)."""

        def fetch_all() -> None:
            for agent_id in agent_ids:
                self._fetch(agent_id, None, None, AgentView(None, None, held))

        return self._pool.submit(fetch_all)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _prepare(self, request: Request, view: AgentView, before: Future[None] | None) -> None:
        try:
            request.lease = self.lease(request.agent_id, request.prompt, view)
        except Exception as exc:  # admitted all the same, from what this worker has
            logger.warning("agent %r: the shared store could not be asked (%s)", request.agent_id, exc)
        if before is not None:
            before.exception()  # the agent's request before this one is queued first
        self._queue(request)

    def lease(self, agent_id: str, prompt: Prompt, view: AgentView) -> Lease:
        """The agent's lease, with its record and the blocks ``prompt`` reuses brought here
        (``view``: what the loop knew of the agent when it handed the request over)."""
        replication = self.store.replication
        # Fresh unless another worker committed since the live copy's version (none live:
        # since what this worker knows; a request of its own may make one live meanwhile).
        hot = view.live
        version = view.version if hot is not None else seen_version(replication, agent_id)
        lease = take_lease(replication, agent_id, version)
        try:
            self._fetch(agent_id, prompt, hot if lease.current else None, view)
        except Exception as exc:  # an optimisation: the model's thread prefills what is not here
            logger.warning(
                "agent %r: its cache could not be brought here (%s); it prefills what this worker lacks",
                agent_id,
                exc,
            )
        return lease

    def _fetch(self, agent_id: str, prompt: Prompt | None, live: AgentState | None, view: AgentView) -> None:
        """The blocks a request for ``prompt`` (None: the whole cache) reads, fetched to this
        worker's disk within the store's deadline: the prefix index's answer
        (``longest_prefix``, over the loop's ``view`` of the index) from ``live`` (the agent's
        live copy, if it is still the newest), else from the record, read again."""
        caches = self.caches
        held = view.held
        own: OwnCache | None
        if live is not None:
            own = own_cache(live)
        else:
            record = caches.read_record(agent_id, self.store)  # the newest, mirrored here
            own = None
            if record is not None:
                own = OwnCache(record_tokens(record), record.chain, record.state_blocks())
        plan = longest_prefix(
            prompt,
            own,
            has=lambda hashes: self._stored(hashes, held),
            next_blocks=view.index.next_blocks,
            fingerprint=caches.fingerprint,
            hybrid=caches.spec.hybrid,
        )
        wanted = [h for h in plan.blocks() if h not in held]
        if wanted and not self.store.blocks.prefetch(wanted):
            logger.info("agent %r: some blocks did not arrive in time; it prefills what is missing", agent_id)

    def _stored(self, hashes: Sequence[BlockHash], held: frozenset[BlockHash]) -> set[BlockHash]:
        """Those of ``hashes`` in this worker's memory (``held``) or in the shared store (one
        round trip)."""
        return set(self.store.blocks.stored(list(hashes))) | {h for h in hashes if h in held}
