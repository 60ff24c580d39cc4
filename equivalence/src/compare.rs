//! Comparing tensors under a stated tolerance, with readable failures.

use std::fmt;

use packshard_reference::ops::Precision;

/// A tolerance rule: element `i` passes when
/// `|actual_i - expected_i| <= rel * |expected_i| + abs * scale`,
/// where `scale = max_j |expected_j|` (at least 1e-300) makes the absolute
/// floor relative to the tensor's magnitude, so values that cancel to near
/// zero are judged against the size of the terms they came from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tolerance {
    /// Name shown in failures, e.g. `f64 exact rewrite`.
    pub name: &'static str,
    /// Relative part.
    pub rel: f64,
    /// Absolute floor, as a fraction of the tensor's largest magnitude.
    pub abs: f64,
    /// Absolute floor in the values' own units: what the kernel's precision
    /// cannot represent (0 for f64 rules; [`F32_UNDERFLOW`] for f32 and bf16
    /// kernels, which flush results below f32's normal range to 0).
    pub underflow: f64,
}

/// The underflow floor of f32 (and bf16, which has f32's exponent range):
/// 64 x the smallest normal f32 (7.5e-37), the f32 twin of
/// `vocab::UNDERFLOW`. Below it an f32 kernel's results are subnormal or
/// flushed to 0. The case that set it: `tests/fuzz_regressions.rs`
/// (`FUZZ_SEED=1`, seeded input 682), a causal 2 x 2 segment whose scores
/// are 700 apart with a zero value on the winning key: the exact output
/// 9.86e-304, every f32 kernel's 0, and 64 ulp of f32 times the terms
/// (2e-300) allowed nothing for it. Real faults are of the tensor's scale,
/// 10^30 times this or more.
pub const F32_UNDERFLOW: f64 = 64.0 * f32::MIN_POSITIVE as f64;

impl Tolerance {
    /// Two f64 computations of the same math that differ only in the order of
    /// a few additions (packed vs padded, sharded vs unsharded in the
    /// reference). Each reordered sum of `k` terms can move the result by about
    /// `k * eps` of its largest term; 64 ulp covers the sums of our test sizes
    /// (at most a few hundred terms per reduction, most of them exact zeros
    /// from masking) with room, and is still 10^10 times tighter than any real
    /// bug we plant.
    pub const F64_REWRITE: Tolerance = Tolerance {
        name: "f64 rewrite (64 ulp)",
        rel: 64.0 * f64::EPSILON,
        abs: 64.0 * f64::EPSILON,
        underflow: 0.0,
    };

    /// The f32 twin of [`Tolerance::F64_REWRITE`]: two f32 computations of
    /// the same math in another order (packed vs padded rows through an f32
    /// layer: the matrix products block differently for different row
    /// counts, and parameter gradients sum over tokens in another order).
    /// 64 ulp of f32 (7.6e-6), the floor relative to the tensor's scale.
    pub const F32_REWRITE: Tolerance = Tolerance {
        name: "f32 rewrite (64 ulp of f32)",
        rel: 64.0 * f32::EPSILON as f64,
        abs: 64.0 * f32::EPSILON as f64,
        underflow: F32_UNDERFLOW,
    };

    /// Bit-for-bit equality.
    pub const EXACT: Tolerance = Tolerance {
        name: "exact",
        rel: 0.0,
        abs: 0.0,
        underflow: 0.0,
    };

    /// A custom rule.
    pub const fn new(name: &'static str, rel: f64, abs: f64) -> Self {
        Tolerance {
            name,
            rel,
            abs,
            underflow: 0.0,
        }
    }

    /// The same rule with an underflow floor (see [`F32_UNDERFLOW`]).
    pub const fn with_underflow(self, underflow: f64) -> Self {
        Tolerance { underflow, ..self }
    }

    /// What an element may be off by: `rel |expected| + abs scale +
    /// underflow`.
    pub fn allowed(&self, expected: f64, scale: f64) -> f64 {
        self.rel * expected.abs() + self.abs * scale + self.underflow
    }
}

