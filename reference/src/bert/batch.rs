//! One batch's layout, independent of how it was laid out: [`TokenBatch`]
//! (token slots, the attention layout over them, each sequence's slots), its
//! MLM/NSP [`Targets`] and the [`LossWeights`] of a reduction. The model
//! ([`super::model`]) runs one code path over any of them.

use ndarray::Array2;

use super::config::BertConfig;
use super::loss::{reduction_weights, Reduction, IGNORE_INDEX};
use crate::attention::AttentionLayout;
use crate::error::{Error, Result};
use crate::packing::batch::MAX_BATCH_SLOTS;
use crate::packing::PackedBatch;

/// The most mask entries (`rows * row_len^2`) a dense layout may hold (2^30).
pub const MAX_MASK_ENTRIES: usize = 1 << 30;

/// How the packed model runs attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PackedAttention {
    /// Padding removed, `cu_seqlens` over the real tokens (flash-attention's
    /// `flash_attn_varlen_func`).
    Varlen,
    /// Pack rows of `max_seq_len` with the block-diagonal mask of the packing
    /// paper (Krell et al. §4.1): a token attends to its own sequence only; a
    /// padding query attends to nothing (output 0, docs/FAULTS.md P8).
    BlockDiagonal,
}

/// One batch, independent of its layout. `n` = token slots.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenBatch {
    /// `[n]` token ids (padding slots hold the pad id).
    pub input_ids: Vec<usize>,
    /// `[n]` position ids.
    pub position_ids: Vec<usize>,
    /// `[n]` token type (segment) ids.
    pub token_type_ids: Vec<usize>,
    /// How attention sees the slots.
    pub layout: AttentionLayout,
    /// For each input sequence, the slots of its tokens in order (empty for
    /// an empty sequence).
    pub sequences: Vec<Vec<usize>>,
}

pub(super) fn to_index(v: i64, field: &str, index: usize, hi: usize) -> Result<usize> {
    if v < 0 || v as u64 >= hi as u64 {
        return Err(Error::IndexOutOfRange {
            field: field.into(),
            index,
            value: v,
            lo: 0,
            hi: hi as i64,
        });
    }
    Ok(v as usize)
}

fn token_type(types: Option<&[Vec<i64>]>, s: usize, t: usize) -> Result<i64> {
    match types {
        None => Ok(0),
        Some(tt) => tt
            .get(s)
            .and_then(|row| row.get(t))
            .copied()
            .ok_or_else(|| Error::ShapeMismatch {
                field: format!("token_type_ids[{s}]"),
                expected: "one token type per token of the sequence".into(),
                actual: vec![tt.get(s).map_or(0, Vec::len)],
            }),
    }
}

impl TokenBatch {
    /// Tokens of the batch (slots, padding included).
    pub fn num_tokens(&self) -> usize {
        self.input_ids.len()
    }

    /// The padded batch of Hugging Face `BertModel`: sequence `s` in row `s`
    /// of `row_len` slots, padded with `pad_token_id`; positions
    /// `position_offset + 0..row_len` in every row (padding included, as
    /// `position_ids = arange`); the attention mask hides padding keys
    /// (`allowed[i][j] = j < len`), so a padding query still attends to its
    /// row's real tokens and every query of an empty sequence attends to
    /// nothing. `token_type_ids` (per sequence, per token) default to 0.
    ///
    /// # Errors
    /// [`Error::SequenceTooLong`] for a sequence over `row_len`;
    /// [`Error::InvalidArgument`] for a batch over [`MAX_BATCH_SLOTS`] slots
    /// or [`MAX_MASK_ENTRIES`] mask entries; [`Error::IndexOutOfRange`] for a
    /// negative id or position.
    pub fn padded(
        sequences: &[Vec<i64>],
        token_type_ids: Option<&[Vec<i64>]>,
        row_len: usize,
        pad_token_id: usize,
        position_offset: usize,
    ) -> Result<Self> {
        let b = sequences.len();
        let n = b.saturating_mul(row_len);
        if n > MAX_BATCH_SLOTS || n.saturating_mul(row_len) > MAX_MASK_ENTRIES {
            return Err(Error::invalid(
                "sequences",
                format!("{b} rows of {row_len} tokens is over the supported batch size"),
            ));
        }
        dense_bytes_check(b, row_len)?;
        let mut batch = TokenBatch {
            input_ids: Vec::with_capacity(n),
            position_ids: Vec::with_capacity(n),
            token_type_ids: Vec::with_capacity(n),
            layout: AttentionLayout::Dense {
                row_len,
                allowed: Vec::with_capacity(b),
            },
            sequences: Vec::with_capacity(b),
        };
        let AttentionLayout::Dense { allowed, .. } = &mut batch.layout else {
            unreachable!()
        };
        for (s, seq) in sequences.iter().enumerate() {
            if seq.len() > row_len {
                return Err(Error::too_long("sequences", s, seq.len(), row_len));
            }
            for t in 0..row_len {
                let (id, ty) = match seq.get(t) {
                    Some(&id) => (
                        to_index(id, &format!("sequences[{s}]"), t, usize::MAX)?,
                        to_index(
                            token_type(token_type_ids, s, t)?,
                            &format!("token_type_ids[{s}]"),
                            t,
                            usize::MAX,
                        )?,
                    ),
                    None => (pad_token_id, 0),
                };
                batch.input_ids.push(id);
                batch.token_type_ids.push(ty);
                batch.position_ids.push(position_offset + t);
            }
            let len = seq.len();
            allowed.push(Array2::from_shape_fn((row_len, row_len), |(_, j)| j < len));
            batch
                .sequences
                .push((s * row_len..s * row_len + len).collect());
        }
        Ok(batch)
    }

