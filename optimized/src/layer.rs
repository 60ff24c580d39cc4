//! One post-LayerNorm BERT encoder layer (Hugging Face `BertLayer`, as
//! `packshard_reference::bert::layer`), forward and backward, in `f32`:
//! matrix products through [`gemm`](crate::matmul), LayerNorm and the exact
//! GELU with SIMD ([`crate::simd`]) on rayon row chunks, attention through
//! [`crate::attention`] — varlen for [`AttentionLayout::Varlen`], the dense
//! masked kernel for [`AttentionLayout::Dense`] (padded rows).
//!
//! ```text
//! q, k, v = x Wq^T + bq, x Wk^T + bk, x Wv^T + bv      [n, hidden] -> [n, h, d]
//! a       = attention(q, k, v, layout)                  [n, h, d] -> [n, hidden]
//! h1      = LayerNorm(a Wo^T + bo + x)
//! f       = gelu(h1 W1^T + b1)                          [n, inter]
//! out     = LayerNorm(f W2^T + b2 + h1)
//! ```
//!
//! Every reduction over tokens (bias and LayerNorm parameter gradients) sums
//! fixed chunks of rows in parallel and the chunk sums in order, so results
//! do not depend on the number of threads.

use ndarray::{
    Array1, Array2, ArrayBase, ArrayView1, ArrayView2, ArrayView3, ArrayViewMut2, Data, Ix2,
};
use packshard_reference::bert::attention::{check_cu_seqlens, check_layout, AttentionLayout};
use packshard_reference::bert::LayerParams;
use packshard_reference::{Error, Result};
use pulp::{Simd, WithSimd};
use rayon::prelude::*;

use crate::attention::{
    check_finite, dense_masked_attention, dense_masked_attention_backward, varlen_attention,
    varlen_attention_backward, AttentionOutput32,
};
use crate::convert::to_f32;
use crate::matmul::{matmul, Threads};
use crate::simd;

/// Rows per chunk of the row-parallel passes and of the token reductions
/// (the decoder layer's too).
pub(crate) const ROWS: usize = 64;

/// The parameters of one layer in f32: the reference's type, names and
/// shapes (`hidden` = `hidden_size`, `inter` = `intermediate_size`).
pub type LayerParams32 = LayerParams<f32>;

/// The reference parameters rounded to f32.
///
/// # Errors
/// [`Error::InvalidArgument`] for a value beyond the f32 range (the field
/// names the tensor by its Hugging Face name); [`Error::ShapeMismatch`]
/// for shapes that do not fit one layer.
pub fn layer_params_f32(p: &LayerParams) -> Result<LayerParams32> {
    let out = p.try_map(|n, a| to_f32(n, a.view()), |n, a| to_f32(n, a.view()))?;
    out.check_shapes()?;
    Ok(out)
}

/// f32 parameters (or gradients) as reference parameters (exact).
pub fn widen_layer_params(p: &LayerParams32) -> LayerParams {
    p.map(|a| a.mapv(f64::from), |a| a.mapv(f64::from))
}

/// What the backward of one layer needs.
#[derive(Debug, Clone)]
pub struct LayerCache32 {
    x: Array2<f32>,
    q: Array2<f32>,
    k: Array2<f32>,
    v: Array2<f32>,
    /// The attention's output (`[n, h, d]`, also the `[n, hidden]` input
    /// of the output projection) and `lse`.
    attention: AttentionOutput32,
    x_hat1: Array2<f32>,
    inv_std1: Vec<f32>,
    h1: Array2<f32>,
    pre: Array2<f32>,
    act: Array2<f32>,
    x_hat2: Array2<f32>,
    inv_std2: Vec<f32>,
}

/// Splits a row-major matrix into chunks of [`ROWS`] rows for rayon.
pub(crate) fn row_chunks(a: &mut Array2<f32>) -> rayon::slice::ChunksMut<'_, f32> {
    let w = a.ncols().max(1);
    a.as_slice_mut()
        .expect("fresh arrays are standard layout")
        .par_chunks_mut(ROWS * w)
}

