//! The unsharded reference: logits, log-softmax and cross-entropy, forward
//! and backward, in f64.
//!
//! Every algorithm of this module and of [`super::sharded`] is built from one
//! per-row summary, [`SoftmaxStats`]: the maximum `m`, the sum `s = Σ exp(z -
//! m)` (kept as `s - 1`, see below), and the target term `Σ q_j (m - z_j)`.
//! Two summaries of disjoint sets of logits merge into the summary of their
//! union ([`SoftmaxStats::merge`], the online-softmax rule of Milakov &
//! Gimelshein 2018), which is what lets a vocabulary shard summarise itself
//! and an all-reduce combine the shards.
//!
//! ## Precision
//!
//! The loss is computed as `Σ_j q_j (m - z_j) + ln(s)` (both terms `>= 0`)
//! and `ln(s)` as `ln_1p(s - 1)`, where `s - 1 = (C - 1) + Σ_{z_j < m}
//! exp(z_j - m)` with `C >= 1` the number of logits equal to the maximum. So a
//! confident prediction's loss (say `1e-14`) keeps its relative precision
//! instead of being the difference of two numbers near `logsumexp`. For the
//! same reason the gradient `p_j - q_j` of a confident target (`q_j > 1/2`
//! at the maximum) is computed as `(1 - q_j) - (s - 1) / s` (all other `p_j -
//! q_j` directly); see [`SoftmaxStats::delta`].
//! The sharded algorithms use the same rules, so sharded and unsharded agree
//! to a few ulp *relative* even for losses of 1e-14.

use ndarray::{Array1, Array2, ArrayView2, Axis, Slice};

use super::softcap;
use super::sum::{self, Neumaier};
use super::{check_logits_size, LossCall, LossConfig};
use crate::error::{check_finite, Error, Result};

/// The per-row summary of a set of logits `z_j` with target weights `q_j`
/// (one row of the vocabulary, or the part of it one shard holds).
///
/// For an empty set, or one whose logits are all `-inf`: `max = -inf`,
/// `rest = -1` (so `s = 0`), and `target` is `+inf` if `q` puts mass there,
/// else 0. Such a set contributes nothing to a merge (docs/FAULTS.md V6).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SoftmaxStats {
    /// `m = max_j z_j` (paper: the local max `m_i` of a shard, or the global `m`).
    pub max: f64,
    /// `s - 1`, where `s = Σ_j exp(z_j - m)` is the sum (paper: `s_i`, or `S`).
    pub rest: f64,
    /// `Σ_j q_j (m - z_j) >= 0`; `+inf` when `q` puts mass on a `-inf` logit.
    pub target: f64,
    /// `Σ_j q_j`, the target mass in the set (1 over a whole non-ignored row).
    pub mass: f64,
}

/// Width of a [`SoftmaxStats`] record in a collective buffer.
pub const STATS_WIDTH: usize = 4;

impl SoftmaxStats {
    /// The summary of no logits.
    pub const EMPTY: SoftmaxStats = SoftmaxStats {
        max: f64::NEG_INFINITY,
        rest: -1.0,
        target: 0.0,
        mass: 0.0,
    };

