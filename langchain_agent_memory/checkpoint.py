"""``AgentMemorySaver``: a LangGraph checkpointer that also keeps each thread's agent KV
caches in step with its checkpoints.

Checkpoints themselves go to another saver (default: ``SqliteCheckpoints`` in the cache
directory; any ``BaseCheckpointSaver``, e.g. LangGraph's PostgresSaver, can be passed).
On top of it this saver keeps *links*, in ``agent_links.sqlite`` beside the caches: for
each checkpoint, the thread's agents (ids ``{thread_id}:...``, see ``namespace``) and the
cache each stood at. A cache state is kept as a *snapshot*: an agent record named
``@snapshot:{digest}`` in the block store, so its blocks stay referenced (and shared, never
copied) for as long as a checkpoint links to it.

Which state a checkpoint links is decided by time, not by when ``put`` is called: LangGraph
saves checkpoints in the background by default (``durability="async"``), so the put of
checkpoint N can arrive after the nodes of step N+1 have already extended the caches. The
engine reports every commit (``Engine.commit_listeners``); the saver keeps that history and
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
- Construction is cheap: no model is loaded until a chat model or a method needs the
  engine; the saver hears the commits of the engine from the moment it is built
  (``shared.watch_engines``). ``from_conn_string``, ``setup``, ``close`` and ``with`` work
  as for LangGraph's own savers.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import sqlite3
import threading
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from datetime import datetime
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

from .config import get_settings
from .engine.engine import Engine, GenerationParams
from .engine.shared import engine_key, shared_engine, unwatch_engines, watch_engines
from .engine.storage.store import AgentRecord
from .sqlite_checkpoints import SqliteCheckpoints
from .threaded_async import ThreadedAsync

SNAPSHOT_PREFIX = "@snapshot:"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS history (
    agent_id TEXT NOT NULL,
    committed_at REAL NOT NULL,
    snapshot TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS history_agent ON history (agent_id, committed_at);
CREATE TABLE IF NOT EXISTS links (
    thread_id TEXT NOT NULL,
    checkpoint_ns TEXT NOT NULL,
    checkpoint_id TEXT NOT NULL,
    agent_id TEXT NOT NULL,
    snapshot TEXT NOT NULL,
    PRIMARY KEY (thread_id, checkpoint_ns, checkpoint_id, agent_id)
);
CREATE TABLE IF NOT EXISTS snapshots (digest TEXT PRIMARY KEY);
"""


def record_digest(record: AgentRecord) -> str:
    """Identity of a cache state (blocks, tokens, text), independent of the agent's id."""
    payload = json.dumps([record.blocks, record.token_ids, record.token_ends, record.text])
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


def next_nodes(checkpoint: Checkpoint) -> set[str]:
    """The nodes a checkpoint has triggered but not yet run: LangGraph keeps a pending
    trigger as a ``branch:to:{node}`` channel value until the node consumes it."""
    marker = "branch:to:"
    return {ch[len(marker) :] for ch in checkpoint.get("channel_values", {}) if ch.startswith(marker)}


