#!/usr/bin/env python3
"""A plain numpy implementation of varlen attention (forward and backward),
cross-entropy (every option packshard has), the output layer and the
embedding, run on packshard's golden vectors.

    packshard golden --out golden                        # f64 (or --dtype f32)
    python examples/python/check_numpy.py golden results.safetensors
    packshard check golden results.safetensors           # exit 0: every output within tolerance

It reads the manifest, runs every case whose op it implements on the case's
inputs (computing in the inputs' precision: float64 for an f64 set, float32
for an f32 one), and writes each output as `<case>/<output>` (the
manifest's `result` names). Cases of other ops (pack, batch) are left out;
`packshard check` lists them as skipped.

`--bug leak` plants docs/FAULTS.md P2 (attention across the segments of a pack)
and `--bug ignore_index` scores ignored targets as class 0: `packshard
check` must then exit 1 (CI runs both).

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


def attention(q, k, v, cu_seqlens, causal, scale, grad_output, bug=None):
    """Varlen attention: q, k, v, grad_output [n_tok, h, d]; cu_seqlens [b + 1].

    Returns output [n_tok, h, d], lse [h, n_tok] (natural log) and the
    gradients of q, k, v.
    """
    dt = q.dtype
    scale = dt.type(scale)
    n, h, d = q.shape
    out = np.zeros_like(q)
    lse = np.zeros((h, n), dtype=dt)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    bounds = [0, n] if bug == "leak" else list(cu_seqlens)
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b == a:
            continue  # an empty segment has no rows
        # [h, L, d] per segment
        Q, K, V, dO = (x[a:b].transpose(1, 0, 2) for x in (q, k, v, grad_output))
        S = scale * (Q @ K.transpose(0, 2, 1))  # [h, L, L]
        if causal:
            S = np.where(np.tri(b - a, dtype=bool), S, -np.inf)
        m = S.max(axis=-1, keepdims=True)
        E = np.exp(S - m)
        l = E.sum(axis=-1, keepdims=True)
        P = E / l
        O = P @ V
        out[a:b] = O.transpose(1, 0, 2)
        lse[:, a:b] = (m + np.log(l))[..., 0]
        dV = P.transpose(0, 2, 1) @ dO
        dP = dO @ V.transpose(0, 2, 1)
        D = (dO * O).sum(axis=-1, keepdims=True)
        dS = P * (dP - D)
        dq[a:b] = (scale * (dS @ K)).transpose(1, 0, 2)
        dk[a:b] = (scale * (dS.transpose(0, 2, 1) @ Q)).transpose(1, 0, 2)
        dv[a:b] = dV.transpose(1, 0, 2)
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
        return attention(
            inputs["q"], inputs["k"], inputs["v"], inputs["cu_seqlens"],
            p["causal"], p["scale"], inputs["grad_output"], bug,
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
    parser.add_argument("--bug", choices=["leak", "ignore_index"], help="plant a fault")
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
