"""What importing the package does to the process's BLAS (engine/ops/runtime.py)."""

from __future__ import annotations

import platform
import sys

import pytest

from langchain_agent_memory.engine.ops import runtime

X86_LINUX = sys.platform == "linux" and platform.machine() == "x86_64"


@pytest.mark.skipif(
    not X86_LINUX or runtime.gpu_backend() is not None, reason="MKL is loaded on x86-64 Linux CPUs only"
)
def test_fast_blas_is_loaded() -> None:
    assert runtime.BLAS == "mkl"