/// A failed check: what was compared, where it first differs, and by how much.
#[derive(Debug, Clone, PartialEq)]
pub struct Mismatch {
    /// The check or tensor, e.g. `grad_q` or `position_ids`.
    pub what: String,
    /// A few lines of detail (index, both values, errors, tolerance).
    pub detail: String,
}

impl Mismatch {
    /// A mismatch with free-form detail.
    pub fn new(what: impl Into<String>, detail: impl Into<String>) -> Self {
        Mismatch {
            what: what.into(),
            detail: detail.into(),
        }
    }

    /// The same mismatch with `context` in front of what was compared
    /// (`unsharded: grad_logits`).
    pub fn within(self, context: &str) -> Self {
        Mismatch {
            what: format!("{context}: {}", self.what),
            detail: self.detail,
        }
    }
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.what, self.detail)
    }
}

impl std::error::Error for Mismatch {}

/// Summary of the difference between two tensors.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ErrorStats {
    /// Largest `|actual - expected|`.
    pub max_abs: f64,
    /// Largest `|actual - expected| / |expected|` over elements with `expected != 0`.
    pub max_rel: f64,
    /// Mean `|actual - expected|`.
    pub mean_abs: f64,
    /// Root mean square of `actual - expected`.
    pub rmse: f64,
}

/// Error statistics of `actual` against `expected` (equal lengths).
pub fn error_stats(expected: &[f64], actual: &[f64]) -> ErrorStats {
    let n = expected.len().max(1) as f64;
    let mut s = ErrorStats::default();
    let mut sq = 0.0;
    for (&e, &a) in expected.iter().zip(actual) {
        let d = (a - e).abs();
        s.max_abs = s.max_abs.max(d);
        if e != 0.0 {
            s.max_rel = s.max_rel.max(d / e.abs());
        }
        s.mean_abs += d / n;
        sq += d * d / n;
    }
    s.rmse = sq.sqrt();
    s
}

/// Formats a flat index as a multi-index of `shape`.
pub fn unravel(mut flat: usize, shape: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    for (i, &extent) in shape.iter().enumerate().rev() {
        if extent > 0 {
            idx[i] = flat % extent;
            flat /= extent;
        }
    }
    idx
}

/// Compares `actual` with `expected` (both row-major of `shape`) under `tol`.
///
/// NaN never equals anything (a NaN where the expected value is finite, or
/// the reverse, fails); equal infinities pass.
///
/// # Errors
/// A [`Mismatch`] naming `what`, the first failing multi-index, both values,
/// how many elements fail, the max/mean/RMS error and the tolerance.
pub fn assert_close(
    what: &str,
    expected: &[f64],
    actual: &[f64],
    shape: &[usize],
    tol: Tolerance,
) -> Result<(), Mismatch> {
    assert_close_with_scale(what, expected, actual, shape, tol, None)
}

/// As [`assert_close`], with the absolute floor relative to `scale` (when
/// given, at least the tensor's own largest magnitude) instead of the tensor's
/// own largest magnitude: for tensors that are parts of one larger vector and
/// may be zero by symmetry (a key bias's gradient is 0 in exact arithmetic
/// because softmax is shift-invariant; computed, it is round-off of terms as
/// large as the other gradients).
///
/// # Errors
/// As [`assert_close`].
pub fn assert_close_with_scale(
    what: &str,
    expected: &[f64],
    actual: &[f64],
    shape: &[usize],
    tol: Tolerance,
    scale: Option<f64>,
) -> Result<(), Mismatch> {
    check_len(what, expected.len(), actual.len(), shape)?;
    let scale = expected
        .iter()
        .filter(|v| v.is_finite())
        .fold(scale.unwrap_or(1e-300).max(1e-300), |m, v| m.max(v.abs()));
    let mut first = None;
    let mut failures = 0usize;
    for (i, (&e, &a)) in expected.iter().zip(actual).enumerate() {
        let ok = if e.is_finite() && a.is_finite() {
            (a - e).abs() <= tol.allowed(e, scale)
        } else {
            e == a // equal infinities; NaN never passes
        };
        if !ok {
            failures += 1;
            first.get_or_insert(i);
        }
    }
    let Some(i) = first else { return Ok(()) };
    let stats = error_stats(expected, actual);
    Err(Mismatch::new(
        what,
        format!(
            "{failures} of {} elements differ; first at {:?}: expected {:e}, got {:e}\n  max abs error {:e}, max rel error {:e}, mean abs error {:e}, rmse {:e}; tolerance {} (rel {:e}, abs {:e} x scale {:e})",
            expected.len(),
            unravel(i, shape),
            expected[i],
            actual[i],
            stats.max_abs,
            stats.max_rel,
            stats.mean_abs,
            stats.rmse,
            tol.name,
            tol.rel,
            tol.abs,
            scale
        ),
    ))
}

