#!/usr/bin/env python3
"""One timed call of the public Python reference of Krell et al. (Graphcore's
tutorials/blogs_code/packedBERT: spfhp.py, lpfhp.py, nnlshp.py).

    bench_python_reference.py SRC_DIR ALGORITHM DATASET LIMIT [REPEATS]

Imports the reference from SRC_DIR (never vendored here: the script
bench_python_reference.sh extracts it into .cache/), times the algorithm call
alone with time.perf_counter (its own printing goes to /dev/null) — one
untimed call, then REPEATS (default 1) timed ones — and prints one JSON line
with their median: {"seconds": ..., "packs": ..., "strategies": ...}.
"""
import contextlib
import json
import os
import sys
import time

src, algorithm, dataset, limit = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
repeats = int(sys.argv[5]) if len(sys.argv) > 5 else 1
sys.path.insert(0, src)

import numpy as np  # noqa: E402

import histograms  # noqa: E402

if dataset == "wikipedia-512":
    histogram, msl = histograms.wikipedia_histogram, histograms.wikipedia_max_sequence_length
elif dataset == "squad-384":
    histogram, msl = histograms.squad_1_1_histogram, histograms.squad_1_1_max_sequence_length
else:
    sys.exit(f"unknown dataset {dataset}")
histogram = np.asarray(histogram)

if algorithm == "spfhp":
    from spfhp import pack_using_spfhp as pack
elif algorithm == "lpfhp":
    from lpfhp import pack_using_lpfhp as pack
elif algorithm == "nnlshp":
    from nnlshp import pack_using_nnlshp as pack
else:
    sys.exit(f"unknown algorithm {algorithm}")

times = []
with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
    pack(histogram, msl, limit)  # warm-up, untimed
    for _ in range(max(repeats, 1)):
        start = time.perf_counter()
        strategies, counts = pack(histogram, msl, limit)
        times.append(time.perf_counter() - start)
seconds = sorted(times)[len(times) // 2]
print(json.dumps({
    "seconds": seconds,
    "packs": int(np.asarray(counts).sum()),
    "strategies": int(np.count_nonzero(np.asarray(counts))),
}))
