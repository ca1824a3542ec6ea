"""Attention on the stored form: queries against an agent's keys and values as they are
held (16-bit head tokens, the quantized body, this request's full-precision tokens), with
no full-precision working copy of the body.

Why: a working copy of a 32K-token agent of an 8B model is 4.3 GB of bf16 beside its
1.5 GB stored form; served from the stored form an agent costs what it costs parked, so
about 2.9x as many agents fit in one device's memory (the default format's bytes are
0.346x bf16's).

How (``stored_attention``): the query heads that share a KV head are folded into the
query rows, ``(B, kv_heads, n_rep * L, D)``, so every product has equal batch dimensions
on both sides. mlx-lm's own quantized attention broadcasts the keys over a query-repeat
dimension instead, which mlx's CUDA ``quantized_matmul`` refuses for multi-row queries
(../shared/FACTS.md). Scores of each segment (``mx.quantized_matmul`` on the body, a plain
matmul elsewhere), one softmax over all of them, then each segment's values. Keys stored
after the codec's rotation meet the query rotated alike (``q R . k R = q . k``); values
stored rotated are rotated back after their product. Only mlx ops that Metal has natively
(``quantized_matmul`` is Metal's own kernel), so an Apple machine takes this path unchanged.

Where the scores of one call would be large (a prefill chunk of thousands of queries over
a long context), the segments are decoded to full precision for that call only and one
fused attention runs over them (``attention``): a transient copy of one layer, freed
after the step, instead of a copy of every layer kept for the request.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from ..ops.runtime import mx
from . import stored_cuda
from .codecs import TensorCodec, rotation

Parts = tuple[mx.array, ...]
#: A run of consecutive visible tokens: K parts, V parts and the codecs they are stored in.
Segment = tuple[Parts, Parts, TensorCodec, TensorCodec]

#: Above this many scores in one call (batch x kv heads x query rows x keys), the segments
#: are decoded for the call and one fused attention runs (see the module's docstring): a
#: 2,048-token prefill chunk of an 8B model over 32K keys would need 8.6 GB of scores.
SCORES_MAX = 1 << 25


def attention(
    q: mx.array, k: mx.array, v: mx.array, scale: float, mask: Any, sinks: mx.array | None = None
) -> mx.array:
    """Full-precision attention, the device's fastest: the CPU kernels of ``fast_ops`` on the
    CPU (with attention sinks, mlx's op), mlx's fused kernel on a GPU."""
    if sinks is None and mx.default_device() == mx.cpu:
        from ..ops import cpu_attention

        return cpu_attention.attention(q, k, v, scale=scale, mask=mask)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks)


@functools.cache
def _rotation_as(dim: int, dtype: mx.Dtype) -> mx.array:
    r = rotation(dim)
    if r.dtype == dtype:
        return r
    # Evaluated before it is kept: a lazy array can only be evaluated on the thread that
    # made it ("There is no Stream(cpu, 0) in current thread"), and this one serves all.
    out = r.astype(dtype)
    mx.eval(out)
    return out


def decode_segment(parts: Parts, codec: TensorCodec, dtype: mx.Dtype) -> mx.array:
    """A segment's keys or values at full precision, in the model's space."""
    x = codec.decode(parts, dtype)
    if codec.rotate:
        x = x @ _rotation_as(x.shape[-1], x.dtype).T
    return x


def positional_mask(
    first_q: int, L: int, first_k: int, window: int | None, return_array: bool, chunk: int | None = None
) -> mx.array | str | None:
    """Queries at ``[first_q, first_q + L)`` over keys ``[first_k, first_q + L)``: causal and,
    with a ``window``, ``query - key < window``; with a ``chunk``, a key of the query's own
    chunk only. None where every query sees every key; ``"causal"`` (bottom-right aligned,
    mlx's fused form) where that is all, unless an array is asked for."""
    end = first_q + L
    if chunk is not None:
        q_pos, k_pos = mx.arange(first_q, end)[:, None], mx.arange(first_k, end)[None]
        return (k_pos <= q_pos) & (k_pos // chunk == q_pos // chunk)
    if L == 1 and (window is None or end - first_k <= window):
        return mx.ones((1, end - first_k), dtype=mx.bool_) if return_array else None
    if window is None and first_k == 0 and not return_array:
        return "causal"
    q_pos = mx.arange(first_q, end)[:, None]
    k_pos = mx.arange(first_k, end)[None]
    mask = k_pos <= q_pos
    if window is not None:
        mask = mask & (q_pos - k_pos < window)
    return mask


def stored_attention(
    queries: mx.array,
    segments: Sequence[Segment],
    scale: float,
    first_q: int,
    first_k: int,
    window: int | None,
    sinks: mx.array | None = None,
    valid: mx.array | None = None,
    row_starts: mx.array | None = None,
    full_body: bool = False,
) -> mx.array:
    """Attention of ``queries`` (B, H, L, D), at positions ``[first_q, first_q + L)``, over
    ``segments`` (oldest first, consecutive from position ``first_k``): causal, and within
    ``window`` on a sliding layer. ``valid`` (B, keys), for one decoded token per row of a
    batch (``StoredBatch``): the keys each row may see, instead of positions; with it,
    ``row_starts`` (B, 4) int32 for the CUDA kernels: each row's first valid column of
    body, head and pending tokens (``stored_cuda.attention``). ``full_body``: the format is
    16-bit (segments: the body, then the request's tokens). Returns (B, H, L, value
    width) in the queries' dtype."""
    B, H, L, D = queries.shape
    kv_heads = segments[0][0][0].shape[1]
    n_keys = sum(seg[0][0].shape[2] for seg in segments)
    rep = H // kv_heads
    fused = _kernels(queries, segments, scale, first_q, first_k, window, sinks, valid, row_starts, full_body)
    if fused is not None:
        return fused
    if B * kv_heads * rep * L * n_keys > SCORES_MAX:
        return _decoded_attention(queries, segments, scale, first_q, first_k, window, sinks, valid)
    dtype = queries.dtype
    # Scores, softmax and the weighted sum in float32, the result cast back: rounded to
    # bf16 on the way, Gemma 3's load-time self-check missed its tolerance on CUDA
    # (worst error 0.081 vs 0.08 over random bf16 weights; 0.063 in float32, H100).
    q = (queries.astype(mx.float32) * scale).reshape(B, kv_heads, rep * L, D)
    rotated_q = None
    scores = []
    for kparts, _, kcodec, _ in segments:
        if kcodec.rotate and rotated_q is None:
            rotated_q = q @ rotation(D)
        x = rotated_q if kcodec.rotate else q
        scores.append(_product(x, kparts, kcodec, transpose=True))
    s = scores[0] if len(scores) == 1 else mx.concatenate(scores, axis=-1)
    if valid is not None:
        s = mx.where(valid[:, None, None, :], s, mx.finfo(s.dtype).min)
    elif positional_mask(first_q, L, first_k, window, False) is not None:
        mask = positional_mask(first_q, L, first_k, window, True)
        assert isinstance(mask, mx.array)
        if rep > 1:
            mask = mx.broadcast_to(mask[None], (rep, L, n_keys)).reshape(rep * L, n_keys)
        s = mx.where(mask, s, mx.finfo(s.dtype).min)
    if sinks is not None:  # one more logit per query head, in the softmax only
        sink = mx.broadcast_to(sinks.astype(s.dtype).reshape(1, kv_heads, rep, 1), (B, kv_heads, rep, L))
        s = mx.concatenate([sink.reshape(B, kv_heads, rep * L, 1), s], axis=-1)
    p = mx.softmax(s, axis=-1)
    if sinks is not None:
        p = p[..., 1:]
    out = None
    at = 0
    for _, vparts, _, vcodec in segments:
        n = vparts[0].shape[2]
        o = _product(p[..., at : at + n], vparts, vcodec, transpose=False)
        if vcodec.rotate:
            o = o @ _rotation_as(o.shape[-1], o.dtype).T
        out = o if out is None else out + o
        at += n
    assert out is not None
    return out.astype(dtype).reshape(B, H, L, -1)


#: mlx 0.32.4's CUDA ``quantized_matmul`` (measured on the H200): the scores product with
#: 4- and 8-bit groups only (6 bits: "No implementation for problem shape"), and not the
#: values product of every shape ("196x128x4106x8, transpose: false, bits: 4" has none).
#: There a segment is decoded for the call instead (a layer's transient copy: 0.12 ms for
#: 32K keys). Metal and the CPU have every width and both products natively.
CUDA_BITS = (4, 8)
#: Query rows (per matrix) up to which CUDA takes the scores product (its vector kernel): a
#: prefill chunk's rows go to the matrix kernel, which has no implementation for a key
#: count that is not a multiple of its tiles (plain q4 on the H200, 15 new tokens over an
#: 8207-token body: "No implementation for problem shape: 60x8207x128x8").
CUDA_VECTOR_ROWS = 8


def native(codec: TensorCodec, transpose: bool, rows: int = 1) -> bool:
    """Whether this device multiplies ``codec``'s stored form directly (``quantized_matmul``)
    for ``rows`` query rows."""
    if codec.bits is None or codec.padded:  # padded heads: the decoded form is cut to width
        return False
    if mx.cuda.is_available() and mx.default_device() != mx.cpu:
        return transpose and codec.bits in CUDA_BITS and rows <= CUDA_VECTOR_ROWS
    return True


def _product(x: mx.array, parts: Parts, codec: TensorCodec, transpose: bool) -> mx.array:
    """``x @ stored.T`` (scores) or ``x @ stored`` (values) on the stored form, still in the
    codec's rotated space where it rotates."""
    if not native(codec, transpose, x.shape[-2]):
        w = codec.decode(parts, x.dtype)
        return x @ (w.swapaxes(-1, -2) if transpose else w)
    q, scales, biases = parts
    if scales.dtype != x.dtype:
        scales, biases = scales.astype(x.dtype), biases.astype(x.dtype)
    return mx.quantized_matmul(
        x, q, scales, biases, transpose=transpose, group_size=codec.group_size, bits=codec.bits
    )


def _kernels(
    queries: mx.array,
    segments: Sequence[Segment],
    scale: float,
    first_q: int,
    first_k: int,
    window: int | None,
    sinks: mx.array | None,
    valid: mx.array | None,
    row_starts: mx.array | None,
    full_body: bool,
) -> mx.array | None:
    """The call through ``stored_cuda``'s kernels where they take it (CUDA, a decode-sized
    call over [16-bit head,] body and the request's own tokens, every key in the window),
    else None. The body is the quantized segment; where none is quantized (the 16-bit
    format: body and own tokens), the segment before the own tokens."""
    quantized = [seg[2].bits is not None for seg in segments]
    if not any(quantized):
        # The 16-bit format (body, own tokens): the unfused path would widen every key and
        # value to float32 at every step (32K decode: 17.5 tok/s on the H100, mlx-lm's 66).
        # A quantized format's head and own tokens alone (no body yet) are few: unfused.
        if not full_body or len(segments) != 2:
            return None
        i = 0
    else:
        i = quantized.index(True)
        if quantized.count(True) != 1 or i > 1 or i + 2 != len(segments):
            return None
    (hk, *_), (hv, *_) = segments[0][:2] if i else ((None,), (None,))
    kparts, vparts, kcodec, vcodec = segments[i]
    (pk, *_), (pv, *_) = segments[i + 1][:2]
    B, H, L, D = queries.shape
    rows = H // kparts[0].shape[1] * L
    value_dim = vparts[0].shape[-1] if vcodec.bits is None else vparts[1].shape[-1] * vcodec.group_size
    if not stored_cuda.fits(rows, D, value_dim, kcodec, vcodec):
        return None
    if window is not None and first_q + L - 1 - first_k >= window:
        return None
    if valid is not None:
        if row_starts is None:
            return None
        starts = row_starts
    else:
        pending_at = first_q + L - pk.shape[2]  # the request's own tokens end with the queries
        starts = stored_cuda.plain_starts(B, first_q - pending_at if L > 1 else stored_cuda.ALL_VISIBLE)
    head = None if hk is None else (hk, hv)
    return stored_cuda.attention(
        queries, scale, head, (kparts, vparts), (pk, pv), kcodec, vcodec, starts, sinks
    )


def _decoded_attention(
    queries: mx.array,
    segments: Sequence[Segment],
    scale: float,
    first_q: int,
    first_k: int,
    window: int | None,
    sinks: mx.array | None,
    valid: mx.array | None = None,
) -> mx.array:
    """One fused attention over the segments decoded for this call (a long prefill chunk)."""
    dtype = queries.dtype
    ks = [decode_segment(kp, kc, dtype) for kp, _, kc, _ in segments]
    vs = [decode_segment(vp, vc, dtype) for _, vp, _, vc in segments]
    k = ks[0] if len(ks) == 1 else mx.concatenate(ks, axis=2)
    v = vs[0] if len(vs) == 1 else mx.concatenate(vs, axis=2)
    if valid is not None:
        mask: Any = valid[:, None, None, :]
    else:
        mask = positional_mask(first_q, queries.shape[2], first_k, window, False)
    return attention(queries, k, v, scale, mask, sinks)
