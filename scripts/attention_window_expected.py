#!/usr/bin/env python3
"""Expected values of oracle/tests/eval_attention_window.rs, computed outside
the project: plain Python floats (IEEE double), no project code, written from
flash-attention's documented semantics of `flash_attn_varlen_func`:

- segment s: queries cu_seqlens_q[s]..cu_seqlens_q[s+1] over keys
  cu_seqlens_k[s]..cu_seqlens_k[s+1]; query head a reads key head a // (h // h_kv);
- window_size = (left, right), bottom-right aligned (flash-attention >= 2.1):
  query i (local) sees key j (local) iff j >= i + lk - lq - left and
  j <= i + lk - lq + right (-1: that side unbounded);
- softmax over scale * q . k; lse = log sum exp (natural log), -inf with no key.

Run: python3 scripts/attention_window_expected.py > oracle/tests/data/attention_window_gqa_cross.json
"""
import json
import math

CU_Q = [0, 3, 7]          # segments of 3 and 4 queries
CU_K = [0, 7, 11]         # over 7 and 4 keys: a continuation chunk, then self
H, H_KV, D = 4, 2, 3      # grouped-query: 2 query heads per key head
WINDOW = (2, 1)
SCALE = 0.6


def val(seed, i, a, e):
    return round(math.sin(1.0 + 7.0 * i + 3.0 * a + e + 11.0 * seed) * 2.0, 6)


def tensor(seed, n, h):
    return [[[val(seed, i, a, e) for e in range(D)] for a in range(h)] for i in range(n)]


n_q, n_k = CU_Q[-1], CU_K[-1]
q, k, v = tensor(1, n_q, H), tensor(2, n_k, H_KV), tensor(3, n_k, H_KV)
out = [[[0.0] * D for _ in range(H)] for _ in range(n_q)]
lse = [[0.0] * n_q for _ in range(H)]
left, right = WINDOW
for s in range(len(CU_Q) - 1):
    q0, k0 = CU_Q[s], CU_K[s]
    lq, lk = CU_Q[s + 1] - q0, CU_K[s + 1] - k0
    for r in range(lq):
        diag = r + lk - lq
        keys = [c for c in range(lk)
                if (left < 0 or c >= diag - left) and (right < 0 or c <= diag + right)]
        for a in range(H):
            kv = a // (H // H_KV)
            i = q0 + r
            sc = [SCALE * sum(q[i][a][e] * k[k0 + c][kv][e] for e in range(D)) for c in keys]
            if not sc:
                lse[a][i] = "-inf"
                continue
            m = max(sc)
            z = sum(math.exp(x - m) for x in sc)
            lse[a][i] = m + math.log(z)
            for e in range(D):
                out[i][a][e] = sum(math.exp(x - m) / z * v[k0 + c][kv][e] for c, x in zip(keys, sc))

case = {"op": "attention", "q": q, "k": k, "v": v, "cu_seqlens_q": CU_Q, "cu_seqlens_k": CU_K,
        "window_size": list(WINDOW), "scale": SCALE}
print(json.dumps({"case": case, "output": out, "lse": lse}, indent=None))
