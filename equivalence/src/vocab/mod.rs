//! Checks for vocabulary-parallel cross-entropy, the output layer and the
//! input embedding: *sharded == unsharded* for the loss, the per-token loss,
//! `logsumexp` and every gradient, on every rank, plus the collective counts
//! (docs/FAULTS.md V1–V6).
//!
//! An implementation provides [`VocabParallel`] (the reference one is
//! [`Reference`]); [`check_cross_entropy`], [`check_linear`] and
//! [`check_embedding`] compare one case against the unsharded f64 reference
//! of `packshard-reference`; [`run_suite`] drives them over the docs/FAULTS.md
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

use std::borrow::Cow;
use std::cell::RefCell;
use std::panic::{catch_unwind, AssertUnwindSafe};

use ndarray::{Array2, ArrayView2, Axis, Slice};
use packshard_reference::ops::{
    CeCall, CrossEntropyOp, EmbeddingCall, EmbeddingOp, LinearCall, LinearCrossEntropyOp,
    LinearInput, LossSupport, TradedError,
};
use packshard_reference::vocab::cross_entropy::LinearCrossEntropy;
use packshard_reference::vocab::embedding::{embedding_backward, embedding_forward};
use packshard_reference::vocab::sharded::{RankLoss, ShardedLoss};
use packshard_reference::vocab::{
    cross_entropy, linear_cross_entropy, CrossEntropy, GradRequest, LossCall, LossConfig,
    Reduction, ShardLayout, ShardMap, ShardPlan, ShardedAlgorithm, SmoothingConvention,
};
use packshard_reference::Error;
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

pub use crate::attention::RelativeReport;
use crate::baseline32;
use crate::compare::{
    assert_close, assert_within_k, Allowance, Judge, Mismatch, RelativeRule, Tolerance,
};

/// The name failures give the implementation under test (the registry
/// adds the entry's name).
const IMPL: &str = "implementation";

/// A cross-entropy case: `logits: [n, w]` (`w >= v`, columns `v..` padding
/// values), `targets: [n]`, an optional upstream gradient.
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
    /// The upstream gradient the gradients are asked with: `[n]` for the
    /// reduction `none`, `[1]` otherwise ([`GradRequest::Upstream`];
    /// docs/FAULTS.md O2). `None`: the gradients of the loss itself.
    pub grad_output: Option<Vec<f64>>,
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
    /// The upstream gradient, as [`CeCase::grad_output`].
    pub grad_output: Option<Vec<f64>>,
}

impl CeCase {
    /// `logits: [n, w]` split by `map`, `targets: [n]`, the default loss
    /// options, the gradients of the loss itself.
    pub fn new(map: ShardMap, logits: Array2<f64>, targets: Vec<i64>) -> Self {
        CeCase {
            map,
            logits,
            targets,
            config: LossConfig::default(),
            grad_output: None,
        }
    }

    /// The case's loss call, asking for gradients when `want_grad` (with
    /// the case's upstream gradient, where it has one).
    pub fn call(&self, want_grad: bool) -> LossCall<'_> {
        let grad = GradRequest::of(want_grad, self.grad_output.as_deref());
        LossCall::new(&self.targets, &self.config, grad)
    }
}

impl LinearCase {
    /// The weight's real rows, `[v, h]`: the padding rows `v..` of a padded
    /// split cut off (all of it where it has fewer rows than `v`).
    pub fn real_weight(&self) -> ArrayView2<'_, f64> {
        let v = self.map.vocab_size().min(self.weight.nrows());
        self.weight.slice_axis(Axis(0), Slice::from(..v))
    }

    /// As [`CeCase::call`].
    pub fn call(&self, want_grad: bool) -> LossCall<'_> {
        let grad = GradRequest::of(want_grad, self.grad_output.as_deref());
        LossCall::new(&self.targets, &self.config, grad)
    }

    /// The case's hidden states and weight as the op's input.
    pub fn input(&self) -> LinearInput<'_> {
        LinearInput::new(self.hidden.view(), self.weight.view())
    }
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

/// A rank's `grad_hidden`, or the mismatch of its absence.
pub(super) fn rank_grad_hidden(r: &RankLoss) -> Result<&Array2<f64>, Mismatch> {
    match &r.grad_hidden {
        Some(g) => Ok(g),
        None => fail("grad_hidden", format!("rank {}: missing", r.rank)),
    }
}

