"""LangGraph checkpoints in SQLite: langgraph-checkpoint-sqlite's ``SqliteSaver`` (its
schema, reads and writes are reused as they are), completed with what it leaves out:

- the async twins (``aget_tuple``, ``alist``, ``aput``, ...): the sync methods on a worker
  thread (the connection is opened with ``check_same_thread=False`` and every access goes
  through the saver's lock), so no ``aiosqlite`` is needed;
- ``delete_for_runs``, ``copy_thread`` and ``prune``, in SQL on the same two tables.

Metadata is stored as JSON text by ``SqliteSaver``, so runs are found with
``json_extract``.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from langgraph.checkpoint.sqlite import SqliteSaver

from .threaded_async import ThreadedAsync


class SqliteCheckpoints(ThreadedAsync, SqliteSaver):
    """A complete SQLite checkpointer (sync and async, every extended capability)."""

    def __init__(self, path: str | Path | sqlite3.Connection, **kwargs: Any) -> None:
        """``path``: a SQLite file (``:memory:`` too), or a connection as ``SqliteSaver`` takes
        one (open it with ``check_same_thread=False`` where async calls will use it)."""
        if isinstance(path, sqlite3.Connection):
            super().__init__(path, **kwargs)
            return
        if str(path) != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        super().__init__(sqlite3.connect(str(path), check_same_thread=False), **kwargs)

    # ------------------------------------------------------------------ extended, sync

    def delete_for_runs(self, run_ids: Sequence[str]) -> None:
        """Delete the checkpoints whose metadata names one of ``run_ids``, and their writes."""
        if not run_ids:
            return
        marks = ",".join("?" * len(run_ids))
        with self.cursor() as cur:
            rows = cur.execute(
                "SELECT thread_id, checkpoint_ns, checkpoint_id FROM checkpoints "
                f"WHERE json_extract(CAST(metadata AS TEXT), '$.run_id') IN ({marks})",
                [str(r) for r in run_ids],
            ).fetchall()
            self._delete_rows(cur, rows)

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Copy every checkpoint (all namespaces, the whole parent chain) and write of
        ``source_thread_id`` to ``target_thread_id``; the source is left unchanged."""
        with self.cursor() as cur:
            cur.execute(
                "INSERT OR REPLACE INTO checkpoints (thread_id, checkpoint_ns, checkpoint_id, "
                "parent_checkpoint_id, type, checkpoint, metadata) SELECT ?, checkpoint_ns, "
                "checkpoint_id, parent_checkpoint_id, type, checkpoint, metadata FROM checkpoints "
                "WHERE thread_id = ?",
                (str(target_thread_id), str(source_thread_id)),
            )
            cur.execute(
                "INSERT OR REPLACE INTO writes (thread_id, checkpoint_ns, checkpoint_id, task_id, "
                "task_path, idx, channel, type, value) SELECT ?, checkpoint_ns, checkpoint_id, "
                "task_id, task_path, idx, channel, type, value FROM writes WHERE thread_id = ?",
                (str(target_thread_id), str(source_thread_id)),
            )
            # Metadata that records the thread names the copy's own thread.
            for ns, cid, meta in cur.execute(
                "SELECT checkpoint_ns, checkpoint_id, metadata FROM checkpoints WHERE thread_id = ?",
                (str(target_thread_id),),
            ).fetchall():
                data = json.loads(meta) if meta else {}
                if data.get("thread_id") == str(source_thread_id):
                    data["thread_id"] = str(target_thread_id)
                    cur.execute(
                        "UPDATE checkpoints SET metadata = ? WHERE thread_id = ? AND checkpoint_ns = ? "
                        "AND checkpoint_id = ?",
                        (json.dumps(data, ensure_ascii=False).encode(), str(target_thread_id), ns, cid),
                    )

    def prune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """``keep_latest``: only each namespace's newest checkpoint (and its writes) stays;
        ``delete``: the threads' checkpoints all go."""
        if strategy not in ("keep_latest", "delete"):
            raise ValueError(f"unknown prune strategy {strategy!r}; use 'keep_latest' or 'delete'")
        with self.cursor() as cur:
            for thread_id in thread_ids:
                rows = cur.execute(
                    "SELECT thread_id, checkpoint_ns, checkpoint_id FROM checkpoints WHERE thread_id = ? "
                    "ORDER BY checkpoint_ns, checkpoint_id DESC",
                    (str(thread_id),),
                ).fetchall()
                if strategy == "keep_latest":  # ids are time-ordered (uuid6): the first per ns
                    newest: dict[str, str] = {}
                    for _, ns, cid in rows:
                        newest.setdefault(ns, cid)
                    rows = [r for r in rows if newest[r[1]] != r[2]]
                self._delete_rows(cur, rows)

    @staticmethod
    def _delete_rows(cur: sqlite3.Cursor, rows: Sequence[tuple[str, str, str]]) -> None:
        for table in ("checkpoints", "writes"):
            cur.executemany(
                f"DELETE FROM {table} WHERE thread_id = ? AND checkpoint_ns = ? AND checkpoint_id = ?", rows
            )
