//! Lower-precision implementations: the relative rule against the f64
//! reference and the reference math run in f32 ([`crate::baseline32`]).

#[allow(clippy::wildcard_imports)]
use super::*;

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
    /// a suite started.
    pub(super) static RELATIVE: RefCell<RelativeReport> = RefCell::new(RelativeReport::default());
}

/// One tensor under `rule` against the f32 baseline, noted in [`RELATIVE`]:
/// `allowance` gives the scale of the floor (`None`: the expected tensor's
/// largest value; [`Allowance::with_scale`]) and widens the allowance by the
/// error the implementation reports it `traded` ([`TradedError`]): the
/// rule's allowance for rounding plus that, nothing more. The suite tier
/// ([`RELATIVE`]) counts the error beyond the trade (every element's error
/// is its rounding plus at most `traded`), so rounding is judged over the
/// run as any other implementation's.
fn traded_relative(
    what: &str,
    (expected, baseline, actual): (&[f64], &[f64], &[f64]),
    shape: &[usize],
    rule: RelativeRule,
    allowance: Allowance,
) -> Result<(), Mismatch> {
    let mut r = assert_within_k(what, expected, baseline, actual, shape, rule, allowance)?;
    r.error = (r.error - allowance.traded).max(0.0);
    RELATIVE.with(|rep| rep.borrow_mut().note(what, r));
    Ok(())
}

/// The reported trade's bounds `(dL/dhidden, dL/dW)`, checked: finite and
/// at least 0 (no report: `(0, 0)`).
fn traded_bounds(traded: Option<TradedError>) -> Result<(f64, f64), Mismatch> {
    let Some(t) = traded else {
        return Ok((0.0, 0.0));
    };
    for (what, b) in [
        ("grad_hidden", t.grad_hidden),
        ("grad_weight", t.grad_weight),
    ] {
        if !(b.is_finite() && b >= 0.0) {
            return fail(
                "traded",
                format!("the {what} bound {b:e} is not a finite size"),
            );
        }
    }
    Ok((t.grad_hidden, t.grad_weight))
}

fn flat64(a: &Array2<f64>) -> Vec<f64> {
    a.iter().copied().collect()
}

fn flat32(a: &Array2<f32>) -> Vec<f64> {
    a.iter().map(|&x| f64::from(x)).collect()
}

