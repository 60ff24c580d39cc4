//! Causal-LM packing: next-token labels inside each document, the loss
//! reductions, and the conversions between the four ways a packed batch
//! names its documents.
//!
//! | form | shape | example: documents of 3 and 2 tokens, one padding slot between |
//! |---|---|---|
//! | document ids (0 = padding) | `[n_slots]` | `[1, 1, 1, 0, 2, 2]` |
//! | real slots + `cu_seqlens` | `[n_tok]`, `[b + 1]` | `[0, 1, 2, 4, 5]`, `[0, 3, 5]` |
//! | `position_ids` (real tokens) | `[n_tok]` | `[0, 1, 2, 0, 1]` |
//! | `seq_idx` (real tokens; Mamba's) | `[n_tok]` | `[0, 0, 0, 1, 1]` |
//!
//! Document ids are the ground truth: they say which slots are padding
//! wherever it is (between documents as well as at the end,
//! docs/FAULTS.md C4), and they mark one-token documents that
//! `position_ids` read by a strict decrease would merge (C3). Each
//! document's slots are contiguous and its id unique in the batch (a
//! document cut over two rows takes two ids).
//!
//! Labels follow Hugging Face's `DataCollatorWithFlattening` and TRL's
//! padding-free collator: the target of token `i` is token `i + 1` of the
//! same document; the last token of a document predicts nothing (`-100`) or,
//! when configured, an EOS id; padding predicts nothing (C1, C2).

use crate::attention::check_cu_seqlens;
use crate::error::{check_len, ensure, Error, Result};
use crate::vocab::IGNORE_INDEX;

/// How the next-token loss of a batch is normalised. Each is a weight per
/// predicted token that depends only on which tokens belong to which
/// document, so packing cannot change it (docs/FAULTS.md P7, C7). The
/// unpacked batch has one document per row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CausalReduction {
    /// Mean over every predicted token of the batch: weight `1 / M`, `M` the
    /// batch's predicted tokens (Hugging Face's `num_items_in_batch`; C7).
    PerToken,
    /// Mean over each document's predicted tokens, then over the documents
    /// that predict any: `1 / (D * m_d)`.
    PerDocument,
    /// Sum over each unpacked row (one document), mean over the rows:
    /// weight `1 / R`, `R` the batch's documents (`loss.sum(-1).mean()` of a
    /// padded batch).
    PerRow,
}

impl CausalReduction {
    /// All three.
    pub const ALL: [CausalReduction; 3] = [
        CausalReduction::PerToken,
        CausalReduction::PerDocument,
        CausalReduction::PerRow,
    ];

    /// `per-token`, `per-document`, `per-row`.
    pub fn name(self) -> &'static str {
        match self {
            CausalReduction::PerToken => "per-token",
            CausalReduction::PerDocument => "per-document",
            CausalReduction::PerRow => "per-row",
        }
    }
}

/// Checks document ids: each non-zero id's slots are contiguous (an id does
/// not come back after another id or padding).
///
/// # Errors
/// [`Error::InvalidArgument`] naming `doc_ids[i]` where an id comes back.
pub fn check_doc_ids(doc_ids: &[usize]) -> Result<()> {
    let mut seen = std::collections::HashSet::new();
    for (i, &d) in doc_ids.iter().enumerate() {
        if d == 0 || (i > 0 && doc_ids[i - 1] == d) {
            continue;
        }
        if !seen.insert(d) {
            return Err(Error::invalid(
                format!("doc_ids[{i}]"),
                format!("document {d} comes back after other slots: a document's slots are contiguous and its id unique"),
            ));
        }
    }
    Ok(())
}

/// Next-token labels: `input_ids, doc_ids: [n_slots]` (0 = padding);
/// `labels[i] = input_ids[i + 1]` when slot `i + 1` is in the same document,
/// else `eos` (when given) for a document's last token, and `-100` for
/// padding and (without `eos`) a document's last token.
///
/// Pack `[a b | c d]`: `[b, -100, d, -100]` (docs/FAULTS.md C1).
///
/// # Errors
/// [`Error::ShapeMismatch`] naming `doc_ids`; [`check_doc_ids`]'s.
pub fn next_token_labels(
    input_ids: &[i64],
    doc_ids: &[usize],
    eos: Option<i64>,
) -> Result<Vec<i64>> {
    check_len(
        "doc_ids",
        doc_ids.len(),
        "n_slots",
        input_ids.len(),
        "one per input id",
    )?;
    check_doc_ids(doc_ids)?;
    Ok((0..input_ids.len())
        .map(|i| match doc_ids[i] {
            0 => IGNORE_INDEX,
            d if doc_ids.get(i + 1) == Some(&d) => input_ids[i + 1],
            _ => eos.unwrap_or(IGNORE_INDEX),
        })
        .collect())
}

