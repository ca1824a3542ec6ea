"""Persistent storage of KV blocks and agent records.

Layout under the root directory, one subfolder per model fingerprint (caches of different
models, or of other KV quantizations, never mix)::

    <root>/<fingerprint>/format.json                  {"format_version": 1, "fingerprint": ...}
    <root>/<fingerprint>/blocks/<h[:2]>/<h>.safetensors
    <root>/<fingerprint>/agents/<sha256(agent id)[:32]>.json

A block file holds the KV tensors of up to 256 tokens for every layer, named
``L{layer}.{k|v}.{q|scales|biases}`` (quantized) or ``L{layer}.{k|v}`` (16-bit), and a
header with the format version, fingerprint, parent hash, token ids and a SHA-256 of the
tensor bytes. Blocks are content-addressed (``block_hash``) and immutable: writing one
that exists is a no-op. Every write is atomic (temp file, fsync, rename, fsync of the
directory): a crash leaves the old file or the new one, never a torn one.

Agent files are named by a hash of the id, so no id can name a path outside the root;
ids are still validated (``validate_agent_id``) so that mistakes surface early.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NewType, Protocol

import numpy as np

from .runtime import mx

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


def tensor_checksum(tensors: dict[str, mx.array]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode() + b"\x00")
        h.update(memoryview(tensors[name]).tobytes())
    return h.hexdigest()


@dataclass(slots=True)
class Block:
    hash: BlockHash
    parent: BlockHash | None
    token_ids: list[int]
    tensors: dict[str, mx.array]

    @property
    def nbytes(self) -> int:
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
        data = json.loads(raw)
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise _version_error("agent record", version)
        return cls(
            agent_id=data["agent_id"],
            blocks=[BlockHash(b) for b in data["blocks"]],
            token_ids=list(data["token_ids"]),
            token_ends=list(data["token_ends"]),
            text=data["text"],
            updated_at=float(data["updated_at"]),
        )


def _version_error(what: str, version: Any) -> CacheFormatError:
    if isinstance(version, int) and version > FORMAT_VERSION:
        return NewerFormatError(
            f"{what} has format version {version}, written by a newer langchain-agent-memory; "
            f"this version reads format {FORMAT_VERSION}: upgrade the package"
        )
    return CacheFormatError(f"{what} has unknown format version {version!r} (expected {FORMAT_VERSION})")


class BlockStore(Protocol):
    """Where blocks and agent records persist. Every backend passes tests/unit/test_store.py."""

    fingerprint: str

    def has_block(self, h: BlockHash) -> bool: ...
    def put_block(self, block: Block) -> int: ...
    def get_block(self, h: BlockHash, names: Sequence[str] | None = None) -> Block: ...
    def delete_block(self, h: BlockHash) -> None: ...
    def block_hashes(self) -> Iterator[BlockHash]: ...
    def put_agent(self, record: AgentRecord) -> int: ...
    def get_agent(self, agent_id: str) -> AgentRecord | None: ...
    def has_agent(self, agent_id: str) -> bool: ...
    def delete_agent(self, agent_id: str) -> bool: ...
    def agents(self) -> Iterator[AgentRecord]: ...


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a directory be opened
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write(path: Path, write: Callable[[str], object], suffix: str = ".tmp") -> int:
    """Write ``path`` through ``write(temp_path)``, then fsync and rename: readers see the
    old file or the new one, never a torn one. Returns the size written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        size = os.path.getsize(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)
    return size


def atomic_write_bytes(path: Path, data: bytes) -> int:
    return atomic_write(path, lambda tmp: Path(tmp).write_bytes(data))


