//! The causal decoder as the pipeline's model (issue 35): the Llama-shaped
//! layers of [`packshard_reference::decoder`] (GQA, RoPE, SwiGLU, RMSNorm)
//! as the stages' layers, on packed documents.
//!
//! ```text
//! x_0    = embed[ids]                                   [n, hidden]  (input embedding, stage 0)
//! x_l    = decoder layer l (pre-norm, causal varlen attention per document, RoPE at each
//!          token's position in its document)            l = 1..L
//! h      = RMSNorm(x_L)                                 (final norm, the last stage)
//! logits = h W^T,  W = lm_head, or embed when tied      [n, v]  (output layer)
//! loss   = Σ_m (n_m / N) loss_m                          (the per-token mean over the step)
//! ```
//!
//! Labels are the next token inside each document, `-100` at a document's
//! last token (Hugging Face's `DataCollatorWithFlattening`); the step's loss
//! is the mean over its predicted tokens, the decoder's
//! [`CausalReduction::PerToken`] (the output layer's mean over a
//! microbatch's tokens times `n_m / N`, [`crate::model::microbatch_scales`]).
//! The other reductions (per document, per row) weigh tokens unequally and
//! the pipeline's output layer does not take per-token weights: not run.
//!
//! **Tied embeddings** (`tie_word_embeddings`): one weight serves the input
//! embedding and the output layer. Each use's rank holds a copy (stage 0's
//! and the last stage's in the baseline placement; under vocabulary
//! parallelism every rank's shard serves both) and the gradient is the sum
//! of both uses, all-reduced between stage 0 and the last stage after the
//! iteration (Megatron-LM's embedding group, `_allreduce_word_embedding_grads`),
//! or summed in place on each rank when vocabulary-parallel.
//!
//! The single-process reference ([`reference_step`]) is the reference
//! decoder's own forward, loss and backward ([`DecoderModel::run`]) on the
//! step's microbatches packed as one batch, with labels and loss weights
//! made from the documents by the decoder's packing ops
//! ([`next_token_labels`], [`loss_weights`]): nothing of the pipeline's
//! microbatching is shared with it.

use ndarray::Array2;
use packshard_reference::attention::{AttentionLayout, ReferenceAttention};
use packshard_reference::decoder::layer::{
    decoder_layer_backward, decoder_layer_forward, norm_backward, norm_forward, DecoderLayerCache,
    NormCache,
};
use packshard_reference::decoder::{
    loss_weights, next_token_labels, CausalReduction, DecoderAttention, DecoderConfig,
    DecoderInput, DecoderLayerParams, DecoderModel, DecoderParams,
};
use packshard_reference::{Error, Result};

use crate::model::{Microbatch, ModelConfig, IGNORE_INDEX};

/// The decoder shape of a pipeline [`ModelConfig`]: `heads` query heads over
/// `kv_heads` key/value heads, head dim `hidden / heads`, RMSNorm, SwiGLU,
/// rotary base 10000, the head tied to the embedding when `tied`.
///
/// # Errors
/// [`Error::InvalidArgument`] naming `heads` when `hidden` is not a
/// multiple of it; [`DecoderConfig::validate`]'s.
pub fn decoder_config(config: &ModelConfig, kv_heads: usize, tied: bool) -> Result<DecoderConfig> {
    if config.heads == 0 || !config.hidden.is_multiple_of(config.heads) {
        return Err(Error::invalid(
            "heads",
            format!(
                "{} does not divide hidden = {}",
                config.heads, config.hidden
            ),
        ));
    }
    let mut c = DecoderConfig::tiny(
        config.vocab,
        config.heads,
        kv_heads,
        config.hidden / config.heads,
        config.intermediate,
        config.layers,
    );
    c.tie_embeddings = tied;
    c.validate()?;
    Ok(c)
}

