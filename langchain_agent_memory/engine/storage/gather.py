"""A block's digest input gathered into one buffer by one system call, so that a reader
thread hashes it in one call (``reader``, ``checksums.Gathered``).

Why: a block's checksums (``checksums.checksum``, ``checksums.fast_checksum``) are taken over the
name, a NUL and the bytes of each of its tensors in name order: ~200 tensors in a block of
an 8B model, so ~400 ``update`` calls a block. Each call lets go of the GIL and takes it
back, and on 16 reader threads those hand-offs were most of a restore: on the H100 the
128 blocks (1.5 GB) of a 32K-token agent spent 1.8-2.1 s of thread time (0.21 s of wall)
in their checksums, where reading the same files and hashing each whole took 0.04 s
(``benchmarks/restore_profile.py``).

Here the pieces are written into a memory file (``memfd``) by one ``pwritev`` (the kernel
copies them; the GIL is let go once) and the digest reads that file's memory map in one
call: the very bytes the caller verifies and uploads, in the order the digest takes them.
Linux only; elsewhere, or where a call fails, ``gathered`` yields None and the caller hashes
piece by piece as before. Each memory file is kept for the next block (one per reader
thread at most: ``KEEP``).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
from collections.abc import Iterator, Sequence
from typing import Any

from ..ops.process import RUNTIME

logger = logging.getLogger(__name__)

#: Memory files kept between blocks (one per reader thread is used at a time).
KEEP = 16
_IOV_MAX = 1024  # Linux's limit of buffers per ``pwritev``
#: A layout's plan, by the id of its entries (a run's headers share one tuple): the entries,
#: then each tensor's (name NUL, begin, end) in name order, the sizes of the pieces, in all.
_plans: dict[int, tuple[Sequence[Any], list[tuple[bytes, int, int]], list[int], int]] = {}
_usable = hasattr(os, "memfd_create") and hasattr(os, "pwritev")


class _MemoryFile:
    def __init__(self, size: int) -> None:
        self.fd = os.memfd_create("agent-memory-digest", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self.map = mmap.mmap(self.fd, size)
        except OSError:
            os.close(self.fd)
            raise
        self.size = size

    def grow(self, size: int) -> None:
        self.map.close()
        os.ftruncate(self.fd, size)
        self.map, self.size = mmap.mmap(self.fd, size), size

    def close(self) -> None:
        self.map.close()
        os.close(self.fd)


def _plan(entries: Sequence[Any]) -> tuple[list[tuple[bytes, int, int]], list[int], int]:
    known = _plans.get(id(entries))
    if known is not None and known[0] is entries:
        return known[1], known[2], known[3]
    order = [(e.name.encode() + b"\x00", e.begin, e.end) for e in sorted(entries, key=lambda e: e.name)]
    sizes = [n for prefix, begin, end in order for n in (len(prefix), end - begin)]
    with RUNTIME.lock:
        if len(_plans) > 256:
            _plans.clear()
        _plans[id(entries)] = (entries, order, sizes, sum(sizes))
    return order, sizes, sum(sizes)


def _take(size: int) -> _MemoryFile:
    """A kept memory file of at least ``size`` bytes: the smallest that fits, else the
    largest, grown (a thread's file grows to the largest block it reads, once; with a new
    file for each block larger than those kept, closed after, a 16-bit 32K restore on the
    H100 took 0.63 s to load where it had taken 0.39)."""
    kept = _kept()
    with RUNTIME.lock:
        fits = [f for f in kept if f.size >= size]
        f = min(fits, key=lambda f: f.size) if fits else max(kept, key=lambda f: f.size, default=None)
        if f is not None:
            kept.remove(f)
    size = -(-size // (1 << 20)) << 20  # whole MiB: a slightly larger block fits
    if f is None:
        return _MemoryFile(size)
    if f.size < size:
        try:
            f.grow(size)
        except OSError:
            f.close()
            raise
    return f


def _give(f: _MemoryFile) -> None:
    kept = _kept()
    with RUNTIME.lock:
        if len(kept) < KEEP:
            kept.append(f)
            return
    f.close()


def _kept() -> list[_MemoryFile]:
    """The memory files kept between blocks: the process runtime's (closed at its shutdown)."""
    return RUNTIME.stock("digest buffers", list, _close)


def _close(files: list[_MemoryFile]) -> None:
    with RUNTIME.lock:
        closing = list(files)
        files.clear()
    for f in closing:
        f.close()


def release() -> None:
    """Close the memory files kept between blocks (up to ``KEEP`` blocks' worth of memory:
    ~0.5 GB for 16 threads at 16-bit blocks of an 8B model), as when an engine closes; the
    next read makes new ones."""
    _close(_kept())


@contextlib.contextmanager
def gathered(data: Any, entries: Sequence[Any]) -> Iterator[memoryview | None]:
    """The digest input of a whole block read into ``data`` (``entries``: its tensors, each
    with ``name``, ``begin`` and ``end`` in ``data``): each name, a NUL and its bytes, in name
    order, as one buffer (valid inside the block); None where it cannot be made."""
    global _usable
    if not _usable:
        yield None
        return
    order, sizes, total = _plan(entries)
    view = memoryview(data).cast("B")
    pieces: list[Any] = []
    for prefix, begin, end in order:
        pieces += (prefix, view[begin:end])
    try:
        f = _take(total)
    except OSError as exc:
        logger.info("no memory file for block digests (%s): hashing tensor by tensor", exc)
        _usable = False
        yield None
        return
    stream = None
    try:
        try:
            at = 0
            for i in range(0, len(pieces), _IOV_MAX):
                want = sum(sizes[i : i + _IOV_MAX])
                if os.pwritev(f.fd, pieces[i : i + _IOV_MAX], at) != want:
                    raise OSError(f"short write of a block's digest input ({want} bytes)")
                at += want
            stream = memoryview(f.map)[:total]
        except OSError as exc:
            logger.info("block digest input not gathered (%s): hashing tensor by tensor", exc)
        yield stream
    finally:
        if stream is not None:
            stream.release()
        _give(f)