    /// Summarises logits `z: [k]` (finite or `-inf`) with target weights
    /// `q(j) >= 0`.
    pub fn of(z: &[f64], q: impl Fn(usize) -> f64) -> SoftmaxStats {
        let max = z.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b));
        Self::relative_to(z, q, max)
    }

    /// Summarises `z` relative to a given maximum `max >= max_j z_j` (the
    /// naive algorithm sums against the global maximum): `rest = (C - 1) +
    /// Σ_{z_j < max} exp(z_j - max)` with `C` the count of `z_j == max`, which
    /// may be 0 here (then `rest` may be below 0).
    pub fn relative_to(z: &[f64], q: impl Fn(usize) -> f64, max: f64) -> SoftmaxStats {
        let (target, mass) = target_term(z, q, max);
        if max == f64::NEG_INFINITY {
            // Every logit is -inf: exp(z - max) would be exp(NaN); nothing
            // enters the sum (docs/FAULTS.md V6).
            return SoftmaxStats {
                target,
                mass,
                ..Self::EMPTY
            };
        }
        let (at_max, below) = count_and_sum(z, max);
        SoftmaxStats {
            max,
            rest: (at_max - 1.0) + below,
            target,
            mass,
        }
    }

    /// `s = Σ_j exp(z_j - m)` (0 for an empty set).
    pub fn sum_exp(&self) -> f64 {
        1.0 + self.rest
    }

    /// `logsumexp = m + ln(s)` (`-inf` for an empty set).
    pub fn logsumexp(&self) -> f64 {
        self.max + self.rest.ln_1p()
    }

    /// Cross-entropy `-Σ_j q_j log p_j = Σ_j q_j (m - z_j) + ln(s)` for a whole
    /// row (`mass` 1); `+inf` when the target has probability 0.
    pub fn cross_entropy(&self) -> f64 {
        self.target + self.rest.ln_1p()
    }

    /// The target term moved to a larger maximum `to >= self.max`:
    /// `Σ q_j (to - z_j) = target + mass * (to - max)`.
    pub fn target_at(&self, to: f64) -> f64 {
        if self.mass == 0.0 || self.target == f64::INFINITY || self.max == to {
            self.target
        } else {
            self.target + weighted_gap(self.mass, to, self.max)
        }
    }

    /// `exp(self.max - to)` for `to >= self.max`: 1 when equal (also when both
    /// are `-inf`), 0 for an empty set under a finite maximum.
    pub fn scale_to(&self, to: f64) -> f64 {
        if self.max == to {
            1.0
        } else {
            (self.max - to).exp()
        }
    }

    /// The summary of the union of two disjoint sets (online-softmax merge):
    /// `m = max(m_a, m_b)`, `s = s_a exp(m_a - m) + s_b exp(m_b - m)`, with the
    /// leading 1 of `s` kept out of `rest` so that it stays exact. A set with
    /// `max = -inf` contributes exactly 0 (never `exp(-inf - -inf) = NaN`).
    pub fn merge(self, b: SoftmaxStats) -> SoftmaxStats {
        let a = self;
        let max = a.max.max(b.max);
        let rest = if a.max == b.max {
            a.rest + b.rest + 1.0
        } else if a.max > b.max {
            a.rest + b.sum_exp() * b.scale_to(max)
        } else {
            b.rest + a.sum_exp() * a.scale_to(max)
        };
        SoftmaxStats {
            max,
            rest,
            target: a.target_at(max) + b.target_at(max),
            mass: a.mass + b.mass,
        }
    }

    /// The record `[max, rest, target, mass]` of a collective buffer.
    pub fn to_record(&self) -> [f64; STATS_WIDTH] {
        [self.max, self.rest, self.target, self.mass]
    }

    /// Reads a record written by [`SoftmaxStats::to_record`] (`r.len() >= 4`).
    pub fn from_record(r: &[f64]) -> SoftmaxStats {
        SoftmaxStats {
            max: r[0],
            rest: r[1],
            target: r[2],
            mass: r[3],
        }
    }

    /// The softmax probability of a logit `z` of the set: `exp(z - m) / s`
    /// (`1 / s` at the maximum, 0 at `-inf`).
    pub fn probability(&self, z: f64) -> f64 {
        if z == f64::NEG_INFINITY {
            0.0
        } else if z == self.max {
            1.0 / self.sum_exp()
        } else {
            (z - self.max).exp() / self.sum_exp()
        }
    }

    /// `p - q` for a logit `z` with target weight `q`. At the maximum, where
    /// `p = 1 / s`, the form with the smaller terms is used: `(1 - q) - (s -
    /// 1) / s` when `q > 1/2` (a confident target: `p` within an ulp of 1,
    /// both terms tiny), else `1 / s - q` (with many ties at the maximum `s`
    /// is large and `(s - 1) / s` close to 1, so the first form would cancel).
    pub fn delta(&self, z: f64, q: f64) -> f64 {
        if z == self.max && q > 0.5 {
            (1.0 - q) - self.rest / self.sum_exp()
        } else {
            self.probability(z) - q
        }
    }

    /// `d loss_i / d z` of one logit of a whole row: `(p - q) + 2 c lse p`
    /// (the second term is the z-loss, `c * lse^2`).
    pub fn gradient(&self, z: f64, q: f64, z_loss: f64) -> f64 {
        let delta = self.delta(z, q);
        if z_loss == 0.0 {
            delta
        } else {
            delta + 2.0 * z_loss * self.logsumexp() * self.probability(z)
        }
    }
}

