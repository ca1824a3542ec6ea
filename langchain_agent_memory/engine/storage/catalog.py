"""The system of record of a shared store, in PostgreSQL: agent records and their block
references (the shape of the local ``index.sqlite``), a catalog of the block objects for
garbage collection, and leases.

Consistency rests on Postgres transactions, never on a worker's clock or memory:

- A commit (``commit``) checks the record's version (compare-and-swap) and the writer's
  lease, and touches the catalog rows of every block it names (``UPDATE ... RETURNING``:
  their row locks, and a fresh ``touched_at``), in one transaction. A block whose row is
  gone (collected) is reported missing: the writer uploads it again and retries.
- Garbage collection (``collect``) takes a block's row lock (``FOR UPDATE SKIP LOCKED``),
  checks that no record names it and that it was last touched longer ago than the grace
  period, marks it not stored and commits, and only then deletes the object and the row
  (a collector killed between the two leaves a row no commit trusts). A block a commit is
  naming is locked or freshly touched: a committed cache never loses a block.
- Timestamps (``updated_at``, ``touched_at``, lease expiry) are Postgres's ``now()``.

Every call has a deadline the client keeps, and a circuit breaker: the catalog's
``session`` (``pg_session.PgSession``) holds its connections.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from ..errors import BlockMissingError, CommitConflictError
from .objects import RemoteConfigError
from .pg_session import STUCK_S, PgSession
from .urls import redacted

__all__ = ["MIGRATIONS", "Catalog", "CommitConflictError", "Committed"]

logger = logging.getLogger(__name__)
T = TypeVar("T")


#: The schema, as migrations (``am_schema`` holds how many have run). Add a step; never edit one.
MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE IF NOT EXISTS am_agents (
        fingerprint TEXT NOT NULL,
        agent_id TEXT NOT NULL,
        record TEXT NOT NULL,
        version BIGINT NOT NULL,
        updated_at TIMESTAMPTZ NOT NULL DEFAULT now(),
        PRIMARY KEY (fingerprint, agent_id)
    );
    CREATE TABLE IF NOT EXISTS am_refs (
        fingerprint TEXT NOT NULL,
        agent_id TEXT NOT NULL,
        pos INTEGER NOT NULL,
        block TEXT NOT NULL,
        PRIMARY KEY (fingerprint, agent_id, pos),
        FOREIGN KEY (fingerprint, agent_id) REFERENCES am_agents ON DELETE CASCADE
    );
    CREATE INDEX IF NOT EXISTS am_refs_block ON am_refs (fingerprint, block);
    CREATE TABLE IF NOT EXISTS am_blocks (
        fingerprint TEXT NOT NULL,
        hash TEXT NOT NULL,
        nbytes BIGINT NOT NULL,
        touched_at TIMESTAMPTZ NOT NULL DEFAULT now(),
        stored BOOLEAN NOT NULL DEFAULT false,  -- its object is written (set after the upload)
        PRIMARY KEY (fingerprint, hash)
    );
    CREATE TABLE IF NOT EXISTS am_leases (
        fingerprint TEXT NOT NULL,
        agent_id TEXT NOT NULL,
        holder TEXT NOT NULL,
        expires_at TIMESTAMPTZ NOT NULL,
        PRIMARY KEY (fingerprint, agent_id)
    );
    """,
    # 2: what a store is bound to (the bucket of its blocks: a worker given another is refused).
    """
    CREATE TABLE IF NOT EXISTS am_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
    """,
)


