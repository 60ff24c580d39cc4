//! Your own case, judged: a case the user built (any shapes the reference
//! accepts) and the user's outputs for it, held to the rule the generated
//! cases are held to ([`crate::core::judge_tensor`]: the f64 reference on
//! the inputs rounded to the kernel's precision, the reference math run in
//! f32 and stored in that precision as the baseline), with a report per
//! tensor: the error, the allowed error, the worst index and both values.
//!
//! Shape legend as in `packshard-reference`: `n_tok` tokens, `h` heads, `d`
//! head dim, `n` rows, `w` given vocabulary columns.

use std::fmt;

use ndarray::ArrayView2;
use packshard_oracle::eval::EvalError;

use crate::core::{
    attention_judged, loss_judged, tensor_of, AttentionArgs, Fields, Judged, KernelPrecision,
    LossArgs, Out,
};

/// How one output tensor of the user's kernel compared.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorReport {
    /// The result's name (`output`, `lse`, `grad_q`, `loss`, ...).
    pub name: String,
    /// Its shape (`[]` for a scalar).
    pub shape: Vec<usize>,
    /// The rule's verdict (error, allowed error, share, index, values).
    pub verdict: crate::core::Verdict,
}

impl TensorReport {
    /// Within the rule.
    pub fn passed(&self) -> bool {
        self.verdict.failure.is_none()
    }
}

/// The verdict on one case: every output the kernel gave that the
/// reference has, judged; the primary result (`output` or `loss`) required.
#[derive(Debug, Clone, PartialEq)]
pub struct CaseReport {
    /// The precision the kernel was judged in.
    pub precision: KernelPrecision,
    /// One report per compared tensor, in the reference's order.
    pub tensors: Vec<TensorReport>,
    /// Why the case failed before any comparison (the primary result
    /// missing), or `None`.
    pub missing: Option<String>,
}

impl CaseReport {
    /// Every tensor within the rule and the primary result given.
    pub fn passed(&self) -> bool {
        self.missing.is_none() && self.tensors.iter().all(TensorReport::passed)
    }

    /// The largest share of its allowed error any tensor used (at most 1 on
    /// a pass).
    pub fn worst_share(&self) -> f64 {
        self.tensors
            .iter()
            .fold(0.0f64, |m, t| m.max(t.verdict.share))
    }
}

impl fmt::Display for CaseReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let verdict = if self.passed() { "pass" } else { "FAIL" };
        writeln!(f, "{verdict} ({} rule)", self.precision.name())?;
        if let Some(m) = &self.missing {
            writeln!(f, "  {m}")?;
        }
        for t in &self.tensors {
            let v = &t.verdict;
            writeln!(
                f,
                "  {} {:?}: max error {:e}, allowed {:e} at {:?} ({:.1}% of it used; expected {:e}, got {:e})",
                t.name,
                t.shape,
                v.error,
                v.allowed,
                v.index,
                100.0 * v.share,
                v.expected,
                v.actual
            )?;
            if let Some(m) = &v.failure {
                writeln!(f, "    {m}")?;
            }
        }
        Ok(())
    }
}

/// Judges `outputs` against `judged` (the reference and baseline of one
/// case, from [`attention_judged`] or [`loss_judged`]): every tensor or
/// scalar of `outputs` whose name the reference has, under the rule for
/// `precision`; `primary` (`output` or `loss`) must be there. The
/// reference's `terms` (the magnitude of each result's terms) set the floors;
/// attention results are judged per segment ([`crate::segments`]).
pub fn verdict(
    judged: &Judged,
    outputs: &Fields,
    primary: &str,
    precision: KernelPrecision,
) -> CaseReport {
    let terms = judged
        .expected
        .iter()
        .find(|(k, _)| *k == "terms")
        .and_then(|(_, v)| match v {
            Out::Json(j) => Some(j.clone()),
            _ => None,
        });
    let missing = (!outputs.iter().any(|(k, _)| *k == primary)).then(|| {
        let keys: Vec<&str> = outputs.iter().map(|(k, _)| *k).collect();
        format!("no {primary:?} among the outputs (keys: {keys:?})")
    });
    let mut tensors = Vec::new();
    for (name, _) in &judged.expected {
        let (Some(e), Some(a)) = (tensor_of(&judged.expected, name), tensor_of(outputs, name))
        else {
            continue;
        };
        let shape = e.shape().to_vec();
        let b = judged.baseline.as_ref().and_then(|b| tensor_of(b, name));
        let p = if b.is_some() {
            precision
        } else {
            KernelPrecision::F64
        };
        let verdict = if a.shape() != e.shape() {
            crate::core::Verdict::shape_mismatch(name, a.shape(), e.shape())
        } else {
            let (e, a) = (
                e.iter().copied().collect::<Vec<_>>(),
                a.iter().copied().collect::<Vec<_>>(),
            );
            let b: Option<Vec<f64>> = b.map(|b| b.iter().copied().collect());
            crate::segments::judge_result(name, &shape, &e, b.as_deref(), &a, p, terms.as_ref())
        };
        tensors.push(TensorReport {
            name: (*name).to_string(),
            shape,
            verdict,
        });
    }
    CaseReport {
        precision,
        tensors,
        missing,
    }
}

/// An attention case the user built, judged: `a` the case (`q`, `k`, `v`,
/// `grad_output`: `[n_tok, h, d]`, `cu_seqlens: [b + 1]`), `outputs` the
/// user's `output: [n_tok, h, d]` and any of `lse: [h, n_tok]`, `grad_q`,
/// `grad_k`, `grad_v`.
///
/// # Errors
/// The reference's errors for a case it refuses (bad input).
pub fn judge_attention(
    a: &AttentionArgs<'_>,
    outputs: &Fields,
    precision: KernelPrecision,
) -> Result<CaseReport, EvalError> {
    let j = attention_judged(a, precision)?;
    Ok(verdict(&j, outputs, "output", precision))
}

/// A loss case the user built, judged: `logits: [n, w]`, or `hidden: [n,
/// h]` and `weight: [w, h]`, with the options `a`; `outputs` the user's
/// `loss` and any of `per_token_loss: [n]`, `logsumexp: [n]`,
/// `grad_logits: [n, w]`, `grad_hidden`, `grad_weight`.
///
/// # Errors
/// The reference's errors for a case it refuses (bad input).
pub fn judge_loss(
    logits: Option<ArrayView2<'_, f64>>,
    hidden: Option<(ArrayView2<'_, f64>, ArrayView2<'_, f64>)>,
    a: &LossArgs,
    outputs: &Fields,
    precision: KernelPrecision,
) -> Result<CaseReport, EvalError> {
    let j = loss_judged(logits, hidden, a, precision)?;
    Ok(verdict(&j, outputs, "loss", precision))
}

#[cfg(test)]
#[path = "judge_tests.rs"]
pub(crate) mod tests;
