"""Cost of a call through the package against the Rust kernel's own time.

    python bench_attention.py [--impl attention_varlen_tiled] [--reps 7] [--check]

Varlen attention forward + backward on q, k, v, grad_output [2048, 4, 64]
(five documents of uneven length). "kernel" is the registered kernel's
forward + backward timed inside Rust (packshard._native.time_attention: no
Python, no conversion); "package" is packshard.attention(..., grad_output=...)
from Python (argument handling, views of the numpy inputs, the same kernel,
results moved into numpy). Medians of --reps runs of each, interleaved, after
one warm-up. With
--check, exits 1 when the package costs 2x the kernel or more.
"""

import argparse
import statistics
import sys
import time

import numpy as np

import packshard
from packshard import _native


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", default="attention_varlen_tiled")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    n, h, d = 2048, 4, 64
    q, k, v, go = (rng.standard_normal((n, h, d)) for _ in range(4))
    cu = np.cumsum([0, 317, 512, 89, 700, 430], dtype=np.int64)
    assert cu[-1] == n
    # Check before timing, on the first document (the f64 reference on all
    # 2048 tokens is slow in a dev build): the kernel agrees with it there.
    m = int(cu[1])
    one = [x[:m] for x in (q, k, v, go)]
    r = packshard.attention(*one[:3], [0, m], grad_output=one[3], impl=a.impl)
    ref = packshard.attention(*one[:3], [0, m], grad_output=one[3])
    err = float(np.abs(r["output"] - ref["output"]).max())
    assert err < 1e-4, err
    _native.time_attention(q, k, v, cu, go, a.impl, 1)  # warm-up
    # Interleaved, so that load from elsewhere on a shared machine hits both alike.
    ktimes, times = [], []
    for _ in range(a.reps):
        ktimes += _native.time_attention(q, k, v, cu, go, a.impl, 1)
        t = time.perf_counter()
        packshard.attention(q, k, v, cu, grad_output=go, impl=a.impl)
        times.append(time.perf_counter() - t)
    kernel, package = statistics.median(ktimes), statistics.median(times)
    tokens = n / package
    print(f"attention [{n}, {h}, {d}] fwd+bwd, {a.impl}: kernel {kernel * 1e3:.1f} ms, "
          f"package {package * 1e3:.1f} ms ({package / kernel:.2f}x the kernel; "
          f"{tokens:,.0f} tokens/s); max |output - reference| {err:.1e}")
    if a.check and package >= 2 * kernel:
        print("the package costs 2x the kernel or more")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
