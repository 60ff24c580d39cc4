//! The context-parallel split of a packed (THD) batch, as TransformerEngine's
//! `get_batch_on_this_cp_rank` / `thd_get_partitioned_indices` and
//! Megatron-LM's `get_batch_on_this_cp_rank` do it for `qkv_format="thd"`:
//! each document padded to a multiple of `2 cp`, cut into `2 cp` equal
//! chunks, rank `r` holding chunks `r` and `2 cp - 1 - r` (so every rank gets
//! one early and one late chunk of each document: the causal work balances).
//!
//! ```text
//! cp = 2, documents of 5 and 2 tokens (a..e, f g), padded to 8 and 4 (_):
//!
//!   padded pack   | a b | c d | e _ | _ _ || f | g | _ | _ |
//!   chunk         |  0  |  1  |  2  |  3  || 0 | 1 | 2 | 3 |
//!   rank 0        | a b |           _ _ || f |           _ |   chunks 0 and 3
//!   rank 1        |     | c d | e _ |     ||   | g | _ |     |   chunks 1 and 2
//! ```
//!
//! Labels are shifted on the whole padded pack **before** the split (`a`
//! predicts `b`, `b` predicts `c` although `c` is on rank 1; docs/FAULTS.md
//! D5); positions are each token's place in its document (`e` is at 4); the
//! padding is a multiple of `2 cp` rounded **up** (D3). Shapes: `b`
//! documents, `n_pad` slots of the padded pack, `n_local = n_pad / cp` slots
//! per rank.

use super::StepFault;
use crate::decoder::next_token_labels;
use crate::error::{ensure, Error, Result};

/// One rank's share of a packed batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpShare {
    /// This rank, `0..cp`.
    pub rank: usize,
    /// `[n_local]`: each local slot's index in the padded pack (`0..n_pad`).
    pub token_index: Vec<usize>,
    /// `[b + 1]`: the local padded boundaries, the global padded
    /// `cu_seqlens` divided by `cp` (document `j`'s two chunks are slots
    /// `cu_seqlens_padded[j]..cu_seqlens_padded[j + 1]`).
    pub cu_seqlens_padded: Vec<usize>,
    /// `[b + 1]`: the running count of this rank's real tokens per document
    /// (each document's real tokens are a prefix of its local slots: padding
    /// sits at a document's end, so in its later chunk).
    pub cu_seqlens: Vec<usize>,
    /// `[n_local]`: each slot's position in its document (rotary angle;
    /// padding continues the count).
    pub position_ids: Vec<usize>,
    /// `[n_local]`: token ids (padding holds the pad id 0).
    pub input_ids: Vec<i64>,
    /// `[n_local]`: next-token labels, shifted on the padded pack before the
    /// split; `-100` on padding and (without EOS) a document's last token.
    pub labels: Vec<i64>,
    /// `[n_local]`: each slot's document, `0..b`.
    pub doc: Vec<usize>,
    /// `[n_local]`: false on padding.
    pub real: Vec<bool>,
}

/// A packed batch split over `cp` ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpPartition {
    /// Context-parallel ranks.
    pub cp: usize,
    /// `[b + 1]`: the real (unpadded) boundaries of the pack.
    pub cu_seqlens: Vec<usize>,
    /// `[b + 1]`: the boundaries of the padded pack (each document's length
    /// rounded up to a multiple of `2 cp`; TransformerEngine's
    /// `cu_seqlens_q_padded`).
    pub cu_seqlens_padded: Vec<usize>,
    /// One share per rank.
    pub ranks: Vec<CpShare>,
}

/// The largest context-parallel size accepted (a bound on the padding, `2 cp
/// - 1` slots per document; TransformerEngine runs cp up to a few hundred).
pub const MAX_CP: usize = 4096;

/// Refuses a `cp` of 0 or over [`MAX_CP`].
pub(super) fn check_cp(cp: usize) -> Result<()> {
    ensure((1..=MAX_CP).contains(&cp), "cp", || {
        format!("is {cp}: context-parallel ranks are 1..={MAX_CP}")
    })
}

