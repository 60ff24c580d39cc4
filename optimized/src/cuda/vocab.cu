// Fused linear cross-entropy of one vocabulary shard, f32 (issue #7): the
// local statistics and partials of Yeung et al., "Vocabulary Parallelism"
// (arXiv:2411.05288), Algorithm 2, without ever holding the [n, w] logits.
//
// Legend: n tokens, hd hidden size, w real rows of this shard.
//   hidden:    [n, hd]   replicated on every rank
//   weight:    [w, hd]   this shard's rows of the output weight
//   target:    [n] int   the target's row in this shard, or -1 when the
//                        target is on another shard or ignored
//   q_target:  [n]       the target distribution of each token: q_target on
//   q_other:   [n]       its target, q_other on every other class (label
//                        smoothing; 1 and 0 without; both 0 for an ignored token)
//   row_max, row_rest:   [n] the softmax statistics the gradient is formed
//                        against: m and s - 1 (local ones in the S pass,
//                        global ones in the T pass)
//   row_scale: [n]       the token's loss weight (1/count for a mean, 1 for a
//                        sum, 0 for an ignored token; 1 in the S pass)
//   row_zl:    [n]       2 c lse (the z-loss term of the gradient), or 0
// z_nj = hidden[n] . weight[j] is recomputed where it is needed, in f32.
//
// lce_stats (S pass, statistics): one block per token; each thread folds a
//   strided part of the shard into a RowStats (the reference's SoftmaxStats
//   without the target weights), then a tree merge in shared memory:
//   local_max[n] = m_i, local_rest[n] = s_i - 1, local_gap[n] = sum_j (m_i - z_j),
//   target_logit[n] = z_t (written only where the target is local). The
//   host forms the target term q_other * gap + (q_target - q_other) (m_i - z_t).
// lce_dx (S pass, input-gradient partials against the local statistics):
//   dpart[n, c] = sum_j g_nj weight[j, c],  g_nj = row_scale (delta_nj + zl p_nj)
//   bpart[n, c] = sum_j q_nj weight[j, c]
//   with p = exp(z - m) / s and delta = p - q (the reference's stable form
//   (1 - q) - (s - 1) / s at the maximum for a confident target). These are
//   the paper's D_i and B_i; the host merges them (the one all-reduce).
// lce_dw (T pass): grad_weight[j, c] = sum_n g_nj hidden[n, c] against the
//   global statistics. A block per DW_ROWS vocabulary rows, tokens staged
//   TILE_N at a time.
//
// Launch (optimized/src/cuda/vocab.rs): blockDim.x threads per block, a
// power of two (the host launches 128), dynamic shared memory
// (hd + 4 blockDim.x) floats for lce_stats, (hd + 2 TILE_V) for lce_dx,
// DW_ROWS x TILE_N for lce_dw.

#define TILE_V 256
#define TILE_N 64
#define DW_ROWS 32
#define NEG_INF (__int_as_float(0xff800000))

__device__ __forceinline__ float dot_row(const float* x, const float* w, int hd) {
    float s = 0.0f;
    for (int c = 0; c < hd; ++c) s += x[c] * w[c];
    return s;
}

// The summary of a set of logits: m = max z, rest = s - 1 with s = sum exp(z
// - m) (the leading 1 kept out, so a confident row keeps its precision), gap
// = sum (m - z) >= 0, count. The empty set: (-inf, -1, 0, 0).
struct RowStats {
    float m, rest, gap, count;
};

// The summary of the union of two disjoint sets (the online-softmax merge,
// SoftmaxStats::merge of the reference).
__device__ __forceinline__ RowStats merge_stats(RowStats a, RowStats b) {
    if (b.count == 0.0f) return a;
    if (a.count == 0.0f) return b;
    RowStats r;
    r.m = fmaxf(a.m, b.m);
    if (a.m == b.m) {
        r.rest = a.rest + b.rest + 1.0f;
    } else if (a.m > b.m) {
        r.rest = a.rest + (b.rest + 1.0f) * expf(b.m - a.m);
    } else {
        r.rest = b.rest + (a.rest + 1.0f) * expf(a.m - b.m);
    }
    r.gap = a.gap + a.count * (r.m - a.m) + b.gap + b.count * (r.m - b.m);
    r.count = a.count + b.count;
    return r;
}

// d loss / d z of one logit against statistics (m, rest): (p - q) + zl p.
__device__ __forceinline__ float grad_entry(float z, float q, float m, float rest, float zl) {
    const float s = 1.0f + rest;
    const float p = expf(z - m) / s;
    const float delta = (z == m && q > 0.5f) ? (1.0f - q) - rest / s : p - q;
    return delta + zl * p;
}

