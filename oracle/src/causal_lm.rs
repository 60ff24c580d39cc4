//! The decoder with every layer in f32 as a [`CausalLmImpl`] (the
//! registry's `causal_lm_f32_layers`): labels, loss weights and boundaries
//! from the reference's causal packing ops, the training step through
//! `packshard_optimized::decoder_model::decoder_run_f32`.

use ndarray::Array2;
use packshard_equivalence::causal::{scatter_logits, CausalBatch, CausalLmImpl, CausalRun};
use packshard_optimized::decoder_model::decoder_run_f32;
use packshard_reference::decoder::{
    loss_weights, next_token_labels, varlen_from_doc_ids, CausalReduction, DecoderAttention,
    DecoderConfig, DecoderInput, DecoderModel, KvCache, Mlp, Norm,
};
use packshard_reference::{Error, Result};

/// One varlen batch for the decoder, holding its layout: `input_ids`,
/// `position_ids: [n]`, the documents back to back at `cu_seqlens: [b + 1]`,
/// no key/value cache.
#[derive(Debug, Clone)]
pub struct VarlenInput<'a> {
    input_ids: &'a [i64],
    position_ids: &'a [usize],
    attention: DecoderAttention,
}

impl<'a> VarlenInput<'a> {
    /// The batch of these tokens (`[n]` each) and boundaries (`[b + 1]`).
    pub fn new(input_ids: &'a [i64], position_ids: &'a [usize], cu_seqlens: &[usize]) -> Self {
        VarlenInput {
            input_ids,
            position_ids,
            attention: DecoderAttention::Varlen {
                cu_seqlens: cu_seqlens.to_vec(),
            },
        }
    }

    /// The [`DecoderInput`] `DecoderModel::forward` and `run` take.
    pub fn input(&self) -> DecoderInput<'_> {
        DecoderInput {
            input_ids: self.input_ids,
            position_ids: self.position_ids,
            attention: &self.attention,
            past: None,
        }
    }
}

/// The f32-layer decoder (see the module docs). Llama configurations only
/// ([`CausalLmImpl::supports`]); no key/value cache.
#[derive(Debug, Clone, Copy, Default)]
pub struct F32LayersCausalLm;

/// Runs the f32-layer decoder on `batch` with per-slot `labels` and
/// `weights` (`[n_slots]` each) given: the real slots and boundaries from
/// the document ids, each slot at its own position; logits scattered back
/// to `[n_slots, v]`.
///
/// # Errors
/// The packing ops' and `decoder_run_f32`'s.
pub fn run_f32_layers(
    model: &DecoderModel,
    batch: &CausalBatch,
    labels: &[i64],
    weights: &[f64],
) -> Result<CausalRun> {
    let (slots, cu) = varlen_from_doc_ids(&batch.doc_ids)?;
    let ids: Vec<i64> = slots.iter().map(|&s| batch.input_ids[s]).collect();
    let pos: Vec<usize> = slots.iter().map(|&s| batch.position_ids[s]).collect();
    let lab: Vec<i64> = slots.iter().map(|&s| labels[s]).collect();
    let w: Vec<f64> = slots.iter().map(|&s| weights[s]).collect();
    let r = decoder_run_f32(model, &ids, &pos, &cu, (&lab, &w))?;
    Ok(CausalRun {
        logits: scatter_logits(batch, &slots, &r.logits),
        loss: r.loss,
        grads: r.grads,
    })
}

impl CausalLmImpl for F32LayersCausalLm {
    fn name(&self) -> String {
        "causal_lm_f32_layers".into()
    }

    fn run(
        &self,
        model: &DecoderModel,
        batch: &CausalBatch,
        reduction: CausalReduction,
    ) -> Result<CausalRun> {
        let labels = next_token_labels(&batch.input_ids, &batch.doc_ids, batch.eos)?;
        let weights = loss_weights(&labels, &batch.doc_ids, reduction, batch.num_documents)?;
        run_f32_layers(model, batch, &labels, &weights)
    }

    fn chunk_logits(&self, _: &DecoderModel, _: &CausalBatch, _: &KvCache) -> Result<Array2<f64>> {
        Err(Error::invalid(
            "past",
            "the f32 decoder layers take no key/value cache",
        ))
    }

    fn supports(&self, config: &DecoderConfig) -> bool {
        config.norm == Norm::RmsNorm && config.mlp == Mlp::SwiGlu
    }
}
