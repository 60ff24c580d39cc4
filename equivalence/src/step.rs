//! The training step across ranks equals one unpacked batch (issue #34;
//! docs/STEP.md, docs/FAULTS.md D1..D8): [`check_step`] runs
//! [`reference_step`] (gradient accumulation, data and context parallel with
//! ring attention, global-denominator weights) and [`unpacked_step`] (the
//! whole batch as padded rows, one document each) and requires the loss,
//! every token's loss and every parameter gradient to agree.
//!
//! Tolerance: [`Tolerance::F64_REWRITE`], the causal-LM suite's rule for
//! packed == padded (`crate::causal`): both sides do the same f64 operations
//! per token; ring attention sums a query's keys in another order (chunk by
//! chunk, merged by log-sum-exp) and parameter gradients are summed over
//! ranks and microbatches in another order, each moving a result by a few
//! ulp of its largest term; gradients are judged against the largest
//! gradient ([`grads_close`], as the causal-LM and BERT suites do). Every
//! fault D1..D8 moves a value by 1e-3 of its scale or more.

use packshard_reference::decoder::{CausalReduction, DecoderConfig, DecoderModel};
use packshard_reference::step::{
    reference_step, unpacked_step, Layout, StepBatch, StepFault, StepResult,
};
use rand::{Rng, SeedableRng};

use crate::attention::Observed;
use crate::causal::grads_close;
use crate::compare::{Mismatch, Tolerance};

/// The tolerance of [`check_step`] (module docs).
pub const STEP_TOLERANCE: Tolerance = Tolerance::F64_REWRITE;

/// Runs the step under `layout` (with `fault`, for a negative control) and
/// the unpacked batch, and compares the loss, the token losses and every
/// parameter gradient under [`STEP_TOLERANCE`].
///
/// # Errors
/// A [`Mismatch`] naming the tensor (`loss`, `token_losses`, `grad
/// <name>`), or `step` / `unpacked` with the reference's error.
pub fn check_step(
    model: &DecoderModel,
    batch: &StepBatch,
    layout: &Layout,
    fault: Option<StepFault>,
) -> Result<Observed, Mismatch> {
    let want = unpacked_step(model, batch).map_err(|e| Mismatch::new("unpacked", e.to_string()))?;
    let got = reference_step(model, batch, layout, fault)
        .map_err(|e| Mismatch::new("step", e.to_string()))?;
    compare_steps(&want, &got)
}

/// Compares a step's results with the wanted ones under
/// [`STEP_TOLERANCE`]: the loss, every token's loss (document by document,
/// laid end to end), every parameter gradient (floors relative to the
/// largest wanted gradient).
///
/// # Errors
/// A [`Mismatch`] naming the tensor; `token_losses` when the documents'
/// lengths differ.
pub fn compare_steps(want: &StepResult, got: &StepResult) -> Result<Observed, Mismatch> {
    let shape = |r: &StepResult| r.token_losses.iter().map(Vec::len).collect::<Vec<_>>();
    if shape(want) != shape(got) {
        return Err(Mismatch::new(
            "token_losses",
            format!(
                "document lengths {:?}, expected {:?}",
                shape(got),
                shape(want)
            ),
        ));
    }
    let mut seen = Observed::default();
    seen.close("loss", &[want.loss], &[got.loss], &[1], STEP_TOLERANCE)?;
    let (a, b): (Vec<f64>, Vec<f64>) = (want.token_losses.concat(), got.token_losses.concat());
    seen.close("token_losses", &a, &b, &[a.len()], STEP_TOLERANCE)?;
    grads_close("grad", &want.grads, &got.grads, STEP_TOLERANCE, &mut seen)?;
    Ok(seen)
}

/// The decoder of the step suites: two layers, grouped-query attention
/// (2 query heads over 1 key/value head), head dim 4, vocabulary 23.
pub fn step_model(seed: u64) -> DecoderModel {
    let config = DecoderConfig::tiny(23, 2, 1, 4, 12, 2);
    DecoderModel::random(config, seed).expect("a valid tiny config")
}

/// A seeded batch for `layout`: `G D` to `G D + 3` documents of 1 to 13
/// tokens (lengths 1 and not multiples of `2 cp` among them), ids in
/// `0..23`.
pub fn step_batch(layout: &Layout, reduction: CausalReduction, seed: u64) -> StepBatch {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let n = layout.microbatches() + rng.random_range(0..=3);
    let mut docs: Vec<Vec<i64>> = (0..n)
        .map(|_| {
            let len = rng.random_range(1..=13);
            (0..len).map(|_| rng.random_range(0..23)).collect()
        })
        .collect();
    docs[0].truncate(1);
    StepBatch {
        docs,
        eos: (seed % 3 == 2).then_some(22),
        reduction,
    }
}

/// The negative controls' case: `G = D = C = 2`, documents of `[5, 1, 7,
/// 3, 9, 2, 6, 11]` tokens (microbatches of 14, 3, 13 and 13 real tokens;
/// no length a multiple of 4 but one), ids from `seed`, under the fault's
/// reduction ([`StepFault::reduction`]).
pub fn fault_case(fault: StepFault, seed: u64) -> (Layout, StepBatch) {
    let layout = Layout {
        grad_accum: 2,
        dp: 2,
        cp: 2,
    };
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let docs = [5usize, 1, 7, 3, 9, 2, 6, 11]
        .iter()
        .map(|&len| (0..len).map(|_| rng.random_range(0..23)).collect())
        .collect();
    (
        layout,
        StepBatch {
            docs,
            eos: None,
            reduction: fault.reduction(),
        },
    )
}