/// `(C, Σ_{z_j < max} exp(z_j - max))` where `C` counts the `z_j == max`:
/// the (compensated) sum `s = Σ_j exp(z_j - max)` split so that its exact integer part
/// stays apart from the small terms. `max` must be finite.
pub fn count_and_sum(z: &[f64], max: f64) -> (f64, f64) {
    let mut at_max = 0.0;
    let mut below = Neumaier::default();
    for &zj in z {
        if zj == max {
            at_max += 1.0;
        } else {
            below.add((zj - max).exp());
        }
    }
    (at_max, below.value())
}

/// `(Σ_j q_j (max - z_j), Σ_j q_j)` over the `j` with `q_j > 0`; a `-inf`
/// logit with `q_j > 0` makes the first `+inf` (its probability is 0).
/// Both sums are compensated.
pub fn target_term(z: &[f64], q: impl Fn(usize) -> f64, max: f64) -> (f64, f64) {
    let mut target = Neumaier::default();
    let mut mass = Neumaier::default();
    for (j, &zj) in z.iter().enumerate() {
        let qj = q(j);
        if qj > 0.0 {
            mass.add(qj);
            target.add(if zj == f64::NEG_INFINITY {
                f64::INFINITY
            } else {
                weighted_gap(qj, max, zj)
            });
        }
    }
    (target.value(), mass.value())
}

/// `q (max - z)` for finite `max >= z`, weighted before subtracting where
/// the gap itself overflows (`max - z` above f64's range: logits of 1e308
/// and -1e308 gave an infinite loss under label smoothing where the true
/// one is finite). Where the gap is finite it is formed first, exactly as
/// before (no cancellation: `q max - q z` would lose the digits of a small
/// gap); where it overflows, `max` and `-z` are both huge and of one sign,
/// so `q max - q z` adds two non-negative terms.
fn weighted_gap(q: f64, max: f64, z: f64) -> f64 {
    let gap = max - z;
    if gap.is_finite() {
        q * gap
    } else {
        q * max - q * z
    }
}

/// The loss of one token from its row's summary: cross-entropy plus `c *
/// lse^2`; 0 for an ignored token.
pub fn token_loss(stats: &SoftmaxStats, target: Option<usize>, config: &LossConfig) -> f64 {
    if target.is_none() {
        return 0.0;
    }
    let ce = stats.cross_entropy();
    if config.z_loss == 0.0 {
        ce
    } else {
        let lse = stats.logsumexp();
        ce + config.z_loss * lse * lse
    }
}

/// Refuses a z-loss whose term `z_loss x lse^2` overflows f64 on a
/// non-ignored row: its gradient `2 z_loss lse p_j` is then `inf x 0`,
/// NaN, where `p_j` underflowed and the true gradient is finite.
///
/// # Errors
/// [`Error::InvalidArgument`] naming `z_loss` and the row.
pub fn check_z_loss(
    config: &LossConfig,
    stats: &[SoftmaxStats],
    targets: &[Option<usize>],
) -> Result<()> {
    if config.z_loss == 0.0 {
        return Ok(());
    }
    for (i, (s, t)) in stats.iter().zip(targets).enumerate() {
        let lse = s.logsumexp();
        if t.is_some() && !(config.z_loss * lse * lse).is_finite() {
            return Err(Error::invalid(
                "z_loss",
                format!(
                    "{:?} x logsumexp^2 of logits[{i}] ({lse:e}) overflows f64: its gradient would be NaN",
                    config.z_loss
                ),
            ));
        }
    }
    Ok(())
}

/// Checks that every token's gradient stays within f64 before it is formed:
/// `|w_i| (2 + 2 z_loss |lse_i|)` bounds `|w_i (p - q + 2 z_loss lse_i p)|`
/// (`p, q <= 1`), the gradient in the (capped) logit. Past f64 the softcap's
/// chain factor, which rounds to 0 on a saturated logit, would meet `inf` and
/// give NaN where the true gradient is finite (the hostile sweep's case:
/// softcap 1e-300, z_loss 3.5e38, grad_output 1.7e308, true gradient 0).
/// The twin of the attention backward's bound on `|grad_output| |v|`.
///
/// # Errors
/// [`Error::InvalidArgument`] naming `grad_output`.
pub fn check_grad_bound(weights: &[f64], stats: &[SoftmaxStats], z_loss: f64) -> Result<()> {
    for (i, (w, s)) in weights.iter().zip(stats).enumerate() {
        if *w == 0.0 {
            continue;
        }
        let bound = w.abs() * (2.0 + 2.0 * z_loss * s.logsumexp().abs());
        if !bound.is_finite() {
            return Err(Error::invalid(
                "grad_output",
                format!(
                    "token {i}'s gradient ({:e} x (2 + 2 z_loss |logsumexp|)) is beyond f64",
                    w.abs()
                ),
            ));
        }
    }
    Ok(())
}

