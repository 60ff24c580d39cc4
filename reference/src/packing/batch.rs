//! Packed batches: model inputs built from token sequences and a packing plan.
//!
//! Conventions follow Hugging Face / flash-attention varlen usage:
//! `position_ids` restart at `position_offset` for every segment (RoBERTa-style
//! models use offset 2); `sequence_ids` number the segments of a pack from 1,
//! with 0 for padding; `cu_seqlens` are the cumulative segment lengths of a
//! pack with a leading 0 and **without** the padding (shape `[segments + 1]`).

use ndarray::Array2;

use super::{pack_lengths, PackingConfig, PackingPlan};
use crate::error::{Error, Result};

/// The most token slots (`num_packs * max_seq_len`) one batch may hold (2^24,
/// 400 MB of ids): a training batch, not a dataset.
pub const MAX_BATCH_SLOTS: usize = 1 << 24;

/// Bytes one token slot of a batch costs on the way through `packshard eval`:
/// the three `i64` id arrays (24 B), their JSON values and text, and the
/// parsed input. Measured: a 2^23-slot `batch` case peaked at 2.4 GB (~290 B
/// a slot); 320 leaves a margin. [`PackedBatch::new`] refuses a batch whose
/// slots times this exceed [`crate::limits::memory_budget`] before allocating.
pub const BATCH_BYTES_PER_SLOT: u64 = 320;

/// A packed batch. Shapes: `input_ids`, `position_ids`, `sequence_ids` are
/// `[num_packs, max_seq_len]`; `cu_seqlens[p]` is `[segments_in_pack_p + 1]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackedBatch {
    /// Tokens per pack.
    pub max_seq_len: usize,
    /// Token ids; padding slots hold the pad token id.
    pub input_ids: Array2<i64>,
    /// Position of each token within its own segment, plus the offset; 0 on padding.
    pub position_ids: Array2<i64>,
    /// 1-based segment number within the pack; 0 = padding.
    pub sequence_ids: Array2<i64>,
    /// Per pack: `[0, l_1, l_1 + l_2, ...]`, padding excluded.
    pub cu_seqlens: Vec<Vec<usize>>,
    /// The longest segment in the batch (flash-attention's `max_seqlen`).
    pub max_seqlen: usize,
    /// Per pack: the input sequence each segment came from.
    pub sequence_index: Vec<Vec<usize>>,
}

