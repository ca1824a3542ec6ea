"""Faster CPU kernels for mlx-lm's attention and MLP activations.

Why: on a Linux CPU, mlx evaluates ``exp`` (and ``sigmoid``, ``tanh``, ``softmax``, ``silu``)
one element at a time through a software ``fma`` (the x86-64 wheel targets baseline SSE2):
about 19 ns per element. ``mx.fast.scaled_dot_product_attention`` on CPU spends nearly all
its time there (56 ms for 9 heads x 512 x 512 against ~3 ms of BLAS matmul), and so do the
SmolLM2 / Gemma MLP activations. This module rebuilds those ops from plain arithmetic that
``mx.compile`` fuses into vectorised C++ loops:

* ``fast_exp``: Cody-Waite range reduction ``x = n ln2 + r`` (n rounded with the 1.5 * 2**23
  trick, since ``floor``/``round`` are libm calls in the JIT kernels), a degree-7 polynomial
  for ``exp(r)`` and ``2**n`` assembled from its IEEE bits (``(n + 127) << 23`` viewed as
  float32). Max relative error 1.1e-7 on [-80, 80] (``mx.exp``: 3.8e-6); exp(-inf) = 0;
  x > 88 saturates at 1.65e38 instead of inf.
* ``fast_softmax``, ``fast_silu``, ``fast_swiglu``, ``gelu_approx`` (``0.5 x (1 + tanh(u))``
  is rewritten as ``x / (1 + exp(-2u))``, the same function), ``gelu_approx_mul``.
* ``attention``: the same contract as ``mx.fast.scaled_dot_product_attention`` for float K/V
  (mask None, "causal", boolean or additive, broadcastable to (B, H, L, kL)), computed with
  two BLAS matmuls. GQA without repeating K/V: queries are regrouped to
  (B, KV heads, n_rep * L, D). Scores are produced transposed, (kL, rows), because mlx's CPU
  reductions over a non-last axis are vectorised (max: 0.6 ms instead of 3.8 ms for 2.4M
  scores). A long prefill (L >= 256) is cut into query blocks of 128 that only multiply the
  keys they can see: the causal upper triangle and, for mlx-lm's sliding-window boolean
  masks, everything outside the window are skipped. Measured (2-core Xeon, MKL): 9 heads x
  512 x 512 causal ~13 ms instead of ~60 ms; 2048 x 2048 ~175 ms instead of ~900 ms; Gemma's
  4 x 2048 x 2048 window-512 layer 68 ms instead of 410 ms.
* A block of queries (16 rows per KV head or more: a prefill chunk's, a warm or hot turn's
  few new tokens) has its mask and softmax done by NumPy, in place on the scores mlx
  computed (``_attend_host``): NumPy's ``exp`` is built for the CPU it runs on (AVX-512
  here), mlx's JIT loops are not. A/B in one process, SmolLM2: hot turn (15 new tokens) at
  8K 0.40 -> 0.34 s, 16K 0.61 -> 0.49 s; cold prefill 2K 12.1 -> 10.0 s, 4K 33.5 -> 27.0 s
  (mean of 2); Gemma 3 unchanged (its sliding layers see 512 keys; 4K 16.0 vs 15.9 s).
  Where one block's scores would pass 128 MB, keys go in tiles of 256 with the softmax
  merged across tiles in mlx (``_attend_tiled``).
* Small problems (one decoded token) keep mlx's single fused op: fewer than 16K scores go to
  ``mx.fast.scaled_dot_product_attention``, activations under 4096 elements to mlx's own
  ``silu`` / ``gelu_approx``. Building ~15 small ops per layer in Python costs more there
  than the exp saves.

Why the kernels are split the way they are: ``mx.compile`` stops fusing at a graph depth of
11 (broadcasts of constants count) and the JIT loop is only vectorised when no op in it
branches (float ``maximum``/``minimum``/``where`` do, for NaN handling), and ``view`` cannot
be traced shapeless. So each helper below is one small compiled function that fuses into one
branch-free loop, compiled per input shape for large inputs (shapeless tracing inserts a
broadcast per op and halves the fusable depth) and shapeless for small ones (token-by-token
decode changes the key length every step; retracing would cost more than it saves).

These kernels reach a model through ``adapters.adapt_model``: the attention and MLP
modules of one loaded model instance are switched to them (CPU only); mlx-lm's modules and
classes are never modified. On Linux mlx JIT-compiles its fused CPU kernels with ``g++``
(once, into ``$TMPDIR/mlx``): ``jit_available()`` says whether it can.
"""

from __future__ import annotations

import math
import shutil
import sys
from collections.abc import Callable
from functools import partial
from typing import Any

import mlx.nn as nn
import numpy as np

