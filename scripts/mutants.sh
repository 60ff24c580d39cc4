#!/usr/bin/env bash
# Mutation testing with cargo-mutants: how many planted bugs do the suites catch?
# Not part of CI (it builds and tests every mutant: about an hour on 2 cores per plan).
#
#   scripts/mutants.sh                    # the default plan: a sample of each crate
#   PLAN=guards scripts/mutants.sh        # only the guard-rail functions (42 mutants)
#   PLAN=compare scripts/mutants.sh       # all of equivalence/src/compare.rs (162 mutants, about 10 min)
#   PLAN=builders scripts/mutants.sh      # the fuzz cases' size builders (schedule.rs, vocab/large.rs)
#   K=3 scripts/mutants.sh                # another slice of the sample (rotate K = 1, 2, ...)
#   ONLY=reference scripts/mutants.sh     # one crate's run of the plan (reference, equivalence, optimized)
#   PLAN=full scripts/mutants.sh          # every mutant of every crate (many hours)
#   IN_PLACE=1 scripts/mutants.sh         # mutate this checkout and build in its (warm) target
#                                         # dir instead of a fresh copy: use a spare worktree
#
# The sample takes mutant i of a crate when i % N == K - 1 (cargo-mutants' round-robin
# sharding, so every slice spreads over the crate's files): N_REF=256, N_EQ=180, N_OPT=140 give about 20 mutants a crate (5,368, 3,596
# and 2,777 mutants in all on 2026-12-02), about an hour on 2 cores with a warm target.
#
# Each crate's mutants run against the tests that should catch them. For `reference` and
# `equivalence` those are the crate's own tests: the code that turns bad input into an
# error, or a checker that must reject a planted fault, is tested where it lives, so a user
# of that crate alone is protected (issue #19). The kernels of `optimized` are held to the
# reference by the registry suites of `packshard-oracle` (every registered implementation
# through every suite), so its mutants run against `packshard-optimized`'s and
# `packshard-oracle`'s tests. WIDE=1 adds `packshard-equivalence`'s tests to `reference`'s.
# Results: mutants.out/<crate>/ (outcomes.json, missed.txt, caught.txt ...); a table per
# crate is printed at the end and written to mutants.out/table.md. docs/MUTANTS.md holds the
# last reviewed table and the equivalent mutants marked with #[mutants::skip] or the
# exclude list in .cargo/mutants.toml, each with its reason.
set -euo pipefail
cd "$(dirname "$0")/.."
PLAN=${PLAN:-sample}
K=${K:-1}
N_REF=${N_REF:-256}
N_EQ=${N_EQ:-180}
N_OPT=${N_OPT:-140}
JOBS=${JOBS:-1}
EXTRA=(--jobs "$JOBS")
[ -n "${IN_PLACE:-}" ] && EXTRA=(--in-place)
OUT=mutants.out
# wide <own package> <downstream packages...>: the --test-package flags of a run.
wide() {
    local own=$1
    shift
    local args=(--test-package "$own")
    if [ -n "${WIDE:-}" ]; then
        for p in "$@"; do args+=(--test-package "$p"); done
    fi
    echo "${args[@]}"
}
mkdir -p "$OUT"

if ! cargo mutants --version >/dev/null 2>&1; then
    cargo install cargo-mutants --locked
fi

# The guard rails issue #19 named: the code that turns bad input into an error.
GUARDS='check_finite|check_strategies|PackingConfig::validate|canonicalize|from_str|Algorithm::name|Display for Algorithm'

run() { # name, then cargo-mutants arguments
    local name=$1
    shift
    # ONLY=<name>[,<name>...] runs only those crates' runs (e.g. ONLY=reference after a fix).
    if [ -n "${ONLY:-}" ] && [[ ",$ONLY," != *",$name,"* ]]; then
        return 0
    fi
    echo "==> $name: cargo mutants $*"
    local t0
    t0=$(date +%s)
    cargo mutants --no-shuffle --timeout-multiplier 3 "${EXTRA[@]}" -o "$OUT/$name" "$@" || true
    echo "$name: $(( $(date +%s) - t0 ))s" >> "$OUT/times.txt"
}

: > "$OUT/times.txt"
case "$PLAN" in
guards)
    run reference-guards -p packshard-reference \
        -f reference/src/error.rs -f reference/src/packing/mod.rs -F "$GUARDS" \
        --test-package packshard-reference
    ;;