extern "C" __global__ void lce_stats(const float* __restrict__ hidden,
                                     const float* __restrict__ weight,
                                     const int* __restrict__ target, int n, int hd, int w,
                                     float* __restrict__ local_max,
                                     float* __restrict__ local_rest,
                                     float* __restrict__ local_gap,
                                     float* __restrict__ target_logit) {
    extern __shared__ float smem[];
    float* xs = smem;                   // [hd]
    float* ms = xs + hd;                // [blockDim.x] each
    float* rs = ms + blockDim.x;
    float* gs = rs + blockDim.x;
    float* cs = gs + blockDim.x;
    const int row = blockIdx.x;
    if (row >= n) return;
    for (int c = threadIdx.x; c < hd; c += blockDim.x) xs[c] = hidden[(long long)row * hd + c];
    __syncthreads();
    const int t = target[row];
    RowStats st = {NEG_INF, -1.0f, 0.0f, 0.0f};
    for (int j = threadIdx.x; j < w; j += blockDim.x) {
        const float z = dot_row(xs, weight + (long long)j * hd, hd);
        if (j == t) target_logit[row] = z;
        const RowStats one = {z, 0.0f, 0.0f, 1.0f};
        st = merge_stats(st, one);
    }
    ms[threadIdx.x] = st.m;
    rs[threadIdx.x] = st.rest;
    gs[threadIdx.x] = st.gap;
    cs[threadIdx.x] = st.count;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
        if (threadIdx.x < stride) {
            const int o = threadIdx.x + stride;
            const RowStats a = {ms[threadIdx.x], rs[threadIdx.x], gs[threadIdx.x], cs[threadIdx.x]};
            const RowStats b = {ms[o], rs[o], gs[o], cs[o]};
            const RowStats r = merge_stats(a, b);
            ms[threadIdx.x] = r.m;
            rs[threadIdx.x] = r.rest;
            gs[threadIdx.x] = r.gap;
            cs[threadIdx.x] = r.count;
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        local_max[row] = ms[0];
        local_rest[row] = rs[0];
        local_gap[row] = gs[0];
    }
}

// The per-token inputs of the gradient kernels, in the order of the host's
// RowInputs (optimized/src/cuda/vocab.rs).
#define ROW_INPUTS                                                              \
    const float* __restrict__ q_target, const float* __restrict__ q_other,     \
        const float* __restrict__ row_max, const float* __restrict__ row_rest, \
        const float* __restrict__ row_scale, const float* __restrict__ row_zl

extern "C" __global__ void lce_dx(const float* __restrict__ hidden,
                                  const float* __restrict__ weight,
                                  const int* __restrict__ target,
                                  ROW_INPUTS, int n, int hd, int w,
                                  float* __restrict__ dpart, float* __restrict__ bpart) {
    extern __shared__ float smem[];
    float* xs = smem;            // [hd]
    float* gs = smem + hd;       // [TILE_V] gradient entries
    float* qs = gs + TILE_V;     // [TILE_V] target weights
    const int row = blockIdx.x;
    if (row >= n) return;
    for (int c = threadIdx.x; c < hd; c += blockDim.x) {
        xs[c] = hidden[(long long)row * hd + c];
        dpart[(long long)row * hd + c] = 0.0f;
        bpart[(long long)row * hd + c] = 0.0f;
    }
    const int t = target[row];
    const float qt = q_target[row], qo = q_other[row];
    const float m = row_max[row], rest = row_rest[row];
    const float sc = row_scale[row], zl = row_zl[row];
    for (int j0 = 0; j0 < w; j0 += TILE_V) {
        const int cnt = min(TILE_V, w - j0);
        __syncthreads();
        for (int r = threadIdx.x; r < cnt; r += blockDim.x) {
            const int j = j0 + r;
            const float z = dot_row(xs, weight + (long long)j * hd, hd);
            const float q = j == t ? qt : qo;
            gs[r] = sc * grad_entry(z, q, m, rest, zl);
            qs[r] = q;
        }
        __syncthreads();
        for (int c = threadIdx.x; c < hd; c += blockDim.x) {
            float accd = 0.0f, accb = 0.0f;
            for (int r = 0; r < cnt; ++r) {
                const float wv = weight[(long long)(j0 + r) * hd + c];
                accd += gs[r] * wv;
                accb += qs[r] * wv;
            }
            dpart[(long long)row * hd + c] += accd;
            bpart[(long long)row * hd + c] += accb;
        }
    }
}

extern "C" __global__ void lce_dw(const float* __restrict__ hidden,
                                  const float* __restrict__ weight,
                                  const int* __restrict__ target,
                                  ROW_INPUTS, int n, int hd, int w,
                                  float* __restrict__ grad_weight) {
    extern __shared__ float smem[];
    float* gs = smem;  // [DW_ROWS][TILE_N] gradient entries
    const int j0 = blockIdx.x * DW_ROWS;
    if (j0 >= w) return;
    const int rows = min(DW_ROWS, w - j0);
    for (int c = threadIdx.x; c < hd; c += blockDim.x)
        for (int r = 0; r < rows; ++r) grad_weight[(long long)(j0 + r) * hd + c] = 0.0f;
    for (int i0 = 0; i0 < n; i0 += TILE_N) {
        const int cnt = min(TILE_N, n - i0);
        __syncthreads();
        for (int e = threadIdx.x; e < rows * cnt; e += blockDim.x) {
            const int r = e / cnt, k = e % cnt;
            const int i = i0 + k, j = j0 + r;
            float g = 0.0f;
            if (row_scale[i] != 0.0f) {
                const float z = dot_row(hidden + (long long)i * hd, weight + (long long)j * hd, hd);
                const float q = j == target[i] ? q_target[i] : q_other[i];
                g = row_scale[i] * grad_entry(z, q, row_max[i], row_rest[i], row_zl[i]);
            }
            gs[r * TILE_N + k] = g;
        }
        __syncthreads();
        for (int c = threadIdx.x; c < hd; c += blockDim.x) {
            for (int r = 0; r < rows; ++r) {
                float acc = 0.0f;
                for (int k = 0; k < cnt; ++k)
                    acc += gs[r * TILE_N + k] * hidden[(long long)(i0 + k) * hd + c];
                grad_weight[(long long)(j0 + r) * hd + c] += acc;
            }
        }
    }
}
