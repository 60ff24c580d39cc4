//! One pre-norm decoder layer in the Llama shape (Hugging Face
//! `LlamaDecoderLayer`, as `packshard_reference::decoder::layer`), forward
//! and backward, in `f32`: bias-free projections through
//! [`gemm`](crate::matmul), RMSNorm, rotary embeddings at each token's own
//! position and SwiGLU on rayon row chunks, causal grouped-query attention
//! through the tiled varlen kernel ([`crate::attention::varlen_attention_general`]).
//!
//! ```text
//! h1 = RMSNorm(x)                                   [n, hidden]
//! q  = rope(h1 Wq^T), k = rope(h1 Wk^T), v = h1 Wv^T  [n, h | h_kv, d]
//! x1 = x + attention_causal(q, k, v, cu_seqlens) Wo^T
//! y  = x1 + (silu(h2 Wg^T) * h2 Wu^T) Wd^T,  h2 = RMSNorm(x1)
//! ```
//!
//! Packed rows are one varlen call over the documents' `cu_seqlens`
//! (positions restart per document); a padded row is one segment of
//! `row_len` slots whose real tokens come first, so under the causal mask
//! they never see the padding after them. Only the Llama configuration
//! (RMSNorm, SwiGLU) is implemented; LayerNorm and GELU are refused.

use ndarray::{Array1, Array2, ArrayView2, Axis};
use packshard_reference::decoder::{DecoderConfig, DecoderLayerParams, Mlp, Norm};
use packshard_reference::ops::Varlen;
use packshard_reference::{Error, Result};
use rayon::prelude::*;

use crate::attention::{
    varlen_attention_general, varlen_attention_general_backward, AttentionOutput32,
};
use crate::convert::to_f32;
use crate::layer::{heads, row_chunks, ROWS};
use crate::matmul::{matmul, Threads};

/// The sizes of a layer (from a [`DecoderConfig`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecoderShape {
    /// Query heads `h`.
    pub heads: usize,
    /// Key/value heads `h_kv` (dividing `h`).
    pub kv_heads: usize,
    /// Head dim `d` (even).
    pub head_dim: usize,
    /// RMSNorm epsilon.
    pub eps: f32,
    /// Rotary base.
    pub rope_theta: f64,
}

impl DecoderShape {
    /// The sizes of `config`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming `norm` or `mlp` for a configuration
    /// other than Llama's (RMSNorm, SwiGLU); the config's own errors.
    pub fn of(config: &DecoderConfig) -> Result<Self> {
        config.validate()?;
        if config.norm != Norm::RmsNorm {
            return Err(Error::invalid(
                "norm",
                "the f32 decoder layer implements RMSNorm only",
            ));
        }
        if config.mlp != Mlp::SwiGlu {
            return Err(Error::invalid(
                "mlp",
                "the f32 decoder layer implements SwiGLU only",
            ));
        }
        let eps = config.norm_eps as f32;
        if !(eps > 0.0 && eps.is_finite()) {
            // An option rounded to the kernel's precision is checked as its
            // inputs are: 1e-50 rounds to 0 in f32, 1e39 to infinity.
            return Err(Error::invalid(
                "norm_eps",
                format!(
                    "{:e} rounds to {eps:e} in f32: the f32 decoder layer needs it positive and finite there",
                    config.norm_eps
                ),
            ));
        }
        Ok(DecoderShape {
            heads: config.num_heads,
            kv_heads: config.num_kv_heads,
            head_dim: config.head_dim,
            eps,
            rope_theta: config.rope_theta,
        })
    }
}

/// One layer's parameters in f32: the reference's type, names and shapes
/// (the LayerNorm biases, which RMSNorm has not, are `[0]`).
pub type DecoderLayerParams32 = DecoderLayerParams<f32>;

/// The reference parameters rounded to f32.
///
/// # Errors
/// [`Error::InvalidArgument`] for a value beyond the f32 range, naming the
/// tensor by its Hugging Face name.
pub fn decoder_layer_params_f32(p: &DecoderLayerParams) -> Result<DecoderLayerParams32> {
    p.try_map(|n, a| to_f32(n, a.view()), |n, a| to_f32(n, a.view()))
}

