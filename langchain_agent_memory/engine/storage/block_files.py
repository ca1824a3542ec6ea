"""The block files of a cache directory (a store's ``local.blocks``; a local store's
``blocks`` role, ``protocols.BlockStoreBlocks``): ``blocks/<h[:2]>/<h>.safetensors``, each
written atomically once (blocks are content-addressed and immutable), read only after its
header and checksums are verified, and moved to ``quarantine/`` when it proves bad."""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Collection, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, serialize_file

from ..ops.files import TEMP_PREFIX, atomic_write
from .blocks import (
    BLOCK_TOKENS,
    FORMAT_VERSION,
    SEGMENTS_FORMAT_VERSION,
    Block,
    BlockHash,
    BlockMissingError,
    CacheFormatError,
    block_hash,
    block_lineage,
    host_views,
    prior_hash,
    raise_if_vanished,
    version_error,
)
from .checksums import block_checksums
from .reader import (
    BlockFileError,
    BlockGroup,
    BlockHeader,
    Layouts,
    read_groups,
    read_header,
    read_joined,
    select,
    sound,
)


class BlockFiles:
    """The block files of one model (``fingerprint``) under ``directory``."""

    def __init__(self, directory: Path, fingerprint: str) -> None:
        self.fingerprint = fingerprint
        self.dir = directory / "blocks"
        self.quarantine_dir = directory / "quarantine"
        #: Block -> the block of its earlier rows (None: whole), as its header says: blocks
        #: are immutable, so an answer holds for as long as the block does.
        self._priors: dict[BlockHash, BlockHash | None] = {}
        #: Tensor tables checked before, by data length (``read_header``): kept across reads,
        #: as a segment's table (its rows' count) comes back in later reads and other agents'.
        self._layouts: Layouts = {}

    def path(self, h: BlockHash) -> Path:
        if len(h) != 64 or any(c not in "0123456789abcdef" for c in h):
            raise ValueError(f"not a block hash: {h!r}")
        return self.dir / h[:2] / f"{h}.safetensors"

    def has(self, h: BlockHash) -> bool:
        return self.path(h).exists()

    def leading(self, hashes: Sequence[BlockHash]) -> int:
        """How many of ``hashes``, from the first, are here."""
        return next((i for i, h in enumerate(hashes) if not self.has(h)), len(hashes))

    def local_bytes(self, hashes: Iterable[BlockHash]) -> int:
        """Bytes of these blocks' files (those missing count nothing)."""
        total = 0
        for h in hashes:
            with contextlib.suppress(FileNotFoundError):
                total += self.path(h).stat().st_size
        return total

    def put(self, block: Block) -> int:
        """Write ``block`` unless it exists; return the bytes written (0 if it existed)."""
        path = self.path(block.hash)
        if path.exists():
            return 0
        host = block.host or host_views(block.tensors)
        m, n = block.rows_from, len(block.token_ids)
        if m and any(t.shape[2] != n for t in host.values()):
            raise ValueError(f"block {block.hash[:12]}: a segment's tensors hold every token of the block")
        tensors = {k: (t.rows(m, n) if m else t).packed() for k, t in host.items()}
        lineage = {
            "format_version": str(SEGMENTS_FORMAT_VERSION if m else FORMAT_VERSION),
            "fingerprint": self.fingerprint,
            "hash": block.hash,
            "parent": block.parent or "",
            "token_ids": json.dumps(block.token_ids),
        }
        if m:  # the rows before are the block of its first m tokens (``Block.prior``)
            lineage["rows_from"] = str(m)
        self._priors[block.hash] = block.prior(self.fingerprint)
        # SHA-256 and XXH3-128, whole and each layer's own (for reads of some layers only:
        # ``reader.select``); a reader checks the fastest it knows.
        meta = block_checksums([(k, t.data) for k, t in tensors.items()], lineage)
        # safetensors' own writer over host arrays: no MLX op, so any thread may write.
        specs = {k: t.spec() for k, t in tensors.items()}
        return atomic_write(path, lambda tmp: _serialize(specs, tmp, meta))

    def get(self, h: BlockHash, names: Sequence[str] | None = None) -> Block:
        """Read a block (all tensors, or only ``names``), verified against its header.

        Raises ``BlockMissingError`` or ``CacheFormatError`` (corrupt, truncated, another
        model's, a newer format); never returns unverified data.
        """
        (group,) = self.read([h])
        header = group.headers[0]
        wanted = group.names() if names is None else list(names)
        missing = [k for k in wanted if k not in group.names()]
        if missing:
            raise CacheFormatError(f"block file {header.path} lacks tensors {missing[:3]}")
        token_ids, parent = block_lineage(header)
        return Block(h, parent, token_ids, {k: group.tensor(k) for k in wanted}, rows_from=_rows_from(header))

    def prior_of(self, h: BlockHash) -> BlockHash | None:
        """The block holding segment ``h``'s earlier rows (None: ``h`` is whole)."""
        if h not in self._priors:
            (header,) = self._headers([h])
            self._priors[h] = self._prior(header)
        return self._priors[h]

    def _prior(self, header: BlockHeader) -> BlockHash | None:
        m = _rows_from(header)
        if not m:
            return None
        token_ids, parent = block_lineage(header)
        return prior_hash(parent, token_ids, m, self.fingerprint)

    def read(self, hashes: Sequence[BlockHash], layers: Collection[int] | None = None) -> list[BlockGroup]:
        """The blocks ``hashes`` (in order), verified, as groups of consecutive blocks of one
        tensor layout, each uploaded to the device as one array (``reader``). ``layers``: only
        these layers' tensors are needed (read alone where every block has per-layer
        checksums; blocks written before them are read whole). A segment comes as a group of
        its own: the blocks of its earlier rows and its own rows, joined."""
        headers = self._headers(hashes)
        parts = [self._parts(hd) for hd in headers]  # a whole block: itself alone
        out: list[BlockGroup] = []
        i = 0
        while i < len(parts):  # runs of whole blocks, runs of segmented ones
            j = i + 1
            while j < len(parts) and (len(parts[j]) == 1) == (len(parts[i]) == 1):
                j += 1
            if len(parts[i]) == 1:
                out += self._read([p[0] for p in parts[i:j]], layers)
            else:
                out += self._read_joined(parts[i:j], layers)
            i = j
        return out

    def _parts(self, header: BlockHeader) -> list[BlockHeader]:
        """The headers a block is read from: the blocks of a segment's earlier rows (back to a
        whole one), then its own. ``CacheFormatError`` (the segment is unreadable) where one
        of them is missing, damaged or does not lead up to it."""
        out = [header]
        while m := _rows_from(out[-1]):
            prior = self._prior(out[-1])
            assert prior is not None
            try:
                (before,) = self._headers([prior])
            except CacheFormatError as exc:  # missing too: the segment cannot be read
                raise CacheFormatError(
                    f"block file {header.path} continues block {prior[:12]}, which is unreadable: {exc}"
                ) from exc
            if before.n_tokens != m or len(out) > BLOCK_TOKENS:
                raise CacheFormatError(f"block file {out[-1].path} does not continue block {prior[:12]}")
            out.append(before)
        return out[::-1]

    def _headers(self, hashes: Sequence[BlockHash]) -> list[BlockHeader]:
        headers = []
        layouts = self._layouts
        if len(layouts) > 4096:  # one per row count and layer set, in practice a few hundred
            layouts.clear()
        for h in hashes:
            path = self.path(h)
            if not path.exists():
                raise BlockMissingError(f"block {h[:12]} is missing from {self.dir}")
            try:
                header = read_header(path, layouts)
            except BlockFileError as exc:
                raise_if_vanished(exc, path)
                raise CacheFormatError(
                    f"block file {path} is unreadable (truncated or corrupt): {exc}"
                ) from None
            self._check_header(h, header)
            headers.append(header)
        return headers

    def _read(self, headers: list[BlockHeader], layers: Collection[int] | None) -> list[BlockGroup]:
        with self._unreadable():
            return read_groups(_selected(headers, layers), _verify)

    def _read_joined(
        self, blocks: list[list[BlockHeader]], layers: Collection[int] | None
    ) -> list[BlockGroup]:
        with self._unreadable():
            return read_joined([_selected(parts, layers) for parts in blocks], _verify)

    @contextlib.contextmanager
    def _unreadable(self) -> Iterator[None]:
        """A read's ``BlockFileError`` as the store's errors: missing if a file vanished
        meanwhile, else ``CacheFormatError``."""
        try:
            yield
        except BlockFileError as exc:
            raise_if_vanished(exc, self.dir)
            raise CacheFormatError(f"a block file is unreadable (truncated or corrupt): {exc}") from exc

    def _check_header(self, h: BlockHash, header: BlockHeader) -> None:
        meta, path = header.meta, header.path
        version = meta.get("format_version")
        if version not in (str(FORMAT_VERSION), str(SEGMENTS_FORMAT_VERSION)):
            raise version_error(f"block {path.name}", _int_or(version), SEGMENTS_FORMAT_VERSION)
        if (version == str(SEGMENTS_FORMAT_VERSION)) != ("rows_from" in meta):
            raise CacheFormatError(f"block file {path} has a corrupt header: version {version}, rows_from")
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
        m = _rows_from(header)
        rows = len(token_ids) - m
        if m and not (0 < m < len(token_ids) and all(e.shape[2] == rows for e in header.tensors)):
            raise CacheFormatError(f"block file {path} holds rows that do not continue its block")

    def delete(self, h: BlockHash) -> None:
        self._priors.pop(h, None)
        with contextlib.suppress(FileNotFoundError):
            self.path(h).unlink()

    def hashes(self) -> Iterator[BlockHash]:
        for p in self.dir.glob("*/*.safetensors"):
            if not p.name.startswith(TEMP_PREFIX):
                yield BlockHash(p.stem)

    def quarantine(self, h: BlockHash) -> Path | None:
        """Move a bad block file aside (kept for inspection, never read again)."""
        src = self.path(h)
        if not src.exists():
            return None
        dst = self.quarantine_dir / f"{h}.{time.time_ns()}.safetensors"
        dst.parent.mkdir(exist_ok=True)
        os.replace(src, dst)
        return dst