/// The error for a row whose logits are all `-inf` while its target is not
/// ignored: the softmax is undefined (PyTorch returns NaN).
///
/// # Errors
/// [`Error::InvalidArgument`] naming `logits[row]`.
pub fn check_row(row: usize, stats: &SoftmaxStats, target: Option<usize>) -> Result<()> {
    if target.is_some() && stats.max == f64::NEG_INFINITY {
        return Err(Error::invalid(
            format!("logits[{row}]"),
            "every logit is -inf, so the softmax is undefined (the target is not ignored)",
        ));
    }
    Ok(())
}

/// Checks logits: NaN and `+inf` are errors, `-inf` (a masked entry) is allowed.
///
/// # Errors
/// [`Error::NonFiniteInput`] with the flat index `i * row_len + column`, where
/// `column` is `offset + j` (a shard reports global vocabulary indices).
pub fn check_logits(
    field: &str,
    z: ArrayView2<f64>,
    columns: usize,
    row_len: usize,
    offset: usize,
) -> Result<()> {
    for ((i, j), &x) in z.indexed_iter() {
        if j < columns && (x.is_nan() || x == f64::INFINITY) {
            return Err(Error::NonFiniteInput {
                field: field.into(),
                index: i * row_len + offset + j,
                value: x,
            });
        }
    }
    Ok(())
}

/// The result of the unsharded cross-entropy, its `dL/dlogits` in `G` (f64
/// here; an f32 kernel's own type holds it in f32).
#[derive(Debug, Clone, PartialEq)]
pub struct CrossEntropy<G = f64> {
    /// The reduced loss (for `reduction = none`: the sum of `per_token_loss`).
    pub loss: f64,
    /// `[n]`: each token's loss (cross-entropy plus z-loss); 0 for ignored tokens.
    pub per_token_loss: Array1<f64>,
    /// `[n]`: each row's [`SoftmaxStats`] (computed for ignored rows too).
    pub stats: Vec<SoftmaxStats>,
    /// How many targets are not `ignore_index` (the mean's denominator).
    pub num_tokens: usize,
    /// `[n, v]`: `d loss / d logits`, when asked for.
    pub grad_logits: Option<Array2<G>>,
}

impl<G> CrossEntropy<G> {
    /// `[n]`: `logsumexp` of each row (`-inf` for a row of `-inf`).
    pub fn logsumexp(&self) -> Array1<f64> {
        self.stats.iter().map(SoftmaxStats::logsumexp).collect()
    }
}

/// The log-softmax of `logits: [n, v]`: `z_ij - logsumexp_i` (`-inf` stays
/// `-inf`; a row of `-inf` gives NaN, as it has no softmax).
pub fn log_softmax(logits: ArrayView2<f64>) -> Array2<f64> {
    let mut out = logits.to_owned();
    for mut row in out.rows_mut() {
        let lse = SoftmaxStats::of(&row.to_vec(), |_| 0.0).logsumexp();
        row.mapv_inplace(|z| z - lse);
    }
    out
}

