//! The causal-LM suite (packed == unpacked for logits, the loss under each
//! reduction and every gradient; continuation chunks) on the reference, and
//! a negative control for each of docs/FAULTS.md C1–C7 and P7: a tiny,
//! deliberately wrong implementation the suite must reject, for the right
//! reason (the quantity its failure names).

use ndarray::Array2;
use packshard_equivalence::causal::{
    check_bottom_right, chunk_varlen, fault_cases, reference_causal_lm, run_causal_suite,
    run_chunk_suite, run_varlen, CausalBatch, CausalForm, CausalLmImpl, CausalRun,
    ReferenceCausalLm, VarlenTokens,
};
use packshard_equivalence::planted::{Planted, TopLeftCausal};
use packshard_equivalence::{Judge, Mismatch, Tolerance};
use packshard_reference::attention::ReferenceAttention;
use packshard_reference::decoder::{
    loss_weights, next_token_labels, position_ids_from_cu_seqlens, varlen_from_doc_ids,
    CausalReduction, DecoderConfig, DecoderModel, KvCache,
};
use packshard_reference::vocab::IGNORE_INDEX;
use packshard_reference::Error;

const JUDGE: Judge = Judge::Rewrite(Tolerance::F64_REWRITE);

#[test]
fn reference_passes_the_causal_suite_in_both_forms() {
    for form in [CausalForm::Varlen, CausalForm::BlockCausal] {
        let r = run_causal_suite(&reference_causal_lm(form), JUDGE, 96).unwrap();
        assert_eq!(r.cases, fault_cases().len() * 3 + 96);
        // Non-degenerate: shared rows, one-token documents beside others,
        // padding between documents, continuation offsets, EOS targets.
        assert!(r.shared_rows >= 50, "{r:?}");
        assert!(r.one_token >= 20, "{r:?}");
        assert!(r.gaps >= 15, "{r:?}");
        assert!(r.continuations >= 25, "{r:?}");
        assert!(r.eos >= 25, "{r:?}");
        assert!(r.grads.values > 50_000, "{r:?}");
        for (what, o) in [
            ("logits", r.logits),
            ("loss", r.loss),
            ("grads", r.grads),
            ("truth", r.truth),
        ] {
            eprintln!(
                "causal {form:?} {what}: max abs {:e}, max rel {:e} over {} values",
                o.max_abs, o.max_rel, o.values
            );
            assert!(o.max_rel <= Tolerance::F64_REWRITE.rel, "{what}: {o:?}");
        }
    }
}

#[test]
fn reference_passes_the_chunk_suite() {
    let o = run_chunk_suite(
        &reference_causal_lm(CausalForm::Varlen),
        Tolerance::F64_REWRITE,
        64,
    )
    .unwrap();
    assert!(o.values > 2_000, "{o:?}");
    for (h, kv, d) in [(1, 1, 2), (4, 2, 2), (3, 1, 4)] {
        check_bottom_right(&ReferenceAttention, (h, kv, d), 7, Tolerance::F64_REWRITE).unwrap();
    }
    eprintln!(
        "chunk vs whole: max abs {:e}, max rel {:e} over {} values",
        o.max_abs, o.max_rel, o.values
    );
}

/// An f32 relative judge: the reference pipeline (f64 attention) against
/// its baseline (the baseline's f32 attention) passes; an implementation
/// without a baseline is refused, not passed.
#[test]
fn relative_judges_need_a_baseline() {
    let judge = Judge::Relative {
        rule: packshard_equivalence::RelativeRule::F32,
        inputs: packshard_reference::ops::Precision::F64,
        packed: Tolerance::F32_REWRITE,
    };
    let r = run_causal_suite(&reference_causal_lm(CausalForm::Varlen), judge, 4).unwrap();
    assert!(r.relative.count > 100, "{r:?}");
    let m = run_causal_suite(&Faulty(Fault::MeanPerPackRow), judge, 1).unwrap_err();
    assert!(
        m.to_string()
            .contains("needs the implementation's f32 baseline"),
        "{m}"
    );
}

// ---- negative controls -------------------------------------------------------

/// The reference pipeline with one fault planted.
#[derive(Clone, Copy, Debug)]
enum Fault {
    /// C1: labels shifted over the whole row (a document's last token
    /// predicts the next document's first).
    LabelsAcrossThePack,
    /// C2: document boundaries from EOS tokens in the inputs (after the
    /// shift EOS is only in the labels: each row becomes one document).
    MaskFromEosInInputs,
    /// C3: boundaries where `position_ids` strictly decrease.
    BoundariesFromStrictDecrease,
    /// C4: the real tokens taken to be the first ones of each row.
    PaddingTakenForTail,
    /// C6: positions recomputed from 0 for every document.
    PositionsRestarted,
    /// C7: per-token denominator `real tokens - rows`.
    DenominatorPerRowShift,
    /// P7: the per-document mean taken per pack row.
    MeanPerPackRow,
    /// The loss reported with the declared weights, the backward run with
    /// the per-pack-row mean (a gradient normalised apart from its loss, as
    /// in the gradient-accumulation bugs): only the gradients show it.
    GradientsPerPackRow,
}

