"""Attention on the CPU for prefill-sized calls (``fast_ops`` holds the fused elementwise
kernels this builds on; its docstring says why and what was measured): scores and softmax in
NumPy on the host where that is faster than mlx's unfused loops, keys in tiles where one
block's scores would not fit, causal prefills in blocks of query rows, and mlx's own fused
attention for small (decode-sized) problems."""

from __future__ import annotations

from typing import Any

import numpy as np

from .fast_ops import SMALL_ELEMENTS, exp_bits_neg, exp_parts, fast_exp, mul_kernel
from .runtime import mx

# Additive score of a masked key. Finite (no inf - inf) and small enough that the polynomial
# of its (wrongly reduced) r stays finite, so exp gives exactly 0 through the 2**n bits; large
# enough that a fully masked row ends up uniform, as with mx.fast's boolean masks.
_MASKED = -1e9
# Fewer scores than this (H * L * kL): mx.fast's single op. Alone, ours wins from H * kL ~ 4600
# (L = 1); inside a decode step the cost of building ~15 small ops moves that to ~16K.
_SDPA_SMALL = 16384
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
    fixed = rows >= 32 and rows * kL * kv >= SMALL_ELEMENTS
    s = (k @ q.swapaxes(-1, -2)).reshape(B, kv, kL, n_rep, L)  # scores, transposed
    add = _additive_mask_t(mask, L, kL, kv, n_rep)
    if add is not None:
        s = s + add
    x = s - s.max(-3, keepdims=True)  # <= 0, and >= ~_MASKED: no float clamp needed
    p, e = exp_parts(x, exp_bits_neg, fixed)
    w = mul_kernel(p, e, fixed=fixed).reshape(B, kv, kL, rows)
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
    fixed = rows >= 32 and rows * tile * kv >= SMALL_ELEMENTS
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
        o, total = _weighted(s, new, v[:, :, a:z], fixed)
        if m is None:
            acc, den = o, total
        else:  # rescale what earlier tiles summed to the new running max
            c = fast_exp(m - new).reshape(B, kv, rows)
            acc = acc * c[..., None] + o
            den = den * c + total
        m = new
    assert acc is not None and den is not None
    return acc / den[..., None]


def _weighted(s: mx.array, top: mx.array, v: mx.array, fixed: bool) -> tuple[mx.array, mx.array]:
    """Transposed scores ``s`` (B, KV, keys, n_rep, L) against their max ``top``: the
    unnormalised output ``exp(s - top)^T v`` (B, KV, n_rep * L, Dv) and its weights' sums."""
    B, kv, n, n_rep, L = s.shape
    p, e = exp_parts(s - top, exp_bits_neg, fixed)
    w = mul_kernel(p, e, fixed=fixed).reshape(B, kv, n, n_rep * L)
    return w.swapaxes(-1, -2) @ v, w.sum(-2)


def attention_over_decoded_prefix(
    queries: mx.array,
    prefix_k: mx.array,
    prefix_v: mx.array,
    keys: mx.array,
    values: mx.array,
    valid: mx.array,
    scale: float,
) -> mx.array:
    """Attention of a batch whose members' keys all begin with the same rows (a fan-out's
    siblings over one stored system prompt): each member's queries (B, H, L, D), its last
    L positions, over ``prefix_k`` / ``prefix_v`` (1, KV, n, D), which every query sees,
    then over its own ``keys`` / ``values`` (B, KV, T, D), causally; ``valid`` (B, T)
    marks each member's rows among the left padding.

    The prefix is read once for the whole batch, every member's queries folded into one
    (1, KV, B * n_rep * L, D) product, instead of once per member: 8 SmolLM2 siblings at 1K
    tokens read 13 MB of keys and values per layer and decode step where 1.7 MB hold them,
    and their tails' prefill ran one host softmax per member and layer (a sync each). The
    two parts' softmaxes are merged by their maxima (flash decoding's rule): the sum of one
    softmax over each member's own keys."""
    B, H, L, D = queries.shape
    kv, n = prefix_k.shape[1], prefix_k.shape[2]
    n_rep, T = H // kv, keys.shape[2]
    rows = n_rep * L
    q = (_f32(queries) * scale).reshape(B, kv, rows, D)
    # The prefix: every member's query rows as columns of one product, (1, KV, n, B * rows).
    qp = q.transpose(1, 0, 2, 3).reshape(1, kv, B * rows, D)
    sp = (_f32(prefix_k) @ qp.swapaxes(-1, -2)).reshape(1, kv, n, B * rows, 1)
    top_p = sp.max(-3, keepdims=True)
    op, dp = _weighted(sp, top_p, _f32(prefix_v), B * rows * n * kv >= SMALL_ELEMENTS)

    def per_member(x: mx.array) -> mx.array:  # (1, KV, B * rows, ...) -> (B, KV, rows, ...)
        return x.reshape(kv, B, rows, *x.shape[3:]).transpose(1, 0, 2, *range(3, x.ndim))

    op, dp, top_p = per_member(op), per_member(dp), per_member(top_p.reshape(1, kv, -1))
    # The members' own rows: query j (of L) sees key column c <= T - L + j (bottom-right
    # aligned, as each member's positions are), and none of the padding.
    see = valid[:, None, :] & (mx.arange(T)[None, None, :] <= mx.arange(T - L, T)[None, :, None])
    st = (_f32(keys) @ q.swapaxes(-1, -2)).reshape(B, kv, T, n_rep, L)
    st = st + mx.where(see, 0.0, _MASKED).swapaxes(-1, -2)[:, None, :, None, :]
    top_t = st.max(-3, keepdims=True)
    ot, dt = _weighted(st, top_t, _f32(values), B * rows * T * kv >= SMALL_ELEMENTS)
    top_t = top_t.reshape(B, kv, rows)
    top = mx.maximum(top_p, top_t)
    cp, ct = fast_exp(top_p - top), fast_exp(top_t - top)
    o = (op * cp[..., None] + ot * ct[..., None]) / (dp * cp + dt * ct)[..., None]
    return o.reshape(B, H, L, -1).astype(queries.dtype)


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
