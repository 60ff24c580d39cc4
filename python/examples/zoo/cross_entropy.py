"""A vocabulary-chunked numpy cross-entropy, correct, and the mistakes its authors ship.

``chunked_cross_entropy(..., bug=None)`` computes the loss in float32 the way
a memory-saving kernel (Liger, Apple's cut cross-entropy, a vocabulary-
parallel rank) does: the real vocabulary ``v`` in chunks of ``CHUNK = 1024``
columns, each chunk's max, then its sum of ``exp(z - m)`` (kept as ``rest =
sum - 1`` beside the max so ``log1p`` keeps the bits of a loss near 0), the
target logit and the smoothing term; then the loss, ``logsumexp`` and
``grad_logits [n, w]`` (padding columns ``v..w`` 0). Options: ``ignore_index``,
``label_smoothing`` (``pytorch``: ``a / v`` on every class; ``megatron``:
``a / (v - 1)`` on the others), ``z_loss``, ``reduction`` (``mean`` over the
non-ignored tokens, ``sum``, ``none``), ``softcap`` (``c * tanh(z / c)``
first, its gradient times ``1 - tanh^2``), ``grad_output`` (``[n]`` under
``none``: token ``i``'s gradient times ``grad_output[i]``; ``[1]`` otherwise).

Each ``bug`` changes one line, as the kernels that shipped it did:

- ``drop_last_chunk``: ``v // CHUNK`` chunks (at least one): the last partial
  chunk of a vocabulary over 1024 never reaches the logsumexp;
- ``ignore_in_mean``: the mean divides by every token, ignored ones included;
- ``smoothing_padded``: the smoothing mass spread over the padded width ``w``;
- ``grad_output_scalar``: a per-token ``grad_output`` read as one scalar;
- ``softcap_no_chain``: the softcap's gradient without its ``1 - tanh^2``.
"""

import numpy as np

CHUNK = 1024  # vocabulary columns per chunk

BUGS = ("drop_last_chunk", "ignore_in_mean", "smoothing_padded", "grad_output_scalar",
        "softcap_no_chain")


