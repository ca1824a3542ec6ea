"""langgraph-checkpoint-conformance: every base capability and every extended one
(delete_for_runs, copy_thread, prune) must pass, for the SQLite checkpointer and for
AgentMemorySaver on top of it (real engine, real cache directory)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from langgraph.checkpoint.conformance import checkpointer_test, validate
from langgraph.checkpoint.conformance.capabilities import ALL_CAPABILITIES, BASE_CAPABILITIES
from langgraph.checkpoint.memory import InMemorySaver

from langchain_agent_memory.engine.model.loading import LoadedModel
from langchain_agent_memory.graph.saver import AgentMemorySaver, server_checkpointer
from langchain_agent_memory.graph.sqlite_checkpoints import SqliteCheckpoints


@checkpointer_test(name="SqliteCheckpoints")
async def _sqlite_checkpoints():  # type: ignore[no-untyped-def]
    with tempfile.TemporaryDirectory() as tmp:
        saver = SqliteCheckpoints(Path(tmp) / "checkpoints.sqlite")
        yield saver
        saver.conn.close()


@checkpointer_test(name="AgentMemorySaver")
async def _agent_memory_saver():  # type: ignore[no-untyped-def]
    with tempfile.TemporaryDirectory() as tmp:
        yield AgentMemorySaver(cache_dir=tmp)


#: The server's cache directory, one for the module: it holds the model converted from its GGUF
#: (once, not per conformance test); each test gets a checkpoint database of its own.
_SERVER_CACHE = tempfile.TemporaryDirectory(prefix="server-checkpointer-")


@checkpointer_test(name="server_checkpointer")
async def _server_checkpointer():  # type: ignore[no-untyped-def]
    """What ``langgraph dev`` builds from ``langgraph.json`` (examples/langgraph_server)."""
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as env:
        env.setenv("AGENT_MEMORY_CACHE_DIR", _SERVER_CACHE.name)
        env.setenv("AGENT_MEMORY_CHECKPOINTS", str(Path(tmp) / "checkpoints.sqlite"))
        async with server_checkpointer() as saver:
            yield saver


@pytest.mark.parametrize(
    "registered", [_sqlite_checkpoints, _agent_memory_saver, _server_checkpointer], ids=lambda r: r.name
)
async def test_full_conformance(registered, smollm: LoadedModel) -> None:  # type: ignore[no-untyped-def]
    report = await validate(registered)
    report.print_report()
    failures = {cap: r.failures for cap, r in report.results.items() if r.passed is not True}
    assert not failures, failures
    assert {c.value for c in ALL_CAPABILITIES} <= {c for c, r in report.results.items() if r.detected}
    assert report.conformance_level() == "FULL"
    passed = sum(r.tests_passed for r in report.results.values())
    print(f"{registered.name}: {passed} conformance tests passed")
    assert passed >= 40


@checkpointer_test(name="AgentMemorySaver(InMemorySaver)")
async def _wrapping_in_memory():  # type: ignore[no-untyped-def]
    with tempfile.TemporaryDirectory() as tmp:
        yield AgentMemorySaver(InMemorySaver(), cache_dir=tmp)


async def test_wrapping_another_saver_passes_its_capabilities(smollm: LoadedModel) -> None:
    """Checkpoints can live in another saver (InMemorySaver here, PostgresSaver in
    production): everything that saver supports (the base capabilities) passes through."""
    report = await validate(_wrapping_in_memory, capabilities={c.value for c in BASE_CAPABILITIES})
    report.print_report()
    results = {cap: r for cap, r in report.results.items() if cap in {c.value for c in BASE_CAPABILITIES}}
    assert results and all(r.passed is True for r in results.values()), {
        c: r.failures for c, r in results.items()
    }


async def test_postgres_conformance_is_full(postgres_url: str, smollm: LoadedModel) -> None:
    """PostgreSQL (a real server): langgraph-checkpoint-postgres completed with copy_thread
    and delete_for_runs is FULL, alone and under AgentMemorySaver (called through its
    async methods)."""
    from contextlib import asynccontextmanager

    from psycopg import AsyncConnection
    from psycopg.rows import dict_row

    from langchain_agent_memory.graph.postgres_checkpoints import AsyncPostgresCheckpoints

    @asynccontextmanager
    async def postgres():  # type: ignore[no-untyped-def]
        async with await AsyncConnection.connect(
            postgres_url, autocommit=True, prepare_threshold=0, row_factory=dict_row
        ) as conn:
            saver = AsyncPostgresCheckpoints(conn)
            await saver.setup()
            yield saver
            for table in ("checkpoints", "checkpoint_blobs", "checkpoint_writes"):
                await conn.execute(f"TRUNCATE {table}")

    @checkpointer_test(name="AsyncPostgresCheckpoints")
    async def _postgres():  # type: ignore[no-untyped-def]
        async with postgres() as saver:
            yield saver

    @checkpointer_test(name="AgentMemorySaver(AsyncPostgresCheckpoints)")
    async def _wrapped():  # type: ignore[no-untyped-def]
        async with postgres() as inner:
            with tempfile.TemporaryDirectory() as tmp:
                yield AgentMemorySaver(inner, cache_dir=tmp)

    for registered in (_postgres, _wrapped):
        report = await validate(registered)
        report.print_report()
        failures = {cap: r.failures for cap, r in report.results.items() if r.passed is not True}
        assert not failures, (registered.name, failures)
        assert report.conformance_level() == "FULL", registered.name


async def test_shared_store_saver_conformance_is_full(
    shared_store: tuple[str, str], smollm: LoadedModel
) -> None:
    """``AgentMemorySaver(store=, blocks=)``: checkpoints and links in the shared store's
    PostgreSQL database (what workers on several hosts share) is FULL too."""

    @checkpointer_test(name="AgentMemorySaver(store=postgresql://, blocks=s3://)")
    async def _shared():  # type: ignore[no-untyped-def]
        with (
            tempfile.TemporaryDirectory() as tmp,
            AgentMemorySaver(cache_dir=tmp, store=shared_store[0], blocks=shared_store[1]) as saver,
        ):
            yield saver
            for table in ("checkpoints", "checkpoint_blobs", "checkpoint_writes", "am_links", "am_history"):
                saver._owned_conn.execute(f"TRUNCATE {table}")

    report = await validate(_shared)
    report.print_report()
    failures = {cap: r.failures for cap, r in report.results.items() if r.passed is not True}
    assert not failures, failures
    assert report.conformance_level() == "FULL"
