#!/usr/bin/env bash
# The GPU check (issues #7 and #38), for a machine with an NVIDIA GPU and driver:
# every registered CUDA entry (`attention_varlen_cuda`,
# `linear_cross_entropy_cuda`) through the suites every kernel meets (packed
# == padded, sharded == unsharded, the f32 relative rule against the f64
# reference), the default fuzz budget of the checker (large cases, GQA, cross
# and causal narrowed to what the kernel declares), the golden set of its
# precision, the CUDA-specific tests (input errors, alg2 vs the reference),
# then the benchmarks: packshard's kernels and, where python3 has PyTorch,
# PyTorch on the same device at the same sizes (scripts/gpu_torch_bench.py).
#
# Usage (repo root):  scripts/gpu_check.sh [OUT_DIR]
#   Builds the test binaries unless PACKSHARD_GPU_BIN_DIR names a folder
#   holding prebuilt ones named cuda, cuda_bench and registry (build them elsewhere with
#     cargo test -p packshard-optimized --features cuda --test cuda --test cuda_bench --no-run
#     cargo test -p packshard-oracle --features cuda --test registry --no-run
#   and carry them: a GPU machine need not have Rust). NVRTC: PACKSHARD_NVRTC_DIR,
#   else the one scripts/fetch_nvrtc.sh fetched into .cache/nvrtc (12.9,
#   which loads on CUDA >= 12.9 drivers, including CUDA 13).
#   OUT_DIR (default: a temporary folder) receives the logs and the lengths
#   both benchmarks share.
# Fails when a GPU suite skips: this script is only meaningful with a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-$(mktemp -d)}"
mkdir -p "$out"
if [[ -z "${PACKSHARD_NVRTC_DIR:-}" && -d .cache/nvrtc/nvidia/cuda_nvrtc/lib ]]; then
  export PACKSHARD_NVRTC_DIR="$PWD/.cache/nvrtc/nvidia/cuda_nvrtc/lib"
fi
if [[ -n "${PACKSHARD_NVRTC_DIR:-}" ]]; then
  export LD_LIBRARY_PATH="$PACKSHARD_NVRTC_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
# The test binary `$2` of package `$1`: prebuilt, or built with the cuda feature.
test_bin() {
  if [[ -n "${PACKSHARD_GPU_BIN_DIR:-}" ]]; then
    echo "$PACKSHARD_GPU_BIN_DIR/$2"
    return
  fi
  cargo test -p "$1" --features cuda --test "$2" --no-run --message-format=json 2>/dev/null \
    | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == sys.argv[1]:
        print(m["executable"])' "$2" | tail -n 1
}
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true

log="$out/gpu_check.log"
: >"$log"
step() { printf '\n== %s ==\n' "$*" | tee -a "$log"; }
# Every step runs even after one fails (a device lease is short: one run
# should show everything); the script fails at the end if any did.
failed=()
run() {
  local name="$1"
  shift
  "$@" 2>&1 | tee -a "$log" || failed+=("$name")
}
# PACKSHARD_REQUIRE_GPU=1: the registry suites fail where the device is missing.
export PACKSHARD_REQUIRE_GPU=1
# The registry binary has a test per (implementation, suite):
# `<family>::<impl>::<suite>`; `_cuda::` selects every test of the two device
# entries (suites, golden set, default fuzz budgets, own numbers) and none of
# their `_emulated` twins.
step "registry: every test of the CUDA entries"
run "registry" "$(test_bin packshard-oracle registry)" --test-threads=1 _cuda::
bin="$(test_bin packshard-optimized cuda)"
bench="$(test_bin packshard-optimized cuda_bench)"
step "CUDA-specific tests"
run "CUDA-specific tests" "$bin" --test-threads=1 --nocapture gpu_
if grep -E "skipped: " "$log" | grep -v "_emulated" | grep -qE "(gpu_|_cuda)"; then
  echo "gpu_check: a GPU suite skipped (no device or no NVRTC): not a GPU check" >&2
  exit 1
fi
step "benchmark: packshard"
PACKSHARD_GPU_BENCH_OUT="$out" "$bench" --ignored --exact gpu_attention_bench gpu_output_layer_bench \
  --nocapture --test-threads=1 2>&1 | tee "$out/bench_packshard.txt" || failed+=("benchmark")
if python3 -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
  step "benchmark: PyTorch on the same device"
  python3 scripts/gpu_torch_bench.py "$out" 2>&1 | tee "$out/bench_torch.txt" || failed+=("PyTorch benchmark")
else
  echo "no PyTorch with CUDA in python3: the PyTorch side is not measured"
fi
if ((${#failed[@]})); then
  printf 'gpu_check: FAILED: %s\n' "${failed[@]}" >&2
  exit 1
fi
echo "gpu_check: every step passed"
