// Fused linear cross-entropy of one vocabulary shard, f32 (issue #7): the
// local statistics and partials of Yeung et al., "Vocabulary Parallelism"
// (arXiv:2411.05288), Algorithm 2, without ever holding the [n, w] logits.
//
// Legend: n tokens, hd hidden size, w real rows of this shard.
//   hidden:   [n, hd]          (replicated on every rank)
//   weight:   [w, hd]          this shard's rows of the output weight
//   target:   [n] int          the target's row in this shard, or -1 when the
//                              target is on another shard or ignored
//   row_scale:[n]              the loss weight of each token (1/count for a
//                              mean, 1 for a sum, 0 for an ignored token)
// z_nj = hidden[n] . weight[j] is recomputed where it is needed.
//
// lce_stats (S pass, statistics): one block per token; each thread folds a
//   strided part of the shard into an online (max, sum-exp) pair, then a tree
//   merge in shared memory: local_max[n] = m_i, local_sum[n] = s_i =
//   sum_j exp(z_j - m_i), target_logit[n] = z_t (written only where the
//   target is local). An all -inf / empty shard gives m_i = -inf, s_i = 0.
// lce_dx (S pass, input-gradient partials of the merged record):
//   dpart[n, c] = row_scale_n * sum_j (exp(z_j - lse_n) - [j == t_n]) weight[j, c]
//   bpart[n, c] = row_scale_n * weight[t_n, c]  (0 where the target is not local)
//   With lse_n the shard's *local* log-sum-exp these are the paper's D_i and
//   B_i; the host merges Σ_i alpha_i D_i + Σ_i (alpha_i - 1) B_i.
// lce_dw (T pass): grad_weight[j, c] = Σ_n g_nj hidden[n, c] with
//   g_nj = row_scale_n (exp(z_nj - lse_n) - [j == t_n]), lse_n the *global*
//   log-sum-exp after the merge: alpha_i softmax'_i - q_i = softmax - q.
//   One block per vocabulary row, tokens staged TILE_N at a time.

#define THREADS 256
#define TILE_V 256
#define TILE_N 256
#define NEG_INF (__int_as_float(0xff800000))

__device__ __forceinline__ float dot_row(const float* x, const float* w, int hd) {
    float s = 0.0f;
    for (int c = 0; c < hd; ++c) s += x[c] * w[c];
    return s;
}

// Merges (m2, s2) into (m, s): the online-softmax merge, -inf safe.
__device__ __forceinline__ void merge_ms(float& m, float& s, float m2, float s2) {
    if (m2 == NEG_INF) return;
    if (m == NEG_INF) {
        m = m2;
        s = s2;
        return;
    }
    if (m2 > m) {
        s = s * expf(m - m2) + s2;
        m = m2;
    } else {
        s = s + s2 * expf(m2 - m);
    }
}

extern "C" __global__ void lce_stats(const float* __restrict__ hidden,
                                     const float* __restrict__ weight,
                                     const int* __restrict__ target, int n, int hd, int w,
                                     float* __restrict__ local_max,
                                     float* __restrict__ local_sum,
                                     float* __restrict__ target_logit) {
    extern __shared__ float smem[];
    float* xs = smem;               // [hd]
    float* ms = smem + hd;          // [THREADS]
    float* ss = smem + hd + THREADS;  // [THREADS]
    const int row = blockIdx.x;
    if (row >= n) return;
    for (int c = threadIdx.x; c < hd; c += blockDim.x) xs[c] = hidden[(long long)row * hd + c];
    __syncthreads();
    const int t = target[row];
    float m = NEG_INF, s = 0.0f;
    for (int j = threadIdx.x; j < w; j += blockDim.x) {
        const float z = dot_row(xs, weight + (long long)j * hd, hd);
        if (j == t) target_logit[row] = z;
        merge_ms(m, s, z, 1.0f);
    }
    ms[threadIdx.x] = m;
    ss[threadIdx.x] = s;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
        if (threadIdx.x < stride) {
            float a = ms[threadIdx.x], b = ss[threadIdx.x];
            merge_ms(a, b, ms[threadIdx.x + stride], ss[threadIdx.x + stride]);
            ms[threadIdx.x] = a;
            ss[threadIdx.x] = b;
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        local_max[row] = ms[0];
        local_sum[row] = ss[0];
    }
}

