#!/usr/bin/env python3
"""A plain numpy implementation of varlen attention (forward and backward),
cross-entropy (every option packshard has), the output layer and the
embedding, run on packshard's golden vectors. Its attention takes
flash-attention's options: grouped-query heads, cu_seqlens_q != cu_seqlens_k
(bottom-right aligned), window_size, softcap and alibi_slopes.

    packshard golden --out golden                        # f64 (or --dtype f32)
    python examples/python/check_numpy.py golden results.safetensors
    packshard check golden results.safetensors           # exit 0: every output within tolerance

It reads the manifest, runs every case whose op it implements on the case's
inputs (computing in the inputs' precision: float64 for an f64 set, float32
for an f32 one), and writes each output as `<case>/<output>` (the
manifest's `result` names). Cases of other ops (pack, batch) are left out;
`packshard check` lists them as skipped.

`--bug leak` plants docs/FAULTS.md P2 (attention across the segments of a pack),
`--bug ignore_index` scores ignored targets as class 0, and `--bug
window_top_left` aligns the sliding window top-left when a segment has fewer
queries than keys (W2): `packshard check` must then exit 1 (CI runs all three).

Requires numpy and safetensors (examples/python/requirements.txt). bfloat16
sets (`--dtype bf16`) need a framework with bfloat16 (e.g. safetensors.torch);
numpy has none.
"""

import argparse
import json
import pathlib
import sys

import numpy as np
from safetensors.numpy import load_file, save_file


def attention(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, grad_output,
              window_size=None, softcap=0.0, alibi_slopes=None, bug=None):
    """Varlen attention as flash_attn_varlen_func computes it.

    q, grad_output [n_q, h, d]; k, v [n_k, h_kv, d] (h_kv divides h: query
    head a reads key head a // (h // h_kv), grouped-query attention);
    cu_seqlens_q, cu_seqlens_k [b + 1]: segment s is queries
    cu_seqlens_q[s]:cu_seqlens_q[s+1] over keys cu_seqlens_k[s]:cu_seqlens_k[s+1].
    In a segment of l_q queries over l_k keys, query r's diagonal is key
    r + l_k - l_q (bottom-right alignment): causal allows keys at or before it,
    window_size (left, right) (-1 unbounded) keys within left before and right
    after it. The score of query r over key c is cap(scale q.k) - slope[a]
    |r + l_k - l_q - c|, cap(x) = softcap tanh(x / softcap) (softcap 0: none;
    applied before the mask, so a masked key stays -inf), the ALiBi term only
    with alibi_slopes [h]. A query that sees no key has output 0, lse -inf
    and zero gradients.

    Returns output [n_q, h, d], lse [h, n_q] (natural log) and grad_q
    [n_q, h, d], grad_k, grad_v [n_k, h_kv, d].
    """
    dt = q.dtype
    scale = dt.type(scale)
    n, h, d = q.shape
    h_kv = k.shape[1]
    group = h // h_kv
    heads = np.arange(h) // group  # the key head of each query head
    left, right = window_size if window_size is not None else (-1, -1)
    cap = dt.type(softcap)
    out = np.zeros_like(q)
    lse = np.zeros((h, n), dtype=dt)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    if bug == "leak":  # the whole pack as one segment (docs/FAULTS.md P2)
        cu_seqlens_q, cu_seqlens_k = [0, n], [0, k.shape[0]]
    bounds = zip(cu_seqlens_q[:-1], cu_seqlens_q[1:], cu_seqlens_k[:-1], cu_seqlens_k[1:])
    for a, b, ka, kb in bounds:
        lq, lk = b - a, kb - ka
        if lq == 0:
            continue  # no rows; its keys are read by no query
        # [h, l_q, d] and [h, l_k, d] per segment, the key heads repeated
        Q, dO = (x[a:b].transpose(1, 0, 2) for x in (q, grad_output))
        K, V = (x[ka:kb][:, heads].transpose(1, 0, 2) for x in (k, v))
        r = np.arange(lq)[:, None]
        c = np.arange(lk)[None, :]
        diag = r + lk - lq  # bottom-right
        allowed = np.ones((lq, lk), dtype=bool)
        if causal:
            allowed &= c <= diag
        # --bug window_top_left: the window's diagonal at key r (flash-attention
        # < 2.1, docs/FAULTS.md W2); causal stays bottom-right.
        wdiag = r if bug == "window_top_left" else diag
        if left >= 0:
            allowed &= c >= wdiag - left
        if right >= 0:
            allowed &= c <= wdiag + right
        raw = scale * (Q @ K.transpose(0, 2, 1))  # [h, l_q, l_k]
        if cap > 0:
            th = np.tanh(raw / cap)
            S = cap * th
        else:
            S = raw
        if alibi_slopes is not None:
            S = S - alibi_slopes.astype(dt)[:, None, None] * np.abs(diag - c).astype(dt)
        S = np.where(allowed, S, -np.inf)
        sees = allowed.any(axis=-1)[None, :, None]  # [1, l_q, 1]
        m = np.where(sees, S.max(axis=-1, keepdims=True), 0)
        E = np.exp(S - m)
        l = E.sum(axis=-1, keepdims=True)
        l = np.where(sees, l, 1)
        P = E / l  # 0 on rows that see no key
        O = P @ V
        out[a:b] = O.transpose(1, 0, 2)
        lse[:, a:b] = np.where(sees, m + np.log(l), -np.inf)[..., 0]
        dV = P.transpose(0, 2, 1) @ dO
        dP = dO @ V.transpose(0, 2, 1)
        D = (dO * O).sum(axis=-1, keepdims=True)
        dS = P * (dP - D)
        if cap > 0:  # through the cap: d(c tanh(x / c))/dx = 1 - tanh^2
            dS = dS * (1 - th**2)
        dq[a:b] = (scale * (dS @ K)).transpose(1, 0, 2)
        dK = scale * (dS.transpose(0, 2, 1) @ Q)  # [h, l_k, d]
        # each key head's gradient: the sum over its query heads
        dk[ka:kb] += dK.reshape(h_kv, group, lk, d).sum(axis=1).transpose(1, 0, 2)
        dv[ka:kb] += dV.reshape(h_kv, group, lk, d).sum(axis=1).transpose(1, 0, 2)
    return {"output": out, "lse": lse, "grad_q": dq, "grad_k": dk, "grad_v": dv}