/// A stage of the decoder on one rank: its layers and, on the last stage,
/// the final norm.
#[derive(Debug, Clone, PartialEq)]
pub struct DecoderStage {
    /// The decoder's shape (every rank the same).
    pub config: DecoderConfig,
    /// This stage's contiguous layers.
    pub layers: Vec<DecoderLayerParams>,
    /// The last stage: the final norm's gain and bias (`[hidden]`, `[0]`
    /// under RMSNorm).
    pub final_norm: Option<(ndarray::Array1<f64>, ndarray::Array1<f64>)>,
}

impl DecoderStage {
    /// Zeros of the same shapes (a gradient).
    pub fn zeros_like(&self) -> Self {
        DecoderStage {
            config: self.config.clone(),
            layers: self
                .layers
                .iter()
                .map(DecoderLayerParams::zeros_like)
                .collect(),
            final_norm: self.final_norm.as_ref().map(|(g, b)| {
                (
                    ndarray::Array1::zeros(g.len()),
                    ndarray::Array1::zeros(b.len()),
                )
            }),
        }
    }
}

/// What a decoder stage keeps of microbatch `m` for its backward.
#[derive(Debug, Clone)]
pub struct StageCache {
    layers: Vec<DecoderLayerCache>,
    final_norm: Option<NormCache>,
}

/// The varlen layout of a microbatch as the decoder names it.
///
/// # Errors
/// [`Error::InvalidArgument`] naming `layout` for a dense layout.
pub fn attention(mb: &Microbatch) -> Result<DecoderAttention> {
    match &mb.layout {
        AttentionLayout::Varlen { cu_seqlens } => Ok(DecoderAttention::Varlen {
            cu_seqlens: cu_seqlens.clone(),
        }),
        _ => Err(Error::invalid(
            "layout",
            "the decoder pipeline runs packed (varlen) microbatches only",
        )),
    }
}

/// Forward of a stage: its layers on `x: [n, hidden]` (causal per document,
/// rotary at `mb.positions`), then the final norm on the last stage.
///
/// # Errors
/// The layers' ([`decoder_layer_forward`]): a bad `cu_seqlens`, shapes.
pub fn stage_forward(
    stage: &DecoderStage,
    mut x: Array2<f64>,
    mb: &Microbatch,
) -> Result<(Array2<f64>, StageCache)> {
    let att = attention(mb)?;
    let mut layers = Vec::with_capacity(stage.layers.len());
    for lp in &stage.layers {
        let (y, cache) = decoder_layer_forward(
            &stage.config,
            lp,
            &ReferenceAttention,
            x.view(),
            &mb.positions,
            &att,
            None,
        )?;
        layers.push(cache);
        x = y;
    }
    let mut final_norm = None;
    if let Some((g, b)) = &stage.final_norm {
        let (h, cache) = norm_forward(&stage.config, x.view(), g, b);
        final_norm = Some(cache);
        x = h;
    }
    Ok((x, StageCache { layers, final_norm }))
}

/// Backward of [`stage_forward`]: `dy: [n, hidden]` → `∂L/∂x`, adding the
/// parameter gradients to `grads`.
///
/// # Errors
/// As [`stage_forward`].
pub fn stage_backward(
    stage: &DecoderStage,
    grads: &mut DecoderStage,
    cache: &StageCache,
    mb: &Microbatch,
    mut dy: Array2<f64>,
) -> Result<Array2<f64>> {
    let att = attention(mb)?;
    if let (Some(nc), Some((g, _)), Some((gg, gb))) = (
        &cache.final_norm,
        &stage.final_norm,
        grads.final_norm.as_mut(),
    ) {
        dy = norm_backward(nc, g, dy.view(), (gg, gb));
    }
    for l in (0..stage.layers.len()).rev() {
        let (dx, _) = decoder_layer_backward(
            &stage.config,
            &stage.layers[l],
            &mut grads.layers[l],
            &ReferenceAttention,
            &cache.layers[l],
            &mb.positions,
            &att,
            None,
            dy.view(),
        )?;
        dy = dx;
    }
    Ok(dy)
}