extern "C" __global__ void lce_dx(const float* __restrict__ hidden,
                                  const float* __restrict__ weight,
                                  const int* __restrict__ target,
                                  const float* __restrict__ lse,
                                  const float* __restrict__ row_scale, int n, int hd, int w,
                                  float* __restrict__ dpart, float* __restrict__ bpart) {
    extern __shared__ float smem[];
    float* xs = smem;          // [hd]
    float* ps = smem + hd;     // [TILE_V]
    const int row = blockIdx.x;
    if (row >= n) return;
    for (int c = threadIdx.x; c < hd; c += blockDim.x) {
        xs[c] = hidden[(long long)row * hd + c];
        dpart[(long long)row * hd + c] = 0.0f;
    }
    const int t = target[row];
    const float sc = row_scale[row];
    const float lse_n = lse[row];
    for (int j0 = 0; j0 < w; j0 += TILE_V) {
        const int cnt = min(TILE_V, w - j0);
        __syncthreads();
        for (int r = threadIdx.x; r < cnt; r += blockDim.x) {
            const int j = j0 + r;
            const float z = dot_row(xs, weight + (long long)j * hd, hd);
            const float p = lse_n == NEG_INF ? 0.0f : expf(z - lse_n);
            ps[r] = sc * (p - (j == t ? 1.0f : 0.0f));
        }
        __syncthreads();
        for (int c = threadIdx.x; c < hd; c += blockDim.x) {
            float acc = 0.0f;
            for (int r = 0; r < cnt; ++r) acc += ps[r] * weight[(long long)(j0 + r) * hd + c];
            dpart[(long long)row * hd + c] += acc;
        }
    }
    for (int c = threadIdx.x; c < hd; c += blockDim.x) {
        bpart[(long long)row * hd + c] =
            (t >= 0 && t < w) ? sc * weight[(long long)t * hd + c] : 0.0f;
    }
}

extern "C" __global__ void lce_dw(const float* __restrict__ hidden,
                                  const float* __restrict__ weight,
                                  const int* __restrict__ target,
                                  const float* __restrict__ lse,
                                  const float* __restrict__ row_scale, int n, int hd, int w,
                                  float* __restrict__ grad_weight) {
    extern __shared__ float smem[];
    float* ws = smem;          // [hd]
    float* gs = smem + hd;     // [TILE_N]
    const int j = blockIdx.x;
    if (j >= w) return;
    for (int c = threadIdx.x; c < hd; c += blockDim.x) {
        ws[c] = weight[(long long)j * hd + c];
        grad_weight[(long long)j * hd + c] = 0.0f;
    }
    for (int i0 = 0; i0 < n; i0 += TILE_N) {
        const int cnt = min(TILE_N, n - i0);
        __syncthreads();
        for (int r = threadIdx.x; r < cnt; r += blockDim.x) {
            const int i = i0 + r;
            const float z = dot_row(hidden + (long long)i * hd, ws, hd);
            const float l = lse[i];
            const float p = l == NEG_INF ? 0.0f : expf(z - l);
            gs[r] = row_scale[i] * (p - (j == target[i] ? 1.0f : 0.0f));
        }
        __syncthreads();
        for (int c = threadIdx.x; c < hd; c += blockDim.x) {
            float acc = 0.0f;
            for (int r = 0; r < cnt; ++r) acc += gs[r] * hidden[(long long)(i0 + r) * hd + c];
            grad_weight[(long long)j * hd + c] += acc;
        }
    }
}
