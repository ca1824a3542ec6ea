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
import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import mlx.nn as nn
import numpy as np

from .runtime import mx

__all__ = [
    "attention",
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
# Additive score of a masked key. Finite (no inf - inf) and small enough that the polynomial
# of its (wrongly reduced) r stays finite, so exp gives exactly 0 through the 2**n bits; large
# enough that a fully masked row ends up uniform, as with mx.fast's boolean masks.
_MASKED = -1e9
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)

_SMALL = 1 << 15  # below this many elements a kernel runs shapeless (see Kernel)
_MAX_SHAPES = 64  # per-shape compilations kept per kernel before the cache is dropped
# Fewer scores than this (H * L * kL): mx.fast's single op. Alone, ours wins from H * kL ~ 4600
# (L = 1); inside a decode step the cost of building ~15 small ops moves that to ~16K.
_SDPA_SMALL = 16384
# One decoded token's MLP: mlx's single compiled op beats our five (graph-building cost).
_ACT_SMALL = 4096
_CAUSAL_BLOCK = 128  # query rows per block of a causal prefill (measured: 64 < 128 > 256)
# From this many query rows per KV head (a prefill chunk, a warm or hot turn's few new tokens:
# 45 rows for SmolLM2's 15) the mask and softmax go to NumPy (``_attend_host``); fewer (a
# decode step: 1 query per head) stay one mlx pass.
_HOST_ROWS = 16
# Above this many scores per call (a long prefill block of a large model: 8 KV heads x 512
# rows x 64K keys is 1 GB of float32), keys go in tiles instead (``_attend_tiled``).
_HOST_MAX_SCORES = 1 << 25
_KEY_TILE = 256  # keys per tile (measured 256 < 512 < 1024)
_HOST_CHUNK = 1 << 19  # scores per row group of ``_attend_host``'s softmax (2 MB)
# ``_attend_host`` takes its keys in tiles where a call has more than ``_HOST_UNTILED_SCORES``
# (24 MB: three quarters of mlx's 32 MB CPU buffer cache; Gemma 3's 512-row blocks over 8K
# keys, 17 MB, ran 6 % slower in tiles), of about ``_HOST_TILE_SCORES`` each (8 MB), which the
# buffer cache then hands back tile after tile (SmolLM2's 384-row blocks: ~1.8K keys per
# tile; measured 1K-4K alike).
_HOST_UNTILED_SCORES = 6 << 20
_HOST_TILE_SCORES = 1 << 21


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
        self._lock = threading.Lock()

    def __call__(self, *args: mx.array, fixed: bool | None = None) -> Any:
        if fixed is None:
            fixed = args[0].size >= _SMALL
        if not fixed:
            return self._shapeless(*args)
        key = tuple((a.shape, a.dtype) for a in args)
        with self._lock:
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
def _exp_bits_neg(n: mx.array) -> mx.array:
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
def _mul(a: mx.array, b: mx.array) -> mx.array:
    return a * b


def _exp_parts(x: mx.array, bits: Kernel, fixed: bool | None) -> tuple[mx.array, mx.array]:
    """exp(x) as (mantissa polynomial, 2**n as float32); x must be finite and |x| < ~1e12."""
    n = _exp_n(x, fixed=fixed)
    return _exp_poly(x, n, fixed=fixed), bits(n, fixed=fixed).view(mx.float32)


def fast_exp(x: mx.array) -> mx.array:
    """exp(x) in float32, max relative error 2e-7 on [-80, 80]; -inf and x < -88 give 0."""
    p, e = _exp_parts(_clamp(x.astype(mx.float32)), _exp_bits, None)
    return _mul(p, e)


def fast_softmax(x: mx.array, axis: int = -1) -> mx.array:
    """``mx.softmax`` (computed in float32, returned in x's dtype); -inf entries get weight 0."""
    x32 = x.astype(mx.float32)
    p, e = _exp_parts(_sub_clamp(x32, x32.max(axis, keepdims=True)), _exp_bits_neg, None)
    y = _mul(p, e)
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


def _f32(x: mx.array) -> mx.array:
    return x if x.dtype == mx.float32 else x.astype(mx.float32)


