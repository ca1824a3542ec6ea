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

#: Device code both kernels' callers share (mlx puts ``header`` before the kernel).
HEADER = """
// The normalised Walsh-Hadamard transform of every `block`-wide run of each of `rows`
// rows of `width` floats, in place (shared memory). Every thread of the block calls it:
// it synchronises them.
__device__ void walsh_hadamard_rows(float* x, int rows, int width, int block) {
    for (int h = 1; h < block; h <<= 1) {
        for (int i = threadIdx.x; i < rows * width / 2; i += blockDim.x) {
            const int r = i / (width / 2);
            const int p = i % (width / 2);
            const int j = r * width + (p / h) * 2 * h + p % h;
            const float a = x[j];
            const float b = x[j + h];
            x[j] = a + b;
            x[j + h] = a - b;
        }
        __syncthreads();
    }
    const float norm = rsqrtf((float)block);
    for (int i = threadIdx.x; i < rows * width; i += blockDim.x) {
        x[i] *= norm;
    }
    __syncthreads();
}
"""

_PARTIAL_SOURCE = """
    const float neg_inf = __int_as_float(0xff800000u);
    constexpr int NW = THREADS / 32;
    constexpr int KGROUPS = D / KG;
    constexpr int KWORDS = KG * KBITS / 32;
    constexpr uint32_t KMASK = (1u << KBITS) - 1u;
    constexpr uint32_t VMASK = (1u << VBITS) - 1u;
    constexpr int PV = THREADS / DV;
    constexpr int RED = (PV * R * DV > R * NW) ? PV * R * DV : R * NW;
    constexpr int KBLK = D & -D;
    constexpr int VBLK = DV & -DV;

    __shared__ float qs[R * D];
    __shared__ float qg[R * KGROUPS];
    __shared__ float ps[R * CHUNK];
    __shared__ float red[RED];
    __shared__ float mrow[R];
    __shared__ float lrow[R];

    const int split = blockIdx.x;
    const int h = blockIdx.y;
    const int b = blockIdx.z;
    const int heads = gridDim.y;
    const int splits = gridDim.x;
    const int t = threadIdx.x;
    const int lane = t & 31;
    const int warp = t >> 5;

    // Which region this block reads: 0 the quantized body, 1 the head tokens, 2 the
    // request's own tokens (block-uniform, so the barriers below are safe).
    const int n_body = kq_shape[2];
    const int body_splits = (n_body + CHUNK - 1) / CHUNK;
    int kind, first, last;
    if (split < body_splits) {
        kind = 0;
        first = starts[b * 4] + split * CHUNK;
        last = n_body;
    } else if (HAS_HEAD && split == body_splits) {
        kind = 1;
        first = starts[b * 4 + 1];
        last = hk_shape[2];
    } else {
        kind = 2;
        first = starts[b * 4 + 2] + (split - body_splits - (HAS_HEAD ? 1 : 0)) * CHUNK;
        last = pk_shape[2];
    }
    last = min(last, first + CHUNK);
    const int count = last - first;  // may be <= 0: an empty chunk
    const int causal = starts[b * 4 + 3];
    const bool rotate_q = KROT && kind == 0;

    // Query rows: row r is query head h * REP + r / L at token r % L.
    for (int i = t; i < R * D; i += THREADS) {
        const int r = i / D;
        const int d = i % D;
        const int64_t at = b * q_strides[0] + (h * REP + r / L) * q_strides[1] + (r % L) * q_strides[2]
            + d * q_strides[3];
        float x = static_cast<float>(q[at]) * params[0];
        if (rotate_q) {
            x *= ksigns[d];
        }
        qs[i] = x;
    }
    __syncthreads();
    if (rotate_q) {
        walsh_hadamard_rows(qs, R, D, KBLK);
    }
    if (kind == 0) {
        for (int i = t; i < R * KGROUPS; i += THREADS) {
            const int r = i / KGROUPS;
            const int g = i % KGROUPS;
            float acc = 0.f;
            for (int d = 0; d < KG; ++d) {
                acc += qs[r * D + g * KG + d];
            }
            qg[i] = acc;
        }
        __syncthreads();
    }

    // Scores: one key per thread at a time.
    for (int j = t; j < CHUNK; j += THREADS) {
        float sc[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            sc[r] = j < count ? 0.f : neg_inf;
        }
        if (j < count && kind == 0) {
            const int64_t k = first + j;
            const uint32_t* row = kq + b * kq_strides[0] + h * kq_strides[1] + k * kq_strides[2];
            const __half* srow = ks + b * ks_strides[0] + h * ks_strides[1] + k * ks_strides[2];
            const __half* brow = kb + b * kb_strides[0] + h * kb_strides[1] + k * kb_strides[2];
            for (int g = 0; g < KGROUPS; ++g) {
                uint32_t w[KWORDS + 1];
#pragma unroll
                for (int i = 0; i < KWORDS; ++i) {
                    w[i] = row[g * KWORDS + i];
                }
                w[KWORDS] = 0u;
                float acc[R];
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    acc[r] = 0.f;
                }
#pragma unroll
                for (int d = 0; d < KG; ++d) {
                    const int bit = d * KBITS;
                    const int wi = bit >> 5;
                    const int sh = bit & 31;
                    uint32_t code = w[wi] >> sh;
                    if (sh + KBITS > 32) {
                        code |= w[wi + 1] << (32 - sh);
                    }
                    const float x = (float)(code & KMASK);
#pragma unroll
                    for (int r = 0; r < R; ++r) {
                        acc[r] += qs[r * D + g * KG + d] * x;
                    }
                }
                const float scale = __half2float(srow[g]);
                const float bias = __half2float(brow[g]);
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    sc[r] += scale * acc[r] + bias * qg[r * KGROUPS + g];
                }
            }
        } else if (j < count) {
            const int64_t k = first + j;
            const auto* hrow = hk + b * hk_strides[0] + h * hk_strides[1] + k * hk_strides[2];
            const auto* prow = pk + b * pk_strides[0] + h * pk_strides[1] + k * pk_strides[2];
            for (int d = 0; d < D; ++d) {
                const float x = kind == 1 ? static_cast<float>(hrow[d * hk_strides[3]])
                                          : static_cast<float>(prow[d * pk_strides[3]]);
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    sc[r] += qs[r * D + d] * x;
                }
            }
            if (kind == 2 && L > 1) {
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    if (k > causal + r % L) {
                        sc[r] = neg_inf;
                    }
                }
            }
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            ps[r * CHUNK + j] = sc[r];
        }
    }
    __syncthreads();

    // The chunk's maximum and softmax numerators, per query row.
    for (int r = 0; r < R; ++r) {
        float m = neg_inf;
        for (int j = t; j < CHUNK; j += THREADS) {
            m = fmaxf(m, ps[r * CHUNK + j]);
        }
        for (int o = 16; o > 0; o >>= 1) {
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        }
        if (lane == 0) {
            red[r * NW + warp] = m;
        }
    }
    __syncthreads();
    if (t < R) {
        float m = neg_inf;
        for (int i = 0; i < NW; ++i) {
            m = fmaxf(m, red[t * NW + i]);
        }
        mrow[t] = m;
    }
    __syncthreads();
    for (int r = 0; r < R; ++r) {
        const float m = mrow[r];
        float sum = 0.f;
        for (int j = t; j < CHUNK; j += THREADS) {
            const float p = (m == neg_inf) ? 0.f : expf(ps[r * CHUNK + j] - m);
            ps[r * CHUNK + j] = p;
            sum += p;
        }
        for (int o = 16; o > 0; o >>= 1) {
            sum += __shfl_xor_sync(0xffffffffu, sum, o);
        }
        if (lane == 0) {
            red[r * NW + warp] = sum;
        }
    }
    __syncthreads();
    if (t < R) {
        float l = 0.f;
        for (int i = 0; i < NW; ++i) {
            l += red[t * NW + i];
        }
        lrow[t] = l;
    }
    __syncthreads();

    // Values: thread (part, channel) sums p * value over the part's keys of the chunk.
    const int c = t % DV;
    const int part = t / DV;
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        acc[r] = 0.f;
    }
    if (part < PV && kind == 0) {
        const uint32_t* vq_bh = vq + b * vq_strides[0] + h * vq_strides[1];
        const __half* vs_bh = vs + b * vs_strides[0] + h * vs_strides[1];
        const __half* vb_bh = vb + b * vb_strides[0] + h * vb_strides[1];
        const int bit = c * VBITS;
        const int wi = bit >> 5;
        const int sh = bit & 31;
        const int g = c / VG;
        for (int j = part; j < count; j += PV) {
            const int64_t k = first + j;
            const uint32_t* row = vq_bh + k * vq_strides[2];
            uint32_t code = row[wi] >> sh;
            if (sh + VBITS > 32) {
                code |= row[wi + 1] << (32 - sh);
            }
            const float x = (float)(code & VMASK) * __half2float(vs_bh[k * vs_strides[2] + g])
                + __half2float(vb_bh[k * vb_strides[2] + g]);
#pragma unroll
            for (int r = 0; r < R; ++r) {
                acc[r] += ps[r * CHUNK + j] * x;
            }
        }
    } else if (part < PV) {
        const auto* hv_bh = hv + b * hv_strides[0] + h * hv_strides[1] + c * hv_strides[3];
        const auto* pv_bh = pv + b * pv_strides[0] + h * pv_strides[1] + c * pv_strides[3];
        for (int j = part; j < count; j += PV) {
            const int64_t k = first + j;
            const float x = kind == 1 ? static_cast<float>(hv_bh[k * hv_strides[2]])
                                      : static_cast<float>(pv_bh[k * pv_strides[2]]);
#pragma unroll
            for (int r = 0; r < R; ++r) {
                acc[r] += ps[r * CHUNK + j] * x;
            }
        }
    }
    if (PV > 1) {
        __syncthreads();  // red held the row sums; every thread has read them
        if (part < PV) {
#pragma unroll
            for (int r = 0; r < R; ++r) {
                red[(part * R + r) * DV + c] = acc[r];
            }
        }
        __syncthreads();
        if (part == 0) {
            for (int p = 1; p < PV; ++p) {
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    acc[r] += red[(p * R + r) * DV + c];
                }
            }
        }
    }
    if (VROT && kind == 0) {  // the body's values were stored rotated: rotate the sums back
        __syncthreads();
        if (part == 0) {
#pragma unroll
            for (int r = 0; r < R; ++r) {
                red[r * DV + c] = acc[r];
            }
        }
        __syncthreads();
        walsh_hadamard_rows(red, R, DV, VBLK);
        if (part == 0) {
#pragma unroll
            for (int r = 0; r < R; ++r) {
                acc[r] = red[r * DV + c] * vsigns[c];
            }
        }
    }
    const size_t at = (size_t)(b * heads + h) * splits + split;
    if (part == 0) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
            o_part[(at * R + r) * DV + c] = acc[r];
        }
    }
    if (t < R) {
        m_part[at * R + t] = mrow[t];
        l_part[at * R + t] = lrow[t];
    }
"""

