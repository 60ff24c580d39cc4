#!/usr/bin/env bash
# Side-by-side: packshard's SPFHP, LPFHP and NNLSHP against the public Python
# reference of Krell et al. (graphcore/examples, tutorials/blogs_code/packedBERT,
# numpy + scipy), on the embedded Wikipedia and SQuAD histograms.
#
#   scripts/bench_python_reference.sh    # RUNS=5 x REPEATS=21 (NNLSHP: NNLS_RUNS=3 x 1)
#
# Method (docs/PACKING.md): both sides warm and in process. Each run is a
# fresh process per side (Python, Rust, Python, Rust, ... interleaved) that
# makes one untimed call, then REPEATS timed calls of the algorithm alone
# (Python: time.perf_counter around pack_using_*; Rust: Instant around
# `pack_histogram`, reference/examples/time_packing.rs) and reports their
# median; the medians of the runs are compared. Both must give the same pack
# count for SPFHP and LPFHP (they follow the same steps); NNLSHP's counts are
# printed.
#
# The reference is never committed: it is extracted from a git mirror of
# graphcore/examples (PYREF_GIT_DIR, default /work/.mirror/graphcore+examples/repo,
# or cloned) into .cache/pyref-src, and run from a venv in .cache/pyref
# (numpy, scipy from PyPI).
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-5}
REPEATS=${REPEATS:-21}
NNLS_RUNS=${NNLS_RUNS:-3}
COMMIT=2d8b565326ef6ba730492ad8badd984b067645bc
SRC=.cache/pyref-src
VENV=.cache/pyref
GIT_DIR=${PYREF_GIT_DIR:-/work/.mirror/graphcore+examples/repo}

if [ ! -f "$SRC/spfhp.py" ]; then
    mkdir -p "$SRC"
    if [ ! -d "$GIT_DIR" ]; then
        git clone --bare --filter=blob:none https://github.com/graphcore/examples .cache/graphcore-examples.git
        GIT_DIR=.cache/graphcore-examples.git
    fi
    rev=$(git --git-dir="$GIT_DIR" rev-parse --verify -q "$COMMIT^{commit}" || git --git-dir="$GIT_DIR" rev-parse HEAD)
    for f in spfhp lpfhp nnlshp histograms; do
        git --git-dir="$GIT_DIR" show "$rev:tutorials/blogs_code/packedBERT/$f.py" > "$SRC/$f.py"
    done
    echo "reference: graphcore/examples@$rev" > "$SRC/SOURCE"
fi
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q numpy scipy
fi
cargo build --release -q -p packshard-reference --example time_packing
BIN=${CARGO_TARGET_DIR:-target}/release/examples/time_packing
PY="$VENV/bin/python"

median() { sort -g | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }
field() { "$PY" -c "import json,sys; d=json.load(sys.stdin); print(eval(sys.argv[1]))" "$1"; }

echo "$(cat "$SRC/SOURCE"); $("$PY" -c 'import numpy, scipy; print(f"numpy {numpy.__version__}, scipy {scipy.__version__}")')"
printf '%-14s %-7s %5s %12s %12s %10s %10s %9s\n' dataset algorithm limit "python (s)" "rust (s)" "py packs" "rs packs" speed-up
for dataset in wikipedia-512 squad-384; do
    for spec in spfhp:12 lpfhp:12 nnlshp:3; do
        algorithm=${spec%%:*}; limit=${spec##*:}
        runs=$RUNS; repeats=$REPEATS
        [ "$algorithm" = nnlshp ] && { runs=$NNLS_RUNS; repeats=1; }
        py_times=(); rs_times=()
        for _ in $(seq "$runs"); do
            py=$("$PY" -W ignore scripts/bench_python_reference.py "$SRC" "$algorithm" "$dataset" "$limit" "$repeats")
            rs=$("$BIN" "$dataset" "$algorithm" "$limit" "$repeats")
            py_times+=("$(echo "$py" | field 'd["seconds"]')")
            rs_times+=("$(echo "$rs" | field 'd["seconds"]')")
            py_packs=$(echo "$py" | field 'd["packs"]')
            rs_packs=$(echo "$rs" | field 'd["packs"]')
        done
        if [ "$algorithm" != nnlshp ] && [ "$py_packs" != "$rs_packs" ]; then
            echo "$dataset $algorithm: python $py_packs packs, rust $rs_packs: not the same algorithm" >&2
            exit 1
        fi
        py_med=$(printf '%s\n' "${py_times[@]}" | median)
        rs_med=$(printf '%s\n' "${rs_times[@]}" | median)
        printf '%-14s %-7s %5s %12.6f %12.6f %10s %10s %8.0fx\n' "$dataset" "$algorithm" "$limit" \
            "$py_med" "$rs_med" "$py_packs" "$rs_packs" "$("$PY" -c "import sys; print(float(sys.argv[1]) / float(sys.argv[2]))" "$py_med" "$rs_med")"
    done
done
