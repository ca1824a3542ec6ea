"""Make MLX fast on a CPU before anything imports it.

The Linux CPU wheel of mlx links a reference BLAS (~3 GFLOP/s fp32 matmul on the 2-core
development machine). `libmlx.so` resolves `cblas_sgemm` through the process's global
symbol scope first, so a BLAS loaded with RTLD_GLOBAL *before* mlx wins. Intel's MKL from
the `mkl` wheel exports the plain CBLAS names (the `scipy-openblas32` wheel prefixes every
symbol with `scipy_`, so it cannot stand in) and measured 245 GFLOP/s on the same machine.

Import this module (every module of the package that needs mlx imports `mx` from here).

What the package does to the whole process (the one list of it; everything else it
changes belongs to one engine or one loaded model instance):

- On import, on an x86-64 Linux CPU: loads MKL's ``libmkl_rt`` with RTLD_GLOBAL before
  mlx and sets ``MKL_THREADING_LAYER=INTEL`` unless set. Opt out:
  ``AGENT_MEMORY_BLAS=bundled``, or import mlx before this package (both keep mlx's BLAS).
- On import: ``TRANSFORMERS_NO_ADVISORY_WARNINGS=1`` unless set (mlx-lm's tokenizers
  would print a PyTorch advisory on every start). Opt out: set it yourself.
- On import, on Linux with neither Metal nor CUDA: ``mx.set_default_device(mx.cpu)``
  (nothing else could run there).
- While an engine holds a working-copy reserve (``kv.reserve.WorkReserve``, the CPU):
  mlx's cache limit is raised by the reserve's bytes and lowered back when it is released
  (``Engine.close``). Opt out: ``reserve_work=False`` (``AGENT_MEMORY_RESERVE_WORK=0``).
- On a GPU, between prefill chunks: ``mx.clear_cache()`` when mlx's buffer cache holds more
  than ``device.prefill_cache_bound()`` (a long prefill's freed buffers of sizes nothing
  reuses filled an H200). Other mlx users of the process lose cached buffers, not data.
- On ``Engine.close()`` and ``loading.unload_models``, with glibc: ``malloc_trim(0)``, so
  the C heap's free pages go back to the system (a closed engine's freed arrays stayed in
  the process: 2.3 GB of 5.0 GB after the random-weight model tests). Nothing else changes.
- Threads: every thread the engine starts is a daemon lent by the process runtime
  (``process.RUNTIME``: an engine's model thread, saves and commit notices, a shared
  store's I/O, the hash and read pools); ``engine.shutdown()`` ends them, and the loaded
  models, shared engines and buffers it keeps.

Not process-wide: ``load_model(cpu_kernels=True)`` switches the module instances of the
one model it loads to subclasses (``model.adapters``); ``cpu_kernels=False`` opts out.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

#: What was loaded: "mkl", "bundled" (mlx's own) or "system" (not Linux: Accelerate etc.).
BLAS: str = "system"


def _find_mkl_rt() -> Path | None:
    try:
        files = importlib.metadata.distribution("mkl").files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name.startswith("libmkl_rt.so"):
            path = Path(str(f.locate())).resolve()
            if path.exists():
                return path
    return None


#: mlx's GPU backends on Linux (the package's ``cuda`` extra: ``config.install_hint``).
GPU_BACKENDS = ("mlx-cuda-13", "mlx-cuda-12")


def gpu_backend() -> str | None:
    """The installed CUDA backend of mlx, if any (read from package metadata, before mlx
    is imported)."""
    for name in GPU_BACKENDS:
        try:
            importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        return name
    return None


def _load_fast_blas() -> str:
    if not sys.platform.startswith("linux"):
        return "system"  # macOS: mlx uses Accelerate; nothing to do.
    if gpu_backend() is not None:
        return "bundled"  # a CUDA machine: matmuls run on the GPU, MKL is not needed there
    if "mlx.core" in sys.modules:
        logger.warning("mlx was imported before langchain_agent_memory: keeping its bundled BLAS")
        return "bundled"
    if os.environ.get("AGENT_MEMORY_BLAS", "").lower() == "bundled":
        return "bundled"
    mkl = _find_mkl_rt()
    if mkl is None:
        logger.warning(
            "MKL not found (pip install mkl): mlx falls back to its reference BLAS, ~70x slower matmuls"
        )
        return "bundled"
    # NOTE: MKL's runtime picks the threading layer from this variable; Intel OpenMP comes
    # with the `mkl` wheel. Respect a value the user already set.
    os.environ.setdefault("MKL_THREADING_LAYER", "INTEL")
    ctypes.CDLL(str(mkl), mode=ctypes.RTLD_GLOBAL)
    return "mkl"


BLAS = _load_fast_blas()
# NOTE: mlx-lm imports transformers only for tokenizers; its "PyTorch was not found"
# advisory on every start is noise for us (we never run torch models).
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

try:
    import mlx.core as mx  # must follow the BLAS preload
except (ImportError, OSError) as exc:  # Linux: mlx installed without a backend
    from ...config import install_hint  # the package is not on PyPI: its extras' requirements

    raise ImportError(
        f"mlx cannot load a backend ({exc}). On Linux mlx's backend is an extra: "
        f"{install_hint('cpu')} (the CPU), or {install_hint('cuda')} (an NVIDIA GPU, CUDA 13; "
        f"{install_hint('cuda12')} for CUDA 12)"
    ) from exc

if sys.platform.startswith("linux") and not mx.metal.is_available():
    # CUDA builds report a GPU device; only pin the CPU where no accelerator exists.
    if not (hasattr(mx, "cuda") and mx.cuda.is_available()):
        mx.set_default_device(mx.cpu)

_THREAD = threading.local()


def side_streams() -> tuple[Any, Any] | tuple[None, None]:
    """Two CPU streams of this thread beside its default one: mlx runs each stream on a
    thread of its own, so work put on them runs on the other core, beside the model
    (a working copy's keys and values decoded at once; a wide GEMV's two halves). On a GPU
    (its own streams) None, None. Streams belong to the thread that made them: one pair per
    thread."""
    if mx.default_device() != mx.cpu:
        return None, None
    pair = getattr(_THREAD, "side_streams", None)
    if pair is None:
        pair = _THREAD.side_streams = (mx.new_stream(mx.cpu), mx.new_stream(mx.cpu))
    return pair


def _malloc_trim() -> Any:
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc only (not musl, not macOS)
    except (AttributeError, OSError):
        return None


_TRIM = _malloc_trim() if sys.platform.startswith("linux") else None


def release_memory() -> None:
    """Freed memory back to the system: mlx's buffer cache, then the C heap's free pages
    (glibc keeps them in the process otherwise: freed arrays are allocated with malloc on
    the CPU). For after an engine closed or models were unloaded, not per step."""
    mx.clear_cache()
    if _TRIM is not None:
        _TRIM(0)


__all__ = ["BLAS", "mx", "release_memory", "side_streams"]