/// A storage rule ([`RelativeRule::BF16_STORED_FUZZ`]): `k = 2` over a
/// suite, `k_tensor` per tensor, a floor of `floor` unit roundoffs of the
/// storage precision ([`Precision::unit_roundoff`]); the name is built from
/// the same literals, so it cannot state other numbers than the rule holds.
macro_rules! storage_rule {
    ($name:literal, $precision:ident, k_tensor: $k:literal, floor: $floor:literal) => {
        RelativeRule::new(
            concat!(
                $name,
                " storage: ",
                $k,
                " x the error of the reference run in f32 and stored in ",
                $name,
                ", floor ",
                $floor,
                " unit roundoffs of the scale"
            ),
            2.0,
            $k as f64,
            $floor as f64,
            Precision::$precision.unit_roundoff(),
        )
    };
}

/// A [`Tolerance`] of `n` unit roundoffs `u` of a precision
/// ([`Precision::unit_roundoff`]), relative and of the tensor's scale (`n u
/// |expected| + n u scale`), named `"<what> (<n> unit roundoffs)"` from the
/// same literal `n`, so that the name cannot state another number than the
/// rule holds: `roundoffs_tolerance!("bf16 inputs", 16, Bf16)`.
#[macro_export]
macro_rules! roundoffs_tolerance {
    ($what:literal, $n:literal, $precision:ident) => {
        $crate::Tolerance::new(
            concat!($what, " (", $n, " unit roundoffs)"),
            $n as f64 * $crate::__reference::ops::Precision::$precision.unit_roundoff(),
            $n as f64 * $crate::__reference::ops::Precision::$precision.unit_roundoff(),
        )
    };
}

/// The tolerance rule for a kernel computed in lower precision than the
/// reference (after the rule of flash-attention's tests): the kernel's error
/// against the f64 reference is compared with the error of the **same
/// reference math run in the kernel's precision** (`baseline`: plain loops,
/// no tiling, no SIMD; `crate::baseline32`) on the same inputs.
///
/// Two tiers, because the largest error of one small tensor is a noisy
/// statistic: on the suites' random cases (tensors of a few dozen values,
/// planted outliers, cancelling sums), two equally legitimate f32
/// transcriptions of the reference — with and without fused multiply-adds,
/// same order — differ by up to 23 x in the max error of an attention
/// gradient (measured over 2000 cases; see the optimized crate's tests).
///
/// - **per tensor** (catches a fault local to one case): `max |actual -
///   expected| <= k_tensor * max |baseline - expected| + floor * eps *
///   scale`, `scale = max |expected|` (or a given larger scale for a part of
///   a vector that can be zero by symmetry). The floor only matters where the
///   baseline is exact.
/// - **over a suite** ([`RelativeTotals`]): the kernel's largest and mean
///   error relative to each tensor's scale are at most `k` times the
///   baseline's. This is the rule's `k`.
///
/// Both sides must be non-finite at the same places with the same value.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RelativeRule {
    /// Name shown in failures.
    pub name: &'static str,
    /// `k`: over a suite, how many times the baseline's error the kernel may have.
    pub k: f64,
    /// The per-tensor factor.
    pub k_tensor: f64,
    /// The per-tensor floor in units of `eps * scale`.
    pub floor: f64,
    /// The unit `floor` counts in: f32's machine epsilon (`2^-23`, an ulp
    /// of 1) for the f32 rules, the storage's unit roundoff `u`
    /// ([`Precision::unit_roundoff`], `2^-8` for bf16) for the storage rules.
    pub eps: f64,
}

