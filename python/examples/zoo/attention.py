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

flash-attention's options (``window_size``, ``softcap``, ``alibi_slopes``,
``seqused_k``; docs/INTERFACE.md) and their mistakes (docs/FAULTS.md W1-W6):

- ``window_off_by_one`` (W1): the left edge one key too far, ``c >= diag -
  left - 1``;
- ``window_top_left`` (W2): the window's diagonal ``c = r`` instead of ``r +
  l_k - l_q`` when ``l_q != l_k`` (the causal mask kept right);
- ``window_across_documents`` (W3): the left edge applied over the pack's
  keys, so a document's first queries see the previous document's last keys;
- ``softcap_after_mask`` (W4): the cap applied after the mask, so a masked
  key scores ``-softcap`` instead of ``-inf``;
- ``softcap_no_chain`` (W5): the backward without the cap's chain factor
  ``1 - tanh^2(raw / softcap)``;
- ``alibi_pack_start`` (W6): ALiBi's distance over the pack's token indices
  instead of the segment's bottom-right aligned ``|r + l_k - l_q - c|``;
- ``alibi_sign`` (W6): ``+slope * |...|``.

Shapes: ``q: [n_q, h, d]``, ``k, v: [n_k, h_kv, d]``, ``grad_output: [n_q,
h, d]``, ``cu_seqlens`` (or ``cu_seqlens_q`` / ``cu_seqlens_k``): ``[b + 1]``;
returns ``output [n_q, h, d]``, ``lse [h, n_q]``, ``grad_q``, ``grad_k``,
``grad_v``.
"""

import numpy as np

TILE = 16  # keys per tile (flash-attention's smallest block size)

BUGS = ("no_rescale", "partial_tile_unmasked", "gqa_modulo", "causal_top_left", "lse_log2",
        "delta_per_tile", "window_off_by_one", "window_top_left", "window_across_documents",
        "softcap_after_mask", "softcap_no_chain", "alibi_pack_start", "alibi_sign",
        "sum_f16", "p_bf16")


def _bf16(x):
    """``x`` (float32) rounded to bfloat16 (nearest, ties to even), kept as float32."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    b = (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return b.view(np.float32)


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


def _mask(cols, lq, lk, causal, bug, window=(-1, -1)):
    """[lq, t] allowed keys of a tile (``cols``: key indices local to the
    segment): bottom-right causal and the window ``(left, right)``."""
    rows = np.arange(lq)[:, None]
    diag = rows + lk - lq
    allowed = np.ones((lq, len(cols)), dtype=bool)
    if causal:
        limit = rows if bug == "causal_top_left" else diag  # BUG: top-left
        allowed &= cols[None, :] <= limit
    wdiag = rows if bug == "window_top_left" else diag  # BUG (W2): c = r
    left, right = window
    if right >= 0:
        allowed &= cols[None, :] <= wdiag + right
    if left >= 0:
        edge = wdiag - left - 1 if bug == "window_off_by_one" else wdiag - left  # BUG (W1)
        allowed &= cols[None, :] >= edge
    if bug != "window_across_documents":
        allowed &= cols[None, :] >= 0  # BUG (W3): the previous document's keys kept
    return allowed


def _scores(qs, kt, cols, scale, lq, lk, causal, bug, opts):
    """The tile's scores ``[h, lq, t]`` after the cap, ALiBi and the mask, and
    ``d cap / d raw`` (1 without a cap). ``opts``: window, softcap, slopes
    ``[h]`` or None, and the segment's first query and key in the pack."""
    window, softcap, slopes, (q0, k0) = opts
    raw = np.einsum("hid,hjd->hij", qs, kt) * scale
    mask = _mask(cols, lq, lk, causal, bug, window)[None]
    if bug == "softcap_after_mask":
        raw = np.where(mask, raw, np.float32(-np.inf))  # BUG (W4): masked before the cap
    chain = np.ones_like(raw)
    s = raw
    if softcap:
        c = np.float32(softcap)
        t = np.tanh(raw / c)
        s, chain = c * t, np.float32(1) - t * t
    if slopes is not None:
        rows = np.arange(lq)[:, None]
        if bug == "alibi_pack_start":
            dist = np.abs((q0 + rows) - (k0 + cols[None, :]))  # BUG (W6): pack indices
        else:
            dist = np.abs(rows + lk - lq - cols[None, :])
        sign = np.float32(1) if bug == "alibi_sign" else np.float32(-1)  # BUG (W6): +slope
        s = s + sign * slopes[:, None, None] * dist[None].astype(np.float32)
    if bug != "softcap_after_mask":
        s = np.where(mask, s, np.float32(-np.inf))
    return s, chain


