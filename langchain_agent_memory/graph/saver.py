"""``AgentMemorySaver``: a LangGraph checkpointer that also keeps each thread's agent KV
caches in step with its checkpoints.

Checkpoints themselves go to another saver (default: ``SqliteCheckpoints`` in the cache
directory; any ``BaseCheckpointSaver``, e.g. LangGraph's PostgresSaver, can be passed).
On top of it this saver keeps *links* (``links``, ``agent_links.sqlite`` beside the
caches): for each checkpoint, the thread's agents (ids ``{thread_id}:...``, see
``namespace``) and the cache each stood at, on every engine of the cache directory (a
graph whose nodes run different models or KV formats is linked whole). A cache state is
kept as a *snapshot*: an agent record named ``@snapshot:{digest}`` in the engine's block
store, so its blocks stay referenced (and shared, never copied) for as long as a checkpoint
links to it.

Which state a checkpoint links is decided by time, not by when ``put`` is called: LangGraph
saves checkpoints in the background by default (``durability="async"``), so the put of
checkpoint N can arrive after the nodes of step N+1 have already extended the caches. The
engine reports every commit (``Engine.subscribe``); the saver keeps that history and
links, for each agent, its last commit before the checkpoint's own timestamp.

- ``delete_thread`` deletes the thread's caches and links (blocks are freed once nothing
  refers to them); ``copy_thread`` forks them (the copy's agents share every block and then
  diverge on their own); ``prune`` and ``delete_for_runs`` drop the links of the
  checkpoints they delete (``prune(strategy="delete")`` also deletes the caches).
- Time travel: reads have no side effects (``get_state`` of an old checkpoint, as LangGraph
  Studio does while a person browses history, changes nothing). When a run *resumes* from an
  older checkpoint (its first request on one of the thread's agents, or a ``put`` whose
  parent is that checkpoint, as ``update_state`` makes), the thread's agents are first set
  back to the caches they had there, so the resumed or forked run extends them exactly.
- Prefetch: ``get_tuple`` of a thread's latest checkpoint starts loading the caches of the
  nodes it runs next (``next_nodes``) on the engine's worker thread.
- Construction is cheap: no model is loaded until a chat model or a method needs an
  engine; the saver hears every engine of its cache directory from the moment it is built
  (``shared.watch_engines``). ``from_conn_string`` / ``afrom_conn_string``, ``setup``,
  ``close`` and ``with`` work as for LangGraph's own savers; an async inner saver
  (``AsyncSqliteSaver``, ``AsyncPostgresSaver``) is called through its own ``a*`` methods.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import hashlib
import json
import threading
from collections.abc import AsyncIterator, Collection, Iterator, Mapping, Sequence
from concurrent.futures import Future
from contextlib import asynccontextmanager, contextmanager
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    BaseCheckpointSaver,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    DeltaChannelHistory,
)

from ..config import get_settings
from ..engine.engine import Engine, GenerationParams, Subscription
from ..engine.kv import preset_name
from ..engine.registry import engine_key, shared_engine, unwatch_engines, watch_engines
from ..engine.storage.blocks import AgentRecord
from ..engine.storage.budget import StorageBudget
from ..engine.storage.catalog import CommitConflictError
from .links import Link, Links, PostgresLinks
from .sqlite_checkpoints import SqliteCheckpoints

SNAPSHOT_PREFIX = "@snapshot:"


def record_digest(record: AgentRecord) -> str:
    """Identity of a cache state (blocks, tokens, text), independent of the agent's id."""
    payload = json.dumps([record.blocks, record.token_ids, record.token_ends, record.text])
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


def next_nodes(checkpoint: Checkpoint) -> set[str]:
    """The nodes a checkpoint has triggered but not yet run: LangGraph keeps a pending
    trigger as a ``branch:to:{node}`` channel value until the node consumes it."""
    marker = "branch:to:"
    return {ch[len(marker) :] for ch in checkpoint.get("channel_values", {}) if ch.startswith(marker)}


def _at(checkpoint: Checkpoint) -> float:
    return datetime.fromisoformat(checkpoint["ts"]).timestamp()


def _where(config: RunnableConfig) -> tuple[str, str, str]:
    """(thread, namespace, checkpoint id) of a checkpoint's config."""
    c = config["configurable"]
    return str(c["thread_id"]), c.get("checkpoint_ns", ""), c["checkpoint_id"]


