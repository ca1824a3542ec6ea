"""The local store's SQLite index (a store's ``local.records``; a local store's ``records``
role, ``protocols.BlockStoreRecords``): its schema as migrations (``INDEX_MIGRATIONS``),
applied in order when a directory is opened; the index itself (``AgentIndex``: agent
records, their block references, a shared store's sync state, block sizes); and what
recovery after a crash reports."""

from __future__ import annotations

import contextlib
import logging
import queue
import sqlite3
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import CacheWriteError
from .agent_ids import validate_agent_id
from .block_files import BlockFiles
from .blocks import (
    SEGMENTS_FORMAT_VERSION,
    AgentRecord,
    BlockHash,
    CacheFormatError,
    NewerFormatError,
    parse_record,
    version_error,
)

logger = logging.getLogger(__name__)

#: The index's schema, as migrations: entry ``i`` takes ``PRAGMA user_version`` from ``i``
#: to ``i + 1`` (an index written before versioning reads as 0 and has version 1's tables:
#: ``IF NOT EXISTS`` makes that step a no-op there). Add a step; never edit one.
INDEX_MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE IF NOT EXISTS agents (
        agent_id TEXT PRIMARY KEY,
        record TEXT NOT NULL
    );
    CREATE TABLE IF NOT EXISTS refs (
        agent_id TEXT NOT NULL,
        pos INTEGER NOT NULL,
        block TEXT NOT NULL,
        PRIMARY KEY (agent_id, pos)
    );
    CREATE INDEX IF NOT EXISTS refs_block ON refs (block);
    """,
    # A local tier of a shared store: which remote version each local record is (or, when
    # ``pending``, was based on before this worker saved it while the store was unreachable).
    """
    CREATE TABLE IF NOT EXISTS remote_sync (
        agent_id TEXT PRIMARY KEY,
        version INTEGER,
        pending INTEGER NOT NULL DEFAULT 0
    );
    """,
    # Bounded storage (``budget``): each agent's last use, for least-recently-used eviction
    # (from its record's time until then), and each block file's size, so that the bytes on
    # disk are one query, not a stat of every file.
    """
    ALTER TABLE agents ADD COLUMN used_at REAL NOT NULL DEFAULT 0;
    UPDATE agents SET used_at = CASE WHEN json_valid(record)
        THEN coalesce(json_extract(record, '$.updated_at'), 0) ELSE 0 END;
    CREATE INDEX IF NOT EXISTS agents_used ON agents (used_at);
    CREATE TABLE IF NOT EXISTS block_sizes (
        block TEXT PRIMARY KEY,
        nbytes INTEGER NOT NULL
    );
    """,
)
INDEX_SCHEMA_VERSION = len(INDEX_MIGRATIONS)


def migrate_index(db: sqlite3.Connection, where: Path) -> int:
    """Bring the index to ``INDEX_SCHEMA_VERSION`` (each step in its own transaction);
    refuse an index written by a newer version. Returns the version it found."""
    found = int(db.execute("PRAGMA user_version").fetchone()[0])
    if found > INDEX_SCHEMA_VERSION:
        raise NewerFormatError(
            f"{where} has index schema {found}, written by a newer langchain-agent-memory; this "
            f"version reads schema {INDEX_SCHEMA_VERSION}: upgrade the package"
        )
    for version in range(found, INDEX_SCHEMA_VERSION):
        with db:  # a step and its version number commit together
            db.execute("BEGIN IMMEDIATE")
            for statement in INDEX_MIGRATIONS[version].split(";"):
                if statement.strip():
                    try:
                        db.execute(statement)
                    except sqlite3.OperationalError as exc:  # a column the index has already
                        if "duplicate column" not in str(exc):
                            raise
            db.execute(f"PRAGMA user_version = {version + 1}")
    return found


@dataclass(slots=True)
class RecoveryReport:
    """What ``DiskMaintenance.recover`` found and fixed when the store was opened."""

    temp_files_removed: int = 0
    orphan_blocks_removed: int = 0
    missing_blocks: int = 0
    records_migrated: int = 0


class AgentIndex:
    """Each agent's record and its block references, in one transaction per change, so
    that which blocks are still needed is known across processes (no in-memory count can
    be: another process may have committed or deleted since). Each thread uses a connection
    of its own (``db``): SQLite serializes the writes, as it does another process's, and in
    WAL mode a read never waits for a write (the engine's loop reads the index while the save
    thread commits and fsyncs); no lock of ours. ``schema``: the version the index has (an
    older one, opened read-only, lacks ``used_at`` and ``block_sizes``). ``files``: the
    blocks whose sizes it records."""

    def __init__(self, connect: Callable[[], sqlite3.Connection], schema: int, files: BlockFiles) -> None:
        self._connect, self.schema, self.files = connect, schema, files
        self._mine = threading.local()  # .db: this thread's connection
        #: every connection opened, for ``close`` (handed over, not shared)
        self._opened: queue.SimpleQueue[sqlite3.Connection] = queue.SimpleQueue()
        self._closed = False

    @property
    def db(self) -> sqlite3.Connection:
        """The calling thread's connection to the index (opened on its first use)."""
        db: sqlite3.Connection | None = getattr(self._mine, "db", None)
        if db is None:
            if self._closed:
                raise sqlite3.ProgrammingError("Cannot operate on a closed database.")
            db = self._mine.db = self._connect()
            self._opened.put(db)
        return db

    @contextlib.contextmanager
    def reading(self) -> Iterator[sqlite3.Connection]:
        """This thread's connection in a read transaction: its queries see one state of the
        index (a change another thread or process commits meanwhile is not seen in half)."""
        db = self.db
        if db.in_transaction:  # inside this thread's own transaction already
            yield db
            return
        db.execute("BEGIN")
        try:
            yield db
        finally:
            db.commit()

    @contextlib.contextmanager
    def writing(self) -> Iterator[sqlite3.Connection]:
        """This thread's connection in a write transaction, committed at the end (rolled back
        on an error). A disk that refuses the write (full, an I/O error) is a
        ``CacheWriteError`` that says what to do, as a refused block file is: nothing was
        changed, and the server answers it with 507, not as a bug."""
        db = self.db
        try:
            with db:
                yield db
        except sqlite3.OperationalError as exc:
            if getattr(exc, "sqlite_errorcode", 0) & 0xFF not in (sqlite3.SQLITE_FULL, sqlite3.SQLITE_IOERR):
                raise
            raise CacheWriteError(
                f"the cache index could not be written ({exc}): nothing was changed; free disk "
                "space (or fix the cache directory's permissions) and retry"
            ) from exc

    @classmethod
    def open(cls, path: Path, files: BlockFiles) -> AgentIndex:
        """Open (or create) the index at ``path`` and migrate it (under the directory lock)."""

        def connect() -> sqlite3.Connection:
            # Closed by ``close``, on its caller's thread: not checked to be this one.
            db = sqlite3.connect(str(path), check_same_thread=False, timeout=60)
            db.execute("PRAGMA synchronous=FULL")  # a committed record survives power loss
            return db

        index = cls(connect, INDEX_SCHEMA_VERSION, files)
        index.db.execute("PRAGMA journal_mode=WAL")  # the file's: every connection's after this
        migrate_index(index.db, path)
        return index

    @classmethod
    def open_read_only(cls, path: Path, files: BlockFiles) -> AgentIndex:
        """Open an existing index read-only (a write raises ``sqlite3.OperationalError``),
        at the schema it has."""
        index = path.resolve()

        def connect() -> sqlite3.Connection:
            return sqlite3.connect(f"file:{index}?mode=ro", uri=True, check_same_thread=False, timeout=60)

        db = connect()
        found = int(db.execute("PRAGMA user_version").fetchone()[0])
        db.close()
        if found > INDEX_SCHEMA_VERSION:
            raise NewerFormatError(f"{index} has index schema {found}, written by a newer version: upgrade")
        return cls(connect, found, files)

    def close(self) -> None:
        """Close every thread's connection (none may be in use: the store's threads have
        ended their work)."""
        self._closed = True
        while True:
            try:
                self._opened.get_nowait().close()
            except queue.Empty:
                return

    def put(self, record: AgentRecord, sync: tuple[int | None, bool] | None = None) -> int:
        """Store ``record`` and its block references in one transaction; its blocks must
        already be stored (a crash then never leaves a record naming a missing block).
        ``sync``: (remote version, pending) of a shared store's local tier, written with it."""
        validate_agent_id(record.agent_id)
        data = record.to_json()
        refs = [(record.agent_id, i, h) for i, h in enumerate(record.blocks)]
        with self.writing():
            self.db.execute(
                "INSERT OR REPLACE INTO agents (agent_id, record, used_at) VALUES (?, ?, ?)",
                (record.agent_id, data, record.updated_at),
            )
            self.db.execute("DELETE FROM refs WHERE agent_id = ?", (record.agent_id,))
            self.db.executemany("INSERT INTO refs VALUES (?, ?, ?)", refs)
            self.note_sizes(record.blocks)
            if sync is not None:
                self.db.execute(
                    "INSERT OR REPLACE INTO remote_sync VALUES (?, ?, ?)",
                    (record.agent_id, sync[0], int(sync[1])),
                )
        return len(data.encode())

    def sync_state(self, agent_id: str) -> tuple[int | None, bool] | None:
        """(remote version, pending) of a local record of a shared store; None if unknown."""
        row = self.db.execute(
            "SELECT version, pending FROM remote_sync WHERE agent_id = ?", (agent_id,)
        ).fetchone()
        return (row[0], bool(row[1])) if row else None

    def set_sync(self, agent_id: str, version: int | None, pending: bool) -> None:
        with self.writing():
            self.db.execute(
                "INSERT OR REPLACE INTO remote_sync VALUES (?, ?, ?)", (agent_id, version, int(pending))
            )

    def pending_agents(self) -> list[str]:
        """Agents saved here while the shared store was unreachable, oldest first."""
        return [
            r[0] for r in self.db.execute("SELECT agent_id FROM remote_sync WHERE pending = 1 ORDER BY rowid")
        ]

    def upload_pending(self, agent_id: str) -> bool:
        """Whether the agent's record waits to be uploaded to a shared store (this tier's)."""
        state = self.sync_state(agent_id)
        return bool(state and state[1])

    def has(self, agent_id: str) -> bool:
        validate_agent_id(agent_id)
        return self.db.execute("SELECT 1 FROM agents WHERE agent_id = ?", (agent_id,)).fetchone() is not None

    def agent_chain(self, agent_id: str) -> list[BlockHash]:
        """The blocks the agent's record names, read from its references (the record itself,
        which holds every token id, is not parsed); ``NewerFormatError`` for a record of a
        newer version (never overwritten or deleted by this one); [] when there is none."""
        validate_agent_id(agent_id)
        with self.reading() as db:
            try:
                row = db.execute(
                    "SELECT json_extract(record, '$.format_version') FROM agents WHERE agent_id = ?",
                    (agent_id,),
                ).fetchone()
            except sqlite3.OperationalError:  # malformed JSON: its references still count
                row = None
            rows = db.execute(
                "SELECT block FROM refs WHERE agent_id = ? ORDER BY pos", (agent_id,)
            ).fetchall()
        version = row[0] if row else None
        if isinstance(version, int) and version > SEGMENTS_FORMAT_VERSION:
            raise version_error(f"agent record {agent_id!r}", version, SEGMENTS_FORMAT_VERSION)
        return [BlockHash(r[0]) for r in rows]

    def get(self, agent_id: str) -> AgentRecord | None:
        validate_agent_id(agent_id)
        row = self.db.execute("SELECT record FROM agents WHERE agent_id = ?", (agent_id,)).fetchone()
        if row is None:
            return None
        record = parse_record(row[0], f"agent record {agent_id!r}")
        if record.agent_id != agent_id:
            raise CacheFormatError(f"agent record {agent_id!r} holds agent {record.agent_id!r}")
        return record

    def delete(self, agent_id: str) -> bool:
        validate_agent_id(agent_id)
        with self.writing():
            gone = self.db.execute("DELETE FROM agents WHERE agent_id = ?", (agent_id,)).rowcount
            self.db.execute("DELETE FROM refs WHERE agent_id = ?", (agent_id,))
            self.db.execute("DELETE FROM remote_sync WHERE agent_id = ?", (agent_id,))
        return gone > 0

    def list(self, prefix: str = "", *, warn: bool = True) -> Iterator[AgentRecord]:
        """Every record whose agent id starts with ``prefix`` (unreadable ones skipped, with
        a log line unless ``warn`` is off: the engine's prefix index, filled at open, leaves
        it to the agent's first request, which moves the record aside)."""
        rows = self.db.execute(
            "SELECT agent_id, record FROM agents WHERE substr(agent_id, 1, ?) = ? ORDER BY agent_id",
            (len(prefix), prefix),
        ).fetchall()
        for agent_id, raw in rows:
            try:
                yield parse_record(raw, f"agent record {agent_id!r}")
            except CacheFormatError as exc:
                if warn:
                    logger.warning("skipping unreadable agent record: %s", exc)

    def is_referenced(self, h: BlockHash) -> bool:
        return self.db.execute("SELECT 1 FROM refs WHERE block = ? LIMIT 1", (h,)).fetchone() is not None

    def refcount(self, h: BlockHash) -> int:
        """How many agent records name block ``h``."""
        row = self.db.execute("SELECT COUNT(DISTINCT agent_id) FROM refs WHERE block = ?", (h,)).fetchone()
        return int(row[0])

    def referenced_blocks(self) -> set[BlockHash]:
        return {BlockHash(r[0]) for r in self.db.execute("SELECT DISTINCT block FROM refs")}

    # ------------------------------------------------------------------ block sizes

    def note_sizes(self, blocks: Sequence[BlockHash]) -> None:
        """Record the file sizes of ``blocks`` not known yet (those on this disk), in the
        caller's transaction. Rows of deleted blocks stay until ``evict_agents`` or recovery:
        usage counts only blocks some record names (a block is deleted when none does)."""
        wanted = list(dict.fromkeys(blocks))
        known: set[str] = set()
        for i in range(0, len(wanted), 500):
            part = wanted[i : i + 500]
            query = f"SELECT block FROM block_sizes WHERE block IN ({','.join('?' * len(part))})"
            known.update(r[0] for r in self.db.execute(query, part))
        rows = []
        for h in wanted:
            if h not in known:
                with contextlib.suppress(FileNotFoundError):  # a local tier's block not fetched yet
                    rows.append((h, self.files.path(h).stat().st_size))
        self.db.executemany("INSERT OR REPLACE INTO block_sizes VALUES (?, ?)", rows)

    def note_blocks(self, blocks: Sequence[BlockHash]) -> None:
        """Blocks that arrived on this disk without a save (a shared store's fetch)."""
        with self.writing():
            self.note_sizes(blocks)

    def forget_sizes(self) -> None:
        """Drop the size rows of blocks no record names (their files are gone or going)."""
        with self.writing():
            self.db.execute(
                "DELETE FROM block_sizes WHERE NOT EXISTS "
                "(SELECT 1 FROM refs r WHERE r.block = block_sizes.block)"
            )
