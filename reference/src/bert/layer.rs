//! One post-LayerNorm BERT encoder layer (Devlin et al. 2019; Hugging Face
//! `BertLayer`), forward and backward.
//!
//! ```text
//! q, k, v = x Wq^T + bq, x Wk^T + bk, x Wv^T + bv      [n, hidden] -> [n, h, d]
//! a       = attention(q, k, v, layout)                  [n, h, d] -> [n, hidden]
//! h1      = LayerNorm(a Wo^T + bo + x)                  (attention.output)
//! f       = gelu(h1 W1^T + b1)                          (intermediate)
//! out     = LayerNorm(f W2^T + b2 + h1)                 (output)
//! ```
//!
//! Dropout is off (evaluation mode, as every equivalence check needs).

use ndarray::{Array2, Array3, ArrayView2};

use super::ops::{
    gelu_backward, gelu_map, layer_norm, layer_norm_backward, linear, linear_backward,
    LayerNormCache,
};
use super::weights::LayerParams;
use crate::attention::{AttentionLayout, AttentionOutput};
use crate::error::{Error, Result};
use crate::ops::{AttentionOp, EncoderLayerOp, Grad, Layer, LayerInput, LayerPass, Qkv};

/// What the backward of one layer needs.
#[derive(Debug, Clone)]
pub struct LayerCache {
    /// The layer input `x: [n, hidden]`.
    pub input: Array2<f64>,
    /// `q, k, v: [n, h, d]`.
    pub q: Array3<f64>,
    /// Keys.
    pub k: Array3<f64>,
    /// Values.
    pub v: Array3<f64>,
    /// The attention output and its log-sum-exp.
    pub attention: AttentionOutput,
    /// Attention LayerNorm intermediates.
    pub ln1: LayerNormCache,
    /// `h1: [n, hidden]`.
    pub h1: Array2<f64>,
    /// The feed-forward pre-activation `h1 W1^T + b1: [n, inter]`.
    pub pre_gelu: Array2<f64>,
    /// `gelu(pre_gelu)`.
    pub act: Array2<f64>,
    /// Output LayerNorm intermediates.
    pub ln2: LayerNormCache,
}

fn heads(x: Array2<f64>, h: usize) -> Result<Array3<f64>> {
    let (n, width) = x.dim();
    x.into_shape_with_order((n, h, width / h))
        .map_err(|e| Error::invalid("hidden", e.to_string()))
}

fn flat(x: &Array3<f64>) -> Array2<f64> {
    let (n, h, d) = x.dim();
    x.to_owned()
        .into_shape_with_order((n, h * d))
        .expect("a standard-layout [n, h, d] array reshapes to [n, h * d]")
}

/// Forward of one layer: `x: [n, hidden]` over `layout`; returns
/// `[n, hidden]` and the cache.
///
/// # Errors
/// Shape errors from the attention kernel.
pub fn layer_forward(
    p: &LayerParams,
    num_heads: usize,
    eps: f64,
    kernel: &dyn AttentionOp,
    x: ArrayView2<f64>,
    layout: &AttentionLayout,
) -> Result<(Array2<f64>, LayerCache)> {
    let width = x.ncols();
    let scale = crate::attention::default_scale(width / num_heads);
    let q = heads(linear(x, p.query_w.view(), p.query_b.view()), num_heads)?;
    let k = heads(linear(x, p.key_w.view(), p.key_b.view()), num_heads)?;
    let v = heads(linear(x, p.value_w.view(), p.value_b.view()), num_heads)?;
    let attention = crate::attention::layout_forward(
        kernel,
        Qkv::new(q.view(), k.view(), v.view()),
        layout,
        scale,
    )?;
    let a = flat(&attention.output);
    let mut r1 = linear(a.view(), p.attn_out_w.view(), p.attn_out_b.view());
    r1 += &x;
    let (h1, ln1) = layer_norm(r1.view(), p.attn_ln_g.view(), p.attn_ln_b.view(), eps);
    let pre_gelu = linear(h1.view(), p.inter_w.view(), p.inter_b.view());
    let act = gelu_map(pre_gelu.view());
    let mut r2 = linear(act.view(), p.out_w.view(), p.out_b.view());
    r2 += &h1;
    let (out, ln2) = layer_norm(r2.view(), p.out_ln_g.view(), p.out_ln_b.view(), eps);
    Ok((
        out,
        LayerCache {
            input: x.to_owned(),
            q,
            k,
            v,
            attention,
            ln1,
            h1,
            pre_gelu,
            act,
            ln2,
        },
    ))
}

