"""Each kernel (correct and buggy) through its op's DEFAULT check, one at a time."""
import time, json, sys, warnings
warnings.filterwarnings("ignore")
from packshard import testing
from attn import make
from ce import make_ce, make_lce
import hand  # noqa: just for the bug lists (runs hand cases; cheap)
fams = [("attention", testing.check_attention, make, [None] + list(hand.A)),
        ("cross_entropy", testing.check_cross_entropy, make_ce, [None] + list(hand.C)),
        ("linear_cross_entropy", testing.check_linear_cross_entropy, make_lce, [None] + list(hand.L))]
only = sys.argv[1:]
res = {}
for fam, chk, mk, bugs in fams:
    for bug in bugs:
        key = f"{fam}/{bug or 'correct'}"
        if only and key not in only: continue
        t = time.time()
        try:
            r = chk(mk(bug))
            outcome, msg = "passed (escaped)" if bug else "passed", repr(r).splitlines()[0]
        except AssertionError as e:
            lines = str(e).splitlines()
            outcome, msg = "caught" if bug else "FAILED", " | ".join(l.strip() for l in lines[:3])
        dt = time.time() - t
        res[key] = dict(outcome=outcome, seconds=round(dt, 2), message=msg)
        print(f"{key:60s} {outcome:18s} {dt:6.2f}s  {msg[:400]}", flush=True)
json.dump(res, open("check_results.json" if not only else "check_results_partial.json", "w"), indent=1)