/// `x W^T + b (+ residual)`: `x: [n, in]`, `w: [out, in]`, `b: [out]`.
fn linear(
    x: ArrayView2<f32>,
    w: &Array2<f32>,
    b: &Array1<f32>,
    residual: Option<&Array2<f32>>,
) -> Array2<f32> {
    let mut y = Array2::zeros((x.nrows(), w.nrows()));
    matmul(y.view_mut(), x, w.t(), false, Threads::All);
    add_rows(&mut y, b.view(), residual);
    y
}

/// `y[i, :] += b (+ r[i, :])` for every row.
fn add_rows(y: &mut Array2<f32>, b: ArrayView1<f32>, r: Option<&Array2<f32>>) {
    let w = y.ncols();
    let b = b.as_slice().expect("contiguous bias").to_vec();
    let r = r.map(|r| r.as_slice().expect("standard layout"));
    row_chunks(y).enumerate().for_each(|(c, chunk)| {
        for (i, row) in chunk.chunks_mut(w).enumerate() {
            for (x, &bv) in row.iter_mut().zip(&b) {
                *x += bv;
            }
            if let Some(r) = r {
                let at = (c * ROWS + i) * w;
                for (x, &rv) in row.iter_mut().zip(&r[at..at + w]) {
                    *x += rv;
                }
            }
        }
    });
}

/// Column sums of `y: [n, w]` in fixed row chunks, chunk sums in order.
fn column_sums(y: &ArrayBase<impl Data<Elem = f32>, Ix2>) -> Vec<f32> {
    let w = y.ncols();
    let flat = y.as_slice().expect("standard layout");
    if w == 0 {
        return Vec::new();
    }
    let partial: Vec<Vec<f32>> = flat
        .par_chunks(ROWS * w)
        .map(|chunk| {
            let mut s = vec![0.0f32; w];
            for row in chunk.chunks(w) {
                for (a, &x) in s.iter_mut().zip(row) {
                    *a += x;
                }
            }
            s
        })
        .collect();
    let mut total = vec![0.0f32; w];
    for p in partial {
        for (t, x) in total.iter_mut().zip(p) {
            *t += x;
        }
    }
    total
}

/// `sum_i a[i, :] * b[i, :]` column-wise (fixed chunks, in order).
fn column_dot(a: &ArrayBase<impl Data<Elem = f32>, Ix2>, b: &Array2<f32>) -> Vec<f32> {
    let w = a.ncols();
    if w == 0 {
        return Vec::new();
    }
    let (fa, fb) = (
        a.as_slice().expect("standard layout"),
        b.as_slice().expect("standard layout"),
    );
    let partial: Vec<Vec<f32>> = fa
        .par_chunks(ROWS * w)
        .zip(fb.par_chunks(ROWS * w))
        .map(|(ca, cb)| {
            let mut s = vec![0.0f32; w];
            for (ra, rb) in ca.chunks(w).zip(cb.chunks(w)) {
                for ((acc, &x), &y) in s.iter_mut().zip(ra).zip(rb) {
                    *acc = x.mul_add(y, *acc);
                }
            }
            s
        })
        .collect();
    let mut total = vec![0.0f32; w];
    for p in partial {
        for (t, x) in total.iter_mut().zip(p) {
            *t += x;
        }
    }
    total
}

fn add_into(dst: &mut Array1<f32>, x: &[f32]) {
    for (d, &v) in dst.iter_mut().zip(x) {
        *d += v;
    }
}

/// `x_hat` of one row computed in f64 (mean, variance and scale), written
/// to `x_hat` rounded to f32; returns `1 / std` rounded to f32.
fn norm_row_f64(row: &[f32], x_hat: &mut [f32], eps: f32) -> f32 {
    let w = row.len() as f64;
    let mean = row.iter().map(|&v| f64::from(v)).sum::<f64>() / w;
    let var = row
        .iter()
        .map(|&v| (f64::from(v) - mean) * (f64::from(v) - mean))
        .sum::<f64>()
        / w;
    let s = 1.0 / (var + f64::from(eps)).sqrt();
    for (h, &v) in x_hat.iter_mut().zip(row) {
        *h = ((f64::from(v) - mean) * s) as f32;
    }
    s as f32
}