def _migrate(conn: Any, url: str) -> None:
    """Bring the schema of ``url``'s database to ``MIGRATIONS`` (on a session's first connection)."""
    with conn.transaction():
        # One migrator at a time across workers (a transaction-scoped advisory lock).
        conn.execute("SELECT pg_advisory_xact_lock(hashtext('langchain-agent-memory/schema'))")
        conn.execute("CREATE TABLE IF NOT EXISTS am_schema (version INTEGER NOT NULL)")
        row = conn.execute("SELECT version FROM am_schema").fetchone()
        found = row[0] if row else 0
        if found > len(MIGRATIONS):
            raise RemoteConfigError(
                f"store {redacted(url)} has schema {found}, written by a newer langchain-agent-memory "
                f"(this version reads {len(MIGRATIONS)}): upgrade the package"
            )
        for step in MIGRATIONS[found:]:
            conn.execute(step)
        if row is None:
            conn.execute("INSERT INTO am_schema VALUES (%s)", (len(MIGRATIONS),))
        else:
            conn.execute("UPDATE am_schema SET version = %s", (len(MIGRATIONS),))


@dataclass(frozen=True, slots=True)
class Committed:
    version: int
    updated_at: float  # Postgres's clock, seconds since the epoch


class Catalog:
    """One worker's view of the system of record (thread-safe): its queries, run on the
    ``session``'s connections (a small pool, client-side deadlines, a circuit breaker)."""

    def __init__(
        self, url: str, *, timeout_s: float = 5.0, retry_s: float = 5.0, stuck_s: float = STUCK_S
    ) -> None:
        self.session = PgSession(
            url, timeout_s=timeout_s, retry_s=retry_s, stuck_s=stuck_s, setup=lambda conn: _migrate(conn, url)
        )

    @property
    def url(self) -> str:
        return self.session.url

    @property
    def timeout_s(self) -> float:
        return self.session.timeout_s

    @property
    def healthy(self) -> bool:
        """Whether the circuit is closed (the last call reached the store)."""
        return self.session.healthy

    def close(self) -> None:
        """Close the session (calls after this are refused)."""
        self.session.close()

    def _run(self, what: str, fn: Callable[[Any], T]) -> T:
        return self.session.run(what, fn)

    @property
    def _safe_url(self) -> str:
        return self.session.safe_url

    def bind_blocks(self, identity: str) -> None:
        """Bind this database to the object store holding its blocks (``bucket/prefix``) on
        first use; ``RemoteConfigError`` if it is bound to another (two workers on one
        database with different buckets would name blocks the other cannot read)."""

        def bind(c: Any) -> str:
            c.execute("INSERT INTO am_meta VALUES ('blocks', %s) ON CONFLICT (key) DO NOTHING", (identity,))
            return str(c.execute("SELECT value FROM am_meta WHERE key = 'blocks'").fetchone()[0])

        bound = self._run("read the store's settings", bind)
        if bound != identity:
            raise RemoteConfigError(
                f"store {self._safe_url} keeps its blocks in {bound!r}, not {identity!r}: every worker of "
                "one database must use the same bucket and prefix (blocks=s3://...)"
            )

    def now(self) -> float:
        """Postgres's clock (seconds since the epoch)."""
        return self._run(
            "read the clock", lambda c: float(c.execute("SELECT extract(epoch FROM now())").fetchone()[0])
        )

    # ------------------------------------------------------------------ records

    def get(self, fp: str, agent_id: str) -> tuple[str, int] | None:
        def read(c: Any) -> tuple[str, int] | None:
            row = c.execute(
                "SELECT record, version FROM am_agents WHERE fingerprint = %s AND agent_id = %s",
                (fp, agent_id),
            ).fetchone()
            return (row[0], int(row[1])) if row else None

        return self._run("read an agent record", read)

    def has(self, fp: str, agent_id: str) -> bool:
        """Whether the agent has a record (without fetching it: the saver asks on every commit)."""
        return self._run(
            "look up an agent",
            lambda c: (
                c.execute(
                    "SELECT 1 FROM am_agents WHERE fingerprint = %s AND agent_id = %s", (fp, agent_id)
                ).fetchone()
                is not None
            ),
        )

    def begin(self, fp: str, agent_id: str, holder: str, ttl_s: float) -> tuple[bool, int | None]:
        """Take (or renew) the agent's lease for ``ttl_s`` unless another worker holds an
        unexpired one; return whether it was taken and the record's version (None: none),
        in one round trip."""

        def take(c: Any) -> tuple[bool, int | None]:
            row = c.execute(
                """
                WITH l AS (
                    INSERT INTO am_leases VALUES (%(fp)s, %(a)s, %(h)s, now() + %(ttl)s * interval '1 second')
                    ON CONFLICT (fingerprint, agent_id) DO UPDATE
                        SET holder = EXCLUDED.holder, expires_at = EXCLUDED.expires_at
                        WHERE am_leases.holder = EXCLUDED.holder OR am_leases.expires_at < now()
                    RETURNING 1
                )
                SELECT (SELECT count(*) FROM l),
                       (SELECT version FROM am_agents WHERE fingerprint = %(fp)s AND agent_id = %(a)s)
                """,
                {"fp": fp, "a": agent_id, "h": holder, "ttl": ttl_s},
            ).fetchone()
            return bool(row[0]), (int(row[1]) if row[1] is not None else None)

        return self._run("take a lease", take)

    def end(self, fp: str, agent_id: str, holder: str) -> None:
        """Give the lease back (if this worker holds it)."""
        self._run(
            "release a lease",
            lambda c: c.execute(
                "DELETE FROM am_leases WHERE fingerprint = %s AND agent_id = %s AND holder = %s",
                (fp, agent_id, holder),
            ),
        )

    def commit(
        self, fp: str, agent_id: str, record: Callable[[float], str], blocks: list[str],
        expected: int | None, holder: str, *, release: bool = True,
    ) -> Committed:  # fmt: skip
        """Store a record naming ``blocks`` if the stored version is still ``expected``
        (None: no record) and no other worker holds the agent's lease; ``record(now)``
        renders it with Postgres's clock; ``release``: delete the lease (False: another
        request of ``holder`` holds it). Raises ``CommitConflictError`` or
        ``BlockMissingError`` naming the blocks it lacks (nothing written)."""

        def write(c: Any) -> Committed:
            with c.transaction():
                now = float(c.execute("SELECT extract(epoch FROM now())").fetchone()[0])
                row = c.execute(
                    "SELECT version FROM am_agents WHERE fingerprint = %s AND agent_id = %s FOR UPDATE",
                    (fp, agent_id),
                ).fetchone()
                current = int(row[0]) if row else None
                if current != expected:
                    raise CommitConflictError(
                        f"agent {agent_id!r} is at version {current}, this save was based on {expected}"
                    )
                lease = c.execute(
                    "SELECT holder FROM am_leases WHERE fingerprint = %s AND agent_id = %s "
                    "AND expires_at >= now()",
                    (fp, agent_id),
                ).fetchone()
                if lease is not None and lease[0] != holder:
                    raise CommitConflictError(
                        f"agent {agent_id!r} is leased to another worker ({lease[0]})", leased=True
                    )
                wanted = sorted(set(blocks))
                touched = {
                    r[0]
                    for r in c.execute(
                        "UPDATE am_blocks SET touched_at = now() WHERE fingerprint = %s AND hash = ANY(%s) "
                        "AND stored RETURNING hash",
                        (fp, wanted),
                    )
                }
                if len(touched) != len(wanted):
                    missing = [h for h in wanted if h not in touched]
                    raise BlockMissingError(f"{len(missing)} blocks are not in the shared store", missing)
                version = (current or 0) + 1
                if current is None:  # a concurrent first save waits on this row, then fails
                    c.execute(
                        "INSERT INTO am_agents VALUES (%s, %s, %s, %s, to_timestamp(%s))",
                        (fp, agent_id, record(now), version, now),
                    )
                else:
                    c.execute(
                        "UPDATE am_agents SET record = %s, version = %s, updated_at = to_timestamp(%s) "
                        "WHERE fingerprint = %s AND agent_id = %s",
                        (record(now), version, now, fp, agent_id),
                    )
                c.execute("DELETE FROM am_refs WHERE fingerprint = %s AND agent_id = %s", (fp, agent_id))
                with c.cursor() as cur:
                    cur.executemany(
                        "INSERT INTO am_refs VALUES (%s, %s, %s, %s)",
                        [(fp, agent_id, i, h) for i, h in enumerate(blocks)],
                    )
                if release:
                    c.execute(
                        "DELETE FROM am_leases WHERE fingerprint = %s AND agent_id = %s AND holder = %s",
                        (fp, agent_id, holder),
                    )
                return Committed(version, now)

        try:
            return self._run("commit an agent record", write)
        except self.session.psycopg.errors.UniqueViolation as exc:  # two first saves of one agent
            raise CommitConflictError(f"agent {agent_id!r} was created by another worker meanwhile") from exc

    def delete(self, fp: str, agent_id: str) -> bool:
        def drop(c: Any) -> bool:
            with c.transaction():
                gone = c.execute(
                    "DELETE FROM am_agents WHERE fingerprint = %s AND agent_id = %s", (fp, agent_id)
                ).rowcount
                c.execute("DELETE FROM am_leases WHERE fingerprint = %s AND agent_id = %s", (fp, agent_id))
            return gone > 0

        return self._run("delete an agent record", drop)

    def agents(self, fp: str, prefix: str = "") -> list[tuple[str, str, int]]:
        """(agent id, record, version) of every agent whose id starts with ``prefix``."""

        def read(c: Any) -> list[tuple[str, str, int]]:
            rows = c.execute(
                "SELECT agent_id, record, version FROM am_agents WHERE fingerprint = %s "
                "AND left(agent_id, %s) = %s ORDER BY agent_id",
                (fp, len(prefix), prefix),
            ).fetchall()
            return [(r[0], r[1], int(r[2])) for r in rows]

        return self._run("list agent records", read)

    def chain(self, fp: str, agent_id: str) -> list[str]:
        return self._run(
            "read block references",
            lambda c: [
                r[0]
                for r in c.execute(
                    "SELECT block FROM am_refs WHERE fingerprint = %s AND agent_id = %s ORDER BY pos",
                    (fp, agent_id),
                )
            ],
        )

    # ------------------------------------------------------------------ blocks

    def has_blocks(self, fp: str, hashes: list[str]) -> set[str]:
        """Which of ``hashes`` the store holds (uploaded)."""
        return self._run(
            "look up blocks",
            lambda c: {
                r[0]
                for r in c.execute(
                    "SELECT hash FROM am_blocks WHERE fingerprint = %s AND hash = ANY(%s) AND stored",
                    (fp, hashes),
                )
            },
        )

    def add_block(self, fp: str, h: str, nbytes: int) -> None:
        """Catalog a block before its object is written (an upload a crash interrupts is
        then collected like any other unreferenced block); ``stored`` follows the upload."""
        self._run(
            "catalog a block",
            lambda c: c.execute(
                "INSERT INTO am_blocks VALUES (%s, %s, %s, now(), false) "
                "ON CONFLICT (fingerprint, hash) DO UPDATE SET touched_at = now()",
                (fp, h, nbytes),
            ),
        )

    def block_stored(self, fp: str, hashes: list[str]) -> None:
        """Mark blocks whose objects are written (and touch them: a fresh grace period)."""
        self._run(
            "mark blocks stored",
            lambda c: c.execute(
                "UPDATE am_blocks SET stored = true, touched_at = now() "
                "WHERE fingerprint = %s AND hash = ANY(%s)",
                (fp, hashes),
            ),
        )

    def unstore(self, fp: str, hashes: list[str]) -> None:
        """Mark blocks whose objects are bad or gone: the next commit naming them uploads them."""
        self._run(
            "mark blocks missing",
            lambda c: c.execute(
                "UPDATE am_blocks SET stored = false WHERE fingerprint = %s AND hash = ANY(%s)", (fp, hashes)
            ),
        )

    def collectable(self, fp: str, grace_s: float) -> list[str]:
        """Blocks no record names, untouched for ``grace_s`` (candidates: ``collect`` checks again)."""
        return self._run(
            "find unreferenced blocks",
            lambda c: [
                r[0]
                for r in c.execute(
                    """
                    SELECT b.hash FROM am_blocks b
                    WHERE b.fingerprint = %s AND b.touched_at < now() - %s * interval '1 second'
                      AND NOT EXISTS (
                          SELECT 1 FROM am_refs r WHERE r.fingerprint = b.fingerprint AND r.block = b.hash
                      )
                    """,
                    (fp, grace_s),
                )
            ],
        )

    def collect(self, fp: str, h: str, grace_s: float, delete_object: Callable[[], None]) -> bool:
        """Delete block ``h`` if no record names it and it is older than the grace period;
        False if it was kept. Two transactions, so that a collector killed at any point
        leaves no row saying ``stored`` of an object that is gone:

        1. under the row's lock: still unnamed and old, so mark it not stored (committed:
           ``has_blocks`` and a commit's check no longer trust it; a writer that needs it
           uploads it again);
        2. under the row's lock again: still not stored (no writer put it back meanwhile)
           and still old: delete the object, then the row. Killed in between, the row stays
           not stored, and the next collection finishes it."""

        def mark(c: Any) -> bool:
            with c.transaction():
                row = c.execute(
                    """
                    SELECT 1 FROM am_blocks b
                    WHERE b.fingerprint = %s AND b.hash = %s
                      AND b.touched_at < now() - %s * interval '1 second'
                    FOR UPDATE SKIP LOCKED
                    """,
                    (fp, h, grace_s),
                ).fetchone()
                # The row is locked: a commit naming it waits, then finds it not stored.
                if row is None or self._named(c, fp, h):
                    return False
                c.execute("UPDATE am_blocks SET stored = false WHERE fingerprint = %s AND hash = %s", (fp, h))
                return True

        def drop(c: Any) -> bool:
            with c.transaction():
                row = c.execute(
                    """
                    SELECT stored FROM am_blocks
                    WHERE fingerprint = %s AND hash = %s AND touched_at < now() - %s * interval '1 second'
                    FOR UPDATE
                    """,
                    (fp, h, grace_s),
                ).fetchone()
                if row is None or row[0] or self._named(c, fp, h):
                    return False  # gone, put back by a writer, or touched since
                delete_object()
                c.execute("DELETE FROM am_blocks WHERE fingerprint = %s AND hash = %s", (fp, h))
                return True

        return self._run("mark a block for collection", mark) and self._run("collect a block", drop)

    @staticmethod
    def _named(c: Any, fp: str, h: str) -> bool:
        row = c.execute("SELECT 1 FROM am_refs WHERE fingerprint = %s AND block = %s LIMIT 1", (fp, h))
        return row.fetchone() is not None

    def dangling(self, fp: str) -> int:
        """References to blocks the store does not hold (0 in a consistent store), counted
        in one snapshot."""
        return self._run(
            "check block references",
            lambda c: int(
                c.execute(
                    "SELECT count(*) FROM am_refs r WHERE r.fingerprint = %s AND NOT EXISTS (SELECT 1 "
                    "FROM am_blocks b WHERE b.fingerprint = r.fingerprint AND b.hash = r.block AND b.stored)",
                    (fp,),
                ).fetchone()[0]
            ),
        )

    def stored_blocks(self, fp: str) -> set[str]:
        """Blocks the catalog says have their object written."""
        return self._run(
            "list stored blocks",
            lambda c: {
                r[0] for r in c.execute("SELECT hash FROM am_blocks WHERE fingerprint = %s AND stored", (fp,))
            },
        )

    def fingerprints(self) -> set[str]:
        """The models (store fingerprints) with records here."""
        return self._run(
            "list models", lambda c: {r[0] for r in c.execute("SELECT DISTINCT fingerprint FROM am_agents")}
        )

    def cataloged(self, fp: str) -> set[str]:
        return self._run(
            "list the block catalog",
            lambda c: {r[0] for r in c.execute("SELECT hash FROM am_blocks WHERE fingerprint = %s", (fp,))},
        )
