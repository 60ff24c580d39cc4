//! Checks for vocabulary-parallel cross-entropy, the output layer and the
//! input embedding: *sharded == unsharded* for the loss, the per-token loss,
//! `logsumexp` and every gradient, on every rank, plus the collective counts
//! (FAULTS.md V1–V6).
//!
//! An implementation provides [`VocabParallel`] (the reference one is
//! [`Reference`]); [`check_cross_entropy`], [`check_linear`] and
//! [`check_embedding`] compare one case against the unsharded f64 reference
//! of `packshard-reference`; [`run_suite`] drives them over the FAULTS.md
//! examples and seeded random cases, and fails if the cases it ran were
//! degenerate. Instantiate it for your own sharded kernels (optimized, GPU,
//! MPI) by implementing the trait.
//!
//! ## Tolerances
//!
//! Sharded and unsharded compute the same f64 math in a different order
//! (per-shard sums merged across shards; `exp(z - m_i) exp(m_i - m)` for
//! `exp(z - m)`), so they agree to a few ulp of the *terms* each value is made
//! of — the bound every floating-point sum obeys. Every value is held to
//! [`TERMS`]: `|actual - expected| <= 64 ulp x (|expected| + terms)`, with
//! per-element `terms` ([`Terms`]):
//!
//! - a probability `p_j = exp(z_j - m) / s` counts as `p_j (1 + |z_j - m|)`:
//!   rounding its argument moves it by `|z_j - m|` ulp relative, in the
//!   reference as much as in a shard;
//! - the loss and per-token losses are sums of non-negative terms (`Σ q (m -
//!   z) + ln s + c lse^2`), so their terms are themselves plus the
//!   probabilities' amplification: the rule is relative — the reference keeps
//!   a loss of 1e-14 relatively precise (`packshard_reference::vocab`);
//! - `logsumexp`: `|m| + ln s`; `∂L/∂z`: `w (p (1 + 2 c |lse|) + q)` (the
//!   softmax and target parts of `p - q`); `∂L/∂x`: those times `|W|`;
//!   `∂L/∂W`: those times `|x|`. A gradient that cancels to `1e-4` from terms
//!   of 50 (two tied maxima, one the target) is judged against 50, as its own
//!   round-off is — in the unsharded reference too.
//!
//! Values under [`UNDERFLOW`] (1.4e-306, subnormal territory) are compared
//! absolutely. 64 ulp is the project's `F64_REWRITE` budget; with compensated sums on both
//! sides the differences seen are a few ulp (the suite reports the largest).
//! The embedding is compared [`Tolerance::EXACT`]: a masked lookup plus a sum
//! of zeros is exact.

use std::cell::RefCell;
use std::panic::{catch_unwind, AssertUnwindSafe};

use ndarray::{Array2, ArrayView2, Axis, Slice};
use packshard_reference::vocab::cross_entropy::LinearCrossEntropy;
use packshard_reference::vocab::embedding::{
    embedding_backward, embedding_forward, sharded_embedding, ShardedEmbedding,
};
use packshard_reference::vocab::sharded::{
    sharded_cross_entropy, sharded_linear_cross_entropy, ShardedLoss,
};
use packshard_reference::vocab::{
    cross_entropy, linear_cross_entropy, CrossEntropy, LossConfig, Reduction, ShardLayout,
    ShardMap, ShardedAlgorithm, SmoothingConvention,
};
use packshard_reference::Error;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

pub use crate::attention::RelativeReport;
use crate::baseline32;
use crate::compare::{assert_close, assert_within_k_with_scale, Mismatch, RelativeRule, Tolerance};

/// A vocabulary-parallel implementation: the sharded cross-entropy on given
/// logits, the sharded output layer, and the sharded input embedding.
///
/// Inputs are whole tensors; the implementation shards them as `map` says
/// (columns / rows `v..` of the inputs are padding values that must never be
/// read). Errors must be those of the unsharded reference (same
/// [`Error::kind`]; out-of-range ids and targets the same error).
pub trait VocabParallel {
    /// A short name for reports.
    fn name(&self) -> String;

    /// The algorithms it implements (default: all three).
    fn algorithms(&self) -> Vec<ShardedAlgorithm> {
        ShardedAlgorithm::ALL.to_vec()
    }

    /// Cross-entropy of `logits: [n, w]` (`w >= v`) against `targets: [n]`.
    ///
    /// # Errors
    /// As `packshard_reference::vocab::cross_entropy`.
    fn cross_entropy(
        &self,
        algorithm: ShardedAlgorithm,
        map: &ShardMap,
        logits: ArrayView2<f64>,
        targets: &[i64],
        config: &LossConfig,
        want_grad: bool,
    ) -> Result<ShardedLoss, Error>;

    /// The output layer `hidden: [n, h]`, `weight: [w, h]` (`w >= v`) and its
    /// cross-entropy.
    ///
    /// # Errors
    /// As `packshard_reference::vocab::linear_cross_entropy`.
    #[allow(clippy::too_many_arguments)]
    fn linear_cross_entropy(
        &self,
        algorithm: ShardedAlgorithm,
        map: &ShardMap,
        hidden: ArrayView2<f64>,
        weight: ArrayView2<f64>,
        targets: &[i64],
        config: &LossConfig,
        want_grad: bool,
    ) -> Result<ShardedLoss, Error>;

    /// The input embedding of `ids: [n]` in `weight: [w, h]`, and with
    /// `grad_output: [n, h]` its weight gradient.
    ///
    /// # Errors
    /// As `packshard_reference::vocab::embedding_forward` / `embedding_backward`.
    fn embedding(
        &self,
        map: &ShardMap,
        ids: &[i64],
        weight: ArrayView2<f64>,
        grad_output: Option<ArrayView2<f64>>,
    ) -> Result<ShardedEmbedding, Error>;
}

/// The reference implementation (`p` in-process ranks).
#[derive(Debug, Clone, Copy, Default)]
pub struct Reference;

impl VocabParallel for Reference {
    fn name(&self) -> String {
        "reference".into()
    }

    fn cross_entropy(
        &self,
        algorithm: ShardedAlgorithm,
        map: &ShardMap,
        logits: ArrayView2<f64>,
        targets: &[i64],
        config: &LossConfig,
        want_grad: bool,
    ) -> Result<ShardedLoss, Error> {
        sharded_cross_entropy(algorithm, map, logits, targets, config, want_grad)
    }

    fn linear_cross_entropy(
        &self,
        algorithm: ShardedAlgorithm,
        map: &ShardMap,
        hidden: ArrayView2<f64>,
        weight: ArrayView2<f64>,
        targets: &[i64],
        config: &LossConfig,
        want_grad: bool,
    ) -> Result<ShardedLoss, Error> {
        sharded_linear_cross_entropy(algorithm, map, hidden, weight, targets, config, want_grad)
    }

    fn embedding(
        &self,
        map: &ShardMap,
        ids: &[i64],
        weight: ArrayView2<f64>,
        grad_output: Option<ArrayView2<f64>>,
    ) -> Result<ShardedEmbedding, Error> {
        sharded_embedding(map, ids, weight, grad_output)
    }
}

/// A cross-entropy case: `logits: [n, w]` (`w >= v`, columns `v..` padding
/// values), `targets: [n]`.
#[derive(Debug, Clone, PartialEq)]
pub struct CeCase {
    /// The split.
    pub map: ShardMap,
    /// `[n, w]`.
    pub logits: Array2<f64>,
    /// `[n]`.
    pub targets: Vec<i64>,
    /// Loss options.
    pub config: LossConfig,
}

/// An output-layer case: `hidden: [n, h]`, `weight: [w, h]` (`w >= v`, rows
/// `v..` padding values), `targets: [n]`.
#[derive(Debug, Clone, PartialEq)]
pub struct LinearCase {
    /// The split.
    pub map: ShardMap,
    /// `[n, h]`.
    pub hidden: Array2<f64>,
    /// `[w, h]`.
    pub weight: Array2<f64>,
    /// `[n]`.
    pub targets: Vec<i64>,
    /// Loss options.
    pub config: LossConfig,
}