/// LayerNorm of the rows of `x` in place: returns `x_hat` and `1 / std`;
/// `x` becomes `gamma x_hat + beta`.
fn layer_norm(
    x: &mut Array2<f32>,
    gamma: &Array1<f32>,
    beta: &Array1<f32>,
    eps: f32,
) -> (Array2<f32>, Vec<f32>) {
    struct Rows<'a> {
        x: &'a mut [f32],
        x_hat: &'a mut [f32],
        inv: &'a mut [f32],
        g: &'a [f32],
        b: &'a [f32],
        eps: f32,
    }
    impl WithSimd for Rows<'_> {
        type Output = ();
        #[inline(always)]
        fn with_simd<S: Simd>(self, simd: S) {
            let w = self.g.len();
            for ((row, xh), inv) in self
                .x
                .chunks_mut(w)
                .zip(self.x_hat.chunks_mut(w))
                .zip(self.inv.iter_mut())
            {
                let mean = simd::sum(simd, row) / w as f32;
                let mut var = 0.0f32;
                for &v in row.iter() {
                    var = (v - mean).mul_add(v - mean, var);
                }
                if !(mean.is_finite() && var.is_finite()) {
                    // The row's sum or squares overflowed f32 (values above
                    // ~1.8e19 normalized to 0): this row in f64, where every
                    // f32 square and sum is finite.
                    *inv = norm_row_f64(row, xh, self.eps);
                    for ((y, &h), (&g, &b)) in
                        row.iter_mut().zip(xh.iter()).zip(self.g.iter().zip(self.b))
                    {
                        *y = h.mul_add(g, b);
                    }
                    continue;
                }
                let s = 1.0 / (var / w as f32 + self.eps).sqrt();
                *inv = s;
                for (((y, h), &g), &b) in row.iter_mut().zip(xh.iter_mut()).zip(self.g).zip(self.b)
                {
                    *h = (*y - mean) * s;
                    *y = h.mul_add(g, b);
                }
            }
        }
    }
    let (n, w) = x.dim();
    let mut x_hat = Array2::zeros((n, w));
    let mut inv = vec![0.0f32; n];
    if w == 0 {
        return (x_hat, inv);
    }
    let (g, b) = (
        gamma.as_slice().expect("contiguous"),
        beta.as_slice().expect("contiguous"),
    );
    let arch = simd::arch();
    let xs = x.as_slice_mut().expect("standard layout");
    let hs = x_hat.as_slice_mut().expect("standard layout");
    xs.par_chunks_mut(ROWS * w)
        .zip(hs.par_chunks_mut(ROWS * w))
        .zip(inv.par_chunks_mut(ROWS))
        .for_each(|((x, x_hat), inv)| {
            arch.dispatch(Rows {
                x,
                x_hat,
                inv,
                g,
                b,
                eps,
            })
        });
    (x_hat, inv)
}

/// Backward of [`layer_norm`]: returns `dx` and adds to the gradients of
/// `gamma` and `beta`.
fn layer_norm_backward(
    x_hat: &Array2<f32>,
    inv: &[f32],
    gamma: &Array1<f32>,
    dy: &ArrayBase<impl Data<Elem = f32>, Ix2>,
    grad_gamma: &mut Array1<f32>,
    grad_beta: &mut Array1<f32>,
) -> Array2<f32> {
    add_into(grad_gamma, &column_dot(dy, x_hat));
    add_into(grad_beta, &column_sums(dy));
    let (n, w) = dy.dim();
    let mut dx = Array2::zeros((n, w));
    if w == 0 {
        return dx;
    }
    let g = gamma.as_slice().expect("contiguous");
    let (dys, xhs) = (
        dy.as_slice().expect("standard layout"),
        x_hat.as_slice().expect("standard layout"),
    );
    dx.as_slice_mut()
        .expect("fresh")
        .par_chunks_mut(ROWS * w)
        .enumerate()
        .for_each(|(c, chunk)| {
            let mut gy = vec![0.0f32; w];
            for (i, out) in chunk.chunks_mut(w).enumerate() {
                let row = c * ROWS + i;
                let (d, xh) = (&dys[row * w..(row + 1) * w], &xhs[row * w..(row + 1) * w]);
                let (mut mean_g, mut mean_gx) = (0.0f32, 0.0f32);
                for ((t, &dv), &gv) in gy.iter_mut().zip(d).zip(g) {
                    *t = dv * gv;
                    mean_g += *t;
                }
                for (&t, &x) in gy.iter().zip(xh) {
                    mean_gx = t.mul_add(x, mean_gx);
                }
                mean_g /= w as f32;
                mean_gx /= w as f32;
                let s = inv[row];
                for ((o, &t), &x) in out.iter_mut().zip(&gy).zip(xh) {
                    *o = s * (t - mean_g - x * mean_gx);
                }
            }
        });
    dx
}

