//! Token-wise ops of the decoder with their backward passes: bias-free
//! linear, RMSNorm, rotary position embeddings, SiLU and SwiGLU.
//!
//! Every op works on token rows (`x: [n, in]`, or `[n, heads, d]` for
//! rotary embeddings); each row is computed on its own from its own position,
//! so a token's result never depends on which other tokens share the matrix
//! (padding, packing). Backward passes return the input gradient and
//! *accumulate* (`+=`) parameter gradients, so the gradients of a tied
//! weight add up. LayerNorm and the exact GELU are the BERT reference's
//! ([`crate::bert::ops`]).

use ndarray::{Array2, Array3, ArrayView1, ArrayView2, ArrayView3, ArrayViewMut2, Axis};

use crate::bert::ops::{normalize_rows, normalize_rows_backward, NormCache};
use crate::error::{check_len, Error, Result};

/// `y = x W^T` (`torch.nn.Linear(bias=False)`, Llama's projections):
/// `x: [n, in]`, `weight: [out, in]`; returns `[n, out]`.
pub fn linear_nb(x: ArrayView2<f64>, weight: ArrayView2<f64>) -> Array2<f64> {
    x.dot(&weight.t())
}

/// Backward of [`linear_nb`]: adds `dy^T x` to `grad_weight` (`[out, in]`)
/// and returns `dx = dy W` (`[n, in]`).
pub fn linear_nb_backward(
    x: ArrayView2<f64>,
    weight: ArrayView2<f64>,
    dy: ArrayView2<f64>,
    mut grad_weight: ArrayViewMut2<f64>,
) -> Array2<f64> {
    grad_weight += &dy.t().dot(&x);
    dy.dot(&weight)
}

/// The intermediates of [`rms_norm`] that its backward needs.
pub type RmsNormCache = NormCache;

/// RMSNorm over the last axis (Zhang & Sennrich 2019; Hugging Face's
/// `LlamaRMSNorm`): `y = gamma * x / sqrt(mean(x^2) + eps)`, no mean
/// subtraction, no bias.
///
/// Shapes: `x: [n, hidden]`, `gamma: [hidden]`; returns `y: [n, hidden]` and
/// the cache for [`rms_norm_backward`].
pub fn rms_norm(
    x: ArrayView2<f64>,
    gamma: ArrayView1<f64>,
    eps: f64,
) -> (Array2<f64>, RmsNormCache) {
    let cache = normalize_rows(x, eps, false);
    let y = &cache.x_hat * &gamma;
    (y, cache)
}

/// Backward of [`rms_norm`]: adds `sum_rows(dy * x_hat)` to `grad_gamma` and
/// returns `dx = r * (g - x_hat * mean(g * x_hat))` with `g = dy * gamma` and
/// `r` the row's inverse RMS.
pub fn rms_norm_backward(
    cache: &RmsNormCache,
    gamma: ArrayView1<f64>,
    dy: ArrayView2<f64>,
    mut grad_gamma: ndarray::ArrayViewMut1<f64>,
) -> Array2<f64> {
    grad_gamma += &(&dy * &cache.x_hat).sum_axis(Axis(0));
    normalize_rows_backward(cache, gamma, dy, false)
}

/// The rotary frequencies `theta^(-2i / d)`, `i = 0..d/2` (Su et al. 2021,
/// RoFormer eq. 15; Hugging Face's `inv_freq`).
///
/// # Errors
/// [`Error::InvalidArgument`] naming `head_dim` when `d` is odd or 0.
pub fn rope_inv_freq(head_dim: usize, theta: f64) -> Result<Vec<f64>> {
    if head_dim == 0 || !head_dim.is_multiple_of(2) {
        return Err(Error::invalid(
            "head_dim",
            format!("is {head_dim}: rotary embeddings need an even, non-zero head dim"),
        ));
    }
    let half = head_dim / 2;
    Ok((0..half)
        .map(|i| theta.powf(-2.0 * i as f64 / head_dim as f64))
        .collect())
}

