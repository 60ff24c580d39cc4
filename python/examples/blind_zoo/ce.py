"""Vocabulary-chunked float32 cross-entropy (chunks of C columns, online logsumexp),
and a fused linear cross-entropy (token chunks x vocabulary chunks), with optional bugs."""
import numpy as np
F = np.float32

def _cap(z, c, bug=None):
    if c is None:
        return z, None
    th = np.tanh(z / F(c))
    zc = F(c) * th
    if bug != "softcap_neg_inf_becomes_minus_cap":
        zc = np.where(np.isneginf(z), F(-np.inf), zc)
    return zc, th

def ce_rows(z, targets, v, ignore_index=-100, label_smoothing=0.0, smoothing=None, z_loss=0.0,
            softcap=None, want_grad=False, row_weight=None, C=1024, bug=None):
    """z: [n, v] float32 logits (raw). Returns per-token loss, lse, grad [n, v] (of the raw logits,
    already times row_weight) or None."""
    n = z.shape[0]
    a = F(label_smoothing or 0.0); zl = F(z_loss or 0.0)
    megatron = (smoothing == "megatron")
    t = np.asarray(targets)
    ign = (t == -100) if bug == "ignore_only_minus100" else (t == ignore_index)
    tt = np.where(ign, 0, t)
    m = np.full(n, -np.inf, F); s = np.zeros(n, F); sx = np.zeros(n, F)
    zt = np.zeros(n, F); zsum = np.zeros(n, F); zsx = np.zeros(n, F)
    nch = (v + C - 1) // C
    for ci in range(nch):
        c0, c1 = ci * C, min((ci + 1) * C, v)
        zc, _ = _cap(z[:, c0:c1], softcap, bug)
        hi = c1 - 1 if bug == "target_chunk_off_by_one" else c1
        inside = (tt >= c0) & (tt < hi)
        tmask = inside[:, None] & (np.arange(c0, c1)[None, :] == tt[:, None])
        cm = zc.max(1)
        m_new = np.maximum(m, cm)
        ms = np.where(np.isfinite(m_new), m_new, 0)
        alpha = np.where(np.isfinite(m), np.exp(m - ms), 0).astype(F)
        if bug == "chunk_merge_no_rescale":      # each chunk's sum relative to its own max, summed as is
            e = np.exp(zc - np.where(np.isfinite(cm), cm, 0)[:, None]); alpha = np.ones_like(alpha)
        elif bug == "no_max_subtraction":
            e = np.exp(zc); alpha = np.ones_like(alpha); m_new = np.zeros_like(m)
        else:
            e = np.exp(zc - ms[:, None])
        if bug == "sum_exp_fp16":
            e16 = e.astype(np.float16); a16 = alpha.astype(np.float16)
            s = (s.astype(np.float16) * a16 + e16.sum(1, dtype=np.float16)).astype(F)
            sx = (sx.astype(np.float16) * a16 + np.where(tmask, 0, e16).sum(1, dtype=np.float16)).astype(F)
        else:
            s = s * alpha + e.sum(1)
            sx = sx * alpha + np.where(tmask, 0, e).sum(1)
        m = m_new
        zt = np.where(inside, zc[np.arange(n), np.clip(tt - c0, 0, c1 - c0 - 1)], zt)
        zsum = zsum + zc.sum(1)
        zsx = zsx + np.where(tmask, 0, zc).sum(1)
    mf = np.where(np.isfinite(m), m, 0)
    logs = np.log(np.where(s > 0, s, 1))
    lse = np.where(s > 0, mf + logs, F(-np.inf)).astype(F)
    # -log p_t, accurate when p_t is close to 1: log1p(sum_{j != t} exp(z_j - z_t))
    dgap = mf - zt
    nll = np.where(dgap < 30, np.log1p(sx * np.exp(np.minimum(dgap, 30))), lse - zt)
    smul = lambda c, x: np.zeros_like(x) if c == 0 else F(c) * x
    if megatron and v > 1:
        loss = smul(1 - a, nll) + smul(a, lse - zsx / F(v - 1))
    else:
        loss = smul(1 - a, nll) + smul(a, lse - zsum / F(v))
    zterm = smul(zl, np.where(np.isfinite(lse), lse, 0) ** 2)
    loss = loss + zterm
    if bug == "zloss_on_ignored":
        loss = np.where(ign, zterm, loss)
    else:
        loss = np.where(ign, F(0), loss)
    grad = None
    if want_grad:
        grad = np.zeros((n, v), F)
        w = row_weight.astype(F)
        if bug != "ignored_rows_grad_not_zeroed":
            w = np.where(ign, F(0), w)
        lsef = np.where(np.isfinite(lse), lse, 0)
        logsf = np.where(s > 0, logs, 0)
        for ci in range(nch):
            c0, c1 = ci * C, min((ci + 1) * C, v)
            zc, th = _cap(z[:, c0:c1], softcap, bug)
            p = np.exp(zc - mf[:, None]) / np.where(s > 0, s, 1)[:, None]
            onehot = (np.arange(c0, c1)[None, :] == tt[:, None])
            if megatron and v > 1:
                qd = np.where(onehot, F(1 - a), F(a / F(v - 1)))
            else:
                qd = np.where(onehot, F(1 - a) + F(a / F(v)), F(a / F(v)))
            g = p - qd
            # at the target, p_t - 1 = -(sum of the others) / s: no cancellation when p_t ~ 1
            one_minus_q = F(a) if (megatron and v > 1) else F(a) * F(1 - 1 / F(v))
            if one_minus_q < 0.5:   # q_t near 1: the complement form avoids cancelling p_t - q_t
                g = np.where(onehot, -(sx / np.where(s > 0, s, 1))[:, None] + one_minus_q, g)
            if bug != "zloss_grad_missing":
                g = g + (2 * zl * lsef)[:, None] * p
            if th is not None and bug != "softcap_grad_no_chain":
                g = g * np.where(np.isneginf(z[:, c0:c1]), F(1), 1 - th * th)
            g = g * w[:, None]
            grad[:, c0:c1] = g
        if bug == "ignored_rows_grad_not_zeroed":
            grad[ign] = np.where(np.isfinite(grad[ign]), grad[ign], 0)
    return loss.astype(F), lse, grad, ign