def _chunks(v, bug):
    count = max(1, v // CHUNK) if bug == "drop_last_chunk" else -(-v // CHUNK)  # BUG: floor
    return [(s, min(s + CHUNK, v)) for s in range(0, count * CHUNK, CHUNK) if s < v]


def chunked_cross_entropy(logits, targets, ignore_index=-100, label_smoothing=0.0,
                          smoothing="pytorch", z_loss=0.0, reduction="mean", vocab_size=None,
                          softcap=None, want_grad=False, grad_output=None, bug=None, **_):
    with np.errstate(all="ignore"):
        return _ce(logits, targets, ignore_index, label_smoothing, smoothing, z_loss, reduction,
                   vocab_size, softcap, want_grad, grad_output, bug)


def _ce(logits, targets, ignore_index, label_smoothing, smoothing, z_loss, reduction,
        vocab_size, softcap, want_grad, grad_output, bug):
    n, w = logits.shape
    v = w if vocab_size is None else int(vocab_size)
    targets = np.asarray(targets)
    keep = targets != ignore_index
    z = np.asarray(logits, dtype=np.float64)[:, :v].astype(np.float32)
    if softcap is not None:
        c = np.float32(softcap)
        z = np.where(z == -np.inf, z, c * np.tanh(z / c))
    a = np.float32(label_smoothing)
    width = w if bug == "smoothing_padded" else v  # BUG: the padded width
    if smoothing == "megatron":
        q_t, q_o = 1 - a, (a / max(width - 1, 1) if v > 1 else np.float32(0))
    else:
        q_t, q_o = 1 - a + a / width, a / width
    q_t, q_o = np.float32(q_t), np.float32(q_o)
    chunks = _chunks(v, bug)
    m = np.full(n, -np.inf, dtype=np.float32)
    for s, e in chunks:
        m = np.maximum(m, z[:, s:e].max(axis=1))
    m_safe = np.where(np.isfinite(m), m, np.float32(0))
    rest = np.full(n, -1, dtype=np.float32)  # sum_j exp(z_j - m) - 1
    gap = np.zeros(n, dtype=np.float32)  # sum_j q_j (m - z_j)
    for s, e in chunks:
        zs = z[:, s:e]
        at_max = zs == m_safe[:, None]
        rest += at_max.sum(axis=1) + np.where(at_max, 0, np.exp(zs - m_safe[:, None])).sum(axis=1)
        mine = targets[:, None] == np.arange(s, e)[None, :]
        q = np.where(mine, q_t, q_o)
        gap += np.where(q > 0, q * (m_safe[:, None] - zs), 0).sum(axis=1)
    log_s = np.log1p(rest)
    lse = np.where(np.isfinite(m), m_safe + log_s, -np.inf).astype(np.float32)
    per = log_s + gap + np.float32(z_loss) * lse * lse
    per = np.where(keep, per, 0).astype(np.float32)
    count = n if bug == "ignore_in_mean" else int(keep.sum())  # BUG: ignored tokens counted
    if reduction == "mean":
        loss, scale = (per.sum() / count, 1.0 / count) if count else (np.float32(0), 0.0)
    else:
        loss, scale = per.sum(), 1.0
    out = {"loss": float(loss), "per_token_loss": per.astype(np.float64),
           "logsumexp": lse.astype(np.float64)}
    if not want_grad:
        return out
    go = np.ones(n) if grad_output is None else np.asarray(grad_output, dtype=np.float64).ravel()
    if reduction == "none" and bug != "grad_output_scalar":
        tok = go if go.size == n else np.full(n, go[0])
    else:
        tok = np.full(n, go[0])  # BUG (grad_output_scalar): token 0's weight for all
    weight = (np.where(keep, tok, 0) * scale).astype(np.float32)
    g = np.zeros((n, w), dtype=np.float64)
    s_ = (1 + rest)[:, None]
    for s, e in chunks:
        zs = z[:, s:e]
        ex = np.exp(zs - m_safe[:, None])
        mine = targets[:, None] == np.arange(s, e)[None, :]
        q = np.where(mine, q_t, q_o)
        # (e - q s) / s with s = 1 + rest, taken as ((e - q) - q rest) / s:
        # exact at a lone max entry, as the reference's confident-target form.
        gs = ((ex - q) - q * rest[:, None]) / s_ + 2 * np.float32(z_loss) * lse[:, None] * ex / s_
        if softcap is not None and bug != "softcap_no_chain":
            t = zs / np.float32(softcap)  # zs is capped: t = tanh(z / c)
            # A -inf (masked) logit stays masked under the cap; its gradient
            # is the reference's p - q, without a chain factor.
            gs = np.where(np.isfinite(zs), gs * ((1 - t) * (1 + t)), gs)  # BUG: line missing
        g[:, s:e] = np.where(weight[:, None] != 0, gs * weight[:, None], 0)
    out["grad_logits"] = g
    return out


def kernel(bug=None):
    """``chunked_cross_entropy`` with ``bug`` fixed, named for reports."""
    def cross_entropy(logits, targets, **kw):
        kw.pop("bug", None)
        return chunked_cross_entropy(logits, targets, bug=bug, **kw)
    cross_entropy.__name__ = f"chunked_cross_entropy_{bug or 'correct'}"
    return cross_entropy


def linear_cross_entropy(hidden, weight, targets, vocab_size=None, want_grad=False, **kw):
    """The output layer over :func:`chunked_cross_entropy`: ``logits = hidden
    @ weight[:v].T`` in float32 (``hidden: [n, h]``, ``weight: [w, h]``), and
    ``grad_hidden = g @ W``, ``grad_weight = g.T @ hidden`` (padding rows 0)."""
    h32 = np.asarray(hidden, dtype=np.float32)
    w32 = np.asarray(weight, dtype=np.float32)
    v = w32.shape[0] if vocab_size is None else int(vocab_size)
    logits = (h32 @ w32[:v].T).astype(np.float64)
    out = chunked_cross_entropy(logits, targets, want_grad=want_grad, **kw)
    g = out.pop("grad_logits", None)
    if g is not None:
        g32 = g.astype(np.float32)
        out["grad_hidden"] = (g32 @ w32[:v]).astype(np.float64)
        gw = np.zeros(w32.shape, dtype=np.float64)
        gw[:v] = (g32.T @ h32).astype(np.float64)
        out["grad_weight"] = gw
    return out


def embedding(ids, weight, grad_output=None, want_grad=False, **_):
    """``weight[ids]`` and its weight gradient (``np.add.at`` over repeated ids)."""
    out = {"output": np.asarray(weight, dtype=np.float64)[np.asarray(ids)]}
    if want_grad and grad_output is not None:
        g = np.zeros(np.shape(weight))
        np.add.at(g, np.asarray(ids), np.asarray(grad_output, dtype=np.float64))
        out["grad_weight"] = g
    return out