impl RelativeRule {
    /// f32 kernels: `k = 4` over a suite. flash-attention's tests allow 2 for
    /// fp16/bf16, where the baseline's error is dominated by rounding every
    /// stored value to 8 or 11 bits; in f32 the baseline accumulates in the
    /// same precision as the kernel, and the kernel adds other summation
    /// orders (SIMD lanes, tiles, chunks, the online softmax's rescaling) and
    /// a 2-ulp polynomial `exp`, so 4. Per tensor `k_tensor = 32` (above the
    /// 23 x spread of two legitimate f32 implementations, see the type's
    /// docs) and a floor of 4 ulp of the tensor's scale; a planted fault is
    /// 10^3 x or more (the negative controls).
    pub const F32: RelativeRule = RelativeRule::new(
        "f32: 4 x the error of the reference run in f32 over the suite, 32 x per tensor",
        4.0,
        32.0,
        4.0,
        f32::EPSILON as f64,
    );

    /// f32 kernels on single adversarial cases (the fuzz targets): as
    /// [`RelativeRule::F32`] but with a floor of 256 ulp of the tensor's
    /// scale. One case has no suite to average over, and 32 x the f32
    /// baseline is not a bound on legitimate rounding in one case: the
    /// committed inputs under `fuzz/regressions/optimized_linear_cross_entropy/`
    /// include a gradient summed over planted `±100` weights where the
    /// baseline's error was 0.6 ulp and the fused kernel's 28 ulp of the
    /// scale, and one with `±100` activations and z-loss where `exp(z - m)`
    /// with `|z - m|` in the hundreds cost the kernel 113 ulp of the scale
    /// (the baseline 12). 256 ulp of f32 is `3e-5` of the scale; the planted
    /// faults of the negative controls are `1e-3` of it or more.
    pub const F32_FUZZ: RelativeRule = RelativeRule {
        name: "f32 fuzz: 32 x the error of the reference run in f32, floor 256 ulp of the scale",
        floor: 256.0,
        ..RelativeRule::F32
    };

    /// Kernels that store their inputs and results in bf16 (arithmetic in
    /// f32), on single cases, against the reference math run in f32 with its
    /// results rounded to bf16 (the Python package's `precision="bf16"`).
    /// That baseline's error is the rounding of the stored results, up to
    /// `u = 2^-8` of each value; a correct kernel rounds the same values, so
    /// its error is the baseline's wherever neither sits at a rounding tie,
    /// about twice it where one does (flash-attention's tests allow 2 x for
    /// fp16/bf16). `k_tensor = 8` leaves room for kernels that also round
    /// intermediates (the probabilities before `P @ V`, as flash-attention
    /// does) and is still tight where it matters: 32 x would pass a result
    /// 12% off (`32 u`), 8 x fails anything beyond about 3% (`8 u`) of the
    /// scale. Floor: one ulp of bf16 (`2 u`) of the scale, for tensors the
    /// baseline stores exactly (a loss that is a bf16 value).
    pub const BF16_STORED_FUZZ: RelativeRule = storage_rule!("bf16", Bf16, k_tensor: 8, floor: 2);

    /// [`RelativeRule::BF16_STORED_FUZZ`] for IEEE f16 storage (`u =
    /// 2^-11`): the same reasoning, 8 x the baseline stored in f16.
    pub const F16_STORED_FUZZ: RelativeRule = storage_rule!("f16", F16, k_tensor: 8, floor: 2);

    /// A custom rule.
    pub const fn new(name: &'static str, k: f64, k_tensor: f64, floor: f64, eps: f64) -> Self {
        RelativeRule {
            name,
            k,
            k_tensor,
            floor,
            eps,
        }
    }
}

