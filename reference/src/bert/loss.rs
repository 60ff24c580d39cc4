//! MLM and NSP cross-entropy with explicit per-token weights, and the two
//! reductions of the packing paper.
//!
//! A small self-contained softmax cross-entropy (the vocabulary-parallel one
//! lives elsewhere): for logits `z: [m, c]` and targets `t: [m]`,
//! `loss_i = lse(z_i) - z_i[t_i]` and `d loss_i / d z_i = softmax(z_i) - onehot(t_i)`.
//!
//! A reduction is a weight per predicted token: the total loss is
//! `sum_i w_i loss_i`. [`Reduction::PerToken`] gives every masked token of
//! the batch the weight `1 / M`; [`Reduction::PerSequence`] averages each
//! sequence's MLM loss over its own masked tokens and then over the sequences
//! that have any, `w_i = 1 / (S * m_s)` (Krell et al., arXiv:2107.02027, §4:
//! the loss of a packed batch must be normalised per sequence, not per pack
//! row). Weights depend only on which tokens belong to which sequence, so
//! packing cannot change them (docs/FAULTS.md P7).

use ndarray::{Array1, Array2, ArrayView2};

use crate::error::{check_len, Error, Result};

/// HF's ignore index: a label of -100 is not predicted.
pub use crate::vocab::IGNORE_INDEX;

/// How the MLM loss of a batch is normalised.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reduction {
    /// Mean over every masked token of the batch.
    PerToken,
    /// Mean over each sequence's masked tokens, then over those sequences.
    PerSequence,
}

impl Reduction {
    /// Both reductions.
    pub const ALL: [Reduction; 2] = [Reduction::PerToken, Reduction::PerSequence];

    /// `per-token` or `per-sequence`.
    pub fn name(self) -> &'static str {
        match self {
            Reduction::PerToken => "per-token",
            Reduction::PerSequence => "per-sequence",
        }
    }
}

impl std::str::FromStr for Reduction {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "per-token" | "per_token" | "token" => Ok(Reduction::PerToken),
            "per-sequence" | "per_sequence" | "sequence" => Ok(Reduction::PerSequence),
            _ => Err(Error::invalid(
                "reduction",
                format!("unknown reduction {s:?}; known: per-token, per-sequence"),
            )),
        }
    }
}

/// The weights of `reduction` for predicted tokens grouped by sequence:
/// `counts[s]` is the number of predicted tokens of sequence `s`; returns
/// one weight per sequence that each of its predicted tokens gets
/// (0 for a sequence with none).
pub fn reduction_weights(counts: &[usize], reduction: Reduction) -> Vec<f64> {
    let total: usize = counts.iter().sum();
    let with_any = counts.iter().filter(|&&c| c > 0).count();
    counts
        .iter()
        .map(|&c| match (c, reduction) {
            (0, _) => 0.0,
            (_, Reduction::PerToken) => 1.0 / total as f64,
            (_, Reduction::PerSequence) => 1.0 / (with_any as f64 * c as f64),
        })
        .collect()
}

/// Softmax cross-entropy per row: `logits: [m, c]`, `targets: [m]` (each in
/// `0..c`). Returns `(loss: [m], lse: [m])`, natural log.
///
/// # Errors
/// [`Error::IndexOutOfRange`] (field `targets`) for a target outside `0..c`;
/// [`Error::ShapeMismatch`] if the lengths differ.
pub fn cross_entropy(
    logits: ArrayView2<f64>,
    targets: &[usize],
) -> Result<(Array1<f64>, Array1<f64>)> {
    let (m, c) = logits.dim();
    check_len("targets", targets.len(), "m", m, "rows of logits")?;
    let mut loss = Array1::zeros(m);
    let mut lse = Array1::zeros(m);
    for (i, row) in logits.rows().into_iter().enumerate() {
        let t = targets[i];
        if t >= c {
            return Err(Error::out_of_range("targets", i, t as i64, c));
        }
        let mx = row.fold(f64::NEG_INFINITY, |a, &b| a.max(b));
        let sum: f64 = row.iter().map(|&z| (z - mx).exp()).sum();
        lse[i] = mx + sum.ln();
        loss[i] = lse[i] - row[t];
    }
    Ok((loss, lse))
}

/// Backward of `sum_i weights[i] * loss_i`: `grad: [m, c]` with
/// `grad_i = weights[i] * (softmax(z_i) - onehot(t_i))`, using the forward's
/// `lse`.
pub fn cross_entropy_backward(
    logits: ArrayView2<f64>,
    targets: &[usize],
    lse: &Array1<f64>,
    weights: &[f64],
) -> Array2<f64> {
    let mut grad = Array2::zeros(logits.dim());
    for (i, row) in logits.rows().into_iter().enumerate() {
        let w = weights[i];
        let mut g = grad.row_mut(i);
        for (j, &z) in row.iter().enumerate() {
            g[j] = w * (z - lse[i]).exp();
        }
        g[targets[i]] -= w;
    }
    grad
}
