"""Times each default ``check_*`` call of packshard.testing on a correct numpy
kernel (the zoo's correct twins, python/examples/zoo): seconds per call,
cases compared, and the largest segment / vocabulary the cases reached.

    python python/examples/time_checks.py
"""

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from packshard import testing  # noqa: E402
from zoo import attention, cross_entropy  # noqa: E402

CHECKS = [
    ("check_attention", testing.check_attention, attention.kernel(None), {}),
    ("check_attention causal", testing.check_attention, attention.kernel(None), {"causal": True}),
    ("check_cross_entropy", testing.check_cross_entropy, cross_entropy.kernel(None), {}),
    ("check_linear_cross_entropy", testing.check_linear_cross_entropy,
     cross_entropy.linear_cross_entropy, {}),
    ("check_embedding", testing.check_embedding, cross_entropy.embedding, {}),
]


def reach(op):
    """The largest segment (attention) or vocabulary (losses) of the default cases."""
    cs = testing.cases(op, 100, 0)
    if op == "attention":
        cu = [np.asarray(a.get("cu_seqlens", a.get("cu_seqlens_q"))) for a, *_ in cs]
        return f"longest segment {max(int(np.diff(c).max(initial=0)) for c in cu)}"
    key = "logits" if op == "cross_entropy" else "weight"
    return f"largest vocabulary {max(int(a.get('vocab_size') or a[key].shape[-2 if key == 'weight' else 1]) for a, *_ in cs)}"


def main():
    for name, check, fn, kw in CHECKS:
        t = time.perf_counter()
        r = check(fn, **kw)
        dt = time.perf_counter() - t
        print(f"{name:28s} {dt:6.2f} s  {r.compared:3d} cases compared, {r.values:9d} values, "
              f"worst {100 * r.worst:5.1f}% of the allowed error; {reach(r.op)}")


if __name__ == "__main__":
    main()
