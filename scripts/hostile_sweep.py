#!/usr/bin/env python3
"""Hostile sweep of issue #32's surfaces through `packshard eval --jsonl`:
edge values (0, +-1e-300, +-1e30, +-1e154, +-1e300, +-1.7e308, f32's
limits) in the attention, loss and decoder options and tensors, under a
small budget and an address-space cap. Counts panics, aborts (a batch
whose output lines are missing), results over 10 s, and non-finite
numbers in results that succeeded (a suspect silent wrong answer: every
input here is finite, and the true outputs are finite).

    python3 scripts/hostile_sweep.py target/debug/packshard [N]
"""
import json, random, subprocess, sys, time

EDGES = [0.0, 1e-300, -1e-300, 1.0, -1.0, 1e30, -1e30, 1e154, -1e154, 1e300,
         -1e300, 1.7e308, -1.7e308, 3.4e38, 3.5e38, 1e-50, 2.5, 1e10]
IMPLS = ["reference", "attention_varlen_tiled", "attention_varlen_scalar",
         "attention_dense_masked"]
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


def nonfinite(x):
    if isinstance(x, dict):
        return any(nonfinite(v) for k, v in x.items() if k not in ("lse",))
    if isinstance(x, list):
        return any(nonfinite(v) for v in x)
    return x in ("nan", "inf", "-inf")


def main():
    binary, total = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3000
    r = random.Random(32)
    gens = [attention, loss, decoder]
    counts = {"cases": 0, "ok": 0, "refused": 0, "panics": 0, "aborts": 0,
              "suspect_nonfinite": 0, "slow_batches": 0}
    suspects = []
    cmd = f"ulimit -v {4096 * 1024} && exec {binary} eval --jsonl -"
    env = {"PACKSHARD_MEMORY_BUDGET": "256MiB", "PATH": "/usr/bin:/bin"}
    for b in range(0, total, BATCH):
        cases = [r.choice(gens)(r) for _ in range(min(BATCH, total - b))]
        text = "\n".join(json.dumps(c) for c in cases) + "\n"
        t = time.time()
        p = subprocess.run(["sh", "-c", cmd], input=text.encode(), capture_output=True, env=env)
        if time.time() - t > 10:
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
            if "error" in out:
                counts["refused"] += 1
            else:
                counts["ok"] += 1
                # A zero-length problem has nothing to be non-finite.
                if nonfinite({k: v for k, v in out.items() if k != "lse"}):
                    counts["suspect_nonfinite"] += 1
                    suspects.append((c, out))
    print(json.dumps(counts))
    for c, out in suspects[:int(sys.argv[3]) if len(sys.argv) > 3 else 5]:
        print("SUSPECT", json.dumps(c)[:400], "->", json.dumps(out)[:300])
    return 1 if counts["panics"] or counts["aborts"] else 0


if __name__ == "__main__":
    sys.exit(main())