class DiskBlockStore:
    """Blocks as safetensors files and agent records as JSON files under one directory."""

    def __init__(self, root: str | os.PathLike[str], fingerprint: str) -> None:
        self.fingerprint = fingerprint
        self.dir = Path(root) / fingerprint
        self.blocks_dir = self.dir / "blocks"
        self.agents_dir = self.dir / "agents"
        self.blocks_dir.mkdir(parents=True, exist_ok=True)
        self.agents_dir.mkdir(parents=True, exist_ok=True)
        fmt = self.dir / "format.json"
        if fmt.exists():
            version = json.loads(fmt.read_text()).get("format_version")
            if version != FORMAT_VERSION:
                raise _version_error(f"cache directory {self.dir}", version)
        else:
            meta = {"format_version": FORMAT_VERSION, "fingerprint": fingerprint}
            atomic_write_bytes(fmt, json.dumps(meta).encode())

    # ------------------------------------------------------------------ blocks

    def block_path(self, h: BlockHash) -> Path:
        if len(h) != 64 or any(c not in "0123456789abcdef" for c in h):
            raise ValueError(f"not a block hash: {h!r}")
        return self.blocks_dir / h[:2] / f"{h}.safetensors"

    def has_block(self, h: BlockHash) -> bool:
        return self.block_path(h).exists()

    def put_block(self, block: Block) -> int:
        """Write ``block`` unless it exists; return the bytes written (0 if it existed)."""
        path = self.block_path(block.hash)
        if path.exists():
            return 0
        tensors = {k: mx.contiguous(v) for k, v in block.tensors.items()}
        mx.eval(tensors)
        meta = {
            "format_version": str(FORMAT_VERSION),
            "fingerprint": self.fingerprint,
            "hash": block.hash,
            "parent": block.parent or "",
            "token_ids": json.dumps(block.token_ids),
            "checksum": tensor_checksum(tensors),
        }
        # mx.save_safetensors appends ".safetensors" to a name that lacks it.
        return atomic_write(
            path, lambda tmp: mx.save_safetensors(tmp, tensors, metadata=meta), ".safetensors"
        )

    def get_block(self, h: BlockHash, names: Sequence[str] | None = None) -> Block:
        """Read a block (all tensors, or only ``names``), verified against its header.

        Raises ``BlockMissingError`` or ``CacheFormatError`` (corrupt, truncated, another
        model's, a newer format); never returns unverified data.
        """
        path = self.block_path(h)
        if not path.exists():
            raise BlockMissingError(f"block {h[:12]} is missing from {self.blocks_dir}")
        try:
            tensors, meta = mx.load(str(path), return_metadata=True)
        except Exception as exc:  # mlx raises bare RuntimeError/ValueError on bad files
            raise CacheFormatError(f"block file {path} is unreadable (truncated or corrupt): {exc}") from exc
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
        try:
            mx.eval(tensors)
            checksum = tensor_checksum(tensors)
        except Exception as exc:
            raise CacheFormatError(f"block file {path} is unreadable (truncated or corrupt): {exc}") from exc
        if checksum != meta.get("checksum"):
            raise CacheFormatError(f"block file {path} failed its checksum: the data is corrupt")
        try:
            token_ids = [int(t) for t in json.loads(meta["token_ids"])]
            parent = BlockHash(meta["parent"]) if meta["parent"] else None
        except (KeyError, TypeError, ValueError) as exc:
            raise CacheFormatError(f"block file {path} has a corrupt header: {exc}") from exc
        if block_hash(parent, token_ids, self.fingerprint) != h:
            raise CacheFormatError(f"block file {path} header does not match its hash")
        if names is not None:
            missing = [k for k in names if k not in tensors]
            if missing:
                raise CacheFormatError(f"block file {path} lacks tensors {missing[:3]}")
            tensors = {k: tensors[k] for k in names}
        return Block(h, parent, token_ids, tensors)

    def delete_block(self, h: BlockHash) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.block_path(h).unlink()

    def block_hashes(self) -> Iterator[BlockHash]:
        for p in self.blocks_dir.glob("*/*.safetensors"):
            if not p.name.startswith("."):
                yield BlockHash(p.stem)

    def quarantine_block(self, h: BlockHash) -> Path | None:
        """Move a bad block file aside (kept for inspection, never read again)."""
        src = self.block_path(h)
        if not src.exists():
            return None
        dst = self.dir / "quarantine" / f"{h}.{int(time.time())}.safetensors"
        dst.parent.mkdir(exist_ok=True)
        os.replace(src, dst)
        return dst

    # ------------------------------------------------------------------ agents

    def agent_path(self, agent_id: str) -> Path:
        validate_agent_id(agent_id)
        return self.agents_dir / (hashlib.sha256(agent_id.encode()).hexdigest()[:32] + ".json")

    def put_agent(self, record: AgentRecord) -> int:
        data = record.to_json().encode()
        atomic_write_bytes(self.agent_path(record.agent_id), data)
        return len(data)

    def has_agent(self, agent_id: str) -> bool:
        return self.agent_path(agent_id).exists()

    def get_agent(self, agent_id: str) -> AgentRecord | None:
        path = self.agent_path(agent_id)
        try:
            raw = path.read_text()
        except FileNotFoundError:
            return None
        try:
            record = AgentRecord.from_json(raw)
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CacheFormatError(f"agent record {path} is corrupt: {exc}") from exc
        if record.agent_id != agent_id:
            raise CacheFormatError(f"agent record {path} belongs to {record.agent_id!r}")
        return record

    def delete_agent(self, agent_id: str) -> bool:
        try:
            self.agent_path(agent_id).unlink()
        except FileNotFoundError:
            return False
        return True

    def agents(self) -> Iterator[AgentRecord]:
        for p in sorted(self.agents_dir.glob("*.json")):
            try:
                yield AgentRecord.from_json(p.read_text())
            except (CacheFormatError, json.JSONDecodeError, KeyError, TypeError) as exc:
                logger.warning("skipping unreadable agent record %s: %s", p, exc)


def _int_or(value: Any) -> Any:
    try:
        return int(value)
    except (TypeError, ValueError):
        return value
