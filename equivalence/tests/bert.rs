//! The BERT suite (layer and whole model, packed == padded) on the reference,
//! and negative controls for docs/FAULTS.md P1, P2, P5, P7, P8: each planted fault
//! must make the suite fail, for the right reason.

use ndarray::Array2;
use packshard_equivalence::bert::{
    check_bert, fault_cases, reference_bert, run_bert_suite, run_layer_suite, BertCase, BertImpl,
};
use packshard_equivalence::planted::{AttentionHooks, Planted};
use packshard_equivalence::{Judge, Tolerance};
use packshard_reference::bert::layer::ReferenceLayer;
use packshard_reference::bert::{
    AttentionLayout, AttentionOutput, BertConfig, BertOutput, LossWeights, PackedAttention,
    Reduction, ReferenceAttention, TokenBatch, IGNORE_INDEX,
};
use packshard_reference::ops::{AttentionOp, Masked, Qkv, Varlen};
use packshard_reference::packing::{Algorithm, PackedBatch};
use packshard_reference::Error;

#[test]
fn reference_passes_the_bert_suite_in_both_packed_forms() {
    for form in [PackedAttention::Varlen, PackedAttention::BlockDiagonal] {
        let r = run_bert_suite(&reference_bert(form), 48).unwrap();
        assert_eq!(r.cases, fault_cases().len() * 2 + 48);
        // Non-degenerate: packs shared by several sequences, padding and empty sequences.
        assert!(r.shared_packs >= 20, "{r:?}");
        assert!(r.padding_or_empty >= 20, "{r:?}");
        assert!(r.observed.values > 50_000, "{r:?}");
        eprintln!(
            "BERT {form:?} packed vs padded: max abs {:e}, max rel (to tensor scale) {:e} over {} values",
            r.observed.max_abs, r.observed.max_rel, r.observed.values
        );
        assert!(r.observed.max_rel <= Tolerance::F64_REWRITE.rel);
    }
}

#[test]
fn reference_passes_the_layer_suite() {
    let seen = run_layer_suite(
        &ReferenceLayer(ReferenceAttention),
        Judge::Rewrite(Tolerance::F64_REWRITE),
        48,
    )
    .unwrap()
    .packed;
    assert!(seen.values > 5_000, "{seen:?}");
    eprintln!(
        "layer packed vs padded: max abs {:e}, max rel {:e}",
        seen.max_abs, seen.max_rel
    );
}

// ---- negative controls -------------------------------------------------------

/// The reference model with one fault planted in its packed path.
#[derive(Clone, Copy)]
enum Fault {
    /// P1: positions counted along the pack row instead of restarting.
    PositionsRunOn,
    /// P2: the packed rows attend with an all-ones mask.
    AllOnesMask,
    /// P5: the padding of each pack becomes a sequence (with an NSP label).
    PaddingAsSequence,
    /// P7: the MLM loss averaged per pack row instead of per sequence / token.
    PerRowAveraging,
    /// P8: the attention of a fully masked row is NaN.
    NanOnEmptyRows,
}

struct NanKernel;

/// A naive softmax over an all `-inf` row: `exp(-inf - -inf)` = NaN.
fn nan_on_empty(mut out: AttentionOutput) -> AttentionOutput {
    for i in 0..out.lse.ncols() {
        if out.lse[[0, i]] == f64::NEG_INFINITY {
            out.output
                .index_axis_mut(ndarray::Axis(0), i)
                .fill(f64::NAN);
            out.lse.column_mut(i).fill(f64::NAN);
        }
    }
    out
}

impl AttentionHooks for NanKernel {
    fn varlen_forward(&self, x: Qkv<'_>, p: &Varlen<'_>) -> Result<AttentionOutput, Error> {
        Ok(nan_on_empty(ReferenceAttention.varlen_forward(x, p)?))
    }
    fn masked_forward(&self, x: Qkv<'_>, m: Masked<'_>) -> Result<AttentionOutput, Error> {
        Ok(nan_on_empty(ReferenceAttention.masked_forward(x, m)?))
    }
}

struct Broken(Fault);

