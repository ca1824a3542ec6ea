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
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, NewType, Protocol, TypeVar

import numpy as np
from safetensors import TensorSpec, serialize_file

from ..ops.files import TEMP_PREFIX, DirectoryLock, atomic_write, atomic_write_bytes
from ..ops.runtime import mx
from .reader import (
    BlockFileError,
    BlockGroup,
    BlockHeader,
    Layouts,
    block_checksums,
    checksum,
    read_groups,
    read_header,
    select,
)

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
BLOCK_TOKENS = 256
MAX_AGENT_ID_CHARS = 256
_HASH_SEED = b"langchain-agent-memory/block/v1\x00"

BlockHash = NewType("BlockHash", str)


class CacheFormatError(ValueError):
    """A stored file cannot be used: corrupt, truncated, another model's, or a newer format."""


class NewerFormatError(CacheFormatError):
    """Written by a newer version of this package: refused, and never overwritten."""


class BlockMissingError(CacheFormatError):
    """A block an agent record refers to is not in the store."""


def _raise_if_vanished(exc: BlockFileError, where: Path) -> None:
    """A block file deleted by another process between finding it and reading it (a cleanup
    racing a load) is missing, not damaged: it must not be reported or treated as corrupt."""
    if isinstance(exc.__cause__, FileNotFoundError):
        raise BlockMissingError(f"a block file in {where} was deleted while read: {exc.__cause__}") from exc


class CacheWriteError(RuntimeError):
    """A cache could not be saved (disk full, permissions...); the previous one is intact."""


def block_hash(parent: BlockHash | None, token_ids: Sequence[int], fingerprint: str) -> BlockHash:
    """Chained content hash: the same tokens after the same prefix, for the same model,
    give the same hash in every process (no per-process seed)."""
    h = hashlib.sha256(_HASH_SEED)
    h.update((parent or "").encode())
    h.update(b"\x00" + fingerprint.encode() + b"\x00")
    h.update(np.asarray(token_ids, dtype="<u4").tobytes())
    return BlockHash(h.hexdigest())


def validate_agent_id(agent_id: str) -> str:
    """Return ``agent_id`` or raise ``ValueError`` saying what a valid id is."""
    if not isinstance(agent_id, str) or not agent_id:
        raise ValueError("agent_id must be a non-empty string, e.g. 'researcher' or 'thread-1:planner'")
    if len(agent_id) > MAX_AGENT_ID_CHARS:
        raise ValueError(f"agent_id is {len(agent_id)} characters; the limit is {MAX_AGENT_ID_CHARS}")
    bad = [c for c in agent_id if c in "/\\" or ord(c) < 32 or ord(c) == 127]
    if bad or agent_id.startswith("."):
        raise ValueError(
            f"agent_id {agent_id!r} looks like a path or holds control characters; "
            "use letters, digits and separators such as ':', '|', '-', '_' (no '/', '\\', NUL, leading '.')"
        )
    return agent_id


def _named_bytes(tensors: dict[str, Any]) -> list[tuple[str, Any]]:
    views = ((name, memoryview(a)) for name, a in tensors.items())
    return [(name, v if v.c_contiguous else v.tobytes()) for name, v in views]


@dataclass(frozen=True, slots=True)
class HostTensor:
    """An evaluated array's bytes as seen from the host: what a block write reads."""

    dtype: str  # mlx's name: "float16", "bfloat16", "uint32", ...
    shape: tuple[int, ...]
    #: uint8, a view of the array's memory shaped as the array (the last axis in bytes); it
    #: keeps the array alive
    data: np.ndarray

    def spec(self) -> TensorSpec:
        return TensorSpec(
            dtype=self.dtype, shape=self.shape, data_ptr=self.data.ctypes.data, data_len=self.data.nbytes
        )

    def rows(self, a: int, b: int) -> HostTensor:
        """Tokens ``[a, b)`` of a (batch, heads, tokens, ·) tensor (a view)."""
        shape = (*self.shape[:2], b - a, *self.shape[3:])
        return HostTensor(self.dtype, shape, self.data[:, :, a:b])

    def packed(self) -> HostTensor:
        """Its bytes as one contiguous run: a block cut from a commit's longer arrays
        (``rows``) is a strided view of them, made contiguous here, on the writer's thread
        (a host copy of one block), not on the model's."""
        if self.data.ndim == 1:
            return self
        return HostTensor(self.dtype, self.shape, np.ascontiguousarray(self.data).reshape(-1))


def host_views(tensors: dict[str, mx.array]) -> dict[str, HostTensor]:
    """``tensors`` made contiguous and evaluated, as byte views of their memory (no copy
    where the memory is the host's: the CPU, a GPU's unified memory). Call it on the thread
    that runs the arrays' MLX work: what it returns is then read on another (an engine's
    saves run on a thread of their own, ``engine.saves``) without any MLX op."""
    return _frozen([tensors])[0]


