"""``python -m zoo`` (from python/examples): every zoo kernel through its op's
default check; prints caught / ESCAPED per kernel and the correct twins'
results, with the time of each call. Exit status 1 when a bug escapes or a
correct kernel fails."""

import sys
import time

from packshard import testing

from . import CORRECT, ZOO

CHECK = {"attention": testing.check_attention, "cross_entropy": testing.check_cross_entropy}


def main():
    bad = 0
    for op, fn in CORRECT.items():
        t = time.perf_counter()
        try:
            r = CHECK[op](fn)
            verdict = f"passes ({r.compared} cases, worst {100 * r.worst:.0f}% of the allowed error)"
        except AssertionError as e:
            verdict, bad = f"FAILS: {str(e).splitlines()[0]}", bad + 1
        print(f"{fn.__name__:40s} {verdict} [{time.perf_counter() - t:.1f} s]")
    for name, (op, fn, what) in ZOO.items():
        t = time.perf_counter()
        try:
            CHECK[op](fn)
            verdict, bad = "ESCAPED", bad + 1
        except AssertionError:
            verdict = "caught"
        print(f"{name:40s} {verdict:8s} {what} [{time.perf_counter() - t:.1f} s]")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
