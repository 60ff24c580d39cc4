//! One loss call as one value: the targets, the options and what the
//! backward pass is asked for ([`LossCall`]), shared by every
//! implementation of the output-layer ops ([`crate::ops::CrossEntropyOp`],
//! [`crate::ops::LinearCrossEntropyOp`]).

use super::{LossConfig, Reduction};
use crate::error::{Error, Result};

/// What a loss call asks of the backward pass.
///
/// Frameworks backpropagate an upstream gradient `grad_output` into the
/// loss: a scalar for the `sum` and `mean` reductions, one value per token
/// for `none` (PyTorch's `loss.backward(grad_output)`; docs/FAULTS.md O2).
/// An upstream gradient without a gradient request cannot be written.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum GradRequest<'a> {
    /// The forward pass only: no gradients.
    #[default]
    None,
    /// The gradients of the loss itself (an upstream gradient of 1).
    Loss,
    /// The gradients of `sum_i grad_output[i] * per_token_loss[i]` for the
    /// reduction `none` (`grad_output: [n]`), of `grad_output[0] * loss`
    /// for `sum` and `mean` (`grad_output: [1]`).
    Upstream(&'a [f64]),
}

impl<'a> GradRequest<'a> {
    /// [`GradRequest::Loss`] when `want_grad`, else [`GradRequest::None`].
    pub fn from_flag(want_grad: bool) -> Self {
        if want_grad {
            GradRequest::Loss
        } else {
            GradRequest::None
        }
    }

    /// Whether gradients are asked for.
    pub fn wanted(&self) -> bool {
        !matches!(self, GradRequest::None)
    }

    /// The upstream gradient, where one is given.
    pub fn upstream(&self) -> Option<&'a [f64]> {
        match self {
            GradRequest::Upstream(g) => Some(g),
            GradRequest::None | GradRequest::Loss => None,
        }
    }
}

/// One call of the loss: `targets: [n]` (global vocabulary ids, or
/// [`LossConfig::ignore_index`]), its options, and the gradient request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossCall<'a> {
    /// `[n]`.
    pub targets: &'a [i64],
    /// The loss's options.
    pub config: &'a LossConfig,
    /// What the backward pass is asked for.
    pub grad: GradRequest<'a>,
}

impl<'a> LossCall<'a> {
    /// The call's parts as one value.
    pub fn new(targets: &'a [i64], config: &'a LossConfig, grad: GradRequest<'a>) -> Self {
        LossCall {
            targets,
            config,
            grad,
        }
    }

    /// A call that asks for the gradients of the loss itself when
    /// `want_grad` (no upstream gradient).
    pub fn with_flag(targets: &'a [i64], config: &'a LossConfig, want_grad: bool) -> Self {
        Self::new(targets, config, GradRequest::from_flag(want_grad))
    }

    /// Whether gradients are asked for.
    pub fn want_grad(&self) -> bool {
        self.grad.wanted()
    }

    /// The length the upstream gradient must have for `n` tokens: `n` for
    /// the reduction `none`, 1 (a scalar) for `sum` and `mean`.
    pub fn upstream_len(&self, n: usize) -> usize {
        match self.config.reduction {
            Reduction::None => n,
            Reduction::Sum | Reduction::Mean => 1,
        }
    }

    /// Checks the upstream gradient, where one is given, for `n` tokens.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] naming `grad_output` for a length other than
    /// [`LossCall::upstream_len`]; [`Error::NonFiniteInput`] naming
    /// `grad_output` and the index of a NaN or infinite value.
    pub fn check_upstream(&self, n: usize) -> Result<()> {
        let Some(g) = self.grad.upstream() else {
            return Ok(());
        };
        let want = self.upstream_len(n);
        if g.len() != want {
            return Err(Error::ShapeMismatch {
                field: "grad_output".into(),
                expected: format!(
                    "[{want}] (reduction {}: {})",
                    self.config.reduction,
                    if self.config.reduction == Reduction::None {
                        "one value per token"
                    } else {
                        "a scalar"
                    }
                ),
                actual: vec![g.len()],
            });
        }
        crate::error::check_finite("grad_output", g)
    }

    /// `d L / d per_token_loss_i` for each token, the upstream gradient
    /// multiplied in: 0 for ignored tokens, otherwise `1 / num_tokens`
    /// (mean) or 1 (sum, none), times `grad_output[0]` (sum, mean) or
    /// `grad_output[i]` (none). Every implementation's per-row gradient
    /// weight comes from here (docs/FAULTS.md O2).
    ///
    /// The upstream gradient is assumed checked ([`LossCall::check_upstream`]);
    /// a missing value reads as NaN, never as a plausible weight.
    pub fn token_weights(&self, targets: &[Option<usize>]) -> Vec<f64> {
        let valid = targets.iter().filter(|t| t.is_some()).count();
        let w = match self.config.reduction {
            Reduction::Mean if valid > 0 => 1.0 / valid as f64,
            Reduction::Mean => 0.0,
            Reduction::Sum | Reduction::None => 1.0,
        };
        let upstream = self.grad.upstream();
        let scale = |i: usize| match (upstream, self.config.reduction) {
            (None, _) => 1.0,
            (Some(g), Reduction::None) => g.get(i).copied().unwrap_or(f64::NAN),
            (Some(g), Reduction::Sum | Reduction::Mean) => g.first().copied().unwrap_or(f64::NAN),
        };
        targets
            .iter()
            .enumerate()
            .map(|(i, t)| if t.is_some() { w * scale(i) } else { 0.0 })
            .collect()
    }
}
