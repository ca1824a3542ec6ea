"""The catalog's PostgreSQL session (``storage.pg_session``) against a real server: a
store opened and closed many times leaves no thread and no connection behind, a closed
session refuses calls, independent threads do not wait for each other, and a frozen
backend costs one deadline (with one watchdog thread), opens the circuit and closes it."""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from services import PostgresServer

from langchain_agent_memory.engine.storage.catalog import Catalog
from langchain_agent_memory.engine.storage.objects import RemoteUnavailableError
from langchain_agent_memory.engine.storage.protocols import take_lease
from langchain_agent_memory.engine.storage.remote import SharedBlockStore, open_store
from langchain_agent_memory.engine.storage.store_config import StoreConfig

FP = "session-model"
#: The threads a session, a lease heartbeat and a store's I/O pool start (by name).
OURS = ("agent-memory", "store-probe")


def _native_threads() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads: line in /proc/self/status")


def _ours() -> Counter[str]:
    """Threads of the package, by name (earlier tests' engines may still run some)."""
    return Counter(t.name for t in threading.enumerate() if t.name.startswith(OURS))


def _backends(url: str) -> int:
    """Connections to ``url``'s database other than this check's own."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid()"
        ).fetchone()
    assert row is not None
    return int(row[0])


def _no_backends_left(url: str) -> int:
    """The backends of closed connections exit a moment after the client's goodbye."""
    deadline = time.monotonic() + 5
    while (n := _backends(url)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return n


@pytest.fixture
def database(postgres: PostgresServer, request: pytest.FixtureRequest) -> str:
    return postgres.new_database("s" + hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:16])


@pytest.fixture
def catalog(database: str) -> Iterator[Catalog]:
    made = Catalog(database, timeout_s=2.0, retry_s=0.5)
    yield made
    made.close()


def test_open_close_cycles_leave_no_thread_and_no_connection(
    tmp_path: Path, shared_store: tuple[str, str], figures: dict[str, str]
) -> None:
    """200 shared stores opened (schema, bucket binding), used from several threads at once
    (a lease and its heartbeat, concurrent catalog reads) and closed: every thread they
    started is joined and every connection they opened is closed, each time."""
    config = StoreConfig.of(*shared_store)
    assert config is not None

    def cycle(i: int) -> None:
        store = open_store(tmp_path / "w", FP, config)
        assert isinstance(store, SharedBlockStore)
        lease = take_lease(store.replication, f"agent-{i % 7}", None)  # the heartbeat starts
        readers = [
            threading.Thread(target=store.catalog.has_blocks, args=(FP, [f"{i}-{k}"])) for k in range(3)
        ]
        for t in readers:
            t.start()
        store.catalog.now()
        for t in readers:
            t.join()
        lease.release()
        store.close()

    cycle(0)  # the object store's client starts its runtime threads once per process
    before, native = _ours(), _native_threads()
    assert _no_backends_left(config.records) == 0
    t0 = time.monotonic()
    for i in range(1, 201):
        cycle(i)
        if i % 50 == 0:
            assert not _ours() - before, (i, _ours() - before)
    took = time.monotonic() - t0
    assert not _ours() - before
    assert _native_threads() <= native + 2, (native, _native_threads(), threading.enumerate())
    assert _no_backends_left(config.records) == 0
    figures["store open/close cycles"] = f"200 in {took:.1f} s: threads left 0, connections left 0"


def test_a_closed_catalog_refuses_calls(catalog: Catalog, database: str) -> None:
    before = _ours()
    assert catalog.now() > 0
    assert _ours() - before == Counter({"agent-memory-pg-deadlines": 1})  # the session's watchdog
    catalog.close()
    with pytest.raises(RemoteUnavailableError, match="closed"):
        catalog.now()
    with pytest.raises(RemoteUnavailableError, match="closed"), catalog.session.connection():
        pass
    assert not _ours() - before and _no_backends_left(database) == 0


def test_independent_threads_do_not_wait_for_each_other(catalog: Catalog) -> None:
    """One thread's slow query holds its connection; another thread's call answers meanwhile."""
    held, ended = threading.Event(), threading.Event()

    def slow() -> None:
        with catalog.session.connection() as conn:
            held.set()
            conn.execute("SELECT pg_sleep(0.5)")
        ended.set()

    sleeper = threading.Thread(target=slow)
    sleeper.start()
    assert held.wait(5)
    t0 = time.monotonic()
    catalog.now()
    took = time.monotonic() - t0
    answered_first = not ended.is_set()
    sleeper.join()
    assert answered_first and took < 0.3, took


