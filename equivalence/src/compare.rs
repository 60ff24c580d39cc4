//! Comparing tensors under a stated tolerance, with readable failures.

use std::fmt;

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
}

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
    };

    /// Bit-for-bit equality.
    pub const EXACT: Tolerance = Tolerance {
        name: "exact",
        rel: 0.0,
        abs: 0.0,
    };

    /// A custom rule.
    pub const fn new(name: &'static str, rel: f64, abs: f64) -> Self {
        Tolerance { name, rel, abs }
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
    if expected.len() != actual.len() {
        return Err(Mismatch::new(
            what,
            format!(
                "length {} where {} was expected (shape {shape:?})",
                actual.len(),
                expected.len()
            ),
        ));
    }
    let scale = expected
        .iter()
        .filter(|v| v.is_finite())
        .fold(scale.unwrap_or(1e-300).max(1e-300), |m, v| m.max(v.abs()));
    let mut first = None;
    let mut failures = 0usize;
    for (i, (&e, &a)) in expected.iter().zip(actual).enumerate() {
        let ok = if e.is_finite() && a.is_finite() {
            (a - e).abs() <= tol.rel * e.abs() + tol.abs * scale
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn close_values_pass_and_far_values_name_the_index() {
        let e = [1.0, -2.0, 3.0, 4.0];
        assert!(assert_close("t", &e, &e, &[2, 2], Tolerance::EXACT).is_ok());
        let mut a = e;
        a[3] += 1e-15;
        assert!(assert_close("t", &e, &a, &[2, 2], Tolerance::F64_REWRITE).is_ok());
        a[2] = 3.001;
        let m = assert_close("t", &e, &a, &[2, 2], Tolerance::F64_REWRITE).unwrap_err();
        assert!(
            m.detail
                .contains("first at [1, 0]: expected 3e0, got 3.001e0"),
            "{m}"
        );
        assert!(m.detail.contains("1 of 4 elements differ"), "{m}");
    }

    #[test]
    fn nan_never_passes_and_infinities_must_match() {
        let m = assert_close(
            "t",
            &[0.0],
            &[f64::NAN],
            &[1],
            Tolerance::new("loose", 1.0, 1.0),
        );
        assert!(m.is_err());
        assert!(assert_close(
            "t",
            &[f64::NEG_INFINITY],
            &[f64::NEG_INFINITY],
            &[1],
            Tolerance::EXACT
        )
        .is_ok());
        assert!(assert_close(
            "t",
            &[f64::NEG_INFINITY],
            &[-1e308],
            &[1],
            Tolerance::new("loose", 1.0, 1.0)
        )
        .is_err());
    }

    #[test]
    fn the_absolute_floor_scales_with_the_tensor() {
        // 1e-3 off on an element near zero of a tensor whose scale is 1e12 is round-off.
        assert!(assert_close(
            "t",
            &[1e12, 0.0],
            &[1e12, 1e-3],
            &[2],
            Tolerance::F64_REWRITE
        )
        .is_ok());
        assert!(
            assert_close("t", &[1.0, 0.0], &[1.0, 1e-3], &[2], Tolerance::F64_REWRITE).is_err()
        );
    }
}