/// The weight of each slot's loss under `reduction` (0 for a slot that
/// predicts nothing): `labels, doc_ids: [n_slots]`, `num_documents` the
/// documents of the batch (the unpacked batch's rows, empty documents
/// included; [`CausalReduction::PerRow`] divides by it).
///
/// # Errors
/// [`Error::ShapeMismatch`] naming `doc_ids`; [`Error::InvalidArgument`]
/// naming `labels[i]` for a label on a padding slot, `num_documents` when
/// fewer than the ids present.
pub fn loss_weights(
    labels: &[i64],
    doc_ids: &[usize],
    reduction: CausalReduction,
    num_documents: usize,
) -> Result<Vec<f64>> {
    check_len(
        "doc_ids",
        doc_ids.len(),
        "n_slots",
        labels.len(),
        "one per label",
    )?;
    let mut per_doc: std::collections::HashMap<usize, usize> = Default::default();
    let mut present = std::collections::HashSet::new();
    for (i, (&l, &d)) in labels.iter().zip(doc_ids).enumerate() {
        if d != 0 {
            present.insert(d);
        }
        if l == IGNORE_INDEX {
            continue;
        }
        if d == 0 {
            return Err(Error::invalid(
                format!("labels[{i}]"),
                "a padding slot has a label",
            ));
        }
        *per_doc.entry(d).or_default() += 1;
    }
    let held = present.len();
    ensure(held <= num_documents, "num_documents", || {
        format!("is {num_documents}, but the batch holds {held} documents")
    })?;
    let total: usize = per_doc.values().sum();
    let with_any = per_doc.len();
    Ok(labels
        .iter()
        .zip(doc_ids)
        .map(|(&l, d)| {
            if l == IGNORE_INDEX {
                return 0.0;
            }
            match reduction {
                CausalReduction::PerToken => 1.0 / total as f64,
                CausalReduction::PerDocument => 1.0 / (with_any * per_doc[d]) as f64,
                CausalReduction::PerRow => 1.0 / num_documents as f64,
            }
        })
        .collect())
}

/// Document ids to the varlen form: `(slots, cu_seqlens)`, the real slots
/// in order (`[n_tok]`) and one segment per document over them (`[b + 1]`).
/// `[1, 1, 1, 0, 2, 2, 0, 0]` gives slots `[0, 1, 2, 4, 5]` and
/// `cu_seqlens [0, 3, 5]` (docs/FAULTS.md C4).
///
/// # Errors
/// [`check_doc_ids`]'s.
pub fn varlen_from_doc_ids(doc_ids: &[usize]) -> Result<(Vec<usize>, Vec<usize>)> {
    check_doc_ids(doc_ids)?;
    let mut slots = Vec::new();
    let mut cu = vec![0];
    for (i, &d) in doc_ids.iter().enumerate() {
        if d == 0 {
            continue;
        }
        let continues = slots
            .last()
            .is_some_and(|&j: &usize| j + 1 == i && doc_ids[j] == d);
        if !continues && !slots.is_empty() {
            cu.push(slots.len());
        }
        slots.push(i);
    }
    if !slots.is_empty() {
        cu.push(slots.len());
    }
    Ok((slots, cu))
}

/// The inverse of [`varlen_from_doc_ids`]: `n_slots` document ids, segment
/// `s` of `cu_seqlens: [b + 1]` at `slots` given id `s + 1`, every other slot
/// 0 (padding).
///
/// # Errors
/// [`check_cu_seqlens`]'s against `slots.len()`; [`Error::IndexOutOfRange`]
/// naming `slots` for a slot `>= n_slots`; [`Error::InvalidArgument`] naming
/// `slots[i]` when slots do not increase.
pub fn doc_ids_from_varlen(
    slots: &[usize],
    cu_seqlens: &[usize],
    n_slots: usize,
) -> Result<Vec<usize>> {
    check_cu_seqlens(cu_seqlens, slots.len())?;
    let mut ids = vec![0; n_slots];
    for (i, &slot) in slots.iter().enumerate() {
        if slot >= n_slots {
            return Err(Error::out_of_range("slots", i, slot as i64, n_slots));
        }
        if i > 0 && slots[i - 1] >= slot {
            return Err(Error::invalid(format!("slots[{i}]"), "slots must increase"));
        }
    }
    for (s, w) in cu_seqlens.windows(2).enumerate() {
        for &slot in &slots[w[0]..w[1]] {
            ids[slot] = s + 1;
        }
    }
    Ok(ids)
}