/// An embedding case: `ids: [n]`, `weight: [w, h]` (`w >= v`), `grad_output: [n, h]`.
#[derive(Debug, Clone, PartialEq)]
pub struct EmbeddingCase {
    /// The split.
    pub map: ShardMap,
    /// `[n]`, possibly out of range.
    pub ids: Vec<i64>,
    /// `[w, h]`.
    pub weight: Array2<f64>,
    /// `[n, h]`.
    pub grad_output: Array2<f64>,
}

fn fail<T>(what: impl Into<String>, detail: impl Into<String>) -> Result<T, Mismatch> {
    Err(Mismatch::new(what, detail))
}

/// Runs `f`, turning a panic into a [`Mismatch`] (an implementation must
/// never panic: an assertion on divisibility is FAULTS.md V4).
fn no_panic<T>(name: &str, f: impl FnOnce() -> T) -> Result<T, Mismatch> {
    catch_unwind(AssertUnwindSafe(f)).or_else(|payload| {
        let msg = payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default();
        fail("panic", format!("{name} panicked: {msg}"))
    })
}

/// Both failed alike, or both succeeded (then `Some` of the results).
fn same_outcome<A, B>(
    expected: Result<A, Error>,
    actual: Result<B, Error>,
) -> Result<Option<(A, B)>, Mismatch> {
    match (expected, actual) {
        (Ok(e), Ok(a)) => Ok(Some((e, a))),
        (Err(e), Err(a)) => {
            let same = e.kind() == a.kind()
                && match e {
                    Error::IndexOutOfRange { .. } => e == a,
                    _ => true,
                };
            if same {
                Ok(None)
            } else {
                fail("error", format!("expected the error {e}, got {a}"))
            }
        }
        (Err(e), Ok(_)) => fail(
            "error",
            format!("expected the error {e} ({}), got a result", e.kind()),
        ),
        (Ok(_), Err(a)) => fail("error", format!("unexpected error {a}")),
    }
}

thread_local! {
    /// The largest `|actual - expected| / (ulp x (|expected| + terms))` this
    /// thread has compared (see [`Coverage::worst_ulps`]).
    static WORST_ULPS: std::cell::Cell<f64> = const { std::cell::Cell::new(0.0) };
}

/// 64 ulp of the value plus 64 ulp of the magnitude of its terms (see the
/// module docs): the tolerance of every sharded gradient and `logsumexp`.
pub const TERMS: Tolerance = Tolerance::new(
    "f64 rewrite (64 ulp of the terms)",
    64.0 * f64::EPSILON,
    64.0 * f64::EPSILON,
);

/// The absolute floor of [`TERMS`]: 64 x the smallest normal f64
/// (1.4e-306). Below it numbers are subnormal and lose relative precision (a
/// probability of 1e-316 has a dozen significant bits), so they are compared
/// absolutely.
pub const UNDERFLOW: f64 = 64.0 * f64::MIN_POSITIVE;

/// Compares element by element under [`TERMS`] with per-element `terms`
/// (the magnitude of what each element was summed from).
///
/// # Errors
/// A [`Mismatch`] naming the first failing multi-index, both values, the
/// terms there and the number of failures.
pub fn assert_close_terms(
    what: &str,
    expected: &[f64],
    actual: &[f64],
    terms: &[f64],
    shape: &[usize],
) -> Result<(), Mismatch> {
    if expected.len() != actual.len() || expected.len() != terms.len() {
        return fail(
            what,
            format!(
                "length {} where {} was expected (shape {shape:?})",
                actual.len(),
                expected.len()
            ),
        );
    }
    let mut first = None;
    let mut failures = 0usize;
    for (i, ((&e, &a), &t)) in expected.iter().zip(actual).zip(terms).enumerate() {
        let ok = if e.is_finite() && a.is_finite() {
            let scale = e.abs() + t;
            if scale > UNDERFLOW {
                let ulps = (a - e).abs() / (f64::EPSILON * scale);
                WORST_ULPS.with(|w| w.set(w.get().max(ulps)));
            }
            (a - e).abs() <= TERMS.rel * e.abs() + TERMS.abs * t + UNDERFLOW
        } else {
            e == a
        };
        if !ok {
            failures += 1;
            first.get_or_insert(i);
        }
    }
    let Some(i) = first else { return Ok(()) };
    let stats = crate::compare::error_stats(expected, actual);
    fail(
        what,
        format!(
            "{failures} of {} elements differ; first at {:?}: expected {:e}, got {:e} (terms {:e})\n  max abs error {:e}, max rel error {:e}; tolerance {} (rel {:e}, abs {:e} x terms, + {UNDERFLOW:e})",
            expected.len(),
            crate::compare::unravel(i, shape),
            expected[i],
            actual[i],
            terms[i],
            stats.max_abs,
            stats.max_rel,
            TERMS.name,
            TERMS.rel,
            TERMS.abs
        ),
    )
}

fn tensor_terms(
    what: &str,
    expected: &Array2<f64>,
    actual: &Array2<f64>,
    terms: &Array2<f64>,
) -> Result<(), Mismatch> {
    if expected.shape() != actual.shape() {
        return fail(
            what,
            format!(
                "shape {:?}, expected {:?}",
                actual.shape(),
                expected.shape()
            ),
        );
    }
    let flat = |a: &Array2<f64>| a.iter().copied().collect::<Vec<f64>>();
    assert_close_terms(
        what,
        &flat(expected),
        &flat(actual),
        &flat(terms),
        expected.shape(),
    )
}

/// The magnitude of the terms every compared value is made of (see the
/// module docs), from the unsharded result.
#[derive(Debug, Clone, PartialEq)]
pub struct Terms {
    /// `[n]`: per-token loss plus `(1 + 2 c |lse|) Σ_j p_j |z_j - m|` plus
    /// `q_o Σ_j |z_j - m|` (the smoothing sum before the target's correction).
    pub per_token_loss: Vec<f64>,
    /// The loss's terms: `per_token_loss` reduced like the loss.
    pub loss: f64,
    /// `[n]`: `|m| + ln s + Σ_j p_j |z_j - m|`.
    pub logsumexp: Vec<f64>,
    /// `[n, v]`: `w (p (1 + |z - m|) (1 + 2 c |lse|) + q)`.
    pub grad_logits: Array2<f64>,
}

impl Terms {
    /// The terms of the unsharded `expected` for `logits: [n, v]`.
    ///
    /// `p_j = exp(z_j - m) / s` carries a relative error of `|z_j - m|` ulp
    /// from the rounding of its argument (and alg1/alg2 round it as `(z_j -
    /// m_i) + (m_i - m)`), so its terms are `p_j (1 + |z_j - m|)`; everything
    /// built from the probabilities inherits that.
    pub fn new(
        logits: ArrayView2<f64>,
        targets: &[i64],
        config: &LossConfig,
        expected: &CrossEntropy,
    ) -> Terms {
        let (n, v) = logits.dim();
        let parsed: Vec<Option<usize>> = (0..n)
            .map(|i| config.target(targets, i, v).ok().flatten())
            .collect();
        let weights = config.token_weights(&parsed);
        let (q_t, q_o) = config.target_distribution(v);
        let mut grad_logits = Array2::zeros((n, v));
        let mut per_token_loss = Vec::with_capacity(n);
        let mut logsumexp = Vec::with_capacity(n);
        for i in 0..n {
            let st = &expected.stats[i];
            let lse = st.logsumexp();
            let zl = if lse.is_finite() {
                1.0 + 2.0 * config.z_loss * lse.abs()
            } else {
                1.0
            };
            let mut exp_terms = 0.0;
            // `q_o Σ_j |m - z_j|`: the smoothing sum as an implementation
            // may form it, over every finite column before the target's
            // weight is corrected to `q_t` (Megatron's smoothing at 1 gives
            // `q_t = 0`, so the target's share cancels).
            let mut smoothing = 0.0;
            for j in 0..v {
                let z = logits[[i, j]];
                if q_o > 0.0 && z.is_finite() && st.max.is_finite() {
                    smoothing += q_o * (z - st.max).abs();
                }
                let p = if st.max == f64::NEG_INFINITY {
                    0.0
                } else {
                    st.probability(z)
                };
                let amplified = if p > 0.0 { p * (z - st.max).abs() } else { 0.0 };
                exp_terms += amplified;
                if let Some(t) = parsed[i] {
                    let q = if t == j { q_t } else { q_o };
                    grad_logits[[i, j]] = weights[i] * ((p + amplified) * zl + q);
                }
            }
            let lse_terms = st.max.abs() + st.rest.ln_1p() + exp_terms;
            logsumexp.push(if lse_terms.is_nan() { 0.0 } else { lse_terms });
            let own = if parsed[i].is_some() {
                zl * exp_terms + smoothing
            } else {
                0.0
            };
            per_token_loss.push(expected.per_token_loss[i] + own);
        }
        let loss = config.reduce(&per_token_loss, &parsed);
        Terms {
            per_token_loss,
            loss,
            logsumexp,
            grad_logits,
        }
    }
}

