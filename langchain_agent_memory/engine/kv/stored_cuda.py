"""Decode attention over an agent's stored form in two CUDA kernels: the quantized body's
packed keys and values are read once and decoded in registers, the 16-bit head tokens and
the request's own full-precision tokens are attended in the same launch, and the output
leaves in the model's layout.

Why: mlx 0.32.4's CUDA ``quantized_matmul`` has no 6-bit keys (the default format's) and
no values product for some shapes, so ``stored_attention`` decoded the whole body to bf16
at every decode step (a step 5x slower than over a working copy at 16K tokens of an 8B
model); and a step built from mlx ops over three segments costs ~30 launches per layer
where mlx's fused attention over a copy costs one. Here a layer's decode attention is two.

How (split-K "flash decoding"): one thread block per (batch row, KV head, chunk of keys).
A chunk is ``CHUNK`` keys of the body, the head tokens, or ``CHUNK`` of the request's own
tokens. The block holds its query rows (the GQA heads of one KV head and the call's tokens,
``rep * L`` rows) in shared memory, scaled, and for body chunks rotated by the codec's
rotation (a fast Walsh-Hadamard transform: ``q R = FWHT(q * signs)``). Each thread scores
whole keys: a body key's packed words are loaded per quantization group and ``score =
scale_g * (q . codes) + bias_g * sum(q)``, so the inner loop is a shift, a mask and one
FMA per query row. The chunk's maximum and softmax numerators stay in the block; each
thread then owns a value channel and sums ``p * value`` over the chunk's keys; a body
chunk's sums are rotated back (``o R^T = FWHT(o) * signs``). The merge kernel combines the
chunks in order (deterministic: the same keys give the same sums whatever the batch), adds
the attention sink where the model has one, normalises and writes (B, heads, L, width).

Chunks start at each batch row's first valid column of each region (``starts``), so an
agent's keys fall into the same chunks alone and inside a left-padded batch: batched
decode equals decode alone on this path as on the others. The request's own tokens are
causal where a call has several (``starts``' last column: the first query's column there).

mlx packs ``bits``-bit codes as one little-endian bit stream per row (``codecs.unpack_affine``);
a group of 32, 64 or 128 codes of 2-8 bits always ends on a 32-bit word, so a group's words
are loaded once and a code straddles at most two of them.

Every shape is read at run time (``_shape``), every changing count from ``starts``: the
kernels compile once per model shape and format, not per context length.

CUDA only (``mx.fast.cuda_kernel``). Metal keeps ``stored_attention``'s ``quantized_matmul``
path, Metal's own kernel for every width.
"""

from __future__ import annotations

import functools
from typing import Any

from ..ops.runtime import mx
from .codecs import SCALE_DTYPE, TensorCodec, rotation, rotation_signs
from .stored_cuda_source import HEADER, MERGE_INPUTS, MERGE_SOURCE, PARTIAL_INPUTS, PARTIAL_SOURCE

Parts = tuple[mx.array, ...]

#: Threads per block: each scores ``CHUNK / THREADS`` keys, then owns a value channel
#: (``THREADS // value width`` threads share one and split the chunk's keys).
THREADS = 256
#: Query rows one block holds (an agent's GQA heads times its new tokens): decode steps.
#: Longer calls (a prefill chunk) take ``stored_attention``'s other paths.
MAX_ROWS = 16
#: Floats of query rows in shared memory (rows x key width): with the scores (rows x
#: ``CHUNK``) and the values' reduction buffer they stay under 48 KB of static shared memory.
MAX_QUERY_FLOATS = 1024
#: Keys per block. Small enough that one agent's 4K tokens make 128 blocks over 8 KV
#: heads (with 1,024 an H200 ran 48 blocks on 132 SMs: 0.26 ms per layer against 0.12 for
#: mlx's fused attention over a copy); fixed, so an agent's keys fall into the same chunks
#: whatever the batch and the kernels compile once.
CHUNK = 256
#: ``starts``' causal column where every key is visible (one new token per row).
ALL_VISIBLE = 1 << 30


@functools.cache
def _kernels() -> tuple[Any, Any]:
    partial = mx.fast.cuda_kernel(
        name="agent_memory_stored_partial",
        input_names=PARTIAL_INPUTS,
        output_names=["o_part", "m_part", "l_part"],
        source=PARTIAL_SOURCE,
        header=HEADER,
        ensure_row_contiguous=False,  # views of buffers with room: every input by its strides
    )
    merge = mx.fast.cuda_kernel(
        name="agent_memory_stored_merge",
        input_names=MERGE_INPUTS,
        output_names=["out"],
        source=MERGE_SOURCE,
    )
    return partial, merge


def available() -> bool:
    """Whether this device runs the kernels (mlx's CUDA backend, the GPU the default)."""
    return bool(mx.cuda.is_available()) and mx.default_device() != mx.cpu


