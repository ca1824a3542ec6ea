"""The local store's SQLite index: its schema as migrations (``INDEX_MIGRATIONS``), applied in
order when a directory is opened, and what recovery after a crash reports."""

from __future__ import annotations

import logging
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from .blocks import NewerFormatError

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
    """What ``DiskBlockStore.recover`` found and fixed when the store was opened."""

    temp_files_removed: int = 0
    orphan_blocks_removed: int = 0
    missing_blocks: int = 0
    records_migrated: int = 0
