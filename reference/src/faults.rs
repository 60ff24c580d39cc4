//! The fault catalogue (`docs/FAULTS.md`) as data: each kind's identifier,
//! one line on what goes wrong, where it was seen, and its canonical example
//! with the right answer. Tests, negative controls, golden cases and the docs
//! use these values; none of them keeps a copy.
//!
//! A kind is a property, not one input: the suites check each kind over
//! generated cases, and every kind has a negative control (a planted fault
//! the suite must reject). The examples here are the smallest points of each.

/// One kind of fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FaultKind {
    /// `P1`, `V3`, ...: the heading in `docs/FAULTS.md`.
    pub id: &'static str,
    /// What goes wrong, in a few words.
    pub title: &'static str,
}

/// Every kind, in the order of `docs/FAULTS.md`.
pub const CATALOGUE: &[FaultKind] = &[
    FaultKind {
        id: "P1",
        title: "positions run on across sequences",
    },
    FaultKind {
        id: "P2",
        title: "attention leaks across sequences",
    },
    FaultKind {
        id: "P3",
        title: "tokens silently lost",
    },
    FaultKind {
        id: "P4",
        title: "zero-length sequences",
    },
    FaultKind {
        id: "P5",
        title: "padding becomes sequences",
    },
    FaultKind {
        id: "P6",
        title: "position offset",
    },
    FaultKind {
        id: "P7",
        title: "loss normalisation changes with packing",
    },
    FaultKind {
        id: "P8",
        title: "fully masked rows give NaN",
    },
    FaultKind {
        id: "V1",
        title: "label smoothing computed per shard",
    },
    FaultKind {
        id: "V2",
        title: "padded vocabulary entries enter the softmax",
    },
    FaultKind {
        id: "V3",
        title: "input gradient not summed over shards",
    },
    FaultKind {
        id: "V4",
        title: "vocabulary not divisible by the shard count",
    },
    FaultKind {
        id: "V5",
        title: "token ids out of range",
    },
    FaultKind {
        id: "V6",
        title: "a shard whose logits are all -inf",
    },
    FaultKind {
        id: "O1",
        title: "logit softcap computed as z * tanh(z)",
    },
    FaultKind {
        id: "O2",
        title: "a per-token grad_output read as a scalar",
    },
    FaultKind {
        id: "O3",
        title: "z-loss added when it is off",
    },
    FaultKind {
        id: "O4",
        title: "label smoothing on huge logits gives inf",
    },
    FaultKind {
        id: "O6",
        title: "a placeholder target matches a padded column",
    },
    FaultKind {
        id: "C1",
        title: "labels shifted over the whole pack",
    },
    FaultKind {
        id: "C2",
        title: "document mask from EOS after the shift",
    },
    FaultKind {
        id: "C3",
        title: "boundaries from position_ids merge one-token documents",
    },
    FaultKind {
        id: "C4",
        title: "padding between documents taken for tail padding",
    },
    FaultKind {
        id: "C5",
        title: "causal alignment when query and key lengths differ",
    },
    FaultKind {
        id: "C6",
        title: "a continuation chunk keeps its positions",
    },
    FaultKind {
        id: "C7",
        title: "the token-count denominator of a packed batch",
    },
];

/// The kind called `id`.
pub fn kind(id: &str) -> Option<&'static FaultKind> {
    CATALOGUE.iter().find(|k| k.id == id)
}

/// P1: lengths `[100, 200]` in one row: positions `0..100` then `0..200`.
pub const P1_LENGTHS: [usize; 2] = [100, 200];

/// P2: lengths `[3, 5]` in a pack of 8; sequence 2's outputs must not move
/// when sequence 1's tokens change.
pub const P2_LENGTHS: [usize; 2] = [3, 5];
/// P2: the pack length.
pub const P2_PACK: usize = 8;

/// P3: lengths `[4, 2, 3, 1]` with packs of 3: an error naming sequence 0 by
/// default; split keeps all 10 tokens.
pub const P3_LENGTHS: [usize; 4] = [4, 2, 3, 1];
/// P3: the pack length.
pub const P3_PACK: usize = 3;

