//! How the causal-LM suite compares: parameter gradients tensor by tensor
//! (floors relative to the largest gradient), and the padded run against
//! the truth under a rewrite tolerance or a relative rule.

use super::*;

/// Calls `f(index, "{what} {name}", want, got, shape, global)` for each
/// parameter's gradient pair (`got` checked finite first), `global` the
/// largest wanted gradient (every tensor's floor is relative to it, as the
/// BERT suite does).
fn each_grad(
    what: &str,
    want: &DecoderParams,
    got: &DecoderParams,
    mut f: impl FnMut(usize, &str, (&[f64], &[f64]), &[usize], f64) -> Result<(), Mismatch>,
) -> Result<(), Mismatch> {
    let (a, b) = (want.named(), got.named());
    if a.len() != b.len() {
        return Err(Mismatch::new(
            what,
            format!("{} tensors, expected {}", b.len(), a.len()),
        ));
    }
    let global = a
        .iter()
        .flat_map(|(_, t)| t.iter().copied())
        .fold(0.0f64, |m, v| m.max(v.abs()));
    for (i, ((name, x), (_, y))) in a.iter().zip(&b).enumerate() {
        let (vx, vy): (Vec<f64>, Vec<f64>) =
            (x.iter().copied().collect(), y.iter().copied().collect());
        let label = format!("{what} {name}");
        finite(&label, &vy)?;
        f(i, &label, (&vx, &vy), x.shape(), global)?;
    }
    Ok(())
}

/// Compares every parameter gradient of `got` with `want` under `tol`,
/// tensor by tensor (by Hugging Face name), the absolute floor relative to
/// the largest gradient of `want` (a tensor of small gradients is judged
/// against the scale of the whole backward, as the BERT suite does);
/// records the error in `seen`.
///
/// # Errors
/// A [`Mismatch`] naming `what`, the tensor and the index; a tensor count or
/// a non-finite value of `got`.
pub fn grads_close(
    what: &str,
    want: &DecoderParams,
    got: &DecoderParams,
    tol: Tolerance,
    seen: &mut Observed,
) -> Result<(), Mismatch> {
    each_grad(what, want, got, |_, label, (x, y), shape, global| {
        seen.close_scaled(label, x, y, shape, tol, Some(global))
    })
}

/// The padded run against the truth: under a rewrite's tolerance, or
/// under a relative judge's rule against the baseline's own error.
pub(super) struct Truth<'a> {
    /// The tolerance without a rule.
    pub(super) tol: Tolerance,
    pub(super) rule: Option<(RelativeRule, &'a CausalRun)>,
    pub(super) seen: Observed,
    pub(super) totals: RelativeTotals,
}

impl Truth<'_> {
    /// `got` against `want`; `base` picks the baseline's values from its run.
    pub(super) fn close(
        &mut self,
        what: &str,
        (want, got): (&[f64], &[f64]),
        base: impl Fn(&CausalRun) -> Vec<f64>,
        shape: &[usize],
        scale: Option<f64>,
    ) -> Result<(), Mismatch> {
        match self.rule {
            None => self
                .seen
                .close_scaled(what, want, got, shape, self.tol, scale),
            Some((rule, b)) => {
                let e = assert_within_k(
                    what,
                    want,
                    &base(b),
                    got,
                    shape,
                    rule,
                    Allowance::with_scale(scale),
                )?;
                self.totals.add(&e);
                Ok(())
            }
        }
    }

    pub(super) fn grads(
        &mut self,
        what: &str,
        want: &DecoderParams,
        got: &DecoderParams,
    ) -> Result<(), Mismatch> {
        each_grad(what, want, got, |i, label, pair, shape, global| {
            let base = |r: &CausalRun| r.grads.named()[i].1.iter().copied().collect();
            self.close(label, pair, base, shape, Some(global))
        })
    }
}
