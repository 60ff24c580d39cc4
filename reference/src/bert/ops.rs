//! Token-wise ops with their backward passes: linear, LayerNorm, exact GELU, tanh.
//!
//! Every op works on a matrix of token rows `x: [n, in]`; each row is
//! computed on its own, so the result for a token never depends on which other
//! tokens share the matrix (padding, packing). Backward passes return the
//! gradient of the input and *accumulate* (`+=`) parameter gradients, so the
//! gradients of a tied weight add up.

use ndarray::{Array1, Array2, ArrayView1, ArrayView2, ArrayViewMut1, ArrayViewMut2, Axis, Zip};

/// `y = x W^T + b`, the convention of `torch.nn.Linear` (`weight: [out, in]`).
///
/// Shapes: `x: [n, in]`, `weight: [out, in]`, `bias: [out]`; returns `[n, out]`.
pub fn linear(x: ArrayView2<f64>, weight: ArrayView2<f64>, bias: ArrayView1<f64>) -> Array2<f64> {
    let mut y = x.dot(&weight.t());
    y += &bias;
    y
}

/// Backward of [`linear`]: returns `dx = dy W` (`[n, in]`) and adds
/// `dy^T x` to `grad_weight` (`[out, in]`) and the column sums of `dy` to
/// `grad_bias` (`[out]`).
pub fn linear_backward(
    x: ArrayView2<f64>,
    weight: ArrayView2<f64>,
    dy: ArrayView2<f64>,
    mut grad_weight: ArrayViewMut2<f64>,
    mut grad_bias: ArrayViewMut1<f64>,
) -> Array2<f64> {
    grad_weight += &dy.t().dot(&x);
    grad_bias += &dy.sum_axis(Axis(0));
    dy.dot(&weight)
}

/// The intermediates of a normalization ([`layer_norm`], or RMSNorm:
/// [`crate::decoder::ops::rms_norm`]) that its backward needs.
#[derive(Debug, Clone, PartialEq)]
pub struct NormCache {
    /// The normalized rows `[n, hidden]`: `x_hat = (x - mean) / sqrt(var + eps)`
    /// (LayerNorm) or `x / sqrt(mean(x^2) + eps)` (RMSNorm).
    pub x_hat: Array2<f64>,
    /// The inverse scale per row `[n]`: `1 / sqrt(var + eps)` (LayerNorm) or
    /// `1 / sqrt(mean(x^2) + eps)` (RMSNorm).
    pub inv: Array1<f64>,
}

/// The intermediates of [`layer_norm`] that its backward needs.
pub type LayerNormCache = NormCache;

/// LayerNorm over the last axis (Ba et al. 2016; `torch.nn.LayerNorm`):
/// `y = gamma * (x - mean) / sqrt(var + eps) + beta` with the biased variance.
///
/// Shapes: `x: [n, hidden]`, `gamma`, `beta: [hidden]`; returns `y: [n, hidden]`
/// and the cache for [`layer_norm_backward`].
pub fn layer_norm(
    x: ArrayView2<f64>,
    gamma: ArrayView1<f64>,
    beta: ArrayView1<f64>,
    eps: f64,
) -> (Array2<f64>, LayerNormCache) {
    let cache = normalize_rows(x, eps, true);
    let mut y = &cache.x_hat * &gamma;
    y += &beta;
    (y, cache)
}

/// Backward of [`layer_norm`]: returns `dx` (`[n, hidden]`) and adds
/// `sum_rows(dy * x_hat)` to `grad_gamma` and `sum_rows(dy)` to `grad_beta`.
///
/// `dx = inv_std * (g - mean(g) - x_hat * mean(g * x_hat))` with `g = dy * gamma`.
pub fn layer_norm_backward(
    cache: &LayerNormCache,
    gamma: ArrayView1<f64>,
    dy: ArrayView2<f64>,
    mut grad_gamma: ArrayViewMut1<f64>,
    mut grad_beta: ArrayViewMut1<f64>,
) -> Array2<f64> {
    grad_gamma += &(&dy * &cache.x_hat).sum_axis(Axis(0));
    grad_beta += &dy.sum_axis(Axis(0));
    normalize_rows_backward(cache, gamma, dy, true)
}

