//! The decoder stack (Llama / GPT-NeoX shape), forward and hand-written
//! backward, over a packed (varlen) or padded (dense rows) token layout.
//!
//! ```text
//! x0  = embed[input_ids]                                  [n, hidden]
//! per layer:
//!   h1  = norm1(x)                                        (input_layernorm)
//!   q   = rope(h1 Wq^T, pos)  [n, h, d]; k = rope(h1 Wk^T, pos), v = h1 Wv^T  [n, h_kv, d]
//!   a   = causal attention(q, [past k; k], [past v; v])   (bottom-right, per segment)
//!   x1  = x + a Wo^T
//!   h2  = norm2(x1)                                       (post_attention_layernorm)
//!   out = x1 + Wd (silu(Wg h2) * Wu h2)    or   x1 + Wd gelu(Wu h2)
//! logits = normf(x_L) W^T,  W = lm_head or embed (tied)   [n, v]
//! ```
//!
//! Every projection is bias-free (Llama). The attention is any
//! [`AttentionOp`] (the reference's by default): its varlen form, causal, with
//! `cu_seqlens_k` covering each segment's cached keys followed by its new
//! ones when a [`KvCache`] is given (a continuation chunk, docs/FAULTS.md C5),
//! or its masked form, one dense mask per row (the padded batch, or packed
//! rows with a block-diagonal causal mask). Rotary embeddings use each
//! token's given position (docs/FAULTS.md C6).

use ndarray::{Array2, Array3, ArrayView2};

pub use super::layer::{
    decoder_layer_backward, decoder_layer_forward, DecoderLayerCache, NormCache,
};
use super::layer::{norm_backward, norm_forward};
use super::ops::{linear_nb, linear_nb_backward};
use super::params::{DecoderConfig, DecoderParams, MAX_TENSOR};
use crate::error::{check_finite, check_len, Error, Result};
use crate::ops::AttentionOp;
use crate::vocab::IGNORE_INDEX;

pub use super::layer::DecoderAttention;

/// Keys and values of earlier tokens (post-rotary), per layer, for a
/// continuation chunk: segment `s` of the chunk continues cached tokens
/// `cu_seqlens[s]..cu_seqlens[s + 1]`.
#[derive(Debug, Clone, PartialEq)]
pub struct KvCache {
    /// `[b + 1]` over the cached tokens, as many segments as the chunk.
    pub cu_seqlens: Vec<usize>,
    /// Per layer `(k, v)`, each `[n_past, h_kv, d]`.
    pub layers: Vec<(Array3<f64>, Array3<f64>)>,
}

/// One batch's inputs: `n` token slots.
#[derive(Debug, Clone, Copy)]
pub struct DecoderInput<'a> {
    /// `[n]` token ids in `0..v` (padding slots hold a valid pad id).
    pub input_ids: &'a [i64],
    /// `[n]` each token's position (rotary angle), as the caller gives it.
    pub position_ids: &'a [usize],
    /// The layout.
    pub attention: &'a DecoderAttention,
    /// Cached keys and values the segments continue (varlen only).
    pub past: Option<&'a KvCache>,
}

/// The forward's results.
#[derive(Debug, Clone)]
pub struct DecoderForward {
    /// `[n, v]`.
    pub logits: Array2<f64>,
    /// Per layer.
    pub layers: Vec<DecoderLayerCache>,
    /// The last layer's output `[n, hidden]` (before the final norm).
    pub last: Array2<f64>,
    /// Final norm intermediates.
    pub final_norm: NormCache,
    /// `normf(last): [n, hidden]`, the LM head's input.
    pub hidden: Array2<f64>,
}

impl DecoderForward {
    /// This batch's keys and values (post-rotary), per layer, as a cache a
    /// continuation chunk of the same segments can attend to.
    pub fn present(&self, cu_seqlens: &[usize]) -> KvCache {
        KvCache {
            cu_seqlens: cu_seqlens.to_vec(),
            layers: self
                .layers
                .iter()
                .map(|l| (l.k.clone(), l.v.clone()))
                .collect(),
        }
    }
}

/// Gradients of a backward pass.
#[derive(Debug, Clone, PartialEq)]
pub struct DecoderGrads {
    /// Every parameter's gradient (the tied head's gradient in `embed`).
    pub params: DecoderParams,
    /// `[n, hidden]`: the gradient of the input embeddings.
    pub grad_inputs_embeds: Array2<f64>,
    /// With a cache: per layer, the gradients of the cached `(k, v)`.
    pub past: Option<Vec<(Array3<f64>, Array3<f64>)>>,
}

/// Forward, loss and backward of one batch.
#[derive(Debug, Clone, PartialEq)]
pub struct DecoderRun {
    /// `[n, v]`.
    pub logits: Array2<f64>,
    /// `[n]`: each slot's cross-entropy (0 for an ignored label).
    pub token_losses: Vec<f64>,
    /// `sum_i weights[i] * token_losses[i]`.
    pub loss: f64,
    /// The gradients of `loss`.
    pub grads: DecoderGrads,
}

