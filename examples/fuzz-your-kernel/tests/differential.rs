//! `NaiveAttention` against packshard's f64 reference: thousands of arbitrary
//! cases through the differential harness, packshard's packed == padded
//! suite, and every committed fuzz input (seeds, and inputs that once
//! failed) replayed.

// A fuzz `Failure` (names, case, first mismatch: ~144 bytes) is the cold
// path, returned once per failing run (as in packshard's own crates).
#![allow(clippy::result_large_err)]

use std::path::Path;

use fuzz_your_kernel::NaiveAttention;
use packshard_equivalence::attention::run_suite;
use packshard_equivalence::fuzz::{attention, fuzz_random, replay_dirs};
use packshard_equivalence::{Judge, Tolerance};

/// An f64 kernel that rounds differently from the reference: 64 ulp of the
/// terms (packshard_equivalence::fuzz::attention::AttentionTerms). A
/// lower-precision kernel states `Judge::Relative` (see packshard's registry).
const TOLERANCE: Judge = Judge::Rewrite(Tolerance::F64_REWRITE);

#[test]
fn naive_attention_matches_the_reference_on_arbitrary_cases() {
    let seen = fuzz_random(2000, 7, |data| {
        attention::run(&NaiveAttention, TOLERANCE, data)
    })
    .unwrap_or_else(|failure| panic!("{failure}"));
    eprintln!(
        "{} cases ({} compared, {} malformed refused alike), {} values; worst error {:.4} of the tolerance",
        seen.cases, seen.compared, seen.errors_alike, seen.values, seen.worst
    );
    assert!(seen.compared >= 1800 && seen.errors_alike >= 50, "{seen:?}");
    // The kernel rounds differently from the reference (the comparison is
    // not vacuous), and stays well inside the tolerance.
    assert!(seen.worst > 0.0 && seen.worst < 0.5, "{seen:?}");
}

#[test]
fn naive_attention_passes_the_packed_equals_padded_suite() {
    // TOLERANCE is the named judge above; 128 is the number of cases, not a threshold.
    let seen = run_suite(&NaiveAttention, TOLERANCE, 128).unwrap_or_else(|m| panic!("{m}"));
    eprintln!("{seen}");
    assert!(seen.packed.values > 5000, "{seen:?}");
}

#[test]
fn committed_fuzz_inputs_still_pass() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
    let seeds = dir.join("seeds/naive_attention");
    let regressions = dir.join("regressions/naive_attention");
    let seen = replay_dirs(&[&seeds, &regressions], |data| {
        attention::run(&NaiveAttention, TOLERANCE, data)
    })
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(seen.cases >= 5, "{seen:?}");
}