/// Backward of [`linear`]: returns `dx = dy W` and adds `dy^T x` to
/// `grad_w`, the column sums of `dy` to `grad_b`. With `dx_into`, `dx` is
/// added to that array instead (and an empty array returned).
fn linear_backward(
    x: ArrayView2<f32>,
    w: &Array2<f32>,
    dy: &Array2<f32>,
    grad_w: &mut Array2<f32>,
    grad_b: &mut Array1<f32>,
    dx_into: Option<ArrayViewMut2<f32>>,
) -> Array2<f32> {
    matmul(grad_w.view_mut(), dy.t(), x, true, Threads::All);
    add_into(grad_b, &column_sums(dy));
    match dx_into {
        Some(dx) => {
            matmul(dx, dy.view(), w.view(), true, Threads::All);
            Array2::zeros((0, 0))
        }
        None => {
            let mut dx = Array2::zeros((dy.nrows(), w.ncols()));
            matmul(dx.view_mut(), dy.view(), w.view(), false, Threads::All);
            dx
        }
    }
}

/// `x: [n, h * d]` viewed as `[n, h, d]`.
pub(crate) fn heads(x: &Array2<f32>, h: usize) -> ArrayView3<'_, f32> {
    let (n, width) = x.dim();
    x.view()
        .into_shape_with_order((n, h, width / h))
        .expect("a standard [n, hidden] array reshapes to [n, h, d]")
}

fn check_input(
    p: &LayerParams32,
    num_heads: usize,
    x: &ArrayView2<f32>,
    layout: &AttentionLayout,
) -> Result<()> {
    p.check_shapes()?;
    let hidden = p.hidden();
    if num_heads == 0 || !hidden.is_multiple_of(num_heads) {
        return Err(Error::invalid(
            "num_attention_heads",
            format!("{num_heads} heads do not divide hidden_size {hidden}"),
        ));
    }
    if x.ncols() != hidden {
        return Err(Error::ShapeMismatch {
            field: "hidden".into(),
            expected: format!("[n, hidden] with hidden = {hidden}"),
            actual: x.shape().to_vec(),
        });
    }
    check_layout(layout, x.nrows())?;
    if let AttentionLayout::Varlen { cu_seqlens } = layout {
        check_cu_seqlens(cu_seqlens, x.nrows())?;
    }
    let x3 = x.view().insert_axis(ndarray::Axis(2));
    check_finite("hidden", &x3)
}

