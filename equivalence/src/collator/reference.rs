//! Correct collators: the positive controls of [`super::check_collator`] and
//! the base the planted faults ([`super::faults`]) break.

use ndarray::{Array2, Array4};
use packshard_reference::packing::{pack_lengths, Algorithm, Overlong, PackingConfig};

use super::faults::RowFault;
use super::{Collated, Collator, CuSeqlens, Feature, LabelForm, Mask, HF_IGNORE};

/// The target of token `t` of `f` before any shift: the feature's label
/// (`-100` read as `ignore`), else its next token; `None` past the end.
fn target(f: &Feature, t: usize, ignore: i64) -> Option<i64> {
    let next = *f.input_ids.get(t + 1)?;
    Some(match &f.labels {
        Some(l) if l[t + 1] == HF_IGNORE => ignore,
        Some(l) => l[t + 1],
        None => next,
    })
}

/// Shifted targets `[n]` into the unshifted form: slot `c + 1` holds slot
/// `c`'s target, slot 0 `first`.
pub(super) fn unshift(shifted: &[i64], first: i64) -> Vec<i64> {
    let mut out = vec![first];
    out.extend_from_slice(&shifted[..shifted.len().saturating_sub(1)]);
    out.truncate(shifted.len());
    out
}

/// Which 4D mask [`Flattening`] builds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MaskForm {
    /// `bool`, true: attend.
    Block,
    /// 0 / `f64::MIN` (Hugging Face's `torch.finfo(dtype).min`).
    Additive,
}

/// Hugging Face's `DataCollatorWithFlattening` (transformers 5.x) with
/// `return_flash_attn_kwargs` and `return_seq_idx`, right where it is not
/// (a continuation chunk keeps its positions, C6): every feature into one
/// row `[1, n]` in order, `position_ids` per document, `labels` per
/// document (`separator_id` at each document's first slot in the
/// unshifted form), `cu_seqlens` over the row, `seq_idx` (the feature's
/// index), `max_seqlen`, `num_items_in_batch`, and with `mask` the 4D
/// block-causal mask.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Flattening {
    /// The label layout it writes.
    pub labels: LabelForm,
    /// Hugging Face's `separator_id`.
    pub separator_id: Option<i64>,
    /// The ignored label.
    pub ignore_index: i64,
    /// A 4D mask too.
    pub mask: Option<MaskForm>,
}

impl Flattening {
    /// Labels in `labels` form, `-100`, no separator, no mask.
    pub fn new(labels: LabelForm) -> Self {
        Flattening {
            labels,
            separator_id: None,
            ignore_index: HF_IGNORE,
            mask: None,
        }
    }

    /// The row's pieces: ids, shifted targets, positions, document of each
    /// slot (its index among the non-empty features, from 0), cu_seqlens.
    pub(super) fn pieces(&self, features: &[Feature]) -> Row {
        let docs: Vec<&Feature> = features
            .iter()
            .filter(|f| !f.input_ids.is_empty())
            .collect();
        let mut row = Row {
            cu: vec![0],
            ..Default::default()
        };
        for (k, f) in docs.iter().enumerate() {
            let m = f.input_ids.len();
            for t in 0..m {
                row.ids.push(f.input_ids[t]);
                row.pos.push(f.position(t));
                row.doc.push(k);
                row.shifted.push(match target(f, t, self.ignore_index) {
                    Some(x) => x,
                    None if k + 1 < docs.len() => self.separator_id.unwrap_or(self.ignore_index),
                    None => self.ignore_index,
                });
            }
            row.cu.push(row.ids.len());
        }
        row
    }

    /// Assembles a row into the batch.
    pub(super) fn finish(&self, row: &Row) -> Collated {
        let n = row.ids.len();
        let labels = match self.labels {
            LabelForm::Shifted => row.shifted.clone(),
            LabelForm::Unshifted => {
                unshift(&row.shifted, self.separator_id.unwrap_or(self.ignore_index))
            }
        };
        let one = |v: &[i64]| Array2::from_shape_vec((1, n), v.to_vec()).expect("n values");
        let mask = self.mask.map(|form| {
            let allowed = |i: usize, j: usize| row.doc[i] == row.doc[j] && j <= i;
            match form {
                MaskForm::Block => {
                    Mask::Block(Array4::from_shape_fn((1, 1, n, n), |(_, _, i, j)| {
                        allowed(i, j)
                    }))
                }
                MaskForm::Additive => {
                    Mask::Additive(Array4::from_shape_fn((1, 1, n, n), |(_, _, i, j)| {
                        if allowed(i, j) {
                            0.0
                        } else {
                            f64::MIN
                        }
                    }))
                }
            }
        });
        let longest = row.cu.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0);
        let doc: Vec<i64> = row.doc.iter().map(|&d| d as i64).collect();
        Collated {
            input_ids: one(&row.ids),
            labels: one(&labels),
            position_ids: Some(one(&row.pos)),
            cu_seqlens: Some(CuSeqlens::Slots(row.cu.clone())),
            seq_idx: Some(one(&doc)),
            max_seqlen: Some(longest),
            num_items_in_batch: Some(
                row.shifted
                    .iter()
                    .filter(|&&x| x != self.ignore_index)
                    .count(),
            ),
            attention_mask: mask,
        }
    }
}

