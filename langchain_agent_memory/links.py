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
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterable
from pathlib import Path

_SCHEMA = """
CREATE TABLE IF NOT EXISTS history (
    agent_id TEXT NOT NULL,
    committed_at REAL NOT NULL,
    snapshot TEXT NOT NULL,
    engine TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS history_agent ON history (agent_id, committed_at);
CREATE TABLE IF NOT EXISTS links (
    thread_id TEXT NOT NULL,
    checkpoint_ns TEXT NOT NULL,
    checkpoint_id TEXT NOT NULL,
    agent_id TEXT NOT NULL,
    snapshot TEXT NOT NULL,
    engine TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (thread_id, checkpoint_ns, checkpoint_id, engine, agent_id)
);
CREATE TABLE IF NOT EXISTS snapshots (
    digest TEXT NOT NULL,
    engine TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (engine, digest)
);
CREATE TABLE IF NOT EXISTS engines (
    engine TEXT PRIMARY KEY,
    model TEXT NOT NULL,
    kv_format TEXT NOT NULL
);
"""

#: A link: (engine, agent id, snapshot digest).
Link = tuple[str, str, str]


class Links:
    """The link tables of one cache directory (thread-safe; every call is one transaction)."""

    def __init__(self, path: Path) -> None:
        self._db = sqlite3.connect(str(path), check_same_thread=False, timeout=60)
        self._lock = threading.RLock()
        with self._lock, self._db:
            _migrate(self._db)
            self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # ------------------------------------------------------------------ engines

    def note_engine(self, engine: str, model: str, kv_format: str) -> None:
        with self._lock, self._db:
            self._db.execute("INSERT OR REPLACE INTO engines VALUES (?, ?, ?)", (engine, model, kv_format))

    def engine_args(self, engine: str) -> tuple[str, str] | None:
        """(model directory, KV format) of an engine a link names, if it was ever noted."""
        with self._lock:
            row = self._db.execute(
                "SELECT model, kv_format FROM engines WHERE engine = ?", (engine,)
            ).fetchone()
        return (row[0], row[1]) if row else None

    def adopt(self, engine: str) -> None:
        """Rows written before links named engines belong to ``engine`` (the saver's own)."""
        with self._lock, self._db:
            for table in ("history", "links", "snapshots"):
                self._db.execute(f"UPDATE OR IGNORE {table} SET engine = ? WHERE engine = ''", (engine,))

    # ------------------------------------------------------------------ history

    def remember(self, engine: str, agent_id: str, at: float, digest: str, *, replace: bool = False) -> None:
        """``agent_id`` stood at snapshot ``digest`` from ``at`` on (``replace``: its
        earlier history is forgotten: a rewind)."""
        with self._lock, self._db:
            if replace:
                self._db.execute("DELETE FROM history WHERE engine = ? AND agent_id = ?", (engine, agent_id))
            self._db.execute("INSERT OR IGNORE INTO snapshots VALUES (?, ?)", (digest, engine))
            self._db.execute("INSERT INTO history VALUES (?, ?, ?, ?)", (agent_id, at, digest, engine))

    def forget_agents(self, agents: Iterable[tuple[str, str]]) -> None:
        """Forget the history of these (engine, agent id) pairs."""
        with self._lock, self._db:
            self._db.executemany("DELETE FROM history WHERE engine = ? AND agent_id = ?", list(agents))

    # ------------------------------------------------------------------ links

    def link(self, thread_id: str, ns: str, checkpoint_id: str, at: float) -> None:
        """Link each of the thread's agents to its last commit before ``at``; older history
        of those agents can no longer be chosen by a later checkpoint and is dropped."""
        prefix = f"{thread_id}:"
        with self._lock, self._db:
            rows = self._db.execute(
                "SELECT engine, agent_id, snapshot, MAX(committed_at) FROM history "
                "WHERE substr(agent_id, 1, ?) = ? AND committed_at <= ? GROUP BY engine, agent_id",
                (len(prefix), prefix, at),
            ).fetchall()
            self._db.executemany(
                "INSERT OR REPLACE INTO links VALUES (?, ?, ?, ?, ?, ?)",
                [(thread_id, ns, checkpoint_id, agent, digest, engine) for engine, agent, digest, _ in rows],
            )
            self._db.executemany(
                "DELETE FROM history WHERE engine = ? AND agent_id = ? AND committed_at < ?",
                [(engine, agent, when) for engine, agent, _, when in rows],
            )

    def linked(self, thread_id: str, ns: str, checkpoint_id: str) -> list[Link]:
        with self._lock:
            return self._db.execute(
                "SELECT engine, agent_id, snapshot FROM links WHERE thread_id = ? AND checkpoint_ns = ? "
                "AND checkpoint_id = ?",
                (thread_id, ns, checkpoint_id),
            ).fetchall()

    def linked_in_thread(self, thread_id: str) -> set[tuple[str, str]]:
        """(engine, agent id) of every agent some checkpoint of the thread links."""
        with self._lock:
            rows = self._db.execute("SELECT engine, agent_id FROM links WHERE thread_id = ?", (thread_id,))
            return {(e, a) for e, a in rows}

    def engines_of_thread(self, thread_id: str) -> set[str]:
        """The engines the thread's links and history name."""
        prefix = f"{thread_id}:"
        with self._lock:
            rows = self._db.execute(
                "SELECT engine FROM links WHERE thread_id = ? UNION SELECT engine FROM history "
                "WHERE substr(agent_id, 1, ?) = ?",
                (thread_id, len(prefix), prefix),
            )
            return {row[0] for row in rows}

    def checkpoints(self, thread_id: str) -> set[tuple[str, str]]:
        """(namespace, checkpoint id) of the thread's checkpoints that link something."""
        with self._lock:
            rows = self._db.execute(
                "SELECT DISTINCT checkpoint_ns, checkpoint_id FROM links WHERE thread_id = ?", (thread_id,)
            )
            return {(ns, cid) for ns, cid in rows}

    def unlink(self, checkpoints: Iterable[tuple[str, str, str]]) -> None:
        """Drop the links of these (thread, namespace, checkpoint id)."""
        with self._lock, self._db:
            self._db.executemany(
                "DELETE FROM links WHERE thread_id = ? AND checkpoint_ns = ? AND checkpoint_id = ?",
                list(checkpoints),
            )

    def drop_thread(self, thread_id: str) -> None:
        prefix = f"{thread_id}:"
        with self._lock, self._db:
            self._db.execute("DELETE FROM links WHERE thread_id = ?", (thread_id,))
            self._db.execute("DELETE FROM history WHERE substr(agent_id, 1, ?) = ?", (len(prefix), prefix))

    def copy_thread(self, source: str, target: str) -> None:
        """The target thread's checkpoints link what the source's do (agent ids renamed)."""
        with self._lock, self._db:
            self._db.execute(
                "INSERT OR REPLACE INTO links SELECT ?, checkpoint_ns, checkpoint_id, "
                "? || substr(agent_id, ?), snapshot, engine FROM links WHERE thread_id = ?",
                (target, target, len(source) + 1, source),
            )

    # ------------------------------------------------------------------ snapshots

    def dead_snapshots(self) -> list[tuple[str, str]]:
        """(engine, digest) of snapshots that no link and no history row names."""
        with self._lock:
            return self._db.execute(
                "SELECT engine, digest FROM snapshots s WHERE NOT EXISTS (SELECT 1 FROM links l "
                "WHERE l.engine = s.engine AND l.snapshot = s.digest) AND NOT EXISTS (SELECT 1 "
                "FROM history h WHERE h.engine = s.engine AND h.snapshot = s.digest)"
            ).fetchall()

    def drop_snapshots(self, snapshots: Iterable[tuple[str, str]]) -> None:
        with self._lock, self._db:
            self._db.executemany("DELETE FROM snapshots WHERE engine = ? AND digest = ?", list(snapshots))


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
        db.executescript(_SCHEMA)
        db.execute(f"INSERT INTO {table} ({cols}) SELECT {cols} FROM {table}_v1")
        db.execute(f"DROP TABLE {table}_v1")