/// Cross-entropy of `logits: [n, v]` against `targets: [n]` (PyTorch
/// `cross_entropy` semantics: `ignore_index`, `label_smoothing`, reductions;
/// plus Megatron's smoothing convention, the z-loss and logit soft-capping),
/// and its gradient `[n, v]` (with respect to the raw logits) when `call`
/// asks for it, each row scaled by [`LossCall::token_weights`] (the upstream
/// gradient multiplied in). With a softcap the statistics (`stats`, `logsumexp`) are
/// those of the capped logits.
///
/// Logits may be `-inf` (masked entries).
///
/// # Errors
/// [`Error::ShapeMismatch`] (`targets` of another length, an empty
/// vocabulary, a `grad_output` of another length than
/// [`LossCall::upstream_len`]); [`Error::NonFiniteInput`] for a non-finite
/// `grad_output`; [`Error::NonFiniteInput`] for NaN or `+inf` logits;
/// [`Error::IndexOutOfRange`] for a target outside `0..v` that is not
/// `ignore_index`; [`Error::InvalidArgument`] for bad options or a non-ignored
/// row of `-inf` logits.
pub fn cross_entropy(logits: ArrayView2<f64>, call: &LossCall) -> Result<CrossEntropy> {
    let config = call.config;
    let (n, v) = logits.dim();
    check_shapes(n, v, call)?;
    check_logits("logits", logits, v, v, 0)?;
    config.validate(v)?;
    let targets = config.targets(call.targets, v)?;
    // Soft-capping comes before everything else (docs/FAULTS.md O1).
    let capped = config.softcap.map(|c| logits.mapv(|z| softcap::cap(z, c)));
    let logits = capped.as_ref().map_or(logits, |c| c.view());
    let (q_target, q_other) = config.target_distribution(v);
    let q = |i: usize, j: usize| match targets[i] {
        None => 0.0,
        Some(t) if t == j => q_target,
        Some(_) => q_other,
    };
    let mut stats = Vec::with_capacity(n);
    for (i, row) in logits.rows().into_iter().enumerate() {
        let z: Vec<f64> = row.to_vec();
        let s = SoftmaxStats::of(&z, |j| q(i, j));
        check_row(i, &s, targets[i])?;
        stats.push(s);
    }
    check_z_loss(config, &stats, &targets)?;
    let per_token_loss: Array1<f64> = (0..n)
        .map(|i| token_loss(&stats[i], targets[i], config))
        .collect();
    let loss = config.reduce(per_token_loss.as_slice().unwrap_or(&[]), &targets);
    if call.want_grad() {
        check_grad_bound(&call.token_weights(&targets), &stats, config.z_loss)?;
    }
    let grad_logits = call.want_grad().then(|| {
        let weights = call.token_weights(&targets);
        let mut grad = Array2::zeros((n, v));
        for ((i, j), g) in grad.indexed_iter_mut() {
            if weights[i] != 0.0 {
                let z = logits[[i, j]];
                let dy = weights[i] * stats[i].gradient(z, q(i, j), config.z_loss);
                *g = softcap::chain(dy, z, config.softcap);
            }
        }
        grad
    });
    Ok(CrossEntropy {
        loss,
        per_token_loss,
        stats,
        num_tokens: targets.iter().filter(|t| t.is_some()).count(),
        grad_logits,
    })
}

/// The shape checks of a loss call on `n` rows of `v` vocabulary entries:
/// `targets: [n]`, `v >= 1`, and the upstream gradient
/// ([`LossCall::check_upstream`]). Shared by the other implementations (the
/// optimized kernels).
///
/// # Errors
/// [`Error::ShapeMismatch`] naming `targets`, `logits` or `grad_output`;
/// [`Error::NonFiniteInput`] naming `grad_output`.
pub fn check_shapes(n: usize, v: usize, call: &LossCall) -> Result<()> {
    let targets = call.targets;
    if targets.len() != n {
        return Err(Error::ShapeMismatch {
            field: "targets".into(),
            expected: format!("[n] with n = {n} (the rows of the logits)"),
            actual: vec![targets.len()],
        });
    }
    if v == 0 {
        return Err(Error::ShapeMismatch {
            field: "logits".into(),
            expected: "[n, v] with v >= 1".into(),
            actual: vec![n, v],
        });
    }
    call.check_upstream(n)
}

/// The largest `h * max|hidden| * max|weight|` accepted: no logit can then
/// overflow (`|z| <= h * max|x| * max|w|`).
pub const MAX_LOGIT_BOUND: f64 = 1e300;