def cross_entropy(logits, targets, p, bug=None, grad_output=None):
    """Cross-entropy of logits [n, w] (columns vocab_size.. are padding, never
    read) against targets [n], with ignore_index, label smoothing (PyTorch's
    or Megatron's convention), z-loss, the logit softcap c * tanh(z / c)
    (Gemma 2; applied first, a -inf logit stays -inf) and mean / sum / none
    reduction. The gradients are those of the loss times the upstream
    gradient grad_output, where given: [n] under reduction none (token i's
    gradient times grad_output[i]), [1] under sum and mean.

    Returns loss, per_token_loss [n], logsumexp [n] and grad_logits [n, w].
    A sharded run (num_shards, algorithm) must equal the unsharded one, so
    this is also the answer for the sharded cases.
    """
    dt = logits.dtype
    n, w = logits.shape
    v = p.get("vocab_size", w)
    z = logits[:, :v]
    cap = p.get("softcap")
    if cap is not None:
        th = np.tanh(z / dt.type(cap))
        z = np.where(np.isneginf(z), -np.inf, dt.type(cap) * th)
    a = dt.type(p["label_smoothing"])
    c = dt.type(p["z_loss"])
    ignored = targets == p["ignore_index"]
    if bug == "ignore_index":
        targets = np.where(ignored, 0, targets)
        ignored = np.zeros(n, dtype=bool)
    t = np.where(ignored, 0, targets)
    m = z.max(axis=1, keepdims=True)
    lse = m + np.log(np.exp(z - m).sum(axis=1, keepdims=True))  # [n, 1]
    prob = np.exp(z - lse)
    onehot = np.zeros_like(z)
    onehot[np.arange(n), t] = 1
    if a == 0:
        q = onehot
    elif p["smoothing"] == "pytorch":
        q = (1 - a) * onehot + a / v
    else:  # megatron: the target keeps 1 - a, the other v - 1 classes share a
        q = (1 - a) * onehot + (a / (v - 1)) * (1 - onehot)
    # q (lse - z), with 0 where q is 0 (a -inf logit that carries no mass)
    terms = np.where(q > 0, q * (lse - np.where(q > 0, z, 0)), 0)
    per_token = terms.sum(axis=1) + c * lse[:, 0] ** 2
    per_token = np.where(ignored, 0, per_token).astype(dt)
    count = int((~ignored).sum())
    if p["reduction"] == "mean":
        loss = per_token.sum() / count if count else dt.type(0)
        weight = dt.type(1 / count) if count else dt.type(0)
    else:  # sum, and none (whose loss is the sum)
        loss = per_token.sum()
        weight = dt.type(1)
    if grad_output is not None:
        g = grad_output.astype(dt)
        weight = weight * (g[:, None] if p["reduction"] == "none" else g[0])
    grad = weight * (prob - q + 2 * c * lse * prob)
    if cap is not None:  # through the cap: d(c tanh(x / c))/dx = 1 - tanh^2
        grad = grad * (1 - th**2)
    grad = np.where(ignored[:, None], 0, grad)
    grad_logits = np.zeros_like(logits)
    grad_logits[:, :v] = grad
    return {
        "loss": np.asarray(loss, dtype=dt),
        "per_token_loss": per_token,
        "logsumexp": lse[:, 0],
        "grad_logits": grad_logits,
    }


