"""Flash-attention-style float32 varlen attention in numpy (key tiles of T, query blocks of BQ,
online softmax, tiled backward with D = rowsum(dO*O)), with optional bugs."""
import numpy as np
F = np.float32

def _bf16(x):
    """Round float32 to bfloat16 (nearest even), kept in float32."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
    return u.view(np.float32)

def attention(q, k, v, cu_seqlens_q, cu_seqlens_k, scale=None, causal=False, grad_output=None,
              want_grad=None, window_size=None, softcap=None, alibi_slopes=None, seqused_k=None,
              max_seqlen_q=None, max_seqlen_k=None, bug=None, T=64, BQ=64, **_):
    q = np.asarray(q, F); k = np.asarray(k, F); v = np.asarray(v, F)
    n_q, h, d = q.shape; n_k, h_kv, _ = k.shape
    g = h // h_kv
    if bug == "gqa_modulo_like":   # not used
        pass
    if scale is None:
        dd = ((d + 7) // 8) * 8 if bug == "scale_from_padded_d" else d   # head dim padded to 8
        scale = F(1.0 / np.sqrt(dd))
    else:
        scale = F(scale)
    want = grad_output is not None and (want_grad is None or want_grad)
    do = np.asarray(grad_output, F) if want else None
    cu_q = np.asarray(cu_seqlens_q); cu_k = np.asarray(cu_seqlens_k)
    out = np.zeros((n_q, h, d), F); lse = np.full((h, n_q), -np.inf, F); lse_true = lse.copy()
    dq = np.zeros((n_q, h, d), F); dk = np.zeros((n_k, h_kv, d), F); dv = np.zeros((n_k, h_kv, d), F)
    cap = None if (softcap is None or softcap == 0) else F(softcap)
    slopes = None if alibi_slopes is None else np.asarray(alibi_slopes, F)
    if slopes is not None and bug == "alibi_kv_head":
        slopes = np.repeat(slopes.reshape(h_kv, g)[:, 0], g)   # slope of the group's first head
    win = None if window_size is None else (int(window_size[0]), int(window_size[1]))
    # head a reads kv head a // g
    kv_of = np.arange(h) // g
    for s in range(len(cu_q) - 1):
        q0, q1 = int(cu_q[s]), int(cu_q[s + 1]); k0, k1 = int(cu_k[s]), int(cu_k[s + 1])
        lq, lk_full = q1 - q0, k1 - k0
        lk = lk_full if seqused_k is None else int(seqused_k[s])
        if lq == 0:
            continue
        off = lk - lq
        if bug == "split_kv_floor" and lk > 1024:
            nsplit = -(-lk // 1024)
            lk = (lk // nsplit) * nsplit          # split size lk // nsplit: the remainder keys are never visited
        if bug == "seqused_alignment_full_lk":
            off = lk_full - lq
        if bug == "causal_offset_max_seqlen":
            off = int(max_seqlen_k) - int(max_seqlen_q)
        Q = q[q0:q1].transpose(1, 0, 2)                       # [h, lq, d]
        K = k[k0:k0 + lk][:, kv_of].transpose(1, 0, 2)        # [h, lk, d]
        V = v[k0:k0 + lk][:, kv_of].transpose(1, 0, 2)

        def scores(r0, r1, c0, c1):
            """Scores [h, r1-r0, c1-c0] after cap, bias and mask; also tanh for the chain."""
            if bug == "hdim_gt128_second_half_unscaled" and d > 128:
                S = (np.einsum("hrd,hcd->hrc", Q[:, r0:r1, :128], K[:, c0:c1, :128]) * scale
                     + np.einsum("hrd,hcd->hrc", Q[:, r0:r1, 128:], K[:, c0:c1, 128:]))
            else:
                S = np.einsum("hrd,hcd->hrc", Q[:, r0:r1], K[:, c0:c1]) * scale
            th = None
            if cap is not None:
                if bug == "softcap_before_scale":
                    th = np.tanh(S / scale / cap); S = cap * th * scale
                else:
                    th = np.tanh(S / cap); S = cap * th
            r = np.arange(r0, r1)[:, None]; c = np.arange(c0, c1)[None, :]
            if slopes is not None:
                S = S - slopes[:, None, None] * np.abs(r + off - c).astype(F)[None]
            ok = np.ones((r1 - r0, c1 - c0), bool)
            if causal:
                ok &= c <= r + off
            if win is not None:
                if win[0] >= 0: ok &= c >= r + off - win[0]
                if win[1] >= 0: ok &= c <= r + off + win[1]
            fill = F(-10000.0) if bug == "mask_fill_minus_1e4" else F(-np.inf)
            S = np.where(ok[None], S, fill)
            return S, th, ok

        def skip(r0, r1, c0, c1):
            """Whether a key tile can be skipped entirely for a query block (causal only)."""
            if not causal:
                return False
            last_row = (r0 if bug == "causal_skip_block_start" else r1 - 1)
            return c0 > last_row + off

        for r0 in range(0, lq, BQ):
            r1 = min(r0 + BQ, lq)
            m = np.full((h, r1 - r0), -np.inf, F); l = np.zeros((h, r1 - r0), F)
            acc = np.zeros((h, r1 - r0, d), F)
            if bug == "l_fp16":
                l = l.astype(np.float16)
            m_first = None
            for c0 in range(0, lk, T):
                c1 = min(c0 + T, lk)
                if skip(r0, r1, c0, c1):
                    continue
                S, _, _ = scores(r0, r1, c0, c1)
                if bug == "no_max_subtraction":
                    m_new = np.zeros_like(m)
                elif bug == "stale_max":
                    if m_first is None:
                        m_first = np.maximum(m, S.max(-1))
                    m_new = m_first
                else:
                    m_new = np.maximum(m, S.max(-1))
                ms = np.where(np.isfinite(m_new), m_new, F(0))
                P = np.exp(S - ms[..., None])
                alpha = np.exp(np.where(np.isfinite(m), m - ms, -np.inf)).astype(F)
                if bug == "l_fp16":
                    l = (l * alpha.astype(np.float16) + P.sum(-1).astype(np.float16)).astype(np.float16)
                else:
                    l = l * alpha + P.sum(-1)
                if bug == "inference_path_no_rescale" and not want:
                    alpha = np.ones_like(alpha)   # splits merged as if they shared one max
                if bug == "p_bf16":
                    P = _bf16(P)
                acc = acc * alpha[..., None] + np.einsum("hrc,hcd->hrd", P, V[:, c0:c1])
                m = m_new
            l = l.astype(F)
            has = l > 0
            o = np.where(has[..., None], acc / np.where(has, l, 1)[..., None], F(0))
            ls = np.where(has, np.where(np.isfinite(m), m, 0) + np.log(np.where(has, l, 1)), -np.inf)
            lse_true[:, q0 + r0:q0 + r1] = ls
            if bug == "lse_without_max":
                ls = np.where(has, np.log(np.where(has, l, 1)), -np.inf)
            out[q0 + r0:q0 + r1] = o.transpose(1, 0, 2)
            lse[:, q0 + r0:q0 + r1] = ls
        if not want:
            continue
        # Backward: recompute P = exp(S - lse) per tile.
        O = out[q0:q1].transpose(1, 0, 2); dO = do[q0:q1].transpose(1, 0, 2)
        L = lse_true[:, q0:q1]
        if bug == "lse_without_max":      # backward uses the correct lse (only the returned one is wrong)
            pass
        Dl = (dO * O).sum(-1)                                   # [h, lq]
        if bug == "delta_head0":
            Dl = np.broadcast_to(Dl[:1], Dl.shape)
        dQ = np.zeros_like(Q); dK = np.zeros_like(K); dV = np.zeros_like(V)
        for c0 in range(0, lk, T):
            c1 = min(c0 + T, lk)
            for r0 in range(0, lq, BQ):
                r1 = min(r0 + BQ, lq)
                if skip(r0, r1, c0, c1):
                    continue
                S, th, ok = scores(r0, r1, c0, c1)
                Lr = L[:, r0:r1]
                Lf = np.where(np.isfinite(Lr), Lr, F(np.inf))
                P = np.exp(S - Lf[..., None]) * ok[None]
                if bug == "mask_fill_minus_1e4":
                    P = np.where(np.isfinite(Lr)[..., None], np.exp(S - np.where(np.isfinite(Lr), Lr, 0)[..., None]), 0)
                dV[:, c0:c1] += np.einsum("hrc,hrd->hcd", P, dO[:, r0:r1])
                dP = np.einsum("hrd,hcd->hrc", dO[:, r0:r1], V[:, c0:c1])
                dS = P * (dP - Dl[:, r0:r1, None])
                if th is not None:
                    dS = dS * (1 - th * th)
                dS = dS * scale
                if bug == "dq_overwrite_per_tile":
                    dQ[:, r0:r1] = np.einsum("hrc,hcd->hrd", dS, K[:, c0:c1])
                else:
                    dQ[:, r0:r1] += np.einsum("hrc,hcd->hrd", dS, K[:, c0:c1])
                dK[:, c0:c1] += np.einsum("hrc,hrd->hcd", dS, Q[:, r0:r1])
        dq[q0:q1] = dQ.transpose(1, 0, 2)
        dKt = dK.transpose(1, 0, 2).reshape(lk, h_kv, g, d); dVt = dV.transpose(1, 0, 2).reshape(lk, h_kv, g, d)
        if bug == "gqa_grad_last_head":
            dk[k0:k0 + lk] = dKt[:, :, -1]; dv[k0:k0 + lk] = dVt[:, :, -1]
        else:
            dk[k0:k0 + lk] = dKt.sum(2); dv[k0:k0 + lk] = dVt.sum(2)
    res = {"output": out, "lse": lse}
    if want:
        res.update(grad_q=dq, grad_k=dk, grad_v=dv)
    return res

def make(bug):
    def fn(**kw):
        return attention(bug=bug, **kw)
    fn.__name__ = "attention_" + (bug or "correct")
    return fn
