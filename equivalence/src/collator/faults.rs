//! Collators with one shipped mistake each: the negative controls of
//! [`super::check_collator`] (docs/FAULTS.md C1–C4, C6, C7, P1, P3 and
//! K1–K9). [`Planted`] breaks [`Flattening`]; [`RowFault`] breaks
//! [`super::RowPacking`].

use super::reference::{Flattening, Row};
use super::{Collated, Collator, CuSeqlens, Feature, LabelForm};

/// A fault of a flattening collator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CollatorFault {
    /// C1: shifted labels over the whole row (`labels = input_ids[1:]`), so
    /// a document's last token predicts the next document's first
    /// (torchtune PR 2613).
    LabelsAcrossDocuments,
    /// K1: unshifted labels copied from `input_ids` with no `-100` at each
    /// document's first slot (`DataCollatorForLanguageModeling` on a packed
    /// row): after the model's shift, C1 again.
    FirstTokenNotIgnored,
    /// C2: boundaries found after the slots whose shifted label is EOS (the
    /// EOS token itself joins the next document; torchtitan issue 3130).
    BoundaryFromEosLabel,
    /// C3: boundaries where a position strictly decreases, merging one-token
    /// documents (ms-swift PR 9904).
    BoundariesAtDecrease,
    /// C4: each document padded to a multiple of 4, `cu_seqlens` the running
    /// sums of the real lengths (padding read as tail padding; NeMo
    /// Automodel PR 3640).
    PaddingAsTail,
    /// C6: every document's positions from 0, a continuation chunk's lost
    /// (transformers issue 39814; what `DataCollatorWithFlattening` does).
    ContinuationRenumbered,
    /// C7: `num_items_in_batch` = real tokens - rows (unsloth-zoo PR 348).
    DenominatorPerRow,
    /// K2 (P1): `position_ids` `0..n` over the row, not reset per document.
    PositionsNotReset,
    /// K3: `cu_seqlens`' inner offsets one slot late.
    CuSeqlensOffByOne,
    /// K4: the last document left out (`features[:-1]`).
    LastDocumentDropped,
    /// K5: TRL's early `packing=True`: documents concatenated, positions
    /// `0..n`, labels over the whole row, no boundaries at all.
    ConcatNoMask,
    /// K6: `cu_seqlens` where `position_ids == 0`, transformers'
    /// `prepare_fa_kwargs_from_position_ids` (flash-attention-2 path):
    /// `[5, 6, 7, 0, 1]` reads as `[3, 5]`, `[0, 1, 2, 5, 6]` as `[0, 5]`,
    /// `[2, 3, 4, 2, 3, 2, 0, 0]` as `[6, 7, 8]` (issue 36).
    FlashAttentionMisread,
}

impl CollatorFault {
    /// Every fault.
    pub const ALL: [CollatorFault; 12] = [
        CollatorFault::LabelsAcrossDocuments,
        CollatorFault::FirstTokenNotIgnored,
        CollatorFault::BoundaryFromEosLabel,
        CollatorFault::BoundariesAtDecrease,
        CollatorFault::PaddingAsTail,
        CollatorFault::ContinuationRenumbered,
        CollatorFault::DenominatorPerRow,
        CollatorFault::PositionsNotReset,
        CollatorFault::CuSeqlensOffByOne,
        CollatorFault::LastDocumentDropped,
        CollatorFault::ConcatNoMask,
        CollatorFault::FlashAttentionMisread,
    ];
}

/// A fault of a packing collator ([`super::RowPacking::fault`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RowFault {
    /// K7 (C6): the second piece of a split document restarts its
    /// positions at 0.
    SplitRestartsPositions,
    /// K8 (P3): a document longer than a row truncated, its tail lost.
    TruncatesOverlong,
    /// K9: padding's labels are the pad id (a tokenizer whose pad token is
    /// EOS, labels copied from `input_ids` before masking), learnt as EOS.
    PaddingLabelled,
}

/// [`Flattening`] with one [`CollatorFault`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Planted {
    /// The correct collator it breaks.
    pub base: Flattening,
    /// The fault.
    pub fault: CollatorFault,
    /// The EOS id ([`CollatorFault::BoundaryFromEosLabel`] looks for it).
    pub eos_token_id: Option<i64>,
}

impl Planted {
    /// `fault` over [`Flattening::new`]`(labels)`.
    pub fn new(fault: CollatorFault, labels: LabelForm) -> Self {
        Planted {
            base: Flattening::new(labels),
            fault,
            eos_token_id: None,
        }
    }
}

fn cu_where(n: usize, starts: impl Iterator<Item = usize>) -> Vec<usize> {
    let mut cu: Vec<usize> = std::iter::once(0).chain(starts).collect();
    cu.retain(|&x| x < n);
    cu.dedup();
    cu.push(n);
    cu
}

impl Collator for Planted {
    fn name(&self) -> String {
        format!("{:?} ({:?} labels)", self.fault, self.base.labels)
    }

