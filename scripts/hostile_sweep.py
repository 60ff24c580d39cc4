#!/usr/bin/env python3
"""Hostile sweep of issue #32's surfaces through `packshard eval --jsonl`:
edge values (0, +-1e-300, +-1e30, +-1e154, +-1e300, +-1.7e308, f32's
limits) in the attention, loss and decoder options and tensors; the work
bounds (one long segment through every attention impl, the output layer
at its sizes); hostile integers in causal_labels and causal_conversions;
all under a small budget and an address-space cap. Counts panics, aborts
(a batch whose output lines are missing), batches over 10 s, and suspect
answers: non-finite numbers in results that succeeded, and plain
cross-entropy losses that disagree with an independent exact computation
(Python's decimal, 700 digits): a finite true loss must come back within
1e-12 relative, a true loss beyond f64 as +inf or a refusal.

    python3 scripts/hostile_sweep.py target/debug/packshard [N]
"""
import json, random, subprocess, sys, time
from decimal import Decimal, getcontext

getcontext().prec = 700  # enough for lse - z at 1e308 with a gap of 1e-300
F64_MAX = Decimal("1.7976931348623157e308")

EDGES = [0.0, 1e-300, -1e-300, 1.0, -1.0, 1e30, -1e30, 1e154, -1e154, 1e300,
         -1e300, 1.7e308, -1.7e308, 3.4e38, 3.5e38, 1e-50, 2.5, 1e10]
IMPLS = ["reference", "attention_varlen_tiled", "attention_varlen_tiled_bf16",
         "attention_varlen_scalar", "attention_dense_masked"]
LINEAR_IMPLS = ["reference", "linear_ce_materialized", "linear_ce_fused",
                "linear_ce_tiled", "linear_ce_tiled_filtered"]
HUGE = [0, 1, 2, 7, 2**20, 2**31, 2**40, 2**53, 2**62, 2**63 - 1, 2**64 - 1, 10**20]
LOSS_IMPLS = ["reference", "cross_entropy_f32"]
BATCH = 50


def t3(n, h, d, r):
    return [[[r.choice(EDGES) for _ in range(d)] for _ in range(h)] for _ in range(n)]


def attention(r):
    n, h, d = r.choice([0, 1, 2, 3]), r.choice([0, 1, 2]), r.choice([0, 1, 2])
    c = {"op": "attention", "impl": r.choice(IMPLS), "q": t3(n, h, d, r),
         "k": t3(n, h, d, r), "v": t3(n, h, d, r), "cu_seqlens": [0, n]}
    if r.random() < 0.5:
        c["want_grad"] = True
        c["grad_output"] = t3(n, h, d, r)
    if r.random() < 0.3:
        c["scale"] = r.choice(EDGES)
    return c


def loss(r):
    n, v = r.choice([1, 2]), r.choice([1, 2, 3])
    c = {"op": "cross_entropy", "impl": r.choice(LOSS_IMPLS),
         "logits": [[r.choice(EDGES) for _ in range(v)] for _ in range(n)],
         "targets": [r.randrange(v) for _ in range(n)]}
    for k in ["label_smoothing", "z_loss", "softcap"]:
        if r.random() < 0.4:
            c[k] = r.choice(EDGES + [0.1, 0.5])
    if r.random() < 0.3:
        c["want_grad"] = True
        c["grad_output"] = [r.choice(EDGES)]
    return c


def decoder(r):
    v, h = 3, 2
    s = r.choice([1.0, 1e30, 1e154, 1e200, 1e300])
    c = {"op": "decoder_forward_backward", "vocab_size": v, "num_heads": 1,
         "head_dim": h, "intermediate_size": 2, "num_layers": 0,
         "norm": r.choice(["rms_norm", "layer_norm"]), "input_ids": [0, 1, 2],
         "model.embed_tokens.weight": [[s * r.uniform(-1, 1) for _ in range(h)] for _ in range(v)],
         "model.norm.weight": [1.0] * h,
         "lm_head.weight": [[r.uniform(-1, 1) for _ in range(h)] for _ in range(v)]}
    if r.random() < 0.3:
        c["norm_eps"] = r.choice(EDGES)
    return c


