"""packshard's f32 varlen attention against PyTorch's CPU scaled_dot_product_attention.

    python scripts/bench_torch.py [--docs 64,16] [--threads 2] [--reps 5] [--seed 0] [--settle 0.25]

Run by scripts/bench_torch.sh (which makes the venv and builds the package in
release mode); not part of CI. One process, one run: for each size (documents
drawn from the wikipedia-512 length histogram, /work/shared/data or
PACKSHARD_DATA), q, k, v, grad_output [n_tok, 12, 64] float32 standard normal,
and each of forward / forward+backward, plain / causal:

- torch: torch.nn.functional.scaled_dot_product_attention called once per
  document on [1, h, len, d] views of the packed tensors (is_causal for causal;
  the backward through out.backward(grad_output of the document) on leaf
  tensors per document), what a CPU user without a varlen kernel writes;
- package: packshard.attention(..., impl="attention_varlen_tiled") on the
  float32 arrays (read in place, float32 results), from Python;
- kernel: the same kernel timed inside Rust (packshard._native.time_attention_f32:
  no Python between calls, the input checks included).

The three are checked against each other first (max |difference| of the
outputs printed; over 1e-4 stops the run), then timed interleaved (torch,
package, kernel, torch, ...) after one warm-up each, so that load from other
processes hits all alike, each after --settle seconds idle (default 0.25):
after a call both libraries' worker threads spin before they sleep
(libgomp's, which torch's CPU wheel uses, and rayon's), and back to back
they take a core from the next side's timed call (issue 37, 2 cores: our
plain forward measured 0.171 s right after torch's, 0.129 s with torch's
threads passive). The table prints medians of --reps and the ratios
torch / package and torch / kernel (over 1: packshard is faster).
"""

import argparse
import csv
import os
import statistics
import sys
import time

# numpy's OpenBLAS starts a worker thread per core at import, and they spin
# between calls: nothing here calls BLAS through numpy, so keep them off the
# two cores both sides are timed on (set before numpy is imported).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402


def lengths_from_histogram(path, docs, seed):
    """``docs`` document lengths drawn with replacement from the histogram at ``path``."""
    with open(path) as f:
        rows = [(int(r["length"]), int(r["count"])) for r in csv.DictReader(f)]
    lens = np.array([l for l, _ in rows])
    p = np.array([c for _, c in rows], dtype=np.float64)
    rng = np.random.default_rng(seed)
    return rng.choice(lens, size=docs, p=p / p.sum())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", default="64,16", help="documents per size, comma-separated")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--settle", type=float, default=0.25,
                    help="seconds idle before each timed call (0: back to back)")
    data = os.environ.get("PACKSHARD_DATA", "/work/shared/data")
    ap.add_argument("--histogram", default=os.path.join(data, "wikipedia_512_histogram.csv"))
    a = ap.parse_args()
    # Both sides on the same number of threads: rayon reads this at its first use.
    os.environ["RAYON_NUM_THREADS"] = str(a.threads)
    import torch
    import torch.nn.functional as F

    import packshard
    from packshard import _native

    torch.set_num_threads(a.threads)
    print(f"torch {torch.__version__}, packshard {packshard.__version__}, "
          f"{a.threads} threads, reps {a.reps}, medians in seconds")
    header = (f"{'docs':>5} {'tokens':>7} {'pass':>8} {'mask':>7} {'torch':>9} {'package':>9} "
              f"{'kernel':>9} {'torch/package':>14} {'torch/kernel':>13}")
    print(header, flush=True)
    table = []
    for docs in [int(x) for x in a.docs.split(",")]:
        lens = lengths_from_histogram(a.histogram, docs, a.seed)
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        n, h, d = int(cu[-1]), a.heads, a.head_dim
        rng = np.random.default_rng(a.seed + 1)
        q, k, v, go = (rng.standard_normal((n, h, d), dtype=np.float32) for _ in range(4))
        tq, tk, tv, tgo = (torch.from_numpy(x) for x in (q, k, v, go))
        spans = list(zip(cu[:-1].tolist(), cu[1:].tolist()))

        def doc(t, s, e):
            return t[s:e].permute(1, 0, 2).unsqueeze(0)  # [1, h, len, d], a view

        for causal in (False, True):
            def torch_fwd():
                with torch.no_grad():
                    return [F.scaled_dot_product_attention(doc(tq, s, e), doc(tk, s, e),
                                                           doc(tv, s, e), is_causal=causal)
                            for s, e in spans]

            def torch_fwd_bwd():
                outs = []
                for s, e in spans:
                    x = [doc(t, s, e).detach().requires_grad_() for t in (tq, tk, tv)]
                    o = F.scaled_dot_product_attention(*x, is_causal=causal)
                    o.backward(doc(tgo, s, e))
                    outs.append(o.detach())
                return outs

            def package(grad):
                return packshard.attention(q, k, v, cu, causal=causal,
                                           grad_output=go if grad else None,
                                           impl="attention_varlen_tiled")

            # Agreement first: torch's per-document outputs against ours.
            ours = package(False)["output"]
            assert ours.dtype == np.float32, ours.dtype
            theirs = np.concatenate([o[0].permute(1, 0, 2).numpy() for o in torch_fwd()])
            diff = float(np.abs(theirs - ours).max())
            if diff > 1e-4:
                print(f"torch and packshard differ by {diff:.2e} (docs {docs}, causal {causal})")
                return 1
            for name, grad, tfn in (("forward", False, torch_fwd), ("fwd+bwd", True, torch_fwd_bwd)):
                kernel_go = go if grad else None
                tfn(), package(grad), _native.time_attention_f32(q, k, v, cu, causal, kernel_go, 1)
                tt, tp, tk_ = [], [], []
                for _ in range(a.reps):
                    time.sleep(a.settle)
                    t = time.perf_counter()
                    tfn()
                    tt.append(time.perf_counter() - t)
                    time.sleep(a.settle)
                    t = time.perf_counter()
                    package(grad)
                    tp.append(time.perf_counter() - t)
                    time.sleep(a.settle)
                    tk_ += _native.time_attention_f32(q, k, v, cu, causal, kernel_go, 1)
                mt, mp, mk = (statistics.median(x) for x in (tt, tp, tk_))
                row = (f"{docs:>5} {n:>7} {name:>8} {'causal' if causal else 'plain':>7} "
                       f"{mt:>9.4f} {mp:>9.4f} {mk:>9.4f} {mt / mp:>13.2f}x {mt / mk:>12.2f}x")
                table.append(row)
                note = f"  (max |torch - ours| {diff:.1e})" if name == "forward" else ""
                print(row + note, flush=True)
    print("\n" + header)
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