_MERGE_SOURCE = """
    const float neg_inf = __int_as_float(0xff800000u);
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    const int heads = m_part_shape[1];
    const int splits = m_part_shape[2];
    if (i >= m_part_shape[0] * heads * R * DV) {
        return;
    }
    const int c = i % DV;
    const int row = i / DV;  // (batch row, KV head, query row)
    const int r = row % R;
    const int bh = row / R;
    const int h = bh % heads;
    const int b = bh / heads;
    const int query_head = h * REP + r / L;
    float m = neg_inf;
    for (int s = 0; s < splits; ++s) {
        m = fmaxf(m, m_part[(bh * splits + s) * R + r]);
    }
    float sink = neg_inf;
    if (HAS_SINKS) {
        sink = sinks[query_head];
        m = fmaxf(m, sink);
    }
    float l = 0.f;
    float acc = 0.f;
    if (m != neg_inf) {
        for (int s = 0; s < splits; ++s) {
            const float ms = m_part[(bh * splits + s) * R + r];
            if (ms == neg_inf) {
                continue;
            }
            const float w = expf(ms - m);
            l += l_part[(bh * splits + s) * R + r] * w;
            acc += o_part[((size_t)(bh * splits + s) * R + r) * DV + c] * w;
        }
        if (HAS_SINKS) {
            l += expf(sink - m);
        }
    }
    out[((size_t)(b * heads * REP + query_head) * L + r % L) * DV + c] = l > 0.f ? acc / l : 0.f;
"""

