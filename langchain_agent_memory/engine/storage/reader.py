"""Reading block files fast: a run of blocks lands in a few device arrays, not thousands.

A 32K-token agent of an 8B model is 128 block files of ~200 tensors each. Loading them one
tensor at a time (``mx.load`` + an array per tensor) cost ~3 s on an H200 for 1.5 GB: the
time went to per-array overhead, not to bytes. Here:

1. every file's safetensors header is read (a few KB each) and checked;
2. blocks of the same tensor layout (all full blocks of a run share one) are read straight
   into the rows of one host array, on a thread pool: file reads and hashing release the
   GIL, and the checksum is taken from the bytes just read (no second pass over the file).
   It is XXH3-128 where the header has one (``fast_checksum``: ~15 GB/s a core, so a
   restore runs at the disk's speed, not SHA-256's ~1.5 GB/s), else SHA-256 (blocks
   written before it was added; new blocks keep both, for readers that know only SHA-256;
   ``checksums``). On 4 or more threads a whole block's digest input is first gathered
   into one buffer by one system call and hashed in one call (``gather``): hashed tensor
   by tensor, a call each, the GIL hand-offs were most of a 32K restore on the H100;
3. each such group goes to the device as one array; a tensor of the group is a strided
   view of it, concatenated over the group's blocks by one copy on the device. On an NVIDIA
   GPU each file's bytes are copied to the GPU by the thread that read them, while the
   others read on (``cuda_memory``: ``mx.array`` of host memory costs ~2.5 GB/s there);
   elsewhere the group is one ``mx.array`` of the host rows.

A block may be read in part: only some layers' tensors (``select``; a sliding-window layer
needs only its last window's blocks, so Gemma 3's blocks before that window are read for its
full-attention layers only). Each layer's tensors are one contiguous range of the file
(names ``L{i}.…`` sort together) and have a checksum of their own in the header
(``part_checksums``; blocks written before it was added are read whole).

A checksum guards against damage (a torn write, a flipped bit, a truncated upload), not
against a forger: who can write the cache directory can write its checksums too.

Nothing unverified is returned: a block whose header, hash or checksum is wrong raises
``CacheFormatError`` (``BlockMissingError`` if absent), naming the file.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import struct
import threading
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..ops import cuda_memory
from ..ops.process import RUNTIME
from ..ops.runtime import mx
from . import gather
from .checksums import (
    FAST_FIELDS,
    SHA_FIELDS,
    Gathered,
    checksum,
    covered,
    fast_checksum,
    layer_of,
    part_checksums,
)

logger = logging.getLogger(__name__)

#: safetensors dtype -> (mlx dtype, numpy dtype of the same width for the raw bytes).
_DTYPES: dict[str, tuple[mx.Dtype, Any]] = {
    "F16": (mx.float16, np.uint16),
    "BF16": (mx.bfloat16, np.uint16),
    "F32": (mx.float32, np.uint32),
    "U32": (mx.uint32, np.uint32),
    "I32": (mx.int32, np.uint32),
    "U8": (mx.uint8, np.uint8),
    "U16": (mx.uint16, np.uint16),
    # Recurrent states kept as integers (LongCat-Flash-NGram's n-gram token history).
    "I64": (mx.int64, np.uint64),
    "U64": (mx.uint64, np.uint64),
}
_WIDTHS = {name: np.dtype(raw).itemsize for name, (_, raw) in _DTYPES.items()}
#: Header size above which a file is not ours (ours are a few KB).
_MAX_HEADER = 16 << 20
#: Threads reading block files (I/O and hashing release the GIL).
READ_THREADS = min(16, os.cpu_count() or 1)


#: From this many reader threads on, a whole block's digest input is gathered first and
#: hashed in one call (``gather``: GIL hand-offs); below, tensor by tensor saves a copy.
GATHER_THREADS = 4
#: ... and where its tensors are this small on average: what the gather saves is a GIL
#: hand-off per tensor, what it costs is a copy of every byte. Measured on the H100 (32K
#: tokens of an 8B shape): the 4-bit format's ~60 KB tensors loaded in 0.23-0.27 s gathered
#: against 0.31-0.36 s tensor by tensor (A/B in one process); the 16-bit format's ~512 KB
#: ones took 0.53-0.62 s gathered, no faster than before the gather (not measured A/B).
GATHER_MAX_MEAN_BYTES = 256 << 10


def read_pool() -> Executor:
    """The process's ``READ_THREADS`` reading threads (the runtime's: made on first use)."""
    return RUNTIME.shared_pool("agent-memory-read", READ_THREADS)


class BlockFileError(ValueError):
    """A block file that cannot be parsed (the store turns it into ``CacheFormatError``)."""


@dataclass(frozen=True, slots=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # byte offsets in the data section
    end: int


@dataclass(slots=True)
class BlockHeader:
    path: Path
    data_offset: int  # where the data section starts in the file
    data_len: int  # bytes read (the data section, or the selected layers' ranges packed)
    tensors: tuple[TensorEntry, ...]  # sorted by name (offsets into what is read)
    meta: dict[str, str]
    _n_tokens: int | None = None
    #: A partial read (``select``): the (begin, end) ranges of the data section read, in
    #: order, and the layers (``L{i}``) they hold; None: the whole data section.
    ranges: tuple[tuple[int, int], ...] | None = None
    parts: tuple[str, ...] = ()

    @property
    def n_tokens(self) -> int:
        """Tokens the block stands for (its header's token ids; checked by the store).
        Parsed once: a 32K-token load asks it for every layer of every block."""
        if self._n_tokens is None:
            self._n_tokens = len(json.loads(self.meta["token_ids"]))
        return self._n_tokens


#: A tensor table already checked, by data length: the safetensors header (without its
#: metadata), its entries and its text after the metadata (None: the metadata is not the
#: first field). Blocks of one run share one table: checking it once saves ~1 ms per file
#: (128 files for a 32K-token agent), and a header whose text after its metadata is the
#: same is not parsed past its metadata (0.25 of 0.37 ms a header went to parsing it).
Layouts = dict[int, tuple[dict[str, Any], tuple[TensorEntry, ...], str | None]]
_META_FIRST = '{"__metadata__":'
_json = json.JSONDecoder()


def _metadata_first(text: str) -> tuple[Any, str] | None:
    """(the metadata, the header's text after it) where the metadata is its first field (as
    safetensors writes it), else None."""
    if not text.startswith(_META_FIRST):
        return None
    try:
        meta, end = _json.raw_decode(text, len(_META_FIRST))
    except json.JSONDecodeError:
        return None
    return meta, text[end:]


def read_header(path: Path, layouts: Layouts | None = None) -> BlockHeader:
    """Parse a safetensors file's header (``BlockFileError`` if it is not a sound one);
    ``layouts``: tables checked before (reused when this file's is the same)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise BlockFileError("shorter than a safetensors header")
            (n,) = struct.unpack("<Q", raw)
            if n > min(_MAX_HEADER, size - 8):
                raise BlockFileError(f"header length {n} does not fit a {size}-byte file")
            text = f.read(n).decode()
        data_len = size - 8 - n
        known = layouts.get(data_len) if layouts is not None else None
        first = _metadata_first(text) if known is not None and known[2] is not None else None
        if known is not None and first is not None and first[1] == known[2] and isinstance(first[0], dict):
            return BlockHeader(path, 8 + n, data_len, known[1], first[0])  # the same table, as text
        header = json.loads(text)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BlockFileError(f"unreadable header: {exc}") from exc
    if not isinstance(header, dict):
        raise BlockFileError("header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if known is not None and known[0] == header:
        return BlockHeader(path, 8 + n, data_len, known[1], meta)
    entries = []
    try:
        for name, info in sorted(header.items()):
            begin, end = (int(x) for x in info["data_offsets"])
            shape = tuple(int(d) for d in info["shape"])
            entries.append(TensorEntry(name, str(info["dtype"]), shape, begin, end))
    except (KeyError, TypeError, ValueError) as exc:
        raise BlockFileError(f"corrupt tensor table: {exc}") from exc
    for e in entries:
        if e.dtype not in _DTYPES:
            raise BlockFileError(f"tensor {e.name} has dtype {e.dtype}, not one a block holds")
        width = _WIDTHS[e.dtype]  # math.prod: np.prod's ~4 us a call was half of a header's parse
        if not (0 <= e.begin <= e.end <= data_len) or e.end - e.begin != width * math.prod(e.shape):
            raise BlockFileError(f"tensor {e.name} does not fit the file (truncated?)")
    if layouts is not None:
        # The text after the metadata stands for the table only where the metadata read
        # first is the one the whole parse kept (no second "__metadata__" after it).
        first = _metadata_first(text)
        sole = first is not None and first[0] == meta and '"__metadata__"' not in first[1]
        layouts[data_len] = (header, tuple(entries), first[1] if first is not None and sole else None)
    return BlockHeader(path, 8 + n, data_len, tuple(entries), meta)


def sound(header: BlockHeader, named: Sequence[tuple[str, Any]]) -> bool:
    """Whether the bytes just read (``named``: all of the block's tensors, or those of the
    layers ``header`` selects) match the header's digest: XXH3-128 where it has one (it also
    covers the header's other fields: a damaged SHA-256 field is found too), else SHA-256.
    ``BlockFileError`` if the header's digests are unreadable."""
    meta = header.meta
    if FAST_FIELDS[1] in meta and FAST_FIELDS[0] not in meta:
        return False  # its whole digest's name is damaged (both are always written)
    if FAST_FIELDS[0] in meta:
        whole = header.ranges is None
        fields, digest = FAST_FIELDS, functools.partial(fast_checksum, meta=covered(meta, whole=whole))
    else:
        fields, digest = SHA_FIELDS, checksum
    if header.ranges is None:
        return digest(named) == meta.get(fields[0])
    try:
        stored = json.loads(meta[fields[1]])
    except (KeyError, ValueError) as exc:
        raise BlockFileError(f"{header.path} has corrupt part checksums") from exc
    got = part_checksums(named, digest)
    return isinstance(stored, dict) and all(stored.get(k) == v for k, v in got.items())


def select(header: BlockHeader, layers: Collection[str]) -> BlockHeader:
    """A view of ``header`` that reads only the tensors of ``layers`` (``L{i}``), packed in
    file order: one range per run of adjacent tensors."""
    chosen = [e for e in header.tensors if layer_of(e.name) in layers]
    ranges: list[tuple[int, int]] = []
    packed: list[TensorEntry] = []
    at = 0
    for e in sorted(chosen, key=lambda e: e.begin):
        if ranges and ranges[-1][1] == e.begin:
            ranges[-1] = (ranges[-1][0], e.end)
        else:
            ranges.append((e.begin, e.end))
        packed.append(TensorEntry(e.name, e.dtype, e.shape, at, at + e.end - e.begin))
        at += e.end - e.begin
    return BlockHeader(
        header.path, header.data_offset, at, tuple(sorted(packed, key=lambda e: e.name)), header.meta,
        header._n_tokens, tuple(ranges), tuple(sorted({layer_of(e.name) for e in chosen})),
    )  # fmt: skip


@dataclass(slots=True)
class BlockGroup:
    """Consecutive blocks of one tensor layout, uploaded together: ``tensor(name)`` is the
    blocks' tensors concatenated along the token axis (axis 2), from block ``first`` on."""

    headers: list[BlockHeader]
    blob: mx.array  # (n_blocks, data_len) uint8
    _entries: dict[str, TensorEntry] = field(default_factory=dict)

    def tensor(self, name: str, first: int = 0) -> mx.array:
        if not self._entries:
            self._entries.update((e.name, e) for e in self.headers[0].tensors)
        entry = self._entries[name]
        if len(entry.shape) != 4:
            raise BlockFileError(f"tensor {name} is not (batch, heads, tokens, width)")
        dtype = _DTYPES[entry.dtype][0]
        width = dtype.size
        if entry.begin % width == 0 and self.blob.shape[1] % width == 0:
            # The whole blob viewed as the tensor's type (contiguous: no copy), then its
            # columns: the one copy below moves words. Viewing the strided byte columns
            # instead copied them byte by byte first: 2 GB/s on the CPU (7-8 as words); on
            # the H200 0.21-0.27 s for a 32K agent's 4.3 GB of 16-bit blocks, 5 ms as words.
            rows = mx.view(self.blob, dtype)[first:, entry.begin // width : entry.end // width]
            x = rows.reshape(rows.shape[0], *entry.shape)
        else:
            rows = self.blob[first:, entry.begin : entry.end]
            x = mx.view(rows, dtype).reshape(rows.shape[0], *entry.shape)
        b, h, t, d = entry.shape
        # (n, B, H, T, D) -> (B, H, n*T, D): one copy on the device.
        return mx.moveaxis(x, 0, 2).reshape(b, h, rows.shape[0] * t, d)

    def names(self) -> list[str]:
        return [e.name for e in self.headers[0].tensors]


Verify = Callable[[BlockHeader, Sequence[tuple[str, Any]]], None]


def _runs(headers: Sequence[BlockHeader]) -> list[list[int]]:
    """Indices of ``headers`` in runs of consecutive ones of one layout (one array each)."""
    runs: list[list[int]] = []
    for i, hd in enumerate(headers):
        if runs and headers[runs[-1][0]].tensors == hd.tensors:  # same layout
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def read_groups(headers: list[BlockHeader], verify: Verify) -> list[BlockGroup]:
    """The data of ``headers`` (in order), grouped by layout, checked with ``verify(header,
    named)`` (the bytes just read, by tensor name; it raises on a mismatch: ``sound``) and
    uploaded one array per group."""
    runs = _runs(headers)
    try:
        return _read(headers, runs, verify, to_gpu=True)
    except cuda_memory.UploadError as exc:
        logger.warning("%s; reading this run through host memory instead", exc)
        return _read(headers, runs, verify, to_gpu=False)


def _read(
    headers: list[BlockHeader],
    runs: list[list[int]],
    verify: Verify,
    to_gpu: bool,
) -> list[BlockGroup]:
    widths = [headers[run[0]].data_len for run in runs]
    # On an NVIDIA GPU every file goes there from a pinned buffer, into GPU arrays made while
    # the threads read and check the first files (making a 32K agent's 1.5 GB of them took
    # 0.08 s on the H100, before a thread could start); elsewhere into host rows.
    gpu = to_gpu and cuda_memory.runtime() is not None
    rows_of = [None if gpu else _host_rows(len(run), w) for run, w in zip(runs, widths, strict=True)]
    hosts = [r[0] if r else None for r in rows_of]
    jobs = [(g, row, headers[i]) for g, run in enumerate(runs) for row, i in enumerate(run)]
    uploads: list[cuda_memory.Upload | None] = []
    made = threading.Event()

    def make() -> None:
        try:
            uploads.extend(cuda_memory.Upload.make(len(run), w) for run, w in zip(runs, widths, strict=True))
        finally:
            made.set()

    def load(job: tuple[int, int, BlockHeader]) -> None:
        g, row, hd = job
        host = hosts[g]
        with cuda_memory.staging(hd.data_len) if host is None else contextlib.nullcontext(host[row]) as dest:
            _fill(hd, dest, verify)
            if gpu:
                made.wait()
                up = uploads[g] if len(uploads) == len(runs) else None
                if up is None:  # the caller reads the run through host memory instead
                    raise cuda_memory.UploadError("no GPU array to copy the blocks into")
                up.write(row, dest)

    if len(jobs) > 1 and READ_THREADS > 1:
        done = read_pool().map(load, jobs)  # every job submitted: the threads read while the arrays are made
        if gpu:
            make()
        list(done)  # re-raises the first error, in order
    else:
        if gpu:
            make()
        for job in jobs:
            load(job)
    groups = []
    for g, run in enumerate(runs):
        up, rows = uploads[g] if gpu else None, rows_of[g]
        blob = up.array if up is not None else _as_array(*rows) if rows is not None else None
        assert blob is not None  # a group without its array raised in ``load``
        groups.append(BlockGroup([headers[i] for i in run], blob))
    return groups


def _fill(hd: BlockHeader, dest: Any, verify: Verify) -> None:
    """Read ``hd``'s data (or its selected ranges) into ``dest`` and ``verify`` it."""
    view, got = memoryview(dest), 0
    try:
        with open(hd.path, "rb") as f:
            for begin, end in hd.ranges or ((0, hd.data_len),):
                f.seek(hd.data_offset + begin)
                got += f.readinto(view[got : got + end - begin])
    except OSError as exc:
        raise BlockFileError(f"unreadable: {exc}") from exc
    if got != hd.data_len:
        raise BlockFileError(f"read {got} of {hd.data_len} bytes (truncated?)")
    small = hd.data_len <= GATHER_MAX_MEAN_BYTES * len(hd.tensors)
    if hd.ranges is None and READ_THREADS >= GATHER_THREADS and small:
        with gather.gathered(dest, hd.tensors) as stream:
            if stream is not None:
                verify(hd, Gathered(stream))
                return
    verify(hd, [(e.name, dest[e.begin : e.end]) for e in hd.tensors])


def read_joined(blocks: list[list[BlockHeader]], verify: Verify) -> list[BlockGroup]:
    """Blocks stored as segments, each read by ``join`` (on threads), then those of one
    layout in a row uploaded as one group, as ``read_groups`` does with whole blocks."""
    if len(blocks) > 1 and READ_THREADS > 1:
        rows = list(read_pool().map(lambda parts: join(parts, verify), blocks))
    else:
        rows = [join(parts, verify) for parts in blocks]
    headers = [header for header, _ in rows]
    return [
        BlockGroup([headers[i] for i in run], mx.array(np.stack([rows[i][1] for i in run])))
        for run in _runs(headers)
    ]


def join(parts: list[BlockHeader], verify: Verify) -> tuple[BlockHeader, np.ndarray]:
    """A block stored as segments: ``parts`` are the whole block of its first rows, then each
    segment (``block_files``). Each is read and verified, and their tensors' rows are joined
    on the host into one buffer laid out as a whole block of all its tokens (its tensors in
    the order a writer puts them): its header and data, read then as any block's (a join per
    tensor on the device took 4x a whole block's restore)."""
    datas = [np.empty(hd.data_len, np.uint8) for hd in parts]
    for hd, data in zip(parts, datas, strict=True):
        _fill(hd, data, verify)
    last = parts[-1]
    n, entries, offset = last.n_tokens, [], 0
    for e in sorted(last.tensors, key=lambda e: e.begin):
        shape = (*e.shape[:2], n, *e.shape[3:])
        size = _WIDTHS[e.dtype] * math.prod(shape)
        entries.append(TensorEntry(e.name, e.dtype, shape, offset, offset + size))
        offset += size
    out = np.empty(offset, np.uint8)
    tables = [{x.name: x for x in hd.tensors} for hd in parts]
    for e in entries:
        try:
            pieces = [data[t[e.name].begin : t[e.name].end] for data, t in zip(datas, tables, strict=True)]
        except KeyError:
            raise BlockFileError(f"{last.path}: a block it continues lacks tensor {e.name}") from None
        heads = math.prod(e.shape[:2])
        rows = np.concatenate([p.reshape(heads, -1) for p in pieces], axis=1)  # rows are the inner axis
        out[e.begin : e.end] = rows.reshape(-1)
    header = BlockHeader(last.path, last.data_offset, offset, tuple(sorted(entries, key=lambda e: e.name)),
                         last.meta, n)  # fmt: skip
    return header, out


def _host_rows(n: int, width: int) -> tuple[np.ndarray, mx.array | None]:
    """Host memory for a group's ``n`` rows, and the array it already is, if any: on the CPU
    the rows are the memory of the group's array itself (mlx shares a CPU array's buffer
    through the buffer protocol), so the bytes read are not copied again into fresh pages."""
    if mx.default_device() != mx.cpu:
        return np.empty((n, width), np.uint8), None
    blob = mx.zeros((n, width), mx.uint8)
    mx.eval(blob)
    return np.asarray(blob), blob


def _as_array(rows: np.ndarray, blob: mx.array | None) -> mx.array:
    return blob if blob is not None else mx.array(rows)