/// Compares a sharded run with the unsharded `expected`: the loss,
/// per-token losses and `logsumexp` on **every rank**, the gathered logit
/// gradient, exact zeros on padding columns, and the counts (barriers as
/// [`ShardedAlgorithm::barriers`] says, the same on every rank).
fn check_loss(
    algorithm: ShardedAlgorithm,
    map: &ShardMap,
    expected: &CrossEntropy,
    terms: &Terms,
    actual: &ShardedLoss,
    linear: bool,
    want_grad: bool,
) -> Result<(), Mismatch> {
    let p = map.num_shards();
    if actual.ranks.len() != p {
        return fail(
            "ranks",
            format!("{} ranks answered, {p} expected", actual.ranks.len()),
        );
    }
    let n = expected.per_token_loss.len();
    let lse = expected.logsumexp();
    for r in &actual.ranks {
        let at = |what: &str| format!("{what} (rank {})", r.rank);
        assert_close_terms(
            &at("loss"),
            &[expected.loss],
            &[r.loss],
            &[terms.loss],
            &[1],
        )?;
        let per_token = r.per_token_loss.to_vec();
        assert_close_terms(
            &at("per_token_loss"),
            expected.per_token_loss.as_slice().unwrap_or(&[]),
            &per_token,
            &terms.per_token_loss,
            &[n],
        )?;
        let got_lse: Vec<f64> = r.global.iter().map(|g| g.logsumexp()).collect();
        if got_lse.len() == n {
            assert_close_terms(
                &at("logsumexp"),
                lse.as_slice().unwrap_or(&[]),
                &got_lse,
                &terms.logsumexp,
                &[n],
            )?;
        } else if !got_lse.is_empty() {
            return fail(
                at("logsumexp"),
                format!("{} rows, {n} expected", got_lse.len()),
            );
        }
    }
    if let Some(want) = &expected.grad_logits {
        let Some(got) = actual.grad_logits() else {
            return fail("grad_logits", "missing");
        };
        tensor_terms("grad_logits", want, &got, &terms.grad_logits)?;
        for (s, r) in map.shards().iter().zip(&actual.ranks) {
            let g = r.grad_logits.as_ref().expect("gathered above");
            let padding = g.slice_axis(Axis(1), Slice::from(s.real..));
            if let Some(x) = padding.iter().find(|x| **x != 0.0) {
                return fail(
                    "grad_logits",
                    format!("rank {}: a padding column has gradient {x}, not 0", r.rank),
                );
            }
        }
    }
    check_counts(algorithm, actual, linear, want_grad)
}

fn check_counts(
    algorithm: ShardedAlgorithm,
    actual: &ShardedLoss,
    linear: bool,
    want_grad: bool,
) -> Result<(), Mismatch> {
    let want = algorithm.barriers(linear, want_grad);
    let first = actual.ranks[0].counts;
    for r in &actual.ranks {
        if r.counts.barriers != want {
            return fail(
                "collectives",
                format!(
                    "{algorithm}: rank {} used {} barriers; the algorithm needs {want}",
                    r.rank, r.counts.barriers
                ),
            );
        }
        if r.counts != first {
            return fail(
                "collectives",
                format!("rank {} counted {:?}, rank 0 {:?}", r.rank, r.counts, first),
            );
        }
    }
    Ok(())
}

/// Checks `imp`'s sharded cross-entropy on `case` against the unsharded
/// reference on the real columns (see [`VocabParallel`]).
///
/// # Errors
/// The first difference, as a [`Mismatch`] naming the tensor, rank and index.
pub fn check_cross_entropy(
    imp: &dyn VocabParallel,
    algorithm: ShardedAlgorithm,
    case: &CeCase,
    want_grad: bool,
) -> Result<(), Mismatch> {
    check_cross_entropy_with(imp, algorithm, case, want_grad, Rule::Terms)
}

/// As [`check_cross_entropy`] under `rule` (see [`Rule`]).
///
/// # Errors
/// The first difference, as a [`Mismatch`] naming the tensor, rank and index.
pub fn check_cross_entropy_with(
    imp: &dyn VocabParallel,
    algorithm: ShardedAlgorithm,
    case: &CeCase,
    want_grad: bool,
    rule: Rule,
) -> Result<(), Mismatch> {
    if let Rule::Relative(rule) = rule {
        return check_cross_entropy_relative(imp, algorithm, case, want_grad, rule);
    }
    let v = case.map.vocab_size();
    let real = case
        .logits
        .slice_axis(Axis(1), Slice::from(..v.min(case.logits.ncols())));
    let expected = cross_entropy(real, &case.targets, &case.config, want_grad);
    let actual = no_panic(&imp.name(), || {
        imp.cross_entropy(
            algorithm,
            &case.map,
            case.logits.view(),
            &case.targets,
            &case.config,
            want_grad,
        )
    })?;
    let Some((expected, actual)) = same_outcome(expected, actual)? else {
        return Ok(());
    };
    let terms = Terms::new(real, &case.targets, &case.config, &expected);
    check_loss(
        algorithm, &case.map, &expected, &terms, &actual, false, want_grad,
    )
}

/// Checks `imp`'s sharded output layer on `case`: as
/// [`check_cross_entropy`], plus `∂L/∂hidden` on every rank and the gathered
/// `∂L/∂W` (exact zeros on padding rows).
///
/// # Errors
/// The first difference, as a [`Mismatch`].
pub fn check_linear(
    imp: &dyn VocabParallel,
    algorithm: ShardedAlgorithm,
    case: &LinearCase,
    want_grad: bool,
) -> Result<(), Mismatch> {
    check_linear_with(imp, algorithm, case, want_grad, Rule::Terms)
}

/// As [`check_linear`] under `rule` (see [`Rule`]).
///
/// # Errors
/// The first difference, as a [`Mismatch`].
pub fn check_linear_with(
    imp: &dyn VocabParallel,
    algorithm: ShardedAlgorithm,
    case: &LinearCase,
    want_grad: bool,
    rule: Rule,
) -> Result<(), Mismatch> {
    if let Rule::Relative(rule) = rule {
        return check_linear_relative(imp, algorithm, case, want_grad, rule);
    }
    let v = case.map.vocab_size();
    let real = case
        .weight
        .slice_axis(Axis(0), Slice::from(..v.min(case.weight.nrows())));
    let expected = linear_cross_entropy(
        case.hidden.view(),
        real,
        &case.targets,
        &case.config,
        want_grad,
    );
    let actual = no_panic(&imp.name(), || {
        imp.linear_cross_entropy(
            algorithm,
            &case.map,
            case.hidden.view(),
            case.weight.view(),
            &case.targets,
            &case.config,
            want_grad,
        )
    })?;
    let Some((expected, actual)) = same_outcome(expected, actual)? else {
        return Ok(());
    };
    compare_linear(algorithm, case, &expected, &actual, want_grad)
}

