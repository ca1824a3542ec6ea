"""Stored responses (``store: true``, the default): what ``previous_response_id`` continues,
``GET`` returns and ``DELETE`` removes. They live where the served model's agent records
do: beside its caches (``responses.sqlite`` in its cache directory), so that a chain
survives a restart; with a shared store, in its PostgreSQL database, so that a chain goes
on on another worker (its agent's cache comes through the shared store as any agent's).

A record is one turn: the response as returned, the agent whose cache holds the
conversation, this turn's input items and the response it continued. A chain's history is
read back by walking those links (``history``): every turn's input items, then its output
items (which the Responses API takes as input items too).
"""

from __future__ import annotations

import json
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ..engine import Engine

#: Longest chain walked back (a loop of links would otherwise never end).
MAX_CHAIN = 10_000
_COLUMNS = "id TEXT PRIMARY KEY, agent_id TEXT NOT NULL, previous_id TEXT, input TEXT NOT NULL, " \
    "response TEXT NOT NULL, created_at DOUBLE PRECISION NOT NULL"  # fmt: skip
#: A row: id, agent, previous id, input items (JSON), response (JSON), created at.
Row = tuple[str, str, str | None, str, str, float]


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: dict[str, Any]
    agent_id: str
    input: list[dict[str, Any]]
    previous_id: str | None


class Rows(Protocol):
    """Where the rows are (``SqliteRows``, ``PostgresRows``)."""

    def put(self, row: Row) -> None: ...
    def get(self, rid: str) -> Row | None: ...
    def delete(self, rid: str) -> bool: ...
    def close(self) -> None: ...


class ResponseStore:
    def __init__(self, rows: Rows) -> None:
        self.rows = rows

    def put(self, record: StoredResponse) -> None:
        r = record.response
        text = json.dumps(record.input, ensure_ascii=False), json.dumps(r, ensure_ascii=False)
        self.rows.put((r["id"], record.agent_id, record.previous_id, *text, float(r["created_at"])))

    def get(self, rid: str) -> StoredResponse | None:
        row = self.rows.get(rid)
        if row is None:
            return None
        return StoredResponse(json.loads(row[4]), row[1], json.loads(row[3]), row[2])

    def delete(self, rid: str) -> bool:
        return self.rows.delete(rid)

    def history(self, rid: str) -> tuple[StoredResponse, list[dict[str, Any]]]:
        """The response ``rid`` and its chain's items, oldest first (``KeyError``: a
        response of the chain is not stored)."""
        turns: list[StoredResponse] = []
        at: str | None = rid
        while at is not None and len(turns) < MAX_CHAIN:
            turn = self.get(at)
            if turn is None:
                raise KeyError(at)
            turns.append(turn)
            at = turn.previous_id
        items: list[dict[str, Any]] = []
        for turn in reversed(turns):
            items += turn.input + turn.response.get("output", [])
        return turns[0], items

    def close(self) -> None:
        self.rows.close()


def open_response_store(engine: Engine) -> ResponseStore:
    """The store of ``engine``'s responses: its shared store's database, else its cache directory."""
    shared = engine.config.store
    if shared is not None:
        return ResponseStore(PostgresRows(shared.records))
    return ResponseStore(SqliteRows(Path(engine.cache_dir) / "responses.sqlite"))


class SqliteRows:
    """Rows in one SQLite file (WAL: readers never wait on a write)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), check_same_thread=False, timeout=60)
        self._lock = threading.Lock()
        with self._lock, self._db:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(f"CREATE TABLE IF NOT EXISTS responses ({_COLUMNS})")

    def put(self, row: Row) -> None:
        with self._lock, self._db:
            self._db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?)", row)

    def get(self, rid: str) -> Row | None:
        with self._lock:
            return self._db.execute("SELECT * FROM responses WHERE id = ?", (rid,)).fetchone()  # type: ignore[no-any-return]

    def delete(self, rid: str) -> bool:
        with self._lock, self._db:
            return self._db.execute("DELETE FROM responses WHERE id = ?", (rid,)).rowcount > 0

    def close(self) -> None:
        with self._lock:
            self._db.close()


class PostgresRows:
    """Rows in the shared store's PostgreSQL database (table ``agent_memory_responses``),
    through the engine's kind of session: deadlines, and a circuit that answers at once
    while the database is out of reach (``RemoteUnavailableError``: a 503)."""

    def __init__(self, url: str) -> None:
        from ..engine import database_session

        def setup(conn: Any) -> None:
            conn.execute(f"CREATE TABLE IF NOT EXISTS agent_memory_responses ({_COLUMNS})")

        self._session = database_session(url, setup=setup)

    def put(self, row: Row) -> None:
        self._session.run("store a response", lambda c: c.execute(
            "INSERT INTO agent_memory_responses VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (id) DO UPDATE "
            "SET response = EXCLUDED.response", row))  # fmt: skip

    def get(self, rid: str) -> Row | None:
        def read(c: Any) -> Row | None:
            found = c.execute("SELECT * FROM agent_memory_responses WHERE id = %s", (rid,)).fetchone()
            return (
                None if found is None else tuple(found.values()) if isinstance(found, dict) else tuple(found)
            )

        return self._session.run("read a response", read)

    def delete(self, rid: str) -> bool:
        return self._session.run(  # type: ignore[no-any-return]
            "delete a response",
            lambda c: c.execute("DELETE FROM agent_memory_responses WHERE id = %s", (rid,)).rowcount > 0,
        )

    def close(self) -> None:
        self._session.close()
