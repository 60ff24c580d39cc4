"""A flash-attention-style numpy kernel, correct, and the mistakes its authors ship.

``tiled_attention(..., bug=None)`` is varlen attention in float32 the way a
flash-attention kernel computes it: per segment, the keys in tiles of
``TILE = 16``, an online softmax (running max ``m``, running sum ``l``, the
accumulator rescaled by ``exp(m_old - m_new)`` when the max grows), grouped-
query heads (query head ``a`` reads key/value head ``a // (h / h_kv)``),
bottom-right causal masks (query ``r`` of a segment of ``l_q`` queries over
``l_k`` keys sees key ``c <= r + l_k - l_q``), ``lse`` in natural log, and the
backward over the same key tiles with ``D = rowsum(dO * O)`` per query row.

Each ``bug`` changes one line, as the kernels that shipped it did:

- ``no_rescale``: the accumulator and sum are not rescaled when a later
  tile raises the row max (only wrong once a segment crosses a tile);
- ``partial_tile_unmasked``: the last key tile is zero-padded to 16 keys and
  the padding is not masked (scores of 0 join the softmax);
- ``gqa_modulo``: query head ``a`` reads key head ``a % h_kv``;
- ``causal_top_left``: the causal mask is aligned top-left (``c <= r``),
  wrong when a segment has fewer queries than keys;
- ``lse_log2``: ``lse`` returned in base 2 (the ``exp2`` trick's scale left in);
- ``delta_per_tile``: the backward's ``D = rowsum(dO * O)`` taken from the
  tile's partial output instead of the whole row's.

Shapes: ``q: [n_q, h, d]``, ``k, v: [n_k, h_kv, d]``, ``grad_output: [n_q,
h, d]``, ``cu_seqlens`` (or ``cu_seqlens_q`` / ``cu_seqlens_k``): ``[b + 1]``;
returns ``output [n_q, h, d]``, ``lse [h, n_q]``, ``grad_q``, ``grad_k``,
``grad_v``.
"""

import numpy as np

TILE = 16  # keys per tile (flash-attention's smallest block size)

BUGS = ("no_rescale", "partial_tile_unmasked", "gqa_modulo", "causal_top_left", "lse_log2",
        "delta_per_tile")


def _segments(cu_seqlens, cu_seqlens_q, cu_seqlens_k):
    cq = np.asarray(cu_seqlens_q if cu_seqlens_q is not None else cu_seqlens, dtype=np.int64)
    ck = np.asarray(cu_seqlens_k if cu_seqlens_k is not None else cq, dtype=np.int64)
    return [(int(a), int(b), int(c), int(e)) for a, b, c, e in zip(cq[:-1], cq[1:], ck[:-1], ck[1:])]


def _tiles(ks, vs, lk, bug):
    """(first key, keys [h, t, d], values [h, t, d], key columns) of each tile."""
    for t0 in range(0, lk, TILE):
        t1 = min(t0 + TILE, lk)
        kt, vt = ks[:, t0:t1], vs[:, t0:t1]
        if bug == "partial_tile_unmasked" and t1 - t0 < TILE:
            # BUG: the tile is padded with zero keys and values, never masked.
            pad = ((0, 0), (0, TILE - (t1 - t0)), (0, 0))
            kt, vt = np.pad(kt, pad), np.pad(vt, pad)
        yield t0, kt, vt, t0 + np.arange(kt.shape[1])


def _mask(cols, lq, lk, causal, bug):
    """[lq, t] allowed keys of a tile."""
    if not causal:
        return np.ones((lq, len(cols)), dtype=bool)
    rows = np.arange(lq)[:, None]
    limit = rows if bug == "causal_top_left" else rows + lk - lq  # BUG: top-left
    return cols[None, :] <= limit