/// The suite tier of a [`RelativeRule`]: errors relative to each tensor's
/// scale, accumulated over every comparison of a run.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct RelativeTotals {
    /// Largest `error / scale` of the kernel.
    pub max: f64,
    /// Largest `baseline error / scale`.
    pub baseline_max: f64,
    /// Sum of the kernel's `error / scale`.
    pub sum: f64,
    /// Sum of the baseline's `error / scale`.
    pub baseline_sum: f64,
    /// Comparisons with a non-zero scale.
    pub count: usize,
}

impl RelativeTotals {
    /// Adds one comparison.
    pub fn add(&mut self, e: &RelativeError) {
        if e.scale > 0.0 {
            let (a, b) = (e.error / e.scale, e.baseline / e.scale);
            self.max = self.max.max(a);
            self.baseline_max = self.baseline_max.max(b);
            self.sum += a;
            self.baseline_sum += b;
            self.count += 1;
        }
    }

    /// Merges another run's totals.
    pub fn merge(&mut self, o: &RelativeTotals) {
        self.max = self.max.max(o.max);
        self.baseline_max = self.baseline_max.max(o.baseline_max);
        self.sum += o.sum;
        self.baseline_sum += o.baseline_sum;
        self.count += o.count;
    }

    /// The kernel's largest relative error over the baseline's.
    pub fn max_ratio(&self) -> f64 {
        if self.max == 0.0 {
            0.0
        } else {
            self.max / self.baseline_max
        }
    }

    /// The kernel's mean relative error over the baseline's.
    pub fn mean_ratio(&self) -> f64 {
        if self.sum == 0.0 {
            0.0
        } else {
            self.sum / self.baseline_sum
        }
    }

    /// The suite tier: both ratios at most `rule.k`, and the baseline
    /// inexact somewhere (else the rule says nothing).
    ///
    /// # Errors
    /// A [`Mismatch`] naming `what` with both ratios.
    pub fn check(&self, what: &str, rule: RelativeRule) -> Result<(), Mismatch> {
        if self.baseline_max == 0.0 {
            return Err(Mismatch::new(
                what,
                format!(
                    "the f32 baseline was exact in all {} comparisons: the rule is vacuous",
                    self.count
                ),
            ));
        }
        if self.max_ratio() > rule.k || self.mean_ratio() > rule.k {
            return Err(Mismatch::new(
                what,
                format!(
                    "over {} tensors the kernel's largest relative error is {:e} ({:.2} x the baseline's {:e}) and its mean {:.2} x the baseline's; at most {} x is allowed ({})",
                    self.count,
                    self.max,
                    self.max_ratio(),
                    self.baseline_max,
                    self.mean_ratio(),
                    rule.k,
                    rule.name
                ),
            ));
        }
        Ok(())
    }
}

/// What one comparison under a [`RelativeRule`] saw.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct RelativeError {
    /// `max |actual - expected|`.
    pub error: f64,
    /// `max |baseline - expected|`.
    pub baseline: f64,
    /// `max |expected|` (finite values), or the larger scale given.
    pub scale: f64,
    /// The absolute floor the tensor was allowed (`floor * eps * scale`).
    pub floor: f64,
    /// Values compared.
    pub values: usize,
}

impl RelativeError {
    /// `error / baseline` (0 when both are 0, infinite when only the
    /// baseline is exact).
    pub fn ratio(&self) -> f64 {
        if self.error == 0.0 {
            0.0
        } else {
            self.error / self.baseline
        }
    }
}

/// Largest `|a - e|` over the finite pairs, and whether the non-finite
/// values agree (`None`: the first index where they do not).
fn finite_max_error(expected: &[f64], actual: &[f64]) -> (f64, Option<usize>) {
    let mut max = 0.0f64;
    for (i, (&e, &a)) in expected.iter().zip(actual).enumerate() {
        if e.is_finite() && a.is_finite() {
            max = max.max((a - e).abs());
        } else if e != a {
            return (max, Some(i));
        }
    }
    (max, None)
}

