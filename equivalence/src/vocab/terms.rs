//! The rule of f64 rewrites, [`TERMS`]: each value within 64 ulp of itself
//! plus the magnitude of its terms ([`Terms`]), and the comparison of a
//! sharded run's losses, gradients and counts under it.

use super::*;
use packshard_reference::vocab::softcap;

thread_local! {
    /// The largest `|actual - expected| / (ulp x (|expected| + terms))` this
    /// thread has compared (see [`Coverage::worst_ulps`]).
    pub(super) static WORST_ULPS: std::cell::Cell<f64> = const { std::cell::Cell::new(0.0) };
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

pub(super) fn tensor_terms(
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
    ///
    /// Each row's gradient weight is the magnitude of its
    /// [`LossCall::token_weights`] (an upstream gradient may be negative).
    pub fn new(logits: ArrayView2<f64>, call: &LossCall, expected: &CrossEntropy) -> Terms {
        let (targets, config) = (call.targets, call.config);
        // With a softcap the statistics are those of the capped logits.
        let capped = config.softcap.map(|c| logits.mapv(|z| softcap::cap(z, c)));
        let logits = capped.as_ref().map_or(logits, |z| z.view());
        let (n, v) = logits.dim();
        let parsed: Vec<Option<usize>> = (0..n)
            .map(|i| config.target(targets, i, v).ok().flatten())
            .collect();
        let weights: Vec<f64> = call
            .token_weights(&parsed)
            .iter()
            .map(|w| w.abs())
            .collect();
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
pub(super) fn check_loss(
    algorithm: Option<ShardedAlgorithm>,
    map: &ShardMap,
    expected: &CrossEntropy,
    terms: &Terms,
    actual: &ShardedLoss,
    linear: bool,
    want_grad: bool,
) -> Result<(), Mismatch> {
    check_rank_count(map, actual)?;
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
        if let Some(got_lse) = rank_logsumexp(r, n)? {
            assert_close_terms(
                &at("logsumexp"),
                lse.as_slice().unwrap_or(&[]),
                &got_lse,
                &terms.logsumexp,
                &[n],
            )?;
        }
    }
    if let Some(want) = &expected.grad_logits {
        let Some(got) = actual.grad_logits() else {
            return fail("grad_logits", "missing");
        };
        tensor_terms("grad_logits", want, &got, &terms.grad_logits)?;
        padding_columns_have_no_gradient(map, actual)?;
    }
    check_counts(algorithm, actual, linear, want_grad)
}

/// `actual` has one rank per shard of `map`.
pub(super) fn check_rank_count(map: &ShardMap, actual: &ShardedLoss) -> Result<(), Mismatch> {
    let p = map.num_shards();
    if actual.ranks.len() != p {
        return fail(
            "ranks",
            format!("{} ranks answered, {p} expected", actual.ranks.len()),
        );
    }
    Ok(())
}

/// Rank `r`'s `logsumexp` of each of the `n` rows (from its global
/// statistics), `None` where it reports no statistics.
///
/// # Errors
/// A [`Mismatch`] naming `logsumexp (rank r)` for another number of rows.
pub(super) fn rank_logsumexp(r: &RankLoss, n: usize) -> Result<Option<Vec<f64>>, Mismatch> {
    let got_lse: Vec<f64> = r.global.iter().map(|g| g.logsumexp()).collect();
    if got_lse.len() == n {
        Ok(Some(got_lse))
    } else if got_lse.is_empty() {
        Ok(None)
    } else {
        fail(
            format!("logsumexp (rank {})", r.rank),
            format!("{} rows, {n} expected", got_lse.len()),
        )
    }
}

/// The collective counts of a sharded run of `algorithm`: the barriers as
/// [`ShardedAlgorithm::barriers`] says, the same counts on every rank
/// (nothing to check for an unsharded run, `None`).
pub(super) fn check_counts(
    algorithm: Option<ShardedAlgorithm>,
    actual: &ShardedLoss,
    linear: bool,
    want_grad: bool,
) -> Result<(), Mismatch> {
    let Some(algorithm) = algorithm else {
        return Ok(());
    };
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
