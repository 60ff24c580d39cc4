//! What the attention suites observe and report, shared by the packed ==
//! padded suite ([`super`]) and the general one
//! ([`crate::attention_general`]): a leaf both walk down to, so neither
//! imports the other's file.

use packshard_reference::bert::attention::AttentionOutput;

use crate::compare::{
    assert_close_with_scale, error_stats, Mismatch, RelativeError, RelativeTotals, Tolerance,
};

/// The name failures give the implementation under test (the registry
/// adds the entry's name).
pub(crate) const IMPL: &str = "implementation";

/// What a passing run saw.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Observed {
    /// Largest `|packed - padded|` over all compared values.
    pub max_abs: f64,
    /// Largest `|packed - padded| / max |padded|` of a tensor.
    pub max_rel: f64,
    /// Values compared.
    pub values: usize,
}

impl Observed {
    /// Compares `actual` with `expected` under `tol` and records the error.
    ///
    /// # Errors
    /// The [`Mismatch`] of [`crate::compare::assert_close`].
    pub fn close(
        &mut self,
        what: &str,
        expected: &[f64],
        actual: &[f64],
        shape: &[usize],
        tol: Tolerance,
    ) -> Result<(), Mismatch> {
        self.close_scaled(what, expected, actual, shape, tol, None)
    }

    /// As [`Observed::close`] with the absolute floor relative to `scale`
    /// (see [`assert_close_with_scale`]).
    ///
    /// # Errors
    /// The [`Mismatch`] of [`assert_close_with_scale`].
    pub fn close_scaled(
        &mut self,
        what: &str,
        expected: &[f64],
        actual: &[f64],
        shape: &[usize],
        tol: Tolerance,
        scale: Option<f64>,
    ) -> Result<(), Mismatch> {
        assert_close_with_scale(what, expected, actual, shape, tol, scale)?;
        if expected.len() == actual.len() {
            let s = error_stats(expected, actual);
            let scale = expected
                .iter()
                .fold(scale.unwrap_or(0.0), |m, v| m.max(v.abs()));
            self.max_abs = self.max_abs.max(s.max_abs);
            if scale > 0.0 {
                self.max_rel = self.max_rel.max(s.max_abs / scale);
            }
            self.values += expected.len();
        }
        Ok(())
    }

    /// Merges another run's figures.
    pub fn merge(&mut self, other: Observed) {
        self.max_abs = self.max_abs.max(other.max_abs);
        self.max_rel = self.max_rel.max(other.max_rel);
        self.values += other.values;
    }
}

/// A [`Mismatch`] naming `varlen_forward` unless `fwd` holds `output: [n_q,
/// h, d]` and `lse: [h, n_q]`.
pub(crate) fn check_forward_shapes(
    fwd: &AttentionOutput,
    (n_q, h, d): (usize, usize, usize),
) -> Result<(), Mismatch> {
    if fwd.output.dim() == (n_q, h, d) && fwd.lse.dim() == (h, n_q) {
        return Ok(());
    }
    Err(Mismatch::new(
        "varlen_forward",
        format!(
            "output {:?} and lse {:?}, expected [{n_q}, {h}, {d}] and [{h}, {n_q}]",
            fwd.output.shape(),
            fwd.lse.shape()
        ),
    ))
}

/// What a run under a [`crate::compare::RelativeRule`] saw: the worst per-tensor ratio of
/// the kernel's error to the baseline's, and the suite tier's totals.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RelativeReport {
    /// The suite tier (see [`crate::compare::RelativeRule`]).
    pub totals: RelativeTotals,
    /// Largest `error / baseline error` over the tensors whose error is
    /// above the rule's floor (0 if none).
    pub worst_ratio: f64,
    /// The tensor where it occurred.
    pub worst: String,
    /// Tensors compared.
    pub tensors: usize,
    /// Of which the baseline was not exact (the rule was not vacuous).
    pub nonzero_baseline: usize,
    /// Values compared.
    pub values: usize,
    /// Largest error of the kernel relative to the tensor's scale.
    pub worst_relative_error: f64,
}

impl RelativeReport {
    /// Records one comparison.
    pub fn note(&mut self, what: &str, e: RelativeError) {
        self.totals.add(&e);
        self.tensors += 1;
        self.values += e.values;
        if e.baseline > 0.0 {
            self.nonzero_baseline += 1;
            if e.error > e.floor && e.ratio() > self.worst_ratio {
                self.worst_ratio = e.ratio();
                self.worst = what.to_string();
            }
        }
        if e.scale > 0.0 {
            self.worst_relative_error = self.worst_relative_error.max(e.error / e.scale);
        }
    }

    /// Merges another run's figures.
    pub fn merge(&mut self, other: RelativeReport) {
        self.totals.merge(&other.totals);
        if other.worst_ratio > self.worst_ratio {
            self.worst_ratio = other.worst_ratio;
            self.worst = other.worst;
        }
        self.tensors += other.tensors;
        self.nonzero_baseline += other.nonzero_baseline;
        self.values += other.values;
        self.worst_relative_error = self.worst_relative_error.max(other.worst_relative_error);
    }

    /// Fails unless at least `min` comparisons had an inexact baseline (a
    /// run where the f32 baseline is always exact checks nothing but the floor).
    ///
    /// # Errors
    /// A [`Mismatch`] saying how many there were.
    pub fn require_nonvacuous(&self, min: usize) -> Result<(), Mismatch> {
        if self.nonzero_baseline < min {
            return Err(Mismatch::new(
                "relative suite",
                format!(
                    "only {} of {} comparisons had an inexact f32 baseline (at least {min} needed): the rule would be vacuous",
                    self.nonzero_baseline, self.tensors
                ),
            ));
        }
        Ok(())
    }
}