def _row_weight(n, ign, reduction, grad_output):
    go = None if grad_output is None else np.asarray(grad_output, np.float64).ravel()
    if reduction == "none":
        return np.ones(n) if go is None else go
    gs = 1.0 if go is None else float(go[0])
    if reduction == "sum":
        return np.full(n, gs)
    N = int((~ign).sum())
    return np.full(n, gs / N if N else 0.0)

def _reduce(loss, ign, reduction):
    if reduction == "mean":
        N = int((~ign).sum())
        return float(loss.sum(dtype=np.float64) / N) if N else 0.0
    return float(loss.sum(dtype=np.float64))

def cross_entropy(logits, targets, ignore_index=-100, label_smoothing=0.0, smoothing=None,
                  z_loss=0.0, reduction="mean", vocab_size=None, softcap=None, want_grad=False,
                  grad_output=None, bug=None, C=1024, **_):
    logits = np.asarray(logits)
    n, w = logits.shape
    v = w if vocab_size is None else int(vocab_size)
    z = logits[:, :v].astype(F)
    if bug == "smoothing_megatron_as_pytorch":
        smoothing = None
    t = np.asarray(targets)
    ign0 = t == ignore_index
    rw = _row_weight(n, ign0, reduction, grad_output if want_grad else None)
    loss, lse, g, ign = ce_rows(z, targets, v, ignore_index, label_smoothing, smoothing, z_loss,
                                softcap, want_grad, rw, C, bug)
    res = {"loss": _reduce(loss, ign, reduction), "per_token_loss": loss, "logsumexp": lse}
    if want_grad:
        gl = np.zeros((n, w), F); gl[:, :v] = g
        res["grad_logits"] = gl
    return res