/// Forward of one layer: `x: [n, hidden]` over `layout`; returns `[n,
/// hidden]` and the cache for [`layer_backward`].
///
/// # Errors
/// [`Error::ShapeMismatch`] for `x` or a parameter not fitting, the layout's
/// errors (`q` for dense rows not covering `n`, `cu_seqlens[i]`),
/// [`Error::InvalidArgument`] for heads not dividing `hidden`,
/// [`Error::NonFiniteInput`] naming `hidden` (the layer input).
pub fn layer_forward(
    p: &LayerParams32,
    num_heads: usize,
    eps: f32,
    x: ArrayView2<f32>,
    layout: &AttentionLayout,
) -> Result<(Array2<f32>, LayerCache32)> {
    check_input(p, num_heads, &x, layout)?;
    let x = x.as_standard_layout().into_owned();
    let hidden = p.hidden();
    let scale = 1.0 / ((hidden / num_heads) as f32).sqrt();
    let q = linear(x.view(), &p.query_w, &p.query_b, None);
    let k = linear(x.view(), &p.key_w, &p.key_b, None);
    let v = linear(x.view(), &p.value_w, &p.value_b, None);
    let (qh, kh, vh) = (
        heads(&q, num_heads),
        heads(&k, num_heads),
        heads(&v, num_heads),
    );
    let attention = match layout {
        AttentionLayout::Varlen { cu_seqlens } => {
            varlen_attention(qh, kh, vh, cu_seqlens, false, scale)?
        }
        AttentionLayout::Dense { row_len, allowed } => {
            let masks: Vec<ArrayView2<bool>> = allowed.iter().map(|a| a.view()).collect();
            dense_masked_attention(qh, kh, vh, *row_len, &masks, scale)?
        }
    };
    let n = x.nrows();
    let a = attention
        .output
        .view()
        .into_shape_with_order((n, hidden))
        .expect("a fresh [n, h, d] array reshapes to [n, hidden]");
    let mut h1 = linear(a.view(), &p.attn_out_w, &p.attn_out_b, Some(&x));
    let (x_hat1, inv_std1) = layer_norm(&mut h1, &p.attn_ln_g, &p.attn_ln_b, eps);
    let pre = linear(h1.view(), &p.inter_w, &p.inter_b, None);
    let mut act = Array2::zeros(pre.dim());
    let chunk = ROWS * p.intermediate().max(1);
    act.as_slice_mut()
        .expect("fresh")
        .par_chunks_mut(chunk)
        .zip(pre.as_slice().expect("fresh").par_chunks(chunk))
        .for_each(|(y, x)| simd::gelu_into(x, y));
    let mut out = linear(act.view(), &p.out_w, &p.out_b, Some(&h1));
    let (x_hat2, inv_std2) = layer_norm(&mut out, &p.out_ln_g, &p.out_ln_b, eps);
    Ok((
        out,
        LayerCache32 {
            x,
            q,
            k,
            v,
            attention,
            x_hat1,
            inv_std1,
            h1,
            pre,
            act,
            x_hat2,
            inv_std2,
        },
    ))
}

/// Backward of one layer: `dout: [n, hidden]`; returns `dx: [n, hidden]` and
/// the parameter gradients.
///
/// # Errors
/// [`Error::ShapeMismatch`] (field `grad_output`) for `dout` not shaped like
/// the forward's output; [`Error::NonFiniteInput`] naming `grad_output`; the
/// attention's errors.
pub fn layer_backward(
    p: &LayerParams32,
    num_heads: usize,
    cache: &LayerCache32,
    layout: &AttentionLayout,
    dout: ArrayView2<f32>,
) -> Result<(Array2<f32>, LayerParams32)> {
    let (n, hidden) = cache.x.dim();
    if dout.dim() != (n, hidden) {
        return Err(Error::ShapeMismatch {
            field: "grad_output".into(),
            expected: format!("[n, hidden] = [{n}, {hidden}]"),
            actual: dout.shape().to_vec(),
        });
    }
    check_finite("grad_output", &dout.insert_axis(ndarray::Axis(2)))?;
    let dout = dout.as_standard_layout();
    let scale = 1.0 / ((hidden / num_heads) as f32).sqrt();
    let mut g = p.zeros_like();
    let dr2 = layer_norm_backward(
        &cache.x_hat2,
        &cache.inv_std2,
        &p.out_ln_g,
        &dout,
        &mut g.out_ln_g,
        &mut g.out_ln_b,
    );
    let mut dpre = linear_backward(
        cache.act.view(),
        &p.out_w,
        &dr2,
        &mut g.out_w,
        &mut g.out_b,
        None,
    );
    let inter = p.intermediate().max(1);
    dpre.as_slice_mut()
        .expect("fresh")
        .par_chunks_mut(ROWS * inter)
        .zip(
            cache
                .pre
                .as_slice()
                .expect("standard layout")
                .par_chunks(ROWS * inter),
        )
        .for_each(|(dy, x)| simd::gelu_backward_slice(x, dy));
    let mut dh1 = dr2;
    linear_backward(
        cache.h1.view(),
        &p.inter_w,
        &dpre,
        &mut g.inter_w,
        &mut g.inter_b,
        Some(dh1.view_mut()),
    );
    let dr1 = layer_norm_backward(
        &cache.x_hat1,
        &cache.inv_std1,
        &p.attn_ln_g,
        &dh1,
        &mut g.attn_ln_g,
        &mut g.attn_ln_b,
    );
    let da = linear_backward(
        cache
            .attention
            .output
            .view()
            .into_shape_with_order((n, hidden))
            .expect("a fresh [n, h, d] array reshapes to [n, hidden]"),
        &p.attn_out_w,
        &dr1,
        &mut g.attn_out_w,
        &mut g.attn_out_b,
        None,
    );
    let (qh, kh, vh) = (
        heads(&cache.q, num_heads),
        heads(&cache.k, num_heads),
        heads(&cache.v, num_heads),
    );
    let dah = heads(&da, num_heads);
    let ag = match layout {
        AttentionLayout::Varlen { cu_seqlens } => {
            varlen_attention_backward(qh, kh, vh, cu_seqlens, false, scale, &cache.attention, dah)?
        }
        AttentionLayout::Dense { row_len, allowed } => {
            let masks: Vec<ArrayView2<bool>> = allowed.iter().map(|a| a.view()).collect();
            dense_masked_attention_backward(
                qh,
                kh,
                vh,
                *row_len,
                &masks,
                scale,
                &cache.attention,
                dah,
            )?
        }
    };
    let flat = |t: ndarray::Array3<f32>| {
        t.into_shape_with_order((n, hidden))
            .expect("[n, h, d] reshapes to [n, hidden]")
    };
    let mut dx = dr1;
    let x = cache.x.view();
    // Query, key and value projections, in that order, into `dx`.
    for (w, dy, gw, gb) in [
        (&p.query_w, ag.grad_q, &mut g.query_w, &mut g.query_b),
        (&p.key_w, ag.grad_k, &mut g.key_w, &mut g.key_b),
        (&p.value_w, ag.grad_v, &mut g.value_w, &mut g.value_b),
    ] {
        linear_backward(x, w, &flat(dy), gw, gb, Some(dx.view_mut()));
    }
    Ok((dx, g))
}