    /// The packed batch of [`PackedBatch`] for `num_sequences` input
    /// sequences (empty ones, never packed, get no slots). Ids and positions
    /// are the batch's own (`position_ids` restart per sequence, with the
    /// batch's offset); `token_type_ids` are per input sequence (default 0).
    ///
    /// With [`PackedAttention::Varlen`] the slots are the real tokens in pack
    /// order and the layout is `cu_seqlens` = [`PackedBatch::flat_cu_seqlens`];
    /// with [`PackedAttention::BlockDiagonal`] the slots are the
    /// `[num_packs, max_seq_len]` grid and each pack has
    /// [`PackedBatch::attention_mask`].
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] (field `sequence_index`) if a sequence is in
    /// more than one segment (split: BERT needs whole sequences) or a
    /// segment names a sequence `>= num_sequences`; [`Error::IndexOutOfRange`]
    /// for negative ids or positions.
    pub fn packed(
        batch: &PackedBatch,
        num_sequences: usize,
        token_type_ids: Option<&[Vec<i64>]>,
        attention: PackedAttention,
    ) -> Result<Self> {
        let msl = batch.max_seq_len;
        let num_packs = batch.num_packs();
        if num_packs.saturating_mul(msl).saturating_mul(msl) > MAX_MASK_ENTRIES
            && attention == PackedAttention::BlockDiagonal
        {
            return Err(Error::invalid(
                "max_seq_len",
                format!("{num_packs} packs of {msl} tokens is over the supported mask size"),
            ));
        }
        if attention == PackedAttention::BlockDiagonal {
            dense_bytes_check(num_packs, msl)?;
        }
        let mut out = TokenBatch {
            input_ids: Vec::new(),
            position_ids: Vec::new(),
            token_type_ids: Vec::new(),
            layout: match attention {
                PackedAttention::Varlen => AttentionLayout::Varlen {
                    cu_seqlens: batch.flat_cu_seqlens(),
                },
                PackedAttention::BlockDiagonal => AttentionLayout::Dense {
                    row_len: msl,
                    allowed: (0..num_packs).map(|p| batch.attention_mask(p)).collect(),
                },
            },
            sequences: vec![Vec::new(); num_sequences],
        };
        let mut placed = vec![false; num_sequences];
        for p in 0..num_packs {
            let cu = &batch.cu_seqlens[p];
            let real = cu.last().copied().unwrap_or(0);
            let cols = match attention {
                PackedAttention::Varlen => real,
                PackedAttention::BlockDiagonal => msl,
            };
            let base = out.input_ids.len();
            for c in 0..cols {
                let id = batch.input_ids[[p, c]];
                let pos = batch.position_ids[[p, c]];
                out.input_ids
                    .push(to_index(id, &format!("input_ids[{p}]"), c, usize::MAX)?);
                out.position_ids
                    .push(to_index(pos, &format!("position_ids[{p}]"), c, usize::MAX)?);
                out.token_type_ids.push(0);
            }
            for (k, w) in cu.windows(2).enumerate() {
                let s = batch.sequence_index[p][k];
                if s >= num_sequences || placed[s] {
                    return Err(Error::invalid(
                        format!("sequence_index[{p}][{k}]"),
                        format!(
                            "sequence {s} is out of range or in more than one segment (BERT needs whole sequences; pack with overlong = error)"
                        ),
                    ));
                }
                placed[s] = true;
                for (t, c) in (w[0]..w[1]).enumerate() {
                    out.token_type_ids[base + c] = to_index(
                        token_type(token_type_ids, s, t)?,
                        &format!("token_type_ids[{s}]"),
                        t,
                        usize::MAX,
                    )?;
                }
                out.sequences[s] = (base + w[0]..base + w[1]).collect();
            }
        }
        Ok(out)
    }

    /// Checks every id against `config` and the layout against the slots.
    ///
    /// # Errors
    /// [`Error::IndexOutOfRange`] naming `input_ids`, `position_ids` or
    /// `token_type_ids` and the slot; [`Error::ShapeMismatch`] for a layout or
    /// sequence slots that do not fit.
    pub fn validate(&self, config: &BertConfig) -> Result<()> {
        let n = self.num_tokens();
        for (field, values, hi) in [
            ("input_ids", &self.input_ids, config.vocab_size),
            (
                "position_ids",
                &self.position_ids,
                config.max_position_embeddings,
            ),
            (
                "token_type_ids",
                &self.token_type_ids,
                config.type_vocab_size,
            ),
        ] {
            if values.len() != n {
                return Err(Error::ShapeMismatch {
                    field: field.into(),
                    expected: format!("[n] = [{n}]"),
                    actual: vec![values.len()],
                });
            }
            if let Some(i) = values.iter().position(|&v| v >= hi) {
                return Err(Error::out_of_range(field, i, values[i] as i64, hi));
            }
        }
        if self.layout.num_tokens() != n {
            return Err(Error::ShapeMismatch {
                field: "layout".into(),
                expected: format!("{n} tokens"),
                actual: vec![self.layout.num_tokens()],
            });
        }
        if let AttentionLayout::Dense { row_len, allowed } = &self.layout {
            if let Some(r) = allowed.iter().position(|m| m.dim() != (*row_len, *row_len)) {
                return Err(Error::ShapeMismatch {
                    field: format!("mask[{r}]"),
                    expected: format!("[{row_len}, {row_len}]"),
                    actual: allowed[r].shape().to_vec(),
                });
            }
        }
        for (s, slots) in self.sequences.iter().enumerate() {
            if let Some(&bad) = slots.iter().find(|&&i| i >= n) {
                return Err(Error::IndexOutOfRange {
                    field: format!("sequences[{s}]"),
                    index: 0,
                    value: bad as i64,
                    lo: 0,
                    hi: n as i64,
                });
            }
        }
        Ok(())
    }
}

