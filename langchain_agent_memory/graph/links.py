"""What ``AgentMemorySaver`` keeps beside the checkpoints, in ``agent_links.sqlite`` in the
cache directory: which cache state each checkpoint links, for every engine (model and KV
format) of the directory.

- ``history``: each agent's commits since the thread's last checkpoint (engine, agent id,
  time, snapshot digest): a checkpoint links, per agent, the last one before its own time.
- ``links``: (thread, namespace, checkpoint, engine, agent) -> snapshot digest.
- ``snapshots``: the digests kept as ``@snapshot:`` records in an engine's block store.
- ``engines``: how to build an engine a link names (its model directory and KV format),
  for a thread whose agents ran on an engine this process has not built yet.

An engine is named by its store's fingerprint (model weights and KV format). Databases of
earlier versions (no engine column) are migrated in place: their rows belong to the
saver's own engine (``adopt``).

Workers that share a store (``storage.remote``) keep these tables in its PostgreSQL
database (``PostgresLinks``: same tables, same statements) so that a thread's phases may
run on different workers; times there are on Postgres's clock (``clock``).
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..engine import database_session

_SCHEMA = """
CREATE TABLE IF NOT EXISTS {history} (
    agent_id TEXT NOT NULL,
    committed_at DOUBLE PRECISION NOT NULL,
    snapshot TEXT NOT NULL,
    engine TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS {history}_agent ON {history} (agent_id, committed_at);
CREATE TABLE IF NOT EXISTS {links} (
    thread_id TEXT NOT NULL,
    checkpoint_ns TEXT NOT NULL,
    checkpoint_id TEXT NOT NULL,
    agent_id TEXT NOT NULL,
    snapshot TEXT NOT NULL,
    engine TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (thread_id, checkpoint_ns, checkpoint_id, engine, agent_id)
);
CREATE TABLE IF NOT EXISTS {snapshots} (
    digest TEXT NOT NULL,
    engine TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (engine, digest)
);
CREATE TABLE IF NOT EXISTS {engines} (
    engine TEXT PRIMARY KEY,
    model TEXT NOT NULL,
    kv_format TEXT NOT NULL
);
"""

#: A link: (engine, agent id, snapshot digest).
Link = tuple[str, str, str]

_TABLES = ("history", "links", "snapshots", "engines")


class Links:
    """The link tables of one cache directory, in SQLite (thread-safe; every call is one
    transaction). Statements use ``?`` and ``{table}`` names; ``PostgresLinks`` runs the
    same ones."""

    def __init__(self, path: Path) -> None:
        self._db = sqlite3.connect(str(path), check_same_thread=False, timeout=60)
        self._lock = threading.RLock()
        with self._lock, self._db:
            _migrate(self._db)
            self._db.executescript(self._sql(_SCHEMA))

    def _sql(self, statement: str) -> str:
        return statement.format(**{t: t for t in _TABLES})

    @contextmanager
    def _tx(self) -> Iterator[Any]:
        """A transaction; yields something with ``execute`` / ``executemany``."""
        with self._lock, self._db:
            yield self._db

    def _rows(self, statement: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._tx() as db:
            return [tuple(r) for r in db.execute(self._sql(statement), params).fetchall()]

    def _run(self, *steps: tuple[str, Any], many: bool = False) -> None:
        with self._tx() as db:
            for statement, params in steps:
                if many:
                    db.executemany(self._sql(statement), list(params))
                else:
                    db.execute(self._sql(statement), params)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def clock(self, at: float | None = None) -> float:
        """A time of this process (``time.time()`` if None) on the clock the tables use."""
        return time.time() if at is None else at

    # ------------------------------------------------------------------ engines

    def note_engine(self, engine: str, model: str, kv_format: str) -> None:
        self._run((
            "INSERT INTO {engines} VALUES (?, ?, ?) ON CONFLICT (engine) DO UPDATE "
            "SET model = excluded.model, kv_format = excluded.kv_format",
            (engine, model, kv_format),
        ))  # fmt: skip

    def engine_args(self, engine: str) -> tuple[str, str] | None:
        """(model directory, KV format) of an engine a link names, if it was ever noted."""
        rows = self._rows("SELECT model, kv_format FROM {engines} WHERE engine = ?", (engine,))
        return (rows[0][0], rows[0][1]) if rows else None

    def adopt(self, engine: str) -> None:
        """Rows written before links named engines belong to ``engine`` (the saver's own)."""
        with self._tx() as db:
            for table in ("history", "links", "snapshots"):
                db.execute(f"UPDATE OR IGNORE {table} SET engine = ? WHERE engine = ''", (engine,))

    # ------------------------------------------------------------------ history

    def remember(self, engine: str, agent_id: str, at: float, digest: str, *, replace: bool = False) -> None:
        """``agent_id`` stood at snapshot ``digest`` from ``at`` on (``replace``: its
        earlier history is forgotten: a rewind)."""
        steps = (
            [("DELETE FROM {history} WHERE engine = ? AND agent_id = ?", (engine, agent_id))]
            if replace
            else []
        )
        self._run(
            *steps,
            ("INSERT INTO {snapshots} VALUES (?, ?) ON CONFLICT DO NOTHING", (digest, engine)),
            ("INSERT INTO {history} VALUES (?, ?, ?, ?)", (agent_id, at, digest, engine)),
        )

    def forget_agents(self, agents: Iterable[tuple[str, str]]) -> None:
        """Forget the history of these (engine, agent id) pairs."""
        self._run(("DELETE FROM {history} WHERE engine = ? AND agent_id = ?", list(agents)), many=True)

    # ------------------------------------------------------------------ links

    def link(self, thread_id: str, ns: str, checkpoint_id: str, at: float) -> None:
        """Link each of the thread's agents to its last commit before ``at``; older history
        of those agents can no longer be chosen by a later checkpoint and is dropped."""
        prefix = f"{thread_id}:"
        with self._tx() as db:
            rows = db.execute(
                self._sql(
                    "SELECT h.engine, h.agent_id, h.snapshot, h.committed_at FROM {history} h "
                    "WHERE substr(h.agent_id, 1, ?) = ? AND h.committed_at = (SELECT MAX(l.committed_at) "
                    "FROM {history} l WHERE l.engine = h.engine AND l.agent_id = h.agent_id "
                    "AND l.committed_at <= ?)"
                ),
                (len(prefix), prefix, at),
            ).fetchall()
            db.executemany(
                self._sql(
                    "INSERT INTO {links} VALUES (?, ?, ?, ?, ?, ?) "
                    "ON CONFLICT (thread_id, checkpoint_ns, checkpoint_id, engine, agent_id) "
                    "DO UPDATE SET snapshot = excluded.snapshot"
                ),
                [(thread_id, ns, checkpoint_id, agent, digest, engine) for engine, agent, digest, _ in rows],
            )
            db.executemany(
                self._sql("DELETE FROM {history} WHERE engine = ? AND agent_id = ? AND committed_at < ?"),
                [(engine, agent, when) for engine, agent, _, when in rows],
            )

    def linked(self, thread_id: str, ns: str, checkpoint_id: str) -> list[Link]:
        return self._rows(  # type: ignore[return-value]
            "SELECT engine, agent_id, snapshot FROM {links} WHERE thread_id = ? AND checkpoint_ns = ? "
            "AND checkpoint_id = ?",
            (thread_id, ns, checkpoint_id),
        )

    def linked_in_thread(self, thread_id: str) -> set[tuple[str, str]]:
        """(engine, agent id) of every agent some checkpoint of the thread links."""
        return {
            (e, a)
            for e, a in self._rows("SELECT engine, agent_id FROM {links} WHERE thread_id = ?", (thread_id,))
        }

    def engines_of_thread(self, thread_id: str) -> set[str]:
        """The engines the thread's links and history name."""
        prefix = f"{thread_id}:"
        rows = self._rows(
            "SELECT engine FROM {links} WHERE thread_id = ? UNION SELECT engine FROM {history} "
            "WHERE substr(agent_id, 1, ?) = ?",
            (thread_id, len(prefix), prefix),
        )
        return {row[0] for row in rows}

    def checkpoints(self, thread_id: str) -> set[tuple[str, str]]:
        """(namespace, checkpoint id) of the thread's checkpoints that link something."""
        rows = self._rows(
            "SELECT DISTINCT checkpoint_ns, checkpoint_id FROM {links} WHERE thread_id = ?", (thread_id,)
        )
        return {(ns, cid) for ns, cid in rows}

    def unlink(self, checkpoints: Iterable[tuple[str, str, str]]) -> None:
        """Drop the links of these (thread, namespace, checkpoint id)."""
        self._run(
            (
                "DELETE FROM {links} WHERE thread_id = ? AND checkpoint_ns = ? AND checkpoint_id = ?",
                list(checkpoints),
            ),
            many=True,
        )

    def drop_thread(self, thread_id: str) -> None:
        prefix = f"{thread_id}:"
        self._run(
            ("DELETE FROM {links} WHERE thread_id = ?", (thread_id,)),
            ("DELETE FROM {history} WHERE substr(agent_id, 1, ?) = ?", (len(prefix), prefix)),
        )

    def copy_thread(self, source: str, target: str) -> None:
        """The target thread's checkpoints link what the source's do (agent ids renamed)."""
        self._run((
            "INSERT INTO {links} SELECT ?, checkpoint_ns, checkpoint_id, "
            "? || substr(agent_id, ?), snapshot, engine FROM {links} WHERE thread_id = ? "
            "ON CONFLICT (thread_id, checkpoint_ns, checkpoint_id, engine, agent_id) "
            "DO UPDATE SET snapshot = excluded.snapshot",
            (target, target, len(source) + 1, source),
        ))  # fmt: skip

    # ------------------------------------------------------------------ snapshots

    def dead_snapshots(self) -> list[tuple[str, str]]:
        """(engine, digest) of snapshots that no link and no history row names."""
        return self._rows(  # type: ignore[return-value]
            "SELECT engine, digest FROM {snapshots} s WHERE NOT EXISTS (SELECT 1 FROM {links} l "
            "WHERE l.engine = s.engine AND l.snapshot = s.digest) AND NOT EXISTS (SELECT 1 "
            "FROM {history} h WHERE h.engine = s.engine AND h.snapshot = s.digest)"
        )

    def drop_snapshots(self, snapshots: Iterable[tuple[str, str]]) -> None:
        self._run(("DELETE FROM {snapshots} WHERE engine = ? AND digest = ?", list(snapshots)), many=True)


class PostgresLinks(Links):
    """The same tables in a shared store's PostgreSQL database (``am_``-prefixed names), so
    that every worker sees every link; times on Postgres's clock. Calls go through the
    engine's ``database_session``, as the store's own do: each has a deadline the client keeps, so
    a frozen database fails a checkpoint's call with ``RemoteUnavailableError`` after
    ``timeout_s`` instead of hanging the graph."""

    def __init__(self, url: str, *, timeout_s: float = 5.0) -> None:
        self._session = database_session(url, timeout_s=timeout_s, pool_size=2, setup=self._create)
        now = self._session.run(
            "read the database's clock",
            lambda c: float(c.execute("SELECT extract(epoch FROM clock_timestamp())").fetchone()[0]),
        )
        self._offset = now - time.time()  # Postgres's clock minus this process's

    def _create(self, conn: Any) -> None:
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(hashtext('langchain-agent-memory/links'))")
            for statement in self._sql(_SCHEMA).split(";"):
                if statement.strip():
                    conn.execute(statement)

    def _sql(self, statement: str) -> str:
        return statement.format(**{t: f"am_{t}" for t in _TABLES}).replace("?", "%s")

    @contextmanager
    def _tx(self) -> Iterator[Any]:
        with (
            self._session.connection("read or write checkpoint links") as conn,
            conn.transaction(),
            conn.cursor() as cur,
        ):
            yield cur

    def close(self) -> None:
        self._session.close()

    def clock(self, at: float | None = None) -> float:
        return (time.time() if at is None else at) + self._offset

    def adopt(self, engine: str) -> None:
        """Nothing to adopt: these tables always named engines."""


def _migrate(db: sqlite3.Connection) -> None:
    """Tables of the first version (no engine column): rebuilt with one, rows kept."""
    tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if "links" not in tables:
        return
    columns = {row[1] for row in db.execute("PRAGMA table_info(links)")}
    if "engine" in columns:
        return
    db.execute("ALTER TABLE history ADD COLUMN engine TEXT NOT NULL DEFAULT ''")
    for table, cols in (
        ("links", "thread_id, checkpoint_ns, checkpoint_id, agent_id, snapshot"),
        ("snapshots", "digest"),
    ):
        db.execute(f"ALTER TABLE {table} RENAME TO {table}_v1")
        db.executescript(_SCHEMA.format(**{t: t for t in _TABLES}))
        db.execute(f"INSERT INTO {table} ({cols}) SELECT {cols} FROM {table}_v1")
        db.execute(f"DROP TABLE {table}_v1")
