"""The cache linker: what keeps a thread's agent caches in step with its checkpoints
(``AgentMemorySaver`` holds one; see ``saver`` for the whole story). It hears every engine
of the cache directory (commits, requests), keeps the links (``links``: for each checkpoint,
the snapshot each agent stood at), rewinds a thread's agents when a run resumes from an
older checkpoint, prefetches the caches of the nodes that run next, and deletes snapshots
no checkpoint links."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import re
import threading
from concurrent.futures import Future
from datetime import datetime
from pathlib import Path
from typing import Any

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import Checkpoint, CheckpointTuple

from ..engine import (
    INTERNAL_PREFIX,
    AgentRecord,
    BlockMissingError,
    CommitConflictError,
    Engine,
    EngineConfig,
    GenerationParams,
    StorageBudget,
    Subscription,
    preset_name,
    shared_engine,
    unwatch_engines,
    watch_engines,
)
from .links import Link, Links
from .step_order import StepOrder

logger = logging.getLogger(__name__)

SNAPSHOT_PREFIX = INTERNAL_PREFIX + "snapshot:"  # hidden from listings (``is_internal``)


def record_digest(record: AgentRecord) -> str:
    """Identity of a cache state (blocks, tokens, text), independent of the agent's id."""
    payload = json.dumps([record.blocks, record.token_ids, record.token_ends, record.text])
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


def next_nodes(checkpoint: Checkpoint) -> set[str]:
    """The nodes a checkpoint has triggered but not yet run: LangGraph keeps a pending
    trigger as a ``branch:to:{node}`` channel value until the node consumes it, and pending
    ``Send``s in its tasks channel (``__pregel_tasks``)."""
    marker = "branch:to:"
    values = checkpoint.get("channel_values", {})
    nodes = {ch[len(marker) :] for ch in values if ch.startswith(marker)}
    for send in values.get("__pregel_tasks") or ():
        node = getattr(send, "node", None)
        if isinstance(node, str):
            nodes.add(node)
    return nodes


def node_of(agent_id: str, thread_prefix: str) -> str:
    """The graph node an agent of the thread belongs to (its id is ``{thread}:{node}``, with
    ``|{subgraph node}`` or ``#{Send index}`` after it: ``chat.namespace``)."""
    return re.split(r"[|#]", agent_id[len(thread_prefix) :], maxsplit=1)[0]


def time_of(checkpoint: Checkpoint) -> float:
    return datetime.fromisoformat(checkpoint["ts"]).timestamp()


def where_of(config: RunnableConfig) -> tuple[str, str, str]:
    """(thread, namespace, checkpoint id) of a checkpoint's config."""
    c = config["configurable"]
    return str(c["thread_id"]), c.get("checkpoint_ns", ""), c["checkpoint_id"]