/// P4: lengths `[1, 0, 1]`: no crash anywhere; the empty one counted.
pub const P4_LENGTHS: [usize; 3] = [1, 0, 1];

/// P5: one sequence of 3 in a pack of 8: `cu_seqlens` `[0, 3]`.
pub const P5_LENGTH: usize = 3;
/// P5: the pack length.
pub const P5_PACK: usize = 8;
/// P5: the sequence ids of the pack (0 = padding).
pub const P5_SEQUENCE_IDS: [usize; 8] = [1, 1, 1, 0, 0, 0, 0, 0];

/// P6: a sequence of 3 at position offset 2 gets positions `[2, 3, 4]`.
pub const P6_OFFSET: usize = 2;
/// P6: the positions.
pub const P6_POSITIONS: [usize; 3] = [2, 3, 4];

/// P7: two sequences of 2 and 6 predicted tokens, per-token losses all 1.0
/// and all 0.0.
pub const P7_PREDICTED: [usize; 2] = [2, 6];
/// P7: the per-sequence mean.
pub const P7_PER_SEQUENCE: f64 = 0.5;
/// P7: the per-token mean.
pub const P7_PER_TOKEN: f64 = 0.25;

/// P8: sequence ids `[1, 1, 2, 0]` with padding keys masked: the padding
/// query's output and gradients are 0, never NaN.
pub const P8_SEQUENCE_IDS: [usize; 4] = [1, 1, 2, 0];

/// V1: the logits of one token over `v = 8`, split into 2 shards of 4.
pub const V1_LOGITS: [f64; 8] = [1.0, 2.0, 0.0, -1.0, 3.0, 0.5, 1.5, -2.0];
/// V1: the target.
pub const V1_TARGET: i64 = 4;
/// V1: the label smoothing.
pub const V1_SMOOTHING: f64 = 0.1;
/// V1: the loss in PyTorch's convention (`(1 - a) onehot + a / V`), to 5 places.
pub const V1_LOSS_PYTORCH: f64 = 0.87051;
/// V1: the loss in Megatron's convention (`a` over the `V - 1` others), to 5 places.
pub const V1_LOSS_MEGATRON: f64 = 0.90444;
/// V1: the places the two losses are given to.
pub const V1_PLACES: f64 = 5e-6;

/// V2: the real logits of one token, `v = 10` padded to 12 for 3 shards.
pub const V2_LOGITS: [f64; 10] = [2.0, 1.0, 0.5, 3.0, -1.0, 0.0, 1.5, 2.5, -0.5, 1.0];
/// V2: the target.
pub const V2_TARGET: i64 = 7;
/// V2: the shard count.
pub const V2_SHARDS: usize = 3;
/// V2: the loss, to 6 places, whatever the padded entries hold.
pub const V2_LOSS: f64 = 1.474030;
/// V2: the places the loss is given to.
pub const V2_PLACES: f64 = 5e-7;

/// V3: the hidden state of one token (`h = 2`).
pub const V3_HIDDEN: [f64; 2] = [1.0, -1.0];
/// V3: the output-layer rows (`v = 4`), split 2 + 2.
pub const V3_WEIGHT: [[f64; 2]; 4] = [[1.0, 0.0], [0.0, 1.0], [0.5, 0.5], [-1.0, 2.0]];
/// V3: the target.
pub const V3_TARGET: i64 = 2;
/// V3: `dL/dx` on every rank, to 4 places.
pub const V3_GRAD_HIDDEN: [f64; 2] = [0.2661, -0.2661];
/// V3: the places the gradient is given to.
pub const V3_PLACES: f64 = 5e-5;

/// V4: a vocabulary (Gemma's 256k class) over 8 shards: accepted, results equal.
pub const V4_VOCAB: usize = 250_682;
/// V4: the shard count.
pub const V4_SHARDS: usize = 8;