/// Checks a dense layout's `rows x row_len^2` mask bytes and its slots'
/// ids, positions and types (3 x 8 bytes each) against the memory budget
/// before any is allocated.
///
/// # Errors
/// [`Error::InvalidArgument`] naming `sequences`.
fn dense_bytes_check(rows: usize, row_len: usize) -> Result<()> {
    let slots = (rows as u64).checked_mul(row_len as u64);
    let bytes = crate::limits::total(&[
        slots.and_then(|s| s.checked_mul(row_len as u64)),
        slots.and_then(|s| s.checked_mul(24)),
    ]);
    crate::limits::check_estimate(
        "sequences",
        bytes,
        &format!("{rows} rows of {row_len} slots with their [row_len, row_len] masks"),
    )
}

/// Pre-training targets, per input sequence.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Targets {
    /// Per sequence, one label per token: the original token id to predict at
    /// a masked position, [`IGNORE_INDEX`] (-100) elsewhere (HF convention).
    pub mlm_labels: Vec<Vec<i64>>,
    /// Per sequence: 0 (is next) / 1 (random), or -100 for none. An empty
    /// sequence has no CLS token and must be -100.
    pub nsp_labels: Vec<i64>,
}

impl Targets {
    /// Number of predicted (MLM) tokens of each sequence.
    pub fn mlm_counts(&self) -> Vec<usize> {
        self.mlm_labels
            .iter()
            .map(|l| l.iter().filter(|&&t| t != IGNORE_INDEX).count())
            .collect()
    }
}

/// The weight of every loss term: `loss = sum mlm[s][t] * ce(s, t) + sum nsp[s] * ce_nsp(s)`.
#[derive(Debug, Clone, PartialEq)]
pub struct LossWeights {
    /// Per sequence, per token (0 where not predicted).
    pub mlm: Vec<Vec<f64>>,
    /// Per sequence (0 where there is no NSP label).
    pub nsp: Vec<f64>,
}

impl LossWeights {
    /// The weights of `reduction` for the MLM loss and the mean over labelled
    /// sequences for the NSP loss. They depend on the sequences only, never on
    /// the layout (docs/FAULTS.md P7).
    pub fn new(targets: &Targets, reduction: Reduction) -> Self {
        let per_seq = reduction_weights(&targets.mlm_counts(), reduction);
        let mlm = targets
            .mlm_labels
            .iter()
            .zip(&per_seq)
            .map(|(labels, &w)| {
                labels
                    .iter()
                    .map(|&l| if l == IGNORE_INDEX { 0.0 } else { w })
                    .collect()
            })
            .collect();
        let labelled = targets
            .nsp_labels
            .iter()
            .filter(|&&l| l != IGNORE_INDEX)
            .count();
        let nsp = targets
            .nsp_labels
            .iter()
            .map(|&l| {
                if l == IGNORE_INDEX {
                    0.0
                } else {
                    1.0 / labelled as f64
                }
            })
            .collect();
        LossWeights { mlm, nsp }
    }
}
