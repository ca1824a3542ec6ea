"""The CUDA source of the stored-form decode attention kernels (``stored_cuda`` compiles and
calls them; its docstring says how they work): the shared device code (``HEADER``), the
partial kernel (one block per batch row, KV head and chunk of keys) and the merge kernel,
with their inputs' names. Template constants (``THREADS``, ``CHUNK``, widths, bits) come
from ``stored_cuda`` at compile time."""

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

PARTIAL_SOURCE = """
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

    // Which region this block reads: 0 the body (quantized, or 16-bit where BODY16), 1 the
    // head tokens, 2 the request's own tokens (block-uniform, so the barriers below are safe).
    const int n_body = BODY16 ? fk_shape[2] : kq_shape[2];
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
    if (kind == 0 && !BODY16) {
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
        if (j < count && kind == 0 && !BODY16) {
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
            const auto* frow = fk + b * fk_strides[0] + h * fk_strides[1] + k * fk_strides[2];
            const auto* hrow = hk + b * hk_strides[0] + h * hk_strides[1] + k * hk_strides[2];
            const auto* prow = pk + b * pk_strides[0] + h * pk_strides[1] + k * pk_strides[2];
            for (int d = 0; d < D; ++d) {
                const float x = kind == 0 ? static_cast<float>(frow[d * fk_strides[3]])
                    : kind == 1           ? static_cast<float>(hrow[d * hk_strides[3]])
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
    if (part < PV && kind == 0 && !BODY16) {
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
        const auto* fv_bh = fv + b * fv_strides[0] + h * fv_strides[1] + c * fv_strides[3];
        const auto* hv_bh = hv + b * hv_strides[0] + h * hv_strides[1] + c * hv_strides[3];
        const auto* pv_bh = pv + b * pv_strides[0] + h * pv_strides[1] + c * pv_strides[3];
        for (int j = part; j < count; j += PV) {
            const int64_t k = first + j;
            const float x = kind == 0 ? static_cast<float>(fv_bh[k * fv_strides[2]])
                : kind == 1           ? static_cast<float>(hv_bh[k * hv_strides[2]])
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
    if (VROT && kind == 0 && !BODY16) {  // the body's values were stored rotated: rotate the sums back
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

MERGE_SOURCE = """
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
    *("q", "kq", "ks", "kb", "vq", "vs", "vb", "fk", "fv", "hk", "hv", "pk", "pv"),
    *("starts", "params", "ksigns", "vsigns"),
]

MERGE_INPUTS = ["o_part", "m_part", "l_part", "sinks"]
