//! # packshard-equivalence
//!
//! The reusable suites: checks that prove *packed == unpacked* and *sharded ==
//! unsharded*, for outputs and gradients, written against the op traits of
//! `packshard_reference::ops` so that the same suite runs for the reference,
//! our optimized kernels (every entry of `packshard-oracle`'s registry), and a
//! framework author's implementation, each under the [`Judge`] it states. Every check has a negative control in this crate's
//! tests: a deliberately broken implementation that the check must reject.
//!
//! - [`compare`]: tensor comparison under a named [`compare::Tolerance`], with
//!   failures that name the tensor, the index and both values; for kernels in
//!   lower precision the [`compare::RelativeRule`] (at most `k` times the error
//!   of the reference math run in that precision, [`baseline32`]).
//! - [`packing`]: plans and packed batches (docs/FAULTS.md P1, P3–P6).
//! - [`vocab`]: vocabulary-parallel cross-entropy and embedding, sharded ==
//!   unsharded (docs/FAULTS.md V1–V6).
//! - [`attention`]: varlen attention == padded attention (P2, P4, P8).
//! - [`bert`]: BERT layer and whole model with losses and gradients, packed ==
//!   padded (P1, P2, P4, P5, P7, P8).
//! - [`planted`]: implementations with one fault planted over the reference,
//!   for negative controls.
//! - [`zoo`]: the bug zoo, realistic tiled and chunked kernels each with one
//!   shipped mistake, the negative controls of the default checks.
//! - [`causal`]: a causal decoder's logits, next-token loss under each
//!   reduction and every gradient, packed == unpacked, and continuation
//!   chunks over cached keys (C1–C7, P7).
//! - [`collator`]: a data collator's packed causal-LM batch (Hugging Face's
//!   and PyTorch's conventions, one row or many) against the features it
//!   was given (issue 36; C1–C4, C6, C7, K1–K9).
//!
//! Shape legend as in `packshard-reference`: `n_tok` tokens, `b` segments,
//! `h` heads, `d` head dim, `v` vocabulary, `p` shards.

#![forbid(unsafe_code)]
#![warn(missing_docs)]
// A fuzz `Failure` (names, case, mismatch: ~144 bytes) is the cold path,
// returned once per failing run; boxing it would only add noise.
#![allow(clippy::result_large_err)]

pub mod attention;
pub mod attention_general;
pub mod baseline32;
pub mod bert;
pub mod causal;
pub mod collator;
pub mod compare;
pub mod fuzz;
pub mod packing;
pub mod planted;
pub mod step;
pub mod vocab;
pub mod zoo;

pub use compare::{Judge, Mismatch, RelativeRule, RelativeTotals, Tolerance};

/// For [`roundoffs_tolerance!`]'s expansion in other crates.
#[doc(hidden)]
pub use packshard_reference as __reference;

/// `cu_seqlens: [b + 1]` of segment `lengths` (leading 0, running sums:
/// flash-attention's varlen offsets).
pub fn cu_seqlens_of(lengths: impl IntoIterator<Item = usize>) -> Vec<usize> {
    let mut cu = vec![0];
    for l in lengths {
        cu.push(cu[cu.len() - 1] + l);
    }
    cu
}

/// The proptest runner every suite uses: `cases` cases from a fixed ChaCha
/// seed (a failure reproduces run after run), no failure files written.
pub fn runner(cases: u32) -> proptest::test_runner::TestRunner {
    use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
    TestRunner::new_with_rng(
        Config {
            cases,
            failure_persistence: None,
            ..Config::default()
        },
        TestRng::deterministic_rng(RngAlgorithm::ChaCha),
    )
}

/// Runs `check` on `cases` cases of `strategy` (the [`runner`]'s fixed
/// seed), each adding what it saw to `report`; the first failure, shrunk by
/// proptest, is a [`Mismatch`] naming `suite` with proptest's account of the
/// case.
///
/// # Errors
/// That failure.
pub fn run_cases<S: proptest::strategy::Strategy, R>(
    cases: u32,
    strategy: &S,
    suite: &str,
    report: R,
    check: impl Fn(&mut R, S::Value) -> Result<(), Mismatch>,
) -> Result<R, Mismatch> {
    use proptest::test_runner::TestCaseError;
    let acc = std::cell::RefCell::new(report);
    runner(cases)
        .run(strategy, |case| {
            check(&mut acc.borrow_mut(), case).map_err(|m| TestCaseError::fail(m.to_string()))
        })
        .map_err(|e| Mismatch::new(suite, e.to_string()))?;
    Ok(acc.into_inner())
}