/// Compares a sharded output-layer run `actual` on `case` with the unsharded
/// `expected` (as [`check_linear`] does after running both), so that one
/// unsharded run can serve several sharded ones.
///
/// # Errors
/// The first difference, as a [`Mismatch`].
pub fn compare_linear(
    algorithm: ShardedAlgorithm,
    case: &LinearCase,
    expected: &LinearCrossEntropy,
    actual: &ShardedLoss,
    want_grad: bool,
) -> Result<(), Mismatch> {
    let v = case.map.vocab_size();
    let real = case
        .weight
        .slice_axis(Axis(0), Slice::from(..v.min(case.weight.nrows())));
    let terms = Terms::new(
        expected.logits.view(),
        &case.targets,
        &case.config,
        &expected.ce,
    );
    let g = &terms.grad_logits;
    if let Some(want) = &expected.grad_hidden {
        let hidden_terms = g.dot(&real.mapv(f64::abs));
        for r in &actual.ranks {
            let Some(got) = &r.grad_hidden else {
                return fail("grad_hidden", format!("rank {}: missing", r.rank));
            };
            tensor_terms(
                &format!("grad_hidden (rank {})", r.rank),
                want,
                got,
                &hidden_terms,
            )?;
        }
    }
    if let Some(want) = &expected.grad_weight {
        let Some(got) = actual.grad_weight() else {
            return fail("grad_weight", "missing");
        };
        tensor_terms(
            "grad_weight",
            want,
            &got,
            &g.t().dot(&case.hidden.mapv(f64::abs)),
        )?;
        for (s, r) in case.map.shards().iter().zip(&actual.ranks) {
            let g = r.grad_weight.as_ref().expect("gathered above");
            if let Some(x) = g
                .slice_axis(Axis(0), Slice::from(s.real..))
                .iter()
                .find(|x| **x != 0.0)
            {
                return fail(
                    "grad_weight",
                    format!("rank {}: a padding row has gradient {x}, not 0", r.rank),
                );
            }
        }
    }
    check_loss(
        algorithm,
        &case.map,
        &expected.ce,
        &terms,
        actual,
        true,
        want_grad,
    )
}

/// Checks `imp`'s sharded embedding on `case`: the output on every rank and
/// the gathered weight gradient equal the unsharded ones exactly; one barrier;
/// out-of-range ids the same error (FAULTS.md V5).
///
/// # Errors
/// The first difference, as a [`Mismatch`].
pub fn check_embedding(imp: &dyn VocabParallel, case: &EmbeddingCase) -> Result<(), Mismatch> {
    check_embedding_with(imp, case, Rule::Terms)
}

/// As [`check_embedding`]; under [`Rule::Relative`] the weight and
/// `grad_output` are rounded to f32 first (a lookup is exact in any
/// precision, so the comparison stays [`Tolerance::EXACT`]).
///
/// # Errors
/// The first difference, as a [`Mismatch`].
pub fn check_embedding_with(
    imp: &dyn VocabParallel,
    case: &EmbeddingCase,
    rule: Rule,
) -> Result<(), Mismatch> {
    let rounded;
    let case = if let Rule::Relative(_) = rule {
        rounded = EmbeddingCase {
            weight: case.weight.mapv(baseline32::round_f32),
            grad_output: case.grad_output.mapv(baseline32::round_f32),
            ..case.clone()
        };
        &rounded
    } else {
        case
    };
    let v = case.map.vocab_size();
    let real = case
        .weight
        .slice_axis(Axis(0), Slice::from(..v.min(case.weight.nrows())));
    let expected = embedding_forward(&case.ids, real).and_then(|out| {
        Ok((
            out,
            embedding_backward(&case.ids, case.grad_output.view(), v)?,
        ))
    });
    let actual = no_panic(&imp.name(), || {
        imp.embedding(
            &case.map,
            &case.ids,
            case.weight.view(),
            Some(case.grad_output.view()),
        )
    })?;
    let Some(((out, gw), actual)) = same_outcome(expected, actual)? else {
        return Ok(());
    };
    let exact = |what: &str, e: &Array2<f64>, a: &Array2<f64>| -> Result<(), Mismatch> {
        if e.shape() != a.shape() {
            return fail(
                what,
                format!("shape {:?}, expected {:?}", a.shape(), e.shape()),
            );
        }
        let (e, a): (Vec<f64>, Vec<f64>) =
            (e.iter().copied().collect(), a.iter().copied().collect());
        assert_close(what, &e, &a, &[e.len()], Tolerance::EXACT)
    };
    if actual.outputs.len() != case.map.num_shards() {
        return fail("ranks", format!("{} ranks answered", actual.outputs.len()));
    }
    for (r, o) in actual.outputs.iter().enumerate() {
        exact(&format!("output (rank {r})"), &out, o)?;
    }
    let Some(got) = actual.grad_weight() else {
        return fail("grad_weight", "missing");
    };
    exact("grad_weight", &gw, &got)?;
    for (r, c) in actual.counts.iter().enumerate() {
        if c.barriers != 1 {
            return fail(
                "collectives",
                format!("rank {r} used {} barriers; the lookup needs 1", c.barriers),
            );
        }
    }
    Ok(())
}

// ---- lower-precision implementations ------------------------------------------

/// How a check judges the values of an implementation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Rule {
    /// f64 implementations: [`TERMS`] (64 ulp of the terms).
    Terms,
    /// Lower-precision implementations: every input is rounded to f32 first
    /// (so the f64 reference and the implementation see the same numbers),
    /// and each loss, per-token loss, `logsumexp` and gradient, on every
    /// rank, is held to the [`RelativeRule`] against the same reference math
    /// run in f32 ([`baseline32`]); padding columns and rows must still be
    /// exactly 0 and the collective counts those of the algorithm.
    Relative(RelativeRule),
}

thread_local! {
    /// The comparisons under [`Rule::Relative`] this thread has made since
    /// [`run_suite_with`] started.
    static RELATIVE: RefCell<RelativeReport> = RefCell::new(RelativeReport::default());
}

fn relative(
    what: &str,
    expected: &[f64],
    baseline: &[f64],
    actual: &[f64],
    shape: &[usize],
    rule: RelativeRule,
) -> Result<(), Mismatch> {
    relative_with_scale(what, expected, baseline, actual, shape, rule, None)
}

/// [`relative`] with a given scale (`None`: the expected tensor's largest value).
fn relative_with_scale(
    what: &str,
    expected: &[f64],
    baseline: &[f64],
    actual: &[f64],
    shape: &[usize],
    rule: RelativeRule,
    scale: Option<f64>,
) -> Result<(), Mismatch> {
    let r = assert_within_k_with_scale(what, expected, baseline, actual, shape, rule, scale)?;
    RELATIVE.with(|rep| rep.borrow_mut().note(what, r));
    Ok(())
}

fn flat64(a: &Array2<f64>) -> Vec<f64> {
    a.iter().copied().collect()
}

fn flat32(a: &Array2<f32>) -> Vec<f64> {
    a.iter().map(|&x| f64::from(x)).collect()
}