/// Packed microbatches of whole documents: `docs` (token ids, each at least
/// one token) dealt in order, `per_microbatch` documents to a microbatch;
/// positions restart at 0 in each document; targets are the next token of
/// the same document, `-100` at its last.
///
/// # Errors
/// [`Error::InvalidArgument`] naming `docs` when there are none, an empty
/// document, or `per_microbatch` is 0.
pub fn document_microbatches(docs: &[Vec<i64>], per_microbatch: usize) -> Result<Vec<Microbatch>> {
    if docs.is_empty() || per_microbatch == 0 {
        return Err(Error::invalid(
            "docs",
            "no documents, or 0 documents per microbatch",
        ));
    }
    if let Some(i) = docs.iter().position(Vec::is_empty) {
        return Err(Error::invalid(format!("docs[{i}]"), "an empty document"));
    }
    Ok(docs
        .chunks(per_microbatch)
        .map(|chunk| {
            let mut mb = Microbatch {
                ids: Vec::new(),
                positions: Vec::new(),
                targets: Vec::new(),
                layout: AttentionLayout::Varlen {
                    cu_seqlens: vec![0],
                },
            };
            let mut cu = vec![0];
            for doc in chunk {
                for (t, &id) in doc.iter().enumerate() {
                    mb.ids.push(id);
                    mb.positions.push(t);
                    mb.targets
                        .push(doc.get(t + 1).copied().unwrap_or(IGNORE_INDEX));
                }
                cu.push(mb.ids.len());
            }
            mb.layout = AttentionLayout::Varlen { cu_seqlens: cu };
            mb
        })
        .collect())
}

/// The reference step's result.
#[derive(Debug, Clone, PartialEq)]
pub struct DecoderStepResult {
    /// The mean over the step's predicted tokens.
    pub loss: f64,
    /// Every parameter's gradient (the tied head's in `embed`).
    pub grads: DecoderParams,
}