/// V5: an embedding lookup of `id == v` (or a negative id) is an
/// index-out-of-range error in the unsharded and the sharded layer alike.
pub const V5_VOCAB: usize = 8;
/// V5: the ids that must be refused for [`V5_VOCAB`].
pub const V5_BAD_IDS: [i64; 2] = [8, -1];

/// V6: one shard whose logits are all `-inf` contributes 0 to the sum, not
/// NaN: logits of `v = 6` over 2 shards, the second all `-inf`.
pub const V6_LOGITS: [f64; 6] = [
    0.5,
    -1.0,
    2.0,
    f64::NEG_INFINITY,
    f64::NEG_INFINITY,
    f64::NEG_INFINITY,
];
/// V6: the target (in the finite shard).
pub const V6_TARGET: i64 = 2;

/// O1: the softcap `c` of the example (logits [`V1_LOGITS`], target [`V1_TARGET`]).
pub const O1_SOFTCAP: f64 = 2.0;
/// O1: the loss with the logits capped to `c * tanh(z / c)`, to 5 places.
pub const O1_LOSS: f64 = 1.18683;
/// O1: the loss of the fault `z * tanh(z)` (flash-attention PR 2402), to 5 places.
pub const O1_LOSS_FAULT: f64 = 0.79840;
/// O1: the places the losses are given to.
pub const O1_PLACES: f64 = 5e-6;
/// O2: the targets of the two tokens (both with the logits [`V1_LOGITS`]),
/// reduction `none`.
pub const O2_TARGETS: [i64; 2] = [V1_TARGET, 1];
/// O2: the upstream gradient `grad_output: [n]` of the example.
pub const O2_GRAD_OUTPUT: [f64; 2] = [1.0, 0.0];
/// O2: the second token's gradient at its target (column 1) under the
/// fault (every row scaled by `grad_output[0]`, Liger-Kernel PR 1298):
/// `softmax(V1)_1 - 1`, to 5 places; the right value is 0.
pub const O2_GRAD_FAULT: f64 = -0.80466;
/// O3: the shift added to [`V1_LOGITS`] (so that `logsumexp` is 33.633).
pub const O3_SHIFT: f64 = 30.0;
/// O3: the loss with `z_loss = 0`, to 5 places (plain cross-entropy).
pub const O3_LOSS: f64 = 0.63301;
/// O3: the loss of the fault (`1e-4 * logsumexp^2` added although off), to 5 places.
pub const O3_LOSS_FAULT: f64 = 0.74613;
/// O3: the coefficient the fault uses when the option is off.
pub const O3_FAULT_COEFFICIENT: f64 = 1e-4;
/// O4: the scale of [`V1_LOGITS`].
pub const O4_SCALE: f64 = 1000.0;
/// O4: the PyTorch label smoothing of the example.
pub const O4_SMOOTHING: f64 = 0.1;
/// O4: the loss (`0.1 / 8 x 19000`), finite; the fault gives `inf`.
pub const O4_LOSS: f64 = 237.5;
/// O6: the padding of the [`V2_LOGITS`] example (`v = 10` padded to 12).
pub const O6_PADDING: [f64; 2] = [9.0, -4.0];
/// O6: the loss of the fault (the first padding column read as the target
/// logit on the last shard): [`V2_LOSS`] minus 9, to 6 places.
pub const O6_LOSS_FAULT: f64 = -7.525970;
/// C1: a pack `[a b | c d]` (ids 10..13) as document ids.
pub const C1_DOC_IDS: [usize; 4] = [1, 1, 2, 2];
/// C1: its input ids.
pub const C1_INPUT_IDS: [i64; 4] = [10, 11, 12, 13];
/// C1: its next-token labels (`-100`: no target).
pub const C1_LABELS: [i64; 4] = [11, -100, 13, -100];

/// C2: documents of 3 and 4 tokens in one row, with EOS targets.
pub const C2_LENGTHS: [usize; 2] = [3, 4];

