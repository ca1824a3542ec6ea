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
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from langchain_agent_memory.engine.kv import stored_cuda
from langchain_agent_memory.engine.kv.codecs import FULL, TensorCodec

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to run the kernels on the CPU")

#: What mlx's CUDA headers give a kernel, for the CPU: one thread per CUDA thread of a block.
EMULATION = r"""
#include <algorithm>
#include <array>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>
struct __half {
  uint16_t x;
  operator float() const;
};
inline float __half2float(__half h) {
  const uint32_t e = (h.x >> 10) & 31, m = h.x & 1023;
  float v = e == 0 ? std::ldexp((float)m, -24)
          : e == 31 ? (m ? NAN : INFINITY)
                    : std::ldexp((float)(m | 1024), (int)e - 25);
  return (h.x >> 15) ? -v : v;
}
inline __half::operator float() const { return __half2float(*this); }
inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }
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
inline float __int_as_float(uint32_t x) { float f; std::memcpy(&f, &x, 4); return f; }
#define __shared__ static
#define __device__
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


#: mlx's names of a dtype in a kernel's template (``template_arguments_hash``) and the
#: emulation's C++ type for it.
_TEMPLATE_TYPES = {
    mx.float32: ("float32", "float"),
    mx.float16: ("float16", "__half"),
    mx.bfloat16: ("bfloat16", "uint16_t"),
}


def _constant(name: str, value: int | bool | mx.Dtype) -> str:
    """A template entry as mlx writes it at the top of a kernel's body."""
    if isinstance(value, bool):
        return f"  constexpr bool {name} = {str(value).lower()};\n"
    if isinstance(value, mx.Dtype):
        return f"  using {name} = {_TEMPLATE_TYPES[value][1]};\n"
    return f"  constexpr int {name} = {value};\n"


def mlx_kernel_name(name: str, template: list[tuple[str, int | bool | mx.Dtype]]) -> str:
    """The name mlx compiles a custom kernel under and finds it by again: its name and its
    template's values, nothing of its inputs (mlx/backend/cuda/custom_kernel.cpp)."""
    parts = []
    for _, v in template:
        if isinstance(v, bool):
            parts.append("_t" if v else "_f")
        elif isinstance(v, mx.Dtype):
            parts.append("_" + _TEMPLATE_TYPES[v][0])
        else:
            parts.append(f"_{v}")
    return f"custom_kernel_{name}{''.join(parts)}"


