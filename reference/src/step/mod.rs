//! The training step across ranks (issue #34): gradient accumulation over
//! `G` microbatches, `D` data-parallel ranks and `C` context-parallel ranks
//! on packed documents, and its definition: **the step's loss is the mean
//! over the step's predicted tokens** (or documents, or rows, as the
//! [`CausalReduction`] declares), whatever the microbatching. Each token's
//! weight uses the *global* denominator of the step, so the sum of every
//! rank's and every microbatch's weighted loss is the loss of one unpacked
//! batch, and the sum of their gradients its gradient (Hugging Face's
//! `num_items_in_batch`, transformers PR 34191; Megatron's
//! `calculate_per_token_loss`).
//!
//! | module | what |
//! |---|---|
//! | [`partition`] | the load-balanced CP split of a packed (THD) batch, per rank: token indices, padded and real `cu_seqlens`, `position_ids`, labels shifted before the split |
//! | [`ring`] | ring attention: per-chunk partial results merged by log-sum-exp with the max rescale, and its backward |
//! | [`balance`] | each rank's attention work (allowed query-key pairs), load-balanced against contiguous |
//! | [`weights`] | the step's loss weights per microbatch, rank and slot, and the document assignment |
//! | [`run`] | the reference step (every rank of every microbatch in one process) and the one unpacked batch it must equal |
//!
//! The document assignment: the global batch's document `i` goes to
//! microbatch `m = i mod (G D)`, which is accumulation step `g = m / D` of
//! data-parallel rank `d = m mod D`; each microbatch is one pack (THD) split
//! over the `C` ranks. The contract and a picture: `docs/STEP.md`.

pub mod balance;
pub mod partition;
pub mod ring;
pub mod run;
pub mod weights;

pub use partition::{cp_partition, rank_meta, CpPartition, CpShare, TokenMeta};
pub use ring::RingAttention;
pub use run::{reference_step, unpacked_step, StepResult};
pub use weights::{microbatch_docs, step_weights, StepBatch};

use crate::decoder::CausalReduction;
use crate::error::{ensure_nonzero, Result};

/// The ranks and steps of one training step: `grad_accum` (`G`)
/// microbatches per data-parallel rank, `dp` (`D`) data-parallel ranks, `cp`
/// (`C`) context-parallel ranks per microbatch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Layout {
    /// `G`: gradient-accumulation steps.
    pub grad_accum: usize,
    /// `D`: data-parallel ranks.
    pub dp: usize,
    /// `C`: context-parallel ranks.
    pub cp: usize,
}

impl Layout {
    /// Microbatches of the step, `G D` (saturating: a layout beyond
    /// `usize` is refused by the document count, which must reach it).
    pub fn microbatches(&self) -> usize {
        self.grad_accum.saturating_mul(self.dp)
    }

    /// Checks every count is at least 1.
    ///
    /// # Errors
    /// [`crate::Error::InvalidArgument`] naming `grad_accum`, `dp` or `cp`.
    pub fn check(&self) -> Result<()> {
        ensure_nonzero(&[
            ("grad_accum", self.grad_accum),
            ("dp", self.dp),
            ("cp", self.cp),
        ])?;
        partition::check_cp(self.cp)
    }
}

/// A faulted variant of the step, for the negative controls
/// (docs/FAULTS.md D1..D8); the step takes `Option<StepFault>`, `None`
/// being the right one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StepFault {
    /// D1: each microbatch's mean over its own tokens, then averaged.
    D1MicrobatchMean,
    /// D2: each data-parallel rank's mean over its own tokens, then averaged.
    D2DpRankMean,
    /// D3: each document's real length rounded down to a multiple of `2 cp`.
    D3RoundDown,
    /// D4: the CP kernel's local boundaries from the unpadded `cu_seqlens`.
    D4UnpaddedBounds,
    /// D5: labels shifted on each rank's slots after the CP split.
    D5ShiftAfterSplit,
    /// D6: the ring merge without the max rescale.
    D6NoRescale,
    /// D7: the per-document loss taking each pack row for one sequence.
    D7PerRowSequence,
    /// D8: padding slots counted in the per-token denominator.
    D8PaddingCounted,
}

impl StepFault {
    /// All eight, in the order of docs/FAULTS.md.
    pub const ALL: [StepFault; 8] = [
        StepFault::D1MicrobatchMean,
        StepFault::D2DpRankMean,
        StepFault::D3RoundDown,
        StepFault::D4UnpaddedBounds,
        StepFault::D5ShiftAfterSplit,
        StepFault::D6NoRescale,
        StepFault::D7PerRowSequence,
        StepFault::D8PaddingCounted,
    ];

    /// `D1` .. `D8`: the heading in docs/FAULTS.md.
    pub fn id(self) -> &'static str {
        match self {
            StepFault::D1MicrobatchMean => "D1",
            StepFault::D2DpRankMean => "D2",
            StepFault::D3RoundDown => "D3",
            StepFault::D4UnpaddedBounds => "D4",
            StepFault::D5ShiftAfterSplit => "D5",
            StepFault::D6NoRescale => "D6",
            StepFault::D7PerRowSequence => "D7",
            StepFault::D8PaddingCounted => "D8",
        }
    }

    /// The reduction under which the fault shows (the loss faults are
    /// faults of one reduction; the others show under any).
    pub fn reduction(self) -> CausalReduction {
        match self {
            StepFault::D7PerRowSequence => CausalReduction::PerDocument,
            _ => CausalReduction::PerToken,
        }
    }
}

#[cfg(test)]
mod tests;