def tiled_attention(q, k, v, cu_seqlens=None, scale=None, causal=False, grad_output=None,
                    want_grad=False, cu_seqlens_q=None, cu_seqlens_k=None, bug=None,
                    window_size=None, softcap=None, alibi_slopes=None, seqused_k=None, **_):
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
    window = (-1, -1) if window_size is None else tuple(int(x) for x in window_size)
    slopes_all = None if alibi_slopes is None else np.asarray(alibi_slopes, dtype=np.float32)
    for seg, (q0, q1, k0, k1) in enumerate(_segments(cu_seqlens, cu_seqlens_q, cu_seqlens_k)):
        lq = q1 - q0
        lk = k1 - k0 if seqused_k is None else min(int(seqused_k[seg]), k1 - k0)
        if lq == 0:
            continue
        # The keys read: the segment's used ones (W3's bug: also the `left`
        # keys before it in the pack, at local columns below 0).
        ext = min(k0, window[0]) if bug == "window_across_documents" and window[0] >= 0 else 0
        kb = k0 - ext
        opts = (window, softcap, slopes_all, (q0, k0))
        qs = q32[q0:q1].transpose(1, 0, 2)  # [h, lq, d]
        ks = k32[kb:k0 + lk][:, kv_of].transpose(1, 0, 2)  # [h, ext + lk, d]
        vs = v32[kb:k0 + lk][:, kv_of].transpose(1, 0, 2)
        m = np.full((h, lq), -np.inf, dtype=np.float32)
        l = np.zeros((h, lq), dtype=np.float32)
        acc = np.zeros((h, lq, d), dtype=np.float32)
        for _t0, kt, vt, cols in _tiles(ks, vs, ext + lk, bug):
            s, _ = _scores(qs, kt, cols - ext, scale, lq, lk, causal, bug, opts)
            m_new = np.maximum(m, s.max(axis=2))
            m_safe = np.where(np.isfinite(m_new), m_new, np.float32(0))
            p = np.exp(s - m_safe[..., None])
            if bug == "no_rescale":
                alpha = np.ones_like(l)  # BUG: the old sums kept at the old max
            else:
                alpha = np.where(np.isfinite(m), np.exp(m - m_safe), np.float32(0))
            if bug == "sum_f16":
                # BUG: the denominator accumulated in float16 (a half-precision
                # register for the row sums).
                l = (alpha * l).astype(np.float16) + p.sum(axis=2).astype(np.float16)
                l = l.astype(np.float32)
            else:
                l = alpha * l + p.sum(axis=2)
            pv = _bf16(p) if bug == "p_bf16" else p  # BUG (p_bf16): P stored in bf16 for P V
            acc = alpha[..., None] * acc + np.einsum("hij,hjd->hid", pv, vt)
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
        for t0, kt, vt, cols in _tiles(ks, vs, ext + lk, None):
            s, chain = _scores(qs, kt, cols - ext, scale, lq, lk, causal, bug, opts)
            if bug == "softcap_no_chain":
                chain = np.ones_like(chain)  # BUG (W5): d cap / d raw dropped
            p = np.exp(s - m_safe[..., None]) / np.where(has, l, 1)[..., None]
            dvt = np.einsum("hij,hid->hjd", p, do)
            dp = np.einsum("hid,hjd->hij", do, vt)
            if bug == "delta_per_tile":
                # BUG: D from this tile's share of the output only.
                delta = (do * np.einsum("hij,hjd->hid", p, vt)).sum(axis=2)
            ds = p * (dp - delta[..., None]) * chain * scale
            dqs += np.einsum("hij,hjd->hid", ds, kt)
            dkt = np.einsum("hij,hid->hjd", ds, qs)
            t1 = t0 + kt.shape[1]
            for a in range(h):  # the query heads sharing key head kv_of[a]
                dk[kb + t0:kb + t1, kv_of[a]] += dkt[a]
                dv[kb + t0:kb + t1, kv_of[a]] += dvt[a]
        dq[q0:q1] = dqs.transpose(1, 0, 2)
    res = {"output": out.astype(np.float64), "lse": lse.astype(np.float64)}
    if backward:
        res.update(grad_q=dq.astype(np.float64), grad_k=dk.astype(np.float64),
                   grad_v=dv.astype(np.float64))
    return res


def kernel(bug=None):
    """``tiled_attention`` with ``bug`` fixed, named for reports."""
    def attention(q, k, v, cu_seqlens=None, scale=None, causal=False, grad_output=None,
                  want_grad=False, cu_seqlens_q=None, cu_seqlens_k=None, window_size=None,
                  softcap=None, alibi_slopes=None, seqused_k=None, **kw):
        return tiled_attention(q, k, v, cu_seqlens, scale, causal, grad_output, want_grad,
                               cu_seqlens_q, cu_seqlens_k, bug=bug, window_size=window_size,
                               softcap=softcap, alibi_slopes=alibi_slopes, seqused_k=seqused_k)
    attention.__name__ = f"tiled_attention_{bug or 'correct'}"
    return attention