/// One flattened row's pieces, before assembly (the planted faults edit them).
#[derive(Debug, Clone, Default)]
pub(super) struct Row {
    pub ids: Vec<i64>,
    pub shifted: Vec<i64>,
    pub pos: Vec<i64>,
    pub doc: Vec<usize>,
    pub cu: Vec<usize>,
}

impl Collator for Flattening {
    fn name(&self) -> String {
        format!("flattening ({:?} labels)", self.labels)
    }
    fn collate(&self, features: &[Feature]) -> Result<Collated, String> {
        Ok(self.finish(&self.pieces(features)))
    }
}

/// A packing collator: documents packed by `algorithm` into rows of
/// `max_seq_len` slots (`packshard_reference::packing::pack_lengths`,
/// overlong documents split into pieces, each piece keeping its positions),
/// padding at each row's end, `cu_seqlens` per row (packshard's
/// `PackedBatch`), `max_seqlen`, `num_items_in_batch` and a 2D padding mask.
/// With [`Algorithm::None`] and unshifted labels it is Hugging Face's
/// `DataCollatorForLanguageModeling(mlm=False)` over right-padded rows (one
/// document per row).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowPacking {
    /// The row length.
    pub max_seq_len: usize,
    /// The packing algorithm.
    pub algorithm: Algorithm,
    /// The label layout it writes.
    pub labels: LabelForm,
    /// The id of padding slots.
    pub pad_token_id: i64,
    /// The ignored label.
    pub ignore_index: i64,
    /// A planted fault ([`super::faults`]); None for the correct collator.
    pub fault: Option<RowFault>,
}

impl RowPacking {
    /// Rows of `max_seq_len` by `algorithm`, padding id 0, `-100`.
    pub fn new(max_seq_len: usize, algorithm: Algorithm, labels: LabelForm) -> Self {
        RowPacking {
            max_seq_len,
            algorithm,
            labels,
            pad_token_id: 0,
            ignore_index: HF_IGNORE,
            fault: None,
        }
    }
}

impl Collator for RowPacking {
    fn name(&self) -> String {
        format!(
            "row packing ({}, {:?} labels{})",
            self.algorithm.name(),
            self.labels,
            self.fault.map_or(String::new(), |f| format!(", {f:?}"))
        )
    }
    fn collate(&self, features: &[Feature]) -> Result<Collated, String> {
        let msl = self.max_seq_len;
        let overlong = if self.fault == Some(RowFault::TruncatesOverlong) {
            Overlong::Truncate
        } else {
            Overlong::Split
        };
        let lengths: Vec<usize> = features.iter().map(|f| f.input_ids.len()).collect();
        let config = PackingConfig::new(self.algorithm, msl).with_overlong(overlong);
        let plan = pack_lengths(&lengths, &config).map_err(|e| e.to_string())?;
        let r = plan.packs.len().max(1);
        let ig = self.ignore_index;
        let mut ids = Array2::from_elem((r, msl), self.pad_token_id);
        let mut labels = Array2::from_elem((r, msl), ig);
        let mut pos = Array2::zeros((r, msl));
        let mut mask = Array2::zeros((r, msl));
        let mut cu = vec![vec![0usize]; r];
        let (mut longest, mut items) = (0, 0);
        for (p, pack) in plan.packs.iter().enumerate() {
            let mut at = 0;
            let mut shifted = vec![ig; msl];
            for seg in pack {
                let f = &features[seg.sequence];
                for t in 0..seg.length {
                    let src = seg.offset + t;
                    ids[[p, at + t]] = f.input_ids[src];
                    pos[[p, at + t]] = if self.fault == Some(RowFault::SplitRestartsPositions) {
                        t as i64
                    } else {
                        f.position(src)
                    };
                    mask[[p, at + t]] = 1;
                    if t + 1 < seg.length {
                        shifted[at + t] = target(f, src, ig).expect("a next token in the piece");
                    }
                }
                at += seg.length;
                cu[p].push(at);
                longest = longest.max(seg.length);
            }
            if self.fault == Some(RowFault::PaddingLabelled) {
                // Hugging Face with pad_token = eos: the padding's labels
                // are the pad id, learnt as EOS.
                shifted[at..].fill(self.pad_token_id);
            }
            items += shifted.iter().filter(|&&x| x != ig).count();
            let row = match self.labels {
                LabelForm::Shifted => shifted,
                LabelForm::Unshifted => unshift(&shifted, ig),
            };
            for (c, x) in row.into_iter().enumerate() {
                labels[[p, c]] = x;
            }
        }
        Ok(Collated {
            input_ids: ids,
            labels,
            position_ids: Some(pos),
            cu_seqlens: Some(CuSeqlens::PerRow(cu)),
            seq_idx: None,
            max_seqlen: Some(longest),
            num_items_in_batch: Some(items),
            attention_mask: Some(Mask::Padding(mask)),
        })
    }
}