/// [`check_loss`] under a [`RelativeRule`], with the f32 baseline `base`.
#[allow(clippy::too_many_arguments)]
fn check_loss_relative(
    algorithm: ShardedAlgorithm,
    map: &ShardMap,
    expected: &CrossEntropy,
    base: &baseline32::CrossEntropy32,
    actual: &ShardedLoss,
    linear: bool,
    want_grad: bool,
    rule: RelativeRule,
    terms: &Terms,
) -> Result<(), Mismatch> {
    let p = map.num_shards();
    // A token's loss is `logsumexp - Σ_j q_j z_j`: two values of the size of
    // the logits that cancel (to ~0 for a confident prediction). An f32
    // kernel may round `logsumexp = m + ln s` at that size (as
    // flash-attention stores `lse`), so the losses' scale is at least the
    // magnitude of their terms and of `logsumexp`, as under [`Rule::Terms`],
    // not only the result's.
    let finite_max = |xs: &[f64]| {
        xs.iter()
            .copied()
            .filter(|x| x.is_finite())
            .fold(0.0, f64::max)
    };
    let loss_scale = |own: &[f64], t: &[f64]| {
        let scale = finite_max(own).max(finite_max(t));
        (scale > 0.0).then_some(scale)
    };
    if actual.ranks.len() != p {
        return fail(
            "ranks",
            format!("{} ranks answered, {p} expected", actual.ranks.len()),
        );
    }
    let n = expected.per_token_loss.len();
    let lse = expected.logsumexp();
    let b_lse: Vec<f64> = base.logsumexp.iter().map(|&x| f64::from(x)).collect();
    let b_tok: Vec<f64> = base.per_token_loss.iter().map(|&x| f64::from(x)).collect();
    for r in &actual.ranks {
        let at = |what: &str| format!("{what} (rank {})", r.rank);
        relative_with_scale(
            &at("loss"),
            &[expected.loss],
            &[f64::from(base.loss)],
            &[r.loss],
            &[1],
            rule,
            loss_scale(
                &[expected.loss],
                &[terms.loss, finite_max(&terms.logsumexp)],
            ),
        )?;
        relative_with_scale(
            &at("per_token_loss"),
            expected.per_token_loss.as_slice().unwrap_or(&[]),
            &b_tok,
            &r.per_token_loss.to_vec(),
            &[n],
            rule,
            loss_scale(
                expected.per_token_loss.as_slice().unwrap_or(&[]),
                &[
                    finite_max(&terms.per_token_loss),
                    finite_max(&terms.logsumexp),
                ],
            ),
        )?;
        let got_lse: Vec<f64> = r.global.iter().map(|g| g.logsumexp()).collect();
        if got_lse.len() == n {
            relative(
                &at("logsumexp"),
                lse.as_slice().unwrap_or(&[]),
                &b_lse,
                &got_lse,
                &[n],
                rule,
            )?;
        } else if !got_lse.is_empty() {
            return fail(
                at("logsumexp"),
                format!("{} rows, {n} expected", got_lse.len()),
            );
        }
    }
    if let Some(want) = &expected.grad_logits {
        let Some(got) = actual.grad_logits() else {
            return fail("grad_logits", "missing");
        };
        let Some(b) = &base.grad_logits else {
            return fail("grad_logits", "the baseline has none");
        };
        if got.shape() != want.shape() {
            return fail(
                "grad_logits",
                format!("shape {:?}, expected {:?}", got.shape(), want.shape()),
            );
        }
        // `p - q` cancels (to exactly 0 where `p = q`): at least the terms' scale.
        let scale = finite_max(&flat64(want)).max(finite_max(&flat64(&terms.grad_logits)));
        relative_with_scale(
            "grad_logits",
            &flat64(want),
            &flat32(b),
            &flat64(&got),
            want.shape(),
            rule,
            (scale > 0.0).then_some(scale),
        )?;
        for (s, r) in map.shards().iter().zip(&actual.ranks) {
            let g = r.grad_logits.as_ref().expect("gathered above");
            let padding = g.slice_axis(Axis(1), Slice::from(s.real..));
            if let Some(x) = padding.iter().find(|x| **x != 0.0) {
                return fail(
                    "grad_logits",
                    format!("rank {}: a padding column has gradient {x}, not 0", r.rank),
                );
            }
        }
    }
    check_counts(algorithm, actual, linear, want_grad)
}

fn check_cross_entropy_relative(
    imp: &dyn VocabParallel,
    algorithm: ShardedAlgorithm,
    case: &CeCase,
    want_grad: bool,
    rule: RelativeRule,
) -> Result<(), Mismatch> {
    let case = CeCase {
        logits: case.logits.mapv(baseline32::round_f32),
        ..case.clone()
    };
    let v = case.map.vocab_size();
    let real = case
        .logits
        .slice_axis(Axis(1), Slice::from(..v.min(case.logits.ncols())));
    let expected = cross_entropy(real, &case.targets, &case.config, want_grad);
    let actual = no_panic(&imp.name(), || {
        imp.cross_entropy(
            algorithm,
            &case.map,
            case.logits.view(),
            &case.targets,
            &case.config,
            want_grad,
        )
    })?;
    let Some((expected, actual)) = same_outcome(expected, actual)? else {
        return Ok(());
    };
    let real32 = real.mapv(|x| x as f32);
    let base = baseline32::cross_entropy(real32.view(), &case.targets, &case.config, want_grad);
    let terms = Terms::new(real, &case.targets, &case.config, &expected);
    check_loss_relative(
        algorithm, &case.map, &expected, &base, &actual, false, want_grad, rule, &terms,
    )
}

fn check_linear_relative(
    imp: &dyn VocabParallel,
    algorithm: ShardedAlgorithm,
    case: &LinearCase,
    want_grad: bool,
    rule: RelativeRule,
) -> Result<(), Mismatch> {
    let case = LinearCase {
        hidden: case.hidden.mapv(baseline32::round_f32),
        weight: case.weight.mapv(baseline32::round_f32),
        ..case.clone()
    };
    let v = case.map.vocab_size();
    let real = case
        .weight
        .slice_axis(Axis(0), Slice::from(..v.min(case.weight.nrows())));
    let expected = linear_cross_entropy(
        case.hidden.view(),
        real,
        &case.targets,
        &case.config,
        want_grad,
    );
    let actual = no_panic(&imp.name(), || {
        imp.linear_cross_entropy(
            algorithm,
            &case.map,
            case.hidden.view(),
            case.weight.view(),
            &case.targets,
            &case.config,
            want_grad,
        )
    })?;
    let Some((expected, actual)) = same_outcome(expected, actual)? else {
        return Ok(());
    };
    let (h32, w32) = (case.hidden.mapv(|x| x as f32), real.mapv(|x| x as f32));
    let (base, base_grads) = baseline32::linear_cross_entropy(
        h32.view(),
        w32.view(),
        &case.targets,
        &case.config,
        want_grad,
    );
    let terms = Terms::new(
        expected.logits.view(),
        &case.targets,
        &case.config,
        &expected.ce,
    );
    // The gradients are sums over the vocabulary (`dL/dhidden`) or the
    // tokens (`dL/dW`) of terms `|dL/dz| x |W|` or `|dL/dz| x |hidden|` that
    // can cancel to ~0 (exactly 0 by symmetry): their scale is at least the
    // terms' magnitude, as under [`Rule::Terms`].
    let abs_w = real.mapv(f64::abs);
    let abs_h = case.hidden.mapv(f64::abs);
    let max_of = |a: &Array2<f64>| {
        a.iter()
            .copied()
            .filter(|x| x.is_finite())
            .fold(0.0, f64::max)
    };
    let hidden_scale = max_of(&terms.grad_logits.dot(&abs_w));
    let weight_scale = max_of(&terms.grad_logits.t().dot(&abs_h));
    let with_floor = |want: &Array2<f64>, floor: f64| {
        let s = max_of(want).max(floor);
        (s > 0.0).then_some(s)
    };
    if let (Some(want), Some((bh, _))) = (&expected.grad_hidden, &base_grads) {
        for r in &actual.ranks {
            let Some(got) = &r.grad_hidden else {
                return fail("grad_hidden", format!("rank {}: missing", r.rank));
            };
            if got.shape() != want.shape() {
                return fail(
                    "grad_hidden",
                    format!("shape {:?}, expected {:?}", got.shape(), want.shape()),
                );
            }
            relative_with_scale(
                &format!("grad_hidden (rank {})", r.rank),
                &flat64(want),
                &flat32(bh),
                &flat64(got),
                want.shape(),
                rule,
                with_floor(want, hidden_scale),
            )?;
        }
    }
    if let (Some(want), Some((_, bw))) = (&expected.grad_weight, &base_grads) {
        let Some(got) = actual.grad_weight() else {
            return fail("grad_weight", "missing");
        };
        if got.shape() != want.shape() {
            return fail(
                "grad_weight",
                format!("shape {:?}, expected {:?}", got.shape(), want.shape()),
            );
        }
        relative_with_scale(
            "grad_weight",
            &flat64(want),
            &flat32(bw),
            &flat64(&got),
            want.shape(),
            rule,
            with_floor(want, weight_scale),
        )?;
        for (s, r) in case.map.shards().iter().zip(&actual.ranks) {
            let g = r.grad_weight.as_ref().expect("gathered above");
            if let Some(x) = g
                .slice_axis(Axis(0), Slice::from(s.real..))
                .iter()
                .find(|x| **x != 0.0)
            {
                return fail(
                    "grad_weight",
                    format!("rank {}: a padding row has gradient {x}, not 0", r.rank),
                );
            }
        }
    }
    check_loss_relative(
        algorithm,
        &case.map,
        &expected.ce,
        &base,
        &actual,
        true,
        want_grad,
        rule,
        &terms,
    )
}