struct Faulty(Fault);

impl CausalLmImpl for Faulty {
    /// Every config, as the reference it plants a fault in.
    fn supports(&self, _: &DecoderConfig) -> bool {
        true
    }

    fn name(&self) -> String {
        format!("{:?}", self.0)
    }

    fn run(
        &self,
        model: &DecoderModel,
        b: &CausalBatch,
        reduction: CausalReduction,
    ) -> Result<CausalRun, Error> {
        let n = b.input_ids.len();
        let row = b.row_len;
        let mut labels = next_token_labels(&b.input_ids, &b.doc_ids, b.eos)?;
        let (mut slots, mut cu) = varlen_from_doc_ids(&b.doc_ids)?;
        let real = |i: usize| b.doc_ids[i] != 0;
        match self.0 {
            Fault::LabelsAcrossThePack => {
                labels = (0..n)
                    .map(|i| {
                        let j = i + 1;
                        if real(i) && j % row != 0 && real(j) {
                            b.input_ids[j]
                        } else {
                            IGNORE_INDEX
                        }
                    })
                    .collect();
            }
            Fault::MaskFromEosInInputs => {
                cu = vec![0];
                for (t, &s) in slots.iter().enumerate() {
                    let row_start = t > 0 && s / row != slots[t - 1] / row;
                    let after_eos = t > 0 && Some(b.input_ids[slots[t - 1]]) == b.eos;
                    if row_start || after_eos {
                        cu.push(t);
                    }
                }
                if !slots.is_empty() {
                    cu.push(slots.len());
                }
            }
            Fault::BoundariesFromStrictDecrease => {
                cu = vec![0];
                for t in 1..slots.len() {
                    if b.position_ids[slots[t]] < b.position_ids[slots[t - 1]] {
                        cu.push(t);
                    }
                }
                if !slots.is_empty() {
                    cu.push(slots.len());
                }
            }
            Fault::PaddingTakenForTail => {
                slots = (0..b.rows())
                    .flat_map(|r| {
                        let k = (r * row..(r + 1) * row).filter(|&i| real(i)).count();
                        r * row..r * row + k
                    })
                    .collect();
            }
            _ => {}
        }
        let mut weights = loss_weights(&labels, &b.doc_ids, reduction, b.num_documents)?;
        let predicted: Vec<bool> = labels.iter().map(|&l| l != IGNORE_INDEX).collect();
        match (self.0, reduction) {
            (Fault::DenominatorPerRowShift, CausalReduction::PerToken) => {
                let denom = (0..n).filter(|&i| real(i)).count() - b.rows();
                for (w, &p) in weights.iter_mut().zip(&predicted) {
                    *w = if p { 1.0 / denom as f64 } else { 0.0 };
                }
            }
            (Fault::MeanPerPackRow, CausalReduction::PerDocument)
            | (Fault::GradientsPerPackRow, _) => {
                let per_row: Vec<usize> = (0..b.rows())
                    .map(|r| {
                        predicted[r * row..(r + 1) * row]
                            .iter()
                            .filter(|&&p| p)
                            .count()
                    })
                    .collect();
                let rows_with_any = per_row.iter().filter(|&&c| c > 0).count();
                for (i, w) in weights.iter_mut().enumerate() {
                    if predicted[i] {
                        *w = 1.0 / (rows_with_any * per_row[i / row]) as f64;
                    }
                }
            }
            _ => {}
        }
        let mut t = VarlenTokens::new(b, slots, cu);
        if let Fault::PositionsRestarted = self.0 {
            t.positions = position_ids_from_cu_seqlens(&t.cu_seqlens, 0)?;
        }
        let labels_g = t.gather(&labels);
        let mut run = run_varlen(
            model,
            &ReferenceAttention,
            b,
            &t,
            &labels_g,
            &t.gather(&weights),
        )?;
        if let Fault::GradientsPerPackRow = self.0 {
            let declared = loss_weights(&labels, &b.doc_ids, reduction, b.num_documents)?;
            let declared = t.gather(&declared);
            let right = run_varlen(model, &ReferenceAttention, b, &t, &labels_g, &declared)?;
            run.loss = right.loss;
        }
        Ok(run)
    }

