#!/usr/bin/env bash
# packshard's f32 varlen attention against PyTorch's CPU scaled_dot_product_attention
# called once per document: forward and forward + backward, plain and causal,
# 2 threads, 64 and 16 documents drawn from wikipedia-512 (scripts/bench_torch.py
# says what is timed and how). Not part of CI.
#
#   scripts/bench_torch.sh                 # then THREADS=2 REPS=5 DOCS=64,16
#
# Makes its own venv (TORCH_VENV, default /work/venvs/torch: torch and numpy from
# PyPI, --no-cache-dir; about 5 GB with torch's CUDA libraries) and builds the
# package into it with `maturin develop --release` (CARGO_TARGET_DIR as set).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${TORCH_VENV:-/work/venvs/torch}
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import torch, numpy" 2>/dev/null; then
    "$VENV/bin/pip" install --no-cache-dir torch numpy
fi
if ! "$VENV/bin/python" -c "import maturin" 2>/dev/null && [ ! -x "$VENV/bin/maturin" ]; then
    "$VENV/bin/pip" install --no-cache-dir "$(grep '^maturin' python/requirements-dev.txt)"
fi
(cd python && VIRTUAL_ENV="$VENV" PATH="$VENV/bin:$PATH" "$VENV/bin/maturin" develop --release)
exec "$VENV/bin/python" scripts/bench_torch.py --threads "${THREADS:-2}" --reps "${REPS:-5}" \
    --docs "${DOCS:-64,16}" "$@"
