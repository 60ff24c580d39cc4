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
    FaultKind {
        id: "K1",
        title: "unshifted labels without -100 at each document's first slot",
    },
    FaultKind {
        id: "K2",
        title: "position_ids not reset at document starts",
    },
    FaultKind {
        id: "K3",
        title: "cu_seqlens off by one",
    },
    FaultKind {
        id: "K4",
        title: "the last document dropped",
    },
    FaultKind {
        id: "K5",
        title: "concatenation with EOS and no boundaries",
    },
    FaultKind {
        id: "K6",
        title: "document starts read where position_ids == 0",
    },
    FaultKind {
        id: "K7",
        title: "a split document's piece restarts its positions",
    },
    FaultKind {
        id: "K8",
        title: "an overlong document truncated",
    },
    FaultKind {
        id: "K9",
        title: "padding labelled with the pad id",
    },
    FaultKind {
        id: "K10",
        title: "cu_seqlens int64",
    },
    FaultKind {
        id: "D1",
        title: "the mean per microbatch, then averaged",
    },
    FaultKind {
        id: "D2",
        title: "the mean per data-parallel rank, then averaged",
    },
    FaultKind {
        id: "D3",
        title: "the real length rounded down to 2 cp",
    },
    FaultKind {
        id: "D4",
        title: "local boundaries from the unpadded cu_seqlens",
    },
    FaultKind {
        id: "D5",
        title: "labels shifted after the CP split",
    },
    FaultKind {
        id: "D6",
        title: "a ring merge without the max rescale",
    },
    FaultKind {
        id: "D7",
        title: "a per-sequence loss over pack rows",
    },
    FaultKind {
        id: "D8",
        title: "padding tokens counted in a denominator",
    },
    FaultKind {
        id: "W1",
        title: "window off by one",
    },
    FaultKind {
        id: "W2",
        title: "window aligned top-left when l_q != l_k",
    },
    FaultKind {
        id: "W3",
        title: "a window reaching across a document boundary",
    },
    FaultKind {
        id: "W4",
        title: "softcap applied after the mask",
    },
    FaultKind {
        id: "W5",
        title: "the softcap gradient without its chain factor",
    },
    FaultKind {
        id: "W6",
        title: "ALiBi from the pack's start, or with the wrong sign",
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

/// D1: two microbatches predicting these tokens, per-token losses all 1.0
/// in the first and all 0.0 in the second.
pub const D1_PREDICTED: [usize; 2] = [2, 6];
/// D1: the mean of the microbatch means (the fault).
pub const D1_MEAN_OF_MEANS: f64 = 0.5;
/// D1: the mean over the step's tokens.
pub const D1_PER_TOKEN: f64 = 0.25;

/// D2: two data-parallel ranks predicting these tokens, losses all 1.0 on
/// rank 0 and all 0.0 on rank 1.
pub const D2_PREDICTED: [usize; 2] = [3, 1];
/// D2: the mean of the ranks' means (the fault).
pub const D2_MEAN_OF_MEANS: f64 = 0.5;
/// D2: the mean over the step's tokens.
pub const D2_PER_TOKEN: f64 = 0.75;

/// D3: a document of 5 tokens at `cp = 2`.
pub const D3_LENGTH: usize = 5;
/// D3: the CP size.
pub const D3_CP: usize = 2;
/// D3: its padded length (rounded up to `2 cp`; the fault's 4 loses token 4).
pub const D3_PADDED: usize = 8;
/// D3: rank 0's slots (chunks 0 and 3 of 2 slots).
pub const D3_RANK0_SLOTS: [usize; 4] = [0, 1, 6, 7];

/// D4: documents of these lengths at `cp = 2`.
pub const D4_LENGTHS: [usize; 2] = [5, 2];
/// D4: each rank's local padded boundaries (the padded `[0, 8, 12]` / 2).
pub const D4_LOCAL_PADDED: [usize; 3] = [0, 4, 6];
/// D4: the fault's boundaries (the unpadded `[0, 5, 7]` / 2): document 0's
/// chunk-3 slots 2 and 3 of rank 0 taken for document 1.
pub const D4_LOCAL_FAULT: [usize; 3] = [0, 2, 3];

/// D5: a document of 8 tokens (ids `0..8`) at `cp = 2`: rank 0 holds
/// `[0 1 | 6 7]`; its labels, shifted before the split.
pub const D5_RANK0_LABELS: [i64; 4] = [1, 2, 7, -100];
/// D5: the fault's labels, shifted on rank 0's slots (token 1 predicts 6).
pub const D5_RANK0_LABELS_FAULT: [i64; 4] = [1, 6, 7, -100];

/// D6: one query over two key chunks of one key each: the scores.
pub const D6_SCORES: [f64; 2] = [0.0, 10.0];
/// D6: the keys' values (`d = 1`).
pub const D6_VALUES: [f64; 2] = [1.0, 0.0];
/// D6: the output, `1 / (1 + e^10)`, to 5 significant digits.
pub const D6_OUTPUT: f64 = 4.5398e-5;
/// D6: the fault's output (each partial's sum taken against its own max).
pub const D6_OUTPUT_FAULT: f64 = 0.5;
/// D6: the places the output is given to.
pub const D6_PLACES: f64 = 5e-9;

/// D7: two pack rows, per-document loss: row 0 holds documents predicting
/// 1 and 3 tokens (losses all 1.0 and all 0.0), row 1 one document
/// predicting 2 (losses 0.0).
pub const D7_ROWS: [&[usize]; 2] = [&[1, 3], &[2]];
/// D7: the mean over documents of their means, `(1 + 0 + 0) / 3`.
pub const D7_PER_DOCUMENT: f64 = 1.0 / 3.0;
/// D7: the fault's mean over rows of the row means, `(1/4 + 0) / 2`.
pub const D7_PER_ROW_SEQUENCE: f64 = 0.125;

/// D8: a document of 5 tokens at `cp = 2` predicts 4 tokens in 8 slots:
/// the per-token denominator is 4, not 8.
pub const D8_PREDICTED: usize = 4;
/// D8: the slots, padding included (the fault's denominator).
pub const D8_SLOTS: usize = 8;

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

    #[test]
    fn d1_d2_d7_d8_examples_add_up() {
        let mean = |ls: &[(usize, f64)]| {
            ls.iter().map(|(n, l)| *n as f64 * l).sum::<f64>()
                / ls.iter().map(|(n, _)| *n as f64).sum::<f64>()
        };
        for (p, mm, pt) in [
            (D1_PREDICTED, D1_MEAN_OF_MEANS, D1_PER_TOKEN),
            (D2_PREDICTED, D2_MEAN_OF_MEANS, D2_PER_TOKEN),
        ] {
            assert_eq!((1.0 + 0.0) / 2.0, mm);
            assert_eq!(mean(&[(p[0], 1.0), (p[1], 0.0)]), pt);
        }
        let row0 = mean(&[(D7_ROWS[0][0], 1.0), (D7_ROWS[0][1], 0.0)]);
        assert_eq!((row0 + 0.0) / 2.0, D7_PER_ROW_SEQUENCE);
        assert_eq!((1.0 + 0.0 + 0.0) / 3.0, D7_PER_DOCUMENT);
        let p = crate::step::cp_partition(&[vec![1; 5]], 2, None, None).unwrap();
        let labels = p.ranks.iter().flat_map(|r| &r.labels);
        assert_eq!(labels.filter(|&&l| l != -100).count(), D8_PREDICTED);
        assert_eq!(p.cu_seqlens_padded, [0, D8_SLOTS]);
    }

    #[test]
    fn d3_d4_d5_examples_are_the_partition() {
        use crate::step::{cp_partition, StepFault};
        let p = cp_partition(&[vec![1; D3_LENGTH]], D3_CP, None, None).unwrap();
        assert_eq!(p.cu_seqlens_padded, [0, D3_PADDED]);
        assert_eq!(p.ranks[0].token_index, D3_RANK0_SLOTS);
        let f = cp_partition(
            &[vec![1; D3_LENGTH]],
            D3_CP,
            None,
            Some(StepFault::D3RoundDown),
        );
        assert_eq!(f.unwrap().cu_seqlens, [0, 4]);
        let docs: Vec<Vec<i64>> = D4_LENGTHS.iter().map(|&l| vec![1; l]).collect();
        let p = cp_partition(&docs, 2, None, None).unwrap();
        assert_eq!(p.ranks[0].cu_seqlens_padded, D4_LOCAL_PADDED);
        let bad: Vec<usize> = p.cu_seqlens.iter().map(|c| c / 2).collect();
        assert_eq!(bad, D4_LOCAL_FAULT);
        let doc = vec![(0..8).collect::<Vec<i64>>()];
        let p = cp_partition(&doc, 2, None, None).unwrap();
        assert_eq!(p.ranks[0].labels, D5_RANK0_LABELS);
        let f = cp_partition(&doc, 2, None, Some(StepFault::D5ShiftAfterSplit)).unwrap();
        assert_eq!(f.ranks[0].labels, D5_RANK0_LABELS_FAULT);
    }

    #[test]
    fn d6_merge_rescales_by_the_max() {
        use crate::step::ring::{finish, merge, Partial};
        use ndarray::{Array2, Array3};
        let part = |i: usize| Partial {
            acc: Array3::from_elem((1, 1, 1), D6_VALUES[i]),
            m: Array2::from_elem((1, 1), D6_SCORES[i]),
            l: Array2::from_elem((1, 1), 1.0),
        };
        for (rescale, want, places) in [(true, D6_OUTPUT, D6_PLACES), (false, D6_OUTPUT_FAULT, 0.0)]
        {
            let mut a = part(0);
            merge(&mut a, &part(1), rescale);
            let got = finish(a).output[[0, 0, 0]];
            assert!((got - want).abs() <= places, "{rescale}: {got}");
        }
    }
}
