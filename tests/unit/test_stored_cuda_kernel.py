"""The CUDA kernels of ``kv.stored_cuda`` run on this CPU: their source is compiled as C++
(g++) with a thread per CUDA thread, a barrier for ``__syncthreads`` and for each warp
shuffle, and the blocks run one after another. They must equal the kernel's oracle
(``reference_body_attention``) over keys and values quantized by mlx: every width from 2 to
8 bits, groups of 32 to 128, head widths 64 to 256, left-padded batch rows (``starts``) and
a body that is a view with room (strides). On the H200, ``pytest -m gpu`` runs the same
source through mlx (tests/integration/test_gpu.py)."""

from __future__ import annotations

import math
import shutil
import subprocess
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from langchain_agent_memory.engine.kv import stored_cuda
from langchain_agent_memory.engine.kv.codecs import TensorCodec

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to run the kernels on the CPU")

#: What mlx's CUDA headers give a kernel, for the CPU: one thread per CUDA thread of a block.
EMULATION = r"""
#include <algorithm>
#include <array>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <thread>
#include <vector>
struct __half { uint16_t x; };
inline float __half2float(__half h) {
  const uint32_t e = (h.x >> 10) & 31, m = h.x & 1023;
  float v = e == 0 ? std::ldexp((float)m, -24)
          : e == 31 ? (m ? NAN : INFINITY)
                    : std::ldexp((float)(m | 1024), (int)e - 25);
  return (h.x >> 15) ? -v : v;
}
struct dim3 { int x = 0, y = 0, z = 0; };
thread_local dim3 threadIdx;
dim3 blockIdx, gridDim, blockDim;
std::barrier<>* block_barrier;
float exchange[1024];
inline void __syncthreads() { block_barrier->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int o) {
  const int t = threadIdx.x;
  block_barrier->arrive_and_wait(); exchange[t] = v; block_barrier->arrive_and_wait();
  const float r = exchange[t ^ o]; block_barrier->arrive_and_wait(); return r;
}
#define inf std::numeric_limits<float>::infinity()
#define __shared__ static
using Shape = std::array<int32_t, 8>;
using Strides = std::array<int64_t, 8>;
using std::min;
std::vector<char> slurp(const char* path, size_t n) {
  std::vector<char> out(n);
  FILE* f = fopen(path, "rb"); fread(out.data(), 1, n, f); fclose(f);
  return out;
}
void spill(const char* path, const std::vector<float>& x) {
  FILE* f = fopen(path, "wb"); fwrite(x.data(), sizeof(float), x.size(), f); fclose(f);
}
"""

_TYPES = {np.float32: "float", np.uint32: "uint32_t", np.float16: "__half", np.int32: "int32_t"}