def test_a_nested_call_on_one_thread_uses_its_connection(catalog: Catalog) -> None:
    """A call made inside another on the same thread (in its transaction) runs on the same
    connection: it sees what the transaction wrote."""
    with catalog.session.connection() as conn, conn.transaction():
        conn.execute("CREATE TEMP TABLE nested (x int)")
        conn.execute("INSERT INTO nested VALUES (1)")
        with catalog.session.connection() as inner:
            assert inner is conn
            assert inner.execute("SELECT count(*) FROM nested").fetchone()[0] == 1


def _freeze_own_backend(conn: psycopg.Connection) -> int:
    pid = int(conn.execute("SELECT pg_backend_pid()").fetchone()[0])  # type: ignore[index]
    os.kill(pid, signal.SIGSTOP)
    return pid


def test_a_frozen_backend_costs_one_deadline_and_opens_the_circuit(catalog: Catalog) -> None:
    """Two calls on backends SIGSTOPped (a hung server answers nothing and enforces no
    timeout): the younger one is cut once it has waited ``stuck_s`` behind the stuck older
    one; the older one at its deadline (``timeout_s`` + 1 s); meanwhile the circuit is open and
    calls answer at once; the probe closes it once the server answers again."""
    before = _ours()
    catalog.now()
    frozen: list[int] = []
    outcome: dict[str, tuple[float, str]] = {}
    t0 = time.monotonic()

    def call(name: str) -> None:
        try:
            with catalog.session.connection(f"run {name}") as conn:
                frozen.append(_freeze_own_backend(conn))
                conn.execute("SELECT 1")
            outcome[name] = (time.monotonic() - t0, "answered")
        except RemoteUnavailableError as exc:
            outcome[name] = (time.monotonic() - t0, str(exc))

    older = threading.Thread(target=call, args=("older",))
    younger = threading.Thread(target=call, args=("younger",))
    try:
        older.start()
        time.sleep(0.3)
        younger.start()
        younger.join(10)
        t_open = time.monotonic()
        with pytest.raises(RemoteUnavailableError, match="unreachable"):
            catalog.now()
        assert time.monotonic() - t_open < 0.1
        older.join(10)
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
    (at_young, why_young), (at_old, why_old) = outcome["younger"], outcome["older"]
    assert "behind a stuck call" in why_young and 1.2 < at_young < 2.0, outcome
    assert "no answer in 3.0 s" in why_old and 2.9 < at_old < 4.0, outcome
    assert (_ours() - before)["agent-memory-pg-deadlines"] == 1  # one watchdog for every call
    deadline = time.monotonic() + 5
    while not catalog.healthy:
        assert time.monotonic() < deadline, "the probe did not close the circuit"
        time.sleep(0.1)
    assert catalog.now() > 0


def test_checkpoint_links_on_a_frozen_database_fail_at_their_deadline(database: str) -> None:
    """The checkpointer's links in a shared store's database (``PostgresLinks``) go through
    the same session: a call whose backend is frozen fails with ``RemoteUnavailableError``
    at its deadline instead of hanging the graph, and the links answer again once the
    database does."""
    from langchain_agent_memory.graph.links import PostgresLinks

    links = PostgresLinks(database, timeout_s=1.0)
    try:
        links.note_engine("engine-a", "/models/a", "q4")
        links.remember("engine-a", "thread ✓:planner", links.clock(), "digest-1")
        frozen: list[int] = []
        t0 = time.monotonic()
        with pytest.raises(RemoteUnavailableError), links._tx() as cur:
            frozen.append(_freeze_own_backend(cur.connection))
            cur.execute("SELECT 1")
        took = time.monotonic() - t0
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
        assert took < 6.0, took  # its deadline (timeout_s + 1 s): it does not hang
        deadline = time.monotonic() + 10
        while True:  # the circuit closes once a probe reaches the database
            try:
                assert links.engine_args("engine-a") == ("/models/a", "q4")
                break
            except RemoteUnavailableError:
                assert time.monotonic() < deadline, "the links never answered again"
                time.sleep(0.2)
    finally:
        links.close()