def linear_cross_entropy(hidden, weight, targets, p, bug=None, grad_output=None):
    """The output layer logits = hidden [n, h] @ weight[:v]^T and its
    cross-entropy; grad_hidden [n, h], grad_weight [w, h]."""
    v = p.get("vocab_size", weight.shape[0])
    logits = hidden @ weight[:v].T
    ce = cross_entropy(logits, targets, dict(p, vocab_size=v), bug, grad_output)
    g = ce.pop("grad_logits")
    grad_weight = np.zeros_like(weight)
    grad_weight[:v] = g.T @ hidden
    return dict(ce, grad_hidden=g @ weight[:v], grad_weight=grad_weight)


def embedding(ids, weight, grad_output, p):
    """The lookup weight[ids] ([n, h]) and its weight gradient [w, h]
    (repeated ids accumulate; padding rows get 0)."""
    grad_weight = np.zeros_like(weight)
    np.add.at(grad_weight, ids, grad_output)
    return {"output": weight[ids], "grad_weight": grad_weight}


def run_case(case, inputs, bug):
    p, op = case["params"], case["op"]
    if op == "attention":
        # cu_seqlens (self-attention), or cu_seqlens_q and cu_seqlens_k
        cu_q = inputs.get("cu_seqlens", inputs.get("cu_seqlens_q"))
        cu_k = inputs.get("cu_seqlens_k", cu_q)
        return attention(
            inputs["q"], inputs["k"], inputs["v"], cu_q, cu_k,
            p["causal"], p["scale"], inputs["grad_output"],
            window_size=p.get("window_size"), softcap=p.get("softcap", 0.0),
            alibi_slopes=inputs.get("alibi_slopes"), bug=bug,
        )
    if op == "cross_entropy":
        return cross_entropy(
            inputs["logits"], inputs["targets"], p, bug, inputs.get("grad_output"),
        )
    if op == "linear_cross_entropy":
        return linear_cross_entropy(
            inputs["hidden"], inputs["weight"], inputs["targets"], p, bug,
            inputs.get("grad_output"),
        )
    if op == "embedding":
        return embedding(inputs["ids"], inputs["weight"], inputs["grad_output"], p)
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("golden", type=pathlib.Path, help="a directory written by `packshard golden`")
    parser.add_argument("results", type=pathlib.Path, help="the safetensors file to write")
    parser.add_argument("--bug", choices=["leak", "ignore_index", "window_top_left"],
                        help="plant a fault")
    args = parser.parse_args()

    manifest = json.loads((args.golden / "manifest.json").read_text())
    results, skipped = {}, []
    for case in manifest["cases"]:
        inputs = load_file(str(args.golden / case["inputs_file"]))
        out = run_case(case, inputs, args.bug)
        if out is None:
            skipped.append(case["name"])
            continue
        for name, spec in case["outputs"].items():
            value = np.array(out[name], order="C")  # keeps 0-d scalars 0-d
            assert list(value.shape) == spec["shape"], (case["name"], name, value.shape)
            results[spec["result"]] = value
    save_file(results, str(args.results))
    print(f"wrote {len(results)} outputs of {len(manifest['cases']) - len(skipped)} cases to "
          f"{args.results}; not implemented here: {', '.join(skipped)}")


if __name__ == "__main__":
    sys.exit(main())
