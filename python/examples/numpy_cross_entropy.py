"""A framework author's numpy vocabulary-parallel cross-entropy, checked by packshard.

    python numpy_cross_entropy.py                          # green
    python numpy_cross_entropy.py --fault smoothing_per_shard  # a / v_shard instead of a / v
    python numpy_cross_entropy.py --fault padded_vocab     # padding columns in the softmax

The kernel splits the vocabulary over ``num_shards`` ranks as Megatron-LM does
(``uneven``: contiguous shards, larger first; ``padded``: ``ceil(v/p)`` columns
each, the tail padding), computes each shard's max, sum of exponentials,
target logit and smoothing term in float32, all-reduces them (here: numpy
sums over the shard axis), and returns the loss, per-token losses,
log-sum-exp and ``grad_logits`` ``[n, w]``. Exit status 0 when packshard's
checks pass, 1 when it catches the fault.
"""

import argparse
import sys

import numpy as np

from packshard import testing

FAULT = None


def shards(v, p, layout, w):
    """(start, real) columns of each rank."""
    if layout == "padded":
        c = -(-v // p)
        return [(r * c, max(0, min(c, v - r * c))) for r in range(p)]
    big, small = -(-v // p), v // p
    out, at = [], 0
    for r in range(p):
        size = big if r < v % p else small
        out.append((at, size))
        at += size
    return out


def vocab_parallel_ce(*args, **kw):
    with np.errstate(all="ignore"):
        return _vocab_parallel_ce(*args, **kw)


def _vocab_parallel_ce(logits, targets, ignore_index=-100, label_smoothing=0.0,
                      smoothing="pytorch", z_loss=0.0, reduction="mean", vocab_size=None,
                      num_shards=1, layout="uneven", want_grad=False, **_):
    n, w = logits.shape
    v = w if vocab_size is None else vocab_size
    p = num_shards or 1
    z = np.asarray(logits, dtype=np.float64)
    targets = np.asarray(targets)
    a = np.float32(label_smoothing)
    keep = targets != ignore_index
    parts = shards(v, p, layout, w)
    if FAULT == "padded_vocab":  # every given column counts, padding included
        parts = [(s, (parts[r + 1][0] if r + 1 < p else w) - s) for r, (s, _) in enumerate(parts)]
    # Per-rank statistics in float32, then the all-reduce.
    local_max = np.full((p, n), -np.inf, dtype=np.float32)
    for r, (s, real) in enumerate(parts):
        if real:
            local_max[r] = z[:, s:s + real].astype(np.float32).max(axis=1)
    m = local_max.max(axis=0)
    m_safe = np.where(np.isfinite(m), m, np.float32(0))
    sums = np.zeros((p, n), dtype=np.float32)
    # sum_j exp(z_j - m) - 1, kept apart from the 1 of the max so that
    # log1p keeps the bits of a loss near 0 (as the reference's statistics).
    rest = np.full(n, -1, dtype=np.float32)
    target_z = np.zeros(n, dtype=np.float32)
    smooth = np.zeros(n, dtype=np.float32)  # sum_j q_j * (m - z_j) over non-target j
    for r, (s, real) in enumerate(parts):
        zs = z[:, s:s + real].astype(np.float32)
        e = np.exp(zs - m_safe[:, None])
        sums[r] = e.sum(axis=1)
        at_max = zs == m_safe[:, None]
        rest += at_max.sum(axis=1) + np.where(at_max, 0, e).sum(axis=1)
        cols = np.arange(s, s + real)
        mine = (targets[:, None] == cols[None, :])
        target_z += np.where(mine, zs, 0).sum(axis=1)
        denom = real if FAULT == "smoothing_per_shard" else v
        if smoothing == "megatron":
            q_other = a / max(denom - 1, 1) if v > 1 else np.float32(0)
        else:
            q_other = a / denom
        if q_other > 0:
            gap = np.where(mine, 0, m_safe[:, None] - zs)
            smooth += q_other * gap.sum(axis=1)
    total = sums.sum(axis=0)
    log_s = np.log1p(np.maximum(rest, np.float32(-1) + np.float32(1e-38)))
    lse = np.where(np.isfinite(m), m_safe + log_s, -np.inf)
    q_t = (1 - a) + (a / v if smoothing != "megatron" else 0)
    # loss_i = lse - sum_j q_j z_j = (lse - m) + q_t (m - z_t) + sum_{j != t} q_j (m - z_j)
    with np.errstate(invalid="ignore", over="ignore"):
        per = log_s + (q_t * (m_safe - target_z) if q_t > 0 else 0) + smooth
        per = per + np.float32(z_loss) * lse * lse
    per = np.where(keep, per, 0).astype(np.float32)
    count = int(keep.sum())
    if reduction == "mean":
        loss = per.sum() / count if count else np.float32(0)
        g_scale = 1.0 / count if count else 0.0
    else:
        loss, g_scale = per.sum(), 1.0
    out = {"loss": float(loss), "per_token_loss": per.astype(np.float64),
           "logsumexp": lse.astype(np.float64)}
    if want_grad:
        g = np.zeros((n, w), dtype=np.float64)
        for r, (s, real) in enumerate(parts):
            zs = z[:, s:s + real].astype(np.float32)
            # exp(z - m), never exp(z - lse): lse near 1e8 keeps no bits of
            # log(sum) in float32. The gradient (e - q s) / s with s = 1 + rest
            # is taken as ((e - q) - q rest) / s: exact at a lone max entry.
            e = np.exp(zs - m_safe[:, None])
            s_ = (1 + rest)[:, None]
            cols = np.arange(s, s + real)
            mine = (targets[:, None] == cols[None, :])
            denom = real if FAULT == "smoothing_per_shard" else v
            if smoothing == "megatron":
                q = np.where(mine, 1 - a, a / max(denom - 1, 1) if v > 1 else 0)
            else:
                q = np.where(mine, 1 - a + a / denom, a / denom)
            q = q.astype(np.float32)
            gs = ((e - q) - q * rest[:, None]) / s_ + 2 * np.float32(z_loss) * lse[:, None] * e / s_
            g[:, s:s + real] = np.where(keep[:, None], gs, 0) * g_scale
        out["grad_logits"] = g
    return out


def main():
    global FAULT
    ap = argparse.ArgumentParser()
    ap.add_argument("--fault", choices=["smoothing_per_shard", "padded_vocab"])
    ap.add_argument("--cases", type=int, default=300)
    ap.add_argument("--regression-out")
    args = ap.parse_args()
    FAULT = args.fault
    try:
        # This kernel implements neither a softcap nor an upstream gradient:
        # the cases are run without them (`fix`), as a kernel states what it
        # lacks.
        r = testing.check_cross_entropy(vocab_parallel_ce, cases=args.cases, seed=3,
                                        fix={"softcap": None, "grad_output": None},
                                        regression_out=args.regression_out)
    except AssertionError as e:
        print(e)
        return 1
    print(f"numpy cross-entropy: green ({r.compared} cases compared, {r.values} values, "
          f"{r.skipped} bad inputs skipped)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
