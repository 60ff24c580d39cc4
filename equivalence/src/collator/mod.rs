//! Checks a data collator of packed causal-LM batches (issue 36;
//! docs/HF.md, docs/FAULTS.md C1–C4, C6, C7 and K1–K9).
//!
//! A [`Collator`] turns tokenized documents ([`Feature`]s, Hugging Face's
//! feature format) into model inputs ([`Collated`]): one flattened row
//! (`DataCollatorWithFlattening`, `[1, n]`) or several padded rows
//! (`[r, n]`: a packing collator's rows of `max_seq_len` slots, or
//! `DataCollatorForLanguageModeling`'s one document per row). The collator
//! decides which document goes in which row and where padding goes;
//! [`judge_collated`] reads that layout back from `input_ids` alone (every
//! generated token id is unique in its case, so each slot names its document
//! and token) and judges every field against packshard's reference
//! (`packshard_reference::decoder::packing::next_token_labels` on the layout
//! read back, with the prompt masks, separators and positions of the
//! features). [`check_collator`] generates document sets the way collators
//! break ([`generate`]), runs the collator on each, and reports the smallest
//! failing case (the failing case with the fewest tokens, then shrunk by
//! leaving out documents while it still fails).
//!
//! Shape legend: `r` rows, `n` slots per row, `b` segments.

mod cases;
pub mod faults;
mod judge;
mod reference;
#[cfg(test)]
mod tests;

use std::fmt;

use ndarray::{Array2, Array4};

pub use cases::{generate, CaseKind, CollatorCase};
pub use judge::{judge_collated, Judged, ADDITIVE_MASKED};
pub use reference::{Flattening, RowPacking};

/// The label Hugging Face's collators and losses ignore (`-100`,
/// `torch.nn.CrossEntropyLoss`'s default `ignore_index`).
pub const HF_IGNORE: i64 = -100;

/// One tokenized document, Hugging Face's feature: `input_ids` `[m]`
/// (`m` may be 0), `labels` `[m]` when the document has a prompt mask
/// (`-100` on the prompt's tokens: token `t` is no target), `position_ids`
/// `[m]` for a continuation chunk of a longer document (its own positions,
/// consecutive, first > 0; docs/FAULTS.md C6).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Feature {
    /// Token ids `[m]`.
    pub input_ids: Vec<i64>,
    /// Per-token targets before any shift `[m]`, `-100` on a prompt.
    pub labels: Option<Vec<i64>>,
    /// The document's positions `[m]` (absent: `0..m`).
    pub position_ids: Option<Vec<i64>>,
}

impl Feature {
    /// Position of token `t`: the feature's own, or `t`.
    pub fn position(&self, t: usize) -> i64 {
        self.position_ids.as_ref().map_or(t as i64, |p| p[t])
    }
}

/// How `labels` are laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LabelForm {
    /// packshard's: slot `i` holds the target of slot `i` (the next token of
    /// its document; `ignore_index` after a document's last token, on padding
    /// and on a prompt).
    Shifted,
    /// Hugging Face's: the model shifts (`logits[:, :-1]` against
    /// `labels[:, 1:]`), so slot `i + 1` holds slot `i`'s target; each
    /// document's first slot holds `ignore_index` (or the separator) and
    /// `labels[row, 0]` is not judged (the shift drops it).
    Unshifted,
}

/// Document boundaries as offsets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CuSeqlens {
    /// `[b + 1]` over the `r * n` slots flattened row-major (Hugging Face's
    /// `cu_seq_lens_q/k` of its `[1, n]` row; flash-attention's `cu_seqlens`
    /// over a padded batch flattened): leading 0, last `r * n`, padding may
    /// form segments of its own.
    Slots(Vec<usize>),
    /// Per row `[b_p + 1]` from 0 (packshard's `PackedBatch::cu_seqlens`):
    /// the slots past the last offset are padding.
    PerRow(Vec<Vec<usize>>),
}