/// The floating-point operations of one layer's forward and backward on `n`
/// token slots (multiply-add = 2), counting the matrix products only
/// (LayerNorm, GELU, softmax are O(n hidden) or O(pairs) and left out, as
/// is usual): forward `2 n (4 hidden^2 + 2 hidden inter) + 4 pairs hidden`,
/// backward twice the products plus `10 pairs hidden` for attention
/// (recomputed scores, `dV`, `dP`, `dQ`, `dK`), where `pairs` is the number
/// of (query, key) pairs scored (`sum len^2` varlen, `rows row_len^2` dense).
pub fn layer_flops(n: usize, hidden: usize, inter: usize, pairs: u64) -> (f64, f64) {
    let (n, hd, it, pairs) = (n as f64, hidden as f64, inter as f64, pairs as f64);
    let products = 2.0 * n * (4.0 * hd * hd + 2.0 * hd * it);
    (
        products + 4.0 * pairs * hd,
        2.0 * products + 10.0 * pairs * hd,
    )
}

#[cfg(test)]
mod tests {
    use super::layer_flops;

    /// The count is the sum of `2 m k n` over the products the docs list,
    /// added here product by product: the Q, K, V and output projections
    /// (`[n, hidden] x [hidden, hidden]` each), the two MLP products
    /// (`[n, hidden] x [hidden, inter]` and back), and per scored pair the
    /// score and `P V` (`2 hidden` each); the backward twice the
    /// projections plus five pair products.
    #[test]
    fn layer_flops_counts_every_product_of_the_layer() {
        let mm = |m: f64, k: f64, n: f64| 2.0 * m * k * n;
        for (n, hd, it, pairs) in [(1, 1, 1, 1), (3, 4, 8, 5), (7, 12, 48, 33)] {
            let (nf, h, i, p) = (n as f64, hd as f64, it as f64, pairs as f64);
            let projections = 4.0 * mm(nf, h, h) + mm(nf, h, i) + mm(nf, i, h);
            let fwd = projections + 2.0 * mm(p, h, 1.0);
            let bwd = 2.0 * projections + 5.0 * mm(p, h, 1.0);
            assert_eq!(
                layer_flops(n, hd, it, pairs as u64),
                (fwd, bwd),
                "{n} {hd} {it} {pairs}"
            );
        }
    }
}
