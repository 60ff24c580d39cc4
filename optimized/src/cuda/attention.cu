// Varlen packed attention, forward and backward, f32 (issue #7).
//
// Legend: n_tok packed tokens, b segments, h heads, d head dim (d <= MAX_D).
//   q, k, v, o, grad_o, grad_q, grad_k, grad_v: [n_tok, h, d] row-major
//   lse, delta: [h, n_tok]
//   cu_seqlens: [b + 1], cu_seqlens[0] == 0, non-decreasing (checked on the host)
//
// Two forms share every line of arithmetic:
//   packed  (allowed == nullptr): blockIdx.y = segment s, keys and queries of
//           cu_seqlens[s] .. cu_seqlens[s+1]; no [n_tok, n_tok] mask exists.
//   masked  (allowed != nullptr): one padded row of row_len tokens, blockIdx.y
//           = 0, the pair (i, j) counts when allowed[i * row_len + j] != 0.
// Keys are visited in the same order, tile boundaries relative to the start
// of the segment, and masked pairs are skipped (not added as zeros), so a
// sequence packed and the same sequence padded give bitwise equal results.
//
// Forward: one thread per query row, a block per (query tile, segment, head);
// online softmax over key tiles of TILE_K keys staged in shared memory
// (Dao, "FlashAttention-2", 2023, Algorithm 1: running max m, running sum l,
// rescale the accumulator by exp(m_old - m_new)). Saves lse = m + ln l.
// A row with no allowed key gives output 0 and lse = -inf (never NaN).
//
// Backward (FlashAttention-2 Algorithm 2, split without atomics):
//   attn_bwd_delta: delta_i = sum_c grad_o[i, c] * o[i, c]
//   attn_bwd_dq:    one thread per query: grad_q_i = scale * sum_j dS_ij k_j
//   attn_bwd_dkv:   one thread per key:   grad_k_j = scale * sum_i dS_ij q_i,
//                                         grad_v_j = sum_i P_ij grad_o_i
//   with P_ij = exp(scale q_i.k_j - lse_i), dS_ij = P_ij (grad_o_i.v_j - delta_i).

#define MAX_D 128
#define TILE_Q 64
#define TILE_K 32
#define NEG_INF (__int_as_float(0xff800000))

struct Span {
    int start;  // first token of the segment (packed) or 0 (masked)
    int len;    // tokens in it
};

__device__ __forceinline__ Span segment_span(const long long* cu_seqlens, int row_len,
                                             const unsigned char* allowed) {
    Span s;
    if (allowed) {
        s.start = 0;
        s.len = row_len;
    } else {
        s.start = (int)cu_seqlens[blockIdx.y];
        s.len = (int)(cu_seqlens[blockIdx.y + 1] - cu_seqlens[blockIdx.y]);
    }
    return s;
}

// Whether query a and key c (positions inside the segment) may attend.
__device__ __forceinline__ bool pair_allowed(const unsigned char* allowed, int row_len, int a,
                                             int c) {
    return allowed == nullptr || allowed[(long long)a * row_len + c] != 0;
}

// Stages rows [first, first + count) of x (head `head`) into tile[count][d].
__device__ __forceinline__ void stage(float* tile, const float* x, int first, int count,
                                      int head, int h, int d) {
    for (int e = threadIdx.x; e < count * d; e += blockDim.x) {
        int r = e / d, c = e % d;
        tile[e] = x[((long long)(first + r) * h + head) * d + c];
    }
}