def _additive_mask_t(mask: Any, L: int, kL: int, kv: int, n_rep: int) -> mx.array | None:
    """The mask as additive scores, broadcastable to the transposed scores (B, KV, kL, n_rep, L)."""
    if mask is None:
        return None
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unsupported mask {mask!r}")
        # Aligned bottom-right like mlx: query i sits at position kL - L + i.
        keep = mx.arange(kL)[:, None] <= mx.arange(kL - L, kL)[None]
        return mx.expand_dims(mx.where(keep, 0.0, _MASKED), 1)
    if mask.dtype == mx.bool_:
        add = mx.where(mask, 0.0, _MASKED)
    else:
        add = mx.maximum(mask.astype(mx.float32), _MASKED)  # -inf -> _MASKED
    if add.ndim < 2:
        add = add[None]
    if add.ndim == 2:  # (L or 1, kL)
        return mx.expand_dims(add.T, 1)
    if add.ndim == 3:  # (H or 1, L, kL): broadcast rules put it on the head axis
        add = add[None]
    if add.shape[1] == 1:  # (B, 1, L, kL) -> (B, 1, kL, 1, L)
        return mx.expand_dims(add.swapaxes(-1, -2), -2)
    add = add.reshape(add.shape[0], kv, n_rep, *add.shape[2:])  # per query head
    return add.transpose(0, 1, 4, 2, 3)


def _attend(q: mx.array, k: mx.array, v: mx.array, mask: Any, kv: int, n_rep: int) -> mx.array:
    """Softmax attention of grouped queries (B, KV, n_rep * L, D); returns (B, KV, n_rep * L, Dv)."""
    B, _, rows, _ = q.shape
    L = rows // n_rep
    kL = k.shape[2]
    # Prefill shapes repeat across layers: fuse per shape. Decode grows kL every step: shapeless.
    fixed = rows >= 32 and rows * kL * kv >= _SMALL
    s = (k @ q.swapaxes(-1, -2)).reshape(B, kv, kL, n_rep, L)  # scores, transposed
    add = _additive_mask_t(mask, L, kL, kv, n_rep)
    if add is not None:
        s = s + add
    x = s - s.max(-3, keepdims=True)  # <= 0, and >= ~_MASKED: no float clamp needed
    p, e = _exp_parts(x, _exp_bits_neg, fixed)
    w = _mul(p, e, fixed=fixed).reshape(B, kv, kL, rows)
    o = w.swapaxes(-1, -2) @ v  # BLAS reads the transposed operand in place
    return o / w.sum(-2)[..., None]


def _run(q: mx.array, k: mx.array, v: mx.array, mask: Any, kv: int, n_rep: int) -> mx.array:
    """``_attend_host`` for a block of queries (a prefill chunk's, a warm turn's); one mlx
    pass for a decode step (its few scores make the sync cost more than NumPy's exp saves:
    SmolLM2 decode at 16K, A/B, 4.6 tok/s through NumPy, 5.2 without); key tiles where the
    scores would take too much memory."""
    rows, kL = q.shape[2], k.shape[2]
    if rows < _HOST_ROWS:
        return _attend(q, k, v, mask, kv, n_rep)
    if q.shape[0] * kv * rows * kL > _HOST_MAX_SCORES:
        return _attend_tiled(q, k, v, mask, kv, n_rep, _KEY_TILE)
    return _attend_host(q, k, v, mask, kv, n_rep)