from .process import RUNTIME
from .runtime import mx

__all__ = [
    "fast_exp",
    "fast_silu",
    "fast_softmax",
    "fast_swiglu",
    "gelu_approx",
    "gelu_approx_mul",
    "jit_available",
    "rms_norm",
    "rms_norm_1p",
    "rope_probe",
    "rope_rotate",
    "rope_table",
]

_LOG2E = 1.4426950408889634
# ln 2 in two parts (Cody-Waite): _LN2_HI has 16 significant bits, so n * _LN2_HI is exact
# for the |n| <= 127 that matter and r = x - n ln 2 keeps its low bits.
_LN2_HI = 0.693145751953125
_LN2_LO = 1.428606765330187e-06
_MAGIC = 12582912.0  # 1.5 * 2**23: (t + _MAGIC) - _MAGIC rounds t to an integer for |t| < 2**22
_EXP_LO = -88.0  # exp(-88) = 6e-39 is already subnormal
_EXP_HI = 88.0
# exp(r) ~= 1 + r + r^2 (C0 + C1 r + ... + C5 r^5) on |r| <= ln(2) / 2 (Cephes expf).
_C = (5.0000001201e-1, 1.6666665459e-1, 4.1665795894e-2, 8.3334519073e-3, 1.3981999507e-3, 1.9875691500e-4)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)

SMALL_ELEMENTS = 1 << 15  # below this many elements a kernel runs shapeless (see Kernel)
_MAX_SHAPES = 64  # per-shape compilations kept per kernel before the cache is dropped
# One decoded token's MLP: mlx's single compiled op beats our five (graph-building cost).
_ACT_SMALL = 4096


class Kernel:
    """``fn`` compiled twice: for each input shape (large inputs) and shapeless (small ones).

    Shape-specialised tracing fuses about twice as many ops per loop as shapeless tracing,
    which matters when the arrays are large; it retraces (~0.3 ms) for every new shape, which
    only pays off when a shape repeats (every layer of one forward pass uses the same ones).
    """

    def __init__(self, fn: Callable[..., Any]) -> None:
        self._fn = fn
        self._shapeless = mx.compile(fn, shapeless=True)
        self._fixed = mx.compile(fn)
        self._shapes: set[tuple[Any, ...]] = set()

    def __call__(self, *args: mx.array, fixed: bool | None = None) -> Any:
        if fixed is None:
            fixed = args[0].size >= SMALL_ELEMENTS
        if not fixed:
            return self._shapeless(*args)
        key = tuple((a.shape, a.dtype) for a in args)
        with RUNTIME.lock:  # the engines' worker threads share the kernels
            if key not in self._shapes:
                if len(self._shapes) >= _MAX_SHAPES:
                    # mlx keeps one traced graph per shape forever and scans them linearly:
                    # a fresh wrapper drops them (its predecessor's destructor erases them).
                    self._fixed = mx.compile(self._fn)
                    self._shapes.clear()
                self._shapes.add(key)
            fn = self._fixed
        return fn(*args)


@Kernel
def _clamp(x: mx.array) -> mx.array:
    # float maximum/minimum check for NaN, which stops the loop from vectorising: alone here.
    return mx.minimum(mx.maximum(x, _EXP_LO), _EXP_HI)


@Kernel
def _sub_clamp(x: mx.array, m: mx.array) -> mx.array:
    return mx.maximum(x - m, _EXP_LO)


@Kernel
def _exp_n(x: mx.array) -> mx.array:
    return (x * _LOG2E + _MAGIC) - _MAGIC


@Kernel
def _exp_bits(n: mx.array) -> mx.array:
    # int32 min/max do not branch. Out-of-range n (|x| beyond ~2.9e6) converts to INT_MIN or
    # saturates here, giving 0 or 2**127.
    return (mx.minimum(mx.maximum(n.astype(mx.int32), -127), 127) + 127) << 23


@Kernel
def exp_bits_neg(n: mx.array) -> mx.array:
    # For x <= 0 (softmax after subtracting the row max) only the lower clamp is needed.
    return (mx.maximum(n.astype(mx.int32), -127) + 127) << 23


def _poly(r: mx.array) -> mx.array:
    # Estrin-like order keeps the graph shallow enough for one fused loop; adding 1 last keeps
    # the error at 1e-7 (1.7e-7 when 1 + r is formed first).
    z = r * r
    a = _C[0] + _C[1] * r
    b = _C[2] + _C[3] * r
    d = _C[4] + _C[5] * r
    return ((r + z * a) + (z * z) * (b + z * d)) + 1.0


@Kernel
def _exp_poly(x: mx.array, n: mx.array) -> mx.array:
    return _poly((x - n * _LN2_HI) - n * _LN2_LO)