sample)
    run reference -p packshard-reference --shard "$((K - 1))/$N_REF" --sharding round-robin \
        $(wide packshard-reference packshard-equivalence)
    run equivalence -p packshard-equivalence --shard "$((K - 1))/$N_EQ" --sharding round-robin \
        $(wide packshard-equivalence)
    # The cuda module is compiled only with the `cuda` feature: PLAN=cuda samples it.
    # cargo-mutants 27.1 times the baseline's tests of `packshard-optimized` alone but
    # runs each mutant's against both packages, so the timeout it derives (20 s on
    # 2026-12-04) cuts the oracle's registry suite short: a floor of 15 min
    # (OPT_TEST_TIMEOUT seconds) only costs time when a mutant really hangs.
    run optimized -p packshard-optimized --shard "$((K - 1))/$N_OPT" --sharding round-robin \
        -e 'optimized/src/cuda/**' \
        --test-package packshard-optimized --test-package packshard-oracle \
        --minimum-test-timeout "${OPT_TEST_TIMEOUT:-900}"
    ;;
compare)
    # The judge: every mutant of compare.rs, against the crate's unit tests only
    # (`--lib`: compare_tests.rs holds each rule to the numbers its docs state),
    # so a mutant costs an incremental build of one test binary (about 3 s).
    run compare -p packshard-equivalence -f equivalence/src/compare.rs -C --lib \
        --minimum-test-timeout 60
    ;;
builders)
    # The fuzz cases' size builders (the size classes, budget and boundary lengths
    # every family draws from; the large loss cases), against the unit tests and the
    # two test files that hold the generators to what they must reach.
    # Three runs (ONLY=builders-sizes, builders-vocab, builders-attention): every
    # function of the three files that turns an input's bytes into sizes and
    # options, not the descriptions or accessors.
    tests=(-C --lib -C --test=fuzz_vocab_sizes -C --test=attention_schedule --minimum-test-timeout 60)
    run builders-sizes -p packshard-equivalence \
        -f equivalence/src/fuzz/schedule.rs -f equivalence/src/fuzz/vocab/large.rs "${tests[@]}"
    run builders-vocab -p packshard-equivalence -f equivalence/src/fuzz/vocab.rs \
        -F 'shard_map|shards_of|loss_config|small_tail|split_and_tokens|targets|padding_value|plant_at|linear_plant|spread_id|Arbitrary' \
        "${tests[@]}"
    run builders-attention -p packshard-equivalence -f equivalence/src/fuzz/attention/case.rs -f equivalence/src/fuzz/attention/case/sizes.rs \
        -F 'heads|small_len|short_len|long_len|segment|fit|small_sizes|large_sizes|options|window_side|malform|plant_index|plant_choice|scale_of|Arbitrary' \
        "${tests[@]}"
    ;;
cuda)
    PACKSHARD_REQUIRE_EMULATOR=1 run optimized-cuda -p packshard-optimized --features cuda \
        -f 'optimized/src/cuda/**' --shard "$((K - 1))/20" --sharding round-robin
    ;;
full)
    run reference -p packshard-reference $(wide packshard-reference packshard-equivalence)
    run equivalence -p packshard-equivalence $(wide packshard-equivalence)
    run optimized -p packshard-optimized --test-package packshard-optimized --test-package packshard-oracle
    ;;
*)
    echo "PLAN must be guards, compare, builders, sample, cuda or full" >&2
    exit 2
    ;;
esac

# One row per crate: mutants tried, caught, missed, unviable, timed out.
python3 - "$OUT" <<'PY' | tee "$OUT/table.md"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print("| run | tried | caught | missed | unviable | timeout | kill rate (of viable) |")
print("|---|---|---|---|---|---|---|")
survivors, runs = [], 0
for d in sorted(p for p in out.iterdir() if (p / "mutants.out" / "outcomes.json").exists()):
    o = json.loads((d / "mutants.out" / "outcomes.json").read_text())
    runs += 1
    c = {k: o.get(k, 0) for k in ("total_mutants", "caught", "missed", "unviable", "timeout")}
    viable = c["caught"] + c["missed"] + c["timeout"]
    rate = f"{100 * (c['caught'] + c['timeout']) / viable:.1f}%" if viable else "-"
    print(f"| {d.name} | {c['total_mutants']} | {c['caught']} | {c['missed']} | {c['unviable']} | {c['timeout']} | {rate} |")
    missed = d / "mutants.out" / "missed.txt"
    if missed.exists():
        survivors += [f"{d.name}: {l}" for l in missed.read_text().splitlines() if l]
print()
if not runs:
    sys.exit("no run left outcomes: see the cargo-mutants output above")
print("survivors:" if survivors else "no survivors")
for s in survivors:
    print("-", s)
PY
cat "$OUT/times.txt"
