//! A decoder model's training step with its layers in f32: the token
//! embedding, the final RMSNorm, the LM head and the weighted next-token
//! loss as the f64 reference computes them (`packshard_reference::decoder`),
//! every layer through the f32 decoder layer of [`crate::decoder_layer`]
//! (f32 matrix products, RMSNorm, rotary embeddings, causal grouped-query
//! varlen attention, SwiGLU). The residual stream enters the first layer
//! rounded to f32 and leaves the last widened to f64; the layers'
//! gradients are widened into the reference's [`DecoderParams`].
//!
//! Llama configurations only (RMSNorm, SwiGLU: [`DecoderShape::of`]); no
//! key/value cache.

use ndarray::{Array2, ArrayView2};
use packshard_reference::decoder::model::token_cross_entropy;
use packshard_reference::decoder::ops::{
    linear_nb, linear_nb_backward, rms_norm, rms_norm_backward,
};
use packshard_reference::decoder::{DecoderLayerParams, DecoderModel, DecoderParams};
use packshard_reference::{Error, Result};

use crate::convert::to_f32;
use crate::decoder_layer::{
    decoder_layer_backward, decoder_layer_forward, decoder_layer_params_f32, DecoderLayerParams32,
    DecoderShape,
};

/// One training step's results.
#[derive(Debug, Clone, PartialEq)]
pub struct DecoderRun32 {
    /// `[n, v]`.
    pub logits: Array2<f64>,
    /// `sum_i weights[i] * CE(logits_i, labels[i])`.
    pub loss: f64,
    /// Every parameter's gradient (the LayerNorm biases, unused, are 0).
    pub grads: DecoderParams,
}

/// Adds the f32 layer gradient `g` into the reference layer gradient `into`.
fn widen_into(into: &mut DecoderLayerParams, g: &DecoderLayerParams32) {
    let m = |a: &mut Array2<f64>, b: &Array2<f32>| a.zip_mut_with(b, |x, &y| *x += f64::from(y));
    into.attn_norm_g
        .zip_mut_with(&g.attn_norm_g, |x, &y| *x += f64::from(y));
    into.mlp_norm_g
        .zip_mut_with(&g.mlp_norm_g, |x, &y| *x += f64::from(y));
    m(&mut into.wq, &g.wq);
    m(&mut into.wk, &g.wk);
    m(&mut into.wv, &g.wv);
    m(&mut into.wo, &g.wo);
    m(&mut into.w_gate, &g.w_gate);
    m(&mut into.w_up, &g.w_up);
    m(&mut into.w_down, &g.w_down);
}

/// Forward, the weighted loss and the backward of `model` on `input_ids:
/// [n]` at `positions: [n]`, causal attention over `cu_seqlens: [b + 1]`,
/// `labels: [n]` (`-100`: no target), `weights: [n]`.
///
/// # Errors
/// [`Error::InvalidArgument`] naming `norm` or `mlp` (not Llama's), or a
/// weight beyond f32; [`Error::IndexOutOfRange`] naming `input_ids`;
/// [`Error::ShapeMismatch`] naming `position_ids` or `weights`; the loss's
/// and the attention kernel's errors (`labels`, `cu_seqlens[i]`).
pub fn decoder_run_f32(
    model: &DecoderModel,
    input_ids: &[i64],
    positions: &[usize],
    cu_seqlens: &[usize],
    (labels, weights): (&[i64], &[f64]),
) -> Result<DecoderRun32> {
    let (c, p) = (&model.config, &model.params);
    let shape = DecoderShape::of(c)?;
    let n = input_ids.len();
    for (field, len) in [
        ("position_ids", positions.len()),
        ("weights", weights.len()),
    ] {
        if len != n {
            return Err(Error::ShapeMismatch {
                field: field.into(),
                expected: format!("[n] = [{n}] (one per input id)"),
                actual: vec![len],
            });
        }
    }
    let layers: Vec<DecoderLayerParams32> = p
        .layers
        .iter()
        .map(decoder_layer_params_f32)
        .collect::<Result<_>>()?;
    let mut x = Array2::zeros((n, c.hidden_size));
    for (i, &id) in input_ids.iter().enumerate() {
        if id < 0 || id as u64 >= c.vocab_size as u64 {
            return Err(Error::IndexOutOfRange {
                field: "input_ids".into(),
                index: i,
                value: id,
                lo: 0,
                hi: c.vocab_size as i64,
            });
        }
        x.row_mut(i).assign(&p.embed.row(id as usize));
    }
    let mut h = to_f32("inputs_embeds", x.view())?;
    let mut caches = Vec::with_capacity(layers.len());
    for lp in &layers {
        let (y, cache) = decoder_layer_forward(&shape, lp, h.view(), positions, cu_seqlens)?;
        caches.push(cache);
        h = y;
    }
    let last = h.mapv(f64::from);
    let (hidden, final_norm) = rms_norm(last.view(), p.final_norm_g.view(), c.norm_eps);
    let head: ArrayView2<f64> = if c.tie_embeddings {
        p.embed.view()
    } else {
        p.lm_head.view()
    };
    let logits = linear_nb(hidden.view(), head);
    let (token_losses, grad) = token_cross_entropy(logits.view(), labels, weights)?;
    let loss = token_losses.iter().zip(weights).map(|(l, w)| l * w).sum();
    // Backward.
    let mut g = p.zeros_like();
    let head_grad = if c.tie_embeddings {
        &mut g.embed
    } else {
        &mut g.lm_head
    };
    let dhidden = linear_nb_backward(hidden.view(), head, grad.view(), head_grad.view_mut());
    let dlast = rms_norm_backward(
        &final_norm,
        p.final_norm_g.view(),
        dhidden.view(),
        g.final_norm_g.view_mut(),
    );
    let mut dh = to_f32("grad_hidden", dlast.view())?;
    for l in (0..layers.len()).rev() {
        let (d, gl) = decoder_layer_backward(
            &shape,
            &layers[l],
            &caches[l],
            positions,
            cu_seqlens,
            dh.view(),
        )?;
        widen_into(&mut g.layers[l], &gl);
        dh = d;
    }
    for (i, &id) in input_ids.iter().enumerate() {
        let mut row = g.embed.row_mut(id as usize);
        row.zip_mut_with(&dh.row(i), |x, &y| *x += f64::from(y));
    }
    Ok(DecoderRun32 {
        logits,
        loss,
        grads: g,
    })
}
