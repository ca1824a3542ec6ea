"""A PostgreSQL connection that a hung server cannot stall: the catalog's, one per worker.

Every call has a deadline the client keeps, not only the server: a server frozen by a hung
host or a silent partition (SIGSTOP) still has its kernel accept connections and bytes, and
enforces no ``statement_timeout``. So ``connect_timeout`` bounds the connection, a watchdog
severs the socket of a call that outlives ``timeout_s`` (the blocked read returns at once),
and a caller waits for the connection's lock no longer than ``timeout_s`` either. After a
failure the circuit opens: every call answers ``RemoteUnavailableError`` at once (the
engine serves from its local tier) while a background probe retries every ``retry_s`` and
closes the circuit when the store answers again: a worker whose store hangs pays one
deadline, not one per request. Nor does a call queue behind one that has held the
connection for longer than ``stuck_s`` (a call takes milliseconds; one that has not returned
after a second most likely waits on a hung server): it answers ``RemoteUnavailableError``
at once, and its request goes on from the local tier, while the first one's deadline runs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from .blocks import CacheWriteError
from .objects import RemoteConfigError, RemoteUnavailableError
from .urls import redacted

logger = logging.getLogger(__name__)
T = TypeVar("T")

#: Seconds a call may hold the connection before the calls behind it stop waiting for it.
STUCK_S = 1.0
#: Seconds between two looks at the circuit and at the call ahead, while waiting for it.
_WAIT_SLICE_S = 0.05


class CommitConflictError(CacheWriteError):
    """Another writer committed this agent first (or holds its lease): this save lost.
    ``leased``: another worker holds the lease (a later retry may succeed)."""

    def __init__(self, message: str, *, leased: bool = False) -> None:
        super().__init__(message)
        self.leased = leased


class PgSession:
    """One connection under one lock, with client-side deadlines and a circuit breaker
    (thread-safe). ``_migrate(conn)``: what a subclass runs once on its first connection."""

    def __init__(
        self, url: str, *, timeout_s: float = 5.0, retry_s: float = 5.0, stuck_s: float = STUCK_S
    ) -> None:
        import psycopg  # imported here: only a shared store needs it

        if not url.startswith(("postgresql://", "postgres://")):
            raise RemoteConfigError(
                f"store={redacted(url)!r}: expected a postgresql:// URL, e.g. postgresql://user@host/dbname"
            )
        self._psycopg = psycopg
        self.url = url
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.stuck_s = stuck_s
        self._conn: Any = None
        self._lock = threading.RLock()
        self._since: float | None = None  # when the call holding the connection started
        self._depth = 0  # how deep its thread holds the (re-entrant) lock
        self._open = threading.Event()  # the circuit: set while the store is unhealthy
        self._closed = threading.Event()
        self._probe: threading.Thread | None = None
        self._migrated = False

    def _new_connection(self) -> Any:
        ms = int(self.timeout_s * 1000)
        return self._psycopg.connect(
            self.url,
            autocommit=True,
            connect_timeout=max(1, round(self.timeout_s)),
            # TCP: a peer gone silent is noticed by the kernel too (no effect on unix sockets).
            keepalives=1,
            keepalives_idle=max(1, round(self.timeout_s)),
            keepalives_interval=1,
            keepalives_count=3,
            tcp_user_timeout=ms,
            options=f"-c statement_timeout={ms} -c lock_timeout={ms}",
        )

    def _connect(self) -> Any:
        if self._conn is not None and not self._conn.closed and not self._conn.broken:
            return self._conn
        conn = self._conn = self._new_connection()
        if not self._migrated:
            with self._deadline(conn):
                self._migrate(conn)
            self._migrated = True
        return conn

    @contextmanager
    def _deadline(self, conn: Any) -> Iterator[None]:
        """Sever ``conn``'s socket if the block outlives ``timeout_s`` (plus a second, so a
        live server's own ``statement_timeout`` answers first): psycopg's blocked read then
        fails at once with an ``OperationalError``."""
        timer = threading.Timer(self.timeout_s + 1.0, _sever, args=(conn,))
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()

    @property
    def healthy(self) -> bool:
        """Whether the circuit is closed (the last call reached the store)."""
        return not self._open.is_set()

    def _trip(self) -> None:
        """Open the circuit and start the probe that closes it again."""
        self._open.set()
        if self._probe is None or not self._probe.is_alive():
            self._probe = threading.Thread(target=self._probe_until_healthy, daemon=True, name="store-probe")
            self._probe.start()

    def _probe_until_healthy(self) -> None:
        while not self._closed.wait(self.retry_s):
            try:
                conn = self._new_connection()
                try:
                    with self._deadline(conn):
                        conn.execute("SELECT 1")
                finally:
                    with contextlib.suppress(Exception):
                        conn.close()
            except Exception as exc:  # still down: try again later
                logger.debug("store %s: still unreachable (%s)", self._safe_url, exc)
                continue
            logger.warning("store %s: reachable again", self._safe_url)
            self._open.clear()
            return

    def _migrate(self, conn: Any) -> None:
        """Run once on the first connection (a subclass's schema)."""

    def _run(self, what: str, fn: Callable[[Any], T]) -> T:
        """``fn(connection)`` under the lock; connection failures and timeouts become
        ``RemoteUnavailableError`` (and open the circuit breaker)."""
        errors = self._psycopg
        down = f"store {self._safe_url}: unreachable (a probe retries every {self.retry_s:g} s)"
        self._acquire(what)
        try:
            if self._open.is_set():
                raise RemoteUnavailableError(down)
            try:
                conn = self._connect()
                with self._deadline(conn):
                    return fn(conn)
            except (errors.OperationalError, errors.errors.QueryCanceled, errors.InterfaceError) as exc:
                if isinstance(exc, errors.errors.LockNotAvailable):
                    raise CommitConflictError(
                        f"{what}: another writer holds the record", leased=True
                    ) from exc
                self._trip()
                if self._conn is not None:
                    with contextlib.suppress(Exception):  # already broken
                        self._conn.close()
                    self._conn = None
                raise RemoteUnavailableError(f"store {self._safe_url}: could not {what}: {exc}") from exc
        finally:
            self._release()

    def _acquire(self, what: str) -> None:
        """Take the connection, or raise ``RemoteUnavailableError`` at once when the circuit
        is open, or as soon as the call holding it has done so for ``stuck_s`` (a call
        stuck on a hung server holds it until its watchdog fires: nobody waits for that)."""
        while True:
            if self._open.is_set():
                raise RemoteUnavailableError(
                    f"store {self._safe_url}: unreachable (a probe retries every {self.retry_s:g} s)"
                )
            if self._lock.acquire(timeout=_WAIT_SLICE_S):
                self._depth += 1
                if self._depth == 1:
                    self._since = time.monotonic()
                return
            since = self._since
            if since is not None and time.monotonic() - since > self.stuck_s:
                raise RemoteUnavailableError(
                    f"store {self._safe_url}: could not {what}: the call before it has waited on the "
                    f"store for {time.monotonic() - since:.1f} s (hung?); not queuing behind it"
                )

    def _release(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._since = None
        self._lock.release()

    @property
    def _safe_url(self) -> str:
        """The URL without its password (for messages)."""
        return redacted(self.url)

    def close(self) -> None:
        self._closed.set()
        if not self._lock.acquire(timeout=self.timeout_s + 2.0):
            return  # a call is stuck on a hung server: its watchdog closes the connection
        try:
            if self._conn is not None:
                with contextlib.suppress(Exception):
                    self._conn.close()
                self._conn = None
        finally:
            self._lock.release()

    @contextmanager
    def connection(self) -> Iterator[Any]:
        """The connection, under the lock and the deadline (for tables of other modules, e.g.
        the saver's links)."""
        self._acquire("use the connection")
        try:
            conn = self._connect()
            with self._deadline(conn):
                yield conn
        finally:
            self._release()


def _sever(conn: Any) -> None:
    """Shut ``conn``'s socket down from another thread (the one blocked on it wakes up)."""
    with contextlib.suppress(Exception):
        fd = conn.pgconn.socket
        sock = socket.socket(fileno=os.dup(fd))
        try:
            sock.shutdown(socket.SHUT_RDWR)
        finally:
            sock.close()
