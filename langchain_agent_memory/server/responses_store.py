"""Stored responses (``store: true``, the default): what ``previous_response_id`` continues,
``GET`` returns and ``DELETE`` removes, kept beside the served model's caches
(``responses.sqlite`` in its cache directory) so that a chain survives a restart.

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
from typing import Any

#: Longest chain walked back (a loop of links would otherwise never end).
MAX_CHAIN = 10_000


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: dict[str, Any]
    agent_id: str
    input: list[dict[str, Any]]
    previous_id: str | None


class ResponseStore:
    """Responses in one SQLite file (WAL: readers never wait on a write)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), check_same_thread=False, timeout=60)
        self._lock = threading.Lock()
        with self._lock, self._db:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS responses (id TEXT PRIMARY KEY, agent_id TEXT NOT NULL, "
                "previous_id TEXT, input TEXT NOT NULL, response TEXT NOT NULL, created_at REAL NOT NULL)"
            )

    def put(self, record: StoredResponse) -> None:
        r = record.response
        with self._lock, self._db:
            self._db.execute(
                "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?)",
                (r["id"], record.agent_id, record.previous_id, json.dumps(record.input, ensure_ascii=False),
                 json.dumps(r, ensure_ascii=False), r["created_at"]),
            )  # fmt: skip

    def get(self, rid: str) -> StoredResponse | None:
        with self._lock:
            row = self._db.execute(
                "SELECT response, agent_id, input, previous_id FROM responses WHERE id = ?", (rid,)
            ).fetchone()
        if row is None:
            return None
        return StoredResponse(json.loads(row[0]), row[1], json.loads(row[2]), row[3])

    def delete(self, rid: str) -> bool:
        with self._lock, self._db:
            return self._db.execute("DELETE FROM responses WHERE id = ?", (rid,)).rowcount > 0

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
        with self._lock:
            self._db.close()
