#!/usr/bin/env bash
# Fetches NVRTC (CUDA's run-time compiler) from the PyPI wheel
# nvidia-cuda-nvrtc-cu12 into .cache/nvrtc, for the PTX compile check of the
# GPU kernels (optimized/tests/cuda.rs) and for the GPU attention in the
# registry (`cuda` feature). Idempotent: does nothing when the
# library is already there. No GPU and no CUDA toolkit are needed.
#
# Prints the library folder on stdout (last line); use it as
#   export PACKSHARD_NVRTC_DIR=$(scripts/fetch_nvrtc.sh | tail -n 1)
#   export LD_LIBRARY_PATH=$PACKSHARD_NVRTC_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
#
# NVRTC_VERSION overrides the wheel version (12.9.86: PTX ISA 8.8, loads on
# drivers for CUDA >= 12.9, including the CUDA 13 driver of the GPU machine).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
version="${NVRTC_VERSION:-12.9.86}"
dest="$root/.cache/nvrtc"
lib="$dest/nvidia/cuda_nvrtc/lib"
if [[ -f "$lib/libnvrtc.so.12" ]] && ls "$lib"/libnvrtc-builtins.so.* >/dev/null 2>&1; then
  echo "$lib"
  exit 0
fi
mkdir -p "$dest/wheel"
python3 -m pip download --quiet --no-deps --only-binary=:all: \
  --platform manylinux2014_x86_64 --python-version 3 \
  -d "$dest/wheel" "nvidia-cuda-nvrtc-cu12==$version" >&2
wheel="$(ls "$dest"/wheel/nvidia_cuda_nvrtc_cu12-"$version"-*.whl | head -n 1)"
python3 - "$wheel" "$dest" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    for name in z.namelist():
        if name.startswith("nvidia/cuda_nvrtc/lib/") or name.startswith("nvidia/cuda_nvrtc/include/"):
            z.extract(name, sys.argv[2])
PY
rm -rf "$dest/wheel"
# The wheel ships libnvrtc.so.12 only; add the unversioned name as well.
ln -sf libnvrtc.so.12 "$lib/libnvrtc.so"
test -f "$lib/libnvrtc.so.12"
echo "$lib"