PARTIAL_INPUTS = [
    *("q", "kq", "ks", "kb", "vq", "vs", "vb", "hk", "hv", "pk", "pv"),
    *("starts", "params", "ksigns", "vsigns"),
]

MERGE_INPUTS = ["o_part", "m_part", "l_part", "sinks"]


@functools.cache
def _kernels() -> tuple[Any, Any]:
    partial = mx.fast.cuda_kernel(
        name="agent_memory_stored_partial",
        input_names=PARTIAL_INPUTS,
        output_names=["o_part", "m_part", "l_part"],
        source=_PARTIAL_SOURCE,
        header=HEADER,
        ensure_row_contiguous=False,  # views of buffers with room: every input by its strides
    )
    merge = mx.fast.cuda_kernel(
        name="agent_memory_stored_merge",
        input_names=MERGE_INPUTS,
        output_names=["out"],
        source=_MERGE_SOURCE,
    )
    return partial, merge


def available() -> bool:
    """Whether this device runs the kernels (mlx's CUDA backend, the GPU the default)."""
    return bool(mx.cuda.is_available()) and mx.default_device() != mx.cpu


def fits(rows: int, key_dim: int, value_dim: int, keys: TensorCodec, values: TensorCodec) -> bool:
    """Whether one call of ``rows`` query rows (per KV head) over a body stored as
    ``keys`` / ``values`` takes the kernels."""
    return (
        keys.bits is not None
        and values.bits is not None
        and rows <= MAX_ROWS
        and rows * key_dim <= MAX_QUERY_FLOATS
        and value_dim <= THREADS
        and key_dim % keys.group_size == 0
        and value_dim % values.group_size == 0
        and available()
    )


