"""The local store's upkeep (``DiskBlockStore`` inherits it): block sizes and bytes on disk,
least-recently-used order and eviction, quarantine, and recovery after a crash."""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..ops.files import TEMP_PREFIX, DirectoryLock
from .blocks import BlockHash, CacheFormatError, StoreUsage, parse_record
from .index import RecoveryReport

logger = logging.getLogger(__name__)


class DiskMaintenance:
    """The maintenance half of ``DiskBlockStore`` (its attributes are the store's)."""

    dir: Path
    blocks_dir: Path
    tier: bool
    _db: sqlite3.Connection
    _db_lock: threading.RLock
    _lock: DirectoryLock
    _schema: int

    def _note_sizes(self, blocks: Sequence[BlockHash]) -> None:
        """Record the file sizes of ``blocks`` not known yet (those on this disk), in the
        caller's transaction. Rows of deleted blocks stay until ``evict_agents`` or recovery:
        usage counts only blocks some record names (a block is deleted when none does)."""
        wanted = list(dict.fromkeys(blocks))
        known: set[str] = set()
        for i in range(0, len(wanted), 500):
            part = wanted[i : i + 500]
            query = f"SELECT block FROM block_sizes WHERE block IN ({','.join('?' * len(part))})"
            known.update(r[0] for r in self._db.execute(query, part))
        rows = []
        for h in wanted:
            if h not in known:
                with contextlib.suppress(FileNotFoundError):  # a local tier's block not fetched yet
                    rows.append((h, self.block_path(h).stat().st_size))
        self._db.executemany("INSERT OR REPLACE INTO block_sizes VALUES (?, ?)", rows)

    def note_blocks(self, blocks: Sequence[BlockHash]) -> None:
        """Blocks that arrived on this disk without a save (a shared store's fetch)."""
        with self._db_lock, self._db:
            self._note_sizes(blocks)

    def _fixed_bytes(self) -> tuple[int, int]:
        """(the directory's own files: index with its journal, format; quarantined files) in bytes."""
        index = sum(_size_of(p) for p in self.dir.iterdir() if p.is_file())
        quarantine = self.dir / "quarantine"
        bad = sum(_size_of(p) for p in quarantine.iterdir()) if quarantine.is_dir() else 0
        return index, bad

    def disk_bytes(self) -> int:
        """Bytes this store holds on disk: the blocks its records name, its index and the
        quarantine (one query: the sizes are recorded as blocks are saved)."""
        if self._schema < 3:  # an older index opened read-only: look at the files
            return self.usage().total
        with self._db_lock:
            (blocks,) = self._db.execute(
                "SELECT coalesce(sum(nbytes), 0) FROM block_sizes b "
                "WHERE EXISTS (SELECT 1 FROM refs r WHERE r.block = b.block)"
            ).fetchone()
        return int(blocks) + sum(self._fixed_bytes())

    def oldest_use(self) -> float | None:
        """The last use of the least recently used agent (None: no agent)."""
        used = "used_at" if self._schema >= 3 else "json_extract(record, '$.updated_at')"
        with self._db_lock:
            (oldest,) = self._db.execute(f"SELECT min({used}) FROM agents").fetchone()
        return None if oldest is None else float(oldest)

    def usage(self) -> StoreUsage:
        """Every agent with its last use (least recent first), the blocks it names and their
        sizes: what ``budget.enforce`` plans with."""
        used = "used_at" if self._schema >= 3 else "json_extract(record, '$.updated_at')"
        with self._db_lock:
            agents = [
                (a, float(t or 0))
                for a, t in self._db.execute(f"SELECT agent_id, {used} FROM agents ORDER BY 2, 1")
            ]
            refs: dict[str, set[BlockHash]] = {}
            for agent, block in self._db.execute("SELECT agent_id, block FROM refs"):
                refs.setdefault(agent, set()).add(BlockHash(block))
            known = (
                dict(self._db.execute("SELECT block, nbytes FROM block_sizes")) if self._schema >= 3 else {}
            )
        named = set().union(*refs.values()) if refs else set()
        sizes = {}
        for h in named:
            size = known.get(h)
            if size is None:
                size = _size_of(self.block_path(h))
            if size:
                sizes[h] = int(size)
        index, bad = self._fixed_bytes()
        return StoreUsage(self.fingerprint, agents, refs, sizes, index, bad)

    def pinned(self) -> set[str]:
        """Agents eviction must keep whatever their age (a shared store's local tier keeps
        saves not uploaded yet); none here."""
        return set()

    def evict_agents(self, agent_ids: Sequence[str]) -> tuple[int, list[BlockHash]]:
        """Delete these agents' records and the blocks no remaining record names, under the
        directory lock; return the bytes freed and the blocks deleted."""
        with self._lock:
            with self._db_lock, self._db:
                chains = set()
                for agent in agent_ids:
                    chains.update(
                        r[0] for r in self._db.execute("SELECT block FROM refs WHERE agent_id = ?", (agent,))
                    )
                    self._db.execute("DELETE FROM agents WHERE agent_id = ?", (agent,))
                    self._db.execute("DELETE FROM refs WHERE agent_id = ?", (agent,))
                    self._db.execute("DELETE FROM remote_sync WHERE agent_id = ?", (agent,))
            freed, deleted = 0, []
            for h in sorted(chains):
                if not self.is_referenced(BlockHash(h)):
                    freed += _size_of(self.block_path(BlockHash(h)))
                    self.delete_block(BlockHash(h))
                    deleted.append(BlockHash(h))
            self._forget_sizes()
        return freed, deleted

    def _forget_sizes(self) -> None:
        """Drop the size rows of blocks no record names (their files are gone or going)."""
        with self._db_lock, self._db:
            self._db.execute(
                "DELETE FROM block_sizes WHERE NOT EXISTS "
                "(SELECT 1 FROM refs r WHERE r.block = block_sizes.block)"
            )

    def clear_quarantine(self) -> int:
        """Delete quarantined files (kept for inspection until a budget needs the space)."""
        quarantine, freed = self.dir / "quarantine", 0
        if quarantine.is_dir():
            for p in quarantine.iterdir():
                freed += _size_of(p)
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
        return freed

    # ------------------------------------------------------------------ recovery

    def recover(self) -> RecoveryReport:
        """Bring the directory back to a consistent state after a crash: remove temporary
        files, move records of the previous layout (one JSON file per agent) into the
        index, and delete block files no record names. Runs on open, under the lock, so
        no live writer's files are touched."""
        report = RecoveryReport()
        with self._lock:
            for tmp in [*self.blocks_dir.glob(f"*/{TEMP_PREFIX}*"), *self.dir.glob(f"{TEMP_PREFIX}*.tmp")]:
                with contextlib.suppress(FileNotFoundError):
                    tmp.unlink()
                    report.temp_files_removed += 1
            report.records_migrated = self._migrate_json_records()
            with self._db_lock, self._db:  # references of quarantined records
                self._db.execute("DELETE FROM refs WHERE agent_id NOT IN (SELECT agent_id FROM agents)")
            referenced = self.referenced_blocks()
            for h in list(self.block_hashes()):
                if h not in referenced:
                    self.delete_block(h)
                    report.orphan_blocks_removed += 1
            report.missing_blocks = sum(1 for h in referenced if not self.has_block(h))
            self.note_blocks(sorted(referenced))  # sizes of blocks saved before they were kept
            self._forget_sizes()
        if report.temp_files_removed or report.orphan_blocks_removed:
            logger.info(
                "cache %s: removed %d temporary files and %d unreferenced blocks left by an interrupted save",
                self.dir,
                report.temp_files_removed,
                report.orphan_blocks_removed,
            )
        if report.missing_blocks and not self.tier:
            logger.warning(
                "cache %s: %d blocks named by agent records are missing (deleted outside this "
                "package?); those agents will prefill again",
                self.dir,
                report.missing_blocks,
            )
        return report

    def _migrate_json_records(self) -> int:
        legacy = self.dir / "agents"
        if not legacy.is_dir():
            return 0
        moved = 0
        for p in sorted(legacy.glob("*.json")):
            try:
                record = parse_record(p.read_text(), f"agent record {p}")
            except CacheFormatError as exc:
                logger.warning("not migrating %s: %s", p, exc)
                continue
            if not self.has_agent(record.agent_id):
                self.put_agent(record)
                moved += 1
            p.unlink()
        with contextlib.suppress(OSError):
            legacy.rmdir()
        return moved


def _size_of(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _int_or(value: Any) -> Any:
    try:
        return int(value)
    except (TypeError, ValueError):
        return value
