"""Bytes read from disk onto an NVIDIA GPU at the copy engine's speed (mlx's CUDA build).

Measured on the H200 (benchmarks/gpu_probe.py upload, 1.5 GB of block files in the page
cache; ../shared/FACTS.md): reading them on 16 threads takes 0.035 s (0.10 s with SHA-256),
but ``mx.array(numpy_array)`` takes 0.6-0.75 s. mlx's CUDA build keeps an array made from
host memory in CUDA *managed* memory, and the host's first touch of fresh managed pages is
what costs (~2.5 GB/s); the first kernel that reads them then migrates them fault by fault
(another 0.1-0.16 s; ``cudaMemPrefetchAsync`` would move them in 0.03 s, but the first
touch is the larger cost).

So a block run is uploaded the other way round: the destination is made on the GPU
(``mx.zeros``, then handed out as managed memory whose pages are already on the GPU), and
each file's bytes go there with ``cudaMemcpy`` from the reader thread that read them, while
the other threads read on. Each thread reads into a pinned host buffer (``staging``; kept
for the next load): from pageable memory the driver stages every copy itself, which
measured 0.30 s for the 1.5 GB where reading and hashing took 0.13 s. The runtime library
is the one mlx loaded (``libcudart``); where it or a call is unavailable (Metal, the CPU,
another CUDA), ``Upload`` is None and the caller uses ``mx.array`` as before: only speed
depends on this module, never a result.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
from collections.abc import Iterator
from typing import Any

import numpy as np

from .process import RUNTIME
from .runtime import gpu_backend, mx

logger = logging.getLogger(__name__)

_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from the pointers (unified addressing)


class UploadError(OSError):
    """A CUDA call of an upload failed (the caller reads through host memory instead)."""


class _Runtime:
    """The few CUDA runtime calls used here, from the ``libcudart`` mlx loaded."""

    def __init__(self, lib: Any, version: int) -> None:
        self.lib, self.version = lib, version  # benchmarks/gpu_probe.py binds more of it
        self.memcpy = lib.cudaMemcpy
        self.memcpy.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        self.memcpy.restype = ctypes.c_int
        self.host_alloc = lib.cudaMallocHost
        self.host_alloc.argtypes = (ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t)
        self.host_alloc.restype = ctypes.c_int
        self.host_free = lib.cudaFreeHost
        self.host_free.argtypes = (ctypes.c_void_p,)
        self.host_free.restype = ctypes.c_int


def _load() -> _Runtime | None:
    if gpu_backend() is None or mx.default_device().type != mx.DeviceType.gpu:
        return None
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        version = ctypes.c_int(0)
        if lib.cudaRuntimeGetVersion(ctypes.byref(version)) == 0:
            return _Runtime(lib, version.value)
    logger.info("libcudart not found: block uploads go through mx.array (slower first touch)")
    return None


def runtime() -> _Runtime | None:
    """The CUDA runtime mlx loaded (looked for once: the process runtime keeps the answer)."""
    return RUNTIME.stock("cuda runtime", _load, _keep)


def _keep(_: object) -> None:
    """The library stays loaded (mlx holds it too)."""


def _address(a: mx.array) -> int:
    """The (managed) address of evaluated ``a``'s data: the buffer protocol moves a device
    array to managed memory, by a copy on the GPU (its pages stay there)."""
    return int(np.asarray(memoryview(a)).ctypes.data)


class Upload:
    """A (rows, width) uint8 array on the GPU that host rows are copied into."""

    def __init__(self, rt: _Runtime, rows: int, width: int) -> None:
        self._rt = rt
        self.array = mx.zeros((rows, width), mx.uint8)
        mx.eval(self.array)
        self._base = _address(self.array)
        self.width = width

    @classmethod
    def make(cls, rows: int, width: int) -> Upload | None:
        rt = runtime()
        if rt is None:
            return None
        try:
            return cls(rt, rows, width)
        except Exception as exc:  # any failure: the caller uploads through mx.array
            logger.info("GPU upload buffer unavailable (%s): using mx.array", exc)
            return None

    def write(self, row: int, data: np.ndarray) -> None:
        """Copy one row (``data``: ``width`` contiguous bytes in host memory) to the GPU
        (synchronous: ``array`` holds the row when this returns)."""
        if data.nbytes != self.width:
            raise ValueError(f"a row is {self.width} bytes, not {data.nbytes}")
        err = self._rt.memcpy(self._base + row * self.width, data.ctypes.data, data.nbytes, _MEMCPY_DEFAULT)
        if err != 0:
            raise UploadError(f"cudaMemcpy to the GPU failed (CUDA error {err})")


#: Pinned staging buffers, at most this many bytes in all (one per reader thread is used).
STAGING_LIMIT = 1 << 30


class StagingBuffers:
    """Host buffers that block files are read into before ``Upload.write``: pinned ones,
    allocated once and reused by later loads (``STAGING_LIMIT`` in all), the process
    runtime's until its shutdown (``release``)."""

    def __init__(self) -> None:
        self.free: list[np.ndarray] = []
        self.pinned_bytes = 0
        self._pinned: list[np.ndarray] = []
        self._rt: _Runtime | None = None  # the runtime that pinned them

    def take(self, nbytes: int) -> np.ndarray | None:
        """The smallest free buffer of at least ``nbytes``, or a new pinned one while the
        limit allows; None: none (the caller reads into pageable memory)."""
        with RUNTIME.lock:
            fits = [i for i, b in enumerate(self.free) if b.nbytes >= nbytes]
            if fits:  # the smallest that fits (by index: ``==`` on arrays compares elements)
                return self.free.pop(min(fits, key=lambda i: self.free[i].nbytes))
            rt = runtime()
            if rt is None or self.pinned_bytes + nbytes > STAGING_LIMIT:
                return None
            size = -(-nbytes // (1 << 20)) << 20  # whole MiB: a later, slightly larger file fits
            ptr = ctypes.c_void_p()
            if rt.host_alloc(ctypes.byref(ptr), size) != 0 or not ptr.value:
                return None
            buf = np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(ptr.value))
            self.pinned_bytes += size
            self._rt = rt
            self._pinned.append(buf)
            return buf

    def give(self, buf: np.ndarray) -> None:
        with RUNTIME.lock:
            self.free.append(buf)

    def release(self) -> None:
        """Free the pinned buffers (every load has ended: the runtime shuts down)."""
        with RUNTIME.lock:
            pinned = self._pinned
            self._pinned = []
            self.free = []
            self.pinned_bytes = 0
        for buf in pinned:
            if self._rt is not None:
                self._rt.host_free(buf.ctypes.data)


def staging_buffers() -> StagingBuffers:
    return RUNTIME.stock("staging buffers", StagingBuffers, StagingBuffers.release)


@contextlib.contextmanager
def staging(nbytes: int) -> Iterator[np.ndarray]:
    """A host buffer of ``nbytes`` to read a file into before ``Upload.write``: pinned
    (allocated once, reused by later loads) while ``STAGING_LIMIT`` allows, else pageable."""
    buffers = staging_buffers()
    buf = buffers.take(nbytes)
    if buf is None:
        yield np.empty(nbytes, np.uint8)
        return
    try:
        yield buf[:nbytes]
    finally:
        buffers.give(buf)