def tiled_attention(q, k, v, cu_seqlens=None, scale=None, causal=False, grad_output=None,
                    want_grad=False, cu_seqlens_q=None, cu_seqlens_k=None, bug=None, **_):
    q32, k32, v32 = (np.asarray(x, dtype=np.float32) for x in (q, k, v))
    n_q, h, d = q32.shape
    n_k, h_kv = k32.shape[:2]
    scale = np.float32(1.0 / np.sqrt(d) if scale is None else scale)
    group = h // max(h_kv, 1)
    kv_of = np.array([a % h_kv if bug == "gqa_modulo" else a // group for a in range(h)],
                     dtype=np.int64)  # BUG (gqa_modulo): a % h_kv
    out = np.zeros((n_q, h, d), dtype=np.float32)
    lse = np.full((h, n_q), -np.inf, dtype=np.float32)
    backward = want_grad and grad_output is not None
    if backward:
        go32 = np.asarray(grad_output, dtype=np.float32)
        dq = np.zeros((n_q, h, d), dtype=np.float32)
        dk = np.zeros((n_k, h_kv, d), dtype=np.float32)
        dv = np.zeros((n_k, h_kv, d), dtype=np.float32)
    for q0, q1, k0, k1 in _segments(cu_seqlens, cu_seqlens_q, cu_seqlens_k):
        lq, lk = q1 - q0, k1 - k0
        if lq == 0:
            continue
        qs = q32[q0:q1].transpose(1, 0, 2)  # [h, lq, d]
        ks = k32[k0:k1][:, kv_of].transpose(1, 0, 2)  # [h, lk, d]
        vs = v32[k0:k1][:, kv_of].transpose(1, 0, 2)
        m = np.full((h, lq), -np.inf, dtype=np.float32)
        l = np.zeros((h, lq), dtype=np.float32)
        acc = np.zeros((h, lq, d), dtype=np.float32)
        for _t0, kt, vt, cols in _tiles(ks, vs, lk, bug):
            s = np.einsum("hid,hjd->hij", qs, kt) * scale
            s = np.where(_mask(cols, lq, lk, causal, bug)[None], s, np.float32(-np.inf))
            m_new = np.maximum(m, s.max(axis=2))
            m_safe = np.where(np.isfinite(m_new), m_new, np.float32(0))
            p = np.exp(s - m_safe[..., None])
            if bug == "no_rescale":
                alpha = np.ones_like(l)  # BUG: the old sums kept at the old max
            else:
                alpha = np.where(np.isfinite(m), np.exp(m - m_safe), np.float32(0))
            l = alpha * l + p.sum(axis=2)
            acc = alpha[..., None] * acc + np.einsum("hij,hjd->hid", p, vt)
            m = m_new
        has = l > 0
        m_safe = np.where(np.isfinite(m), m, np.float32(0))
        o = np.where(has[..., None], acc / np.where(has, l, 1)[..., None], np.float32(0))
        out[q0:q1] = o.transpose(1, 0, 2)
        seg_lse = np.where(has, m_safe + np.log(np.where(has, l, 1)), np.float32(-np.inf))
        if bug == "lse_log2":
            seg_lse = seg_lse / np.float32(np.log(2))  # BUG: base-2 lse returned
        lse[:, q0:q1] = seg_lse
        if not backward:
            continue
        do = go32[q0:q1].transpose(1, 0, 2)  # [h, lq, d]
        delta = (do * o).sum(axis=2)  # D = rowsum(dO * O), per row
        dqs = np.zeros((h, lq, d), dtype=np.float32)
        for t0, kt, vt, cols in _tiles(ks, vs, lk, None):
            s = np.einsum("hid,hjd->hij", qs, kt) * scale
            s = np.where(_mask(cols, lq, lk, causal, bug)[None], s, np.float32(-np.inf))
            p = np.exp(s - m_safe[..., None]) / np.where(has, l, 1)[..., None]
            dvt = np.einsum("hij,hid->hjd", p, do)
            dp = np.einsum("hid,hjd->hij", do, vt)
            if bug == "delta_per_tile":
                # BUG: D from this tile's share of the output only.
                delta = (do * np.einsum("hij,hjd->hid", p, vt)).sum(axis=2)
            ds = p * (dp - delta[..., None]) * scale
            dqs += np.einsum("hij,hjd->hid", ds, kt)
            dkt = np.einsum("hij,hid->hjd", ds, qs)
            t1 = t0 + kt.shape[1]
            for a in range(h):  # the query heads sharing key head kv_of[a]
                dk[k0 + t0:k0 + t1, kv_of[a]] += dkt[a]
                dv[k0 + t0:k0 + t1, kv_of[a]] += dvt[a]
        dq[q0:q1] = dqs.transpose(1, 0, 2)
    res = {"output": out.astype(np.float64), "lse": lse.astype(np.float64)}
    if backward:
        res.update(grad_q=dq.astype(np.float64), grad_k=dk.astype(np.float64),
                   grad_v=dv.astype(np.float64))
    return res


def kernel(bug=None):
    """``tiled_attention`` with ``bug`` fixed, named for reports."""
    def attention(q, k, v, cu_seqlens=None, scale=None, causal=False, grad_output=None,
                  want_grad=False, cu_seqlens_q=None, cu_seqlens_k=None, **kw):
        return tiled_attention(q, k, v, cu_seqlens, scale, causal, grad_output, want_grad,
                               cu_seqlens_q, cu_seqlens_k, bug=bug)
    attention.__name__ = f"tiled_attention_{bug or 'correct'}"
    return attention