/// What the backward needs.
#[derive(Debug, Clone)]
pub struct DecoderLayerCache32 {
    x: Array2<f32>,
    norm1: RmsNormCache,
    h1: Array2<f32>,
    q: Array2<f32>,
    k: Array2<f32>,
    v: Array2<f32>,
    attention: AttentionOutput32,
    norm2: RmsNormCache,
    h2: Array2<f32>,
    gate: Array2<f32>,
    up: Array2<f32>,
    act: Array2<f32>,
}

/// `x W^T`: `x: [n, in]`, `w: [out, in]`.
fn linear(x: ArrayView2<f32>, w: &Array2<f32>) -> Array2<f32> {
    let mut y = Array2::zeros((x.nrows(), w.nrows()));
    matmul(y.view_mut(), x, w.t(), false, Threads::All);
    y
}

/// Backward of [`linear`]: adds `dy^T x` to `gw`, returns `dy W`.
fn linear_backward(
    x: ArrayView2<f32>,
    w: &Array2<f32>,
    dy: ArrayView2<f32>,
    gw: &mut Array2<f32>,
) -> Array2<f32> {
    matmul(gw.view_mut(), dy.t(), x, true, Threads::All);
    let mut dx = Array2::zeros((dy.nrows(), w.ncols()));
    matmul(dx.view_mut(), dy, w.view(), false, Threads::All);
    dx
}

/// `1 / sqrt(mean(x^2) + eps)` of each row of `x`, the squares summed in
/// f64: an f32 square overflows above ~1.8e19, which normalized such rows
/// to 0; every f32 square and a row's sum of them are finite in f64. Kept
/// in f64, since `1 / rms` of a row near f32's largest value is below f32's
/// smallest normal.
fn inv_rms(x: &Array2<f32>, eps: f32) -> Vec<f64> {
    let w = x.ncols() as f64;
    x.rows()
        .into_iter()
        .map(|r| {
            let sum: f64 = r.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
            1.0 / (sum / w + f64::from(eps)).sqrt()
        })
        .collect()
}

/// What [`rms_norm_backward`] needs of an [`rms_norm`] of `x: [n, w]`.
#[derive(Debug, Clone)]
struct RmsNormCache {
    /// `[n, w]`: `x / rms` of each row.
    x_hat: Array2<f32>,
    /// `[n]`: `1 / rms` of each row (f64: [`inv_rms`]).
    inv_rms: Vec<f64>,
}

/// RMSNorm of the rows of `x`: `(gamma x_hat, {x_hat, 1 / rms})`.
fn rms_norm(x: &Array2<f32>, gamma: &Array1<f32>, eps: f32) -> (Array2<f32>, RmsNormCache) {
    let w = x.ncols().max(1);
    let inv_rms = inv_rms(x, eps);
    let mut x_hat = x.clone();
    row_chunks(&mut x_hat).enumerate().for_each(|(c, chunk)| {
        for (i, row) in chunk.chunks_mut(w).enumerate() {
            let r = inv_rms[c * ROWS + i];
            row.iter_mut().for_each(|v| *v = (f64::from(*v) * r) as f32);
        }
    });
    let y = &x_hat * gamma;
    (y, RmsNormCache { x_hat, inv_rms })
}

/// Backward of [`rms_norm`]: adds `sum_rows(dy x_hat)` to `gg`, returns
/// `dx = r (g - x_hat mean(g x_hat))`, `g = dy gamma`.
fn rms_norm_backward(
    RmsNormCache { x_hat, inv_rms }: &RmsNormCache,
    gamma: &Array1<f32>,
    dy: &Array2<f32>,
    gg: &mut Array1<f32>,
) -> Array2<f32> {
    *gg += &(dy * x_hat).sum_axis(Axis(0));
    let w = dy.ncols();
    let mut dx = dy * gamma;
    let xh = x_hat.as_slice().expect("standard layout");
    row_chunks(&mut dx).enumerate().for_each(|(c, chunk)| {
        for (i, row) in chunk.chunks_mut(w.max(1)).enumerate() {
            let t = c * ROWS + i;
            let xr = &xh[t * w..(t + 1) * w];
            let mean = row.iter().zip(xr).map(|(g, x)| g * x).sum::<f32>() / w as f32;
            let r = inv_rms[t];
            for (g, &x) in row.iter_mut().zip(xr) {
                *g = (r * f64::from(*g - x * mean)) as f32;
            }
        }
    });
    dx
}