/// Checks `actual` against `expected` (both row-major of `shape`) under
/// `rule`, given the baseline's error `baseline_error = max |baseline -
/// expected|` (see [`RelativeRule`]), beyond it allowing what `allowance`
/// states (`Allowance::default()`: nothing).
///
/// # Errors
/// A [`Mismatch`] naming `what`, the multi-index of the largest error, both
/// values there, the kernel's and the baseline's max error, their ratio and
/// the rule; or the first index where the non-finite values differ.
pub fn assert_close_relative_to(
    what: &str,
    expected: &[f64],
    actual: &[f64],
    shape: &[usize],
    baseline_error: f64,
    rule: RelativeRule,
    Allowance { scale, traded }: Allowance,
) -> Result<RelativeError, Mismatch> {
    let error = max_error(what, expected, actual, shape, Against::Actual)?;
    let scale = max_finite(expected).max(scale.unwrap_or(0.0));
    let seen = RelativeError {
        error,
        baseline: baseline_error,
        scale,
        floor: rule.floor * rule.eps * scale,
        values: expected.len(),
    };
    let allowed = rule.k_tensor * baseline_error + seen.floor + traded;
    if error <= allowed {
        return Ok(seen);
    }
    let worst = expected
        .iter()
        .zip(actual)
        .position(|(&e, &a)| e.is_finite() && (a - e).abs() == error)
        .unwrap_or(0);
    Err(Mismatch::new(
        what,
        format!(
            "max error {:e} at {:?} (expected {:e}, got {:e}) is {:.3} x the baseline's {:e}; allowed {:e} = {} x baseline + {} eps x scale {:e}{} ({})",
            error,
            unravel(worst, shape),
            expected[worst],
            actual[worst],
            seen.ratio(),
            baseline_error,
            allowed,
            rule.k_tensor,
            rule.floor,
            scale,
            if traded > 0.0 {
                format!(" + the {traded:e} it reports it traded")
            } else {
                String::new()
            },
            rule.name
        ),
    ))
}

fn max_finite(x: &[f64]) -> f64 {
    x.iter()
        .filter(|v| v.is_finite())
        .fold(0.0f64, |m, v| m.max(v.abs()))
}

/// A [`Mismatch`] when `actual` holds `n` values where `expected` (of `shape`) holds `m`.
fn check_len(what: &str, m: usize, n: usize, shape: &[usize]) -> Result<(), Mismatch> {
    if n == m {
        return Ok(());
    }
    Err(Mismatch::new(
        what,
        format!("length {n} where {m} was expected (shape {shape:?})"),
    ))
}

/// Which tensor [`max_error`] compares with the reference (its messages name it).
#[derive(Debug, Clone, Copy)]
enum Against {
    /// The implementation under test.
    Actual,
    /// The f32 baseline that sets the allowance.
    Baseline,
}

/// The largest error of `other` against `expected` over the values where
/// both are finite; a [`Mismatch`] when the lengths differ or a non-finite
/// value disagrees (those must agree exactly).
fn max_error(
    what: &str,
    expected: &[f64],
    other: &[f64],
    shape: &[usize],
    against: Against,
) -> Result<f64, Mismatch> {
    let (n, m) = (other.len(), expected.len());
    match against {
        Against::Actual => check_len(what, m, n, shape)?,
        Against::Baseline if n != m => {
            let detail = format!("the baseline has {n} values, the reference {m}");
            return Err(Mismatch::new(what, detail));
        }
        Against::Baseline => {}
    }
    let (error, bad) = finite_max_error(expected, other);
    let Some(i) = bad else {
        return Ok(error);
    };
    let (at, e, o) = (unravel(i, shape), expected[i], other[i]);
    Err(match against {
        Against::Actual => Mismatch::new(
            what,
            format!("at {at:?}: expected {e:e}, got {o:e} (non-finite values must agree exactly)"),
        ),
        Against::Baseline => Mismatch::new(
            format!("{what} (baseline)"),
            format!("at {at:?}: the reference gives {e:e}, the f32 baseline {o:e}"),
        ),
    })
}