def long_segment(r):
    """One segment past the shared work bound (2^29): refused at once by
    every impl, where the optimized ones used to run for a minute."""
    n = r.choice([24000, 40000, 100000])
    t = [[[0.5]]] * n
    c = {"op": "attention", "impl": r.choice(IMPLS), "q": t, "k": t, "v": t,
         "cu_seqlens": [0, n]}
    if r.random() < 0.5:
        c["want_grad"], c["grad_output"] = True, t
    return c


def linear(r):
    n, v, h = r.choice([1, 2, 3]), r.choice([1, 2, 3]), r.choice([1, 2])
    if r.random() < 0.1:  # larger: the work and memory bounds
        n, v, h = r.choice([64, 256, 600]), r.choice([64, 256, 600]), r.choice([1, 8, 32])
        row = lambda: [r.choice([0, 1, -1, 0.5]) for _ in range(h)]
    else:
        row = lambda: [r.choice(EDGES) for _ in range(h)]
    c = {"op": "linear_cross_entropy", "impl": r.choice(LINEAR_IMPLS),
         "hidden": [row() for _ in range(n)], "weight": [row() for _ in range(v)],
         "targets": [r.randrange(v) for _ in range(n)]}
    if r.random() < 0.3:
        c["want_grad"] = True
    return c


def causal(r):
    k = r.randrange(6)
    n = r.choice([0, 1, 3])
    if k == 0:
        return {"op": "causal_conversions", "seq_idx": sorted(r.choice([0, 1, 5]) for _ in range(n)),
                "num_segments": r.choice(HUGE)}
    if k == 1:
        return {"op": "causal_conversions", "position_ids": [r.choice(HUGE) for _ in range(n)]}
    if k == 2:
        return {"op": "causal_conversions", "doc_ids": [r.choice(HUGE) for _ in range(n)]}
    if k == 3:
        c = {"op": "causal_conversions", "cu_seqlens": sorted(r.choice(HUGE[:6]) for _ in range(n + 1))}
        if r.random() < 0.5:
            c["first_offset"] = r.choice(HUGE)
        return c
    c = {"op": "causal_labels", "input_ids": [r.choice([0, 1, 2, 2**62]) for _ in range(n)]}
    if k == 4:
        c["doc_ids"] = [r.choice(HUGE[:3] + [2**62]) for _ in range(n)]
    else:
        c["cu_seqlens"] = [0] + sorted(r.choice(range(n + 1)) for _ in range(r.randrange(3))) + [n]
    for f in ["num_documents", "eos_token_id", "ignore_index"]:
        if r.random() < 0.3:
            c[f] = r.choice(HUGE + [-1, -100])
    return c


def plain_loss(r):
    """Plain cross-entropy (mean or sum) on edge logits: checked against the
    exact value (`exact_loss`)."""
    n, v = r.choice([1, 2, 3]), r.choice([1, 2, 3])
    big = [0.0, 1.0, -1.0, 1e300, -1e300, 1.5e308, -1.5e308, 1.7e308, -1.7e308, 1e-300]
    return {"op": "cross_entropy", "impl": "reference",
            "logits": [[r.choice(big) for _ in range(v)] for _ in range(n)],
            "targets": [r.randrange(v) for _ in range(n)],
            "reduction": r.choice(["mean", "sum"])}


def exact_losses(c):
    """The exact per-token losses of a `plain_loss` case, as Decimals."""
    out = []
    for row, t in zip(c["logits"], c["targets"]):
        z = [+Decimal(x) for x in row]
        m = max(z)
        out.append(m + sum((x - m).exp() for x in z).ln() - z[t])
    return out


