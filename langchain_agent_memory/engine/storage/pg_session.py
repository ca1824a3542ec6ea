"""PostgreSQL connections that a hung server cannot stall: the catalog's, one session per worker.

Every call has a deadline the client keeps, not only the server: a server frozen by a hung
host or a silent partition (SIGSTOP) still has its kernel accept connections and bytes, and
enforces no ``statement_timeout``. So ``connect_timeout`` bounds a connection, and the
session's watchdog (``Deadlines``, one thread) severs the socket of a call that outlives
``timeout_s`` (the blocked read returns at once). After a failure the circuit opens: every
call answers ``RemoteUnavailableError`` at once (the engine serves from its local tier)
while a background probe retries every ``retry_s`` and closes the circuit when the store
answers again: a worker whose store hangs pays one deadline, not one per request.

Independent threads (admissions, uploads, the lease heartbeat) each get a connection of a
small pool (``Connections``), so a slow query holds up no other call. Nothing waits long
behind a stuck call either (a call takes milliseconds; one that has not returned after
``stuck_s`` most likely waits on a hung server): a call that finds every connection held by
stuck calls answers ``RemoteUnavailableError`` at once, and one that has itself waited
``stuck_s`` while an older call was stuck is severed (two calls stuck: the server is hung).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from ..errors import CommitConflictError
from ..ops.process import RUNTIME, Loan
from .objects import RemoteConfigError, RemoteUnavailableError
from .urls import redacted

logger = logging.getLogger(__name__)
T = TypeVar("T")

#: Seconds a call may run before the calls behind it stop waiting for it.
STUCK_S = 1.0
#: Connections of one session (one worker): admissions, uploads and the heartbeat at once.
POOL_SIZE = 4
#: Seconds an idle connection is kept beyond the latest one (an idle worker holds one).
IDLE_S = 30.0
#: Seconds a new connection may take while another call is out (libpq's least): a server that
#: answered before and now cannot take a connection in this long is most likely hung.
GROW_CONNECT_S = 2
#: Seconds between two looks at the circuit and at the calls ahead, while waiting for a connection.
_WAIT_SLICE_S = 0.05


@dataclass(slots=True, eq=False)
class _Call:
    """A call in flight: its connection, when it started, when it is due."""

    conn: Any
    started: float
    due: float
    severed: str = ""  # why the watchdog cut its socket ("" while it has not)


class Deadlines:
    """The watchdog of one session's calls: one thread, started with the first call and
    joined by ``close``. It severs the socket of a call that outlives its deadline, or that
    has run ``stuck_s`` while an older call has been stuck too; and it calls ``tick`` every
    ``tick_s`` (the pool's idle connections are closed there)."""

    def __init__(self, name: str, stuck_s: float, tick: Callable[[], None], tick_s: float) -> None:
        self.name, self.stuck_s = name, stuck_s
        self._tick, self._tick_s = tick, tick_s
        self._calls: list[_Call] = []  # in the order they started
        self._cond = threading.Condition()
        self._thread: Loan | None = None
        self._closed = False

    @contextmanager
    def watch(self, conn: Any, seconds: float) -> Iterator[_Call]:
        """A call on ``conn`` with ``seconds`` to run; its ``severed`` says if it was cut."""
        now = time.monotonic()
        call = _Call(conn, now, now + seconds)
        with self._cond:
            if self._closed:
                raise RemoteUnavailableError(f"{self.name}: closed")
            self._calls.append(call)
            if self._thread is None:
                self._thread = RUNTIME.lend(self._watch, self.name, self._halt)
            self._cond.notify()
        try:
            yield call
        finally:
            with self._cond:  # the watchdog severs under this lock: never after the call has left
                self._calls.remove(call)
                if self._closed:
                    self._cond.notify_all()  # ``close`` waits for the last one

    def youngest_s(self) -> float:
        """How long the youngest call in flight has run (0: none is)."""
        with self._cond:
            return time.monotonic() - self._calls[-1].started if self._calls else 0.0

    def _watch(self) -> None:
        ticked = time.monotonic()
        with self._cond:
            while not (self._closed and not self._calls):  # closing: the calls left still get cut
                now = time.monotonic()
                wake = now + self._tick_s
                for i, call in enumerate(self._calls):
                    if call.severed:
                        continue
                    late = now >= call.due
                    behind = i > 0 and now - call.started > self.stuck_s  # an older one is stuck too
                    if late or behind:
                        why = "" if late else ", behind a stuck call"
                        call.severed = f"{now - call.started:.1f} s{why}"
                        _sever(call.conn)
                    else:
                        wake = min(wake, call.due, call.started + self.stuck_s if i > 0 else call.due)
                if now - ticked >= self._tick_s and not self._closed:
                    ticked = now
                    self._cond.release()  # the tick closes sockets: no call waits on that
                    try:
                        self._tick()
                    finally:
                        self._cond.acquire()
                    continue
                self._cond.wait(max(0.0, min(wake, ticked + self._tick_s) - now))

    def _halt(self) -> None:
        """The process exits: later calls are refused, the thread ends once those in flight
        have (``RUNTIME.lend``)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def close(self) -> None:
        """Wait for the calls in flight (each ends by its deadline at the latest), then stop
        the thread; later calls are refused."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            while self._calls:
                self._cond.wait()
            thread = self._thread
        if thread is not None:
            thread.join()


class Connections:
    """Up to ``size`` connections, each opened on the thread that needs it, idle ones kept
    for ``idle_s`` (the latest always). NOTE: not ``psycopg_pool``: it opens connections on
    worker threads of its own, so a caller waiting for one gets a ``PoolTimeout`` after the
    whole wait instead of the cause (no such database, a wrong password) at once."""

    def __init__(self, connect: Callable[[bool], Any], size: int, idle_s: float) -> None:
        self._connect, self.size, self.idle_s = connect, size, idle_s
        self._idle: list[tuple[Any, float]] = []  # (connection, when it was given back), latest last
        self._count = 0  # open or opening, idle or in use
        self._cond = threading.Condition()
        self._closed = False

    def take(self, wait_s: float) -> Any | None:
        """An idle connection, or a new one (``connect(alone)``: whether no other is open);
        None when all ``size`` stay in use for ``wait_s``."""
        until = time.monotonic() + wait_s
        with self._cond:
            while True:
                if self._closed:
                    raise RemoteUnavailableError("the session is closed")
                if self._idle:
                    conn = self._idle.pop()[0]
                    if not (conn.closed or conn.broken):
                        return conn
                    self._count -= 1
                    continue
                if self._count < self.size:
                    self._count += 1
                    alone = self._count == 1
                    break
                left = until - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
        try:
            return self._connect(alone)
        except BaseException:
            self._forget(1)
            raise

    def give(self, conn: Any) -> None:
        """Back from a call: kept if sound and idle (no transaction left open), else closed."""
        status = None if conn.closed or conn.broken else conn.info.transaction_status
        sound = status is not None and status == type(status).IDLE  # no transaction left open
        with self._cond:
            if sound and not self._closed:
                self._idle.append((conn, time.monotonic()))
                self._cond.notify()
                return
        self._forget(1, [conn])

    def trim(self, everything: bool = False) -> None:
        """Close the idle connections unused for ``idle_s`` but the latest (``everything``:
        all of them: after a failure none is trusted)."""
        since = time.monotonic() - self.idle_s
        with self._cond:
            old = self._idle if everything else [(c, at) for c, at in self._idle[:-1] if at < since]
            self._idle = [e for e in self._idle if e not in old]
        self._forget(len(old), [c for c, _ in old])

    def close(self) -> None:
        """Close the idle connections now; those in use close when given back."""
        with self._cond:
            self._closed = True
        self.trim(everything=True)

    def _forget(self, n: int, conns: Sequence[Any] = ()) -> None:
        with self._cond:
            self._count -= n
            self._cond.notify_all()
        for conn in conns:
            with contextlib.suppress(Exception):  # already broken
                conn.close()


class PgSession:
    """Connections to one database with client-side deadlines and a circuit breaker
    (thread-safe). ``setup(conn)``: run on the first connection (a schema's migrations)."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 5.0,
        retry_s: float = 5.0,
        stuck_s: float = STUCK_S,
        pool_size: int = POOL_SIZE,
        setup: Callable[[Any], None] | None = None,
    ) -> None:
        import psycopg  # imported here: only a shared store needs it

        if not url.startswith(("postgresql://", "postgres://")):
            raise RemoteConfigError(
                f"store={redacted(url)!r}: expected a postgresql:// URL, e.g. postgresql://user@host/dbname"
            )
        self.psycopg = psycopg
        self.url, self.timeout_s, self.retry_s, self.stuck_s = url, timeout_s, retry_s, stuck_s
        self._setup = setup
        self._ready = setup is None  # set once ``setup`` has run (concurrent first runs are harmless)
        self._pool = Connections(self._new_connection, pool_size, IDLE_S)
        self._deadlines = Deadlines("agent-memory-pg-deadlines", stuck_s, self._pool.trim, IDLE_S)
        self._local = threading.local()  # .conn: the connection this thread holds (nested calls)
        self._open = threading.Event()  # the circuit: set while the store is unhealthy
        self._closed = threading.Event()
        self._probe: Loan | None = None

    @property
    def safe_url(self) -> str:
        """The URL without its password (for messages)."""
        return redacted(self.url)

    @property
    def healthy(self) -> bool:
        """Whether the circuit is closed (the last call reached the store)."""
        return not self._open.is_set()

    def _new_connection(self, alone: bool) -> Any:
        ms = int(self.timeout_s * 1000)
        return self.psycopg.connect(
            self.url,
            autocommit=True,
            connect_timeout=max(1, round(self.timeout_s if alone else min(self.timeout_s, GROW_CONNECT_S))),
            fallback_application_name="langchain-agent-memory",
            # TCP: a peer gone silent is noticed by the kernel too (no effect on unix sockets).
            keepalives=1,
            keepalives_idle=max(1, round(self.timeout_s)),
            keepalives_interval=1,
            keepalives_count=3,
            tcp_user_timeout=ms,
            options=f"-c statement_timeout={ms} -c lock_timeout={ms}",
        )

    def run(self, what: str, fn: Callable[[Any], T]) -> T:
        """``fn(connection)`` (see ``connection``)."""
        with self.connection(what) as conn:
            return fn(conn)

    @contextmanager
    def connection(self, what: str = "use the connection") -> Iterator[Any]:
        """A connection of the pool under the deadline. Connection failures and timeouts
        become ``RemoteUnavailableError`` (and open the circuit), a lock wait that times out
        ``CommitConflictError``. Nested on one thread (inside a transaction), the same one."""
        with self._connection(what, probing=False) as conn:
            yield conn

    @contextmanager
    def _connection(self, what: str, *, probing: bool) -> Iterator[Any]:
        outer = getattr(self._local, "conn", None)
        if outer is not None:
            yield outer
            return
        errors = self.psycopg
        call: _Call | None = None
        try:
            conn = self._take(what, probing)
            try:
                self._local.conn = conn
                with self._deadlines.watch(conn, self.timeout_s + 1.0) as call:
                    if not self._ready and self._setup is not None:
                        self._setup(conn)
                        self._ready = True
                    yield conn
            finally:
                self._local.conn = None
                if call is not None and call.severed:
                    with contextlib.suppress(Exception):
                        conn.close()
                self._pool.give(conn)
        except (errors.OperationalError, errors.errors.QueryCanceled, errors.InterfaceError) as exc:
            if isinstance(exc, errors.errors.LockNotAvailable):
                raise CommitConflictError(f"{what}: another writer holds the record", leased=True) from exc
            self._trip()
            why = f"no answer in {call.severed}" if call is not None and call.severed else str(exc)
            # A server that answered and refused (a wrong password, database or user) says
            # FATAL; a refused or timed-out connection is no answer.
            raise RemoteUnavailableError(
                f"store {self.safe_url}: could not {what}: {why}", unreachable="FATAL" not in why
            ) from exc

    def _take(self, what: str, probing: bool) -> Any:
        """A connection, or ``RemoteUnavailableError`` at once when the session is closed or
        the circuit open (unless ``probing``), or as soon as every connection is held by a
        call that has run for ``stuck_s`` (stuck on a hung server until its deadline: nobody
        waits for that)."""
        give_up = time.monotonic() + self.timeout_s
        while True:
            if self._closed.is_set():
                raise RemoteUnavailableError(f"store {self.safe_url}: could not {what}: closed")
            if self._open.is_set() and not probing:
                raise RemoteUnavailableError(
                    f"store {self.safe_url}: unreachable (a probe retries every {self.retry_s:g} s)"
                )
            conn = self._pool.take(_WAIT_SLICE_S)
            if conn is not None:
                return conn
            youngest = self._deadlines.youngest_s()
            if youngest > self.stuck_s or time.monotonic() > give_up:
                raise RemoteUnavailableError(
                    f"store {self.safe_url}: could not {what}: every connection has waited on the store "
                    f"for {youngest:.1f} s or more (hung?); not queuing behind them"
                )

    def _trip(self) -> None:
        """Open the circuit, drop the idle connections (none is trusted now) and start the
        probe that closes it again."""
        self._open.set()
        self._pool.trim(everything=True)
        with RUNTIME.lock:  # one probe at a time: checked and lent at once
            if self._closed.is_set() or (self._probe is not None and self._probe.is_alive()):
                return
            self._probe = RUNTIME.lend(
                self._probe_until_healthy, "agent-memory-store-probe", self._closed.set
            )

    def _probe_until_healthy(self) -> None:
        while not self._closed.wait(self.retry_s):
            try:
                with self._connection("probe the store", probing=True) as conn:
                    conn.execute("SELECT 1")
            except Exception as exc:  # still down: try again later
                logger.debug("store %s: still unreachable (%s)", self.safe_url, exc)
                continue
            logger.warning("store %s: reachable again", self.safe_url)
            self._open.clear()
            return

    def close(self) -> None:
        """Refuse calls from now on; wait for those in flight (each ends by its deadline at
        the latest); close every connection; end the session's threads."""
        if getattr(self._local, "conn", None) is not None:
            raise RuntimeError("PgSession.close() inside one of its calls would wait for itself: a bug")
        self._closed.set()
        self._pool.close()
        self._deadlines.close()
        with RUNTIME.lock:
            probe = self._probe
        if probe is not None:
            probe.join()  # its connect and its call are bounded by their timeouts


def _sever(conn: Any) -> None:
    """Shut ``conn``'s socket down from another thread (the one blocked on it wakes up)."""
    with contextlib.suppress(Exception):
        fd = conn.pgconn.socket
        sock = socket.socket(fileno=os.dup(fd))
        try:
            sock.shutdown(socket.SHUT_RDWR)
        finally:
            sock.close()