/// What a relative check allows beyond the rule: the scale of its floor
/// (`None`: the expected tensor's own largest magnitude; see
/// [`assert_close_with_scale`]) and the error an approximate implementation
/// reports it `traded` on purpose (0 for every exact-math kernel).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Allowance {
    /// At least the tensor's largest magnitude when given.
    pub scale: Option<f64>,
    /// The reported trade, added to the allowance as it is.
    pub traded: f64,
}

impl Allowance {
    /// The floor relative to `scale` (when given, at least the tensor's own
    /// largest magnitude), no trade: for tensors that are parts of one
    /// larger vector and may be zero by symmetry (see
    /// [`assert_close_with_scale`]).
    pub fn with_scale(scale: Option<f64>) -> Self {
        Allowance { scale, traded: 0.0 }
    }
}

/// As [`assert_close_relative_to`], computing the baseline's error from the
/// baseline tensor itself (which must agree with `expected` on non-finite
/// values too). `allowance` widens the floor's scale
/// ([`Allowance::with_scale`]) and adds the error an approximate
/// implementation reports it `traded` on purpose
/// (`packshard_reference::ops::TradedError`), so that an error beyond
/// rounding **and** that report still fails; `Allowance::default()` allows
/// neither.
///
/// # Errors
/// As [`assert_close_relative_to`]; a [`Mismatch`] if the baseline's
/// non-finite values differ from the reference's.
pub fn assert_within_k(
    what: &str,
    expected: &[f64],
    baseline: &[f64],
    actual: &[f64],
    shape: &[usize],
    rule: RelativeRule,
    allowance: Allowance,
) -> Result<RelativeError, Mismatch> {
    let base = max_error(what, expected, baseline, shape, Against::Baseline)?;
    assert_close_relative_to(what, expected, actual, shape, base, rule, allowance)
}

#[cfg(test)]
#[path = "compare_tests.rs"]
mod tests;

/// How an implementation's results are judged against the f64 reference:
/// the one value a registry entry states and every suite and fuzz target
/// reads (`docs/FAULTS.md`, "How results are judged").
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Judge {
    /// An f64 rewrite of the reference: every value within `Tolerance` of
    /// the reference's (packed == padded within the same tolerance).
    Rewrite(Tolerance),
    /// A lower-precision kernel: inputs rounded to `inputs` first (so the
    /// kernel and the reference see the same numbers), every result within
    /// the [`RelativeRule`] of the reference math run in f32 on them, and its
    /// two forms (packed and padded, sharded and unsharded) within `packed`
    /// of each other.
    Relative {
        /// The rule against the f64 reference.
        rule: RelativeRule,
        /// What the inputs are rounded to first.
        inputs: Precision,
        /// Packed against padded (its own two forms).
        packed: Tolerance,
    },
}

impl Judge {
    /// The function that rounds an input as the implementation receives it
    /// (identity for a rewrite).
    pub fn round(&self) -> fn(f64) -> f64 {
        match self {
            Judge::Rewrite(_) => |x| x,
            Judge::Relative { inputs, .. } => inputs.rounding(),
        }
    }

    /// The tolerance of packed against padded (and sharded against
    /// unsharded) for this implementation.
    pub fn packed(&self) -> Tolerance {
        match *self {
            Judge::Rewrite(t) => t,
            Judge::Relative { packed, .. } => packed,
        }
    }

    /// The relative rule, when the implementation is a lower-precision one.
    pub fn relative_rule(&self) -> Option<RelativeRule> {
        match *self {
            Judge::Rewrite(_) => None,
            Judge::Relative { rule, .. } => Some(rule),
        }
    }
}

impl fmt::Display for Judge {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Judge::Rewrite(t) => write!(f, "{}", t.name),
            Judge::Relative {
                rule,
                inputs,
                packed,
            } => write!(
                f,
                "{} on {} inputs; packed == padded: {}",
                rule.name,
                inputs.name(),
                packed.name
            ),
        }
    }
}