/// Rotary embeddings (GPT-NeoX `rotate_half` layout) of `x: [n, heads * d]`
/// in place, token `t` by the angle of `positions[t]` (`sign` -1: the
/// backward). Angles in f64, rounded once.
fn rope(x: &mut Array2<f32>, heads: usize, positions: &[usize], theta: f64, sign: f64) {
    let w = x.ncols();
    let d = w / heads.max(1);
    let half = d / 2;
    let inv: Vec<f64> = (0..half)
        .map(|i| theta.powf(-2.0 * i as f64 / d as f64))
        .collect();
    x.as_slice_mut()
        .expect("standard layout")
        .par_chunks_mut(w.max(1))
        .zip(positions.par_iter())
        .for_each(|(row, &p)| {
            for (i, &f) in inv.iter().enumerate() {
                let a = p as f64 * f;
                let (s, c) = ((sign * a.sin()) as f32, a.cos() as f32);
                for hd in row.chunks_mut(d) {
                    let (x1, x2) = (hd[i], hd[i + half]);
                    hd[i] = x1 * c - x2 * s;
                    hd[i + half] = x2 * c + x1 * s;
                }
            }
        });
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

fn check(
    s: &DecoderShape,
    p: &DecoderLayerParams32,
    x: ArrayView2<f32>,
    positions: &[usize],
) -> Result<()> {
    let hidden = p.attn_norm_g.len();
    if x.ncols() != hidden || positions.len() != x.nrows() {
        return Err(Error::ShapeMismatch {
            field: "x".into(),
            expected: format!("[n, hidden] = [{}, {hidden}]", positions.len()),
            actual: x.shape().to_vec(),
        });
    }
    if p.wq.nrows() != s.heads * s.head_dim || p.wk.nrows() != s.kv_heads * s.head_dim {
        return Err(Error::ShapeMismatch {
            field: "self_attn.q_proj.weight".into(),
            expected: format!("[h * d, hidden] = [{}, {hidden}]", s.heads * s.head_dim),
            actual: p.wq.shape().to_vec(),
        });
    }
    Ok(())
}

/// Forward of one layer: `x: [n, hidden]`, `positions: [n]`, causal
/// attention over `cu_seqlens: [b + 1]`. Returns `[n, hidden]` and the cache.
///
/// # Errors
/// [`Error::ShapeMismatch`] naming `x` or a weight; the attention kernel's
/// errors (`cu_seqlens[i]`, non-finite values).
pub fn decoder_layer_forward(
    s: &DecoderShape,
    p: &DecoderLayerParams32,
    x: ArrayView2<f32>,
    positions: &[usize],
    cu_seqlens: &[usize],
) -> Result<(Array2<f32>, DecoderLayerCache32)> {
    check(s, p, x, positions)?;
    let x = x.as_standard_layout().to_owned();
    let (h1, norm1) = rms_norm(&x, &p.attn_norm_g, s.eps);
    let mut q = linear(h1.view(), &p.wq);
    let mut k = linear(h1.view(), &p.wk);
    let v = linear(h1.view(), &p.wv);
    rope(&mut q, s.heads, positions, s.rope_theta, 1.0);
    rope(&mut k, s.kv_heads, positions, s.rope_theta, 1.0);
    let scale = 1.0 / (s.head_dim as f64).sqrt();
    let attention = varlen_attention_general(
        heads(&q, s.heads),
        heads(&k, s.kv_heads),
        heads(&v, s.kv_heads),
        &Varlen::new(cu_seqlens, true, scale),
    )?;
    let (n, h, d) = attention.output.dim();
    let a = attention
        .output
        .view()
        .into_shape_with_order((n, h * d))
        .expect("standard layout");
    let mut x1 = linear(a, &p.wo);
    x1 += &x;
    let (h2, norm2) = rms_norm(&x1, &p.mlp_norm_g, s.eps);
    let gate = linear(h2.view(), &p.w_gate);
    let up = linear(h2.view(), &p.w_up);
    let mut act = gate.mapv(silu);
    act *= &up;
    let mut y = linear(act.view(), &p.w_down);
    y += &x1;
    Ok((
        y,
        DecoderLayerCache32 {
            x,
            norm1,
            h1,
            q,
            k,
            v,
            attention,
            norm2,
            h2,
            gate,
            up,
            act,
        },
    ))
}

/// Backward of [`decoder_layer_forward`]: `dy: [n, hidden]`; returns `dx`
/// and the parameter gradients.
///
/// # Errors
/// [`Error::ShapeMismatch`] naming `dy`; the attention kernel's errors.
pub fn decoder_layer_backward(
    s: &DecoderShape,
    p: &DecoderLayerParams32,
    c: &DecoderLayerCache32,
    positions: &[usize],
    cu_seqlens: &[usize],
    dy: ArrayView2<f32>,
) -> Result<(Array2<f32>, DecoderLayerParams32)> {
    if dy.dim() != c.x.dim() {
        return Err(Error::ShapeMismatch {
            field: "dy".into(),
            expected: format!("{:?} (the layer's output)", c.x.shape()),
            actual: dy.shape().to_vec(),
        });
    }
    let dy = dy.as_standard_layout().to_owned();
    let mut g = p.zeros_like();
    let dact = linear_backward(c.act.view(), &p.w_down, dy.view(), &mut g.w_down);
    let mut dgate = c.gate.mapv(|x| {
        let sg = 1.0 / (1.0 + (-x).exp());
        sg * (1.0 + x * (1.0 - sg))
    });
    dgate *= &c.up;
    dgate *= &dact;
    let mut dup = c.gate.mapv(silu);
    dup *= &dact;
    let mut dh2 = linear_backward(c.h2.view(), &p.w_gate, dgate.view(), &mut g.w_gate);
    dh2 += &linear_backward(c.h2.view(), &p.w_up, dup.view(), &mut g.w_up);
    let mut dx1 = rms_norm_backward(&c.norm2, &p.mlp_norm_g, &dh2, &mut g.mlp_norm_g);
    dx1 += &dy;
    let (n, h, d) = c.attention.output.dim();
    let a = c
        .attention
        .output
        .view()
        .into_shape_with_order((n, h * d))
        .expect("standard layout");
    let da = linear_backward(a, &p.wo, dx1.view(), &mut g.wo);
    let scale = 1.0 / (s.head_dim as f64).sqrt();
    let ag = varlen_attention_general_backward(
        heads(&c.q, s.heads),
        heads(&c.k, s.kv_heads),
        heads(&c.v, s.kv_heads),
        &Varlen::new(cu_seqlens, true, scale),
        &c.attention,
        heads(&da, s.heads),
    )?;
    let flat = |t: ndarray::Array3<f32>| {
        let (n, h, d) = t.dim();
        t.into_shape_with_order((n, h * d)).expect("fresh array")
    };
    let (mut dq, mut dk, dv) = (flat(ag.grad_q), flat(ag.grad_k), flat(ag.grad_v));
    rope(&mut dq, s.heads, positions, s.rope_theta, -1.0);
    rope(&mut dk, s.kv_heads, positions, s.rope_theta, -1.0);
    let h1 = c.h1.view();
    let mut dh1 = linear_backward(h1, &p.wq, dq.view(), &mut g.wq);
    dh1 += &linear_backward(h1, &p.wk, dk.view(), &mut g.wk);
    dh1 += &linear_backward(h1, &p.wv, dv.view(), &mut g.wv);
    let mut dx = rms_norm_backward(&c.norm1, &p.attn_norm_g, &dh1, &mut g.attn_norm_g);
    dx += &dx1;
    Ok((dx, g))
}