/// A decoder: configuration and parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct DecoderModel {
    /// Sizes and options.
    pub config: DecoderConfig,
    /// Weights.
    pub params: DecoderParams,
}

impl DecoderModel {
    /// Seeded random weights ([`DecoderParams::random`]).
    ///
    /// # Errors
    /// [`DecoderConfig::validate`]'s.
    pub fn random(config: DecoderConfig, seed: u64) -> Result<Self> {
        let params = DecoderParams::random(&config, seed)?;
        Ok(DecoderModel { config, params })
    }

    fn head(&self) -> ArrayView2<'_, f64> {
        if self.config.tie_embeddings {
            self.params.embed.view()
        } else {
            self.params.lm_head.view()
        }
    }

    fn check_input(&self, input: &DecoderInput<'_>) -> Result<()> {
        let c = &self.config;
        c.validate()?;
        self.params.check(c)?;
        let n = input.input_ids.len();
        if n.saturating_mul(c.vocab_size.max(c.hidden_size).max(c.intermediate_size)) > MAX_TENSOR {
            return Err(Error::invalid(
                "input_ids",
                format!("{n} tokens is over the supported batch size"),
            ));
        }
        check_len(
            "position_ids",
            input.position_ids.len(),
            "n",
            n,
            "one per input id",
        )?;
        for (i, &id) in input.input_ids.iter().enumerate() {
            if id < 0 || id as u64 >= c.vocab_size as u64 {
                return Err(Error::out_of_range("input_ids", i, id, c.vocab_size));
            }
        }
        input.attention.check(n)?;
        if let Some(past) = input.past {
            let DecoderAttention::Varlen { cu_seqlens } = input.attention else {
                return Err(Error::invalid(
                    "past",
                    "a key/value cache needs the varlen layout",
                ));
            };
            let n_past = *past.cu_seqlens.last().unwrap_or(&0);
            crate::attention::check_cu_seqlens_named(
                "past.cu_seqlens",
                "past.k",
                &past.cu_seqlens,
                n_past,
            )?;
            if past.cu_seqlens.len() != cu_seqlens.len() {
                return Err(Error::ShapeMismatch {
                    field: "past.cu_seqlens".into(),
                    expected: format!(
                        "[b + 1] = [{}] (one entry per segment of cu_seqlens)",
                        cu_seqlens.len()
                    ),
                    actual: vec![past.cu_seqlens.len()],
                });
            }
            check_len(
                "past.layers",
                past.layers.len(),
                "num_layers",
                c.num_layers,
                "",
            )?;
            let want = [n_past, c.num_kv_heads, c.head_dim];
            for (l, (k, v)) in past.layers.iter().enumerate() {
                for (name, t) in [("k", k), ("v", v)] {
                    if t.shape() != want {
                        return Err(Error::ShapeMismatch {
                            field: format!("past.layers[{l}].{name}"),
                            expected: format!("[n_past, h_kv, d] = {want:?}"),
                            actual: t.shape().to_vec(),
                        });
                    }
                    check_finite(&format!("past.layers[{l}].{name}"), t.iter())?;
                }
            }
        }
        Ok(())
    }

    /// The forward pass: logits `[n, v]` and every intermediate.
    ///
    /// # Errors
    /// The config's and the parameters' ([`DecoderConfig::validate`],
    /// [`DecoderParams::check`]); [`Error::IndexOutOfRange`] (`input_ids`), [`Error::ShapeMismatch`]
    /// (`position_ids`, `allowed[r]`, `past.*`), the layout's
    /// [`Error::InvalidArgument`] (`cu_seqlens[i]`), the attention op's.
    pub fn forward(
        &self,
        op: &dyn AttentionOp,
        input: &DecoderInput<'_>,
    ) -> Result<DecoderForward> {
        self.check_input(input)?;
        let c = &self.config;
        let p = &self.params;
        let n = input.input_ids.len();
        let mut x = Array2::zeros((n, c.hidden_size));
        for (i, &id) in input.input_ids.iter().enumerate() {
            x.row_mut(i).assign(&p.embed.row(id as usize));
        }
        let mut layers = Vec::with_capacity(c.num_layers);
        for (l, lp) in p.layers.iter().enumerate() {
            let past = input
                .past
                .map(|kv| (kv.cu_seqlens.as_slice(), &kv.layers[l].0, &kv.layers[l].1));
            let (y, cache) = decoder_layer_forward(
                c,
                lp,
                op,
                x.view(),
                input.position_ids,
                input.attention,
                past,
            )?;
            layers.push(cache);
            x = y;
        }
        let (hidden, final_norm) = norm_forward(c, x.view(), &p.final_norm_g, &p.final_norm_b);
        let logits = linear_nb(hidden.view(), self.head());
        Ok(DecoderForward {
            logits,
            layers,
            last: x,
            final_norm,
            hidden,
        })
    }

    /// The backward pass from `grad_logits: [n, v]`.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] naming `grad_logits`; the attention op's.
    pub fn backward(
        &self,
        op: &dyn AttentionOp,
        input: &DecoderInput<'_>,
        fwd: &DecoderForward,
        grad_logits: ArrayView2<f64>,
    ) -> Result<DecoderGrads> {
        let c = &self.config;
        let p = &self.params;
        if grad_logits.dim() != fwd.logits.dim() {
            return Err(Error::ShapeMismatch {
                field: "grad_logits".into(),
                expected: format!("[n, v] = {:?}", fwd.logits.shape()),
                actual: grad_logits.shape().to_vec(),
            });
        }
        let mut g = p.zeros_like();
        let head_grad = if c.tie_embeddings {
            &mut g.embed
        } else {
            &mut g.lm_head
        };
        let dhidden = linear_nb_backward(
            fwd.hidden.view(),
            self.head(),
            grad_logits,
            head_grad.view_mut(),
        );
        let mut dx = norm_backward(
            &fwd.final_norm,
            &p.final_norm_g,
            dhidden.view(),
            (&mut g.final_norm_g, &mut g.final_norm_b),
        );
        let past_cu = input.past.map(|kv| kv.cu_seqlens.as_slice());
        let mut past_grads = input.past.map(|_| Vec::with_capacity(c.num_layers));
        for l in (0..c.num_layers).rev() {
            let (d, pg) = decoder_layer_backward(
                c,
                &p.layers[l],
                &mut g.layers[l],
                op,
                &fwd.layers[l],
                input.position_ids,
                input.attention,
                past_cu,
                dx.view(),
            )?;
            if let (Some(all), Some(pg)) = (past_grads.as_mut(), pg) {
                all.push(pg);
            }
            dx = d;
        }
        if let Some(all) = past_grads.as_mut() {
            all.reverse();
        }
        for (i, &id) in input.input_ids.iter().enumerate() {
            let mut row = g.embed.row_mut(id as usize);
            row += &dx.row(i);
        }
        Ok(DecoderGrads {
            params: g,
            grad_inputs_embeds: dx,
            past: past_grads,
        })
    }

    /// Forward, the weighted next-token loss
    /// `sum_i weights[i] * CE(logits_i, labels[i])` ([`token_cross_entropy`];
    /// `labels[i] == -100` predicts nothing), and the backward of it.
    ///
    /// # Errors
    /// Those of [`DecoderModel::forward`] and [`token_cross_entropy`];
    /// [`Error::ShapeMismatch`] naming `weights`; [`Error::NonFiniteInput`]
    /// for a non-finite weight.
    pub fn run(
        &self,
        op: &dyn AttentionOp,
        input: &DecoderInput<'_>,
        labels: &[i64],
        weights: &[f64],
    ) -> Result<DecoderRun> {
        let n = input.input_ids.len();
        check_len("weights", weights.len(), "n", n, "")?;
        check_finite("weights", weights)?;
        let fwd = self.forward(op, input)?;
        let (token_losses, grad) = token_cross_entropy(fwd.logits.view(), labels, weights)?;
        let loss = token_losses.iter().zip(weights).map(|(l, w)| l * w).sum();
        let grads = self.backward(op, input, &fwd, grad.view())?;
        Ok(DecoderRun {
            logits: fwd.logits,
            token_losses,
            loss,
            grads,
        })
    }
}