def _run(
    where: Path,
    name: str,
    source: str,
    inputs: list[tuple[str, np.ndarray, tuple[int, ...], tuple[int, ...]]],
    outputs: list[tuple[str, tuple[int, ...]]],
    template: list[tuple[str, int | bool | mx.Dtype]],
    blocks: tuple[int, int, int],
) -> list[np.ndarray]:
    """Compile ``source`` as mlx would wrap it (inputs, ``_shape`` / ``_strides`` where the
    source names them, outputs, template constants) and run its ``blocks``. ``inputs``:
    (name, memory, the shape and element strides of the view the kernel gets)."""
    params, call, load = [], [], []
    for i, (n, memory, shape, strides) in enumerate(inputs):
        ctype = _TYPES[memory.dtype.type]
        memory.tofile(where / f"in{i}.bin")
        params.append(f"const {ctype}* {n}")
        load.append(f'std::vector<char> b{i} = slurp("{where}/in{i}.bin", {memory.nbytes});')
        call.append(f"(const {ctype}*)b{i}.data()")
        if f"{n}_shape" in source:
            params.append(f"const Shape {n}_shape")
            call.append("Shape{" + ",".join(map(str, shape)) + "}")
        if f"{n}_strides" in source:
            params.append(f"const Strides {n}_strides")
            call.append("Strides{" + ",".join(map(str, strides)) + "}")
    for j, (n, shape) in enumerate(outputs):
        params.append(f"float* {n}")
        load.append(f"std::vector<float> o{j}({math.prod(shape)}, NAN);")
        call.append(f"o{j}.data()")
    constants = "".join(_constant(k, v) for k, v in template)
    threads = stored_cuda.THREADS
    saves = "".join(f'  spill("{where}/out{j}.bin", o{j});\n' for j in range(len(outputs)))
    program = f"""{EMULATION}
{stored_cuda.HEADER}
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


def _as_held(name: str, x: mx.array) -> tuple[str, np.ndarray, tuple[int, ...], tuple[int, ...]]:
    """An input as the engine holds it: K/V regions in buffers with room for appends (a
    view: row strides longer than the row), queries transposed from (B, L, heads, D)."""
    a = np.array(x)
    if name == "q":
        memory = np.ascontiguousarray(a.transpose(0, 2, 1, 3))
        _, L, H, D = memory.shape
        return name, memory, a.shape, (L * H * D, D, H * D, 1)
    if name in ("kq", "ks", "kb", "vq", "vs", "vb", "fk", "fv", "hk", "hv", "pk", "pv"):
        memory = np.zeros((*a.shape[:2], a.shape[2] + 37, a.shape[3]), dtype=a.dtype)
        memory[:, :, : a.shape[2]] = a
        return name, memory, a.shape, tuple(s // a.itemsize for s in memory.strides)
    return name, np.ascontiguousarray(a), a.shape, tuple(s // a.itemsize for s in a.strides)


def _kernels_on_cpu(where: Path, queries: mx.array, args: tuple, sinks: mx.array | None) -> np.ndarray:
    """``stored_cuda.attention``'s two launches, emulated."""
    partial = stored_cuda.partial_call(queries, *args)
    blocks = tuple(g // t for g, t in zip(partial["grid"], partial["threadgroup"], strict=True))
    parts = _run(
        where,
        "partial",
        stored_cuda.PARTIAL_SOURCE,
        [_as_held(n, x) for n, x in zip(stored_cuda.PARTIAL_INPUTS, partial["inputs"], strict=True)],
        list(zip(("o_part", "m_part", "l_part"), partial["output_shapes"], strict=True)),
        partial["template"],
        blocks,  # type: ignore[arg-type]
    )
    merge = stored_cuda.merge_call(queries, *(mx.array(p) for p in parts), sinks)
    (out,) = _run(
        where,
        "merge",
        stored_cuda.MERGE_SOURCE,
        [_as_held(n, x) for n, x in zip(stored_cuda.MERGE_INPUTS, merge["inputs"], strict=True)],
        [("out", merge["output_shapes"][0])],
        merge["template"],
        (merge["grid"][0] // stored_cuda.THREADS, 1, 1),
    )
    return out


ALL = stored_cuda.ALL_VISIBLE


@dataclass(frozen=True)
class Case:
    heads: int
    kv_heads: int
    L: int
    D: int
    n_head: int
    n_body: int
    n_pending: int
    keys: TensorCodec
    values: TensorCodec
    starts: tuple[tuple[int, int, int, int], ...] = ((0, 0, 0, ALL),)
    sinks: bool = False

    def inputs(self, dtype: mx.Dtype = mx.float32) -> tuple[mx.array, tuple, mx.array | None]:
        B, r = len(self.starts), mx.random.split(mx.random.key(0), 8)

        def kv(i: int, n: int) -> mx.array:
            return mx.random.normal((B, self.kv_heads, n, self.D), key=r[i])

        head = (
            (kv(0, self.n_head).astype(mx.float16), kv(1, self.n_head).astype(mx.float16))
            if self.n_head
            else None
        )
        body = (self.keys.encode(kv(2, self.n_body)), self.values.encode(kv(3, self.n_body)))
        pending = (kv(4, self.n_pending).astype(dtype), kv(5, self.n_pending).astype(dtype))
        queries = (mx.random.normal((B, self.heads, self.L, self.D), key=r[6]) * 3).astype(dtype)
        sinks = mx.random.normal((self.heads,), key=r[7]) if self.sinks else None
        starts = mx.array(self.starts, dtype=mx.int32)
        return queries, (self.D**-0.5, head, body, pending, self.keys, self.values, starts), sinks


ROTATED = TensorCodec(6, rotate=True), TensorCodec(4, rotate=True)
CASES = pytest.mark.parametrize(
    "case",
    [
        pytest.param(Case(8, 2, 1, 128, 4, 300, 3, *ROTATED), id="default-format-decode"),
        pytest.param(
            Case(
                8,
                2,
                1,
                128,
                4,
                1100,
                5,
                TensorCodec(6),
                TensorCodec(4),
                ((0, 0, 0, ALL), (517, 2, 3, ALL)),
                True,
            ),
            id="left-padded-batch-with-sinks",
        ),
        pytest.param(
            Case(4, 1, 2, 64, 0, 700, 6, TensorCodec(4, 32), TensorCodec(8, 32), ((0, 0, 0, 4),)),
            id="two-tokens-causal",
        ),
        pytest.param(
            Case(3, 1, 1, 96, 2, 260, 1, TensorCodec(3, 32, rotate=True), TensorCodec(5, 32)),
            id="width-96-odd-bits",
        ),
        pytest.param(  # what the default format stores Phi-3's heads in (``for_width``)
            Case(8, 2, 1, 96, 4, 300, 3, TensorCodec(6, 32, rotate=True), TensorCodec(4, 32, rotate=True)),
            id="width-96-default-format",
        ),
        pytest.param(
            Case(1, 1, 1, 256, 0, 1030, 2, TensorCodec(2, 128, rotate=True), TensorCodec(6, 64, rotate=True)),
            id="width-256",
        ),
        pytest.param(Case(8, 2, 1, 128, 0, 600, 3, FULL, FULL), id="16-bit-body-decode"),
        pytest.param(  # the 16-bit format in a left-padded batch (``StoredBatch``)
            Case(8, 2, 1, 64, 0, 530, 4, FULL, FULL, ((0, 0, 0, ALL), (211, 0, 1, ALL)), True),
            id="16-bit-body-left-padded-batch",
        ),
        pytest.param(
            Case(4, 1, 2, 96, 0, 300, 5, FULL, FULL, ((0, 0, 0, 3),)), id="16-bit-body-two-tokens-causal"
        ),
    ],
)


@needs_gxx
@CASES
def test_the_kernels_equal_their_oracle(tmp_path: Path, case: Case) -> None:
    queries, args, sinks = case.inputs()
    got = _kernels_on_cpu(tmp_path, queries, args, sinks)
    want = np.array(stored_cuda.reference_attention(queries, *args, sinks))
    np.testing.assert_allclose(got, want, atol=2e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not stored_cuda.available(), reason="mlx's CUDA backend only")
@CASES
def test_the_kernels_on_the_gpu_equal_their_oracle(case: Case) -> None:
    """Through mlx, bf16 queries and own tokens as a model has them. The oracle's float32
    matmuls may run at TF32 on the GPU: the bound is bf16's, not float32's."""
    queries, args, sinks = case.inputs(mx.bfloat16)
    got = stored_cuda.attention(queries, *args, sinks).astype(mx.float32)
    want = stored_cuda.reference_attention(queries, *args, sinks).astype(mx.float32)
    assert got.shape == want.shape
    assert mx.abs(got - want).max().item() < 2e-2


@CASES
def test_models_of_another_dtype_get_a_kernel_of_their_own(case: Case) -> None:
    """mlx compiles a custom kernel once per name and template, and declares its inputs'
    types in the source: two models of one process whose dtypes differ (a server of a bf16
    and an fp16 checkpoint) must not share a compiled kernel, or the second reads its keys
    as the first's type. Calls of one dtype share one (it compiles once)."""
    names = {}
    for dtype in (mx.bfloat16, mx.float16, mx.float32, mx.bfloat16):
        queries, args, _ = case.inputs(dtype)
        names.setdefault(dtype, set()).add(
            mlx_kernel_name(
                "agent_memory_stored_partial", stored_cuda.partial_call(queries, *args)["template"]
            )
        )
    assert all(len(n) == 1 for n in names.values()), names
    assert len(set.union(*names.values())) == 3, names