@Kernel
def mul_kernel(a: mx.array, b: mx.array) -> mx.array:
    return a * b


def exp_parts(x: mx.array, bits: Kernel, fixed: bool | None) -> tuple[mx.array, mx.array]:
    """exp(x) as (mantissa polynomial, 2**n as float32); x must be finite and |x| < ~1e12."""
    n = _exp_n(x, fixed=fixed)
    return _exp_poly(x, n, fixed=fixed), bits(n, fixed=fixed).view(mx.float32)


def fast_exp(x: mx.array) -> mx.array:
    """exp(x) in float32, max relative error 2e-7 on [-80, 80]; -inf and x < -88 give 0."""
    p, e = exp_parts(_clamp(x.astype(mx.float32)), _exp_bits, None)
    return mul_kernel(p, e)


def fast_softmax(x: mx.array, axis: int = -1) -> mx.array:
    """``mx.softmax`` (computed in float32, returned in x's dtype); -inf entries get weight 0."""
    x32 = x.astype(mx.float32)
    p, e = exp_parts(_sub_clamp(x32, x32.max(axis, keepdims=True)), exp_bits_neg, None)
    y = mul_kernel(p, e)
    return (y / y.sum(axis, keepdims=True)).astype(x.dtype)


@Kernel
def _neg_n(x: mx.array) -> mx.array:
    return (x * -_LOG2E + _MAGIC) - _MAGIC


@Kernel
def _neg_poly(x: mx.array, n: mx.array) -> mx.array:
    return _poly((-x - n * _LN2_HI) - n * _LN2_LO)


@Kernel
def _silu_out(x: mx.array, p: mx.array, e: mx.array) -> mx.array:
    return x / (1.0 + p * e)


@Kernel
def _swiglu_out(g: mx.array, x: mx.array, p: mx.array, e: mx.array) -> mx.array:
    return (g * x) / (1.0 + p * e)


@partial(mx.compile, shapeless=True)
def _mlx_swiglu(gate: mx.array, x: mx.array) -> mx.array:
    return nn.silu(gate) * x  # mlx-lm's own swiglu: one compiled op for small inputs


def _result_dtype(a: mx.array, b: mx.array) -> mx.Dtype:
    # mlx promotes any two different float types to float32 (fp16 * bf16 included).
    return a.dtype if a.dtype == b.dtype else mx.float32


def _exp_neg_parts(x: mx.array) -> tuple[mx.array, mx.array]:
    """exp(-x) as (polynomial, 2**n); x finite, |x| < ~1e12 (MLP activations)."""
    n = _neg_n(x)
    return _neg_poly(x, n), _exp_bits(n).view(mx.float32)


def fast_silu(x: mx.array) -> mx.array:
    """``nn.silu``: x * sigmoid(x) = x / (1 + exp(-x)), in float32."""
    if x.size < _ACT_SMALL:
        return nn.silu(x)
    x32 = x.astype(mx.float32)
    return _silu_out(x32, *_exp_neg_parts(x32)).astype(x.dtype)


def fast_swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """mlx-lm's ``swiglu``: silu(gate) * x."""
    if gate.size < _ACT_SMALL:
        return _mlx_swiglu(gate, x)
    g32 = gate.astype(mx.float32)
    out = _swiglu_out(g32, x.astype(mx.float32), *_exp_neg_parts(g32))
    return out.astype(_result_dtype(gate, x))


@Kernel
def _gelu_arg(x: mx.array) -> mx.array:
    # 0.5 x (1 + tanh(u)) = x sigmoid(2u) = x / (1 + exp(-2u)), u = sqrt(2/pi) (x + 0.044715 x^3)
    return (2.0 * _SQRT_2_OVER_PI) * (x + 0.044715 * (x * x * x))


def gelu_approx(x: mx.array) -> mx.array:
    """``nn.gelu_approx`` (the tanh approximation) without tanh."""
    if x.size < _ACT_SMALL:
        return nn.gelu_approx(x)
    x32 = x.astype(mx.float32)
    return _silu_out(x32, *_exp_neg_parts(_gelu_arg(x32))).astype(x.dtype)


def gelu_approx_mul(gate: mx.array, x: mx.array) -> mx.array:
    """gelu_approx(gate) * x in one pass over the output (Gemma 3's MLP)."""
    if gate.size < _ACT_SMALL:
        return nn.gelu_approx(gate) * x
    g32 = gate.astype(mx.float32)
    out = _swiglu_out(g32, x.astype(mx.float32), *_exp_neg_parts(_gelu_arg(g32)))
    return out.astype(_result_dtype(gate, x))


