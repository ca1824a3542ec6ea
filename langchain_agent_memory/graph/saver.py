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
import copy
import dataclasses
import os
import sqlite3
from collections.abc import AsyncIterator, Collection, Iterator, Mapping, Sequence
from concurrent.futures import Future
from contextlib import asynccontextmanager, contextmanager
from datetime import timedelta
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
from ..engine import Engine, EngineConfig, StorageBudget
from .linker import CacheLinker, where_of
from .links import Links, PostgresLinks
from .sqlite_checkpoints import SqliteCheckpoints

#: The channel LangGraph writes a task's interrupt to (its checkpoint format; the constant
#: is private to LangGraph since 1.0): a write to it means the thread waits on a human.
INTERRUPT = "__interrupt__"


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
        store, blocks, lazy_store: a shared store (as for ``ChatAgentMemory``); with
            ``lazy_store`` its engines start serving from this worker's directory when the
            store does not answer at start (its checkpoints still need the database).
    """

    def __init__(
        self,
        checkpoints: BaseCheckpointSaver | sqlite3.Connection | str | os.PathLike[str] | None = None,
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
        lazy_store: bool | None = None,
    ) -> None:
        self.storage_budget = StorageBudget.of(max_disk_bytes, cache_ttl)
        config = EngineConfig.resolve(
            model, cache_dir=cache_dir, kv_bits=kv_bits, kv_format=kv_format, store=store, blocks=blocks,
            lazy_store=lazy_store,
        )  # fmt: skip
        root = config.cache_dir.expanduser().resolve()
        root.mkdir(parents=True, exist_ok=True)
        config = dataclasses.replace(config, cache_dir=root)
        store = config.store.records if config.store is not None else None
        self._owned_conn: Any = None
        if checkpoints is None and store:  # workers sharing a store share its checkpoints too
            checkpoints = self._postgres_checkpoints(store)
        self.inner = _checkpoints_of(checkpoints, root)
        super().__init__(serde=self.inner.serde)
        self.cache_dir = root
        # Links beside the caches they name: in the shared store's database when workers
        # share one (every worker sees every link), else in the cache directory.
        links: Links = PostgresLinks(store) if store else Links(root / "agent_links.sqlite")
        self.linker = CacheLinker(links, config, self.storage_budget, prefetch)

    @property
    def links(self) -> Links:
        return self.linker.links

    @property
    def prefetch(self) -> bool:
        """Whether a read of a thread's latest checkpoint loads the caches of its next nodes."""
        return self.linker.prefetch

    @property
    def last_prefetch(self) -> Future[int] | None:
        """The latest background load a read started, if any."""
        return self.linker.last_prefetch

    @property
    def engine(self) -> Engine:
        """The saver's own engine (built on first use: ``shared_engine``)."""
        return self.linker.engine

    @property
    def engines(self) -> list[Engine]:
        """The engines of the cache directory built in this process."""
        return self.linker.engines

    def linked_agents(self, config: RunnableConfig) -> dict[str, str]:
        """agent id -> snapshot digest for the checkpoint named by ``config`` (every engine)."""
        return self.linker.linked_agents(config)

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
        self.linker.close()
        if self._owned_conn is not None:
            self._owned_conn.close()
            self._owned_conn = None

    def __enter__(self) -> AgentMemorySaver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ engines

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
            thread, ns, _ = where_of(tup.config)
            latest = self.inner.get_tuple(_latest_config(thread, ns))
        self.linker.after_read(config, tup, latest)
        return tup

    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        tup = await self.inner.aget_tuple(config)
        if tup is None:
            return None
        latest = None
        if config["configurable"].get("checkpoint_id"):
            thread, ns, _ = where_of(tup.config)
            latest = await self.inner.aget_tuple(_latest_config(thread, ns))
        await asyncio.to_thread(self.linker.after_read, config, tup, latest)
        return tup

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
        self.linker.before_put(config)
        saved = self.inner.put(config, checkpoint, metadata, new_versions)
        self.linker.link(saved, checkpoint)
        return saved

    async def aput(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        await asyncio.to_thread(self.linker.before_put, config)
        saved = await self.inner.aput(config, checkpoint, metadata, new_versions)
        await asyncio.to_thread(self.linker.link, saved, checkpoint)
        return saved

    def put_writes(
        self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str, task_path: str = ""
    ) -> None:
        self.inner.put_writes(config, writes, task_id, task_path)
        if any(channel == INTERRUPT for channel, _ in writes):
            self.linker.interrupted(config)

    async def aput_writes(
        self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str, task_path: str = ""
    ) -> None:
        await self.inner.aput_writes(config, writes, task_id, task_path)
        if any(channel == INTERRUPT for channel, _ in writes):
            self.linker.interrupted(config)

    # ------------------------------------------------------------------ threads

    def delete_thread(self, thread_id: str) -> None:
        self.inner.delete_thread(thread_id)
        self.linker.forget_thread(str(thread_id))

    async def adelete_thread(self, thread_id: str) -> None:
        await self.inner.adelete_thread(thread_id)
        await asyncio.to_thread(self.linker.forget_thread, str(thread_id))

    def delete_for_runs(self, run_ids: Sequence[str]) -> None:
        doomed = [where_of(t.config) for r in run_ids for t in self.inner.list(None, filter={"run_id": r})]
        self.inner.delete_for_runs(run_ids)
        threads = {thread for thread, _, _ in doomed}
        latest = {t: self.inner.get_tuple(_latest_config(t)) for t in threads}
        self.linker.after_delete_for_runs(doomed, latest)

    async def adelete_for_runs(self, run_ids: Sequence[str]) -> None:
        doomed = [
            where_of(t.config) for r in run_ids async for t in self.inner.alist(None, filter={"run_id": r})
        ]
        await self.inner.adelete_for_runs(run_ids)
        latest = {t: await self.inner.aget_tuple(_latest_config(t)) for t in {t for t, _, _ in doomed}}
        await asyncio.to_thread(self.linker.after_delete_for_runs, doomed, latest)

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        self.inner.copy_thread(source_thread_id, target_thread_id)
        self.linker.copy_caches(str(source_thread_id), str(target_thread_id))

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        await self.inner.acopy_thread(source_thread_id, target_thread_id)
        await asyncio.to_thread(self.linker.copy_caches, str(source_thread_id), str(target_thread_id))

    def prune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        self.inner.prune(thread_ids, strategy=strategy)
        kept = {
            str(t): {where_of(x.config)[1:] for x in self.inner.list(_thread_config(str(t)))}
            for t in thread_ids
        }
        self.linker.after_prune(kept, strategy)

    async def aprune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        await self.inner.aprune(thread_ids, strategy=strategy)
        kept = {}
        for t in map(str, thread_ids):
            kept[t] = {where_of(x.config)[1:] async for x in self.inner.alist(_thread_config(t))}
        await asyncio.to_thread(self.linker.after_prune, kept, strategy)

    # ------------------------------------------------------------------ links


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


def _checkpoints_of(
    checkpoints: BaseCheckpointSaver | sqlite3.Connection | str | os.PathLike[str] | None, root: Path
) -> BaseCheckpointSaver:
    """The inner saver of what ``AgentMemorySaver`` was given: a saver as it is; what
    ``SqliteSaver`` takes (a ``sqlite3`` connection) or a SQLite path, as SQLite
    checkpoints; nothing, SQLite in the cache directory."""
    if checkpoints is None:
        return SqliteCheckpoints(root / "checkpoints.sqlite")
    if isinstance(checkpoints, BaseCheckpointSaver):
        return checkpoints
    if isinstance(checkpoints, sqlite3.Connection):
        return SqliteCheckpoints(checkpoints)
    if isinstance(checkpoints, (str, os.PathLike)):
        if _is_postgres(str(checkpoints)):
            raise TypeError(
                "a PostgreSQL URL needs a connection the saver owns: use "
                "AgentMemorySaver.from_conn_string(url) (or pass store=url for workers sharing a store)"
            )
        return SqliteCheckpoints(checkpoints)
    raise TypeError(
        f"checkpoints must be a LangGraph checkpoint saver, a sqlite3 connection or a SQLite path, "
        f"not {type(checkpoints).__name__}; e.g. AgentMemorySaver(SqliteSaver(conn)) or "
        "AgentMemorySaver.from_conn_string('checkpoints.sqlite')"
    )
