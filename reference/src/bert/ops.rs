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
        // The row scaled by a power of two `q` that brings its largest
        // magnitude to at most 1: a row of 1e300s neither overflows its
        // squares nor its sum (unscaled, rows above ~1e154 normalized to 0),
        // and since scaling by a power of two is exact, a row in the
        // ordinary range gets the textbook formula's values bit for bit:
        // `var q^2 + eps q^2` rounds as `(var + eps) q^2`, so
        // `t = 1 / sqrt(var q^2 + eps q^2) = s / q` and
        // `x_hat = (v q - mean q) t = (v - mean) s`, `inv = q t = s`.
        let q = downscale(row.iter().fold(0.0f64, |m, v| m.max(v.abs())));
        let mean = if !centered {
            0.0
        } else if q == 1.0 {
            row.sum() / width as f64
        } else {
            // The same summation order as `row.sum()`.
            row.mapv(|v| v * q).sum() / width as f64
        };
        let var = row
            .iter()
            .map(|v| (v * q - mean) * (v * q - mean))
            .sum::<f64>()
            / width as f64;
        let denominator = var + eps * q * q;
        if denominator == 0.0 {
            // A constant row whose `eps q^2` underflowed (or eps = 0):
            // `x_hat` is 0 and the inverse scale `1 / sqrt(eps)`.
            inv[i] = 1.0 / eps.sqrt();
            continue;
        }
        let t = 1.0 / denominator.sqrt();
        inv[i] = q * t;
        Zip::from(x_hat.row_mut(i))
            .and(row)
            .for_each(|h, &v| *h = (v * q - mean) * t);
    }
    NormCache { x_hat, inv }
}

/// The power of two `2^-k` that brings `max >= 1` into `[0.5, 1)`; 1 for a
/// `max` below 1 or not finite (nothing to scale). `k` is at most 1024, so
/// the factor may be subnormal, yet it is exact, and so is `v * 2^-k` for
/// every `|v| <= max` whose result is normal.
pub(crate) fn downscale(max: f64) -> f64 {
    if !(1.0..=f64::MAX).contains(&max) {
        return 1.0;
    }
    // max = m 2^e with m in [1, 2): k = e + 1 puts max 2^-k in [0.5, 1).
    let k = ((max.to_bits() >> 52) & 0x7ff) as i32 - 1023 + 1;
    let half = k / 2;
    // Two factors of at most 2^-512 each: every powi stays exact.
    2f64.powi(-half) * 2f64.powi(-(k - half))
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