/// Splits documents (`docs[j]`: document `j`'s token ids) over `cp` ranks
/// (see the module docs). `eos`: the target of each document's last token
/// (else `-100`). `fault` selects a faulted variant (D3, D5), for the
/// negative controls; `None` is the right split.
///
/// # Errors
/// [`Error::InvalidArgument`] naming `cp` (0 or over [`MAX_CP`]) or `docs`
/// (no document); the labels' errors.
pub fn cp_partition(
    docs: &[Vec<i64>],
    cp: usize,
    eos: Option<i64>,
    fault: Option<StepFault>,
) -> Result<CpPartition> {
    check_cp(cp)?;
    ensure(!docs.is_empty(), "docs", || "no document".into())?;
    let two = 2 * cp;
    let mut cu = vec![0];
    let mut cu_pad = vec![0];
    let (mut ids, mut doc_ids, mut pos) = (Vec::new(), Vec::new(), Vec::new());
    for (j, d) in docs.iter().enumerate() {
        let len = d.len();
        let padded = if fault == Some(StepFault::D3RoundDown) {
            // TransformerEngine issue 1930: rounded down, the tail is lost.
            len / two * two
        } else {
            len.div_ceil(two) * two
        };
        let kept = len.min(padded);
        cu.push(cu.last().unwrap_or(&0) + kept);
        cu_pad.push(cu_pad.last().unwrap_or(&0) + padded);
        ids.extend(d.iter().take(kept).copied());
        ids.resize(ids.len() + padded - kept, 0);
        doc_ids.extend((0..padded).map(|p| if p < kept { j + 1 } else { 0 }));
        pos.extend(0..padded);
    }
    let labels = next_token_labels(&ids, &doc_ids, eos)?;
    let mut ranks = Vec::with_capacity(cp);
    for r in 0..cp {
        let mut s = CpShare {
            rank: r,
            token_index: Vec::new(),
            cu_seqlens_padded: cu_pad.iter().map(|&c| c / cp).collect(),
            cu_seqlens: vec![0],
            position_ids: Vec::new(),
            input_ids: Vec::new(),
            labels: Vec::new(),
            doc: Vec::new(),
            real: Vec::new(),
        };
        for j in 0..docs.len() {
            let chunk = (cu_pad[j + 1] - cu_pad[j]) / two;
            let mut real = 0;
            for c in [r, two - 1 - r] {
                for i in 0..chunk {
                    let slot = cu_pad[j] + c * chunk + i;
                    s.token_index.push(slot);
                    s.position_ids.push(pos[slot]);
                    s.input_ids.push(ids[slot]);
                    s.labels.push(labels[slot]);
                    s.doc.push(j);
                    s.real.push(doc_ids[slot] != 0);
                    real += usize::from(doc_ids[slot] != 0);
                }
            }
            s.cu_seqlens.push(s.cu_seqlens.last().unwrap_or(&0) + real);
        }
        if fault == Some(StepFault::D5ShiftAfterSplit) {
            // The shift on each rank's own slots: a chunk's last token
            // predicts the first token of the rank's other chunk.
            let local: Vec<usize> = s
                .doc
                .iter()
                .zip(&s.real)
                .map(|(&d, &re)| if re { d + 1 } else { 0 })
                .collect();
            s.labels = next_token_labels(&s.input_ids, &local, eos)?;
        }
        ranks.push(s);
    }
    Ok(CpPartition {
        cp,
        cu_seqlens: cu,
        cu_seqlens_padded: cu_pad,
        ranks,
    })
}

/// Where a token sits: its document, its position there, and whether it is
/// a real token (not padding).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenMeta {
    /// The document, `0..b`.
    pub doc: usize,
    /// The position in the document.
    pub pos: usize,
    /// False on padding.
    pub real: bool,
}

/// Each local slot's [`TokenMeta`] on `rank`, derived as a CP attention
/// kernel derives it from its arguments (TransformerEngine's
/// `cu_seqlens_q` and `cu_seqlens_q_padded`, both global `[b + 1]`):
/// document `j`'s local slots are `cu_seqlens_padded[j] / cp ..
/// cu_seqlens_padded[j + 1] / cp`, the first half chunk `rank`, the second
/// chunk `2 cp - 1 - rank`; a slot is real when its position is below the
/// document's real length.
///
/// With `fault == Some(StepFault::D4UnpaddedBounds)` the local boundaries
/// come from the real `cu_seqlens` instead (Megatron-LM PR 4495).
///
/// # Errors
/// [`Error::ShapeMismatch`] naming `cu_seqlens` when the two have different
/// lengths; [`Error::InvalidArgument`] naming `cu_seqlens_padded` when a
/// padded document is shorter than its real length or not a multiple of `2
/// cp`.
pub fn rank_meta(
    rank: usize,
    cp: usize,
    cu_seqlens: &[usize],
    cu_seqlens_padded: &[usize],
    fault: Option<StepFault>,
) -> Result<Vec<TokenMeta>> {
    if cu_seqlens.len() != cu_seqlens_padded.len() || cu_seqlens.is_empty() {
        return Err(Error::ShapeMismatch {
            field: "cu_seqlens".into(),
            expected: format!("[b + 1] = [{}]", cu_seqlens_padded.len()),
            actual: vec![cu_seqlens.len()],
        });
    }
    ensure(rank < cp, "rank", || format!("is {rank}, cp = {cp}"))?;
    let two = 2 * cp;
    let n_local = cu_seqlens_padded.last().unwrap_or(&0) / cp;
    let bounds = if fault == Some(StepFault::D4UnpaddedBounds) {
        cu_seqlens
    } else {
        cu_seqlens_padded
    };
    let mut meta = Vec::with_capacity(n_local);
    for j in 0..cu_seqlens.len() - 1 {
        let len = cu_seqlens[j + 1].saturating_sub(cu_seqlens[j]);
        let padded = cu_seqlens_padded[j + 1].saturating_sub(cu_seqlens_padded[j]);
        ensure(
            padded >= len && padded.is_multiple_of(two),
            "cu_seqlens_padded",
            || {
                format!("document {j}: {padded} padded slots for {len} tokens (need >= and a multiple of 2 cp = {two})")
            },
        )?;
        let (a, b) = (bounds[j] / cp, (bounds[j + 1] / cp).min(n_local));
        let chunk = b.saturating_sub(a) / 2;
        for o in 0..b.saturating_sub(a) {
            let (c, i) = if o < chunk {
                (rank, o)
            } else {
                (two - 1 - rank, o - chunk)
            };
            let pos = c * chunk + i;
            meta.push(TokenMeta {
                doc: j,
                pos,
                real: pos < len,
            });
        }
    }
    // A faulted derivation may cover fewer slots than the rank holds: the
    // rest is taken for padding (what a kernel reading past the last
    // boundary does).
    meta.resize(
        n_local,
        TokenMeta {
            doc: usize::MAX,
            pos: 0,
            real: false,
        },
    );
    Ok(meta)
}