impl BertImpl for Broken {
    fn name(&self) -> String {
        "broken".into()
    }
    fn padded(&self, case: &BertCase) -> Result<BertOutput, Error> {
        let (model, t) = (&case.model, &case.targets);
        let tt = Some(&case.token_type_ids[..]);
        let pad = model.config.pad_token_id;
        let batch = TokenBatch::padded(
            &case.sequences,
            tt,
            case.max_seq_len,
            pad,
            case.position_offset,
        )?;
        let kernel: &dyn AttentionOp = match self.0 {
            Fault::NanOnEmptyRows => &Planted(NanKernel),
            _ => &ReferenceAttention,
        };
        let w = LossWeights::new(t, case.reduction);
        model.run_with(kernel, &batch, t, &w, true, None)
    }
    fn packed(&self, case: &BertCase, batch: &PackedBatch) -> Result<BertOutput, Error> {
        let (model, t, r) = (&case.model, &case.targets, case.reduction);
        let tt = &case.token_type_ids[..];
        let b = t.nsp_labels.len();
        let mut batch = batch.clone();
        if let Fault::PositionsRunOn = self.0 {
            let ids = batch.sequence_ids.clone();
            for ((p, c), v) in batch.position_ids.indexed_iter_mut() {
                if ids[[p, c]] != 0 {
                    *v = c as i64;
                }
            }
        }
        let mut tb = TokenBatch::packed(&batch, b, Some(tt), PackedAttention::BlockDiagonal)?;
        let mut targets = t.clone();
        let mut weights = LossWeights::new(t, r);
        match self.0 {
            Fault::AllOnesMask => {
                if let AttentionLayout::Dense { allowed, .. } = &mut tb.layout {
                    for m in allowed.iter_mut() {
                        m.fill(true);
                    }
                }
            }
            Fault::PaddingAsSequence => {
                let msl = batch.max_seq_len;
                for (p, cu) in batch.cu_seqlens.iter().enumerate() {
                    let end = *cu.last().unwrap();
                    if end < msl {
                        tb.sequences.push((p * msl + end..(p + 1) * msl).collect());
                        targets.mlm_labels.push(vec![IGNORE_INDEX; msl - end]);
                        targets.nsp_labels.push(0);
                    }
                }
                weights = LossWeights::new(&targets, r);
            }
            Fault::PerRowAveraging => {
                // Each pack row's mean over its predicted tokens, then the mean over rows.
                let counts: Vec<usize> = batch
                    .sequence_index
                    .iter()
                    .map(|row| row.iter().map(|&s| t.mlm_counts()[s]).sum())
                    .collect();
                let rows_with_any = counts.iter().filter(|&&c| c > 0).count() as f64;
                for (p, row) in batch.sequence_index.iter().enumerate() {
                    for &s in row {
                        for (w, &l) in weights.mlm[s].iter_mut().zip(&t.mlm_labels[s]) {
                            *w = if l == IGNORE_INDEX {
                                0.0
                            } else {
                                1.0 / (rows_with_any * counts[p] as f64)
                            };
                        }
                    }
                }
            }
            _ => {}
        }
        let kernel: &dyn AttentionOp = match self.0 {
            Fault::NanOnEmptyRows => &Planted(NanKernel),
            _ => &ReferenceAttention,
        };
        let mut out = model.run_with(kernel, &tb, &targets, &weights, true, None)?;
        out.sequences.truncate(b); // report the real sequences only
        Ok(out)
    }
}

fn fault_case(prefix: &str, reduction: Reduction) -> BertCase {
    let (i, (_, lengths, msl)) = fault_cases()
        .into_iter()
        .enumerate()
        .find(|(_, c)| c.0.starts_with(prefix))
        .unwrap();
    BertCase::seeded(
        BertConfig::tiny(13, 6, 2, 2, 7, msl + 2),
        &lengths,
        msl,
        Algorithm::Spfhp,
        reduction,
        0,
        i as u64,
    )
}

/// The fault must be caught on its docs/FAULTS.md case as `what` (and the whole
/// suite must fail), while the reference passes the same case.
fn caught(fault: Fault, prefix: &str, reduction: Reduction, what: &str) {
    let case = fault_case(prefix, reduction);
    check_bert(&reference_bert(PackedAttention::BlockDiagonal), &case).unwrap();
    let err = check_bert(&Broken(fault), &case).expect_err("the planted fault must be caught");
    assert!(err.what.contains(what), "caught, but as {err}");
    assert!(
        run_bert_suite(&Broken(fault), 8).is_err(),
        "the suite must catch it too"
    );
}

#[test]
fn p1_negative_control_positions_not_reset() {
    caught(Fault::PositionsRunOn, "P1", Reduction::PerToken, "hidden");
}

#[test]
fn p2_negative_control_all_ones_mask() {
    caught(Fault::AllOnesMask, "P2", Reduction::PerToken, "hidden");
}

#[test]
fn p5_negative_control_padding_as_a_sequence() {
    caught(
        Fault::PaddingAsSequence,
        "P5",
        Reduction::PerSequence,
        "nsp_loss",
    );
}

#[test]
fn p7_negative_control_per_row_averaging() {
    for reduction in Reduction::ALL {
        caught(Fault::PerRowAveraging, "P7", reduction, "mlm_loss");
    }
}

#[test]
fn p8_negative_control_nan_on_empty_rows() {
    let case = fault_case("P8", Reduction::PerToken);
    let err = check_bert(&Broken(Fault::NanOnEmptyRows), &case).expect_err("NaN must be caught");
    assert!(
        err.what.starts_with("packed grad") && err.detail.contains("P8"),
        "caught, but as {err}"
    );
    assert!(run_bert_suite(&Broken(Fault::NanOnEmptyRows), 8).is_err());
}

#[test]
fn p7_losses_on_the_faults_md_example() {
    // Two sequences with 2 and 6 predicted tokens and per-token losses all 1.0
    // and all 0.0: per-sequence mean 0.5, per-token mean 0.25.
    let weights_of = |r| packshard_reference::bert::loss::reduction_weights(&[2, 6], r);
    let loss = |w: Vec<f64>| 2.0 * w[0] * 1.0 + 6.0 * w[1] * 0.0;
    assert_eq!(loss(weights_of(Reduction::PerSequence)), 0.5);
    assert_eq!(loss(weights_of(Reduction::PerToken)), 0.25);
    let _ = Array2::<f64>::zeros((0, 0));
}