def wrong_loss(c, out):
    """Why a `plain_loss` answer is wrong, or None. The documented rule
    (docs/HOSTILE.md): a loss beyond f64 answers +inf; so does a reduction
    over a token whose own loss is beyond f64 (its per-token value is inf)."""
    per = exact_losses(c)
    true = sum(per) / len(per) if c["reduction"] == "mean" else sum(per)
    got = out.get("loss")
    if abs(true) > F64_MAX or any(abs(p) > F64_MAX for p in per):
        return None if got == ("inf" if true > 0 else "-inf") else f"true {true:.6e} beyond f64, got {got}"
    if not isinstance(got, (int, float)):
        return f"true {true:.6e}, got {got}"
    if abs(Decimal(got) - true) > Decimal("1e-12") * abs(true) + Decimal("1e-300"):
        return f"true {true:.17e}, got {got!r}"
    return None


def nonfinite(x):
    if isinstance(x, dict):
        return any(nonfinite(v) for k, v in x.items() if k not in ("lse",))
    if isinstance(x, list):
        return any(nonfinite(v) for v in x)
    return x in ("nan", "inf", "-inf")


def main():
    binary, total = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3000
    r = random.Random(32)
    gens = [attention, loss, decoder, linear, causal, causal, plain_loss, plain_loss]
    counts = {"cases": 0, "ok": 0, "refused": 0, "panics": 0, "aborts": 0,
              "suspect_nonfinite": 0, "wrong_loss": 0, "slow_batches": 0,
              "slowest_batch_s": 0.0, "by_op": {}}
    suspects = []
    cmd = f"ulimit -v {4096 * 1024} && exec {binary} eval --jsonl -"
    env = {"PACKSHARD_MEMORY_BUDGET": "256MiB", "PATH": "/usr/bin:/bin"}
    for b in range(0, total, BATCH):
        cases = [r.choice(gens)(r) for _ in range(min(BATCH, total - b))]
        if b % (BATCH * 10) == 0:
            cases[0] = long_segment(r)
        text = "\n".join(json.dumps(c) for c in cases) + "\n"
        t = time.time()
        p = subprocess.run(["sh", "-c", cmd], input=text.encode(), capture_output=True, env=env)
        took = time.time() - t
        counts["slowest_batch_s"] = round(max(counts["slowest_batch_s"], took), 2)
        if took > 10:
            counts["slow_batches"] += 1
        err = p.stderr.decode(errors="replace")
        if "panicked" in err:
            counts["panics"] += 1
        lines = p.stdout.decode(errors="replace").splitlines()
        if len(lines) != len(cases) or p.returncode not in (0, 1, 2):
            counts["aborts"] += 1
        for c, line in zip(cases, lines):
            counts["cases"] += 1
            out = json.loads(line)
            op = counts["by_op"].setdefault(c["op"], {"ok": 0, "refused": 0})
            if "error" in out:
                counts["refused"] += 1
                op["refused"] += 1
            else:
                counts["ok"] += 1
                op["ok"] += 1
                if c["op"] == "cross_entropy" and "reduction" in c:
                    why = wrong_loss(c, out)
                    if why:
                        counts["wrong_loss"] += 1
                        suspects.append((c, why))
                # A zero-length problem has nothing to be non-finite; a plain
                # loss is judged exactly above.
                if "reduction" not in c and nonfinite({k: v for k, v in out.items() if k != "lse"}):
                    counts["suspect_nonfinite"] += 1
                    suspects.append((c, out))
    print(json.dumps(counts))
    for c, out in suspects[:int(sys.argv[3]) if len(sys.argv) > 3 else 5]:
        print("SUSPECT", json.dumps(c)[:400], "->", json.dumps(out)[:300])
    bad = counts["panics"] or counts["aborts"] or counts["wrong_loss"] or counts["slow_batches"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
