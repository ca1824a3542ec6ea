"""langgraph-checkpoint-conformance on the SQLite checkpointer: every base capability and
every extended one (delete_for_runs, copy_thread, prune) must pass."""

from __future__ import annotations

import tempfile
from pathlib import Path

from langgraph.checkpoint.conformance import checkpointer_test, validate
from langgraph.checkpoint.conformance.capabilities import ALL_CAPABILITIES

from langchain_agent_memory.sqlite_checkpoints import SqliteCheckpoints


@checkpointer_test(name="SqliteCheckpoints")
async def _sqlite_checkpoints():  # type: ignore[no-untyped-def]
    with tempfile.TemporaryDirectory() as tmp:
        saver = SqliteCheckpoints(Path(tmp) / "checkpoints.sqlite")
        yield saver
        saver.conn.close()


async def test_sqlite_checkpoints_full_conformance() -> None:
    report = await validate(_sqlite_checkpoints)
    report.print_report()
    failures = {cap: r.failures for cap, r in report.results.items() if r.passed is not True}
    assert not failures, failures
    assert {c.value for c in ALL_CAPABILITIES} <= {c for c, r in report.results.items() if r.detected}
    assert report.conformance_level() == "FULL"
