"""A framework author's numpy varlen attention (document mask), checked by packshard.

    python numpy_attention.py                      # green: every check passes
    python numpy_attention.py --fault across_documents   # the mask ignores cu_seqlens
    python numpy_attention.py --fault positions_not_reset  # position_ids run on across a row

The kernel runs in float32 and builds each row's document mask from
``cu_seqlens`` (block-diagonal, optionally causal), with the backward by hand.
The batching helper turns the oracle's packing plan into ``input_ids``,
``position_ids`` and ``sequence_ids``. Exit status 0 when the checks pass,
1 when packshard catches a fault (printing its report).
"""

import argparse
import sys

import numpy as np

import packshard
from packshard import testing

FAULT = None


def varlen_attention(q, k, v, cu_seqlens, scale=None, causal=False, grad_output=None,
                     want_grad=False):
    """Self-attention (it takes no cu_seqlens_k, so packshard gives it no cross
    cases): q, grad_output: [n_tok, h, d]; k, v: [n_tok, h_kv, d] (query head
    a reads key head a // (h / h_kv)); cu_seqlens: [b + 1]. float32 inside."""
    n, h, d = q.shape
    h_kv = k.shape[1]
    if n == 0:  # no tokens: empty results (numpy's max has no identity)
        z, zk = np.zeros((0, h, d)), np.zeros((0, h_kv, d))
        return {"output": z, "lse": np.zeros((h, 0)), "grad_q": z, "grad_k": zk, "grad_v": zk}
    q32 = np.asarray(q, dtype=np.float32)
    # Grouped-query heads as Hugging Face's repeat_kv: head a reads a // (h / h_kv).
    k32, v32 = (np.repeat(np.asarray(x, dtype=np.float32), h // h_kv, axis=1) for x in (k, v))
    scale = np.float32(1.0 / np.sqrt(d) if scale is None else scale)
    # Document ids per token, then the [n, n] mask: same document (and causal).
    doc = np.searchsorted(np.asarray(cu_seqlens)[1:], np.arange(n), side="right")
    mask = doc[:, None] == doc[None, :]
    if FAULT == "across_documents":
        mask = np.ones((n, n), dtype=bool)
    if causal:
        mask &= np.arange(n)[None, :] <= np.arange(n)[:, None]
    s = np.einsum("ihd,jhd->hij", q32, k32) * scale  # [h, n, n]
    s = np.where(mask[None], s, -np.inf)
    m = s.max(axis=2, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    e = np.exp(s - m)
    z = e.sum(axis=2, keepdims=True)
    p = e / np.where(z > 0, z, 1)
    out = np.einsum("hij,jhd->ihd", p, v32)
    lse = (m + np.log(np.where(z > 0, z, 1)))[:, :, 0]  # [h, n]
    res = {"output": out.astype(np.float64), "lse": lse.astype(np.float64)}
    if want_grad and grad_output is not None:
        go = np.asarray(grad_output, dtype=np.float32)
        dv = np.einsum("hij,ihd->jhd", p, go)
        dp = np.einsum("ihd,jhd->hij", go, v32)
        delta = (go * out).sum(axis=2).T[:, :, None]  # [h, n, 1]
        ds = p * (dp - delta) * scale
        res["grad_q"] = np.einsum("hij,jhd->ihd", ds, k32).astype(np.float64)
        # Summed over the query heads sharing each key head.
        gk = np.einsum("hij,ihd->jhd", ds, q32).reshape(n, h_kv, h // h_kv, d).sum(axis=2)
        res["grad_k"] = gk.astype(np.float64)
        res["grad_v"] = dv.reshape(n, h_kv, h // h_kv, d).sum(axis=2).astype(np.float64)
    return res


def batch_rows(sequences, packs, max_seq_len, **_):
    """The oracle's plan -> input_ids, position_ids, sequence_ids, cu_seqlens."""
    P = len(packs)
    input_ids = np.zeros((P, max_seq_len), dtype=np.int64)
    position_ids = np.zeros((P, max_seq_len), dtype=np.int64)
    sequence_ids = np.zeros((P, max_seq_len), dtype=np.int64)
    cu = []
    for r, pack in enumerate(packs):
        at, c = 0, [0]
        for s, seg in enumerate(pack, start=1):
            toks = sequences[seg["sequence"]][seg["offset"]:seg["offset"] + seg["length"]]
            L = len(toks)
            input_ids[r, at:at + L] = toks
            position_ids[r, at:at + L] = np.arange(L) if FAULT != "positions_not_reset" \
                else np.arange(at, at + L)
            sequence_ids[r, at:at + L] = s
            at += L
            c.append(at)
        cu.append(np.asarray(c))
    return {"input_ids": input_ids, "position_ids": position_ids,
            "sequence_ids": sequence_ids, "cu_seqlens": cu}


def main():
    global FAULT
    ap = argparse.ArgumentParser()
    ap.add_argument("--fault", choices=["across_documents", "positions_not_reset"])
    ap.add_argument("--cases", type=int, default=150)
    FAULT = ap.parse_args().fault
    try:
        testing.check_batch(batch_rows, cases=40, seed=1)
        r1 = testing.check_attention(varlen_attention, cases=ap.parse_args().cases, seed=1)
        r2 = testing.check_attention(varlen_attention, cases=60, seed=2, causal=True)
    except AssertionError as e:
        print(e)
        return 1
    # And one packed batch end to end: packshard.batch's cu_seqlens drive the kernel.
    b = packshard.batch([[5] * 7, [6] * 3, [], [7] * 11], 16, algorithm="ffd")
    assert (b["position_ids"] == batch_rows([[5] * 7, [6] * 3, [], [7] * 11], b["packs"], 16)
            ["position_ids"]).all()
    print(f"numpy attention: green ({r1.compared} + {r2.compared} cases compared, "
          f"{r1.values + r2.values} values; worst {100 * max(r1.worst, r2.worst):.1f}% of the "
          f"allowed error)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