    fn collate(&self, features: &[Feature]) -> Result<Collated, String> {
        use CollatorFault as F;
        let ig = self.base.ignore_index;
        let whole_row_shift = |row: &mut Row| {
            let n = row.ids.len();
            row.shifted = (0..n)
                .map(|c| if c + 1 < n { row.ids[c + 1] } else { ig })
                .collect();
        };
        let mut row = match self.fault {
            F::LastDocumentDropped => {
                let last = features.iter().rposition(|f| !f.input_ids.is_empty());
                let kept: Vec<Feature> = features
                    .iter()
                    .enumerate()
                    .filter(|&(i, _)| Some(i) != last || features.len() == 1)
                    .map(|(_, f)| f.clone())
                    .collect();
                self.base.pieces(&kept)
            }
            _ => self.base.pieces(features),
        };
        let n = row.ids.len();
        match self.fault {
            F::LabelsAcrossDocuments | F::FirstTokenNotIgnored => whole_row_shift(&mut row),
            F::BoundaryFromEosLabel => {
                let eos = self.eos_token_id;
                row.cu = cu_where(
                    n,
                    (0..n)
                        .filter(|&c| Some(row.shifted[c]) == eos)
                        .map(|c| c + 1),
                );
            }
            F::BoundariesAtDecrease => {
                row.cu = cu_where(n, (1..n).filter(|&c| row.pos[c] < row.pos[c - 1]));
            }
            F::ContinuationRenumbered => {
                for c in 0..n {
                    let start = row.cu[row.doc[c]];
                    row.pos[c] = (c - start) as i64;
                }
            }
            F::PositionsNotReset => row.pos = (0..n as i64).collect(),
            F::CuSeqlensOffByOne => {
                let last = row.cu.len() - 1;
                for x in &mut row.cu[1..last] {
                    *x += 1;
                }
            }
            F::FlashAttentionMisread => {
                row.cu = cu_where(n, (0..n).filter(|&c| row.pos[c] == 0));
                if row.pos[0] != 0 {
                    // transformers' torch.cat of the zeros' indices and n:
                    // no leading 0 when the row does not start at 0.
                    row.cu.remove(0);
                }
            }
            _ => {}
        }
        let mut out = self.base.finish(&row);
        match self.fault {
            F::FirstTokenNotIgnored => {
                // Labels = input_ids: the unshifted form's copy.
                out.labels = out.input_ids.clone();
            }
            F::DenominatorPerRow => out.num_items_in_batch = Some(n - 1),
            F::ConcatNoMask => {
                whole_row_shift(&mut row);
                row.pos = (0..n as i64).collect();
                let mut o = self.base.finish(&row);
                o.cu_seqlens = None;
                o.seq_idx = None;
                o.max_seqlen = None;
                o.attention_mask = None;
                o.num_items_in_batch = None;
                out = o;
            }
            F::PaddingAsTail => out = pad_documents(&self.base, features, 4),
            F::BoundariesAtDecrease
            | F::BoundaryFromEosLabel
            | F::CuSeqlensOffByOne
            | F::FlashAttentionMisread => {
                // Their seq_idx and max_seqlen follow the wrong boundaries.
                if let Some(CuSeqlens::Slots(cu)) = &out.cu_seqlens {
                    let mut si = vec![0i64; n];
                    for (k, w) in cu.windows(2).enumerate() {
                        si[w[0]..w[1].min(n)].fill(k as i64);
                    }
                    out.seq_idx = Some(ndarray::Array2::from_shape_vec((1, n), si).expect("n"));
                    out.max_seqlen = cu.windows(2).map(|w| w[1].saturating_sub(w[0])).max();
                }
            }
            _ => {}
        }
        Ok(out)
    }
}

/// C4: each document padded to a multiple of `multiple` with id 0 (labels
/// ignored, positions continuing), `cu_seqlens` the running sums of the
/// real lengths as if the padding were at the row's end.
fn pad_documents(base: &Flattening, features: &[Feature], multiple: usize) -> Collated {
    let row = base.pieces(features);
    let mut padded = Row {
        cu: vec![0],
        ..Default::default()
    };
    let docs = row.cu.len() - 1;
    for k in 0..docs {
        let (a, b) = (row.cu[k], row.cu[k + 1]);
        padded.ids.extend_from_slice(&row.ids[a..b]);
        padded.shifted.extend_from_slice(&row.shifted[a..b]);
        padded.pos.extend_from_slice(&row.pos[a..b]);
        padded.doc.extend(std::iter::repeat_n(k, b - a));
        let pad = (multiple - (b - a) % multiple) % multiple;
        let last = row.pos[b - 1];
        for i in 0..pad {
            padded.ids.push(0);
            padded.shifted.push(base.ignore_index);
            padded.pos.push(last + 1 + i as i64);
            // Padding belongs to no document; the 4D mask is not built here.
            padded.doc.push(usize::MAX);
        }
    }
    let n = padded.ids.len();
    let mut cu: Vec<usize> = row.cu.clone();
    cu.push(n);
    cu.dedup();
    padded.cu = cu;
    let mut out = base.finish(&padded);
    out.seq_idx = None;
    out
}