extern "C" __global__ void attn_fwd(const float* __restrict__ q, const float* __restrict__ k,
                                    const float* __restrict__ v,
                                    const long long* __restrict__ cu_seqlens,
                                    const unsigned char* __restrict__ allowed, int row_len,
                                    int n_tok, int h, int d, float scale,
                                    float* __restrict__ o, float* __restrict__ lse) {
    extern __shared__ float smem[];
    float* ks = smem;                // [TILE_K][d]
    float* vs = smem + TILE_K * d;   // [TILE_K][d]
    const Span seg = segment_span(cu_seqlens, row_len, allowed);
    const int head = blockIdx.z;
    const int a = blockIdx.x * TILE_Q + threadIdx.x;  // query inside the segment
    if (blockIdx.x * TILE_Q >= seg.len) return;       // whole block idle (uniform)
    const bool active = a < seg.len;
    const int row = seg.start + a;

    float qr[MAX_D];
    float acc[MAX_D];
    for (int c = 0; c < d; ++c) {
        qr[c] = active ? q[((long long)row * h + head) * d + c] : 0.0f;
        acc[c] = 0.0f;
    }
    float m = NEG_INF;
    float l = 0.0f;
    for (int t0 = 0; t0 < seg.len; t0 += TILE_K) {
        const int cnt = min(TILE_K, seg.len - t0);
        __syncthreads();
        stage(ks, k, seg.start + t0, cnt, head, h, d);
        stage(vs, v, seg.start + t0, cnt, head, h, d);
        __syncthreads();
        if (!active) continue;
        float s[TILE_K];
        float tile_max = NEG_INF;
        for (int j = 0; j < cnt; ++j) {
            if (!pair_allowed(allowed, row_len, a, t0 + j)) continue;
            float dot = 0.0f;
            for (int c = 0; c < d; ++c) dot += qr[c] * ks[j * d + c];
            s[j] = dot * scale;
            tile_max = fmaxf(tile_max, s[j]);
        }
        if (tile_max == NEG_INF) continue;  // nothing allowed in this tile
        const float m_new = fmaxf(m, tile_max);
        const float corr = (m == NEG_INF) ? 0.0f : expf(m - m_new);
        l *= corr;
        for (int c = 0; c < d; ++c) acc[c] *= corr;
        for (int j = 0; j < cnt; ++j) {
            if (!pair_allowed(allowed, row_len, a, t0 + j)) continue;
            const float p = expf(s[j] - m_new);
            l += p;
            for (int c = 0; c < d; ++c) acc[c] += p * vs[j * d + c];
        }
        m = m_new;
    }
    if (!active) return;
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    for (int c = 0; c < d; ++c) o[((long long)row * h + head) * d + c] = acc[c] * inv;
    lse[(long long)head * n_tok + row] = l > 0.0f ? m + logf(l) : NEG_INF;
}

// delta[head, i] = grad_o[i, head, :] . o[i, head, :]; one thread per (i, head).
extern "C" __global__ void attn_bwd_delta(const float* __restrict__ o,
                                          const float* __restrict__ grad_o, int n_tok, int h,
                                          int d, float* __restrict__ delta) {
    const long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= (long long)n_tok * h) return;
    const long long i = e / h;
    const int head = (int)(e % h);
    float sum = 0.0f;
    for (int c = 0; c < d; ++c) {
        const long long x = (i * h + head) * d + c;
        sum += grad_o[x] * o[x];
    }
    delta[(long long)head * n_tok + i] = sum;
}

extern "C" __global__ void attn_bwd_dq(const float* __restrict__ q, const float* __restrict__ k,
                                       const float* __restrict__ v,
                                       const long long* __restrict__ cu_seqlens,
                                       const unsigned char* __restrict__ allowed, int row_len,
                                       int n_tok, int h, int d, float scale,
                                       const float* __restrict__ lse,
                                       const float* __restrict__ delta,
                                       const float* __restrict__ grad_o,
                                       float* __restrict__ grad_q) {
    extern __shared__ float smem[];
    float* ks = smem;
    float* vs = smem + TILE_K * d;
    const Span seg = segment_span(cu_seqlens, row_len, allowed);
    const int head = blockIdx.z;
    const int a = blockIdx.x * TILE_Q + threadIdx.x;
    if (blockIdx.x * TILE_Q >= seg.len) return;
    const bool active = a < seg.len;
    const int row = seg.start + a;

    float qr[MAX_D];
    float gor[MAX_D];
    float acc[MAX_D];
    for (int c = 0; c < d; ++c) {
        const long long x = ((long long)row * h + head) * d + c;
        qr[c] = active ? q[x] : 0.0f;
        gor[c] = active ? grad_o[x] : 0.0f;
        acc[c] = 0.0f;
    }
    const float lse_i = active ? lse[(long long)head * n_tok + row] : 0.0f;
    const float delta_i = active ? delta[(long long)head * n_tok + row] : 0.0f;
    for (int t0 = 0; t0 < seg.len; t0 += TILE_K) {
        const int cnt = min(TILE_K, seg.len - t0);
        __syncthreads();
        stage(ks, k, seg.start + t0, cnt, head, h, d);
        stage(vs, v, seg.start + t0, cnt, head, h, d);
        __syncthreads();
        if (!active) continue;
        for (int j = 0; j < cnt; ++j) {
            if (!pair_allowed(allowed, row_len, a, t0 + j)) continue;
            float dot = 0.0f, dp = 0.0f;
            for (int c = 0; c < d; ++c) {
                dot += qr[c] * ks[j * d + c];
                dp += gor[c] * vs[j * d + c];
            }
            const float p = expf(dot * scale - lse_i);
            const float ds = p * (dp - delta_i);
            for (int c = 0; c < d; ++c) acc[c] += ds * ks[j * d + c];
        }
    }
    if (!active) return;
    for (int c = 0; c < d; ++c) grad_q[((long long)row * h + head) * d + c] = acc[c] * scale;
}