/// Backward of one layer: `dout: [n, hidden]`; adds the parameter gradients
/// to `g` and returns `dx: [n, hidden]`.
///
/// # Errors
/// Shape errors from the attention kernel.
#[allow(clippy::too_many_arguments)]
pub fn layer_backward(
    p: &LayerParams,
    g: &mut LayerParams,
    num_heads: usize,
    kernel: &dyn AttentionOp,
    cache: &LayerCache,
    layout: &AttentionLayout,
    dout: ArrayView2<f64>,
) -> Result<Array2<f64>> {
    let width = dout.ncols();
    let scale = crate::attention::default_scale(width / num_heads);
    // out = LN2(r2), r2 = act W2^T + b2 + h1
    let dr2 = param_backward!(layer_norm_backward(&cache.ln2, dout), p => g, out_ln_g, out_ln_b);
    let dact = param_backward!(linear_backward(cache.act.view(), dr2.view()), p => g, out_w, out_b);
    let dpre = gelu_backward(cache.pre_gelu.view(), dact.view());
    let mut dh1 =
        param_backward!(linear_backward(cache.h1.view(), dpre.view()), p => g, inter_w, inter_b);
    dh1 += &dr2;
    // h1 = LN1(r1), r1 = a Wo^T + bo + x
    let dr1 =
        param_backward!(layer_norm_backward(&cache.ln1, dh1.view()), p => g, attn_ln_g, attn_ln_b);
    let a = flat(&cache.attention.output);
    let da = param_backward!(linear_backward(a.view(), dr1.view()), p => g, attn_out_w, attn_out_b);
    let da = heads(da, num_heads)?;
    let ag = crate::attention::layout_backward(
        kernel,
        Qkv::new(cache.q.view(), cache.k.view(), cache.v.view()),
        layout,
        scale,
        Grad::new(&cache.attention, da.view()),
    )?;
    let x = cache.input.view();
    let mut dx = dr1;
    dx += &param_backward!(linear_backward(x, flat(&ag.grad_q).view()), p => g, query_w, query_b);
    dx += &param_backward!(linear_backward(x, flat(&ag.grad_k).view()), p => g, key_w, key_b);
    dx += &param_backward!(linear_backward(x, flat(&ag.grad_v).view()), p => g, value_w, value_b);
    Ok(dx)
}

/// The reference encoder layer ([`layer_forward`], [`layer_backward`]) with
/// the attention `A` ([`crate::attention::ReferenceAttention`] by default;
/// any [`AttentionOp`] to check a kernel inside the whole layer).
#[derive(Debug, Clone, Copy, Default)]
pub struct ReferenceLayer<A = crate::attention::ReferenceAttention>(pub A);

impl<A: AttentionOp> EncoderLayerOp for ReferenceLayer<A> {
    fn forward_backward(&self, layer: Layer<'_>, input: LayerInput<'_>) -> Result<LayerPass> {
        let Layer {
            params,
            num_heads,
            eps,
        } = layer;
        let LayerInput {
            x,
            layout,
            grad_output,
        } = input;
        let (output, cache) = layer_forward(params, num_heads, eps, &self.0, x, layout)?;
        let mut grads = params.zeros_like();
        let grad_x = layer_backward(
            params,
            &mut grads,
            num_heads,
            &self.0,
            &cache,
            layout,
            grad_output,
        )?;
        Ok(LayerPass {
            output,
            grad_x,
            grads,
        })
    }
}