def _frozen(groups: list[dict[str, mx.array]]) -> list[dict[str, HostTensor]]:
    """``host_views`` of several groups, evaluated together (one wait for the device)."""
    ready = [{k: mx.contiguous(v) for k, v in g.items()} for g in groups]
    mx.eval(ready)
    return [{k: _host(v) for k, v in g.items()} for g in ready]


def _host(x: mx.array) -> HostTensor:
    """An evaluated, contiguous array's bytes, shaped as it is (the last axis in bytes)."""
    data = np.frombuffer(memoryview(x).cast("B"), dtype=np.uint8).reshape(*x.shape[:-1], -1)
    return HostTensor(str(x.dtype).removeprefix("mlx.core."), tuple(x.shape), data)


def freeze_blocks(blocks: list[Block]) -> None:
    """Make each block's ``host`` now (on the thread of the tensors' MLX work), evaluated
    together: a commit of a 32K-token turn freezes 128 blocks, and a wait for the device per
    block cost more than the work."""
    todo = [b for b in blocks if b.host is None]
    for block, host in zip(todo, _frozen([b.tensors for b in todo]), strict=True):
        block.host = host


def tensor_checksum(tensors: dict[str, mx.array]) -> str:
    """A block's checksum (``reader.checksum``) over evaluated arrays."""
    return checksum(_named_bytes(tensors))


def _lineage(header: BlockHeader) -> tuple[list[int], BlockHash | None]:
    """A block header's token ids and parent hash."""
    try:
        token_ids = [int(t) for t in json.loads(header.meta["token_ids"])]
        parent = BlockHash(header.meta["parent"]) if header.meta["parent"] else None
    except (KeyError, TypeError, ValueError) as exc:
        raise CacheFormatError(f"block file {header.path} has a corrupt header: {exc}") from exc
    return token_ids, parent


_T = TypeVar("_T", mx.array, HostTensor)


