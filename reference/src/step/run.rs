//! The reference step and the one unpacked batch it must equal.
//!
//! [`reference_step`] runs every microbatch of the step as its `C` CP ranks
//! would: each rank's slots (token ids, positions, labels shifted before
//! the split, global-denominator weights) through the f64 decoder, the
//! attention a [`RingAttention`] over the ranks; the ranks' slots are
//! concatenated in one call (every op but attention is row-wise, so this is
//! each rank's own computation), and the loss and the parameter gradients
//! are summed over the microbatches (the data-parallel all-reduce and the
//! accumulation). [`unpacked_step`] is the definition: the whole global
//! batch as one padded batch, one document per row, under
//! [`crate::decoder::loss_weights`].

use super::partition::rank_meta;
use super::ring::RingAttention;
use super::weights::{step_weights, StepBatch};
use super::{Layout, StepFault};
use crate::attention::ReferenceAttention;
use crate::decoder::{
    loss_weights, next_token_labels, DecoderAttention, DecoderInput, DecoderModel, DecoderParams,
};
use crate::error::Result;

/// What a step computes.
#[derive(Debug, Clone, PartialEq)]
pub struct StepResult {
    /// The step's loss (weighted sum over every slot of every microbatch).
    pub loss: f64,
    /// `token_losses[j]: [len_j]`: each token's cross-entropy against its
    /// target (0 where it predicts nothing).
    pub token_losses: Vec<Vec<f64>>,
    /// The gradient of the loss, summed over ranks and microbatches.
    pub grads: DecoderParams,
}

/// Adds every tensor of `b` into `a`.
pub fn add_grads(a: &mut DecoderParams, b: &DecoderParams) {
    for ((_, mut x), (_, y)) in a.named_mut().into_iter().zip(b.named()) {
        x += &y;
    }
}

/// The step as the ranks run it (module docs); `fault` selects a faulted
/// variant (docs/FAULTS.md D1..D8), `None` the right one.
///
/// # Errors
/// [`step_weights`]' and the decoder's.
pub fn reference_step(
    model: &DecoderModel,
    batch: &StepBatch,
    layout: &Layout,
    fault: Option<StepFault>,
) -> Result<StepResult> {
    let mbs = step_weights(batch, layout, fault)?;
    let mut token_losses: Vec<Vec<f64>> = batch.docs.iter().map(|d| vec![0.0; d.len()]).collect();
    let mut grads = model.params.zeros_like();
    let mut loss = 0.0;
    for mb in &mbs {
        let part = &mb.partition;
        let (mut ids, mut pos, mut labels, mut weights) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut cu = vec![0];
        let mut metas = Vec::with_capacity(part.cp);
        for (share, w) in part.ranks.iter().zip(&mb.weights) {
            let base = ids.len();
            ids.extend_from_slice(&share.input_ids);
            pos.extend_from_slice(&share.position_ids);
            labels.extend_from_slice(&share.labels);
            weights.extend_from_slice(w);
            cu.extend(share.cu_seqlens_padded[1..].iter().map(|c| base + c));
            metas.push(rank_meta(
                share.rank,
                part.cp,
                &part.cu_seqlens,
                &part.cu_seqlens_padded,
                fault,
            )?);
        }
        let op = RingAttention {
            ranks: metas,
            rescale: fault != Some(StepFault::D6NoRescale),
        };
        let attention = DecoderAttention::Varlen { cu_seqlens: cu };
        let input = DecoderInput {
            input_ids: &ids,
            position_ids: &pos,
            attention: &attention,
            past: None,
        };
        let run = model.run(&op, &input, &labels, &weights)?;
        loss += run.loss;
        add_grads(&mut grads, &run.grads.params);
        let mut t = 0;
        for share in &part.ranks {
            for ((&j, &p), &real) in share.doc.iter().zip(&share.position_ids).zip(&share.real) {
                if real {
                    token_losses[mb.docs[j]][p] = run.token_losses[t];
                }
                t += 1;
            }
        }
    }
    Ok(StepResult {
        loss,
        token_losses,
        grads,
    })
}

/// The definition: the global batch as one padded batch, one document per
/// row (right padding, Hugging Face's causal LM with `attention_mask`),
/// weights from [`loss_weights`] under the batch's reduction.
///
/// # Errors
/// The labels', the weights' and the decoder's.
pub fn unpacked_step(model: &DecoderModel, batch: &StepBatch) -> Result<StepResult> {
    let lengths: Vec<usize> = batch.docs.iter().map(Vec::len).collect();
    let row_len = lengths.iter().copied().max().unwrap_or(0).max(1);
    let (mut ids, mut doc_ids, mut pos) = (Vec::new(), Vec::new(), Vec::new());
    for (j, d) in batch.docs.iter().enumerate() {
        for p in 0..row_len {
            ids.push(d.get(p).copied().unwrap_or(0));
            doc_ids.push(if p < d.len() { j + 1 } else { 0 });
            pos.push(p);
        }
    }
    let labels = next_token_labels(&ids, &doc_ids, batch.eos)?;
    let weights = loss_weights(&labels, &doc_ids, batch.reduction, batch.docs.len())?;
    let attention = DecoderAttention::padded_rows(&lengths, row_len);
    let input = DecoderInput {
        input_ids: &ids,
        position_ids: &pos,
        attention: &attention,
        past: None,
    };
    let run = model.run(&ReferenceAttention, &input, &labels, &weights)?;
    let token_losses = batch
        .docs
        .iter()
        .enumerate()
        .map(|(j, d)| run.token_losses[j * row_len..j * row_len + d.len()].to_vec())
        .collect();
    Ok(StepResult {
        loss: run.loss,
        token_losses,
        grads: run.grads.params,
    })
}
