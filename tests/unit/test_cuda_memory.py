"""The GPU upload helpers (engine/ops/cuda_memory.py) where no CUDA runtime is: every entry point
says "not done" and the caller's host path runs; staging buffers of any size are reused."""

from __future__ import annotations

import numpy as np
import pytest

from langchain_agent_memory.engine.ops import cuda_memory, device


@pytest.mark.skipif(device.on_gpu(), reason="a GPU has a CUDA runtime: benchmarks/gpu.py covers that path")
def test_without_cuda_uploads_fall_back_to_host_memory() -> None:
    assert cuda_memory.Upload.make(4, 1024) is None
    with cuda_memory.staging(1000) as buf:  # a plain host buffer of the size asked for
        assert buf.nbytes == 1000 and buf.dtype == np.uint8


def test_staging_lends_the_smallest_buffer_that_fits_and_takes_it_back(monkeypatch) -> None:
    small, large = np.zeros(12 << 20, np.uint8), np.zeros(34 << 20, np.uint8)
    monkeypatch.setattr(cuda_memory, "_staging_free", [large, small])
    with cuda_memory.staging(11_534_336) as a:  # files of different sizes in one load
        assert a.nbytes == 11_534_336 and np.shares_memory(a, small)
        with cuda_memory.staging(33_554_432) as b:
            assert np.shares_memory(b, large)
            assert cuda_memory._staging_free == []
    assert sorted(x.nbytes for x in cuda_memory._staging_free) == [12 << 20, 34 << 20]