def _latest_config(thread_id: str, ns: str = "") -> RunnableConfig:
    return {"configurable": {"thread_id": thread_id, "checkpoint_ns": ns}}


def _thread_config(thread_id: str) -> RunnableConfig:
    """Every checkpoint of a thread, all namespaces (for ``list``)."""
    return {"configurable": {"thread_id": thread_id}}


class AgentMemorySaver(BaseCheckpointSaver[str]):
    """Checkpoints plus the agent caches they stand for.

    Args:
        checkpoints: where checkpoints go (default ``SqliteCheckpoints`` at
            ``{cache_dir}/checkpoints.sqlite``; any saver, sync or async).
        cache_dir: the cache directory whose engines' caches are linked (every model and
            KV format used there); default as for ``ChatAgentMemory``.
        model, kv_bits, kv_format: the saver's own engine (``engine``): the one built when
            the saver itself needs one, and the owner of links written by earlier versions.
        prefetch: when a thread is read to run (``get_tuple``), load the caches of the
            nodes it runs next into memory in the background.
        max_disk_bytes, cache_ttl: a disk budget (``"5GB"``; ``"7d"``) for the caches of
            each engine of the directory that has none of its own: agents and snapshots
            least recently used are evicted (their checkpoints stay; a thread resumed from
            one prefills).
    """

    def __init__(
        self,
        checkpoints: BaseCheckpointSaver | None = None,
        *,
        cache_dir: str | Path | None = None,
        model: str | None = None,
        kv_bits: int | None = 4,
        kv_format: str | None = None,
        prefetch: bool = True,
        store: str | None = None,
        blocks: str | None = None,
        max_disk_bytes: int | str | None = None,
        cache_ttl: float | str | timedelta | None = None,
    ) -> None:
        settings = get_settings()
        self.storage_budget = StorageBudget.of(max_disk_bytes, cache_ttl)
        root = Path(cache_dir or settings.cache_dir).expanduser().resolve()
        root.mkdir(parents=True, exist_ok=True)
        store, blocks = store or settings.store, blocks or settings.blocks
        self._owned_conn: Any = None
        if checkpoints is None and store:  # workers sharing a store share its checkpoints too
            checkpoints = self._postgres_checkpoints(store)
        self.inner = (
            checkpoints if checkpoints is not None else SqliteCheckpoints(root / "checkpoints.sqlite")
        )
        super().__init__(serde=self.inner.serde)
        self.cache_dir = root
        self._engine_args: dict[str, Any] = {
            "model": model,
            "cache_dir": root,
            "kv_bits": kv_bits,
            "kv_format": kv_format,
            "store": store,
            "blocks": blocks,
        }
        # Links beside the caches they name: in the shared store's database when workers
        # share one (every worker sees every link), else in the cache directory.
        self.links: Links = PostgresLinks(store) if store else Links(root / "agent_links.sqlite")
        self.prefetch = prefetch
        self.last_prefetch: Future[int] | None = None  # the latest background load, if any
        #: (thread, namespace) -> the older checkpoint a read named (and its time): the
        #: caches go back to it when a run resumes from it, not when it is read.
        self._pending: dict[tuple[str, str], dict[str, Any]] = {}
        self._rewinding = threading.Lock()  # one rewind at a time; requests wait for it
        #: Engines of the cache directory built in this process, by store fingerprint.
        self._engines: dict[str, Engine] = {}
        self._hooks: list[Subscription] = []
        self._own: Engine | None = None
        self._own_key: tuple[Any, ...] | None = None
        self._attach_lock = threading.RLock()
        self._closed = False
        watch_engines(self._attach)  # no model loaded here: engines are heard once they exist

    # ------------------------------------------------------------------ lifetime

    @classmethod
    @contextmanager
    def from_conn_string(cls, conn_string: str, **kwargs: Any) -> Iterator[AgentMemorySaver]:
        """A saver whose checkpoints go to ``conn_string`` (a SQLite path or ``:memory:``,
        or ``postgresql://...`` with ``langgraph-checkpoint-postgres`` installed), set up,
        and closed on exit; ``kwargs`` as for the constructor (``cache_dir``, ``model``, ...)."""
        with _inner_from_conn_string(conn_string) as inner, cls(inner, **kwargs) as saver:
            saver.setup()
            yield saver

    @classmethod
    @asynccontextmanager
    async def afrom_conn_string(cls, conn_string: str, **kwargs: Any) -> AsyncIterator[AgentMemorySaver]:
        """``from_conn_string`` for async code: PostgreSQL through ``AsyncPostgresSaver``
        (its own async calls), SQLite through ``SqliteCheckpoints`` on worker threads."""
        async with _ainner_from_conn_string(conn_string) as inner:
            with cls(inner, **kwargs) as saver:
                await saver.asetup()
                yield saver

    def _postgres_checkpoints(self, url: str) -> BaseCheckpointSaver:
        """``PostgresCheckpoints`` on a connection of this saver's own (closed with it)."""
        import psycopg
        from psycopg.rows import dict_row

        module = _postgres_module()
        self._owned_conn = psycopg.connect(url, autocommit=True, prepare_threshold=0, row_factory=dict_row)
        saver = module.PostgresCheckpoints(self._owned_conn)
        saver.setup()
        return saver

    def setup(self) -> None:
        """Create the inner saver's tables where it needs that (PostgresSaver); the links'
        tables exist from construction on. Safe to call again."""
        setup = getattr(self.inner, "setup", None)
        if callable(setup) and not asyncio.iscoroutinefunction(setup):
            setup()

    async def asetup(self) -> None:
        setup = getattr(self.inner, "setup", None)
        if callable(setup):
            result = setup()
            if asyncio.iscoroutine(result):
                await result

    def close(self) -> None:
        """Stop hearing the engines and close the links' database (the inner saver is its
        owner's to close; ``from_conn_string`` closes its own)."""
        with self._attach_lock:
            if self._closed:
                return
            self._closed = True
        unwatch_engines(self._attach)
        for subscription in self._hooks:
            subscription.close()
        self.links.close()
        if self._owned_conn is not None:
            self._owned_conn.close()

    def __enter__(self) -> AgentMemorySaver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ engines

    @property
    def engine(self) -> Engine:
        """The saver's own engine (built on first use: ``shared_engine``)."""
        if self._own is None:
            self._attach(shared_engine(**self._engine_args))
        assert self._own is not None
        return self._own

    @property
    def engines(self) -> list[Engine]:
        """The engines of the cache directory built in this process."""
        with self._attach_lock:
            return list(self._engines.values())

    def _attach(self, engine: Engine) -> None:
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
                if self.storage_budget is not None and engine.storage_budget is None:
                    engine.storage_budget = self.storage_budget
            if self._own is None and self._is_own(engine):
                self._own = engine
                self.links.adopt(fp)

    def _is_own(self, engine: Engine) -> bool:
        if self._own_key is None:
            try:
                self._own_key = engine_key(**self._engine_args)
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
            built = shared_engine(
                model, cache_dir=self.cache_dir, kv_format=kv,
                store=self._engine_args["store"], blocks=self._engine_args["blocks"],
            )  # fmt: skip
        except (ValueError, OSError, ImportError):
            return None
        self._attach(built)
        return built if built.fingerprint == fp else None

    def _settle(self) -> None:
        """Every commit made so far by the directory's engines is in the history."""
        for engine in self.engines:
            engine.settle_commits()

    @property
    def config_specs(self) -> list:
        return self.inner.config_specs

    def get_next_version(self, current: Any, channel: None) -> Any:
        return self.inner.get_next_version(current, channel)

    # ------------------------------------------------------------------ reads

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        tup = self.inner.get_tuple(config)
        if tup is None:
            return None
        latest = None
        if config["configurable"].get("checkpoint_id"):
            thread, ns, _ = _where(tup.config)
            latest = self.inner.get_tuple(_latest_config(thread, ns))
        self._after_read(config, tup, latest)
        return tup

    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        tup = await self.inner.aget_tuple(config)
        if tup is None:
            return None
        latest = None
        if config["configurable"].get("checkpoint_id"):
            thread, ns, _ = _where(tup.config)
            latest = await self.inner.aget_tuple(_latest_config(thread, ns))
        await asyncio.to_thread(self._after_read, config, tup, latest)
        return tup

    def _after_read(
        self, config: RunnableConfig, tup: CheckpointTuple, latest: CheckpointTuple | None
    ) -> None:
        """A read of an older checkpoint is remembered (a run may resume from it: then, and
        only then, the caches go back to it); a read of the latest one prefetches."""
        thread, ns, checkpoint_id = _where(tup.config)
        older = latest is not None and latest.config["configurable"]["checkpoint_id"] != checkpoint_id
        if older:
            # As of its own time: the checkpoints a resumed run puts then link the rewound caches.
            at = self.links.clock(_at(tup.checkpoint))
            self._pending[(thread, ns)] = {**tup.config["configurable"], "at": at}
        elif self.prefetch:
            self._prefetch_next(tup)

    def list(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> Iterator[CheckpointTuple]:
        return self.inner.list(config, filter=filter, before=before, limit=limit)

    async def alist(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> AsyncIterator[CheckpointTuple]:
        async for item in self.inner.alist(config, filter=filter, before=before, limit=limit):
            yield item

    def get_delta_channel_history(
        self, *, config: RunnableConfig, channels: Sequence[str]
    ) -> Mapping[str, DeltaChannelHistory]:
        # The inner saver's walk: the base class's would go through ``get_tuple`` of every
        # ancestor, each read naming an older checkpoint.
        return self.inner.get_delta_channel_history(config=config, channels=channels)

    async def aget_delta_channel_history(
        self, *, config: RunnableConfig, channels: Sequence[str]
    ) -> Mapping[str, DeltaChannelHistory]:
        return await self.inner.aget_delta_channel_history(config=config, channels=channels)

    def with_allowlist(self, extra_allowlist: Collection[tuple[str, ...]]) -> AgentMemorySaver:
        """A shallow clone whose inner saver (and so its serde) has the extra allowlist;
        links, engines and pending rewinds are shared with this saver."""
        inner = self.inner.with_allowlist(extra_allowlist)
        if inner is self.inner:
            return self
        clone = copy.copy(self)
        clone.inner, clone.serde = inner, inner.serde
        return clone

    # ------------------------------------------------------------------ writes

    def put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        self._before_put(config)
        saved = self.inner.put(config, checkpoint, metadata, new_versions)
        self._link(saved, checkpoint)
        return saved

    async def aput(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        await asyncio.to_thread(self._before_put, config)
        saved = await self.inner.aput(config, checkpoint, metadata, new_versions)
        await asyncio.to_thread(self._link, saved, checkpoint)
        return saved

    def _before_put(self, config: RunnableConfig) -> None:
        """A put whose parent is the older checkpoint last read (a fork, ``update_state``,
        a resume) rewinds the thread's caches first; one with another parent forgets it."""
        parent = config["configurable"]
        key = (str(parent["thread_id"]), parent.get("checkpoint_ns", ""))
        pending = self._pending.get(key)
        if pending is not None and pending["checkpoint_id"] == parent.get("checkpoint_id"):
            self._rewind_thread(key[0], pending["checkpoint_id"])
        elif pending is not None:
            self._pending.pop(key, None)

    def _link(self, saved: RunnableConfig, checkpoint: Checkpoint) -> None:
        self._settle()  # every commit before the checkpoint's time is in the history
        self.links.link(*_where(saved), self.links.clock(_at(checkpoint)))

    def put_writes(
        self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str, task_path: str = ""
    ) -> None:
        self.inner.put_writes(config, writes, task_id, task_path)

    async def aput_writes(
        self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str, task_path: str = ""
    ) -> None:
        await self.inner.aput_writes(config, writes, task_id, task_path)

    # ------------------------------------------------------------------ threads

    def delete_thread(self, thread_id: str) -> None:
        self.inner.delete_thread(thread_id)
        self._forget_thread(str(thread_id))

    async def adelete_thread(self, thread_id: str) -> None:
        await self.inner.adelete_thread(thread_id)
        await asyncio.to_thread(self._forget_thread, str(thread_id))

    def delete_for_runs(self, run_ids: Sequence[str]) -> None:
        doomed = [_where(t.config) for r in run_ids for t in self.inner.list(None, filter={"run_id": r})]
        self.inner.delete_for_runs(run_ids)
        threads = {thread for thread, _, _ in doomed}
        latest = {t: self.inner.get_tuple(_latest_config(t)) for t in threads}
        self._after_delete_for_runs(doomed, latest)

    async def adelete_for_runs(self, run_ids: Sequence[str]) -> None:
        doomed = [
            _where(t.config) for r in run_ids async for t in self.inner.alist(None, filter={"run_id": r})
        ]
        await self.inner.adelete_for_runs(run_ids)
        latest = {t: await self.inner.aget_tuple(_latest_config(t)) for t in {t for t, _, _ in doomed}}
        await asyncio.to_thread(self._after_delete_for_runs, doomed, latest)

    def _after_delete_for_runs(
        self, doomed: list[tuple[str, str, str]], latest: dict[str, CheckpointTuple | None]
    ) -> None:
        self.links.unlink(doomed)
        # The threads now end at an earlier checkpoint (or have none): their agents go back
        # to the caches linked there, and those of deleted runs only are deleted.
        for thread_id, tup in latest.items():
            self._set_agents_to(
                thread_id, self.links.linked(*_where(tup.config)) if tup else [], drop_rest=True
            )
        self._collect_snapshots()

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        self.inner.copy_thread(source_thread_id, target_thread_id)
        self._copy_caches(str(source_thread_id), str(target_thread_id))

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        await self.inner.acopy_thread(source_thread_id, target_thread_id)
        await asyncio.to_thread(self._copy_caches, str(source_thread_id), str(target_thread_id))

    def _copy_caches(self, src: str, dst: str) -> None:
        """The target thread's agents share the source's blocks (no tensor copied)."""
        for engine, record in self._thread_agents(src):
            agent_id = dst + record.agent_id[len(src) :]
            engine.set_agent(agent_id, record)
            self._remember(engine, agent_id, record, self.links.clock())
        self.links.copy_thread(src, dst)

    def prune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        self.inner.prune(thread_ids, strategy=strategy)
        kept = {
            str(t): {_where(x.config)[1:] for x in self.inner.list(_thread_config(str(t)))}
            for t in thread_ids
        }
        self._after_prune(kept, strategy)

    async def aprune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        await self.inner.aprune(thread_ids, strategy=strategy)
        kept = {}
        for t in map(str, thread_ids):
            kept[t] = {_where(x.config)[1:] async for x in self.inner.alist(_thread_config(t))}
        await asyncio.to_thread(self._after_prune, kept, strategy)

    def _after_prune(self, kept: dict[str, set[tuple[str, str]]], strategy: str) -> None:
        for thread_id, remaining in kept.items():
            if strategy == "delete":
                self._forget_thread(thread_id)
                continue
            gone = self.links.checkpoints(thread_id) - remaining
            self.links.unlink((thread_id, ns, cid) for ns, cid in gone)
        self._collect_snapshots()

    # ------------------------------------------------------------------ links

    def linked_agents(self, config: RunnableConfig) -> dict[str, str]:
        """agent id -> snapshot digest for the checkpoint named by ``config`` (every engine)."""
        return {agent: digest for _, agent, digest in self.links.linked(*_where(config))}

    def _on_commit(self, engine: Engine, record: AgentRecord) -> None:
        """A request of ``engine`` committed ``record``: keep it as a snapshot in the history."""
        if not record.agent_id.startswith(SNAPSHOT_PREFIX):
            self._remember(engine, record.agent_id, record, record.updated_at)

    def _remember(
        self, engine: Engine, agent_id: str, record: AgentRecord, at: float, replace: bool = False
    ) -> None:
        digest = record_digest(record)
        if not engine.has_agent(SNAPSHOT_PREFIX + digest):  # no parse on every commit
            # Another worker may store the same snapshot at the same time: either one serves.
            with contextlib.suppress(CommitConflictError):
                engine.set_agent(SNAPSHOT_PREFIX + digest, record)
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
            if not nodes or r.agent_id[len(prefix) :].split("|", 1)[0] in nodes:
                wanted.setdefault(engine.fingerprint, []).append(r)
        for fp, records in wanted.items():
            records.sort(key=lambda r: r.updated_at)
            self.last_prefetch = self._engines[fp].prefetch([r.agent_id for r in records])

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
                    links = self.links.linked(*_where({"configurable": c}))
                    self._set_agents_to(thread_id, links, drop_rest=False, at=c["at"])
                # Removed only now: a request that finds it pending waits for this rewind
                # (``_before_request`` looks without the lock), never runs ahead of it.
                self._pending.pop(key, None)

    def _set_agents_to(
        self, thread_id: str, links: list[Link], *, drop_rest: bool, at: float | None = None
    ) -> None:
        """Set the thread's agents to the snapshots ``links`` name; with ``drop_rest``,
        delete its agents that no remaining checkpoint links."""
        self._settle()  # no earlier commit is recorded after this
        for fp, agent_id, digest in links:
            engine = self._engine_of(fp)
            if engine is None:
                continue
            snapshot = engine.agent_record(SNAPSHOT_PREFIX + digest)
            current = engine.agent_record(agent_id)
            if snapshot is not None and (current is None or record_digest(current) != digest):
                engine.set_agent(agent_id, snapshot)
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
            engine.delete(record.agent_id)
        self.links.forget_agents((e.fingerprint, r.agent_id) for e, r in gone)

    def _forget_thread(self, thread_id: str) -> None:
        self._settle()  # no commit of the thread is recorded after this
        for engine, record in self._thread_agents(thread_id):
            engine.delete(record.agent_id)
        self.links.drop_thread(thread_id)
        self._collect_snapshots()

    def _thread_agents(self, thread_id: str) -> list[tuple[Engine, AgentRecord]]:
        """The stored caches of the thread's agents (ids ``{thread_id}:...``) on every
        engine of the directory: those built here, and those its links name."""
        for fp in self.links.engines_of_thread(thread_id):
            self._engine_of(fp)
        return [(e, r) for e in self.engines for r in e.agent_records(f"{thread_id}:")]

    def _collect_snapshots(self) -> None:
        """Delete snapshots no checkpoint links to (their blocks go once unreferenced)."""
        self._settle()  # a snapshot a pending commit names is not dead
        dead = self.links.dead_snapshots()
        for fp, digest in dead:  # records first: a crash here leaves rows that the next pass retries
            engine = self._engine_of(fp)
            if engine is not None:
                engine.delete(SNAPSHOT_PREFIX + digest)
        self.links.drop_snapshots(dead)


@asynccontextmanager
async def server_checkpointer() -> AsyncIterator[AgentMemorySaver]:
    """The checkpointer of a LangGraph Agent Server (``langgraph dev``): in ``langgraph.json``,
    ``"checkpointer": {"path": "<a file that imports this>:server_checkpointer"}``. Settings
    from the environment: ``AGENT_MEMORY_CACHE_DIR``, ``AGENT_MEMORY_MODEL`` and
    ``AGENT_MEMORY_CHECKPOINTS`` (a SQLite path or ``postgresql://``; default
    ``{cache_dir}/checkpoints.sqlite``)."""
    settings = get_settings()
    conn = settings.checkpoints or str(Path(settings.cache_dir).expanduser() / "checkpoints.sqlite")
    async with AgentMemorySaver.afrom_conn_string(conn, cache_dir=settings.cache_dir) as saver:
        yield saver


def _is_postgres(conn_string: str) -> bool:
    return conn_string.startswith(("postgresql://", "postgres://"))


def _postgres_module() -> Any:
    """``postgres_checkpoints`` (LangGraph's Postgres savers, completed), with a clear
    error where langgraph-checkpoint-postgres or psycopg is missing."""
    try:
        from . import postgres_checkpoints
    except ImportError as exc:
        raise ImportError(
            "a postgresql:// connection needs langgraph-checkpoint-postgres and psycopg: "
            'pip install "langgraph-checkpoint-postgres" "psycopg[binary]"'
        ) from exc
    return postgres_checkpoints


@contextmanager
def _inner_from_conn_string(conn_string: str) -> Iterator[BaseCheckpointSaver]:
    """The checkpoint saver for a connection string: PostgreSQL through LangGraph's
    ``PostgresSaver`` (completed: ``PostgresCheckpoints``), anything else a SQLite path
    (``SqliteCheckpoints``)."""
    if _is_postgres(conn_string):
        with _postgres_module().PostgresCheckpoints.from_conn_string(conn_string) as saver:
            yield saver
        return
    saver = SqliteCheckpoints(conn_string)
    try:
        yield saver
    finally:
        saver.conn.close()


@asynccontextmanager
async def _ainner_from_conn_string(conn_string: str) -> AsyncIterator[BaseCheckpointSaver]:
    if _is_postgres(conn_string):
        async with _postgres_module().AsyncPostgresCheckpoints.from_conn_string(conn_string) as saver:
            yield saver
        return
    with _inner_from_conn_string(conn_string) as saver:
        yield saver