    fn chunk_logits(
        &self,
        model: &DecoderModel,
        b: &CausalBatch,
        past: &KvCache,
    ) -> Result<Array2<f64>, Error> {
        let mut t = VarlenTokens::of(b)?;
        if let Fault::PositionsRestarted = self.0 {
            t.positions = position_ids_from_cu_seqlens(&t.cu_seqlens, 0)?;
        }
        chunk_varlen(model, &ReferenceAttention, b, &t, past)
    }
}

fn rejected(fault: Fault) -> Mismatch {
    match run_causal_suite(&Faulty(fault), JUDGE, 24) {
        Ok(r) => panic!("{fault:?} passed the suite: {r:?}"),
        Err(m) => m,
    }
}

fn assert_names(m: &Mismatch, parts: &[&str]) {
    for p in parts {
        assert!(m.what.contains(p), "expected {p:?} in {m}");
    }
}

/// A test that the suite rejects `$fault`, its first failure naming every
/// one of `$parts`.
macro_rules! caught {
    ($name:ident, $fault:expr, [$($part:expr),+ $(,)?]) => {
        #[test]
        fn $name() {
            let m = rejected($fault);
            assert_names(&m, &[$($part),+]);
        }
    };
}

caught!(
    c1_labels_across_the_pack_are_caught,
    Fault::LabelsAcrossThePack,
    ["C1 pack [a b | c d]", "packed vs padded: loss"]
);

caught!(
    c2_a_document_mask_from_eos_in_the_inputs_is_caught,
    Fault::MaskFromEosInInputs,
    ["packed vs padded: document", "logits"]
);

// The C1 and C2 cases hold no one-token document: the first to fail is
// C3's. Padded rows flattened read the same positions, so the truth
// check sees it first.
caught!(
    c3_boundaries_from_a_strict_decrease_are_caught,
    Fault::BoundariesFromStrictDecrease,
    ["C3 positions [0,1,2,0,0,1]", "document", "logits"]
);

caught!(
    c4_padding_between_documents_taken_for_tail_padding_is_caught,
    Fault::PaddingTakenForTail,
    [
        "C4 doc ids [1,1,1,0,2,2,0,0]",
        "packed vs padded: document",
        "logits"
    ]
);

#[test]
fn c6_restarted_positions_are_caught_on_continuation_chunks() {
    // Without a cache, rotary attention sees relative positions only: a
    // document shifted by a constant gives the same logits, so the packed ==
    // padded suite passes it (honestly: nothing it computes changes). Over
    // its cache, the chunk's restarted positions break the relative ones.
    assert!(run_causal_suite(&Faulty(Fault::PositionsRestarted), JUDGE, 8).is_ok());
    let m = run_chunk_suite(
        &Faulty(Fault::PositionsRestarted),
        Tolerance::F64_REWRITE,
        8,
    )
    .unwrap_err();
    assert_names(&m, &["C5/C6 chunks", "chunk of document 0: logits"]);
}

caught!(
    c7_a_token_count_denominator_off_by_the_rows_is_caught,
    Fault::DenominatorPerRowShift,
    ["(per-token)", "loss"]
);

caught!(
    p7_a_mean_per_pack_row_is_caught,
    Fault::MeanPerPackRow,
    ["(per-document)", "packed vs padded: loss"]
);

/// C5: causal masks aligned top-left (`c <= r`) when queries and keys
/// differ in length, instead of bottom-right (`c <= r + l_k - l_q`).
const TOP_LEFT: Planted<TopLeftCausal> = Planted(TopLeftCausal);

#[test]
fn c5_top_left_causal_alignment_is_caught() {
    // Top-left and bottom-right agree when queries and keys match: the
    // self-attention suite cannot see it; the chunk checks must.
    let top_left = ReferenceCausalLm {
        attention: &TOP_LEFT,
        form: CausalForm::Varlen,
    };
    assert!(run_causal_suite(&top_left, JUDGE, 4).is_ok());
    let m = run_chunk_suite(&top_left, Tolerance::F64_REWRITE, 8).unwrap_err();
    assert_names(&m, &["C5/C6 chunks", "chunk of document 0: logits"]);
    let m = check_bottom_right(&TOP_LEFT, (2, 1, 2), 7, Tolerance::F64_REWRITE).unwrap_err();
    assert_names(&m, &["query 0 of 3 over 1 key"]);
}

// Logits and loss are right: the suite must reach the gradients.
caught!(
    gradients_normalised_apart_from_the_loss_are_caught,
    Fault::GradientsPerPackRow,
    ["vs padded: grad "]
);