// ---- the FAULTS.md examples --------------------------------------------------

/// FAULTS.md V1 logits (`V = 8`, target 4).
pub const V1_LOGITS: [f64; 8] = [1.0, 2.0, 0.0, -1.0, 3.0, 0.5, 1.5, -2.0];
/// FAULTS.md V2 logits (`V = 10`, target 7).
pub const V2_LOGITS: [f64; 10] = [2.0, 1.0, 0.5, 3.0, -1.0, 0.0, 1.5, 2.5, -0.5, 1.0];

fn row(z: &[f64]) -> Array2<f64> {
    Array2::from_shape_vec((1, z.len()), z.to_vec()).expect("one row")
}

fn map(v: usize, p: usize, layout: ShardLayout) -> ShardMap {
    ShardMap::new(v, p, layout).expect("a valid example map")
}

const LAYOUTS: [ShardLayout; 2] = [ShardLayout::Uneven, ShardLayout::Padded];

/// Checks the values FAULTS.md states, through `imp`, on every rank, for
/// every algorithm it implements: V1 (both conventions, `p` in 1..=8, both
/// layouts), V2 (padded 10 → 12 over 3, whatever the padding holds), V3
/// (`∂L/∂x`), V4 (`V = 250682` over 8, both layouts, equal to unsharded), V5
/// (ids `V` and `-1`), V6 (an all `-inf` shard; an all-padding shard). Each is
/// also compared with the unsharded reference by the checks above.
///
/// # Errors
/// The first failure, named by its FAULTS.md entry.
pub fn check_fault_values(imp: &dyn VocabParallel) -> Result<(), Mismatch> {
    check_fault_values_with(imp, Rule::Terms)
}

/// As [`check_fault_values`], every comparison under `rule`.
///
/// # Errors
/// The first failure, named by its FAULTS.md entry.
pub fn check_fault_values_with(imp: &dyn VocabParallel, rule: Rule) -> Result<(), Mismatch> {
    let named = |name: &str, m: Mismatch| Mismatch::new(format!("{name}: {}", m.what), m.detail);
    for algorithm in imp.algorithms() {
        // V1: label smoothing with the global vocabulary size.
        for (convention, want) in [
            (SmoothingConvention::PyTorch, "0.87051"),
            (SmoothingConvention::Megatron, "0.90444"),
        ] {
            let config = LossConfig::default().with_smoothing(0.1, convention);
            for p in 1..=8 {
                for layout in LAYOUTS {
                    let case = CeCase {
                        map: map(8, p, layout),
                        logits: row(&V1_LOGITS),
                        targets: vec![4],
                        config,
                    };
                    let name = format!(
                        "V1 {algorithm} {} p {p} {}",
                        convention.name(),
                        layout.name()
                    );
                    check_cross_entropy_with(imp, algorithm, &case, true, rule)
                        .map_err(|m| named(&name, m))?;
                    let out = imp
                        .cross_entropy(
                            algorithm,
                            &case.map,
                            case.logits.view(),
                            &[4],
                            &config,
                            false,
                        )
                        .map_err(|e| Mismatch::new(&name, e.to_string()))?;
                    for r in &out.ranks {
                        if format!("{:.5}", r.loss) != want {
                            return fail(
                                &name,
                                format!(
                                    "rank {}: loss {:.5}, FAULTS.md says {want}",
                                    r.rank, r.loss
                                ),
                            );
                        }
                    }
                }
            }
        }
        // V2: the padded entries never enter the softmax.
        for padding in [
            [0.0, 0.0],
            [9.0, -4.0],
            [1e4, 1e4],
            [f64::NAN, f64::INFINITY],
        ] {
            let mut z = V2_LOGITS.to_vec();
            z.extend(padding);
            let case = CeCase {
                map: map(10, 3, ShardLayout::Padded),
                logits: row(&z),
                targets: vec![7],
                config: LossConfig::default(),
            };
            let name = format!("V2 {algorithm} padding {padding:?}");
            check_cross_entropy_with(imp, algorithm, &case, true, rule)
                .map_err(|m| named(&name, m))?;
            let out = imp
                .cross_entropy(
                    algorithm,
                    &case.map,
                    case.logits.view(),
                    &[7],
                    &case.config,
                    false,
                )
                .map_err(|e| Mismatch::new(&name, e.to_string()))?;
            if format!("{:.6}", out.loss()) != "1.474030" {
                return fail(
                    &name,
                    format!("loss {:.6}, FAULTS.md says 1.474030", out.loss()),
                );
            }
        }
        // V3: the input gradient is summed over the shards, on every rank.
        let case = LinearCase {
            map: map(4, 2, ShardLayout::Uneven),
            hidden: row(&[1.0, -1.0]),
            weight: Array2::from_shape_vec((4, 2), vec![1.0, 0.0, 0.0, 1.0, 0.5, 0.5, -1.0, 2.0])
                .expect("4 x 2"),
            targets: vec![2],
            config: LossConfig::default(),
        };
        let name = format!("V3 {algorithm}");
        check_linear_with(imp, algorithm, &case, true, rule).map_err(|m| named(&name, m))?;
        let out = imp
            .linear_cross_entropy(
                algorithm,
                &case.map,
                case.hidden.view(),
                case.weight.view(),
                &[2],
                &case.config,
                true,
            )
            .map_err(|e| Mismatch::new(&name, e.to_string()))?;
        for r in &out.ranks {
            let g = r
                .grad_hidden
                .as_ref()
                .map(|g| format!("{:.4} {:.4}", g[[0, 0]], g[[0, 1]]));
            if g.as_deref() != Some("0.2661 -0.2661") {
                return fail(
                    &name,
                    format!(
                        "rank {}: dL/dx {g:?}, FAULTS.md says [0.2661, -0.2661]",
                        r.rank
                    ),
                );
            }
        }
        // V4: V = 250682 over 8 shards, targets on the first, a middle and the last shard.
        for layout in LAYOUTS {
            let v = 250_682;
            let logits = Array2::from_shape_fn((2, v), |(i, j)| {
                ((i * 7 + j * 13) % 101) as f64 / 17.0 - 3.0
            });
            let case = CeCase {
                map: map(v, 8, layout),
                logits,
                targets: vec![0, v as i64 - 1],
                config: LossConfig::default().with_smoothing(0.1, SmoothingConvention::PyTorch),
            };
            check_cross_entropy_with(imp, algorithm, &case, true, rule)
                .map_err(|m| named(&format!("V4 {algorithm} {}", layout.name()), m))?;
            let hidden = Array2::from_shape_fn((3, 2), |(i, k)| i as f64 * 0.5 - k as f64);
            let weight =
                Array2::from_shape_fn((v, 2), |(j, k)| ((j * 3 + k * 5) % 23) as f64 / 11.0 - 1.0);
            let case = LinearCase {
                map: case.map,
                hidden,
                weight,
                targets: vec![125_000, -100, 31_336],
                config: LossConfig::default(),
            };
            check_linear_with(imp, algorithm, &case, true, rule)
                .map_err(|m| named(&format!("V4 linear {algorithm} {}", layout.name()), m))?;
        }
        // V6: a shard whose logits are all -inf, and a shard that is all padding.
        let inf = f64::NEG_INFINITY;
        let case = CeCase {
            map: map(8, 2, ShardLayout::Uneven),
            logits: row(&[1.0, 2.0, 0.0, -1.0, inf, inf, inf, inf]),
            targets: vec![1],
            config: LossConfig::default(),
        };
        check_cross_entropy_with(imp, algorithm, &case, true, rule)
            .map_err(|m| named(&format!("V6 {algorithm} all -inf shard"), m))?;
        let case = CeCase {
            map: map(9, 4, ShardLayout::Padded),
            logits: row(&[0.5, -1.0, 2.0, 1.0, 0.0, 3.0, -2.0, 1.5, 0.25]),
            targets: vec![5],
            config: LossConfig::default(),
        };
        check_cross_entropy_with(imp, algorithm, &case, true, rule)
            .map_err(|m| named(&format!("V6 {algorithm} all-padding shard"), m))?;
    }
    // V5: id == V or negative is an error in both layers.
    let weight = Array2::from_shape_fn((5, 3), |(j, k)| (j * 3 + k) as f64);
    for layout in LAYOUTS {
        for p in [1, 2, 4] {
            for bad in [5, -1] {
                let case = EmbeddingCase {
                    map: map(5, p, layout),
                    ids: vec![0, bad, 4],
                    weight: weight.clone(),
                    grad_output: Array2::ones((3, 3)),
                };
                let name = format!("V5 id {bad} p {p} {}", layout.name());
                check_embedding_with(imp, &case, rule).map_err(|m| named(&name, m))?;
                if imp
                    .embedding(&case.map, &case.ids, weight.view(), None)
                    .is_ok()
                {
                    return fail(&name, "an out-of-range id must be an error");
                }
            }
        }
    }
    Ok(())
}

