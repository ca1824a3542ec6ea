"""The upkeep of this worker's disk (``DiskBlockStore`` holds it as ``maintenance``; a shared
store's is its local tier's): bytes on disk, least-recently-used order and eviction,
quarantined records and their clearing, and recovery after a crash. The one
implementation of ``protocols.Maintenance``."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ..ops.files import TEMP_PREFIX, DirectoryLock, atomic_write_bytes
from .agent_ids import validate_agent_id
from .block_files import BlockFiles
from .blocks import BlockHash, CacheFormatError, StoreUsage, parse_record
from .index import AgentIndex, RecoveryReport

logger = logging.getLogger(__name__)


class DiskMaintenance:
    """Upkeep of the cache directory ``directory``: its block ``files`` and its ``index``;
    mutations run under its ``lock``. ``tier``: the local tier of a shared store (its
    records may name blocks not fetched yet)."""

    def __init__(
        self, directory: Path, files: BlockFiles, index: AgentIndex, lock: DirectoryLock, *, tier: bool
    ) -> None:
        self.dir, self.files, self.index, self.lock, self.tier = directory, files, index, lock, tier
        #: told of each agent evicted here before its record goes (a shared store's records
        #: forget this worker's copy: ``SharedRecords.forget``); None: nothing to tell
        self.on_evict: Callable[[str], None] | None = None

    def _fixed_bytes(self) -> tuple[int, int]:
        """(the directory's own files: index with its journal, format; quarantined files) in bytes."""
        index = sum(_size_of(p) for p in self.dir.iterdir() if p.is_file())
        quarantine = self.files.quarantine_dir
        bad = sum(_size_of(p) for p in quarantine.iterdir()) if quarantine.is_dir() else 0
        return index, bad

    def disk_bytes(self) -> int:
        """Bytes this store holds on disk: the blocks its records name, its index and the
        quarantine (one query: the sizes are recorded as blocks are saved)."""
        if self.index.schema < 3:  # an older index opened read-only: look at the files
            return self.usage().total
        (blocks,) = self.index.db.execute(
            "SELECT coalesce(sum(nbytes), 0) FROM block_sizes b "
            "WHERE EXISTS (SELECT 1 FROM refs r WHERE r.block = b.block)"
        ).fetchone()
        return int(blocks) + sum(self._fixed_bytes())

    def oldest_use(self) -> float | None:
        """The last use of the least recently used agent (None: no agent)."""
        used = "used_at" if self.index.schema >= 3 else "json_extract(record, '$.updated_at')"
        (oldest,) = self.index.db.execute(f"SELECT min({used}) FROM agents").fetchone()
        return None if oldest is None else float(oldest)

    def usage(self) -> StoreUsage:
        """Every agent with its last use (least recent first), the blocks it names and their
        sizes: what ``budget.enforce`` plans with."""
        used = "used_at" if self.index.schema >= 3 else "json_extract(record, '$.updated_at')"
        refs: dict[str, set[BlockHash]] = {}
        with self.index.reading() as db:  # the records and their references as of one moment
            agents = [
                (a, float(t or 0))
                for a, t in db.execute(f"SELECT agent_id, {used} FROM agents ORDER BY 2, 1")
            ]
            for agent, block in db.execute("SELECT agent_id, block FROM refs"):
                refs.setdefault(agent, set()).add(BlockHash(block))
            known = (
                dict(db.execute("SELECT block, nbytes FROM block_sizes")) if self.index.schema >= 3 else {}
            )
        named = set().union(*refs.values()) if refs else set()
        sizes = {}
        for h in named:
            size = known.get(h)
            if size is None:
                size = _size_of(self.files.path(h))
            if size:
                sizes[h] = int(size)
        index, bad = self._fixed_bytes()
        return StoreUsage(self.files.fingerprint, agents, refs, sizes, index, bad)

    def evict_agents(self, agent_ids: Sequence[str]) -> tuple[int, list[BlockHash]]:
        """Delete these agents' records and the blocks no remaining record names, under the
        directory lock; return the bytes freed and the blocks deleted. A shared store's
        local tier: this worker's copies only (the store keeps the agents; their next request
        reads them through, as on any other worker)."""
        for agent in agent_ids if self.on_evict is not None else ():
            self.on_evict(agent)
        with self.lock:
            with self.index.writing() as db:
                chains = set()
                for agent in agent_ids:
                    chains.update(
                        r[0] for r in db.execute("SELECT block FROM refs WHERE agent_id = ?", (agent,))
                    )
                    db.execute("DELETE FROM agents WHERE agent_id = ?", (agent,))
                    db.execute("DELETE FROM refs WHERE agent_id = ?", (agent,))
                    db.execute("DELETE FROM remote_sync WHERE agent_id = ?", (agent,))
            freed, deleted = 0, []
            for h in sorted(chains):
                if not self.index.is_referenced(BlockHash(h)):
                    freed += _size_of(self.files.path(BlockHash(h)))
                    self.files.delete(BlockHash(h))
                    deleted.append(BlockHash(h))
            self.index.forget_sizes()
        return freed, deleted

    def quarantine_agent(self, agent_id: str) -> Path | None:
        """Move an unreadable record out of the index into ``quarantine/`` (its blocks stay:
        the next save of the agent reuses those that are sound)."""
        validate_agent_id(agent_id)
        db = self.index.db
        with self.lock:
            row = db.execute("SELECT record FROM agents WHERE agent_id = ?", (agent_id,)).fetchone()
            if row is None:
                return None
            name = hashlib.sha256(agent_id.encode()).hexdigest()[:32]
            dst = self.files.quarantine_dir / f"agent-{name}.{time.time_ns()}.json"
            dst.parent.mkdir(exist_ok=True)
            atomic_write_bytes(dst, row[0].encode())
            with self.index.writing() as db:
                db.execute("DELETE FROM agents WHERE agent_id = ?", (agent_id,))
            return dst

    def clear_quarantine(self) -> int:
        """Delete quarantined files (kept for inspection until a budget needs the space)."""
        quarantine, freed = self.files.quarantine_dir, 0
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
        with self.lock:
            for tmp in [*self.files.dir.glob(f"*/{TEMP_PREFIX}*"), *self.dir.glob(f"{TEMP_PREFIX}*.tmp")]:
                with contextlib.suppress(FileNotFoundError):
                    tmp.unlink()
                    report.temp_files_removed += 1
            report.records_migrated = self._migrate_json_records()
            with self.index.db:  # references of quarantined records
                self.index.db.execute("DELETE FROM refs WHERE agent_id NOT IN (SELECT agent_id FROM agents)")
            referenced = self.index.referenced_blocks()
            for h in list(self.files.hashes()):
                if h not in referenced:
                    self.files.delete(h)
                    report.orphan_blocks_removed += 1
            report.missing_blocks = sum(1 for h in referenced if not self.files.has(h))
            self.index.note_blocks(sorted(referenced))  # sizes of blocks saved before they were kept
            self.index.forget_sizes()
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
            if not self.index.has(record.agent_id):
                self.index.put(record)
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
