"""What a block store holds: content-addressed blocks of KV tensors (``Block``, their
hashes and their bytes as the host sees them), agent records (``AgentRecord``), what
eviction sees of a store (``StoreUsage``), and the errors of reading and writing them. The
stores themselves: ``store.DiskBlockStore`` (a local directory), ``remote.SharedBlockStore``
(PostgreSQL + S3 with a local tier in front); their protocols: ``protocols``."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import time
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, NewType, TypeVar

import numpy as np
from safetensors import TensorSpec

from ..errors import (  # noqa: F401 - defined there, re-exported
    AgentNotFoundError,
    BlockMissingError,
    CacheFormatError,
    CacheWriteError,
    NewerFormatError,
)
from ..ops.runtime import mx
from .checksums import checksum
from .reader import BlockFileError, BlockHeader

logger = logging.getLogger(__name__)


FORMAT_VERSION = 1
#: Agent records of a hybrid model (``AgentRecord.states``): refused by a version that reads
#: only ``FORMAT_VERSION``; records without state snapshots are still written as 1.
STATES_FORMAT_VERSION = 2
#: Agent records whose chain has segments (``AgentRecord.priors``), and block files that are
#: segments (``Block.rows_from``): refused by versions that cannot read segments; records and
#: blocks without them are still written as before.
SEGMENTS_FORMAT_VERSION = 3
BLOCK_TOKENS = 256
#: The token id of a recurrent-state snapshot's block, at the end of the chain block it
#: follows: the child of that block with this one "token" (``STATE_TOKEN - d`` for a
#: snapshot ``d`` tokens before the block's end; no vocabulary comes near), so its hash is a
#: ``block_hash`` like any other and every store checks it the same way.
STATE_TOKEN = 0xFFFFFFFF
_HASH_SEED = b"langchain-agent-memory/block/v1\x00"

BlockHash = NewType("BlockHash", str)


def raise_if_vanished(exc: BlockFileError, where: Path) -> None:
    """A block file deleted by another process between finding it and reading it (a cleanup
    racing a load) is missing, not damaged: it must not be reported or treated as corrupt."""
    if isinstance(exc.__cause__, FileNotFoundError):
        raise BlockMissingError(f"a block file in {where} was deleted while read: {exc.__cause__}") from exc


def block_hash(parent: BlockHash | None, token_ids: Sequence[int], fingerprint: str) -> BlockHash:
    """Chained content hash: the same tokens after the same prefix, for the same model,
    give the same hash in every process (no per-process seed)."""
    h = hashlib.sha256(_HASH_SEED)
    h.update((parent or "").encode())
    h.update(b"\x00" + fingerprint.encode() + b"\x00")
    h.update(np.asarray(token_ids, dtype="<u4").tobytes())
    return BlockHash(h.hexdigest())


def chain_hashes(
    token_ids: Sequence[int], fingerprint: str, parent: BlockHash | None = None, first: int = 0
) -> Iterator[BlockHash]:
    """The hashes of the blocks of ``token_ids`` from block ``first`` on (``parent``: the hash
    of the block before it), in order; the last block may be partial."""
    for a in range(first * BLOCK_TOKENS, len(token_ids), BLOCK_TOKENS):
        parent = block_hash(parent, token_ids[a : a + BLOCK_TOKENS], fingerprint)
        yield parent


def prompt_hashes(token_ids: Sequence[int], fingerprint: str) -> Iterator[BlockHash]:
    """The hashes of a prompt's whole blocks that a cold start may reuse: never the block of
    its last token (that token's logits must be computed)."""
    return chain_hashes(token_ids[: (len(token_ids) - 1) // BLOCK_TOKENS * BLOCK_TOKENS], fingerprint)


def prior_hash(
    parent: BlockHash | None, token_ids: Sequence[int], rows_from: int, fingerprint: str
) -> BlockHash:
    """The block holding the first ``rows_from`` tokens of a segment (its predecessor: the
    same block position, fewer tokens)."""
    if not 0 < rows_from < len(token_ids):
        raise ValueError(f"a segment starts inside its block, not at row {rows_from} of {len(token_ids)}")
    return block_hash(parent, token_ids[:rows_from], fingerprint)


def state_block_hash(h: BlockHash, fingerprint: str, before_end: int = 0) -> BlockHash:
    """The block holding the recurrent layers' state ``before_end`` tokens before the end of
    chain block ``h`` (a function of ``h``: the same tokens after the same prefix give the
    same state)."""
    if not 0 <= before_end < BLOCK_TOKENS:
        raise ValueError(f"a state snapshot is within its block: {before_end} tokens before its end")
    return block_hash(h, [STATE_TOKEN - before_end], fingerprint)


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
    """A block's checksum (``checksums.checksum``) over evaluated arrays."""
    return checksum(_named_bytes(tensors))


def block_lineage(header: BlockHeader) -> tuple[list[int], BlockHash | None]:
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
    #: another; None: ``BlockFiles.put`` makes them (on the calling thread).
    host: Mapping[str, HostTensor] | None = None
    #: Written as a segment: the file holds only tokens ``[rows_from, n)``; the rows before
    #: are block ``prior_hash(self)``, stored already (a turn appends to its agent's partly
    #: filled last block without writing that block's earlier rows again). 0: whole.
    rows_from: int = 0

    @property
    def nbytes(self) -> int:
        if isinstance(self.tensors, TokenSlices):
            return self.tensors.nbytes
        return sum(int(t.nbytes) for t in self.tensors.values())

    def prior(self, fingerprint: str) -> BlockHash | None:
        """The block of a segment's earlier rows (None: written whole)."""
        if not self.rows_from:
            return None
        return prior_hash(self.parent, self.token_ids, self.rows_from, fingerprint)

    @property
    def written_nbytes(self) -> int:
        """Tensor bytes its write puts on disk: a segment's own rows only."""
        n = len(self.token_ids)
        return self.nbytes * (n - self.rows_from) // n if self.rows_from else self.nbytes


@dataclass(slots=True)
class AgentRecord:
    """What an agent's cache stands for: the block chain, the text and its token ends.

    ``blocks`` is every block the record names, which is what stores count references,
    write, upload and collect by: the chain (``chain``: block ``i`` holds tokens
    ``[256 i, 256 (i + 1))``), then, for a hybrid model, one recurrent-state snapshot per
    entry of ``states`` (the token positions snapshotted, ascending; ``state_block_hash``),
    then the predecessors of the chain's segments (``priors``: segment -> the block of its
    earlier rows, itself whole or a segment; ``set_priors``)."""

    agent_id: str
    blocks: list[BlockHash]
    token_ids: list[int]
    token_ends: list[int]
    text: str
    updated_at: float = field(default_factory=time.time)
    format_version: int = FORMAT_VERSION
    states: list[int] = field(default_factory=list)
    priors: dict[BlockHash, BlockHash] = field(default_factory=dict)

    @property
    def chain(self) -> list[BlockHash]:
        return self.blocks[: len(self.blocks) - len(self.states) - len(self.priors)]

    def named(self, agent_id: str) -> AgentRecord:
        """A record of ``agent_id`` that stands for what this one does (the same blocks: a
        fork, a snapshot, a restore)."""
        return AgentRecord(
            agent_id, list(self.blocks), list(self.token_ids), list(self.token_ends), self.text,
            states=list(self.states), priors=dict(self.priors),
        )  # fmt: skip

    def state_blocks(self) -> dict[int, BlockHash]:
        """Token position -> the block of the recurrent state there."""
        n = len(self.chain)
        return dict(zip(self.states, self.blocks[n : n + len(self.states)], strict=True))

    def set_priors(self, priors: Mapping[BlockHash, BlockHash]) -> None:
        """Name these segment predecessors (``priors``) after the chain and the snapshots,
        so that the blocks a read of the chain needs are counted, kept and uploaded with it."""
        kept = self.blocks[: len(self.blocks) - len(self.priors)]
        self.priors = dict(priors)
        self.blocks = kept + list(self.priors.values())

    def to_json(self) -> str:
        version = (
            SEGMENTS_FORMAT_VERSION
            if self.priors
            else STATES_FORMAT_VERSION
            if self.states
            else FORMAT_VERSION
        )
        data: dict[str, Any] = {"format_version": version, "agent_id": self.agent_id, "blocks": self.blocks}
        tokens = {"token_ids": self.token_ids, "token_ends": self.token_ends, "text": self.text}
        if self.priors:
            # A conversation's record, rewritten by every turn's save, with its tokens and
            # text packed: 2.5x fewer bytes for the index (and its journal) to write.
            data["priors"] = self.priors
            data["packed"] = _pack(tokens)
        else:
            data.update(tokens)
        data["updated_at"] = self.updated_at
        if self.states:
            data["states"] = self.states
        return json.dumps(data)

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
        if "packed" in data:
            data.update(_unpack(data.pop("packed")))
        version = data.get("format_version")
        if version not in (FORMAT_VERSION, STATES_FORMAT_VERSION, SEGMENTS_FORMAT_VERSION):
            raise version_error("agent record", version, SEGMENTS_FORMAT_VERSION)
        record = cls(
            agent_id=data["agent_id"],
            blocks=[BlockHash(b) for b in data["blocks"]],
            token_ids=list(data["token_ids"]),
            token_ends=list(data["token_ends"]),
            text=data["text"],
            updated_at=float(data["updated_at"]),
            format_version=version,
            states=list(data.get("states", [])),
            priors={BlockHash(k): BlockHash(v) for k, v in dict(data.get("priors", {})).items()},
        )
        if record.priors and record.blocks[len(record.blocks) - len(record.priors) :] != list(
            record.priors.values()
        ):
            raise CacheFormatError("agent record names segment predecessors it does not list")
        if not (
            len(record.states) + len(record.priors) <= len(record.blocks)
            and all(type(p) is int and 0 < p <= len(record.token_ids) for p in record.states)
            and record.states == sorted(set(record.states))
        ):
            raise CacheFormatError("agent record names state snapshots of blocks it does not have")
        # Well-formed JSON with the wrong shapes must not reach the engine.
        if not (
            isinstance(record.agent_id, str)
            and isinstance(record.text, str)
            and all(isinstance(b, str) and len(b) == 64 for b in [*record.blocks, *record.priors])
            and all(type(t) is int for t in record.token_ids + record.token_ends)
            and len(record.token_ids) == len(record.token_ends)
        ):
            raise CacheFormatError("agent record fields have the wrong types or lengths")
        return record


def _pack(fields: dict[str, Any]) -> str:
    raw = json.dumps(fields, ensure_ascii=False, separators=(",", ":")).encode()
    return base64.b64encode(zlib.compress(raw, 6)).decode("ascii")


def _unpack(packed: str) -> dict[str, Any]:
    try:
        fields = json.loads(zlib.decompress(base64.b64decode(packed, validate=True)))
    except (ValueError, zlib.error) as exc:
        raise CacheFormatError(f"agent record is corrupt: its packed tokens do not unpack ({exc})") from exc
    if not isinstance(fields, dict) or set(fields) != {"token_ids", "token_ends", "text"}:
        raise CacheFormatError("agent record is corrupt: its packed tokens are not tokens")
    return fields


def version_error(what: str, version: Any, newest: int = FORMAT_VERSION) -> CacheFormatError:
    if isinstance(version, int) and version > newest:
        return NewerFormatError(
            f"{what} has format version {version}, written by a newer langchain-agent-memory; "
            f"this version reads format {newest}: upgrade the package"
        )
    return CacheFormatError(f"{what} has unknown format version {version!r} (expected {newest})")


def parse_record(raw: str, what: str) -> AgentRecord:
    try:
        return AgentRecord.from_json(raw)
    except CacheFormatError as exc:
        raise type(exc)(f"{what}: {exc}") from exc