class CacheLinker:
    """Links, rewinds, prefetch and snapshots for one cache directory (``cache_dir``), on
    every engine built there; ``config`` builds the saver's own engine (``engine``), and,
    for another model and KV format, an engine a link names."""

    def __init__(
        self, links: Links, config: EngineConfig, storage_budget: StorageBudget | None, prefetch: bool
    ) -> None:
        self.links, self.cache_dir, self._config = links, config.cache_dir, config
        self.storage_budget, self.prefetch = storage_budget, prefetch
        self.last_prefetch: Future[int] | None = None  # the latest background load, if any
        #: (thread, namespace) -> the older checkpoint a read named (and its time): the
        #: caches go back to it when a run resumes from it, not when it is read.
        self._pending: dict[tuple[str, str], dict[str, Any]] = {}
        self._steps = StepOrder()  # which nodes follow which: the step after next
        #: fingerprint -> ids of agents with a cache (``_known_agents``), threads listed once
        self._known: dict[str, set[str]] = {}
        self._listed: set[str] = set()
        self._known_lock = threading.Lock()
        self._rewinding = threading.Lock()  # one rewind at a time; requests wait for it
        #: Engines of the cache directory built in this process, by store fingerprint.
        self._engines: dict[str, Engine] = {}
        self._hooks: list[Subscription] = []
        self._own: Engine | None = None
        self._own_key: tuple[Any, ...] | None = None
        self._attach_lock = threading.RLock()
        self._closed = False
        watch_engines(self.attach)  # no model loaded here: engines are heard once they exist

    def close(self) -> None:
        """Stop hearing the engines and close the links' database."""
        with self._attach_lock:
            if self._closed:
                return
            self._closed = True
        unwatch_engines(self.attach)
        for subscription in self._hooks:
            subscription.close()
        self.links.close()

    @property
    def engine(self) -> Engine:
        """The saver's own engine (built on first use: ``shared_engine``)."""
        if self._own is None:
            self.attach(shared_engine(self._config))
        assert self._own is not None
        return self._own

    @property
    def engines(self) -> list[Engine]:
        """The engines of the cache directory built in this process."""
        with self._attach_lock:
            return list(self._engines.values())

    def attach(self, engine: Engine) -> None:
        """A shared engine exists: if it works in this cache directory, hear its commits
        and requests (and, if it is the saver's own, adopt links of earlier versions)."""
        with self._attach_lock:
            if self._closed or Path(engine.cache_dir).resolve() != self.cache_dir:
                return
            fp = engine.fingerprint
            if fp not in self._engines:
                self._engines[fp] = engine
                on_commit = functools.partial(self._on_commit, engine)
                self._hooks.append(engine.subscribe(on_commit, self._before_request))
                self.links.note_engine(
                    fp, str(engine.lm.path), preset_name(engine.quant) or engine.quant.label
                )
                if self.storage_budget is not None and engine.admin.storage_budget is None:
                    engine.admin.storage_budget = self.storage_budget
            if self._own is None and self._is_own(engine):
                self._own = engine
                self.links.adopt(fp)

    def _is_own(self, engine: Engine) -> bool:
        if self._own_key is None:
            try:
                self._own_key = self._config.key
            except (ValueError, OSError, ImportError):  # a model that cannot load: ``engine`` says why
                return False
        return engine.key == self._own_key

    def _engine_of(self, fp: str) -> Engine | None:
        """The engine a link names: built here already, else built from what was noted of
        it (its model directory and KV format); None if that cannot be done (logged by the
        caller's fallback: the link is then skipped)."""
        with self._attach_lock:
            engine = self._engines.get(fp)
        if engine is not None:
            return engine
        if fp == "":
            return self.engine
        args = self.links.engine_args(fp)
        if args is None:
            return None
        model, kv = args
        try:
            built = shared_engine(self._config.for_model(model, kv))
        except (ValueError, OSError, ImportError):
            return None
        self.attach(built)
        return built if built.fingerprint == fp else None

    def settle(self) -> None:
        """Every commit made so far by the directory's engines is in the history."""
        for engine in self.engines:
            engine.admin.settle_commits()

    def after_read(
        self, config: RunnableConfig, tup: CheckpointTuple, latest: CheckpointTuple | None
    ) -> None:
        """A read of an older checkpoint is remembered (a run may resume from it: then, and
        only then, the caches go back to it); a read of the latest one prefetches."""
        thread, ns, checkpoint_id = where_of(tup.config)
        older = latest is not None and latest.config["configurable"]["checkpoint_id"] != checkpoint_id
        if older:
            # As of its own time: the checkpoints a resumed run puts then link the rewound caches.
            at = self.links.clock(time_of(tup.checkpoint))
            self._pending[(thread, ns)] = {**tup.config["configurable"], "at": at}
        elif self.prefetch:
            self._prefetch_next(tup)

    def before_put(self, config: RunnableConfig) -> None:
        """A put whose parent is the older checkpoint last read (a fork, ``update_state``,
        a resume) rewinds the thread's caches first; one with another parent forgets it."""
        parent = config["configurable"]
        key = (str(parent["thread_id"]), parent.get("checkpoint_ns", ""))
        pending = self._pending.get(key)
        if pending is not None and pending["checkpoint_id"] == parent.get("checkpoint_id"):
            self._rewind_thread(key[0], pending["checkpoint_id"])
        elif pending is not None:
            self._pending.pop(key, None)

    def link(self, saved: RunnableConfig, checkpoint: Checkpoint) -> None:
        self.settle()  # every commit before the checkpoint's time is in the history
        self.links.link(*where_of(saved), self.links.clock(time_of(checkpoint)))
        self._tell_next(saved, checkpoint)

    def _tell_next(self, saved: RunnableConfig, checkpoint: Checkpoint) -> None:
        """A step's checkpoint says which nodes run next, and ``StepOrder`` which run in the
        step after: the engines' schedules hear it (they evict those agents last), and those
        not live start loading now, the next step's first, while this step still runs (a
        supervisor is back in memory before its worker is done)."""
        thread = str(saved["configurable"]["thread_id"])
        nodes = next_nodes(checkpoint)
        soon = self._steps.saw(thread, nodes)
        if not nodes:
            return
        prefix = f"{thread}:"
        as_of = time_of(checkpoint)  # written while the next step may run already
        for engine, ids in self._known_agents(thread):
            schedule = engine.admin.schedule
            upcoming = [a for a in ids if node_of(a, prefix) in nodes]
            later = [a for a in ids if node_of(a, prefix) in soon] if schedule.follow else []
            schedule.runs_next(upcoming, as_of)
            schedule.runs_soon(later, as_of)
            if self.prefetch and (upcoming or later):
                self.last_prefetch = engine.admin.prefetch(upcoming + later)

    def _known_agents(self, thread_id: str) -> list[tuple[Engine, list[str]]]:
        """The thread's agents with a cache, by engine, without a read of the store per step:
        those committed in this process, and, once per thread, those stored before."""
        with self._known_lock:
            listed = thread_id in self._listed
            self._listed.add(thread_id)
        if not listed:
            for engine, record in self._thread_agents(thread_id):
                self._note(engine, record.agent_id)
        prefix = f"{thread_id}:"
        with self._known_lock:
            return [
                (e, ids)
                for e in self.engines
                if (ids := sorted(a for a in self._known.get(e.fingerprint, ()) if a.startswith(prefix)))
            ]

    def _note(self, engine: Engine, agent_id: str) -> None:
        with self._known_lock:
            self._known.setdefault(engine.fingerprint, set()).add(agent_id)

    def interrupted(self, config: RunnableConfig) -> None:
        """A task of the thread waits on a human (an interrupt): nothing of the thread runs
        until one answers, so its agents are the first the hot tier evicts."""
        prefix = f"{config['configurable']['thread_id']}:"
        for engine in self.engines:
            engine.admin.schedule.waits(engine.admin.hot_agents(prefix))

    def after_delete_for_runs(
        self, doomed: list[tuple[str, str, str]], latest: dict[str, CheckpointTuple | None]
    ) -> None:
        self.links.unlink(doomed)
        # The threads now end at an earlier checkpoint (or have none): their agents go back
        # to the caches linked there, and those of deleted runs only are deleted.
        for thread_id, tup in latest.items():
            self._set_agents_to(
                thread_id, self.links.linked(*where_of(tup.config)) if tup else [], drop_rest=True
            )
        self.collect_snapshots()

    def copy_caches(self, src: str, dst: str) -> None:
        """The target thread's agents share the source's blocks (no tensor copied)."""
        for engine, record in self._thread_agents(src):
            agent_id = dst + record.agent_id[len(src) :]
            engine.admin.set_agent(agent_id, record)
            self._remember(engine, agent_id, record, self.links.clock())
        self.links.copy_thread(src, dst)

    def after_prune(self, kept: dict[str, set[tuple[str, str]]], strategy: str) -> None:
        for thread_id, remaining in kept.items():
            if strategy == "delete":
                self.forget_thread(thread_id)
                continue
            gone = self.links.checkpoints(thread_id) - remaining
            self.links.unlink((thread_id, ns, cid) for ns, cid in gone)
        self.collect_snapshots()

    def linked_agents(self, config: RunnableConfig) -> dict[str, str]:
        """agent id -> snapshot digest for the checkpoint named by ``config`` (every engine)."""
        return {agent: digest for _, agent, digest in self.links.linked(*where_of(config))}

    def _on_commit(self, engine: Engine, record: AgentRecord) -> None:
        """A request of ``engine`` committed ``record``: keep it as a snapshot in the history."""
        if not record.agent_id.startswith(SNAPSHOT_PREFIX):
            self._note(engine, record.agent_id)
            self._remember(engine, record.agent_id, record, record.updated_at)

    def _remember(
        self, engine: Engine, agent_id: str, record: AgentRecord, at: float, replace: bool = False
    ) -> None:
        digest = record_digest(record)
        if not engine.admin.has_agent(SNAPSHOT_PREFIX + digest):  # no parse on every commit
            try:
                engine.admin.set_agent(SNAPSHOT_PREFIX + digest, record)
            except CommitConflictError:
                pass  # another worker stored the same snapshot at the same time: either serves
            except BlockMissingError:
                # Commits are heard after the fact: the agent's next save replaced this one
                # and freed a block it named. Its history skips this state: a checkpoint
                # taken here resumes from the one before and prefills the difference.
                logger.info(
                    "agent %r: moved on before its state was kept as a snapshot; a checkpoint "
                    "of this moment resumes from its previous one", agent_id,
                )  # fmt: skip
                return
        self.links.remember(engine.fingerprint, agent_id, at, digest, replace=replace)

    def _prefetch_next(self, tup: CheckpointTuple) -> None:
        """Start loading, in the background, the caches of the nodes that run next (a
        resumed thread's first node then gets its first token from memory)."""
        nodes = next_nodes(tup.checkpoint)
        prefix = f"{tup.config['configurable']['thread_id']}:"
        self.engine  # noqa: B018 - built if not yet: the run this read starts needs it
        # Nothing pending: the thread ran to its end and a new input will start it again,
        # so any of its agents may be next: all are loaded, in the order they last ran.
        wanted: dict[str, list[AgentRecord]] = {}
        for engine, r in self._thread_agents(prefix[:-1]):
            self._note(engine, r.agent_id)
            if not nodes or node_of(r.agent_id, prefix) in nodes:
                wanted.setdefault(engine.fingerprint, []).append(r)
        for fp, records in wanted.items():
            records.sort(key=lambda r: r.updated_at)
            self.last_prefetch = self._engines[fp].admin.prefetch([r.agent_id for r in records])

    def _before_request(self, agent_id: str, params: GenerationParams) -> None:
        """An engine request for ``agent_id`` (on the caller's thread, before it is queued):
        if its LangGraph run resumes the older checkpoint last read for its thread, the
        thread's agents go back to it first; a run from the latest one forgets that read
        (a person browsed history: nothing changes)."""
        if not self._pending:
            return
        for thread_id, _ in list(self._pending):
            if agent_id.startswith(f"{thread_id}:"):
                self._rewind_thread(thread_id, params.metadata.get("checkpoint_id"))

    def _rewind_thread(self, thread_id: str, resume_from: str | None) -> None:
        """Set the thread's agents to the caches linked at the older checkpoint pending for
        it if ``resume_from`` names it; otherwise (a run from elsewhere) forget it. Once: a
        concurrent request of the same thread waits for it."""
        with self._rewinding:
            for key in [k for k in self._pending if k[0] == thread_id]:
                c = self._pending.get(key)
                if c is not None and resume_from is not None and resume_from == c["checkpoint_id"]:
                    links = self.links.linked(*where_of({"configurable": c}))
                    self._set_agents_to(thread_id, links, drop_rest=False, at=c["at"])
                # Removed only now: a request that finds it pending waits for this rewind
                # (``_before_request`` looks without the lock), never runs ahead of it.
                self._pending.pop(key, None)

    def _set_agents_to(
        self, thread_id: str, links: list[Link], *, drop_rest: bool, at: float | None = None
    ) -> None:
        """Set the thread's agents to the snapshots ``links`` name; with ``drop_rest``,
        delete its agents that no remaining checkpoint links."""
        self.settle()  # no earlier commit is recorded after this
        for fp, agent_id, digest in links:
            engine = self._engine_of(fp)
            if engine is None:
                continue
            snapshot = engine.admin.agent_record(SNAPSHOT_PREFIX + digest)
            current = engine.admin.agent_record(agent_id)
            if snapshot is not None and (current is None or record_digest(current) != digest):
                engine.admin.set_agent(agent_id, snapshot)
                # Now the agent's latest state: a checkpoint put before its next commit
                # (the input of a resumed run) must link this, not the state it replaced.
                when = self.links.clock() if at is None else at
                self._remember(engine, agent_id, snapshot, when, replace=True)
        if not drop_rest:
            return
        linked = self.links.linked_in_thread(thread_id)
        gone = [
            (e, r) for e, r in self._thread_agents(thread_id) if (e.fingerprint, r.agent_id) not in linked
        ]
        for engine, record in gone:
            engine.admin.delete(record.agent_id)
        self.links.forget_agents((e.fingerprint, r.agent_id) for e, r in gone)

    def forget_thread(self, thread_id: str) -> None:
        self.settle()  # no commit of the thread is recorded after this
        self._steps.forget(thread_id)
        with self._known_lock:
            self._listed.discard(thread_id)
            for ids in self._known.values():
                ids.difference_update([a for a in ids if a.startswith(f"{thread_id}:")])
        for engine, record in self._thread_agents(thread_id):
            engine.admin.delete(record.agent_id)
        self.links.drop_thread(thread_id)
        self.collect_snapshots()

    def _thread_agents(self, thread_id: str) -> list[tuple[Engine, AgentRecord]]:
        """The stored caches of the thread's agents (ids ``{thread_id}:...``) on every
        engine of the directory: those built here, and those its links name."""
        for fp in self.links.engines_of_thread(thread_id):
            self._engine_of(fp)
        return [(e, r) for e in self.engines for r in e.admin.agent_records(f"{thread_id}:")]

    def collect_snapshots(self) -> None:
        """Delete snapshots no checkpoint links to (their blocks go once unreferenced)."""
        self.settle()  # a snapshot a pending commit names is not dead
        dead = self.links.dead_snapshots()
        for fp, digest in dead:  # records first: a crash here leaves rows that the next pass retries
            engine = self._engine_of(fp)
            if engine is not None:
                engine.admin.delete(SNAPSHOT_PREFIX + digest)
        self.links.drop_snapshots(dead)