class TokenSlices(Mapping[str, _T], Generic[_T]):
    """Tokens ``[a, z)`` of each of a run's (batch, heads, tokens, ·) tensors, cut when read.
    A commit's blocks are cut from one array per layer and part over their run; cutting them
    all up front was 128 blocks x 32 layers x 6 parts = 24,576 slices for a 32K turn of an
    8B model (0.26 s of the model's thread on the H200), most never read (a write reads the
    host bytes once; a restore reads a block's tensors only while its write is queued)."""

    __slots__ = ("_a", "_whole", "_z")

    def __init__(self, whole: Mapping[str, _T], a: int, z: int) -> None:
        self._whole, self._a, self._z = whole, a, z

    def __getitem__(self, name: str) -> _T:
        x = self._whole[name]
        return x.rows(self._a, self._z) if isinstance(x, HostTensor) else x[:, :, self._a : self._z]

    def __iter__(self) -> Iterator[str]:
        return iter(self._whole)

    def __len__(self) -> int:
        return len(self._whole)

    @property
    def nbytes(self) -> int:
        """What the slices hold, without cutting them."""
        return sum(_nbytes(x) // x.shape[2] * (self._z - self._a) for x in self._whole.values())


def _nbytes(x: mx.array | HostTensor) -> int:
    return int(x.data.nbytes if isinstance(x, HostTensor) else x.nbytes)


@dataclass(slots=True)
class StoreUsage:
    """What one store holds, as eviction sees it."""

    fingerprint: str
    #: (agent id, last use as a Unix time), least recently used first.
    agents: list[tuple[str, float]]
    refs: dict[str, set[BlockHash]]  # agent id -> the blocks its record names
    sizes: dict[BlockHash, int]  # bytes of each named block present on this disk
    index_bytes: int  # the index and its journal
    quarantine_bytes: int

    @property
    def total(self) -> int:
        return self.index_bytes + self.quarantine_bytes + sum(self.sizes.values())


@dataclass(slots=True)
class Block:
    hash: BlockHash
    parent: BlockHash | None
    token_ids: list[int]
    tensors: Mapping[str, mx.array]
    #: The tensors as host views (``host_views``), made on the MLX thread for a write on
    #: another; None: ``put_block`` makes them (on the calling thread).
    host: Mapping[str, HostTensor] | None = None

    @property
    def nbytes(self) -> int:
        if isinstance(self.tensors, TokenSlices):
            return self.tensors.nbytes
        return sum(int(t.nbytes) for t in self.tensors.values())


@dataclass(slots=True)
class AgentRecord:
    """What an agent's cache stands for: the block chain, the text and its token ends."""

    agent_id: str
    blocks: list[BlockHash]
    token_ids: list[int]
    token_ends: list[int]
    text: str
    updated_at: float = field(default_factory=time.time)
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(
            {
                "format_version": self.format_version,
                "agent_id": self.agent_id,
                "blocks": self.blocks,
                "token_ids": self.token_ids,
                "token_ends": self.token_ends,
                "text": self.text,
                "updated_at": self.updated_at,
            }
        )

    @classmethod
    def from_json(cls, raw: str) -> AgentRecord:
        """Parse a stored record; anything but a well-formed one is ``CacheFormatError``."""
        try:
            return cls._from_json(raw)
        except CacheFormatError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as exc:  # JSON, shape, types
            raise CacheFormatError(f"agent record is corrupt: {exc!r}") from exc

    @classmethod
    def _from_json(cls, raw: str) -> AgentRecord:
        data = json.loads(raw)
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise _version_error("agent record", version)
        record = cls(
            agent_id=data["agent_id"],
            blocks=[BlockHash(b) for b in data["blocks"]],
            token_ids=list(data["token_ids"]),
            token_ends=list(data["token_ends"]),
            text=data["text"],
            updated_at=float(data["updated_at"]),
        )
        # Well-formed JSON with the wrong shapes must not reach the engine.
        if not (
            isinstance(record.agent_id, str)
            and isinstance(record.text, str)
            and all(isinstance(b, str) and len(b) == 64 for b in record.blocks)
            and all(type(t) is int for t in record.token_ids + record.token_ends)
            and len(record.token_ids) == len(record.token_ends)
        ):
            raise CacheFormatError("agent record fields have the wrong types or lengths")
        return record


def _version_error(what: str, version: Any) -> CacheFormatError:
    if isinstance(version, int) and version > FORMAT_VERSION:
        return NewerFormatError(
            f"{what} has format version {version}, written by a newer langchain-agent-memory; "
            f"this version reads format {FORMAT_VERSION}: upgrade the package"
        )
    return CacheFormatError(f"{what} has unknown format version {version!r} (expected {FORMAT_VERSION})")


class BlockStore(Protocol):
    """Where blocks and agent records persist. Every backend passes tests/unit/test_store.py.

    Mutations that must not interleave with another process's (a commit: blocks then
    record; a delete: record then orphaned blocks) run inside ``with store.locked():``.
    """

    fingerprint: str

    def locked(self) -> contextlib.AbstractContextManager[None]: ...
    def has_block(self, h: BlockHash) -> bool: ...
    def block_path(self, h: BlockHash) -> Path: ...
    def local_bytes(self, hashes: Iterable[BlockHash]) -> int: ...
    def put_block(self, block: Block) -> int: ...
    def get_block(self, h: BlockHash, names: Sequence[str] | None = None) -> Block: ...
    def delete_block(self, h: BlockHash) -> None: ...
    def quarantine_block(self, h: BlockHash) -> Path | None: ...
    def quarantine_agent(self, agent_id: str) -> Path | None: ...
    def block_hashes(self) -> Iterator[BlockHash]: ...
    def is_referenced(self, h: BlockHash) -> bool: ...
    def put_agent(self, record: AgentRecord) -> int: ...
    def get_agent(self, agent_id: str) -> AgentRecord | None: ...
    def has_agent(self, agent_id: str) -> bool: ...
    def agent_chain(self, agent_id: str) -> list[BlockHash]: ...
    def delete_agent(self, agent_id: str) -> bool: ...
    def agents(self, prefix: str = "") -> Iterator[AgentRecord]: ...
    def read_blocks(
        self, hashes: Sequence[BlockHash], layers: Collection[int] | None = None
    ) -> list[BlockGroup]: ...
    def disk_bytes(self) -> int: ...
    def oldest_use(self) -> float | None: ...
    def usage(self) -> StoreUsage: ...
    def pinned(self) -> set[str]: ...
    def evict_agents(self, agent_ids: Sequence[str]) -> tuple[int, list[BlockHash]]: ...
    def clear_quarantine(self) -> int: ...
    def begin(self, agent_id: str, version: int | None) -> bool: ...
    def seen_version(self, agent_id: str) -> int | None: ...
    def end(self, agent_id: str) -> None: ...
    def close(self) -> None: ...


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


class DiskBlockStore:
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
                    raise _version_error(f"cache directory {self.dir}", version)
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
            raise _version_error(f"cache directory {self.dir}", version)
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
        token_ids, parent = _lineage(header)
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
                _raise_if_vanished(exc, path)
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
            _raise_if_vanished(exc, self.blocks_dir)
            raise CacheFormatError(f"a block file is unreadable (truncated or corrupt): {exc}") from exc

    def _check_header(self, h: BlockHash, header: BlockHeader) -> None:
        meta, path = header.meta, header.path
        version = meta.get("format_version")
        if version != str(FORMAT_VERSION):
            raise _version_error(f"block {path.name}", _int_or(version))
        if meta.get("fingerprint") != self.fingerprint:
            raise CacheFormatError(
                f"block {path.name} was written for model/quantization {meta.get('fingerprint')!r}, "
                f"not {self.fingerprint!r}: it belongs to another model"
            )
        if meta.get("hash") != h:
            raise CacheFormatError(f"block file {path.name} holds block {meta.get('hash')!r}")
        token_ids, parent = _lineage(header)
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
        if isinstance(version, int) and version > FORMAT_VERSION:
            raise _version_error(f"agent record {agent_id!r}", version)
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


def parse_record(raw: str, what: str) -> AgentRecord:
    try:
        return AgentRecord.from_json(raw)
    except CacheFormatError as exc:
        raise type(exc)(f"{what}: {exc}") from exc


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
