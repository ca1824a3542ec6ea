"""LangGraph checkpoints in PostgreSQL: langgraph-checkpoint-postgres's ``PostgresSaver``
and ``AsyncPostgresSaver`` (their schema, reads and writes as they are), completed with
what its 3.2 leaves out (it raises ``NotImplementedError``): ``copy_thread`` and
``delete_for_runs``, in SQL on the same three tables, one transaction each.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langgraph.checkpoint.postgres import PostgresSaver
from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver

from .threaded_async import ThreadedAsync

_TABLES = ("checkpoints", "checkpoint_blobs", "checkpoint_writes")


def _copy_sql(table: str, columns: list[str]) -> str:
    rest = ", ".join(c for c in columns if c != "thread_id")
    return (
        f"INSERT INTO {table} (thread_id, {rest}) SELECT %s, {rest} FROM {table} "
        "WHERE thread_id = %s ON CONFLICT DO NOTHING"
    )


#: The copy's metadata names its own thread (where the source's named the source).
_RETHREAD_SQL = (
    "UPDATE checkpoints SET metadata = jsonb_set(metadata, '{thread_id}', to_jsonb(%s::text)) "
    "WHERE thread_id = %s AND metadata->>'thread_id' = %s"
)
_COLUMNS_SQL = (
    "SELECT column_name FROM information_schema.columns WHERE table_name = %s ORDER BY ordinal_position"
)
_RUNS_SQL = (
    "SELECT thread_id, checkpoint_ns, checkpoint_id FROM checkpoints WHERE metadata->>'run_id' = ANY(%s)"
)
_DELETE_SQL = [
    f"DELETE FROM {t} WHERE (thread_id, checkpoint_ns, checkpoint_id) IN "
    "(SELECT * FROM unnest(%s::text[], %s::text[], %s::text[]))"
    for t in ("checkpoints", "checkpoint_writes")
]


def _columns_of(rows: list[Any]) -> list[str]:
    return [r["column_name"] if isinstance(r, dict) else r[0] for r in rows]


def _unzip(rows: list[Any]) -> tuple[list[str], list[str], list[str]]:
    """(thread ids, namespaces, checkpoint ids) of checkpoint rows (dict or tuple rows)."""
    keys = [tuple(r.values()) if isinstance(r, dict) else tuple(r) for r in rows]
    return [k[0] for k in keys], [k[1] for k in keys], [k[2] for k in keys]


class PostgresCheckpoints(ThreadedAsync, PostgresSaver):
    """A complete PostgreSQL checkpointer (every extended capability; its async methods run
    the sync ones on a worker thread, so ``ainvoke`` works on one sync connection)."""

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Copy every checkpoint, blob and write of ``source_thread_id`` to
        ``target_thread_id`` (all namespaces, the whole parent chain)."""
        src, dst = str(source_thread_id), str(target_thread_id)
        with self._cursor() as cur, cur.connection.transaction():
            for table in _TABLES:
                cur.execute(_COLUMNS_SQL, (table,))
                cur.execute(_copy_sql(table, _columns_of(cur.fetchall())), (dst, src))
            cur.execute(_RETHREAD_SQL, (dst, dst, src))

    def delete_for_runs(self, run_ids: Sequence[str]) -> None:
        """Delete the checkpoints whose metadata names one of ``run_ids``, and their writes."""
        if not run_ids:
            return
        with self._cursor() as cur, cur.connection.transaction():
            cur.execute(_RUNS_SQL, ([str(r) for r in run_ids],))
            keys = _unzip(cur.fetchall())
            for sql in _DELETE_SQL:
                cur.execute(sql, keys)


class AsyncPostgresCheckpoints(AsyncPostgresSaver):
    """``PostgresCheckpoints`` for async code (its own async connection)."""

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        src, dst = str(source_thread_id), str(target_thread_id)
        async with self._cursor() as cur, cur.connection.transaction():
            for table in _TABLES:
                await cur.execute(_COLUMNS_SQL, (table,))
                await cur.execute(_copy_sql(table, _columns_of(await cur.fetchall())), (dst, src))
            await cur.execute(_RETHREAD_SQL, (dst, dst, src))

    async def adelete_for_runs(self, run_ids: Sequence[str]) -> None:
        if not run_ids:
            return
        async with self._cursor() as cur, cur.connection.transaction():
            await cur.execute(_RUNS_SQL, ([str(r) for r in run_ids],))
            keys = _unzip(await cur.fetchall())
            for sql in _DELETE_SQL:
                await cur.execute(sql, keys)