def _attend_host(q: mx.array, k: mx.array, v: mx.array, mask: Any, kv: int, n_rep: int) -> mx.array:
    """``_attend`` with the two matmuls in mlx (its BLAS) and the mask and softmax in NumPy,
    in place on the scores' own memory (an evaluated mlx array's buffer, through the buffer
    protocol; nothing else holds it).

    Why: NumPy's ufuncs are built for the CPU they run on (``exp`` with AVX-512 here: 0.5 ms
    for 1.1M scores) where mlx's JIT loops are baseline SSE2. Per layer, 45 query rows over
    8K keys: 10.9 -> 5.5 ms; a prefill block (384 rows) over 16K keys: ~150 ms in key tiles
    -> ~105 ms. The matmuls stay in mlx: NumPy's own BLAS keeps its threads spinning after a
    call, which slowed the mlx ops around it 2-3x on two cores. The cost is one sync per
    call: the scores are evaluated here, so the layer's graph up to them runs first.

    Past ``_HOST_UNTILED_SCORES`` scores the keys go in tiles, the softmax merged across them (a
    running max and sum, as ``_attend_tiled``): a whole block's scores (38 MB for SmolLM2's
    384 rows over 8K keys) are larger than mlx's 32 MB buffer cache, so each block's came from
    fresh memory, page by page; a tile's buffer is reused tile after tile and layer after
    layer. One block, 8K / 16K keys: 43 / 76 ms -> 35 / 48 ms; a 256-token prefill chunk of
    SmolLM2 at 8K (A/B in one process, 4 runs each): 2.80 -> 2.17 s. A warm turn's few rows
    stay one tile (45 rows over 8K keys: 4.4 MB of scores).
    """
    B, _, rows, _ = q.shape
    L = rows // n_rep
    kL = k.shape[2]
    if isinstance(mask, mx.array) and mask.dtype not in (mx.bool_, mx.float32):
        mask = mask.astype(mx.float32)  # NumPy has no bfloat16
    if isinstance(mask, str) and mask != "causal":
        raise ValueError(f"unsupported mask {mask!r}")
    held = [mask] if isinstance(mask, mx.array) else []  # evaluated with the first tile's scores
    m_np = None
    per_key = B * kv * rows
    tile = kL if per_key * kL <= _HOST_UNTILED_SCORES else max(256, _HOST_TILE_SCORES // per_key // 256 * 256)
    top = acc = den = None
    for a in range(0, kL, tile):
        z = min(a + tile, kL)
        kt, vt = (k, v) if tile == kL else (k[:, :, a:z], v[:, :, a:z])
        scores = q @ kt.swapaxes(-1, -2)  # (B, KV, rows, z - a)
        mx.eval(scores, *held)
        if held and m_np is None:
            m = np.asarray(held[0])
            m = m.reshape((1,) * (4 - m.ndim) + m.shape)  # (B or 1, H or 1, L or 1, kL or 1)
            m_np = m[:, :, None] if m.shape[1] == 1 else m.reshape(m.shape[0], kv, n_rep, *m.shape[2:])
        s = np.asarray(scores)  # a view of the scores' buffer: written in place below
        _mask_host(s.reshape(B, kv, n_rep, L, z - a), mask, m_np, a, z, kL, L)
        new, total = _softmax_host(s.reshape(-1, z - a), None if top is None else top.reshape(-1, 1))
        o = scores @ vt
        if top is None:
            acc, den = o, total
        else:  # rescale what earlier tiles summed to the new running max
            c = np.exp(top - new)
            acc, den = acc * mx.array(c.reshape(B, kv, rows, 1)) + o, den * c + total
        top = new
        if tile != kL:
            mx.eval(acc)  # frees this tile's scores for the next tile (mlx's buffer cache)
    assert acc is not None and den is not None
    return acc / mx.array(den.reshape(B, kv, rows, 1))


def _mask_host(s5: np.ndarray, mask: Any, m5: np.ndarray | None, a: int, z: int, kL: int, L: int) -> None:
    """Mask scores ``s5`` (B, KV, n_rep, L, keys ``[a, z)``) in place: "causal" (query i at
    position kL - L + i; only the last L keys are ever masked), boolean or additive ``m5``."""
    if isinstance(mask, str):
        c0 = max(a, kL - L)
        if c0 < z:
            tri = np.triu(np.full((L, L), _MASKED, np.float32), 1)
            s5[..., c0 - a :] += tri[:, c0 - (kL - L) : z - (kL - L)]
        return
    if m5 is None:
        return
    part = m5 if m5.shape[-1] == 1 else m5[..., a:z]
    if part.dtype == np.bool_:
        np.putmask(s5, ~np.broadcast_to(part, s5.shape), _MASKED)
    else:  # additive: -inf clamped to _MASKED (a fully masked row then averages, as mx.fast does)
        s5 += np.maximum(part.astype(np.float32), _MASKED)


def _softmax_host(flat: np.ndarray, floor: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """``exp(flat - max)`` in place, row by row group (each group's passes run in the cache),
    the max taken over each row and ``floor`` (the running max of earlier tiles); returns
    the max used and the row sums."""
    n, width = flat.shape
    top = np.empty((n, 1), np.float32)
    den = np.empty((n, 1), np.float32)
    step = max(8, _HOST_CHUNK // width)
    for a in range(0, n, step):
        x, t = flat[a : a + step], top[a : a + step]
        np.max(x, axis=-1, keepdims=True, out=t)
        if floor is not None:
            np.maximum(t, floor[a : a + step], out=t)
        np.subtract(x, t, out=x)
        np.exp(x, out=x)
        np.sum(x, axis=-1, keepdims=True, out=den[a : a + step])
    return top, den


def _attend_tiled(
    q: mx.array, k: mx.array, v: mx.array, mask: Any, kv: int, n_rep: int, tile: int
) -> mx.array:
    """``_attend`` over keys in tiles of ``tile``, the softmax merged across tiles
    (running max and sum, as flash attention does): memory for one tile's scores only, where
    a whole block's would be too large (``_HOST_MAX_SCORES``). In mlx, the whole block's
    scores were read and written ~12 times from memory; a tile's stay in the cache (1 layer,
    384 query rows, 8K keys: 140 ms whole, 45 ms in tiles of 256)."""
    B, _, rows, _ = q.shape
    L = rows // n_rep
    kL = k.shape[2]
    fixed = rows >= 32 and rows * tile * kv >= _SMALL
    add = _additive_mask_t(mask, L, kL, kv, n_rep)
    # Keys every query sees need no mask: "causal" masks only the last L keys.
    masked_from = kL if add is None else (kL - L if isinstance(mask, str) else 0)
    qt = q.swapaxes(-1, -2)
    m = acc = den = None
    for a in range(0, kL, tile):
        z = min(a + tile, kL)
        s = (k[:, :, a:z] @ qt).reshape(B, kv, z - a, n_rep, L)
        if add is not None and z > masked_from:
            s = s + add[..., a:z, :, :]
        top = s.max(-3, keepdims=True)
        new = top if m is None else mx.maximum(m, top)
        p, e = _exp_parts(s - new, _exp_bits_neg, fixed)
        w = _mul(p, e, fixed=fixed).reshape(B, kv, z - a, rows)
        o = w.swapaxes(-1, -2) @ v[:, :, a:z]
        total = w.sum(-2)
        if m is None:
            acc, den = o, total
        else:  # rescale what earlier tiles summed to the new running max
            c = fast_exp(m - new).reshape(B, kv, rows)
            acc = acc * c[..., None] + o
            den = den * c + total
        m = new
    assert acc is not None and den is not None
    return acc / den[..., None]


_block_cache: list[tuple[mx.array, list[tuple[int, int, int, int]] | None]] = []


def _query_blocks(mask: Any, L: int, kL: int) -> list[tuple[int, int, int, int]] | None:
    """Query blocks (a, b) of a long prefill with the key range [lo, hi) each one can see.

    "causal": block [a, b) sees keys [0, kL - L + b). A boolean (L, kL) mask (mlx-lm's
    sliding-window layers) is inspected once (the same array serves every layer of a forward
    pass, hence the one-entry cache); None when a row is fully masked (mx.fast then averages
    over all keys, so the keys cannot be cut) or the mask is of another kind.
    """
    starts = range(0, L, _CAUSAL_BLOCK)
    if isinstance(mask, str):
        return [(a, min(a + _CAUSAL_BLOCK, L), 0, kL - L + min(a + _CAUSAL_BLOCK, L)) for a in starts]
    if mask is None or mask.dtype != mx.bool_ or mask.size != L * kL or mask.shape[-1] != kL:
        return None
    for cached, blocks in _block_cache:
        if cached is mask:
            return blocks
    m2 = mask.reshape(L, kL)
    cols = mx.arange(kL)
    first = mx.where(m2, cols, kL).min(axis=1)
    last = mx.where(m2, cols, -1).max(axis=1)
    first_np, last_np = np.array(first), np.array(last)  # one sync per mask, not per layer
    result: list[tuple[int, int, int, int]] | None = None
    if (last_np >= 0).all():
        result = []
        for a in starts:
            b = min(a + _CAUSAL_BLOCK, L)
            result.append((a, b, int(first_np[a:b].min()), int(last_np[a:b].max()) + 1))
    _block_cache[:] = [(mask, result)]
    return result


def attention(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any = None
) -> mx.array:
    """``mx.fast.scaled_dot_product_attention`` for float (not quantized) K/V, on BLAS.

    queries (B, H, L, D); keys (B, KV, kL, D); values (B, KV, kL, Dv) with H a multiple of
    KV; mask None, "causal" (bottom-right aligned), a boolean (True = attend) or additive
    array broadcastable to (B, H, L, kL). Computed in float32, returned in queries' dtype.
    A fully masked row gives the mean of the values for a boolean mask (as mx.fast does), and
    also for an additive mask of -inf (mx.fast: NaN), since -inf is clamped to -1e9.
    """
    B, H, L, D = queries.shape
    kv = keys.shape[1]
    if H * L * keys.shape[2] < _SDPA_SMALL:
        # Decode over a short context: mx.fast's single op beats our ~15 small ones.
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
    n_rep = H // kv
    q = (_f32(queries) * scale).reshape(B, kv, n_rep * L, D)
    k = _f32(keys)
    v = _f32(values)
    blocks = _query_blocks(mask, L, k.shape[2]) if L >= 2 * _CAUSAL_BLOCK else None
    if blocks is None:
        o = _run(q, k, v, mask, kv, n_rep)
    else:
        # Long prefill: each block of queries only multiplies the keys it can see (skips the
        # causal upper triangle, and everything outside a sliding window), and stays in cache.
        q5 = q.reshape(B, kv, n_rep, L, D)
        outs = []
        for a, b, lo, hi in blocks:
            qc = q5[:, :, :, a:b].reshape(B, kv, n_rep * (b - a), D)
            mc = "causal" if isinstance(mask, str) else mask.reshape(L, -1)[a:b, lo:hi]
            oc = _run(qc, k[:, :, lo:hi], v[:, :, lo:hi], mc, kv, n_rep)
            outs.append(oc.reshape(B, kv, n_rep, b - a, -1))
        o = mx.concatenate(outs, axis=3)
    return o.reshape(B, H, L, -1).astype(queries.dtype)


def jit_available() -> bool:
    """Whether mlx can JIT-compile the fused CPU loops these kernels rely on (``g++`` on
    Linux); without it the ops run unfused, one pass each, slower than mlx's own."""
    return not sys.platform.startswith("linux") or shutil.which("g++") is not None
