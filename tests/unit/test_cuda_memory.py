"""The GPU upload helpers (engine/ops/cuda_memory.py) where no CUDA runtime is: every entry point
says "not done" and the caller's host path runs; staging buffers of any size are reused; the
block reader's GPU path, with its copies faked in host memory."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest

from langchain_agent_memory.engine.ops import cuda_memory, device
from langchain_agent_memory.engine.ops.runtime import mx
from langchain_agent_memory.engine.storage import reader
from langchain_agent_memory.engine.storage.blocks import Block, CacheFormatError, block_hash
from langchain_agent_memory.engine.storage.store import DiskBlockStore


@pytest.mark.skipif(device.on_gpu(), reason="a GPU has a CUDA runtime: benchmarks/gpu.py covers that path")
def test_without_cuda_uploads_fall_back_to_host_memory() -> None:
    assert cuda_memory.Upload.make(4, 1024) is None
    with cuda_memory.staging(1000) as buf:  # a plain host buffer of the size asked for
        assert buf.nbytes == 1000 and buf.dtype == np.uint8


def test_staging_lends_the_smallest_buffer_that_fits_and_takes_it_back(monkeypatch) -> None:
    small, large = np.zeros(12 << 20, np.uint8), np.zeros(34 << 20, np.uint8)
    monkeypatch.setattr(cuda_memory.staging_buffers(), "free", [large, small])
    with cuda_memory.staging(11_534_336) as a:  # files of different sizes in one load
        assert a.nbytes == 11_534_336 and np.shares_memory(a, small)
        with cuda_memory.staging(33_554_432) as b:
            assert np.shares_memory(b, large)
            assert cuda_memory.staging_buffers().free == []
    assert sorted(x.nbytes for x in cuda_memory.staging_buffers().free) == [12 << 20, 34 << 20]


class _FakeUpload:
    """``cuda_memory.Upload`` without CUDA: the rows a reader thread copies, in host memory."""

    made: ClassVar[list[_FakeUpload]] = []
    fail = False

    def __init__(self, rows: int, width: int) -> None:
        self.rows, self.width = np.zeros((rows, width), np.uint8), width

    @classmethod
    def make(cls, rows: int, width: int) -> _FakeUpload | None:
        up = None if cls.fail else cls(rows, width)
        cls.made.append(up)
        return up

    def write(self, row: int, data: np.ndarray) -> None:
        self.rows[row] = data

    @property
    def array(self) -> mx.array:
        return mx.array(self.rows)


@pytest.mark.parametrize("fail", [False, True])
def test_the_gpu_read_path_lands_every_block_in_its_row(tmp_path: Path, monkeypatch, fail: bool) -> None:
    """The reader's NVIDIA path (``reader._read``: reader threads start on the files while
    the GPU arrays are made, then copy into them), with the copies faked in host memory:
    the groups equal a host read's, a run whose array cannot be made is read through host
    memory, and a damaged block is still refused."""
    store = DiskBlockStore(tmp_path, "model-a")
    hashes, parent = [], None
    for i in range(6):
        mx.random.seed(i)
        tensors = {"L0.k": mx.random.normal((1, 2, 4, 8)).astype(mx.float16), "L1.v": mx.zeros((1, 2, 4, 16))}
        tokens = [4 * i + j for j in range(4)]
        blk = Block(block_hash(parent, tokens, "model-a"), parent, tokens, tensors)
        store.blocks.put(blk)
        hashes.append(parent := blk.hash)
    expected = store.blocks.read(hashes)
    monkeypatch.setattr(cuda_memory, "runtime", lambda: object())
    monkeypatch.setattr(cuda_memory, "Upload", _FakeUpload)
    monkeypatch.setattr(cuda_memory, "staging", lambda n: contextlib.nullcontext(np.empty(n, np.uint8)))
    monkeypatch.setattr(reader, "READ_THREADS", 4)
    monkeypatch.setattr(reader, "GATHER_THREADS", 0)
    monkeypatch.setattr(_FakeUpload, "made", [])
    monkeypatch.setattr(_FakeUpload, "fail", fail)
    got = store.blocks.read(hashes)
    assert len(_FakeUpload.made) == len(expected) and len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert mx.array_equal(a.blob, b.blob).item() and a.names() == b.names()
    path = store.blocks.path(hashes[3])
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x04
    path.write_bytes(bytes(data))
    with pytest.raises(CacheFormatError, match="checksum"):
        store.blocks.read(hashes)