def fits(rows: int, key_dim: int, value_dim: int, keys: TensorCodec, values: TensorCodec) -> bool:
    """Whether one call of ``rows`` query rows (per KV head) over a body stored as
    ``keys`` / ``values`` (both quantized, or both 16-bit) takes the kernels."""
    if (keys.bits is None) != (values.bits is None):
        return False
    quantized = keys.bits is not None
    return (
        rows <= MAX_ROWS
        and rows * key_dim <= MAX_QUERY_FLOATS
        and value_dim <= THREADS
        and (not quantized or (key_dim % keys.group_size == 0 and value_dim % values.group_size == 0))
        and available()
    )


@functools.cache
def _constant(values: tuple[float, ...]) -> mx.array:
    return mx.array(values, dtype=mx.float32)


@functools.cache
def _empty(dtype: mx.Dtype) -> mx.array:
    """An input a kernel launch does not read (the other body form's)."""
    out = mx.zeros((1, 1, 0, 1), dtype=dtype)
    mx.eval(out)  # made once, used from every thread: evaluated here (see ``stored._rotation_as``)
    return out


@functools.cache
def _signs(dim: int) -> mx.array:
    return mx.array(rotation_signs(dim).astype("float32"))


def plain_starts(batch: int, causal: int = ALL_VISIBLE) -> mx.array:
    """``starts`` of rows that hold every column of every region (one request, or a batch
    of equal members); ``causal``: the first query's column among the request's tokens."""
    if causal == ALL_VISIBLE:
        return _plain_starts(batch)
    return mx.array([[0, 0, 0, causal]] * batch, dtype=mx.int32)


@functools.cache
def _plain_starts(batch: int) -> mx.array:
    return mx.array([[0, 0, 0, ALL_VISIBLE]] * batch, dtype=mx.int32)


