#!/usr/bin/env bash
# The GPU check of issue #7, for a machine with an NVIDIA GPU and driver:
# the registry's attention and output-layer suites for `attention_varlen_cuda`
# and `linear_cross_entropy_cuda` (packed == padded, sharded == unsharded and
# the f32 relative rule against the f64 reference, the suites every kernel meets), the CUDA-specific tests (input errors, alg2 vs
# the reference) and the attention benchmark (tokens/s and TFLOP/s on
# wikipedia-512-drawn batches, packed vs padded).
#
# Usage (repo root):  scripts/gpu_check.sh
#   Builds the test binaries unless PACKSHARD_CUDA_TEST_BIN and
#   PACKSHARD_REGISTRY_TEST_BIN name prebuilt ones (build elsewhere with
#     cargo test -p packshard-optimized --features cuda --test cuda --no-run
#     cargo test -p packshard-oracle --features cuda --test registry --no-run
#   and carry the binaries), then runs them. NVRTC: the one on the loader path,
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
# The test binary `$2` of package `$1`, built with the cuda feature.
test_bin() {
  cargo test -p "$1" --features cuda --test "$2" --no-run --message-format=json 2>/dev/null \
    | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == sys.argv[1]:
        print(m["executable"])' "$2" | tail -n 1
}
bin="${PACKSHARD_CUDA_TEST_BIN:-$(test_bin packshard-optimized cuda)}"
registry="${PACKSHARD_REGISTRY_TEST_BIN:-$(test_bin packshard-oracle registry)}"
echo "test binaries: $bin $registry"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true

log="$(mktemp)"
# PACKSHARD_REQUIRE_GPU=1: the registry's tests fail where the device is missing.
# One test per (implementation, suite) named <family>::<impl>::<suite>: the
# filter (libtest-mimic takes one) selects the two GPU kernels' tests
# (`attention_varlen_cuda::`, `linear_cross_entropy_cuda::`: suites, golden,
# own numbers, fuzz budget), not their CPU emulator's (`..._cuda_emulated::`,
# the CI step's).
PACKSHARD_REQUIRE_GPU=1 "$registry" --test-threads=1 _cuda:: 2>&1 | tee "$log"
"$bin" --test-threads=1 --nocapture gpu_ 2>&1 | tee -a "$log"
if grep -qE "^(gpu_[a-z0-9_]*|attention_varlen_cuda|linear_cross_entropy_cuda): skipped: " "$log"; then
  echo "gpu_check: a GPU suite skipped (no device or no NVRTC): not a GPU check" >&2
  exit 1
fi
echo "== benchmark =="
"$bin" --ignored --exact gpu_attention_bench --nocapture --test-threads=1