// ---- random cases ------------------------------------------------------------

/// Largest `n` (tokens) of a random case.
pub const MAX_N: usize = 9;
/// Largest `v` of a random case.
pub const MAX_V: usize = 41;
/// Largest `h` of a random case.
pub const MAX_H: usize = 6;
/// Largest `p` of a random case.
pub const MAX_P: usize = 8;

/// A shard map: `v` in `1..=MAX_V` (primes weighted up), `p` in
/// `1..=min(MAX_P, v)`, either layout.
pub fn shard_maps() -> impl Strategy<Value = ShardMap> {
    let vocab = prop_oneof![
        2 => prop::sample::select(vec![1usize, 2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41]),
        1 => 1usize..=MAX_V,
    ];
    (vocab, prop::sample::select(LAYOUTS.to_vec()))
        .prop_flat_map(|(v, layout)| (Just(v), 1usize..=v.min(MAX_P), Just(layout)))
        .prop_map(|(v, p, layout)| ShardMap::new(v, p, layout).expect("p <= v"))
}

/// Loss options: `ignore_index` -100 or -1; no smoothing half the time, else
/// `a` in `[0, 1]` in either convention; z-loss 0 or up to 0.1; any reduction.
pub fn loss_configs() -> impl Strategy<Value = LossConfig> {
    (
        prop::sample::select(vec![-100i64, -1]),
        prop_oneof![1 => Just(0.0), 1 => 0.0f64..=1.0],
        prop::sample::select(vec![
            SmoothingConvention::PyTorch,
            SmoothingConvention::Megatron,
        ]),
        prop_oneof![2 => Just(0.0), 1 => 1e-4f64..0.1],
        prop::sample::select(vec![Reduction::Mean, Reduction::Sum, Reduction::None]),
    )
        .prop_map(
            |(ignore_index, a, smoothing, z_loss, reduction)| LossConfig {
                ignore_index,
                label_smoothing: a,
                smoothing,
                z_loss,
                reduction,
            },
        )
}

/// A logit: mostly in `[-8, 8]`; small integers (ties at the maximum); planted
/// `±1e4`; `-inf` (masked).
pub fn logit() -> impl Strategy<Value = f64> {
    prop_oneof![
        16 => -8.0f64..8.0,
        3 => (-3i32..=3).prop_map(f64::from),
        1 => Just(1e4),
        1 => Just(-1e4),
        2 => Just(f64::NEG_INFINITY),
    ]
}

/// What a padding column or row holds: anything (it must never be read).
pub fn padding_value() -> impl Strategy<Value = f64> {
    prop_oneof![
        2 => -8.0f64..8.0,
        1 => Just(1e4),
        1 => Just(f64::NAN),
        1 => Just(f64::INFINITY),
    ]
}

/// A target: in range mostly, `ignore_index` sometimes, rarely out of range
/// (`v`, or -5) to exercise the errors.
fn target(v: usize, ignore: i64) -> impl Strategy<Value = i64> {
    prop_oneof![
        160 => 0..v as i64,
        30 => Just(ignore),
        1 => Just(v as i64),
        1 => Just(-5i64),
    ]
}

/// Rows with one shard's real logits all set to `-inf` (FAULTS.md V6).
fn masked_shards(n: usize, p: usize) -> impl Strategy<Value = Vec<Option<usize>>> {
    prop::collection::vec(prop_oneof![5 => Just(None), 1 => (0..p).prop_map(Some)], n)
}

/// Random cross-entropy cases: sizes first (`map`, `n`), then logits with
/// planted `±1e4` and `-inf`, whole shards masked to `-inf`, padding columns
/// holding anything, targets on every shard and ignored.
pub fn ce_cases() -> impl Strategy<Value = CeCase> {
    (shard_maps(), 1usize..=MAX_N, loss_configs())
        .prop_flat_map(|(map, n, config)| {
            let (v, w) = (map.vocab_size(), map.padded_vocab_size());
            (
                Just(map),
                Just(config),
                prop::collection::vec(logit(), n * v),
                prop::collection::vec(padding_value(), n * (w - v)),
                prop::collection::vec(target(v, config.ignore_index), n),
                masked_shards(n, map.num_shards()),
            )
        })
        .prop_map(|(map, config, real, padding, targets, masks)| {
            let (v, w) = (map.vocab_size(), map.padded_vocab_size());
            let n = targets.len();
            let mut logits = Array2::from_shape_fn((n, w), |(i, j)| {
                if j < v {
                    real[i * v + j]
                } else {
                    padding[i * (w - v) + j - v]
                }
            });
            for (i, mask) in masks.iter().enumerate() {
                if let Some(r) = mask {
                    let s = map.shard(*r);
                    for j in s.start..s.start + s.real {
                        logits[[i, j]] = f64::NEG_INFINITY;
                    }
                }
            }
            CeCase {
                map,
                logits,
                targets,
                config,
            }
        })
}

/// A hidden or weight value: mostly in `[-2, 2]`, planted `±100` (so that a
/// logit reaches `±1e4`).
pub fn activation() -> impl Strategy<Value = f64> {
    prop_oneof![12 => -2.0f64..2.0, 1 => Just(100.0), 1 => Just(-100.0)]
}

/// Random output-layer cases: `h` in `1..=MAX_H`, planted outliers, padding
/// rows holding anything.
pub fn linear_cases() -> impl Strategy<Value = LinearCase> {
    (shard_maps(), 1usize..=MAX_N, 1usize..=MAX_H, loss_configs())
        .prop_flat_map(|(map, n, h, config)| {
            let (v, w) = (map.vocab_size(), map.padded_vocab_size());
            (
                Just(map),
                Just(config),
                prop::collection::vec(activation(), n * h),
                prop::collection::vec(activation(), v * h),
                prop::collection::vec(padding_value(), (w - v) * h),
                prop::collection::vec(target(v, config.ignore_index), n),
            )
        })
        .prop_map(|(map, config, x, wr, wp, targets)| {
            let n = targets.len();
            let h = x.len() / n;
            let (v, w) = (map.vocab_size(), map.padded_vocab_size());
            let hidden = Array2::from_shape_vec((n, h), x).expect("n x h");
            let weight = Array2::from_shape_fn((w, h), |(j, k)| {
                if j < v {
                    wr[j * h + k]
                } else {
                    wp[(j - v) * h + k]
                }
            });
            LinearCase {
                map,
                hidden,
                weight,
                targets,
                config,
            }
        })
}

/// Random embedding cases: ids mostly in range, rarely `v` or `-1`.
pub fn embedding_cases() -> impl Strategy<Value = EmbeddingCase> {
    (shard_maps(), 0usize..=MAX_N, 1usize..=MAX_H)
        .prop_flat_map(|(map, n, h)| {
            let (v, w) = (map.vocab_size(), map.padded_vocab_size());
            (
                Just(map),
                prop::collection::vec(
                    prop_oneof![30 => 0..v as i64, 1 => Just(v as i64), 1 => Just(-1i64)],
                    n,
                ),
                prop::collection::vec(-2.0f64..2.0, v * h),
                prop::collection::vec(padding_value(), (w - v) * h),
                prop::collection::vec(-1.0f64..1.0, n * h),
                Just(h),
            )
        })
        .prop_map(|(map, ids, wr, wp, g, h)| {
            let (v, w) = (map.vocab_size(), map.padded_vocab_size());
            let weight = Array2::from_shape_fn((w, h), |(j, k)| {
                if j < v {
                    wr[j * h + k]
                } else {
                    wp[(j - v) * h + k]
                }
            });
            let grad_output = Array2::from_shape_vec((ids.len(), h), g).expect("n x h");
            EmbeddingCase {
                map,
                ids,
                weight,
                grad_output,
            }
        })
}