/// An attention mask.
#[derive(Debug, Clone, PartialEq)]
pub enum Mask {
    /// 4D `[r, 1, n, n]`, `true`: query `i` may attend to key `j`.
    Block(Array4<bool>),
    /// 4D `[r, 1, n, n]` added to the scores: 0 to attend, at most
    /// [`ADDITIVE_MASKED`] (Hugging Face writes `torch.finfo(dtype).min`) to
    /// mask.
    Additive(Array4<f64>),
    /// 2D `[r, n]`: 1 on tokens, 0 on padding (`DataCollatorWithPadding`).
    Padding(Array2<i64>),
}

/// What a collator hands the model. Per-token fields are `[r, n]`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Collated {
    /// Token ids; padding slots hold `pad_token_id`.
    pub input_ids: Array2<i64>,
    /// Targets in the declared [`LabelForm`].
    pub labels: Array2<i64>,
    /// Positions (absent: the model numbers each row `0..n`).
    pub position_ids: Option<Array2<i64>>,
    /// Document boundaries.
    pub cu_seqlens: Option<CuSeqlens>,
    /// Segment index per slot (Mamba-2's `seq_idx`), non-decreasing in a row.
    pub seq_idx: Option<Array2<i64>>,
    /// flash-attention's `max_seqlen` (Hugging Face's `max_length_q/k`).
    pub max_seqlen: Option<usize>,
    /// The tokens with a target: the per-token loss's denominator
    /// (Hugging Face's `num_items_in_batch`; C7).
    pub num_items_in_batch: Option<usize>,
    /// A 4D block-causal mask or a 2D padding mask.
    pub attention_mask: Option<Mask>,
}

/// Something that collates features into a batch.
pub trait Collator {
    /// A short name for reports.
    fn name(&self) -> String;
    /// Collates `features` (in order; some may be empty).
    ///
    /// # Errors
    /// Any message; a collator that refuses a valid document set fails the
    /// case.
    fn collate(&self, features: &[Feature]) -> Result<Collated, String>;
}

/// What [`check_collator`] generates and how it judges.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CollatorOptions {
    /// Random cases after the fixed ones (issue 36's rows and docs/FAULTS.md's).
    pub cases: usize,
    /// Seed of the random cases (ChaCha8).
    pub seed: u64,
    /// The declared label layout.
    pub labels: LabelForm,
    /// The ignored label (default `-100`). A feature's `labels` always mark
    /// a prompt with `-100` (Hugging Face's), whatever this is.
    pub ignore_index: i64,
    /// Every non-empty generated document ends with this token (a
    /// tokenizer's EOS); it predicts nothing.
    pub eos_token_id: Option<i64>,
    /// Hugging Face's `separator_id`: every chunk but a row's last predicts
    /// it after its last token.
    pub separator_id: Option<i64>,
    /// The id of padding slots (never a generated token).
    pub pad_token_id: i64,
    /// The row length of a packing collator: the generator then draws
    /// documents longer than a row ([`CaseKind::Long`]).
    pub max_seq_len: Option<usize>,
    /// The kinds of document sets drawn.
    pub kinds: Vec<CaseKind>,
    /// Whether the batch must carry document boundaries (`cu_seqlens`,
    /// `seq_idx` or a 4D mask) when a row holds two documents (default true;
    /// false for a model that derives them from `position_ids`, as
    /// transformers' SDPA path does).
    pub require_boundaries: bool,
}

impl Default for CollatorOptions {
    fn default() -> Self {
        CollatorOptions {
            cases: 200,
            seed: 0,
            labels: LabelForm::Shifted,
            ignore_index: HF_IGNORE,
            eos_token_id: None,
            separator_id: None,
            pad_token_id: 0,
            max_seq_len: None,
            kinds: CaseKind::ALL.to_vec(),
            require_boundaries: true,
        }
    }
}

/// A field of a collated batch that is wrong: the field (`labels`,
/// `cu_seqlens`, ...), the row and index where known, and what was found
/// and expected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CollatorError {
    /// The field, under [`Collated`]'s names (`input_ids`, `attention_mask`, ...).
    pub field: String,
    /// The batch row.
    pub row: Option<usize>,
    /// The slot in the row (the query slot of a mask; the offset's index of
    /// `cu_seqlens`).
    pub index: Option<usize>,
    /// Both values and why.
    pub message: String,
}