/// Checks `hidden: [n, h]` and `weight: [k, h]` (`k` rows of the vocabulary
/// starting at global row `offset`; only the first `rows` are real) for the
/// output layer: finite values, matching `h`, logits that cannot overflow.
///
/// # Errors
/// [`Error::ShapeMismatch`], [`Error::NonFiniteInput`] (flat index, global
/// rows for the weight), [`Error::InvalidArgument`] when logits could
/// overflow.
pub fn check_linear(
    hidden: ArrayView2<f64>,
    weight: ArrayView2<f64>,
    rows: usize,
    offset: usize,
) -> Result<()> {
    let h = hidden.ncols();
    if weight.ncols() != h {
        return Err(Error::ShapeMismatch {
            field: "weight".into(),
            expected: format!("[v, h] with h = {h} (the columns of hidden)"),
            actual: weight.shape().to_vec(),
        });
    }
    check_finite("hidden", hidden.iter())?;
    let real = weight.slice_axis(Axis(0), Slice::from(..rows.min(weight.nrows())));
    if let Err(Error::NonFiniteInput { index, value, .. }) = check_finite("weight", real.iter()) {
        return Err(Error::NonFiniteInput {
            field: "weight".into(),
            index: index + offset * h,
            value,
        });
    }
    let max_abs = |a: ArrayView2<f64>| a.iter().fold(0.0f64, |m, x| m.max(x.abs()));
    let bound = h as f64 * max_abs(hidden) * max_abs(real);
    if bound.is_nan() || bound > MAX_LOGIT_BOUND {
        return Err(Error::invalid(
            "hidden",
            format!("h * max|hidden| * max|weight| = {bound:e} is over {MAX_LOGIT_BOUND:e}: logits could overflow"),
        ));
    }
    Ok(())
}

/// `logits = hidden @ weight^T`: `hidden: [n, h]`, `weight: [v, h]` → `[n, v]`.
///
/// # Errors
/// As [`check_linear`], and [`Error::InvalidArgument`] when `n * v` is over
/// [`super::MAX_LOGITS`].
pub fn logits(hidden: ArrayView2<f64>, weight: ArrayView2<f64>) -> Result<Array2<f64>> {
    check_linear(hidden, weight, weight.nrows(), 0)?;
    check_logits_size("weight", hidden.nrows(), weight.nrows())?;
    super::check_linear_work(hidden.nrows(), weight.nrows(), hidden.ncols())?;
    Ok(hidden.dot(&weight.t()))
}

/// The result of the unsharded output layer plus cross-entropy.
#[derive(Debug, Clone, PartialEq)]
pub struct LinearCrossEntropy {
    /// `[n, v]`: `hidden @ weight^T`.
    pub logits: Array2<f64>,
    /// The cross-entropy of the logits (with `grad_logits` when asked for).
    pub ce: CrossEntropy,
    /// `[n, h]`: `d loss / d hidden = grad_logits @ weight`, when asked for.
    pub grad_hidden: Option<Array2<f64>>,
    /// `[v, h]`: `d loss / d weight = grad_logits^T @ hidden`, when asked for.
    pub grad_weight: Option<Array2<f64>>,
}

/// The output layer and its loss: `logits = hidden @ weight^T` (`hidden: [n,
/// h]`, `weight: [v, h]`), then [`cross_entropy`]; when `call` asks for them the
/// gradients of the logits, the hidden states and the weights.
///
/// # Errors
/// As [`logits`] (non-finite inputs are errors here) and [`cross_entropy`].
pub fn linear_cross_entropy(
    hidden: ArrayView2<f64>,
    weight: ArrayView2<f64>,
    call: &LossCall,
) -> Result<LinearCrossEntropy> {
    check_shapes(hidden.nrows(), weight.nrows(), call)?;
    let logits = logits(hidden, weight)?;
    let ce = cross_entropy(logits.view(), call)?;
    let (grad_hidden, grad_weight) = match &ce.grad_logits {
        Some(g) => (
            Some(sum::matmul(g.view(), weight)),
            Some(g.t().dot(&hidden)),
        ),
        None => (None, None),
    };
    Ok(LinearCrossEntropy {
        logits,
        ce,
        grad_hidden,
        grad_weight,
    })
}

/// The softmax of `logits: [n, v]` row by row (`[n, v]`); a row of `-inf`
/// gives a row of NaN, as it has no softmax.
pub fn softmax(logits: ArrayView2<f64>) -> Array2<f64> {
    let mut out = logits.to_owned();
    for mut row in out.rows_mut() {
        let s = SoftmaxStats::of(&row.to_vec(), |_| 0.0);
        if s.max == f64::NEG_INFINITY {
            row.fill(f64::NAN);
        } else {
            row.mapv_inplace(|z| s.probability(z));
        }
    }
    out
}
