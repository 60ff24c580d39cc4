//! The step's loss weights: each predicted token's weight from the
//! **global** counts of the step (all microbatches, all ranks), so that the
//! weighted sums of the ranks and microbatches add up to the loss of the one
//! unpacked batch:
//!
//! | reduction | weight of a predicted token of document `j` |
//! |---|---|
//! | per token | `1 / M`, `M` the step's predicted tokens |
//! | per document | `1 / (D_any m_j)`, `m_j` document `j`'s predicted tokens, `D_any` the documents that predict any |
//! | per row | `1 / R`, `R` the step's documents (one unpacked row each) |
//!
//! These are [`crate::decoder::loss_weights`]' rules over the whole step.
//! A slot that predicts nothing (padding, a document's last token without
//! EOS) weighs 0.

use super::partition::{cp_partition, CpPartition};
use super::{Layout, StepFault};
use crate::decoder::CausalReduction;
use crate::error::{ensure, Result};
use crate::vocab::IGNORE_INDEX;

/// The global batch of one step.
#[derive(Debug, Clone, PartialEq)]
pub struct StepBatch {
    /// `docs[j]`: document `j`'s token ids.
    pub docs: Vec<Vec<i64>>,
    /// The target of each document's last token (else `-100`).
    pub eos: Option<i64>,
    /// How the loss is normalised.
    pub reduction: CausalReduction,
}

/// One microbatch of the step: accumulation step `g` of data-parallel rank
/// `d`, its documents (indices into the batch), their CP split and the loss
/// weights of every rank's slots.
#[derive(Debug, Clone, PartialEq)]
pub struct Microbatch {
    /// The accumulation step, `0..G`.
    pub g: usize,
    /// The data-parallel rank, `0..D`.
    pub d: usize,
    /// The batch's documents in this microbatch, in pack order.
    pub docs: Vec<usize>,
    /// The pack split over the CP ranks.
    pub partition: CpPartition,
    /// Per CP rank, `[n_local]`: each slot's loss weight.
    pub weights: Vec<Vec<f64>>,
}

/// The documents of each microbatch: document `i` goes to microbatch `i
/// mod (G D)`; microbatch `m` is accumulation step `m / D` of data-parallel
/// rank `m mod D`.
///
/// # Errors
/// [`crate::Error::InvalidArgument`] naming `docs` when the batch has fewer
/// documents than microbatches; the layout's.
pub fn microbatch_docs(layout: &Layout, num_docs: usize) -> Result<Vec<Vec<usize>>> {
    layout.check()?;
    let mbs = layout.microbatches();
    ensure(num_docs >= mbs, "docs", || {
        format!("{num_docs} documents for {mbs} microbatches (G D): each needs one")
    })?;
    let mut out = vec![Vec::new(); mbs];
    for i in 0..num_docs {
        out[i % mbs].push(i);
    }
    Ok(out)
}

/// Splits the step (documents, CP partition) and weighs every slot (see the
/// module docs). `fault` selects a faulted variant (docs/FAULTS.md D1, D2,
/// D7, D8 change the weights; D3, D5 the partition).
///
/// # Errors
/// [`microbatch_docs`]'s and [`cp_partition`]'s.
pub fn step_weights(
    batch: &StepBatch,
    layout: &Layout,
    fault: Option<StepFault>,
) -> Result<Vec<Microbatch>> {
    let assignment = microbatch_docs(layout, batch.docs.len())?;
    let mut mbs = Vec::with_capacity(assignment.len());
    for (m, docs) in assignment.into_iter().enumerate() {
        let texts: Vec<Vec<i64>> = docs.iter().map(|&j| batch.docs[j].clone()).collect();
        let partition = cp_partition(&texts, layout.cp, batch.eos, fault)?;
        mbs.push(Microbatch {
            g: m / layout.dp,
            d: m % layout.dp,
            docs,
            partition,
            weights: Vec::new(),
        });
    }
    // The global counts, from the labels the split produced.
    let mut per_doc = vec![0usize; batch.docs.len()];
    let mut per_mb = vec![0usize; mbs.len()];
    let mut per_dp = vec![0usize; layout.dp];
    let mut slots = 0usize;
    for (m, mb) in mbs.iter().enumerate() {
        for share in &mb.partition.ranks {
            slots += share.labels.len();
            for (&l, &j) in share.labels.iter().zip(&share.doc) {
                if l != IGNORE_INDEX {
                    per_doc[mb.docs[j]] += 1;
                    per_mb[m] += 1;
                    per_dp[mb.d] += 1;
                }
            }
        }
    }
    let total: usize = per_doc.iter().sum();
    let with_any = per_doc.iter().filter(|&&c| c > 0).count();
    let rows_with_any = per_mb.iter().filter(|&&c| c > 0).count();
    let num_docs = batch.docs.len();
    let (g_d, dp) = (layout.microbatches() as f64, layout.dp as f64);
    for (m, mb) in mbs.iter_mut().enumerate() {
        mb.weights = mb
            .partition
            .ranks
            .iter()
            .map(|share| {
                share
                    .labels
                    .iter()
                    .zip(&share.doc)
                    .map(|(&l, &j)| {
                        if l == IGNORE_INDEX {
                            return 0.0;
                        }
                        let doc = mb.docs[j];
                        match (batch.reduction, fault) {
                            (CausalReduction::PerToken, Some(StepFault::D1MicrobatchMean)) => {
                                1.0 / (g_d * per_mb[m] as f64)
                            }
                            (CausalReduction::PerToken, Some(StepFault::D2DpRankMean)) => {
                                1.0 / (dp * per_dp[mb.d] as f64)
                            }
                            (CausalReduction::PerToken, Some(StepFault::D8PaddingCounted)) => {
                                1.0 / slots as f64
                            }
                            (CausalReduction::PerToken, _) => 1.0 / total as f64,
                            (CausalReduction::PerDocument, Some(StepFault::D7PerRowSequence)) => {
                                1.0 / (rows_with_any * per_mb[m]) as f64
                            }
                            (CausalReduction::PerDocument, _) => {
                                1.0 / (with_any * per_doc[doc]) as f64
                            }
                            (CausalReduction::PerRow, _) => 1.0 / num_docs as f64,
                        }
                    })
                    .collect()
            })
            .collect();
    }
    Ok(mbs)
}