/// [`check_loss`] under a [`RelativeRule`], with the f32 baseline `base`.
#[allow(clippy::too_many_arguments)]
pub(super) fn check_loss_relative(
    algorithm: Option<ShardedAlgorithm>,
    map: &ShardMap,
    expected: &CrossEntropy,
    base: &baseline32::CrossEntropy32,
    actual: &ShardedLoss,
    linear: bool,
    want_grad: bool,
    rule: RelativeRule,
    terms: &Terms,
) -> Result<(), Mismatch> {
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
    check_rank_count(map, actual)?;
    let n = expected.per_token_loss.len();
    let lse = expected.logsumexp();
    let b_lse: Vec<f64> = base.logsumexp.iter().map(|&x| f64::from(x)).collect();
    let b_tok: Vec<f64> = base.per_token_loss.iter().map(|&x| f64::from(x)).collect();
    for r in &actual.ranks {
        let at = |what: &str| format!("{what} (rank {})", r.rank);
        traded_relative(
            &at("loss"),
            (&[expected.loss], &[f64::from(base.loss)], &[r.loss]),
            &[1],
            rule,
            Allowance::with_scale(loss_scale(
                &[expected.loss],
                &[terms.loss, finite_max(&terms.logsumexp)],
            )),
        )?;
        let per_token = expected.per_token_loss.as_slice().unwrap_or(&[]);
        traded_relative(
            &at("per_token_loss"),
            (per_token, &b_tok, &r.per_token_loss.to_vec()),
            &[n],
            rule,
            Allowance::with_scale(loss_scale(
                per_token,
                &[
                    finite_max(&terms.per_token_loss),
                    finite_max(&terms.logsumexp),
                ],
            )),
        )?;
        if let Some(got_lse) = rank_logsumexp(r, n)? {
            // `logsumexp = m + ln s` is rounded at the size of its terms,
            // not at its own: `|m|`, the probabilities' arguments, and the
            // sum `s = Σ_j exp(z_j - m)`, which holds the term `exp(0) = 1`,
            // so `ln s` is off by up to eps of 1 however small it is:
            // `ln(1 + e^-100) = 3.7e-44` is 0 in f32 (issue #14; the case is
            // `oracle/tests/vocab_kernels.rs`,
            // `logsumexp_far_below_its_terms_is_judged_at_their_size`).
            let lse_values = lse.as_slice().unwrap_or(&[]);
            traded_relative(
                &at("logsumexp"),
                (lse_values, &b_lse, &got_lse),
                &[n],
                rule,
                Allowance::with_scale(loss_scale(
                    lse_values,
                    &[finite_max(&terms.logsumexp) + 1.0],
                )),
            )?;
        }
    }
    if let Some(want) = &expected.grad_logits {
        let Some(got) = actual.grad_logits() else {
            return fail("grad_logits", "missing");
        };
        let Some(b) = &base.grad_logits else {
            return fail("grad_logits", "the baseline has none");
        };
        same_shape("grad_logits", got.shape(), want.shape())?;
        // `p - q` cancels (to exactly 0 where `p = q`): at least the terms' scale.
        let scale = finite_max(&flat64(want)).max(finite_max(&flat64(&terms.grad_logits)));
        traded_relative(
            "grad_logits",
            (&flat64(want), &flat32(b), &flat64(&got)),
            want.shape(),
            rule,
            Allowance::with_scale((scale > 0.0).then_some(scale)),
        )?;
        padding_columns_have_no_gradient(map, actual)?;
    }
    check_counts(algorithm, actual, linear, want_grad)
}

/// [`compare_linear`] under a [`RelativeRule`], for the f32-rounded `case`,
/// with the error the implementation reports it `traded`.
pub(super) fn compare_linear_relative(
    algorithm: Option<ShardedAlgorithm>,
    case: &LinearCase,
    expected: &LinearCrossEntropy,
    actual: &ShardedLoss,
    traded: Option<TradedError>,
    want_grad: bool,
    rule: RelativeRule,
) -> Result<(), Mismatch> {
    let real = case.real_weight();
    // An approximate kernel's gradients are allowed the error it reports
    // it traded on top of rounding (a bound, checked: the error must stay
    // inside it); everything else is judged as any other's.
    let (traded_hidden, traded_weight) = traded_bounds(traded)?;
    let (h32, w32) = (case.hidden.mapv(|x| x as f32), real.mapv(|x| x as f32));
    let (base, base_grads) =
        baseline32::linear_cross_entropy(h32.view(), w32.view(), &case.call(want_grad));
    let terms = Terms::new(expected.logits.view(), &case.call(want_grad), &expected.ce);
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
            let got = rank_grad_hidden(r)?;
            same_shape("grad_hidden", got.shape(), want.shape())?;
            traded_relative(
                &format!("grad_hidden (rank {})", r.rank),
                (&flat64(want), &flat32(bh), &flat64(got)),
                want.shape(),
                rule,
                Allowance {
                    scale: with_floor(want, hidden_scale),
                    traded: traded_hidden,
                },
            )?;
        }
    }
    if let (Some(want), Some((_, bw))) = (&expected.grad_weight, &base_grads) {
        let Some(got) = actual.grad_weight() else {
            return fail("grad_weight", "missing");
        };
        same_shape("grad_weight", got.shape(), want.shape())?;
        traded_relative(
            "grad_weight",
            (&flat64(want), &flat32(bw), &flat64(&got)),
            want.shape(),
            rule,
            Allowance {
                scale: with_floor(want, weight_scale),
                traded: traded_weight,
            },
        )?;
        padding_rows_have_no_gradient(&case.map, actual)?;
    }
    check_loss_relative(
        algorithm,
        &case.map,
        &expected.ce,
        &base,
        actual,
        true,
        want_grad,
        rule,
        &terms,
    )
}