/// What the random part of a [`run_suite`] exercised; the suite fails when a
/// kind of input it must cover did not occur.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Coverage {
    /// Cases run (each once per algorithm).
    pub cases: u32,
    /// Cases where both sides succeeded and were compared value by value.
    pub compared: u32,
    /// Cases where both sides failed alike.
    pub errors: u32,
    /// Compared cases with a target in the first / a middle / the last shard (of `p > 1`).
    pub target_shards: [u32; 3],
    /// Compared cases with an ignored target.
    pub ignored: u32,
    /// Compared cases with label smoothing, with z-loss.
    pub smoothing: u32,
    /// Compared cases with z-loss.
    pub z_loss: u32,
    /// Compared cases with a `±1e4` logit.
    pub huge: u32,
    /// Compared cases with a shard whose logits are all `-inf` (masked or all padding).
    pub empty_shard: u32,
    /// Compared cases with `p` not dividing `v`.
    pub uneven: u32,
    /// Compared cases in the padded layout with padding.
    pub padded: u32,
    /// The largest difference seen over the whole run (FAULTS.md cases and
    /// random ones), in ulp of `|expected| + terms` (the tolerance is 64).
    pub worst_ulps: f64,
    /// Under [`Rule::Relative`]: the comparisons of the whole run.
    pub relative: RelativeReport,
}

impl Coverage {
    fn note(
        &mut self,
        map: &ShardMap,
        logits: ArrayView2<f64>,
        targets: &[i64],
        config: &LossConfig,
    ) {
        self.compared += 1;
        let (v, p) = (map.vocab_size(), map.num_shards());
        for &t in targets {
            if t == config.ignore_index {
                continue;
            }
            if let Some((r, _)) = map.owner(t as usize).filter(|_| p > 1) {
                let slot = if r == 0 {
                    0
                } else if r == p - 1 {
                    2
                } else {
                    1
                };
                self.target_shards[slot] += 1;
            }
        }
        self.ignored += u32::from(targets.contains(&config.ignore_index));
        self.smoothing += u32::from(config.label_smoothing > 0.0);
        self.z_loss += u32::from(config.z_loss > 0.0);
        let real = logits.slice_axis(Axis(1), Slice::from(..v));
        self.huge += u32::from(real.iter().any(|x| x.abs() == 1e4));
        let empty = map.shards().iter().any(|s| {
            logits
                .rows()
                .into_iter()
                .any(|row| (s.start..s.start + s.real).all(|j| row[j] == f64::NEG_INFINITY))
        });
        self.empty_shard += u32::from(empty);
        self.uneven += u32::from(v % p != 0);
        self.padded += u32::from(map.padded_vocab_size() > v);
    }

    /// Fails unless every kind of input occurred at least `min` times.
    ///
    /// # Errors
    /// A [`Mismatch`] naming the first kind that did not.
    pub fn require(&self, min: u32) -> Result<(), Mismatch> {
        let kinds = [
            ("compared cases", self.compared),
            ("cases failing alike", self.errors),
            ("targets on the first shard", self.target_shards[0]),
            ("targets on a middle shard", self.target_shards[1]),
            ("targets on the last shard", self.target_shards[2]),
            ("ignored targets", self.ignored),
            ("label smoothing", self.smoothing),
            ("z-loss", self.z_loss),
            ("+-1e4 logits", self.huge),
            ("all -inf shards", self.empty_shard),
            ("p not dividing v", self.uneven),
            ("padded vocabularies", self.padded),
        ];
        for (kind, count) in kinds {
            if count < min {
                return fail("coverage", format!("only {count} cases with {kind} (at least {min} needed): the suite would pass vacuously"));
            }
        }
        Ok(())
    }
}

fn runner(cases: u32) -> TestRunner {
    TestRunner::new_with_rng(
        Config {
            cases,
            failure_persistence: None,
            ..Config::default()
        },
        proptest::test_runner::TestRng::deterministic_rng(
            proptest::test_runner::RngAlgorithm::ChaCha,
        ),
    )
}

/// The whole suite for one implementation: [`check_fault_values`], then
/// `cases` random cases of each layer, every algorithm of `imp`, with and
/// without gradients; the coverage of the random cases must reach a few of
/// each kind. Deterministic (fixed seed), so a failure reproduces.
///
/// # Errors
/// The first failure, with the (shrunk) case that produced it.
pub fn run_suite(imp: &dyn VocabParallel, cases: u32) -> Result<Coverage, Mismatch> {
    run_suite_with(imp, cases, Rule::Terms)
}

/// As [`run_suite`] with every comparison under `rule`; with
/// [`Rule::Relative`] also the suite tier of the [`RelativeRule`] over all
/// comparisons of the run (in [`Coverage::relative`]).
///
/// # Errors
/// The first failure, with the (shrunk) case that produced it.
pub fn run_suite_with(
    imp: &dyn VocabParallel,
    cases: u32,
    rule: Rule,
) -> Result<Coverage, Mismatch> {
    WORST_ULPS.with(|w| w.set(0.0));
    RELATIVE.with(|r| *r.borrow_mut() = RelativeReport::default());
    check_fault_values_with(imp, rule)?;
    let coverage = RefCell::new(Coverage::default());
    let to_case_error = |m: Mismatch| TestCaseError::fail(m.to_string());
    let suite =
        |what: &str, e: String| Mismatch::new(format!("{} vocab suite ({what})", imp.name()), e);
    runner(cases)
        .run(&(ce_cases(), any::<bool>()), |(case, want_grad)| {
            for algorithm in imp.algorithms() {
                check_cross_entropy_with(imp, algorithm, &case, want_grad, rule)
                    .map_err(to_case_error)?;
            }
            let mut c = coverage.borrow_mut();
            c.cases += 1;
            let v = case.map.vocab_size();
            let real = case.logits.slice_axis(Axis(1), Slice::from(..v));
            if cross_entropy(real, &case.targets, &case.config, false).is_ok() {
                c.note(&case.map, case.logits.view(), &case.targets, &case.config);
            } else {
                c.errors += 1;
            }
            Ok(())
        })
        .map_err(|e| suite("cross_entropy", e.to_string()))?;
    runner(cases)
        .run(&(linear_cases(), any::<bool>()), |(case, want_grad)| {
            for algorithm in imp.algorithms() {
                check_linear_with(imp, algorithm, &case, want_grad, rule).map_err(to_case_error)?;
            }
            Ok(())
        })
        .map_err(|e| suite("linear_cross_entropy", e.to_string()))?;
    runner(cases)
        .run(&embedding_cases(), |case| {
            check_embedding_with(imp, &case, rule).map_err(to_case_error)
        })
        .map_err(|e| suite("embedding", e.to_string()))?;
    let mut coverage = coverage.into_inner();
    coverage.worst_ulps = WORST_ULPS.with(|w| w.get());
    coverage.relative = RELATIVE.with(|r| r.borrow().clone());
    coverage.require(2)?;
    if let Rule::Relative(rule) = rule {
        coverage.relative.require_nonvacuous(100)?;
        coverage
            .relative
            .totals
            .check(&format!("{} relative vocab suite", imp.name()), rule)?;
    }
    Ok(coverage)
}

/// The largest difference this thread's [`TERMS`] comparisons have seen since
/// the last call, in ulp of `|expected| + terms` (the tolerance is 64), and
/// resets it. The fuzz bodies report it per case
/// ([`crate::fuzz::Outcome::worst`]).
pub fn take_worst_ulps() -> f64 {
    WORST_ULPS.with(|w| w.replace(0.0))
}