def linear_cross_entropy(hidden, weight, targets, ignore_index=-100, label_smoothing=0.0,
                         smoothing=None, z_loss=0.0, reduction="mean", vocab_size=None,
                         softcap=None, want_grad=False, grad_output=None, bug=None, C=1024,
                         TOK=64, **_):
    H = np.asarray(hidden, F); W = np.asarray(weight, F)
    n, hd = H.shape; w = W.shape[0]
    v = w if vocab_size is None else int(vocab_size)
    t = np.asarray(targets)
    ign0 = t == ignore_index
    rw = _row_weight(n, ign0, reduction, grad_output if want_grad else None)
    if bug == "grad_output_none_mean":   # not used
        pass
    if bug == "per_chunk_mean":
        # Liger-style chunk size: next_pow2(ceil(n / ceil(v / h)))
        TOK = 1 << int(np.ceil(np.log2(max(1, -(-n // -(-v // hd))))))
        if reduction == "mean":
            # each chunk's gradient scaled by its own non-ignored count, averaged over chunks
            nchunks = -(-n // TOK)
            for r0 in range(0, n, TOK):
                r1 = min(r0 + TOK, n); k_ = int((~ign0[r0:r1]).sum())
                rw[r0:r1] = (rw[r0:r1] * 0 + (1.0 if grad_output is None or not want_grad else float(np.ravel(grad_output)[0]))
                             / (k_ * nchunks) if k_ else 0.0)
    loss = np.zeros(n, F); lse = np.zeros(n, F)
    gH = np.zeros((n, hd), F); gW = np.zeros((w, hd), F)
    ign = ign0
    for r0 in range(0, n, TOK):
        r1 = min(r0 + TOK, n)
        if bug == "logits_fp16":
            z = (H[r0:r1].astype(np.float16) @ W[:v].T.astype(np.float16)).astype(F)
        else:
            z = H[r0:r1] @ W[:v].T
        l_, s_, g, ig = ce_rows(z, t[r0:r1], v, ignore_index, label_smoothing, smoothing, z_loss,
                                softcap, want_grad, rw[r0:r1], C, bug)
        loss[r0:r1] = l_; lse[r0:r1] = s_
        if want_grad:
            nch = (v + C - 1) // C
            if bug == "grad_hidden_drop_last_chunk":
                nch = v // C if v >= C else nch
            for ci in range(nch):
                c0, c1 = ci * C, min((ci + 1) * C, v)
                gH[r0:r1] += g[:, c0:c1] @ W[c0:c1]
            for ci in range((v + C - 1) // C):
                c0, c1 = ci * C, min((ci + 1) * C, v)
                if bug == "grad_weight_overwrite_token_chunk":
                    gW[c0:c1] = g[:, c0:c1].T @ H[r0:r1]
                else:
                    gW[c0:c1] += g[:, c0:c1].T @ H[r0:r1]
    res = {"loss": _reduce(loss, ign, reduction), "per_token_loss": loss, "logsumexp": lse}
    if bug == "per_chunk_mean" and reduction == "mean":
        tot = 0.0; nchunks = -(-n // TOK)
        for r0 in range(0, n, TOK):
            r1 = min(r0 + TOK, n); k_ = int((~ign[r0:r1]).sum())
            if k_: tot += float(loss[r0:r1].sum(dtype=np.float64)) / k_
        res["loss"] = tot / nchunks
    if want_grad:
        res.update(grad_hidden=gH, grad_weight=gW)
    return res

ALIAS = {  # variant name -> (bug switch, chunk sizes)
    "chunk16k_merge_no_rescale": ("chunk_merge_no_rescale", dict(C=16384)),
    "grad_weight_overwrite_token_chunk_1024": ("grad_weight_overwrite_token_chunk", dict(TOK=1024)),
}

def make_ce(bug):
    b, extra = ALIAS.get(bug, (bug, {}))
    def fn(**kw):
        return cross_entropy(bug=b, **extra, **kw)
    fn.__name__ = "ce_" + (bug or "correct")
    return fn

def make_lce(bug):
    b, extra = ALIAS.get(bug, (bug, {}))
    def fn(**kw):
        return linear_cross_entropy(bug=b, **extra, **kw)
    fn.__name__ = "lce_" + (bug or "correct")
    return fn