/// Cross-entropy of each row of `logits: [n, v]` against `labels: [n]`
/// (`-100` = no target: loss 0, no gradient), and the gradient of
/// `sum_i weights[i] * loss_i`: `weights[i] * (softmax(z_i) - onehot)`.
/// Returns `(loss: [n], grad_logits: [n, v])`, natural log.
///
/// # Errors
/// [`Error::ShapeMismatch`] naming `labels`; [`Error::IndexOutOfRange`]
/// naming `labels` and the index for a label outside `0..v` other than -100.
pub fn token_cross_entropy(
    logits: ArrayView2<f64>,
    labels: &[i64],
    weights: &[f64],
) -> Result<(Vec<f64>, Array2<f64>)> {
    let (n, v) = logits.dim();
    check_len("labels", labels.len(), "n", n, "rows of logits")?;
    let mut loss = vec![0.0; n];
    let mut grad = Array2::zeros((n, v));
    for (i, &t) in labels.iter().enumerate() {
        if t == IGNORE_INDEX {
            continue;
        }
        if t < 0 || t as u64 >= v as u64 {
            return Err(Error::out_of_range("labels", i, t, v));
        }
        let row = logits.row(i);
        let m = row.fold(f64::NEG_INFINITY, |a, &b| a.max(b));
        let lse = m + row.iter().map(|&z| (z - m).exp()).sum::<f64>().ln();
        loss[i] = lse - row[t as usize];
        let w = weights.get(i).copied().unwrap_or(0.0);
        let mut gr = grad.row_mut(i);
        for (j, &z) in row.iter().enumerate() {
            gr[j] = w * (z - lse).exp();
        }
        gr[t as usize] -= w;
    }
    Ok((loss, grad))
}