/// C3: positions of documents `[3, 1, 2]`.
pub const C3_POSITION_IDS: [usize; 6] = [0, 1, 2, 0, 0, 1];
/// C3: their `cu_seqlens`.
pub const C3_CU_SEQLENS: [usize; 4] = [0, 3, 4, 6];

/// C4: document ids with padding between documents.
pub const C4_DOC_IDS: [usize; 8] = [1, 1, 1, 0, 2, 2, 0, 0];
/// C4: the real slots.
pub const C4_SLOTS: [usize; 5] = [0, 1, 2, 4, 5];
/// C4: `cu_seqlens` over them.
pub const C4_CU_SEQLENS: [usize; 3] = [0, 3, 5];

/// C5: 2 queries over 5 keys, causal, bottom-right: the mask.
pub const C5_MASK: [[bool; 5]; 2] = [
    [true, true, true, true, false],
    [true, true, true, true, true],
];

/// C6: a continuation chunk's positions, kept as given.
pub const C6_POSITIONS: [usize; 4] = [5, 6, 7, 8];

/// C7: 2 rows, each documents of these lengths.
pub const C7_ROW_LENGTHS: [usize; 2] = [3, 5];
/// C7: the predicted tokens of the batch.
pub const C7_PREDICTED: usize = 12;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_unique_and_titled() {
        for (i, k) in CATALOGUE.iter().enumerate() {
            assert!(CATALOGUE[i + 1..].iter().all(|o| o.id != k.id), "{}", k.id);
            assert!(!k.title.is_empty());
            assert_eq!(kind(k.id), Some(k));
        }
        assert_eq!(kind("Z9"), None);
    }

    /// The reference cross-entropy of the logits `z` (`[n, v]`) at
    /// `targets` under `config`, with gradients when `want_grad`.
    fn ce(
        z: &ndarray::Array2<f64>,
        targets: &[i64],
        config: &crate::vocab::LossConfig,
        want_grad: bool,
    ) -> crate::vocab::CrossEntropy {
        use crate::vocab::{cross_entropy, LossCall};
        cross_entropy(z.view(), &LossCall::with_flag(targets, config, want_grad)).unwrap()
    }

    #[test]
    fn v1_and_v2_values_are_the_reference_losses() {
        use crate::vocab::{LossConfig, SmoothingConvention};
        let z = ndarray::Array2::from_shape_vec((1, 8), V1_LOGITS.to_vec()).unwrap();
        for (conv, want) in [
            (SmoothingConvention::PyTorch, V1_LOSS_PYTORCH),
            (SmoothingConvention::Megatron, V1_LOSS_MEGATRON),
        ] {
            let c = LossConfig::default().with_smoothing(V1_SMOOTHING, conv);
            let l = ce(&z, &[V1_TARGET], &c, false).loss;
            assert!((l - want).abs() < V1_PLACES, "{conv:?}: {l}");
        }
        let z = ndarray::Array2::from_shape_vec((1, 10), V2_LOGITS.to_vec()).unwrap();
        let l = ce(&z, &[V2_TARGET], &LossConfig::default(), false).loss;
        assert!((l - V2_LOSS).abs() < V2_PLACES, "{l}");
    }

    #[test]
    fn o2_values_are_the_reference_gradients() {
        use crate::vocab::{cross_entropy, GradRequest, LossCall, LossConfig, Reduction};
        let z = ndarray::Array2::from_shape_fn((2, 8), |(_, j)| V1_LOGITS[j]);
        let none = LossConfig::default().with_reduction(Reduction::None);
        let grad = |g: &[f64]| {
            let call = LossCall::new(&O2_TARGETS, &none, GradRequest::Upstream(g));
            cross_entropy(z.view(), &call).unwrap().grad_logits.unwrap()
        };
        let g = grad(&O2_GRAD_OUTPUT);
        assert!(g.row(1).iter().all(|&x| x == 0.0), "{g}");
        let loss_only = ce(&z, &O2_TARGETS, &none, true).grad_logits.unwrap();
        assert_eq!(g.row(0), loss_only.row(0));
        // The fault: grad_output[0] for every row.
        let fault = grad(&[O2_GRAD_OUTPUT[0]; 2]);
        assert!((fault[[1, 1]] - O2_GRAD_FAULT).abs() < O1_PLACES, "{fault}");
    }

    #[test]
    fn o1_values_are_the_reference_losses() {
        use crate::vocab::LossConfig;
        let z = ndarray::Array2::from_shape_vec((1, 8), V1_LOGITS.to_vec()).unwrap();
        let capped = LossConfig::default().with_softcap(O1_SOFTCAP);
        let l = ce(&z, &[V1_TARGET], &capped, false).loss;
        assert!((l - O1_LOSS).abs() < O1_PLACES, "{l}");
        let fault = z.mapv(|x| x * x.tanh());
        let l = ce(&fault, &[V1_TARGET], &LossConfig::default(), false).loss;
        assert!((l - O1_LOSS_FAULT).abs() < O1_PLACES, "{l}");
    }

    #[test]
    fn o3_and_o4_values_are_the_reference_losses() {
        use crate::vocab::cross_entropy::token_loss;
        use crate::vocab::{LossConfig, SmoothingConvention};
        let z = ndarray::Array2::from_shape_vec((1, 8), V1_LOGITS.to_vec()).unwrap();
        let shifted = z.mapv(|x| x + O3_SHIFT);
        let off = LossConfig::default();
        let ce0 = ce(&shifted, &[V1_TARGET], &off, false);
        assert!((ce0.loss - O3_LOSS).abs() < O1_PLACES, "{}", ce0.loss);
        // Bit for bit the cross-entropy of the statistics, no term added.
        assert_eq!(ce0.loss.to_bits(), ce0.stats[0].cross_entropy().to_bits());
        let t = Some(V1_TARGET as usize);
        assert_eq!(
            token_loss(&ce0.stats[0], t, &off).to_bits(),
            ce0.loss.to_bits()
        );
        let lse = ce0.stats[0].logsumexp();
        let fault = ce0.loss + O3_FAULT_COEFFICIENT * lse * lse;
        assert!((fault - O3_LOSS_FAULT).abs() < O1_PLACES, "{fault}");
        let huge = z.mapv(|x| x * O4_SCALE);
        let smoothed = off.with_smoothing(O4_SMOOTHING, SmoothingConvention::PyTorch);
        let l = ce(&huge, &[V1_TARGET], &smoothed, true);
        assert!((l.loss - O4_LOSS).abs() < 1e-9, "{}", l.loss);
        assert!(l.grad_logits.unwrap().iter().all(|g| g.is_finite()));
    }

    #[test]
    fn c5_mask_is_the_reference_mask() {
        use crate::attention::varlen_mask;
        use crate::ops::Varlen;
        let m = varlen_mask(&Varlen::cross(&[0, 2], &[0, 5], true, 1.0), 2, 5).unwrap();
        for (r, row) in C5_MASK.iter().enumerate() {
            for (c, &want) in row.iter().enumerate() {
                assert_eq!(m[[r, c]], want, "[{r}, {c}]");
            }
        }
    }

    #[test]
    fn v3_gradient_is_the_reference_gradient() {
        use crate::vocab::{linear_cross_entropy, LossCall, LossConfig};
        let x = ndarray::Array2::from_shape_vec((1, 2), V3_HIDDEN.to_vec()).unwrap();
        let w = ndarray::Array2::from_shape_fn((4, 2), |(i, j)| V3_WEIGHT[i][j]);
        let l = linear_cross_entropy(
            x.view(),
            w.view(),
            &LossCall::with_flag(&[V3_TARGET], &LossConfig::default(), true),
        )
        .unwrap();
        let g = l.grad_hidden.unwrap();
        for j in 0..2 {
            assert!((g[[0, j]] - V3_GRAD_HIDDEN[j]).abs() < V3_PLACES, "{g}");
        }
    }
}