extern "C" __global__ void attn_bwd_dkv(const float* __restrict__ q, const float* __restrict__ k,
                                        const float* __restrict__ v,
                                        const long long* __restrict__ cu_seqlens,
                                        const unsigned char* __restrict__ allowed, int row_len,
                                        int n_tok, int h, int d, float scale,
                                        const float* __restrict__ lse,
                                        const float* __restrict__ delta,
                                        const float* __restrict__ grad_o,
                                        float* __restrict__ grad_k, float* __restrict__ grad_v) {
    extern __shared__ float smem[];
    float* qs = smem;                 // [TILE_K][d] queries
    float* gs = smem + TILE_K * d;    // [TILE_K][d] grad_o
    float* ls = smem + 2 * TILE_K * d;        // [TILE_K] lse
    float* ds_ = smem + 2 * TILE_K * d + TILE_K;  // [TILE_K] delta
    const Span seg = segment_span(cu_seqlens, row_len, allowed);
    const int head = blockIdx.z;
    const int c_key = blockIdx.x * TILE_Q + threadIdx.x;  // key inside the segment
    if (blockIdx.x * TILE_Q >= seg.len) return;
    const bool active = c_key < seg.len;
    const int col = seg.start + c_key;

    float kr[MAX_D];
    float vr[MAX_D];
    float dk[MAX_D];
    float dv[MAX_D];
    for (int c = 0; c < d; ++c) {
        const long long x = ((long long)col * h + head) * d + c;
        kr[c] = active ? k[x] : 0.0f;
        vr[c] = active ? v[x] : 0.0f;
        dk[c] = 0.0f;
        dv[c] = 0.0f;
    }
    for (int t0 = 0; t0 < seg.len; t0 += TILE_K) {
        const int cnt = min(TILE_K, seg.len - t0);
        __syncthreads();
        stage(qs, q, seg.start + t0, cnt, head, h, d);
        stage(gs, grad_o, seg.start + t0, cnt, head, h, d);
        for (int r = threadIdx.x; r < cnt; r += blockDim.x) {
            ls[r] = lse[(long long)head * n_tok + seg.start + t0 + r];
            ds_[r] = delta[(long long)head * n_tok + seg.start + t0 + r];
        }
        __syncthreads();
        if (!active) continue;
        for (int i = 0; i < cnt; ++i) {
            if (!pair_allowed(allowed, row_len, t0 + i, c_key)) continue;
            float dot = 0.0f, dp = 0.0f;
            for (int c = 0; c < d; ++c) {
                dot += qs[i * d + c] * kr[c];
                dp += gs[i * d + c] * vr[c];
            }
            const float p = expf(dot * scale - ls[i]);
            const float ds = p * (dp - ds_[i]);
            for (int c = 0; c < d; ++c) {
                dv[c] += p * gs[i * d + c];
                dk[c] += ds * qs[i * d + c];
            }
        }
    }
    if (!active) return;
    for (int c = 0; c < d; ++c) {
        const long long x = ((long long)col * h + head) * d + c;
        grad_k[x] = dk[c] * scale;
        grad_v[x] = dv[c];
    }
}