def _normalized(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    # The formula of mx.fast.rms_norm's CPU fallback before its weight, op for op: the same
    # bits; compiled with the weight's product, 3 kernels (2 fused loops and the sum) where
    # the fallback runs 8 ops.
    x32 = x.astype(mx.float32)
    normed = x32 * mx.rsqrt(mx.mean(mx.square(x32), -1, keepdims=True) + eps)
    return normed.astype(_result_dtype(x, weight))


@partial(mx.compile, shapeless=True)
def _rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    return _normalized(x, weight, eps) * weight


#: Rows up to which the compiled norm runs; more (a turn's tokens, a prefill chunk) go to
#: mx.fast's own. Per call, rows of 640: 1 row 11 vs 21 us, 4 rows 21 vs 20, 15 rows 47 vs 42,
#: 64 rows 144 vs 115, 512 rows 1.10 vs 0.70 ms (its fallback's loops beat the shapeless ones).
_NORM_ROWS = 2


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """``mx.fast.rms_norm(x, weight, eps)``, bit for bit, in fewer ops for a decode step's
    row (~11 us against ~21 us per call: a decode step of SmolLM2 runs 61)."""
    if x.size > _NORM_ROWS * x.shape[-1]:
        return mx.fast.rms_norm(x, weight, eps)
    return _rms_norm(x, weight, eps)


@partial(mx.compile, shapeless=True)
def _rms_norm_1p(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    return _normalized(x, weight, eps) * (1.0 + weight)


def rms_norm_1p(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """``mx.fast.rms_norm(x, 1.0 + weight, eps)`` (Gemma's norms), bit for bit."""
    if x.size > _NORM_ROWS * x.shape[-1]:
        return mx.fast.rms_norm(x, 1.0 + weight, eps)
    return _rms_norm_1p(x, weight, eps)


def _rope_rotate(x: mx.array, table: mx.array, traditional: bool) -> mx.array:
    # RoPE as x * C + swap(x) * S, where swap exchanges the two halves of the rotated dims
    # (or the two members of each pair, ``traditional``) and (C, S) = table: C = (c, c),
    # S = (-s, s) per pair. mx.fast.rope's fallback computes x1 c - x2 s and x1 s + x2 c: the
    # same products and sums (a - b = a + (-b) exactly), so the same bits.
    shape = x.shape
    half = shape[-1] // 2
    if traditional:
        swapped = x.reshape(*shape[:-1], half, 2)[..., ::-1].reshape(shape)
    else:
        swapped = x.reshape(*shape[:-1], 2, half)[..., ::-1, :].reshape(shape)
    return x * table[0] + swapped * table[1]


_rope_kernels = {t: Kernel(partial(_rope_rotate, traditional=t)) for t in (False, True)}


def rope_rotate(x: mx.array, table: mx.array, traditional: bool) -> mx.array:
    """Rotate ``x`` (..., L, dims) by ``table`` (2, 1, L, dims): see ``rope_table``. One
    fused loop, compiled per shape (a decode step's shapes repeat step after step), where
    mx.fast.rope's CPU fallback runs ~20 ops (~50 us against ~8 us per call)."""
    return _rope_kernels[traditional](x, table, fixed=True)


def rope_probe(dims: int, L: int, dtype: mx.Dtype, traditional: bool) -> mx.array:
    """Two inputs (2, 1, L, dims) whose rotations give a RoPE's tables: ones on the first
    member of each pair (the first half, or even dims where ``traditional``), zeros on the
    second, and the converse. Rotated: (c | s) and (-s | c), exactly (1 x c - 0 x s = c)."""
    first = _first_members(dims, traditional)
    probe = np.stack([first, ~first]).astype(np.float32).reshape(2, 1, 1, dims)
    return mx.array(np.broadcast_to(probe, (2, 1, L, dims))).astype(dtype)


def rope_table(rotated_probe: mx.array, traditional: bool) -> mx.array:
    """(C, S) for ``rope_rotate`` from a RoPE's output on ``rope_probe``: C = (c | c) takes
    the first members from the first output and the second from the other; S = (-s | s) the
    converse."""
    first = _first_members(rotated_probe.shape[-1], traditional)
    return mx.where(mx.array(first), rotated_probe, rotated_probe[::-1])


def _first_members(dims: int, traditional: bool) -> np.ndarray:
    """Which of ``dims`` are the first of their rotated pair: the first half, or the even
    dims where ``traditional``."""
    return (np.arange(dims) % 2 == 0) if traditional else (np.arange(dims) < dims // 2)


def jit_available() -> bool:
    """Whether mlx can JIT-compile the fused CPU loops these kernels rely on (``g++`` on
    Linux); without it the ops run unfused, one pass each, slower than mlx's own."""
    return not sys.platform.startswith("linux") or shutil.which("g++") is not None
