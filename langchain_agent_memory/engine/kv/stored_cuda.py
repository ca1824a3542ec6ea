"""Attention of a few query rows over an agent's quantized body in one CUDA kernel: the
packed keys and values are read once and decoded in registers, never written out.

Why: mlx 0.32.4's CUDA ``quantized_matmul`` has no 6-bit keys (the default format's) and
no values product for some shapes, so ``stored_attention`` decoded the whole body to bf16
at every decode step: at 16K tokens of an 8B model that made a decode step 5x slower than
over a working copy. This kernel is what the CUDA path takes instead, for decode-sized
calls (one or a few tokens per agent, any batch).

How (split-K "flash decoding"): one thread block per (batch row, KV head, chunk of
``chunk`` keys) holds the chunk's query rows (the GQA heads of one KV head folded in, as
``stored_attention`` folds them) in shared memory. Each thread scores whole keys: a key's
packed words are loaded per quantization group and ``score = scale * (q . codes) + bias *
sum(q)`` per group, so the inner loop is a shift, a mask and one FMA per query row. The
chunk's softmax numerator and maximum stay in the block; each thread then owns a value
channel and accumulates ``p * (code * scale + bias)`` over the chunk's keys. A second
kernel merges the chunks' partial results in order (deterministic: the same keys give the
same sums whatever the batch). The caller merges the result with the small segments held
at full precision (head tokens, the request's own tokens) by their log-sum-exp.

Chunks start at each batch row's first valid key (``starts``), so an agent's keys fall
into the same chunks alone and inside a left-padded batch: batched decode equals decode
alone on this path as on the others.

mlx packs ``bits``-bit codes as one little-endian bit stream per row (``codecs.unpack_affine``);
a group of 32, 64 or 128 codes of 2-8 bits always ends on a 32-bit word, so a group's words
are loaded once and a code straddles at most two of them.

CUDA only (``mx.fast.cuda_kernel``). Metal keeps ``stored_attention``'s ``quantized_matmul``
path, Metal's own kernel for every width.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from ..runtime import mx
from .codecs import SCALE_DTYPE, TensorCodec

#: Threads per block: each scores ``chunk / THREADS`` keys, then owns a value channel
#: (``THREADS // value width`` threads share one and split the chunk's keys).
THREADS = 256
#: Query rows one block holds (an agent's GQA heads times its new tokens): decode steps.
#: Longer calls (a prefill chunk) take ``stored_attention``'s other paths.
MAX_ROWS = 16
#: Floats of query rows in shared memory (rows x key width), and of scores (rows x chunk).
MAX_QUERY_FLOATS = 2048
SCORE_FLOATS = 4096
MAX_CHUNK = 1024

_PARTIAL_SOURCE = """
    constexpr int NW = THREADS / 32;
    constexpr int KGROUPS = D / KG;
    constexpr int KWORDS = KG * KBITS / 32;
    constexpr uint32_t KMASK = (1u << KBITS) - 1u;
    constexpr uint32_t VMASK = (1u << VBITS) - 1u;
    constexpr int PV = THREADS / DV;
    constexpr int RED = (PV * R * DV > R * NW) ? PV * R * DV : R * NW;

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
    const int n_keys = kq_shape[2];
    const int first = starts[b] + split * CHUNK;
    const int last = min(n_keys, first + CHUNK);
    const int count = last - first;  // may be <= 0: an empty chunk

    const float* qrow = q + (size_t)(b * heads + h) * R * D;
    for (int i = t; i < R * D; i += THREADS) {
        qs[i] = qrow[i];
    }
    __syncthreads();
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

    // Scores: one key per thread at a time, straight from its packed words.
    const uint32_t* kq_bh = kq + b * kq_strides[0] + h * kq_strides[1];
    const __half* ks_bh = ks + b * ks_strides[0] + h * ks_strides[1];
    const __half* kb_bh = kb + b * kb_strides[0] + h * kb_strides[1];
    for (int j = t; j < CHUNK; j += THREADS) {
        float sc[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            sc[r] = -inf;
        }
        if (j < count) {
            const int k = first + j;
            const uint32_t* row = kq_bh + (int64_t)k * kq_strides[2];
            const __half* srow = ks_bh + (int64_t)k * ks_strides[2];
            const __half* brow = kb_bh + (int64_t)k * kb_strides[2];
#pragma unroll
            for (int r = 0; r < R; ++r) {
                sc[r] = 0.f;
            }
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
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            ps[r * CHUNK + j] = sc[r];
        }
    }
    __syncthreads();

    // The chunk's maximum and softmax numerators, per query row.
    for (int r = 0; r < R; ++r) {
        float m = -inf;
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
        float m = -inf;
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
            const float p = (m == -inf) ? 0.f : expf(ps[r * CHUNK + j] - m);
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
    if (part < PV) {
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
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= ROWS * DV) {
        return;
    }
    const int c = i % DV;
    const int row = i / DV;  // (batch row, head, query row)
    const int r = row % R;
    const int bh = row / R;
    float m = -inf;
    for (int s = 0; s < SPLITS; ++s) {
        m = fmaxf(m, m_part[(bh * SPLITS + s) * R + r]);
    }
    float l = 0.f;
    float acc = 0.f;
    if (m != -inf) {
        for (int s = 0; s < SPLITS; ++s) {
            const float ms = m_part[(bh * SPLITS + s) * R + r];
            if (ms == -inf) {
                continue;
            }
            const float w = expf(ms - m);
            l += l_part[(bh * SPLITS + s) * R + r] * w;
            acc += o_part[((size_t)(bh * SPLITS + s) * R + r) * DV + c] * w;
        }
    }
    o[i] = acc;
    if (c == 0) {
        m_out[row] = m;
        l_out[row] = l;
    }
"""


@functools.cache
def _kernels() -> tuple[Any, Any]:
    partial = mx.fast.cuda_kernel(
        name="agent_memory_stored_partial",
        input_names=["q", "kq", "ks", "kb", "vq", "vs", "vb", "starts"],
        output_names=["o_part", "m_part", "l_part"],
        source=_PARTIAL_SOURCE,
        ensure_row_contiguous=False,  # the body is a view of a buffer with room: strides
    )
    merge = mx.fast.cuda_kernel(
        name="agent_memory_stored_merge",
        input_names=["o_part", "m_part", "l_part"],
        output_names=["o", "m_out", "l_out"],
        source=_MERGE_SOURCE,
    )
    return partial, merge


def available() -> bool:
    """Whether this device runs the kernel (mlx's CUDA backend, the GPU the default)."""
    return bool(mx.cuda.is_available()) and mx.default_device() != mx.cpu


def fits(rows: int, key_dim: int, value_dim: int, keys: TensorCodec, values: TensorCodec) -> bool:
    """Whether one call of ``rows`` query rows (per KV head) over a body stored as
    ``keys`` / ``values`` takes the kernel."""
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


def chunk_for(rows: int) -> int:
    """Keys per block: as many as ``SCORE_FLOATS`` of shared scores hold, whole warps' worth."""
    return max(THREADS, min(MAX_CHUNK, (SCORE_FLOATS // rows) // THREADS * THREADS))


def body_attention(
    q: mx.array,
    kparts: tuple[mx.array, ...],
    vparts: tuple[mx.array, ...],
    keys: TensorCodec,
    values: TensorCodec,
    starts: mx.array | None = None,
) -> tuple[mx.array, mx.array, mx.array]:
    """Unnormalised attention of ``q`` (B, kv_heads, R, D; scaled, in the keys' stored
    space) over a quantized body: ``(o, m, l)`` with ``o`` (B, kv_heads, R, value width)
    in the values' stored space, ``m`` the rows' maximum score and ``l`` the sum of
    ``exp(score - m)``; all float32. ``starts`` (B,) int32: each row's first valid key
    (keys before it are left padding of a batch); None: every key."""
    B, heads, R, D = q.shape
    n_keys = kparts[0].shape[2]
    dv = vparts[1].shape[-1] * values.group_size
    chunk = chunk_for(R)
    splits = max(1, math.ceil(n_keys / chunk))
    if starts is None:
        starts = mx.zeros((B,), dtype=mx.int32)
    kq, ks, kb = kparts
    vq, vs, vb = vparts
    scales = [x if x.dtype == SCALE_DTYPE else x.astype(SCALE_DTYPE) for x in (ks, kb, vs, vb)]
    partial, merge = _kernels()
    o_part, m_part, l_part = partial(
        inputs=[q.astype(mx.float32), kq, scales[0], scales[1], vq, scales[2], scales[3], starts],
        template=[
            ("R", R),
            ("D", D),
            ("DV", dv),
            ("KBITS", keys.bits),
            ("VBITS", values.bits),
            ("KG", keys.group_size),
            ("VG", values.group_size),
            ("CHUNK", chunk),
            ("THREADS", THREADS),
        ],
        grid=(splits * THREADS, heads, B),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(B, heads, splits, R, dv), (B, heads, splits, R), (B, heads, splits, R)],
        output_dtypes=[mx.float32, mx.float32, mx.float32],
    )
    rows = B * heads * R
    return tuple(
        merge(
            inputs=[o_part, m_part, l_part],
            template=[("R", R), ("DV", dv), ("SPLITS", splits), ("ROWS", rows)],
            grid=(math.ceil(rows * dv / THREADS) * THREADS, 1, 1),
            threadgroup=(THREADS, 1, 1),
            output_shapes=[(B, heads, R, dv), (B, heads, R), (B, heads, R)],
            output_dtypes=[mx.float32, mx.float32, mx.float32],
        )
    )  # type: ignore[return-value]


def reference_body_attention(
    q: mx.array,
    kparts: tuple[mx.array, ...],
    vparts: tuple[mx.array, ...],
    keys: TensorCodec,
    values: TensorCodec,
    starts: mx.array | None = None,
) -> tuple[mx.array, mx.array, mx.array]:
    """What ``body_attention`` computes, in plain mlx ops (every device): the oracle its
    kernel is checked against."""
    k = keys.decode(kparts, mx.float32)
    v = values.decode(vparts, mx.float32)
    s = q.astype(mx.float32) @ k.swapaxes(-1, -2)
    if starts is not None:
        seen = mx.arange(k.shape[2])[None] >= starts[:, None]
        s = mx.where(seen[:, None, None, :], s, -mx.inf)
    top = s.max(axis=-1)
    e = mx.where(top[..., None] == -mx.inf, 0.0, mx.exp(s - top[..., None]))
    return e @ v, top, e.sum(axis=-1)
