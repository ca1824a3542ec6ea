"""Persistent storage of KV blocks and agent records.

Layout under the root directory, one subfolder per model fingerprint (caches of different
models, or of other KV quantizations, never mix)::

    <root>/<fingerprint>/format.json                  {"format_version": 1, "fingerprint": ...}
    <root>/<fingerprint>/blocks/<h[:2]>/<h>.safetensors
    <root>/<fingerprint>/index.sqlite                 agent records and their block references
    <root>/<fingerprint>/lock                         the directory lock (flock) for mutations
    <root>/<fingerprint>/quarantine/                  bad block files, moved aside for inspection

A block file holds the KV tensors of up to 256 tokens for every layer, named
``L{layer}.{k|v}.{q|scales|biases}`` (quantized) or ``L{layer}.{k|v}`` (16-bit), and a
header with the format version, fingerprint, parent hash, token ids and a SHA-256 of the
tensor bytes. Blocks are content-addressed (``block_hash``) and immutable: writing one
that exists is a no-op. Every write is atomic (temp file, fsync, rename, fsync of the
directory; SQLite transactions for the index): a crash leaves the old file or the new
one, never a torn one, and a record is written only after all of its blocks.

Agent ids are keys in the index, never paths, so no id can name a file; ids are still
validated (``validate_agent_id``) so that mistakes surface early. Several processes may
share a directory: mutations run under its lock (``DiskBlockStore.locked``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Collection, Iterable, Iterator, Sequence
from pathlib import Path

from safetensors import serialize_file

from ..ops.files import TEMP_PREFIX, DirectoryLock, atomic_write, atomic_write_bytes
from .blocks import (
    FORMAT_VERSION,
    STATES_FORMAT_VERSION,
    AgentRecord,
    Block,
    BlockHash,
    BlockMissingError,
    CacheFormatError,
    NewerFormatError,
    block_hash,
    block_lineage,
    host_views,
    parse_record,
    raise_if_vanished,
    validate_agent_id,
    version_error,
)
from .index import INDEX_SCHEMA_VERSION, RecoveryReport, migrate_index
from .maintenance import DiskMaintenance, _int_or
from .reader import (
    BlockFileError,
    BlockGroup,
    BlockHeader,
    Layouts,
    block_checksums,
    read_groups,
    read_header,
    select,
)

logger = logging.getLogger(__name__)


class DiskBlockStore(DiskMaintenance):
    """Blocks as safetensors files, agent records in a SQLite index, under one directory.

    The index (``index.sqlite``) holds each agent's record and its block references, so
    that which blocks are still needed is known across processes (no in-memory count can
    be: another process may have committed or deleted since). On open, ``recover`` undoes
    what a killed process may have left: temporary files, and blocks written for a record
    it never committed (or left behind by a delete it did not finish).
    """

    def __init__(
        self, root: str | os.PathLike[str], fingerprint: str, *, tier: bool = False, read_only: bool = False
    ) -> None:
        #: The local tier of a shared store: its records may name blocks not fetched yet.
        self.tier = tier
        self.fingerprint = fingerprint
        self.dir = Path(root) / fingerprint
        self.blocks_dir = self.dir / "blocks"
        if read_only:  # for looking (``cache ls``/``du``): no lock, no migration, no recovery
            self._open_read_only()
            return
        self.blocks_dir.mkdir(parents=True, exist_ok=True)
        self._lock = DirectoryLock(self.dir / "lock")
        with self._lock:
            fmt = self.dir / "format.json"
            if fmt.exists():
                try:
                    version = json.loads(fmt.read_text()).get("format_version")
                except (ValueError, AttributeError) as exc:  # bad JSON or UTF-8, not an object
                    raise CacheFormatError(
                        f"{fmt} is corrupt ({exc}); move the directory {self.dir} aside to start afresh"
                    ) from exc
                if version != FORMAT_VERSION:
                    raise version_error(f"cache directory {self.dir}", version)
            else:
                meta = {"format_version": FORMAT_VERSION, "fingerprint": fingerprint}
                atomic_write_bytes(fmt, json.dumps(meta).encode())
            self._db = sqlite3.connect(str(self.dir / "index.sqlite"), check_same_thread=False, timeout=60)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")  # a committed record survives power loss
            migrate_index(self._db, self.dir / "index.sqlite")
            self._schema = INDEX_SCHEMA_VERSION
            self._db_lock = threading.RLock()
            self.recovery = self.recover()

    def _open_read_only(self) -> None:
        """Open an existing directory without changing anything in it: its index read-only
        (a write raises ``sqlite3.OperationalError``), no recovery (``recovery`` is empty)."""
        fmt = self.dir / "format.json"
        try:
            version = json.loads(fmt.read_text()).get("format_version")
        except (OSError, ValueError, AttributeError) as exc:
            raise CacheFormatError(f"{self.dir} is not a readable cache directory ({exc})") from exc
        if version != FORMAT_VERSION:
            raise version_error(f"cache directory {self.dir}", version)
        index = (self.dir / "index.sqlite").resolve()
        self._db = sqlite3.connect(f"file:{index}?mode=ro", uri=True, check_same_thread=False, timeout=60)
        found = int(self._db.execute("PRAGMA user_version").fetchone()[0])
        if found > INDEX_SCHEMA_VERSION:
            raise NewerFormatError(f"{index} has index schema {found}, written by a newer version: upgrade")
        self._schema = found
        self._db_lock = threading.RLock()
        self._lock = DirectoryLock(self.dir / "lock")  # never taken by a reader
        self.recovery = RecoveryReport()

    def locked(self) -> DirectoryLock:
        """Hold the directory's exclusive lock (re-entrant in this thread)."""
        return self._lock

    def begin(self, agent_id: str, version: int | None) -> bool:
        """A request for the agent starts: whether a live copy of it at ``version`` may be
        used (here always: one directory has one writer at a time; a shared store takes a
        lease and compares versions)."""
        return True

    def seen_version(self, agent_id: str) -> int | None:
        """The shared store's version of the agent this process last read or wrote (None here)."""
        return None

    def end(self, agent_id: str) -> None:
        """A request for the agent ended without a commit (a shared store's lease)."""

    def close(self) -> None:
        with self._db_lock:
            self._db.close()

    # ------------------------------------------------------------------ blocks

    def block_path(self, h: BlockHash) -> Path:
        if len(h) != 64 or any(c not in "0123456789abcdef" for c in h):
            raise ValueError(f"not a block hash: {h!r}")
        return self.blocks_dir / h[:2] / f"{h}.safetensors"

    def has_block(self, h: BlockHash) -> bool:
        return self.block_path(h).exists()

    def has_local_block(self, h: BlockHash) -> bool:
        """Whether the block's file is in this directory (no round trip to anything)."""
        return self.has_block(h)

    def local_bytes(self, hashes: Iterable[BlockHash]) -> int:
        """Bytes of these blocks' files in this directory (those missing count nothing)."""
        total = 0
        for h in hashes:
            with contextlib.suppress(FileNotFoundError):
                total += self.block_path(h).stat().st_size
        return total

    def put_block(self, block: Block) -> int:
        """Write ``block`` unless it exists; return the bytes written (0 if it existed)."""
        path = self.block_path(block.hash)
        if path.exists():
            return 0
        tensors = {k: t.packed() for k, t in (block.host or host_views(block.tensors)).items()}
        whole, parts = block_checksums([(k, t.data) for k, t in tensors.items()])
        meta = {
            "format_version": str(FORMAT_VERSION),
            "fingerprint": self.fingerprint,
            "hash": block.hash,
            "parent": block.parent or "",
            "token_ids": json.dumps(block.token_ids),
            "checksum": whole,
            # Each layer's own, for reads of some layers only (``reader.select``); an older
            # reader ignores it and checks the whole.
            "part_checksums": json.dumps(parts, separators=(",", ":")),
        }
        # safetensors' own writer over host arrays: no MLX op, so any thread may write.
        specs = {k: t.spec() for k, t in tensors.items()}
        return atomic_write(path, lambda tmp: serialize_file(specs, tmp, metadata=meta))

    def get_block(self, h: BlockHash, names: Sequence[str] | None = None) -> Block:
        """Read a block (all tensors, or only ``names``), verified against its header.

        Raises ``BlockMissingError`` or ``CacheFormatError`` (corrupt, truncated, another
        model's, a newer format); never returns unverified data.
        """
        (group,) = self.read_blocks([h])
        header = group.headers[0]
        wanted = group.names() if names is None else list(names)
        missing = [k for k in wanted if k not in group.names()]
        if missing:
            raise CacheFormatError(f"block file {header.path} lacks tensors {missing[:3]}")
        token_ids, parent = block_lineage(header)
        return Block(h, parent, token_ids, {k: group.tensor(k) for k in wanted})

    def read_blocks(
        self, hashes: Sequence[BlockHash], layers: Collection[int] | None = None
    ) -> list[BlockGroup]:
        """The blocks ``hashes`` (in order), verified, as groups of consecutive blocks of one
        tensor layout, each uploaded to the device as one array (``reader``). ``layers``: only
        these layers' tensors are needed (read alone where every block has per-layer
        checksums; blocks written before them are read whole)."""
        headers = []
        layouts: Layouts = {}
        for h in hashes:
            path = self.block_path(h)
            if not path.exists():
                raise BlockMissingError(f"block {h[:12]} is missing from {self.blocks_dir}")
            try:
                header = read_header(path, layouts)
            except BlockFileError as exc:
                raise_if_vanished(exc, path)
                raise CacheFormatError(
                    f"block file {path} is unreadable (truncated or corrupt): {exc}"
                ) from None
            self._check_header(h, header)
            headers.append(header)

        if layers is not None and all("part_checksums" in hd.meta for hd in headers):
            wanted = {f"L{i}" for i in layers}
            headers = [select(hd, wanted) for hd in headers]

        def verify(header: BlockHeader, got: str | dict[str, str]) -> None:
            if isinstance(got, dict):
                try:
                    stored = json.loads(header.meta["part_checksums"])
                except (KeyError, ValueError) as exc:
                    raise CacheFormatError(f"block file {header.path} has corrupt part checksums") from exc
                sound = isinstance(stored, dict) and all(stored.get(k) == v for k, v in got.items())
            else:
                sound = got == header.meta.get("checksum")
            if not sound:
                raise CacheFormatError(f"block file {header.path} failed its checksum: the data is corrupt")

        try:
            return read_groups(headers, verify)
        except BlockFileError as exc:
            raise_if_vanished(exc, self.blocks_dir)
            raise CacheFormatError(f"a block file is unreadable (truncated or corrupt): {exc}") from exc

    def _check_header(self, h: BlockHash, header: BlockHeader) -> None:
        meta, path = header.meta, header.path
        version = meta.get("format_version")
        if version != str(FORMAT_VERSION):
            raise version_error(f"block {path.name}", _int_or(version))
        if meta.get("fingerprint") != self.fingerprint:
            raise CacheFormatError(
                f"block {path.name} was written for model/quantization {meta.get('fingerprint')!r}, "
                f"not {self.fingerprint!r}: it belongs to another model"
            )
        if meta.get("hash") != h:
            raise CacheFormatError(f"block file {path.name} holds block {meta.get('hash')!r}")
        token_ids, parent = block_lineage(header)
        if block_hash(parent, token_ids, self.fingerprint) != h:
            raise CacheFormatError(f"block file {path} header does not match its hash")

    def delete_block(self, h: BlockHash) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.block_path(h).unlink()

    def block_hashes(self) -> Iterator[BlockHash]:
        for p in self.blocks_dir.glob("*/*.safetensors"):
            if not p.name.startswith(TEMP_PREFIX):
                yield BlockHash(p.stem)

    def quarantine_block(self, h: BlockHash) -> Path | None:
        """Move a bad block file aside (kept for inspection, never read again)."""
        src = self.block_path(h)
        if not src.exists():
            return None
        dst = self.dir / "quarantine" / f"{h}.{time.time_ns()}.safetensors"
        dst.parent.mkdir(exist_ok=True)
        os.replace(src, dst)
        return dst

    def quarantine_agent(self, agent_id: str) -> Path | None:
        """Move an unreadable record out of the index into ``quarantine/`` (its blocks stay:
        the next save of the agent reuses those that are sound)."""
        validate_agent_id(agent_id)
        with self._lock:
            with self._db_lock:
                row = self._db.execute("SELECT record FROM agents WHERE agent_id = ?", (agent_id,)).fetchone()
            if row is None:
                return None
            name = hashlib.sha256(agent_id.encode()).hexdigest()[:32]
            dst = self.dir / "quarantine" / f"agent-{name}.{time.time_ns()}.json"
            dst.parent.mkdir(exist_ok=True)
            atomic_write_bytes(dst, row[0].encode())
            with self._db_lock, self._db:
                self._db.execute("DELETE FROM agents WHERE agent_id = ?", (agent_id,))
            return dst

    # ------------------------------------------------------------------ agents

    def put_agent(self, record: AgentRecord, sync: tuple[int | None, bool] | None = None) -> int:
        """Store ``record`` and its block references in one transaction; its blocks must
        already be stored (a crash then never leaves a record naming a missing block).
        ``sync``: (remote version, pending) of a shared store's local tier, written with it."""
        validate_agent_id(record.agent_id)
        data = record.to_json()
        refs = [(record.agent_id, i, h) for i, h in enumerate(record.blocks)]
        with self._db_lock, self._db:
            self._db.execute(
                "INSERT OR REPLACE INTO agents (agent_id, record, used_at) VALUES (?, ?, ?)",
                (record.agent_id, data, record.updated_at),
            )
            self._db.execute("DELETE FROM refs WHERE agent_id = ?", (record.agent_id,))
            self._db.executemany("INSERT INTO refs VALUES (?, ?, ?)", refs)
            self._note_sizes(record.blocks)
            if sync is not None:
                self._db.execute(
                    "INSERT OR REPLACE INTO remote_sync VALUES (?, ?, ?)",
                    (record.agent_id, sync[0], int(sync[1])),
                )
        return len(data.encode())

    def sync_state(self, agent_id: str) -> tuple[int | None, bool] | None:
        """(remote version, pending) of a local record of a shared store; None if unknown."""
        with self._db_lock:
            row = self._db.execute(
                "SELECT version, pending FROM remote_sync WHERE agent_id = ?", (agent_id,)
            ).fetchone()
        return (row[0], bool(row[1])) if row else None

    def set_sync(self, agent_id: str, version: int | None, pending: bool) -> None:
        with self._db_lock, self._db:
            self._db.execute(
                "INSERT OR REPLACE INTO remote_sync VALUES (?, ?, ?)", (agent_id, version, int(pending))
            )

    def pending_agents(self) -> list[str]:
        """Agents saved here while the shared store was unreachable, oldest first."""
        with self._db_lock:
            return [
                r[0]
                for r in self._db.execute("SELECT agent_id FROM remote_sync WHERE pending = 1 ORDER BY rowid")
            ]

    def upload_pending(self, agent_id: str) -> bool:
        """Whether the agent's record waits to be uploaded to a shared store (this tier's)."""
        state = self.sync_state(agent_id)
        return bool(state and state[1])

    def has_agent(self, agent_id: str) -> bool:
        validate_agent_id(agent_id)
        with self._db_lock:
            return (
                self._db.execute("SELECT 1 FROM agents WHERE agent_id = ?", (agent_id,)).fetchone()
                is not None
            )

    def agent_chain(self, agent_id: str) -> list[BlockHash]:
        """The blocks the agent's record names, read from its references (the record itself,
        which holds every token id, is not parsed); ``NewerFormatError`` for a record of a
        newer version (never overwritten or deleted by this one); [] when there is none."""
        validate_agent_id(agent_id)
        with self._db_lock:
            try:
                row = self._db.execute(
                    "SELECT json_extract(record, '$.format_version') FROM agents WHERE agent_id = ?",
                    (agent_id,),
                ).fetchone()
            except sqlite3.OperationalError:  # malformed JSON: its references still count
                row = None
            rows = self._db.execute(
                "SELECT block FROM refs WHERE agent_id = ? ORDER BY pos", (agent_id,)
            ).fetchall()
        version = row[0] if row else None
        if isinstance(version, int) and version > STATES_FORMAT_VERSION:
            raise version_error(f"agent record {agent_id!r}", version, STATES_FORMAT_VERSION)
        return [BlockHash(r[0]) for r in rows]

    def get_agent(self, agent_id: str) -> AgentRecord | None:
        validate_agent_id(agent_id)
        with self._db_lock:
            row = self._db.execute("SELECT record FROM agents WHERE agent_id = ?", (agent_id,)).fetchone()
        if row is None:
            return None
        record = parse_record(row[0], f"agent record {agent_id!r}")
        if record.agent_id != agent_id:
            raise CacheFormatError(f"agent record {agent_id!r} holds agent {record.agent_id!r}")
        return record

    def delete_agent(self, agent_id: str) -> bool:
        validate_agent_id(agent_id)
        with self._db_lock, self._db:
            gone = self._db.execute("DELETE FROM agents WHERE agent_id = ?", (agent_id,)).rowcount
            self._db.execute("DELETE FROM refs WHERE agent_id = ?", (agent_id,))
            self._db.execute("DELETE FROM remote_sync WHERE agent_id = ?", (agent_id,))
        return gone > 0

    def agents(self, prefix: str = "") -> Iterator[AgentRecord]:
        """Every record whose agent id starts with ``prefix`` (unreadable ones skipped, with
        a log line)."""
        with self._db_lock:
            rows = self._db.execute(
                "SELECT agent_id, record FROM agents WHERE substr(agent_id, 1, ?) = ? ORDER BY agent_id",
                (len(prefix), prefix),
            ).fetchall()
        for agent_id, raw in rows:
            try:
                yield parse_record(raw, f"agent record {agent_id!r}")
            except CacheFormatError as exc:
                logger.warning("skipping unreadable agent record: %s", exc)

    def is_referenced(self, h: BlockHash) -> bool:
        with self._db_lock:
            return self._db.execute("SELECT 1 FROM refs WHERE block = ? LIMIT 1", (h,)).fetchone() is not None

    def refcount(self, h: BlockHash) -> int:
        """How many agent records name block ``h``."""
        with self._db_lock:
            return self._db.execute(
                "SELECT COUNT(DISTINCT agent_id) FROM refs WHERE block = ?", (h,)
            ).fetchone()[0]

    def referenced_blocks(self) -> set[BlockHash]:
        with self._db_lock:
            return {BlockHash(r[0]) for r in self._db.execute("SELECT DISTINCT block FROM refs")}

    # ------------------------------------------------------------------ disk use
