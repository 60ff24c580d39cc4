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

    /// The request of a call that asks for gradients when `want_grad`,
    /// with `upstream` where given (ignored without `want_grad`: a forward
    /// pass reads no upstream gradient).
    pub fn of(want_grad: bool, upstream: Option<&'a [f64]>) -> Self {
        match (want_grad, upstream) {
            (false, _) => GradRequest::None,
            (true, None) => GradRequest::Loss,
            (true, Some(g)) => GradRequest::Upstream(g),
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

    /// The checks of a sharded run on `n` rows of `v` entries that every rank
    /// (and the whole run) makes first: `targets` is `[n]` (the error expects
    /// `[n] with n = {n}`, followed by ` (rows)` unless `rows` is empty), then
    /// [`LossCall::check_upstream`], then [`LossConfig::validate`] for `v`.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] naming `targets`; those of the two checks.
    pub(crate) fn check_rows(&self, n: usize, rows: &str, v: usize) -> Result<()> {
        if self.targets.len() != n {
            let rows = if rows.is_empty() {
                String::new()
            } else {
                format!(" ({rows})")
            };
            return Err(Error::ShapeMismatch {
                field: "targets".into(),
                expected: format!("[n] with n = {n}{rows}"),
                actual: vec![self.targets.len()],
            });
        }
        self.check_upstream(n)?;
        self.config.validate(v)
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

#[cfg(test)]
mod tests {
    use ndarray::Array2;

    use super::*;
    use crate::vocab::sharded::{sharded_cross_entropy, sharded_linear_cross_entropy};
    use crate::vocab::ShardedAlgorithm;
    use crate::vocab::{cross_entropy, linear_cross_entropy, ShardLayout, ShardMap};

    fn logits() -> Array2<f64> {
        Array2::from_shape_fn((3, 5), |(i, j)| ((i * 3 + j * 7) % 5) as f64 - 2.0)
    }

    const TARGETS: [i64; 3] = [1, -100, 4];

    /// Every form of the reference on `call`: unsharded, and each algorithm
    /// over 2 shards, the logits and the output layer (`h = 5`, `hidden`
    /// the identity so the logits are the weight's rows).
    fn every_form(call: &LossCall) -> Vec<Result<()>> {
        let z = logits();
        let map = ShardMap::new(5, 2, ShardLayout::Uneven).unwrap();
        let hidden = Array2::from_shape_fn((3, 5), |(i, k)| z[[i, k]]);
        let weight = Array2::<f64>::eye(5);
        let mut out = vec![
            cross_entropy(z.view(), call).map(|_| ()),
            linear_cross_entropy(hidden.view(), weight.view(), call).map(|_| ()),
        ];
        for a in ShardedAlgorithm::ALL {
            out.push(sharded_cross_entropy(a, &map, z.view(), call).map(|_| ()));
            let (x, w) = (hidden.view(), weight.view());
            out.push(sharded_linear_cross_entropy(a, &map, x, w, call).map(|_| ()));
        }
        out
    }

    #[test]
    fn a_grad_output_of_another_length_is_a_shape_error_naming_it() {
        let none = LossConfig::default().with_reduction(Reduction::None);
        let sum = LossConfig::default().with_reduction(Reduction::Sum);
        for (config, g) in [
            (&none, &[1.0, 2.0][..]),
            (&none, &[1.0][..]),
            (&sum, &[1.0, 1.0, 1.0][..]),
        ] {
            let call = LossCall::new(&TARGETS, config, GradRequest::Upstream(g));
            for r in every_form(&call) {
                match r {
                    Err(Error::ShapeMismatch { field, actual, .. }) => {
                        assert_eq!((field.as_str(), actual), ("grad_output", vec![g.len()]));
                    }
                    other => panic!("{other:?}"),
                }
            }
        }
    }

    #[test]
    fn a_non_finite_grad_output_is_named_with_its_index() {
        let none = LossConfig::default().with_reduction(Reduction::None);
        for bad in [f64::NAN, f64::INFINITY] {
            let g = [1.0, 0.0, bad];
            let call = LossCall::new(&TARGETS, &none, GradRequest::Upstream(&g));
            for r in every_form(&call) {
                match r {
                    Err(Error::NonFiniteInput { field, index, .. }) => {
                        assert_eq!((field.as_str(), index), ("grad_output", 2));
                    }
                    other => panic!("{other:?}"),
                }
            }
        }
    }

    #[test]
    fn the_upstream_gradient_scales_each_row() {
        let z = logits();
        for reduction in [Reduction::None, Reduction::Sum, Reduction::Mean] {
            let config = LossConfig::default().with_reduction(reduction);
            let g: Vec<f64> = match reduction {
                Reduction::None => vec![0.5, 3.0, -2.0],
                _ => vec![-1.5],
            };
            let call = LossCall::new(&TARGETS, &config, GradRequest::Upstream(&g));
            let scaled = cross_entropy(z.view(), &call).unwrap();
            let plain = LossCall::with_flag(&TARGETS, &config, true);
            let plain = cross_entropy(z.view(), &plain).unwrap();
            assert_eq!(scaled.loss, plain.loss);
            let (a, b) = (scaled.grad_logits.unwrap(), plain.grad_logits.unwrap());
            for ((i, j), x) in a.indexed_iter() {
                let s = if reduction == Reduction::None {
                    g[i]
                } else {
                    g[0]
                };
                assert_eq!(*x, s * b[[i, j]], "{reduction} [{i}, {j}]");
            }
            // The ignored token's row stays 0 whatever its upstream value.
            assert!(a.row(1).iter().all(|x| *x == 0.0));
        }
        // No gradient asked for: no upstream gradient read, none returned.
        let config = LossConfig::default();
        let call = LossCall::with_flag(&TARGETS, &config, false);
        assert!(cross_entropy(z.view(), &call)
            .unwrap()
            .grad_logits
            .is_none());
    }
}