/// Every rank's weight-gradient rows past its real vocabulary (padding) are
/// exactly 0.
pub(super) fn padding_rows_have_no_gradient(
    map: &ShardMap,
    actual: &ShardedLoss,
) -> Result<(), Mismatch> {
    for (s, r) in map.shards().iter().zip(&actual.ranks) {
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
    Ok(())
}

/// Every rank's logit-gradient columns past its real vocabulary (padding)
/// are exactly 0.
pub(super) fn padding_columns_have_no_gradient(
    map: &ShardMap,
    actual: &ShardedLoss,
) -> Result<(), Mismatch> {
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
    Ok(())
}

/// `got` has the shape of `want`, or the mismatch names `what`.
pub(super) fn same_shape(what: &str, got: &[usize], want: &[usize]) -> Result<(), Mismatch> {
    if got != want {
        return fail(what, format!("shape {got:?}, expected {want:?}"));
    }
    Ok(())
}

fn fail<T>(what: impl Into<String>, detail: impl Into<String>) -> Result<T, Mismatch> {
    Err(Mismatch::new(what, detail))
}

/// Runs `f`, turning a panic into a [`Mismatch`] (an implementation must
/// never panic: an assertion on divisibility is docs/FAULTS.md V4).
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

/// An implementation that declares an option of `call` unsupported
/// ([`LossSupport`]) must refuse the call, never answer it (no silent
/// fallback): `Some(check)` with the check that it failed — with the
/// reference's error where the reference fails too, else an
/// [`Error::InvalidArgument`] naming the option (`softcap`, `grad_output`)
/// — and `None` when the call is supported (it is then compared as usual).
fn refused<T>(
    support: LossSupport,
    call: &LossCall,
    reference_ok: impl FnOnce() -> bool,
    actual: impl FnOnce() -> Result<T, Error>,
) -> Option<Result<(), Mismatch>> {
    if support.covers(call) {
        return None;
    }
    let option = if support.softcap || call.config.softcap.is_none() {
        "grad_output"
    } else {
        "softcap"
    };
    let ok = reference_ok();
    Some(match no_panic(IMPL, actual) {
        Err(m) => Err(m),
        Ok(Ok(_)) => fail(
            option,
            format!("the implementation declares no {option} yet answered a call with one"),
        ),
        Ok(Err(Error::InvalidArgument { field, .. })) if field == option || !ok => Ok(()),
        Ok(Err(_)) if !ok => Ok(()),
        Ok(Err(e)) => fail(
            option,
            format!("the refusal of an unsupported {option} must name it, got: {e}"),
        ),
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

/// Checks `imp`'s sharded cross-entropy on `case` against the unsharded
/// reference on the real columns.
///
/// # Errors
/// The first difference, as a [`Mismatch`] naming the tensor, rank and index.
pub fn check_cross_entropy(
    imp: &dyn CrossEntropyOp,
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
    imp: &dyn CrossEntropyOp,
    algorithm: ShardedAlgorithm,
    case: &CeCase,
    want_grad: bool,
    rule: Rule,
) -> Result<(), Mismatch> {
    let run = |c: &CeCase| {
        let plan = ShardPlan::new(algorithm, c.map);
        imp.sharded_cross_entropy(plan, CeCall::new(c.logits.view(), c.call(want_grad)))
    };
    let call = case.call(want_grad);
    if let Some(r) = refused(imp.options(), &call, || ce_ok(case), || run(case)) {
        return r;
    }
    ce_with(&run, Some(algorithm), case, want_grad, rule)
}

/// Checks `imp`'s **unsharded** cross-entropy on the real columns of `case`
/// against the reference, under `rule`, as [`check_cross_entropy_with`]
/// checks one rank.
///
/// # Errors
/// The first difference, as a [`Mismatch`] naming the tensor and index.
pub fn check_cross_entropy_unsharded(
    imp: &dyn CrossEntropyOp,
    case: &CeCase,
    want_grad: bool,
    rule: Rule,
) -> Result<(), Mismatch> {
    let v = case.map.vocab_size().min(case.logits.ncols());
    let Ok(map) = ShardMap::new(v, 1, ShardLayout::Uneven) else {
        return Ok(()); // v = 0: no unsharded problem to pose
    };
    let one = CeCase {
        map,
        logits: case.logits.slice_axis(Axis(1), Slice::from(..v)).to_owned(),
        ..case.clone()
    };
    let run = |c: &CeCase| {
        imp.cross_entropy(CeCall::new(c.logits.view(), c.call(want_grad)))
            .map(|ce| one_rank(&c.map, ce, None, None))
    };
    let call = one.call(want_grad);
    if let Some(r) = refused(imp.options(), &call, || ce_ok(&one), || run(&one)) {
        return r;
    }
    ce_with(&run, None, &one, want_grad, rule)
}

/// An unsharded result as a sharded one of one rank (no collectives).
fn one_rank(
    map: &ShardMap,
    ce: CrossEntropy,
    grad_hidden: Option<Array2<f64>>,
    grad_weight: Option<Array2<f64>>,
) -> ShardedLoss {
    ShardedLoss {
        map: *map,
        ranks: vec![RankLoss {
            rank: 0,
            loss: ce.loss,
            per_token_loss: ce.per_token_loss,
            local: ce.stats.clone(),
            global: ce.stats,
            grad_logits: ce.grad_logits,
            grad_hidden,
            grad_weight,
            counts: Default::default(),
            peak_bytes: 0,
        }],
    }
}

/// Whether the reference accepts `case` (its real columns).
fn ce_ok(case: &CeCase) -> bool {
    let v = case.map.vocab_size().min(case.logits.ncols());
    let real = case.logits.slice_axis(Axis(1), Slice::from(..v));
    cross_entropy(real, &case.call(false)).is_ok()
}

/// Whether the reference accepts `case` (the real rows of its weight).
fn linear_ok(case: &LinearCase) -> bool {
    linear_cross_entropy(case.hidden.view(), case.real_weight(), &case.call(false)).is_ok()
}

type RunCe<'a> = dyn Fn(&CeCase) -> Result<ShardedLoss, Error> + 'a;
/// An output-layer run: every rank's results and the error the
/// implementation reports it traded
/// ([`packshard_reference::ops::LinearLoss::traded`], unsharded only).
type RunLinear<'a> = dyn Fn(&LinearCase) -> Result<(ShardedLoss, Option<TradedError>), Error> + 'a;

/// `case` as a check under `rule` runs it: itself under [`Rule::Terms`];
/// under [`Rule::Relative`] with every input rounded to f32 by `round` (so
/// the f64 reference and the implementation see the same numbers).
fn judged<C: Clone>(rule: Rule, case: &C, round: impl FnOnce(&C) -> C) -> Cow<'_, C> {
    match rule {
        Rule::Terms => Cow::Borrowed(case),
        Rule::Relative(_) => Cow::Owned(round(case)),
    }
}

/// `run` on the [`judged`] `case` against the reference under `rule`.
fn ce_with(
    run: &RunCe<'_>,
    algorithm: Option<ShardedAlgorithm>,
    case: &CeCase,
    want_grad: bool,
    rule: Rule,
) -> Result<(), Mismatch> {
    let case: &CeCase = &judged(rule, case, |c| CeCase {
        logits: c.logits.mapv(baseline32::round_f32),
        ..c.clone()
    });
    let v = case.map.vocab_size();
    let real = case
        .logits
        .slice_axis(Axis(1), Slice::from(..v.min(case.logits.ncols())));
    let expected = cross_entropy(real, &case.call(want_grad));
    let actual = no_panic(IMPL, || run(case))?;
    let Some((expected, actual)) = same_outcome(expected, actual)? else {
        return Ok(());
    };
    let terms = Terms::new(real, &case.call(want_grad), &expected);
    match rule {
        Rule::Terms => check_loss(
            algorithm, &case.map, &expected, &terms, &actual, false, want_grad,
        ),
        Rule::Relative(rule) => {
            let real32 = real.mapv(|x| x as f32);
            let base = baseline32::cross_entropy(real32.view(), &case.call(want_grad));
            check_loss_relative(
                algorithm, &case.map, &expected, &base, &actual, false, want_grad, rule, &terms,
            )
        }
    }
}

/// Checks `imp`'s sharded output layer on `case`: as
/// [`check_cross_entropy`], plus `∂L/∂hidden` on every rank and the gathered
/// `∂L/∂W` (exact zeros on padding rows).
///
/// # Errors
/// The first difference, as a [`Mismatch`].
pub fn check_linear(
    imp: &dyn LinearCrossEntropyOp,
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
    imp: &dyn LinearCrossEntropyOp,
    algorithm: ShardedAlgorithm,
    case: &LinearCase,
    want_grad: bool,
    rule: Rule,
) -> Result<(), Mismatch> {
    let run = |c: &LinearCase| {
        let plan = ShardPlan::new(algorithm, c.map);
        imp.sharded_linear_cross_entropy(plan, LinearCall::new(c.input(), c.call(want_grad)))
            .map(|l| (l, None))
    };
    let call = case.call(want_grad);
    if let Some(r) = refused(imp.options(), &call, || linear_ok(case), || run(case)) {
        return r;
    }
    linear_with(&run, Some(algorithm), case, want_grad, rule)
}

/// Checks `imp`'s **unsharded** output layer on the real rows of `case`'s
/// weight against the reference, under `rule`.
///
/// # Errors
/// The first difference, as a [`Mismatch`].
pub fn check_linear_unsharded(
    imp: &dyn LinearCrossEntropyOp,
    case: &LinearCase,
    want_grad: bool,
    rule: Rule,
) -> Result<(), Mismatch> {
    let v = case.map.vocab_size().min(case.weight.nrows());
    let Ok(map) = ShardMap::new(v, 1, ShardLayout::Uneven) else {
        return Ok(());
    };
    let one = LinearCase {
        map,
        weight: case.weight.slice_axis(Axis(0), Slice::from(..v)).to_owned(),
        ..case.clone()
    };
    let run = |c: &LinearCase| {
        imp.linear_cross_entropy(LinearCall::new(c.input(), c.call(want_grad)))
            .map(|l| {
                (
                    one_rank(&c.map, l.ce, l.grad_hidden, l.grad_weight),
                    l.traded,
                )
            })
    };
    let call = one.call(want_grad);
    if let Some(r) = refused(imp.options(), &call, || linear_ok(&one), || run(&one)) {
        return r;
    }
    linear_with(&run, None, &one, want_grad, rule)
}

/// `run` on `case` against the reference under `rule`, as [`ce_with`].
fn linear_with(
    run: &RunLinear<'_>,
    algorithm: Option<ShardedAlgorithm>,
    case: &LinearCase,
    want_grad: bool,
    rule: Rule,
) -> Result<(), Mismatch> {
    let case: &LinearCase = &judged(rule, case, |c| LinearCase {
        hidden: c.hidden.mapv(baseline32::round_f32),
        weight: c.weight.mapv(baseline32::round_f32),
        ..c.clone()
    });
    let real = case.real_weight();
    let expected = linear_cross_entropy(case.hidden.view(), real, &case.call(want_grad));
    let actual = no_panic(IMPL, || run(case))?;
    let Some((mut expected, (actual, traded))) = same_outcome(expected, actual)? else {
        return Ok(());
    };
    if actual.ranks.iter().all(|r| r.grad_logits.is_none()) {
        // A fused output layer need not materialize dL/dz (`LinearLoss::ce`):
        // it is judged by dL/dhidden and dL/dW.
        expected.ce.grad_logits = None;
    }
    match rule {
        // Under this rule a reported trade earns no allowance: judged as exact.
        Rule::Terms => compare_linear(algorithm, case, &expected, &actual, want_grad),
        Rule::Relative(rule) => {
            compare_linear_relative(algorithm, case, &expected, &actual, traded, want_grad, rule)
        }
    }
}

/// Compares a sharded output-layer run `actual` on `case` with the unsharded
/// `expected` (as [`check_linear`] does after running both), so that one
/// unsharded run can serve several sharded ones.
///
/// # Errors
/// The first difference, as a [`Mismatch`].
pub fn compare_linear(
    algorithm: Option<ShardedAlgorithm>,
    case: &LinearCase,
    expected: &LinearCrossEntropy,
    actual: &ShardedLoss,
    want_grad: bool,
) -> Result<(), Mismatch> {
    let real = case.real_weight();
    let terms = Terms::new(expected.logits.view(), &case.call(want_grad), &expected.ce);
    let g = &terms.grad_logits;
    if let Some(want) = &expected.grad_hidden {
        let hidden_terms = g.dot(&real.mapv(f64::abs));
        for r in &actual.ranks {
            let got = rank_grad_hidden(r)?;
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
        padding_rows_have_no_gradient(&case.map, actual)?;
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
/// out-of-range ids the same error (docs/FAULTS.md V5).
///
/// # Errors
/// The first difference, as a [`Mismatch`].
pub fn check_embedding(imp: &dyn EmbeddingOp, case: &EmbeddingCase) -> Result<(), Mismatch> {
    check_embedding_with(imp, case, Rule::Terms)
}

/// As [`check_embedding`]; under [`Rule::Relative`] the weight and
/// `grad_output` are rounded to f32 first (a lookup is exact in any
/// precision, so the comparison stays [`Tolerance::EXACT`]).
///
/// # Errors
/// The first difference, as a [`Mismatch`].
pub fn check_embedding_with(
    imp: &dyn EmbeddingOp,
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
    let actual = no_panic(IMPL, || {
        imp.sharded_embedding(
            &case.map,
            EmbeddingCall::new(&case.ids, case.weight.view(), Some(case.grad_output.view())),
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
    let unsharded = no_panic(IMPL, || {
        imp.embedding(EmbeddingCall::new(
            &case.ids,
            real,
            Some(case.grad_output.view()),
        ))
    })?
    .map_err(|e| Mismatch::new("unsharded embedding", e.to_string()))?;
    exact("unsharded output", &out, &unsharded.output)?;
    let Some(got) = &unsharded.grad_weight else {
        return fail("unsharded grad_weight", "missing");
    };
    exact("unsharded grad_weight", &gw, got)?;
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

mod faults;
mod relative;
mod strategies;
mod suite;
mod terms;

pub use faults::*;
pub use relative::Rule;
use relative::{check_loss_relative, compare_linear_relative};
pub use strategies::*;
pub use suite::*;
pub use terms::{assert_close_terms, Terms, TERMS, UNDERFLOW};
use terms::{check_counts, check_loss, check_rank_count, rank_logsumexp, tensor_terms, WORST_ULPS};
