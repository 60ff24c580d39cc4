#!/usr/bin/env bash
# Side-by-side: packshard's SPFHP, LPFHP and NNLSHP against the public Python
# reference of Krell et al. (graphcore/examples, tutorials/blogs_code/packedBERT,
# numpy + scipy), on the embedded Wikipedia and SQuAD histograms.
#
#   scripts/bench_python_reference.sh            # RUNS=7 (NNLSHP: NNLS_RUNS=3)
#
# Method (docs/PACKING.md): the two run interleaved (Python, Rust, Python,
# Rust, ...), each run a fresh process timing the algorithm call alone
# (Python: time.perf_counter around pack_using_*; Rust: the `seconds` that
# `packshard pack --json --no-bound` reports, measured around the algorithm),
# and the medians are compared. Both must give the same pack count for SPFHP
# and LPFHP (they follow the same steps); NNLSHP's counts are printed.
#
# The reference is never committed: it is extracted from a git mirror of
# graphcore/examples (PYREF_GIT_DIR, default /work/.mirror/graphcore+examples/repo,
# or cloned) into .cache/pyref-src, and run from a venv in .cache/pyref
# (numpy, scipy from PyPI).
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-7}
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
cargo build --release --bin packshard -q
BIN=target/release/packshard
PY="$VENV/bin/python"

median() { sort -g | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }
field() { "$PY" -c "import json,sys; d=json.load(sys.stdin); print(eval(sys.argv[1]))" "$1"; }

echo "$(cat "$SRC/SOURCE"); $("$PY" -c 'import numpy, scipy; print(f"numpy {numpy.__version__}, scipy {scipy.__version__}")')"
printf '%-14s %-7s %5s %12s %12s %10s %10s %9s\n' dataset algorithm limit "python (s)" "rust (s)" "py packs" "rs packs" speed-up
for dataset in wikipedia-512 squad-384; do
    for spec in spfhp:12 lpfhp:12 nnlshp:3; do
        algorithm=${spec%%:*}; limit=${spec##*:}
        runs=$RUNS; [ "$algorithm" = nnlshp ] && runs=$NNLS_RUNS
        py_times=(); rs_times=()
        for _ in $(seq "$runs"); do
            py=$("$PY" scripts/bench_python_reference.py "$SRC" "$algorithm" "$dataset" "$limit")
            rs=$("$BIN" pack --dataset "$dataset" -a "$algorithm" --max-sequences-per-pack "$limit" --json --no-bound)
            py_times+=("$(echo "$py" | field 'd["seconds"]')")
            rs_times+=("$(echo "$rs" | field 'd["results"][0]["metrics"]["seconds"]')")
            py_packs=$(echo "$py" | field 'd["packs"]')
            rs_packs=$(echo "$rs" | field 'd["results"][0]["metrics"]["num_packs"]')
        done
        if [ "$algorithm" != nnlshp ] && [ "$py_packs" != "$rs_packs" ]; then
            echo "$dataset $algorithm: python $py_packs packs, rust $rs_packs: not the same algorithm" >&2
            exit 1
        fi
        py_med=$(printf '%s\n' "${py_times[@]}" | median)
        rs_med=$(printf '%s\n' "${rs_times[@]}" | median)
        printf '%-14s %-7s %5s %12.6f %12.6f %10s %10s %8.0fx\n' "$dataset" "$algorithm" "$limit" \
            "$py_med" "$rs_med" "$py_packs" "$rs_packs" "$(echo "$py_med / $rs_med" | bc -l)"
    done
done