@functools.cache
def _constant(values: tuple[float, ...]) -> mx.array:
    return mx.array(values, dtype=mx.float32)


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
    """Attention of ``queries`` (B, heads, L, D) over 16-bit ``head`` tokens, a quantized
    ``body`` (keys, values parts) and the request's own ``pending`` tokens (B, kv_heads, n,
    width) at full precision; the body precedes the queries, the pending tokens are causal
    from ``starts``' last column. ``starts`` (B, 4) int32: each row's first valid column of
    body, head and pending (regions right-aligned per row), then the causal column
    (``plain_starts``). Returns (B, heads, L, value width) in the queries' dtype."""
    partial, merge = _kernels()
    parts = partial(**partial_call(queries, scale, head, body, pending, keys, values, starts))
    (out,) = merge(**merge_call(queries, *parts, sinks))
    return out.astype(queries.dtype)


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
    dv = vparts[1].shape[-1] * values.group_size
    if head is not None and head[0].shape[2] > CHUNK:
        raise RuntimeError(f"{head[0].shape[2]} head tokens exceed one chunk of {CHUNK} (this is a bug)")
    n_split = splits(kparts[0].shape[2], 0 if head is None else head[0].shape[2], pending[0].shape[2])
    k_scales, k_biases, v_scales, v_biases = (
        x if x.dtype == SCALE_DTYPE else x.astype(SCALE_DTYPE)
        for x in (kparts[1], kparts[2], vparts[1], vparts[2])
    )
    hk, hv = head if head is not None else (pending[0][:, :, :0], pending[1][:, :, :0])
    ones = _constant((1.0,))
    per_split = (B, kv_heads, n_split, R)
    return {
        "inputs": [
            queries, kparts[0], k_scales, k_biases, vparts[0], v_scales, v_biases,
            hk, hv, pending[0], pending[1], starts, _constant((scale,)),
            _signs(D) if keys.rotate else ones, _signs(dv) if values.rotate else ones,
        ],
        "template": [
            ("R", R), ("L", L), ("REP", rep), ("D", D), ("DV", dv),
            ("KBITS", keys.bits), ("VBITS", values.bits), ("KG", keys.group_size), ("VG", values.group_size),
            ("CHUNK", CHUNK), ("THREADS", THREADS),
            ("KROT", keys.rotate), ("VROT", values.rotate), ("HAS_HEAD", head is not None),
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