def _selected(headers: list[BlockHeader], layers: Collection[int] | None) -> list[BlockHeader]:
    """Only ``layers``' tensors, where every block can be checked layer by layer."""
    if layers is not None and all("part_checksums" in hd.meta for hd in headers):
        wanted = {f"L{i}" for i in layers}
        return [select(hd, wanted) for hd in headers]
    return headers


def _verify(header: BlockHeader, named: Sequence[tuple[str, Any]]) -> None:
    try:
        ok = sound(header, named)
    except BlockFileError as exc:
        raise CacheFormatError(f"block file {exc}") from exc
    if not ok:
        raise CacheFormatError(f"block file {header.path} failed its checksum: the data is corrupt")


def _rows_from(header: BlockHeader) -> int:
    """A segment's first row (0: a whole block); ``CacheFormatError`` if unreadable."""
    try:
        return int(header.meta.get("rows_from", 0))
    except ValueError:
        raise CacheFormatError(f"block file {header.path} has a corrupt header: rows_from") from None


def _int_or(value: Any) -> Any:
    try:
        return int(value)
    except (TypeError, ValueError):
        return value


def _serialize(specs: dict[str, Any], tmp: str, meta: dict[str, str]) -> None:
    """safetensors' writer, its I/O errors raised as the ``OSError`` they are: its own error
    type carries a refused write ("No space left on device (os error 28)") as text only, and
    a save tells a disk that refuses it (``CacheWriteError``) from a bug by ``OSError``."""
    try:
        serialize_file(specs, tmp, metadata=meta)
    except SafetensorError as exc:
        code = re.search(r"\(os error (\d+)\)", str(exc))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), tmp) from exc
