#!/usr/bin/env bash
# The GPU check of issue #7, for a machine with an NVIDIA GPU and driver:
# the GPU equivalence suites (attention packed == padded and vs the f64
# reference, alg2 vs the reference) and the attention benchmark (tokens/s
# and TFLOP/s on wikipedia-512-drawn batches, packed vs padded).
#
# Usage (repo root):  scripts/gpu_check.sh
#   Builds the test binary unless PACKSHARD_CUDA_TEST_BIN names a prebuilt
#   one (build elsewhere with
#     cargo test -p packshard-optimized --features cuda --test cuda --no-run
#   and carry the binary), then runs it. NVRTC: the one on the loader path,
#   else the one scripts/fetch_nvrtc.sh fetched into .cache/nvrtc (12.9,
#   which loads on CUDA >= 12.9 drivers, including CUDA 13).
# Fails when the GPU suites skip: this script is only meaningful with a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${PACKSHARD_NVRTC_DIR:-}" && -d .cache/nvrtc/nvidia/cuda_nvrtc/lib ]]; then
  export PACKSHARD_NVRTC_DIR="$PWD/.cache/nvrtc/nvidia/cuda_nvrtc/lib"
fi
if [[ -n "${PACKSHARD_NVRTC_DIR:-}" ]]; then
  export LD_LIBRARY_PATH="$PACKSHARD_NVRTC_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
bin="${PACKSHARD_CUDA_TEST_BIN:-}"
if [[ -z "$bin" ]]; then
  bin="$(cargo test -p packshard-optimized --features cuda --test cuda --no-run \
    --message-format=json 2>/dev/null \
    | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "cuda":
        print(m["executable"])' | tail -n 1)"
fi
echo "test binary: $bin"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true

log="$(mktemp)"
"$bin" --test-threads=1 --nocapture gpu_ 2>&1 | tee "$log"
if grep -q "skipped: " "$log"; then
  echo "gpu_check: a GPU suite skipped (no device or no NVRTC): not a GPU check" >&2
  exit 1
fi
echo "== benchmark =="
"$bin" --ignored --exact gpu_attention_bench --nocapture --test-threads=1