class AgentMemorySaver(ThreadedAsync, BaseCheckpointSaver[str]):
    """Checkpoints plus the agent caches they stand for.

    Args:
        checkpoints: where checkpoints go (default ``SqliteCheckpoints`` at
            ``{cache_dir}/checkpoints.sqlite``).
        cache_dir, model, kv_bits, kv_format: the engine whose caches are linked: the same
            values as the graph's ``ChatAgentMemory`` (both default alike), so both share one
            engine.
        prefetch: when a thread is read to run (``get_tuple``), load the caches of the
            nodes it runs next into memory in the background.
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
    ) -> None:
        root = Path(cache_dir or get_settings().cache_dir).expanduser().resolve()
        root.mkdir(parents=True, exist_ok=True)
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
        }
        self._db = sqlite3.connect(str(root / "agent_links.sqlite"), check_same_thread=False)
        self._db.executescript(_SCHEMA)
        self._lock = threading.RLock()
        self.prefetch = prefetch
        self.last_prefetch: Future[int] | None = None  # the latest background load, if any
        #: (thread, namespace) -> the older checkpoint a read named: the caches go back to it
        #: when a run resumes from it (``_before_request``, ``put``), not when it is read.
        self._pending: dict[tuple[str, str], dict[str, Any]] = {}
        self._rewinding = threading.Lock()  # one rewind at a time; requests wait for it
        self._engine: Engine | None = None
        self._key: tuple[Path, Path, str] | None = None
        self._closed = False
        watch_engines(self._attach)  # no model loaded here: the engine's commits are heard once it exists

    @classmethod
    @contextmanager
    def from_conn_string(cls, conn_string: str, **kwargs: Any) -> Iterator[AgentMemorySaver]:
        """A saver whose checkpoints go to ``conn_string`` (a SQLite path or ``:memory:``,
        or ``postgresql://...`` with ``langgraph-checkpoint-postgres`` installed), closed on
        exit; ``kwargs`` as for the constructor (``cache_dir``, ``model``, ...)."""
        with _inner_from_conn_string(conn_string) as inner:
            saver = cls(inner, **kwargs)
            try:
                saver.setup()
                yield saver
            finally:
                saver.close()

    def setup(self) -> None:
        """Create the inner saver's tables where it needs that (PostgresSaver); the links'
        tables exist from construction on. Safe to call again."""
        setup = getattr(self.inner, "setup", None)
        if callable(setup):
            setup()

    def close(self) -> None:
        """Stop hearing the engine's commits and close the links' database (the inner
        saver is its owner's to close; ``from_conn_string`` closes its own)."""
        if self._closed:
            return
        self._closed = True
        unwatch_engines(self._attach)
        if self._engine is not None:
            for hooks, fn in (
                (self._engine.commit_listeners, self._on_commit),
                (self._engine.request_hooks, self._before_request),
            ):
                if fn in hooks:
                    hooks.remove(fn)
        with self._lock:
            self._db.close()

    def __enter__(self) -> AgentMemorySaver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def engine(self) -> Engine:
        """The engine whose caches are linked (built on first use: ``shared_engine``)."""
        if self._engine is None:
            engine = shared_engine(**self._engine_args)  # ``_attach`` hears it if it is new
            self._attach(engine)
        assert self._engine is not None
        return self._engine

    def _attach(self, engine: Engine) -> None:
        """A shared engine exists: if it is this saver's, hear its commits and requests."""
        if self._engine is not None or self._closed:
            return
        if self._key is None:
            try:
                self._key = engine_key(**self._engine_args)
            except (ValueError, OSError, ImportError):  # a model that cannot load: ``engine`` says why
                return
        if (engine.lm.path, engine.cache_dir, engine.quant.label) != self._key:
            return
        self._engine = engine
        engine.commit_listeners.append(self._on_commit)
        engine.request_hooks.append(self._before_request)

    @property
    def config_specs(self) -> list:
        return self.inner.config_specs

    def get_next_version(self, current: Any, channel: None) -> Any:
        return self.inner.get_next_version(current, channel)

    # ------------------------------------------------------------------ checkpoints

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        tup = self.inner.get_tuple(config)
        if tup is None:
            return None
        c = tup.config["configurable"]
        key = (str(c["thread_id"]), c.get("checkpoint_ns", ""))
        if config["configurable"].get("checkpoint_id") and not self._is_latest(tup):
            # Rewound if a run resumes from it (a read changes nothing), as of its own time:
            # the checkpoints the resumed run puts then link the rewound caches.
            self._pending[key] = {**c, "at": datetime.fromisoformat(tup.checkpoint["ts"]).timestamp()}
        elif self.prefetch:
            self._prefetch_next(tup)
        return tup

    def _is_latest(self, tup: CheckpointTuple) -> bool:
        c = tup.config["configurable"]
        latest = self.inner.get_tuple(
            {"configurable": {"thread_id": c["thread_id"], "checkpoint_ns": c.get("checkpoint_ns", "")}}
        )
        return latest is None or latest.config["configurable"]["checkpoint_id"] == c["checkpoint_id"]

    def get_delta_channel_history(
        self, *, config: RunnableConfig, channels: Sequence[str]
    ) -> Mapping[str, DeltaChannelHistory]:
        # The inner saver's walk: the base class's would go through ``get_tuple`` of every
        # ancestor, each read naming an older checkpoint.
        return self.inner.get_delta_channel_history(config=config, channels=channels)

    async def aget_delta_channel_history(
        self, *, config: RunnableConfig, channels: Sequence[str]
    ) -> Mapping[str, DeltaChannelHistory]:
        return await asyncio.to_thread(self.get_delta_channel_history, config=config, channels=channels)

    def with_allowlist(self, extra_allowlist: Collection[tuple[str, ...]]) -> AgentMemorySaver:
        """A shallow clone whose inner saver (and so its serde) has the extra allowlist;
        links, engine and pending rewinds are shared with this saver."""
        inner = self.inner.with_allowlist(extra_allowlist)
        if inner is self.inner:
            return self
        clone = copy.copy(self)
        clone.inner, clone.serde = inner, inner.serde
        return clone

    def list(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> Iterator[CheckpointTuple]:
        return self.inner.list(config, filter=filter, before=before, limit=limit)

    def put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        parent = config["configurable"]
        key = (str(parent["thread_id"]), parent.get("checkpoint_ns", ""))
        pending = self._pending.get(key)
        if pending is not None and pending["checkpoint_id"] == parent.get("checkpoint_id"):
            self._rewind_thread(key[0], pending["checkpoint_id"])  # a fork or resume of it
        elif pending is not None:
            self._pending.pop(key, None)  # the thread went on from another checkpoint
        saved = self.inner.put(config, checkpoint, metadata, new_versions)
        c = saved["configurable"]
        at = datetime.fromisoformat(checkpoint["ts"]).timestamp()
        self._link(str(c["thread_id"]), c.get("checkpoint_ns", ""), c["checkpoint_id"], at)
        return saved

    def put_writes(
        self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str, task_path: str = ""
    ) -> None:
        self.inner.put_writes(config, writes, task_id, task_path)

    def delete_thread(self, thread_id: str) -> None:
        self.inner.delete_thread(thread_id)
        self._forget_thread(str(thread_id))

    def delete_for_runs(self, run_ids: Sequence[str]) -> None:
        doomed = [
            t.config["configurable"]
            for run_id in run_ids
            for t in self.inner.list(None, filter={"run_id": run_id})
        ]
        self.inner.delete_for_runs(run_ids)
        with self._lock, self._db:
            self._db.executemany(
                "DELETE FROM links WHERE thread_id = ? AND checkpoint_ns = ? AND checkpoint_id = ?",
                [(str(c["thread_id"]), c.get("checkpoint_ns", ""), c["checkpoint_id"]) for c in doomed],
            )
        # The threads now end at an earlier checkpoint (or have none): their agents go back
        # to the caches linked there, and those of deleted runs only are deleted.
        for thread_id in {str(c["thread_id"]) for c in doomed}:
            latest = self.inner.get_tuple({"configurable": {"thread_id": thread_id}})
            self._set_agents_to(
                thread_id, self.linked_agents(latest.config) if latest else {}, drop_rest=True
            )
        self._collect_snapshots()

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        self.inner.copy_thread(source_thread_id, target_thread_id)
        src, dst = str(source_thread_id), str(target_thread_id)
        engine = self.engine
        for record in self._thread_agents(src):
            engine.set_agent(dst + record.agent_id[len(src) :], record)
            self._remember(dst + record.agent_id[len(src) :], record, time.time())
        with self._lock, self._db:
            self._db.execute(
                "INSERT OR REPLACE INTO links SELECT ?, checkpoint_ns, checkpoint_id, "
                "? || substr(agent_id, ?), snapshot FROM links WHERE thread_id = ?",
                (dst, dst, len(src) + 1, src),
            )

    def prune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        self.inner.prune(thread_ids, strategy=strategy)
        for thread_id in map(str, thread_ids):
            if strategy == "delete":
                self._forget_thread(thread_id)
                continue
            kept = {
                (t.config["configurable"].get("checkpoint_ns", ""), t.config["configurable"]["checkpoint_id"])
                for t in self.inner.list({"configurable": {"thread_id": thread_id}})
            }
            with self._lock, self._db:
                rows = self._db.execute(
                    "SELECT DISTINCT checkpoint_ns, checkpoint_id FROM links WHERE thread_id = ?",
                    (thread_id,),
                ).fetchall()
                self._db.executemany(
                    "DELETE FROM links WHERE thread_id = ? AND checkpoint_ns = ? AND checkpoint_id = ?",
                    [(thread_id, ns, cid) for ns, cid in rows if (ns, cid) not in kept],
                )
        self._collect_snapshots()

    # ------------------------------------------------------------------ links

    def linked_agents(self, config: RunnableConfig) -> dict[str, str]:
        """agent id -> snapshot digest for the checkpoint named by ``config``."""
        c = config["configurable"]
        with self._lock:
            rows = self._db.execute(
                "SELECT agent_id, snapshot FROM links WHERE thread_id = ? AND checkpoint_ns = ? "
                "AND checkpoint_id = ?",
                (str(c["thread_id"]), c.get("checkpoint_ns", ""), c["checkpoint_id"]),
            ).fetchall()
        return dict(rows)

    def _on_commit(self, record: AgentRecord) -> None:
        """A request committed ``record``: keep it as a snapshot in the history."""
        if not record.agent_id.startswith(SNAPSHOT_PREFIX):
            self._remember(record.agent_id, record, record.updated_at)

    def _remember(self, agent_id: str, record: AgentRecord, at: float) -> None:
        digest = record_digest(record)
        engine = self.engine
        if not engine.store.has_agent(SNAPSHOT_PREFIX + digest):  # no parse on every commit
            engine.set_agent(SNAPSHOT_PREFIX + digest, record)
        with self._lock, self._db:
            self._db.execute("INSERT OR IGNORE INTO snapshots VALUES (?)", (digest,))
            self._db.execute("INSERT INTO history VALUES (?, ?, ?)", (agent_id, at, digest))

    def _link(self, thread_id: str, ns: str, checkpoint_id: str, at: float) -> None:
        """Link each of the thread's agents to its last commit before ``at``; older history
        of those agents can no longer be chosen by a later checkpoint and is dropped."""
        self.engine.settle_commits()  # every commit before ``at`` is in the history
        prefix = f"{thread_id}:"
        with self._lock, self._db:
            rows = self._db.execute(
                "SELECT agent_id, snapshot, MAX(committed_at) FROM history "
                "WHERE substr(agent_id, 1, ?) = ? AND committed_at <= ? GROUP BY agent_id",
                (len(prefix), prefix, at),
            ).fetchall()
            self._db.executemany(
                "INSERT OR REPLACE INTO links VALUES (?, ?, ?, ?, ?)",
                [(thread_id, ns, checkpoint_id, agent, digest) for agent, digest, _ in rows],
            )
            self._db.executemany(
                "DELETE FROM history WHERE agent_id = ? AND committed_at < ?",
                [(agent, when) for agent, _, when in rows],
            )

    def _prefetch_next(self, tup: CheckpointTuple) -> None:
        """Start loading, in the background, the caches of the nodes that run next (a
        resumed thread's first node then gets its first token from memory)."""
        nodes = next_nodes(tup.checkpoint)
        prefix = f"{tup.config['configurable']['thread_id']}:"
        engine = self.engine
        # Nothing pending: the thread ran to its end and a new input will start it again,
        # so any of its agents may be next: all are loaded, in the order they last ran.
        records = sorted(self._thread_agents(prefix[:-1]), key=lambda r: r.updated_at)
        agents = [
            r.agent_id for r in records if not nodes or r.agent_id[len(prefix) :].split("|", 1)[0] in nodes
        ]
        if agents:
            self.last_prefetch = engine.prefetch(agents)

    def _before_request(self, agent_id: str, params: GenerationParams) -> None:
        """An engine request for ``agent_id`` (on the caller's thread, before it is queued):
        if its LangGraph run resumes the older checkpoint last read for its thread, the
        thread's agents go back to it first; a run from the latest one forgets that read
        (a person browsed history: nothing changes)."""
        if not self._pending:
            return
        for thread_id, _ in list(self._pending):
            if agent_id.startswith(f"{thread_id}:"):
                self._rewind_thread(thread_id, params.resume_from)

    def _rewind_thread(self, thread_id: str, resume_from: str | None) -> None:
        """Set the thread's agents to the caches linked at the older checkpoint pending for
        it if ``resume_from`` names it; otherwise (a run from elsewhere) forget it. Once: a
        concurrent request of the same thread waits for it."""
        with self._rewinding:
            for key in [k for k in self._pending if k[0] == thread_id]:
                c = self._pending.pop(key, None)
                if c is not None and resume_from is not None and resume_from == c["checkpoint_id"]:
                    links = self.linked_agents({"configurable": c})
                    self._set_agents_to(thread_id, links, drop_rest=False, at=c["at"])

    def _set_agents_to(
        self, thread_id: str, links: dict[str, str], *, drop_rest: bool, at: float | None = None
    ) -> None:
        """Set the thread's agents to the snapshots in ``links`` (agent id -> digest); with
        ``drop_rest``, delete its agents that no remaining checkpoint links."""
        engine = self.engine
        engine.settle_commits()  # no earlier commit is recorded after this
        for agent_id, digest in links.items():
            snapshot = engine.store.get_agent(SNAPSHOT_PREFIX + digest)
            current = engine.store.get_agent(agent_id)
            if snapshot is not None and (current is None or record_digest(current) != digest):
                engine.set_agent(agent_id, snapshot)
                # Now the agent's latest state: a checkpoint put before its next commit
                # (the input of a resumed run) must link this, not the state it replaced.
                with self._lock, self._db:
                    self._db.execute("DELETE FROM history WHERE agent_id = ?", (agent_id,))
                self._remember(agent_id, snapshot, time.time() if at is None else at)
        if not drop_rest:
            return
        with self._lock:
            linked = {
                row[0]
                for row in self._db.execute("SELECT agent_id FROM links WHERE thread_id = ?", (thread_id,))
            }
        for record in self._thread_agents(thread_id):
            if record.agent_id not in linked:
                engine.delete(record.agent_id)
                with self._lock, self._db:
                    self._db.execute("DELETE FROM history WHERE agent_id = ?", (record.agent_id,))

    def _forget_thread(self, thread_id: str) -> None:
        engine = self.engine
        engine.settle_commits()  # no commit of the thread is recorded after this
        for record in self._thread_agents(thread_id):
            engine.delete(record.agent_id)
        prefix = f"{thread_id}:"
        with self._lock, self._db:
            self._db.execute("DELETE FROM links WHERE thread_id = ?", (thread_id,))
            self._db.execute("DELETE FROM history WHERE substr(agent_id, 1, ?) = ?", (len(prefix), prefix))
        self._collect_snapshots()

    def _thread_agents(self, thread_id: str) -> list[AgentRecord]:
        """The stored caches of the thread's agents (ids ``{thread_id}:...``)."""
        return self.engine.agent_records(f"{thread_id}:")

    def _collect_snapshots(self) -> None:
        """Delete snapshots no checkpoint links to (their blocks go once unreferenced)."""
        engine = self.engine
        engine.settle_commits()  # a snapshot a pending commit names is not dead
        with self._lock:
            dead = [
                row[0]
                for row in self._db.execute(
                    "SELECT digest FROM snapshots WHERE digest NOT IN "
                    "(SELECT snapshot FROM links UNION SELECT snapshot FROM history)"
                )
            ]
        for digest in dead:  # records first: a crash here leaves rows that the next pass retries
            engine.delete(SNAPSHOT_PREFIX + digest)
        with self._lock, self._db:
            self._db.executemany("DELETE FROM snapshots WHERE digest = ?", [(d,) for d in dead])


@contextmanager
def _inner_from_conn_string(conn_string: str) -> Iterator[BaseCheckpointSaver]:
    """The checkpoint saver for a connection string: PostgreSQL through LangGraph's
    ``PostgresSaver``, anything else a SQLite path (``SqliteCheckpoints``)."""
    if conn_string.startswith(("postgresql://", "postgres://")):
        try:
            from langgraph.checkpoint.postgres import PostgresSaver
        except ImportError as exc:
            raise ImportError(
                "a postgresql:// connection needs langgraph-checkpoint-postgres: "
                'pip install "langgraph-checkpoint-postgres" "psycopg[binary]"'
            ) from exc
        with PostgresSaver.from_conn_string(conn_string) as saver:
            yield saver
        return
    saver = SqliteCheckpoints(conn_string)
    try:
        yield saver
    finally:
        saver.conn.close()