def splits(n_body: int, n_head: int, n_pending: int) -> int:
    """Thread blocks per (batch row, KV head): the body's chunks, the head's, the own tokens'."""
    return -(-n_body // CHUNK) + (1 if n_head else 0) + -(-n_pending // CHUNK)


def attention(
    queries: mx.array,
    scale: float,
    head: tuple[mx.array, mx.array] | None,
    body: tuple[Parts, Parts],
    pending: tuple[mx.array, mx.array],
    keys: TensorCodec,
    values: TensorCodec,
    starts: mx.array,
    sinks: mx.array | None = None,
) -> mx.array:
    """Attention of ``queries`` (B, heads, L, D) over 16-bit ``head`` tokens, a ``body``
    (keys, values parts: quantized, or one 16-bit array each where the codecs' ``bits`` is
    None) and the request's own ``pending`` tokens (B, kv_heads, n, width) at full
    precision; the body precedes the queries, the pending tokens are causal from
    ``starts``' last column. ``starts`` (B, 4) int32: each row's first valid column of
    body, head and pending (regions right-aligned per row), then the causal column
    (``plain_starts``). Returns (B, heads, L, value width) in the queries' dtype."""
    partial, merge = _kernels()
    parts = partial(**partial_call(queries, scale, head, body, pending, keys, values, starts))
    (out,) = merge(**merge_call(queries, *parts, sinks))
    return out.astype(queries.dtype)


def _input_types(**inputs: mx.array) -> list[tuple[str, mx.Dtype]]:
    """Template entries naming the dtypes of the inputs whose dtype varies (the model's:
    bf16, fp16 or float32). mlx names a compiled custom kernel by its template alone, though
    its source declares each input's type: without these, a process whose models differ in
    dtype (a server of a bf16 and an fp16 checkpoint) ran the second one's attention through
    the kernel compiled for the first's, reading its keys as the other type."""
    return [(f"{name.upper()}_T", x.dtype) for name, x in inputs.items()]


def partial_call(
    queries: mx.array,
    scale: float,
    head: tuple[mx.array, mx.array] | None,
    body: tuple[Parts, Parts],
    pending: tuple[mx.array, mx.array],
    keys: TensorCodec,
    values: TensorCodec,
    starts: mx.array,
) -> dict[str, Any]:
    """The first kernel's arguments (inputs in ``PARTIAL_INPUTS`` order): per chunk, its
    maximum score, sum of ``exp(score - max)`` and weighted values of every query row."""
    B, n_heads, L, D = queries.shape
    kv_heads = body[0][0].shape[1]
    rep = n_heads // kv_heads
    R = rep * L
    kparts, vparts = body
    if head is not None and head[0].shape[2] > CHUNK:
        raise RuntimeError(f"{head[0].shape[2]} head tokens exceed one chunk of {CHUNK} (this is a bug)")
    n_split = splits(kparts[0].shape[2], 0 if head is None else head[0].shape[2], pending[0].shape[2])
    body16 = keys.bits is None
    if body16:
        # A 16-bit body is read as the head and own tokens are (``BODY16``); the quantized
        # inputs are empty and the packing constants unused (but valid C++).
        dv = vparts[0].shape[-1]
        (fk,), (fv,) = kparts, vparts
        kq = vq = _empty(mx.uint32)
        k_scales = k_biases = v_scales = v_biases = _empty(SCALE_DTYPE)
        kbits, vbits, kg, vg = 4, 4, 32, 32
    else:
        dv = vparts[1].shape[-1] * values.group_size
        fk, fv = pending[0][:, :, :0], pending[1][:, :, :0]
        kq, vq = kparts[0], vparts[0]
        k_scales, k_biases, v_scales, v_biases = (
            x if x.dtype == SCALE_DTYPE else x.astype(SCALE_DTYPE)
            for x in (kparts[1], kparts[2], vparts[1], vparts[2])
        )
        kbits, vbits, kg, vg = keys.bits, values.bits, keys.group_size, values.group_size
    hk, hv = head if head is not None else (pending[0][:, :, :0], pending[1][:, :, :0])
    ones = _constant((1.0,))
    per_split = (B, kv_heads, n_split, R)
    return {
        "inputs": [
            queries, kq, k_scales, k_biases, vq, v_scales, v_biases, fk, fv,
            hk, hv, pending[0], pending[1], starts, _constant((scale,)),
            _signs(D) if keys.rotate else ones, _signs(dv) if values.rotate else ones,
        ],
        "template": [
            ("R", R), ("L", L), ("REP", rep), ("D", D), ("DV", dv),
            ("KBITS", kbits), ("VBITS", vbits), ("KG", kg), ("VG", vg),
            ("CHUNK", CHUNK), ("THREADS", THREADS),
            ("KROT", keys.rotate), ("VROT", values.rotate), ("HAS_HEAD", head is not None),
            ("BODY16", body16),
            *_input_types(queries=queries, fk=fk, hk=hk, pk=pending[0]),
        ],
        "grid": (n_split * THREADS, kv_heads, B),
        "threadgroup": (THREADS, 1, 1),
        "output_shapes": [(*per_split, dv), per_split, per_split],
        "output_dtypes": [mx.float32, mx.float32, mx.float32],
    }  # fmt: skip


def merge_call(
    queries: mx.array, o_part: mx.array, m_part: mx.array, l_part: mx.array, sinks: mx.array | None
) -> dict[str, Any]:
    """The second kernel's arguments: the chunks merged in order, the sink added,
    normalised, written as (B, heads, L, value width) float32."""
    B, n_heads, L, _ = queries.shape
    kv_heads, R, dv = o_part.shape[1], o_part.shape[3], o_part.shape[4]
    return {
        "inputs": [o_part, m_part, l_part, _constant((0.0,)) if sinks is None else sinks.astype(mx.float32)],
        "template": [
            ("R", R),
            ("L", L),
            ("REP", n_heads // kv_heads),
            ("DV", dv),
            ("HAS_SINKS", sinks is not None),
        ],
        "grid": (-(-B * kv_heads * R * dv // THREADS) * THREADS, 1, 1),
        "threadgroup": (THREADS, 1, 1),
        "output_shapes": [(B, n_heads, L, dv)],
        "output_dtypes": [mx.float32],
    }


def reference_attention(
    queries: mx.array,
    scale: float,
    head: tuple[mx.array, mx.array] | None,
    body: tuple[Parts, Parts],
    pending: tuple[mx.array, mx.array],
    keys: TensorCodec,
    values: TensorCodec,
    starts: mx.array,
    sinks: mx.array | None = None,
) -> mx.array:
    """What ``attention`` computes, in plain mlx ops at float32 (every device): the oracle
    its kernels are checked against."""
    B, n_heads, L, D = queries.shape
    regions = [
        (keys.decode(body[0], mx.float32), values.decode(body[1], mx.float32), keys.rotate, values.rotate, 0)
    ]
    if head is not None:
        regions.append((head[0].astype(mx.float32), head[1].astype(mx.float32), False, False, 1))
    regions.append((pending[0].astype(mx.float32), pending[1].astype(mx.float32), False, False, 2))
    ks, vs, masks = [], [], []
    for k, v, krot, vrot, col in regions:
        ks.append(k @ rotation(D).T if krot else k)
        vs.append(v @ rotation(v.shape[-1]).T if vrot else v)
        n = k.shape[2]
        seen = mx.arange(n)[None, None] >= starts[:, col, None, None]  # (B, 1, n)
        if col == 2:
            seen = seen & (mx.arange(n)[None, None] <= starts[:, 3, None, None] + mx.arange(L)[None, :, None])
        masks.append(mx.broadcast_to(seen, (B, L, n)))
    k, v, mask = (mx.concatenate(x, axis=-2 if x is not masks else -1) for x in (ks, vs, masks))
    rep = n_heads // k.shape[1]
    k, v = mx.repeat(k, rep, axis=1), mx.repeat(v, rep, axis=1)
    s = (queries.astype(mx.float32) * scale) @ k.swapaxes(-1, -2)
    s = mx.where(mask[:, None], s, -mx.inf)
    if sinks is not None:
        s = mx.concatenate(
            [mx.broadcast_to(sinks.astype(mx.float32)[None, :, None, None], (B, n_heads, L, 1)), s], -1
        )
    p = mx.softmax(s, axis=-1, precise=True)
    if sinks is not None:
        p = p[..., 1:]
    return (p @ v).astype(queries.dtype)