/// The normalized rows of `x: [n, hidden]` and each row's inverse scale
/// `[n]` (a [`NormCache`]), shared by [`layer_norm`] and RMSNorm
/// ([`crate::decoder::ops::rms_norm`]): `x_hat = (x - mean) / sqrt(var + eps)`
/// (biased variance) when `centered`, else `x_hat = x / sqrt(mean(x^2) + eps)`
/// (the mean taken as 0, which leaves every value bit for bit unchanged).
pub(crate) fn normalize_rows(x: ArrayView2<f64>, eps: f64, centered: bool) -> NormCache {
    let (n, width) = x.dim();
    let mut x_hat = Array2::zeros((n, width));
    let mut inv = Array1::zeros(n);
    for (i, row) in x.rows().into_iter().enumerate() {
        let mean = if centered {
            row.sum() / width as f64
        } else {
            0.0
        };
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / width as f64;
        let s = 1.0 / (var + eps).sqrt();
        inv[i] = s;
        Zip::from(x_hat.row_mut(i))
            .and(row)
            .for_each(|h, &v| *h = (v - mean) * s);
    }
    NormCache { x_hat, inv }
}

/// `dx` (`[n, hidden]`) of [`normalize_rows`] followed by the gain `gamma`:
/// `inv * (g - mean(g) - x_hat * mean(g * x_hat))` with `g = dy * gamma`, the
/// `mean(g)` term only when `centered` (the mean was subtracted).
pub(crate) fn normalize_rows_backward(
    cache: &NormCache,
    gamma: ArrayView1<f64>,
    dy: ArrayView2<f64>,
    centered: bool,
) -> Array2<f64> {
    let (n, width) = dy.dim();
    let mut dx = Array2::zeros((n, width));
    for i in 0..n {
        let g: Array1<f64> = &dy.row(i) * &gamma;
        let xh = cache.x_hat.row(i);
        let mean_g = if centered {
            g.sum() / width as f64
        } else {
            0.0
        };
        let mean_gx = g.iter().zip(xh).map(|(a, b)| a * b).sum::<f64>() / width as f64;
        let s = cache.inv[i];
        Zip::from(dx.row_mut(i))
            .and(&g)
            .and(xh)
            .for_each(|d, &gv, &x| *d = s * (gv - mean_g - x * mean_gx));
    }
    dx
}

/// The exact GELU, `x * Phi(x) = 0.5 x (1 + erf(x / sqrt 2))` (Hendrycks &
/// Gimpel 2016; BERT's `hidden_act = "gelu"`), with `erf` from `libm`.
pub fn gelu(x: f64) -> f64 {
    0.5 * x * (1.0 + libm::erf(x * std::f64::consts::FRAC_1_SQRT_2))
}

/// The derivative of [`gelu`]: `Phi(x) + x phi(x)`.
pub fn gelu_grad(x: f64) -> f64 {
    let cdf = 0.5 * (1.0 + libm::erf(x * std::f64::consts::FRAC_1_SQRT_2));
    let pdf = (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt();
    cdf + x * pdf
}

/// [`gelu`] element-wise.
pub fn gelu_map(x: ArrayView2<f64>) -> Array2<f64> {
    x.mapv(gelu)
}

/// Backward of [`gelu_map`]: `dx = dy * gelu'(x)` where `x` is the GELU's input.
pub fn gelu_backward(x: ArrayView2<f64>, dy: ArrayView2<f64>) -> Array2<f64> {
    let mut dx = dy.to_owned();
    Zip::from(&mut dx)
        .and(x)
        .for_each(|d, &v| *d *= gelu_grad(v));
    dx
}
