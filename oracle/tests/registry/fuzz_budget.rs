//! Every registered attention, loss and embedding kernel over the default
//! budget of the fuzz targets (`fuzz_budgeted(Budget::DEFAULT, seed, ..)`:
//! 88 small cases, then 12 large ones: for attention a segment of 1,023 to
//! 1,100 tokens in most, GQA, cross and causal, each narrowed to what the
//! kernel declares; for the losses cases crossing vocabulary and token
//! chunks), under the judge its fuzz target runs it with, timed (the figures
//! of docs/FAULTS.md, "How results are judged"):
//! `<family>::<impl>::fuzz_budget[_small][_seed<n>]`.

use std::time::Instant;

use packshard_equivalence::fuzz::attention as fa;
use packshard_equivalence::fuzz::schedule::{fuzz_budgeted, Budget};
use packshard_equivalence::fuzz::vocab::{run_cross_entropy, run_embedding, run_linear};
use packshard_equivalence::fuzz::Outcome;
use packshard_oracle::registry::{self, Entry, Family};
use packshard_reference::ops::AttentionOp;

use crate::harness::{Config, Tests};

/// The budget's report of one run, or its first failure.
fn budget(
    seed: u64,
    body: impl Fn(&[u8]) -> Result<Outcome, packshard_equivalence::fuzz::Failure>,
) -> Result<(Outcome, f64), String> {
    let t = Instant::now();
    let seen = fuzz_budgeted(Budget::DEFAULT, seed, body).map_err(|f| f.to_string())?;
    Ok((seen, t.elapsed().as_secs_f64()))
}

/// Adds the budget of every attention (its small configuration, seeds 0
/// and 1, what its fuzz target runs) and every loss and embedding kernel
/// (seed 0, both configurations).
pub fn add(t: &mut Tests, attention_list: &[Entry<dyn AttentionOp>]) {
    for seed in [0u64, 1] {
        let suite = format!("fuzz_budget_small_seed{seed}");
        // The CPU emulator of the CUDA kernels runs a thread per CUDA thread
        // (27 s a seed on CI's 2 cores, as long as every other entry's two
        // seeds together): seed 0 only there. The device kernel it emulates
        // runs both (and did, on an H200: docs/GPU.md).
        let list: Vec<Entry<dyn AttentionOp>> = attention_list
            .iter()
            .filter(|e| seed == 0 || e.needs != registry::Needs::CxxCompiler)
            .cloned()
            .collect();
        t.each(
            Family::Attention,
            &list,
            &suite,
            Config::SmallAlways,
            4,
            move |imp, e| {
                let (seen, s) = budget(seed, |d| fa::run(imp, e.fuzz_judge, d))?;
                // Every case of the budget is compared or refused alike by
                // the kernel and the reference.
                assert_eq!(seen.cases, Budget::DEFAULT.cases);
                assert_eq!(seen.compared + seen.errors_alike, Budget::DEFAULT.cases);
                Ok(format!(
                    "{} cases, {} compared, {} refused alike, {} narrowed, {} values, worst {:.3} of the tolerance, {s:.2} s",
                    seen.cases, seen.compared, seen.errors_alike, seen.narrowed, seen.values, seen.worst
                ))
            },
        );
    }
    for (config, suite) in [
        (Config::Registered, "fuzz_budget"),
        (Config::Small, "fuzz_budget_small"),
    ] {
        let min = |n: usize| if config == Config::Registered { n } else { 0 };
        // At least 80 of the 100 cases compared (the rest refused alike):
        // the budget exercised the kernel, not only its refusals.
        let report = |seen: Outcome, s: f64| -> Result<String, String> {
            assert_eq!(seen.cases, Budget::DEFAULT.cases);
            assert!(seen.compared >= 80, "{seen:?}");
            Ok(format!("{s:.2} s, {seen:?}"))
        };
        t.each(
            Family::CrossEntropy,
            &registry::cross_entropy(),
            suite,
            config,
            min(2),
            move |imp, e| {
                let (seen, s) = budget(0, |d| run_cross_entropy(imp, e.fuzz_judge, d))?;
                report(seen, s)
            },
        );
        t.each(
            Family::LinearCrossEntropy,
            &registry::linear_cross_entropy(),
            suite,
            config,
            min(2),
            move |imp, e| {
                let (seen, s) = budget(0, |d| run_linear(imp, e.fuzz_judge, d))?;
                report(seen, s)
            },
        );
        t.each(
            Family::Embedding,
            &registry::embedding(),
            suite,
            config,
            min(1),
            move |imp, _| {
                let (seen, s) = budget(0, |d| run_embedding(imp, d))?;
                report(seen, s)
            },
        );
    }
}
