#!/usr/bin/env bash
# A time-boxed fuzzing campaign that looks for NEW failures: every target of
# `cargo fuzz list --fuzz-dir fuzz` for $SECONDS_PER_TARGET seconds each
# (default 600), `--sanitizer none` (stable toolchain), a random libFuzzer
# seed (printed, so a run can be repeated with FUZZ_SEED=...), and a working
# corpus under fuzz/corpus/<target>/ (gitignored; it grows from run to run,
# starting from the committed seeds and regressions).
#
# Not run by CI: CI fuzzes deterministically inside `cargo test`
# (tests/fuzz_regressions.rs: FUZZ_RUNS seeded mutations). Run this by hand:
#
#   scripts/fuzz_campaign.sh                         # 10 minutes per target
#   SECONDS_PER_TARGET=60 scripts/fuzz_campaign.sh attention eval_json
#   FUZZ_SEED=1234 scripts/fuzz_campaign.sh          # repeat a campaign's seed
#
# A find is written by libFuzzer to fuzz/artifacts/<target>/crash-<sha1>
# (or oom-/timeout-/slow-unit-). To keep it fixed forever, fix the code, then
# commit the input as a regression: `cargo test --test fuzz_regressions`
# replays fuzz/regressions/<target>/ on every run:
#
#   cp fuzz/artifacts/<target>/crash-<sha1> fuzz/regressions/<target>/
#   cargo test --test fuzz_regressions
#   git add fuzz/regressions/<target>/crash-<sha1>
set -u -o pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"

SECONDS_PER_TARGET=${SECONDS_PER_TARGET:-600}
FUZZ_SEED=${FUZZ_SEED:-$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')}
RSS_LIMIT_MB=${RSS_LIMIT_MB:-2048}

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "cargo-fuzz is missing: cargo install cargo-fuzz --locked" >&2
    exit 2
fi

if [ $# -gt 0 ]; then
    targets="$*"
else
    targets=$(cargo fuzz list --fuzz-dir fuzz)
fi

echo "fuzz campaign: seed $FUZZ_SEED, ${SECONDS_PER_TARGET}s per target, targets: $(echo $targets)"
echo "(repeat with FUZZ_SEED=$FUZZ_SEED)"

summary=""
total_finds=0
for target in $targets; do
    mkdir -p "fuzz/corpus/$target" "fuzz/seeds/$target" "fuzz/regressions/$target" "fuzz/artifacts/$target"
    log=$(mktemp)
    # Build first, so that "time" below is fuzzing time, not compile time.
    if ! cargo fuzz build --fuzz-dir fuzz --sanitizer none "$target" >"$log" 2>&1; then
        echo "$target: cargo fuzz build failed; last lines:" >&2
        tail -n 5 "$log" >&2
        rm -f "$log"
        exit 2
    fi
    before=$(find "fuzz/artifacts/$target" -type f | wc -l)
    start=$(date +%s)
    cargo fuzz run --fuzz-dir fuzz --sanitizer none "$target" \
        "fuzz/corpus/$target" "fuzz/seeds/$target" "fuzz/regressions/$target" -- \
        -seed="$FUZZ_SEED" -max_total_time="$SECONDS_PER_TARGET" \
        -rss_limit_mb="$RSS_LIMIT_MB" -timeout=60 \
        -artifact_prefix="fuzz/artifacts/$target/" >"$log" 2>&1
    status=$?
    elapsed=$(( $(date +%s) - start ))
    after=$(find "fuzz/artifacts/$target" -type f | wc -l)
    finds=$(( after - before ))
    # libFuzzer's last status line: "#123456 DONE cov: ... exec/s: ..." or
    # "stat::number_of_executed_units: N" with -print_final_stats.
    runs=$(grep -Eo '^#[0-9]+' "$log" | tail -n 1 | tr -d '#')
    runs=${runs:-0}
    if [ "$status" -ne 0 ] && [ "$finds" -eq 0 ]; then
        echo "$target: cargo fuzz failed (status $status) with no artifact; last lines:" >&2
        tail -n 5 "$log" >&2
    fi
    line=$(printf '%-22s runs %10s  time %5ss  finds %d' "$target" "$runs" "$elapsed" "$finds")
    echo "$line"
    if [ "$finds" -gt 0 ]; then
        grep -E '^(thread .* panicked|==[0-9]+== ERROR|SUMMARY|.*Test unit written to)' "$log" | head -n 5
    fi
    summary="$summary$line"$'\n'
    total_finds=$(( total_finds + finds ))
    rm -f "$log"
done

echo
echo "summary (seed $FUZZ_SEED):"
printf '%s' "$summary"
if [ "$total_finds" -gt 0 ]; then
    cat <<MSG

$total_finds find(s) in fuzz/artifacts/<target>/. For each: reproduce it with
  cargo fuzz run --fuzz-dir fuzz --sanitizer none <target> fuzz/artifacts/<target>/<file>
fix the code, then commit the input as a regression (replayed by cargo test):
  cp fuzz/artifacts/<target>/<file> fuzz/regressions/<target>/
  cargo test --test fuzz_regressions
  git add fuzz/regressions/<target>/<file>
MSG
    exit 1
fi
echo "no finds."