/// Rotary position embeddings in the GPT-NeoX / Llama layout
/// (`rotate_half`: dimension `i` pairs with `i + d/2`), each token rotated by
/// the angle of **its own position** `positions[t]` (so positions that reset
/// per document, or start at an offset for a continuation chunk, are honoured
/// as given: docs/FAULTS.md C6):
///
/// `y_i = x_i cos(p w_i) - x_{i+d/2} sin(p w_i)`,
/// `y_{i+d/2} = x_{i+d/2} cos(p w_i) + x_i sin(p w_i)`, `w = inv_freq`.
///
/// Shapes: `x: [n, heads, d]`, `positions: [n]`, `inv_freq: [d / 2]`.
///
/// # Errors
/// [`Error::ShapeMismatch`] naming `position_ids` or `inv_freq`.
pub fn rope(x: ArrayView3<f64>, positions: &[usize], inv_freq: &[f64]) -> Result<Array3<f64>> {
    rope_signed(x, positions, inv_freq, 1.0)
}

/// Backward of [`rope`]: the rotation is orthogonal, so `dx` is `dy` rotated
/// by the negative angle.
///
/// # Errors
/// As [`rope`].
pub fn rope_backward(
    dy: ArrayView3<f64>,
    positions: &[usize],
    inv_freq: &[f64],
) -> Result<Array3<f64>> {
    rope_signed(dy, positions, inv_freq, -1.0)
}

fn rope_signed(
    x: ArrayView3<f64>,
    positions: &[usize],
    inv_freq: &[f64],
    sign: f64,
) -> Result<Array3<f64>> {
    let (n, heads, d) = x.dim();
    check_len(
        "position_ids",
        positions.len(),
        "n",
        n,
        "one position per token",
    )?;
    if 2 * inv_freq.len() != d {
        return Err(Error::ShapeMismatch {
            field: "inv_freq".into(),
            expected: format!("[d / 2] = [{}]", d / 2),
            actual: vec![inv_freq.len()],
        });
    }
    let half = d / 2;
    let mut y = Array3::zeros((n, heads, d));
    for (t, &p) in positions.iter().enumerate() {
        for (i, &w) in inv_freq.iter().enumerate() {
            let angle = p as f64 * w;
            let (s, c) = (sign * angle.sin(), angle.cos());
            for a in 0..heads {
                let (x1, x2) = (x[[t, a, i]], x[[t, a, i + half]]);
                y[[t, a, i]] = x1 * c - x2 * s;
                y[[t, a, i + half]] = x2 * c + x1 * s;
            }
        }
    }
    Ok(y)
}

/// The logistic sigmoid `1 / (1 + exp(-x))`.
pub fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// SiLU (swish), `x * sigmoid(x)` (Elfwing et al. 2018; Llama's `hidden_act = "silu"`).
pub fn silu(x: f64) -> f64 {
    x * sigmoid(x)
}

/// The derivative of [`silu`]: `s (1 + x (1 - s))` with `s = sigmoid(x)`.
pub fn silu_grad(x: f64) -> f64 {
    let s = sigmoid(x);
    s * (1.0 + x * (1.0 - s))
}

/// The SwiGLU gate (Shazeer 2020, eq. 6; Llama's MLP before `down_proj`):
/// `silu(gate) * up`, element-wise; `gate, up: [n, inter]`.
pub fn swiglu(gate: ArrayView2<f64>, up: ArrayView2<f64>) -> Array2<f64> {
    let mut y = gate.mapv(silu);
    y *= &up;
    y
}

/// Backward of [`swiglu`]: returns `(d gate, d up)` for `dy: [n, inter]`.
pub fn swiglu_backward(
    gate: ArrayView2<f64>,
    up: ArrayView2<f64>,
    dy: ArrayView2<f64>,
) -> (Array2<f64>, Array2<f64>) {
    let mut dgate = gate.mapv(silu_grad);
    dgate *= &up;
    dgate *= &dy;
    let mut dup = gate.mapv(silu);
    dup *= &dy;
    (dgate, dup)
}
