"""A PostgreSQL connection that a hung server cannot stall: the catalog's, one per worker.

Every call has a deadline the client keeps, not only the server: a server frozen by a hung
host or a silent partition (SIGSTOP) still has its kernel accept connections and bytes, and
enforces no ``statement_timeout``. So ``connect_timeout`` bounds the connection, a watchdog
severs the socket of a call that outlives ``timeout_s`` (the blocked read returns at once),
and a caller waits for the connection's lock no longer than ``timeout_s`` either. After a
failure the circuit opens: every call answers ``RemoteUnavailableError`` at once (the
engine serves from its local tier) while a background probe retries every ``retry_s`` and
closes the circuit when the store answers again: a worker whose store hangs pays one
deadline, not one per request.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from .blocks import CacheWriteError
from .objects import RemoteConfigError, RemoteUnavailableError
from .urls import redacted

logger = logging.getLogger(__name__)
T = TypeVar("T")


class CommitConflictError(CacheWriteError):
    """Another writer committed this agent first (or holds its lease): this save lost.
    ``leased``: another worker holds the lease (a later retry may succeed)."""

    def __init__(self, message: str, *, leased: bool = False) -> None:
        super().__init__(message)
        self.leased = leased


class PgSession:
    """One connection under one lock, with client-side deadlines and a circuit breaker
    (thread-safe). ``_migrate(conn)``: what a subclass runs once on its first connection."""

    def __init__(self, url: str, *, timeout_s: float = 5.0, retry_s: float = 5.0) -> None:
        import psycopg  # imported here: only a shared store needs it

        if not url.startswith(("postgresql://", "postgres://")):
            raise RemoteConfigError(
                f"store={redacted(url)!r}: expected a postgresql:// URL, e.g. postgresql://user@host/dbname"
            )
        self._psycopg = psycopg
        self.url = url
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self._conn: Any = None
        self._lock = threading.RLock()
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
        if self._open.is_set():
            raise RemoteUnavailableError(down)
        # A call stuck on a hung server holds the lock until its watchdog fires: wait no
        # longer than that for it.
        if not self._lock.acquire(timeout=self.timeout_s + 2.0):
            raise RemoteUnavailableError(f"store {self._safe_url}: could not {what}: another call is stuck")
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
        if self._open.is_set() or not self._lock.acquire(timeout=self.timeout_s + 2.0):
            raise RemoteUnavailableError(f"store {self._safe_url}: unreachable")
        try:
            conn = self._connect()
            with self._deadline(conn):
                yield conn
        finally:
            self._lock.release()


def _sever(conn: Any) -> None:
    """Shut ``conn``'s socket down from another thread (the one blocked on it wakes up)."""
    with contextlib.suppress(Exception):
        fd = conn.pgconn.socket
        sock = socket.socket(fileno=os.dup(fd))
        try:
            sock.shutdown(socket.SHUT_RDWR)
        finally:
            sock.close()