/// Segment boundaries of real tokens from their `position_ids: [n_tok]`: a
/// document starts wherever a position is not its predecessor's plus one
/// (the first document may start anywhere: a continuation chunk). Positions
/// `[0, 1, 2, 0, 0, 1]` are documents of `[3, 1, 2]` (docs/FAULTS.md C3: a
/// strict decrease would see `[3, 3]`). Returns `cu_seqlens: [b + 1]`, with
/// no empty segments (positions cannot show one).
pub fn cu_seqlens_from_position_ids(position_ids: &[usize]) -> Vec<usize> {
    let mut cu = vec![0];
    for i in 1..position_ids.len() {
        if position_ids[i] != position_ids[i - 1].wrapping_add(1) {
            cu.push(i);
        }
    }
    if !position_ids.is_empty() {
        cu.push(position_ids.len());
    }
    cu
}

/// Positions of the tokens of `cu_seqlens: [b + 1]`: each segment counts from
/// 0, the first from `first_offset` (a continuation chunk keeps its
/// positions: `[5, 6, 7, 8]` stays `[5, 6, 7, 8]`, docs/FAULTS.md C6).
///
/// # Errors
/// [`check_cu_seqlens`]'s (against the last offset).
pub fn position_ids_from_cu_seqlens(
    cu_seqlens: &[usize],
    first_offset: usize,
) -> Result<Vec<usize>> {
    let n = cu_seqlens.last().copied().unwrap_or(0);
    check_cu_seqlens(cu_seqlens, n)?;
    let mut pos = Vec::with_capacity(n);
    for (s, w) in cu_seqlens.windows(2).enumerate() {
        let o = if s == 0 { first_offset } else { 0 };
        pos.extend(o..o + w[1] - w[0]);
    }
    Ok(pos)
}

/// Each token's segment index (`seq_idx: [n_tok]`, Mamba's varlen form) of
/// `cu_seqlens: [b + 1]`; an empty segment's index is skipped.
///
/// # Errors
/// [`check_cu_seqlens`]'s (against the last offset).
pub fn seq_idx_from_cu_seqlens(cu_seqlens: &[usize]) -> Result<Vec<usize>> {
    let n = cu_seqlens.last().copied().unwrap_or(0);
    check_cu_seqlens(cu_seqlens, n)?;
    Ok(cu_seqlens
        .windows(2)
        .enumerate()
        .flat_map(|(s, w)| std::iter::repeat_n(s, w[1] - w[0]))
        .collect())
}

/// The inverse of [`seq_idx_from_cu_seqlens`] for `num_segments` segments
/// (`[num_segments + 1]`; indices that never occur are empty segments).
///
/// # Errors
/// [`Error::IndexOutOfRange`] naming `seq_idx` for an index `>=
/// num_segments`; [`Error::InvalidArgument`] naming `seq_idx[i]` where it
/// decreases.
pub fn cu_seqlens_from_seq_idx(seq_idx: &[usize], num_segments: usize) -> Result<Vec<usize>> {
    let mut counts = vec![0usize; num_segments];
    for (i, &s) in seq_idx.iter().enumerate() {
        if s >= num_segments {
            return Err(Error::out_of_range("seq_idx", i, s as i64, num_segments));
        }
        if i > 0 && seq_idx[i - 1] > s {
            return Err(Error::invalid(
                format!("seq_idx[{i}]"),
                format!(
                    "{s} is below seq_idx[{}] = {} (must not decrease)",
                    i - 1,
                    seq_idx[i - 1]
                ),
            ));
        }
        counts[s] += 1;
    }
    let mut cu = Vec::with_capacity(num_segments + 1);
    cu.push(0);
    for c in counts {
        cu.push(cu.last().copied().unwrap_or(0) + c);
    }
    Ok(cu)
}