/// The single-process reference (module docs): the microbatches' documents
/// packed as one batch, next-token labels and per-token loss weights from
/// the decoder's packing ops, one [`DecoderModel::run`].
///
/// # Errors
/// Layout errors (a microbatch that is not varlen, a bad `cu_seqlens`),
/// the decoder's.
pub fn reference_step(
    model: &DecoderModel,
    microbatches: &[Microbatch],
) -> Result<DecoderStepResult> {
    let mut ids = Vec::new();
    let mut positions = Vec::new();
    let mut doc_ids = Vec::new();
    let mut cu = vec![0];
    for mb in microbatches {
        let DecoderAttention::Varlen { cu_seqlens } = attention(mb)? else {
            unreachable!("attention() returns the varlen layout")
        };
        packshard_reference::attention::check_cu_seqlens(&cu_seqlens, mb.ids.len())?;
        for w in cu_seqlens.windows(2) {
            let doc = cu.len();
            for (t, i) in (w[0]..w[1]).enumerate() {
                ids.push(mb.ids[i]);
                positions.push(t);
                doc_ids.push(doc);
            }
            cu.push(ids.len());
        }
    }
    let labels = next_token_labels(&ids, &doc_ids, None)?;
    let weights = loss_weights(&labels, &doc_ids, CausalReduction::PerToken, cu.len() - 1)?;
    let att = DecoderAttention::Varlen { cu_seqlens: cu };
    let input = DecoderInput {
        input_ids: &ids,
        position_ids: &positions,
        attention: &att,
        past: None,
    };
    let run = model.run(&ReferenceAttention, &input, &labels, &weights)?;
    Ok(DecoderStepResult {
        loss: run.loss,
        grads: run.grads.params,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pipeline's stage functions over all layers on one rank, with the
    /// pipeline's per-microbatch loss and scaling, equal the reference
    /// decoder's one-batch step (the math the MPI test then splits).
    #[test]
    fn one_stage_of_every_layer_equals_the_reference_step() {
        let docs: Vec<Vec<i64>> = vec![
            vec![1, 5, 7, 2],
            vec![3, 3],
            vec![9],
            vec![4, 8, 10, 6, 2, 1],
            vec![0, 2, 4],
        ];
        let mbs = document_microbatches(&docs, 2).unwrap();
        assert_eq!(mbs.len(), 3);
        let mc = ModelConfig {
            vocab: 11,
            hidden: 8,
            heads: 2,
            layers: 2,
            intermediate: 12,
            seq_len: 6,
            sequences: 2,
            microbatches: 3,
            seed: 3,
        };
        let config = decoder_config(&mc, 1, false).unwrap();
        let model = DecoderModel::random(config.clone(), 3).unwrap();
        let reference = reference_step(&model, &mbs).unwrap();
        let p = &model.params;
        let stage = DecoderStage {
            config,
            layers: p.layers.clone(),
            final_norm: Some((p.final_norm_g.clone(), p.final_norm_b.clone())),
        };
        let mut g = stage.zeros_like();
        let mut g_head = Array2::<f64>::zeros(p.lm_head.dim());
        let mut g_embed = Array2::<f64>::zeros(p.embed.dim());
        let scales = crate::model::microbatch_scales(&mbs).unwrap();
        let mut loss = 0.0;
        // One stage holding every layer, the embedding before it and the
        // output layer after it: microbatch `mb`'s stage cache and loss.
        let run = |mb: &Microbatch, want_grad: bool| {
            let x0 =
                packshard_reference::vocab::embedding::embedding_forward(&mb.ids, p.embed.view())
                    .unwrap();
            let (h, cache) = stage_forward(&stage, x0, mb).unwrap();
            let out = packshard_reference::vocab::linear_cross_entropy(
                h.view(),
                p.lm_head.view(),
                &packshard_reference::vocab::LossCall::with_flag(
                    &mb.targets,
                    &mc.loss_config(),
                    want_grad,
                ),
            )
            .unwrap();
            (cache, out)
        };
        for (mb, &s) in mbs.iter().zip(&scales) {
            let (cache, out) = run(mb, true);
            loss += s * out.ce.loss;
            let (gx, gw) =
                crate::model::scaled_output_grads(out.grad_hidden, out.grad_weight, s).unwrap();
            g_head += &gw;
            let dx = stage_backward(&stage, &mut g, &cache, mb, gx).unwrap();
            crate::model::word_grad_accumulate(&mb.ids, 11, dx.view(), &mut g_embed, 0).unwrap();
        }
        let tol = crate::report::PIPELINE_TOLERANCE;
        let close = |a: &Array2<f64>, b: &Array2<f64>| {
            let scale = b.iter().fold(0.0f64, |m, x| m.max(x.abs()));
            let diff = (a - b).iter().fold(0.0f64, |m, x| m.max(x.abs()));
            assert!(scale > 0.0 && diff <= tol * scale, "{diff} vs {scale}");
        };
        assert!((loss - reference.loss).abs() <= tol * reference.loss.abs());
        close(&g_head, &reference.grads.lm_head);
        close(&g_embed, &reference.grads.embed);
        close(&g.layers[0].wq, &reference.grads.layers[0].wq);
        close(&g.layers[1].w_gate, &reference.grads.layers[1].w_gate);
        // Negative control: a document's label crossing into the next one
        // (fault C1) changes the loss.
        let mut bad = mbs.clone();
        bad[0].targets[3] = bad[0].ids[4];
        let mut l2 = 0.0;
        for (mb, &s) in bad
            .iter()
            .zip(&crate::model::microbatch_scales(&bad).unwrap())
        {
            l2 += s * run(mb, false).1.ce.loss;
        }
        assert!((l2 - reference.loss).abs() > 1e-6);
    }
}