impl PackedBatch {
    /// Builds the batch of `sequences` laid out as `plan` says.
    ///
    /// # Errors
    /// [`Error::IndexOutOfRange`] (field `plan`) if a segment names a sequence
    /// or a token range that does not exist; [`Error::InvalidArgument`] if a
    /// pack holds more than `max_seq_len` tokens, (field `max_seq_len`) if
    /// the batch is over [`MAX_BATCH_SLOTS`] or its slots times
    /// [`BATCH_BYTES_PER_SLOT`] over the memory budget, or naming
    /// `position_offset` if it is negative or `position_offset + max_seq_len`
    /// overflows.
    pub fn new(
        sequences: &[Vec<i64>],
        plan: &PackingPlan,
        max_seq_len: usize,
        pad_token_id: i64,
        position_offset: i64,
    ) -> Result<Self> {
        // Position ids index a position-embedding table: a negative offset
        // (or one whose last position overflows i64) names no row.
        if position_offset < 0 || position_offset.checked_add(max_seq_len as i64).is_none() {
            return Err(Error::invalid(
                "position_offset",
                format!(
                    "{position_offset} must be at least 0 and leave room for {max_seq_len} positions below 2^63 (position ids index a position-embedding table)"
                ),
            ));
        }
        let num_packs = plan.packs.len();
        if num_packs.saturating_mul(max_seq_len) > MAX_BATCH_SLOTS {
            return Err(Error::invalid(
                "max_seq_len",
                format!("{num_packs} packs x {max_seq_len} tokens is over the {MAX_BATCH_SLOTS} token slots a batch may hold"),
            ));
        }
        crate::limits::check_memory(
            "max_seq_len",
            (num_packs as u64)
                .saturating_mul(max_seq_len as u64)
                .saturating_mul(BATCH_BYTES_PER_SLOT),
            &format!("a batch of {num_packs} packs x {max_seq_len} tokens"),
        )?;
        let mut input_ids = Array2::from_elem((num_packs, max_seq_len), pad_token_id);
        let mut position_ids = Array2::zeros((num_packs, max_seq_len));
        let mut sequence_ids = Array2::zeros((num_packs, max_seq_len));
        let mut cu_seqlens = Vec::with_capacity(num_packs);
        let mut sequence_index = Vec::with_capacity(num_packs);
        let mut max_seqlen = 0;
        for (p, pack) in plan.packs.iter().enumerate() {
            let mut cu = vec![0usize];
            let mut index = Vec::with_capacity(pack.len());
            let mut at = 0usize;
            for (k, seg) in pack.iter().enumerate() {
                let Some(tokens) = sequences.get(seg.sequence) else {
                    return Err(Error::out_of_range(
                        "plan",
                        p,
                        seg.sequence as i64,
                        sequences.len(),
                    ));
                };
                if seg.offset + seg.length > tokens.len() {
                    return Err(Error::out_of_range(
                        "plan",
                        p,
                        (seg.offset + seg.length) as i64,
                        tokens.len() + 1,
                    ));
                }
                if at + seg.length > max_seq_len {
                    return Err(Error::invalid(
                        "plan",
                        format!("pack {p} holds more than max_seq_len {max_seq_len} tokens"),
                    ));
                }
                for t in 0..seg.length {
                    input_ids[[p, at + t]] = tokens[seg.offset + t];
                    position_ids[[p, at + t]] = position_offset + t as i64;
                    sequence_ids[[p, at + t]] = k as i64 + 1;
                }
                at += seg.length;
                cu.push(at);
                index.push(seg.sequence);
                max_seqlen = max_seqlen.max(seg.length);
            }
            cu_seqlens.push(cu);
            sequence_index.push(index);
        }
        Ok(PackedBatch {
            max_seq_len,
            input_ids,
            position_ids,
            sequence_ids,
            cu_seqlens,
            max_seqlen,
            sequence_index,
        })
    }

    /// Packs `sequences` with `config` and builds the batch: the `batch` op of
    /// `packshard eval`.
    ///
    /// # Errors
    /// Those of [`pack_lengths`] and [`PackedBatch::new`].
    pub fn from_sequences(
        sequences: &[Vec<i64>],
        config: &PackingConfig,
        pad_token_id: i64,
        position_offset: i64,
    ) -> Result<(PackingPlan, PackedBatch)> {
        let lengths: Vec<usize> = sequences.iter().map(Vec::len).collect();
        let plan = pack_lengths(&lengths, config)?;
        let batch = PackedBatch::new(
            sequences,
            &plan,
            config.max_seq_len,
            pad_token_id,
            position_offset,
        )?;
        Ok((plan, batch))
    }

    /// Number of packs (rows).
    pub fn num_packs(&self) -> usize {
        self.input_ids.nrows()
    }

    /// The dense block-diagonal attention mask of pack `p` for the reference
    /// model: `[max_seq_len, max_seq_len]`, `mask[q, k]` true iff query `q` and
    /// key `k` are real tokens of the same segment. Padding rows and columns are
    /// all false (a padding query attends to nothing; its output is 0).
    pub fn attention_mask(&self, p: usize) -> Array2<bool> {
        let ids = self.sequence_ids.row(p);
        Array2::from_shape_fn((self.max_seq_len, self.max_seq_len), |(q, k)| {
            ids[q] != 0 && ids[q] == ids[k]
        })
    }

    /// `cu_seqlens` of the whole batch with the padding removed, the form
    /// `flash_attn_varlen_func` takes: `[total_segments + 1]`, offsets into the
    /// concatenation of all real tokens in pack order.
    pub fn flat_cu_seqlens(&self) -> Vec<usize> {
        let mut out = vec![0usize];
        for cu in &self.cu_seqlens {
            let base = *out.last().expect("starts with 0");
            out.extend(cu.iter().skip(1).map(|&c| base + c));
        }
        out
    }
}
