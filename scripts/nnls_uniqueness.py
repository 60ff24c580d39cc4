#!/usr/bin/env python3
"""Why NNLSHP's pack count on SQuAD differs between solvers (docs/PACKING.md).

    nnls_uniqueness.py SRC_DIR [PERMUTATIONS]

Builds the public reference's NNLSHP problem for SQuAD 1.1 at depth 3 (its own
get_packing_strategies / get_packing_matrix from SRC_DIR, the same weights),
solves it with scipy.optimize.nnls as given and with the strategy columns
permuted, and prints for each solve the residual norm (the NNLS objective, the
same for every optimum), the rank of the columns in use, and the packs the
reference's rounding makes of it. Different optimal x, same objective,
different rounded pack counts: the NNLS optimum is not unique.
"""
import json
import sys

import numpy as np
from scipy import optimize

sys.path.insert(0, sys.argv[1])
permutations = int(sys.argv[2]) if len(sys.argv) > 2 else 2

import histograms  # noqa: E402
from nnlshp import get_packing_matrix, get_packing_strategies  # noqa: E402

h = np.asarray(histograms.squad_1_1_histogram)
msl = histograms.squad_1_1_max_sequence_length
strategies = get_packing_strategies(0, 1, msl, 3)
A = get_packing_matrix(strategies, msl).astype(np.float64)
w = np.ones(msl)
w[:8] = 0.09


def packs(x):
    """The reference's rounding and residual handling, as pack_using_nnlshp does it."""
    r = np.rint(x).astype(np.int64)
    residual = h - A.astype(np.int64) @ r
    return int(r.sum() + residual[residual > 0].sum())


rng = np.random.default_rng(0)
for k in range(permutations + 1):
    order = np.arange(A.shape[1]) if k == 0 else rng.permutation(A.shape[1])
    x_perm, rnorm = optimize.nnls(w[:, None] * A[:, order], w * h)
    x = np.zeros(A.shape[1])
    x[order] = x_perm
    used = x > 0
    print(json.dumps({
        "columns": "as given" if k == 0 else f"permutation {k}",
        "rnorm": rnorm,
        "columns_used": int(used.sum()),
        "rank_of_used": int(np.linalg.matrix_rank(A[:, used])),
        "fractional_packs": float(x.sum()),
        "rounded_packs": packs(x),
    }), flush=True)