def _run(
    where: Path,
    name: str,
    source: str,
    inputs: list[tuple[str, np.ndarray, tuple[int, ...]]],
    outputs: list[tuple[str, tuple[int, ...]]],
    template: list[tuple[str, int]],
    blocks: tuple[int, int, int],
) -> list[np.ndarray]:
    """Compile ``source`` as mlx would wrap it (inputs, ``_shape`` / ``_strides`` where the
    source names them, outputs, template constants) and run its ``blocks``. ``inputs``:
    (name, base array, the shape of the view the kernel gets; its strides are the base's)."""
    params, call, load = [], [], []
    for i, (n, base, shape) in enumerate(inputs):
        ctype = _TYPES[base.dtype.type]
        base.tofile(where / f"in{i}.bin")
        params.append(f"const {ctype}* {n}")
        load.append(f'std::vector<char> b{i} = slurp("{where}/in{i}.bin", {base.nbytes});')
        call.append(f"(const {ctype}*)b{i}.data()")
        if f"{n}_shape" in source:
            params.append(f"const Shape {n}_shape")
            call.append("Shape{" + ",".join(map(str, shape)) + "}")
        if f"{n}_strides" in source:
            params.append(f"const Strides {n}_strides")
            call.append("Strides{" + ",".join(str(s // base.itemsize) for s in base.strides) + "}")
    for j, (n, shape) in enumerate(outputs):
        params.append(f"float* {n}")
        load.append(f"std::vector<float> o{j}({math.prod(shape)}, NAN);")
        call.append(f"o{j}.data()")
    constants = "".join(f"  constexpr int {k} = {v};\n" for k, v in template)
    threads = stored_cuda.THREADS
    saves = "".join(f'  spill("{where}/out{j}.bin", o{j});\n' for j in range(len(outputs)))
    program = f"""{EMULATION}
void {name}({", ".join(params)}) {{
{constants}{source}
}}
int main() {{
  {" ".join(load)}
  gridDim = dim3{{{blocks[0]}, {blocks[1]}, {blocks[2]}}};
  blockDim = dim3{{{threads}, 1, 1}};
  std::barrier<> barrier({threads});
  block_barrier = &barrier;
  for (int z = 0; z < {blocks[2]}; ++z)
  for (int y = 0; y < {blocks[1]}; ++y)
  for (int x = 0; x < {blocks[0]}; ++x) {{
    blockIdx = dim3{{x, y, z}};
    std::vector<std::thread> team;
    for (int t = 0; t < {threads}; ++t) team.emplace_back([&, t]() {{
      threadIdx = dim3{{t, 0, 0}};
      {name}({", ".join(call)});
    }});
    for (auto& member : team) member.join();
  }}
{saves}}}
"""
    (where / f"{name}.cpp").write_text(program)
    subprocess.run(
        ["g++", "-std=c++20", "-O1", "-pthread", "-w", str(where / f"{name}.cpp"), "-o", str(where / name)],
        check=True,
    )
    subprocess.run([str(where / name)], check=True)
    return [
        np.fromfile(where / f"out{j}.bin", dtype=np.float32).reshape(shape)
        for j, (_, shape) in enumerate(outputs)
    ]


def _kernel_on_cpu(
    where: Path,
    q: mx.array,
    kparts: tuple,
    vparts: tuple,
    keys: TensorCodec,
    values: TensorCodec,
    starts: list[int],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    B, heads, R, D = q.shape
    n_keys = kparts[0].shape[2]
    dv = vparts[1].shape[-1] * values.group_size
    chunk = stored_cuda.chunk_for(R)
    splits = max(1, math.ceil(n_keys / chunk))
    inputs: list[tuple[str, np.ndarray, tuple[int, ...]]] = [
        ("q", np.array(q.astype(mx.float32)), tuple(q.shape))
    ]
    for name, x in zip(("kq", "ks", "kb", "vq", "vs", "vb"), (*kparts, *vparts), strict=True):
        held = np.array(x)
        room = np.zeros((*held.shape[:2], held.shape[2] + 37, held.shape[3]), dtype=held.dtype)
        room[:, :, : held.shape[2]] = held  # a body with room for appends: the kernel sees a view
        inputs.append((name, room, held.shape))
    inputs.append(("starts", np.array(starts, dtype=np.int32), (B,)))
    template = [
        ("R", R), ("D", D), ("DV", dv), ("KBITS", keys.bits), ("VBITS", values.bits),
        ("KG", keys.group_size), ("VG", values.group_size), ("CHUNK", chunk),
        ("THREADS", stored_cuda.THREADS),
    ]  # fmt: skip
    per_split = (B, heads, splits, R)
    parts = _run(
        where, "partial", stored_cuda._PARTIAL_SOURCE, inputs,
        [("o_part", (*per_split, dv)), ("m_part", per_split), ("l_part", per_split)],
        template, (splits, heads, B),
    )  # fmt: skip
    rows = B * heads * R
    merged = [(n, p, p.shape) for n, p in zip(("o_part", "m_part", "l_part"), parts, strict=True)]
    o, m, l_ = _run(
        where, "merge", stored_cuda._MERGE_SOURCE, merged,
        [("o", (B, heads, R, dv)), ("m_out", (B, heads, R)), ("l_out", (B, heads, R))],
        [("R", R), ("DV", dv), ("SPLITS", splits), ("ROWS", rows)],
        (math.ceil(rows * dv / stored_cuda.THREADS), 1, 1),
    )  # fmt: skip
    return o, m, l_


CASES = pytest.mark.parametrize(
    ("B", "heads", "R", "D", "n_keys", "keys", "values", "starts"),
    [
        (
            1,
            2,
            4,
            128,
            300,
            TensorCodec(6, rotate=True),
            TensorCodec(4, rotate=True),
            [0],
        ),  # the default format
        (2, 2, 4, 128, 1100, TensorCodec(6), TensorCodec(4), [0, 517]),  # a batch row left-padded
        (1, 1, 8, 64, 700, TensorCodec(4, 32), TensorCodec(8, 32), [5]),
        (1, 1, 3, 96, 260, TensorCodec(3, 32), TensorCodec(5, 32), [0]),  # Phi-3's head width
        (1, 1, 1, 256, 1030, TensorCodec(2, 128), TensorCodec(6, 64), [0]),  # Gemma 3's
    ],
)


def _case(
    B: int, heads: int, R: int, D: int, n_keys: int, keys: TensorCodec, values: TensorCodec
) -> tuple[mx.array, tuple, tuple]:
    k1, k2, k3 = mx.random.split(mx.random.key(0), 3)
    kparts = keys.encode(mx.random.normal((B, heads, n_keys, D), key=k1))
    vparts = values.encode(mx.random.normal((B, heads, n_keys, D), key=k2))
    return mx.random.normal((B, heads, R, D), key=k3) * 0.3, kparts, vparts


@needs_gxx
@CASES
def test_the_kernels_equal_their_oracle(
    tmp_path: Path,
    B: int,
    heads: int,
    R: int,
    D: int,
    n_keys: int,
    keys: TensorCodec,
    values: TensorCodec,
    starts: list[int],
) -> None:
    q, kparts, vparts = _case(B, heads, R, D, n_keys, keys, values)
    o, m, total = _kernel_on_cpu(tmp_path, q, kparts, vparts, keys, values, starts)
    want_o, want_m, want_total = (
        np.array(x)
        for x in stored_cuda.reference_body_attention(
            q, kparts, vparts, keys, values, mx.array(starts, dtype=mx.int32)
        )
    )
    np.testing.assert_allclose(m, want_m, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(total, want_total, rtol=1e-4)
    np.testing.assert_allclose(o / total[..., None], want_o / want_total[..., None], atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not stored_cuda.available(), reason="mlx's CUDA backend only")
@CASES
def test_the_kernels_on_the_gpu_equal_their_oracle(
    B: int,
    heads: int,
    R: int,
    D: int,
    n_keys: int,
    keys: TensorCodec,
    values: TensorCodec,
    starts: list[int],
) -> None:
    """Through mlx, over views as the engine holds them: a body with room for appends, and
    one that starts inside its buffer (what a batch hands back to a leaving member)."""
    q, kparts, vparts = _case(B, heads, R, D, n_keys + 40, keys, values)
    begin = mx.array(starts, dtype=mx.int32)
    for view in (slice(0, n_keys), slice(40, n_keys + 40)):
        kv = tuple(x[:, :, view] for x in kparts), tuple(x[:, :, view] for x in vparts)
        got = stored_cuda.body_attention(q, *kv, keys, values, begin)
        want = stored_cuda.reference_body_attention(q, *kv, keys, values, begin)
        o, m, total = (np.array(x) for x in got)
        want_o, want_m, want_total = (np.array(x) for x in want)
        np.testing.assert_allclose(m, want_m, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(total, want_total, rtol=1e-3)
        np.testing.assert_allclose(o / total[..., None], want_o / want_total[..., None], atol=1e-4)