impl CollatorError {
    /// An error at `field[row, index]`.
    pub fn at(
        field: &str,
        row: Option<usize>,
        index: Option<usize>,
        message: impl Into<String>,
    ) -> Self {
        CollatorError {
            field: field.into(),
            row,
            index,
            message: message.into(),
        }
    }
}

impl fmt::Display for CollatorError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.row, self.index) {
            (Some(r), Some(i)) => write!(f, "{}[{r}, {i}]: {}", self.field, self.message),
            (None, Some(i)) => write!(f, "{}[{i}]: {}", self.field, self.message),
            (Some(r), None) => write!(f, "{} row {r}: {}", self.field, self.message),
            (None, None) => write!(f, "{}: {}", self.field, self.message),
        }
    }
}

impl std::error::Error for CollatorError {}

/// One failing case: the features, how they were drawn, and the error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CollatorFailure {
    /// The collator's input (replay with [`judge_collated`]).
    pub case: CollatorCase,
    /// Tokens of the case.
    pub tokens: usize,
    /// What was wrong.
    pub error: CollatorError,
}

impl fmt::Display for CollatorFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "case: {} ({})\n  {}",
            self.case.describe(),
            self.case.source,
            self.error
        )
    }
}

/// What a run saw.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CollatorReport {
    /// The collator's name.
    pub name: String,
    /// Cases run.
    pub cases: usize,
    /// Slots judged (`r * n` summed over the cases).
    pub slots: usize,
    /// Rows judged.
    pub rows: usize,
    /// The fields the collator returned, judged.
    pub fields: Vec<&'static str>,
}

/// Runs `collator` on the fixed and random cases of `options` and judges
/// each batch with [`judge_collated`].
///
/// # Errors
/// The smallest failing case: of the failing cases the one with the fewest
/// tokens, then shrunk (documents left out one at a time while the collator
/// still fails on the rest).
pub fn check_collator(
    collator: &dyn Collator,
    options: &CollatorOptions,
) -> Result<CollatorReport, CollatorFailure> {
    let mut report = CollatorReport {
        name: collator.name(),
        ..Default::default()
    };
    let mut worst: Option<CollatorFailure> = None;
    for case in generate(options) {
        report.cases += 1;
        match run_case(collator, &case, options) {
            Ok(j) => {
                report.slots += j.slots;
                report.rows += j.rows;
                for f in j.fields {
                    if !report.fields.contains(&f) {
                        report.fields.push(f);
                    }
                }
            }
            Err(error) => {
                let tokens = case.tokens();
                if worst.as_ref().is_none_or(|w| tokens < w.tokens) {
                    worst = Some(CollatorFailure {
                        case,
                        tokens,
                        error,
                    });
                }
            }
        }
    }
    match worst {
        None => Ok(report),
        Some(w) => Err(shrink(collator, w, options)),
    }
}

/// Calls the collator on `case` and judges its batch.
fn run_case(
    collator: &dyn Collator,
    case: &CollatorCase,
    options: &CollatorOptions,
) -> Result<Judged, CollatorError> {
    let out = collator.collate(&case.features).map_err(|e| {
        CollatorError::at(
            "collate",
            None,
            None,
            format!("refused a valid document set: {e}"),
        )
    })?;
    judge_collated(&case.features, &out, options)
}

/// Leaves documents out of a failing case while the collator still fails.
fn shrink(
    collator: &dyn Collator,
    mut w: CollatorFailure,
    options: &CollatorOptions,
) -> CollatorFailure {
    let mut k = 0;
    while k < w.case.features.len() && w.case.features.len() > 1 {
        let mut smaller = w.case.clone();
        smaller.features.remove(k);
        smaller.source = format!("{}, shrunk", w.case.source.trim_end_matches(", shrunk"));
        if smaller.tokens() > 0 {
            if let Err(error) = run_case(collator, &smaller, options) {
                w = CollatorFailure {
                    tokens: smaller.tokens(),
                    case: smaller,
                    error,
                };
                continue;
            }
        }
        k += 1;
    }
    w
}
