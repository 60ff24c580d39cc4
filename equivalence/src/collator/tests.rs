//! Positive and negative controls of the collator check (docs/FAULTS.md
//! C1–C4, C6, C7, K1–K9).

use ndarray::{array, Array2};
use packshard_reference::packing::Algorithm;

use super::faults::{CollatorFault, Planted, RowFault};
use super::reference::MaskForm;
use super::*;

fn opts(labels: LabelForm) -> CollatorOptions {
    CollatorOptions {
        cases: 60,
        labels,
        ..Default::default()
    }
}

fn feature(ids: &[i64]) -> Feature {
    Feature {
        input_ids: ids.to_vec(),
        ..Default::default()
    }
}

#[test]
fn flattening_passes_in_both_label_forms_with_every_option() {
    for labels in [LabelForm::Shifted, LabelForm::Unshifted] {
        for mask in [None, Some(MaskForm::Block), Some(MaskForm::Additive)] {
            for separator_id in [None, Some(7)] {
                let c = Flattening {
                    separator_id,
                    mask,
                    ..Flattening::new(labels)
                };
                let o = CollatorOptions {
                    separator_id,
                    ..opts(labels)
                };
                let report = check_collator(&c, &o).unwrap_or_else(|f| panic!("{f}"));
                assert!(report.cases > 60, "{report:?}");
                assert_eq!(report.rows, report.cases, "one flattened row per case");
                for f in [
                    "labels",
                    "position_ids",
                    "cu_seqlens",
                    "seq_idx",
                    "max_seqlen",
                ] {
                    assert!(report.fields.contains(&f), "{f} judged");
                }
                assert_eq!(report.fields.contains(&"attention_mask"), mask.is_some());
            }
        }
    }
}

#[test]
fn flattening_passes_with_eos_terminated_documents() {
    let o = CollatorOptions {
        eos_token_id: Some(2),
        ..opts(LabelForm::Shifted)
    };
    let cases = generate(&o);
    assert!(cases.iter().all(|c| c
        .features
        .iter()
        .all(|f| f.input_ids.last().is_none_or(|&x| x == 2))));
    check_collator(&Flattening::new(LabelForm::Shifted), &o).unwrap_or_else(|f| panic!("{f}"));
}

#[test]
fn row_packing_passes_under_every_algorithm_and_splits_long_documents() {
    for algorithm in Algorithm::ALL {
        for labels in [LabelForm::Shifted, LabelForm::Unshifted] {
            let c = RowPacking::new(16, algorithm, labels);
            let o = CollatorOptions {
                cases: 25,
                max_seq_len: Some(16),
                ..opts(labels)
            };
            let report = check_collator(&c, &o).unwrap_or_else(|f| panic!("{}: {f}", c.name()));
            assert!(report.rows > report.cases, "multi-row batches: {report:?}");
        }
    }
}

#[test]
fn data_collator_for_language_modeling_convention_passes() {
    // One document per right-padded row, unshifted labels, a 2D mask.
    let c = RowPacking::new(40, Algorithm::None, LabelForm::Unshifted);
    let o = CollatorOptions {
        cases: 40,
        max_seq_len: Some(40),
        ..opts(LabelForm::Unshifted)
    };
    let report = check_collator(&c, &o).unwrap_or_else(|f| panic!("{f}"));
    assert!(report.fields.contains(&"attention_mask"));
}

/// The field each planted fault is caught at, under the options it needs.
fn caught(fault: CollatorFault) -> (&'static str, CollatorOptions) {
    use CollatorFault as F;
    let shifted = opts(LabelForm::Shifted);
    match fault {
        F::LabelsAcrossDocuments => ("labels", shifted),
        // Its positions run on over the row, judged before its labels.
        F::ConcatNoMask => ("position_ids", shifted),
        F::FirstTokenNotIgnored => ("labels", opts(LabelForm::Unshifted)),
        F::BoundaryFromEosLabel => (
            "cu_seqlens",
            CollatorOptions {
                eos_token_id: Some(2),
                ..shifted
            },
        ),
        F::BoundariesAtDecrease | F::CuSeqlensOffByOne | F::FlashAttentionMisread => {
            ("cu_seqlens", shifted)
        }
        F::PaddingAsTail => ("cu_seqlens", shifted),
        F::ContinuationRenumbered | F::PositionsNotReset => ("position_ids", shifted),
        F::DenominatorPerRow => ("num_items_in_batch", shifted),
        F::LastDocumentDropped => ("input_ids", shifted),
    }
}

#[test]
fn every_planted_collator_fault_is_caught_at_its_field() {
    for fault in CollatorFault::ALL {
        let (field, o) = caught(fault);
        let c = Planted {
            eos_token_id: o.eos_token_id,
            ..Planted::new(fault, o.labels)
        };
        let f = check_collator(&c, &o).expect_err(&format!("{fault:?} must be caught"));
        assert_eq!(f.error.field, field, "{fault:?}: {f}");
        // The smallest failing case, shrunk: a handful of documents.
        assert!(f.case.features.len() <= 3, "{fault:?}: {f}");
    }
}

#[test]
fn every_row_packing_fault_is_caught() {
    for (fault, field) in [
        (RowFault::SplitRestartsPositions, "position_ids"),
        (RowFault::TruncatesOverlong, "input_ids"),
        (RowFault::PaddingLabelled, "labels"),
    ] {
        let c = RowPacking {
            fault: Some(fault),
            ..RowPacking::new(16, Algorithm::Ffd, LabelForm::Shifted)
        };
        let o = CollatorOptions {
            max_seq_len: Some(16),
            ..opts(LabelForm::Shifted)
        };
        let f = check_collator(&c, &o).expect_err(&format!("{fault:?} must be caught"));
        assert_eq!(f.error.field, field, "{fault:?}: {f}");
    }
}

#[test]
fn the_flash_attention_port_reads_issue_36s_rows_as_transformers_does() {
    // Issue 36: transformers reads [5,6,7,0,1] as [3,5], [0,1,2,5,6] as
    // [0,5], [2,3,4,2,3,2,0,0] as [6,7,8].
    let c = Planted::new(CollatorFault::FlashAttentionMisread, LabelForm::Shifted);
    let chunk = |ids: &[i64], first: i64| Feature {
        input_ids: ids.to_vec(),
        position_ids: Some((first..first + ids.len() as i64).collect()),
        labels: None,
    };
    let rows: [(Vec<Feature>, Vec<usize>); 3] = [
        (
            vec![chunk(&[11, 12, 13], 5), feature(&[14, 15])],
            vec![3, 5],
        ),
        (
            vec![feature(&[11, 12, 13]), chunk(&[14, 15], 5)],
            vec![0, 5],
        ),
        (
            vec![
                chunk(&[11, 12, 13], 2),
                chunk(&[14, 15], 2),
                chunk(&[16], 2),
                feature(&[17]),
                feature(&[18]),
            ],
            vec![6, 7, 8],
        ),
    ];
    let right = Flattening::new(LabelForm::Shifted);
    let o = opts(LabelForm::Shifted);
    for (features, misread) in rows {
        let out = c.collate(&features).unwrap();
        assert_eq!(out.cu_seqlens, Some(CuSeqlens::Slots(misread)));
        let e = judge_collated(&features, &out, &o).unwrap_err();
        assert_eq!(e.field, "cu_seqlens", "{e}");
        judge_collated(&features, &right.collate(&features).unwrap(), &o).unwrap();
    }
}

/// Documents [3, 1, 2] (C3's row), shifted labels, by hand.
fn c3_batch() -> (Vec<Feature>, Collated) {
    let features = vec![feature(&[11, 12, 13]), feature(&[14]), feature(&[15, 16])];
    let ig = HF_IGNORE;
    let out = Collated {
        input_ids: array![[11, 12, 13, 14, 15, 16]],
        labels: array![[12, 13, ig, ig, 16, ig]],
        position_ids: Some(array![[0, 1, 2, 0, 0, 1]]),
        cu_seqlens: Some(CuSeqlens::Slots(vec![0, 3, 4, 6])),
        seq_idx: Some(array![[0, 0, 0, 1, 2, 2]]),
        max_seqlen: Some(3),
        num_items_in_batch: Some(3),
        attention_mask: None,
    };
    (features, out)
}

#[test]
fn a_hand_built_batch_passes_and_each_wrong_value_names_field_row_and_index() {
    let (features, good) = c3_batch();
    let o = opts(LabelForm::Shifted);
    judge_collated(&features, &good, &o).unwrap();
    let wrong = |edit: &dyn Fn(&mut Collated)| {
        let mut out = good.clone();
        edit(&mut out);
        judge_collated(&features, &out, &o).unwrap_err()
    };
    // C3: [3, 3] from a strict decrease.
    let e = wrong(&|o| o.cu_seqlens = Some(CuSeqlens::Slots(vec![0, 3, 6])));
    assert_eq!(
        (e.field.as_str(), e.row, e.index),
        ("cu_seqlens", Some(0), Some(2))
    );
    assert!(e.message.contains("slot 4"), "{e}");
    // C1 at document 0's last token.
    let e = wrong(&|o| o.labels[[0, 2]] = 14);
    assert_eq!(
        (e.field.as_str(), e.row, e.index),
        ("labels", Some(0), Some(2))
    );
    assert!(e.message.contains("is 14, expected -100"), "{e}");
    let e = wrong(&|o| o.position_ids.as_mut().unwrap()[[0, 4]] = 1);
    assert_eq!((e.field.as_str(), e.index), ("position_ids", Some(4)));
    let e = wrong(&|o| o.seq_idx = Some(array![[0, 0, 0, 1, 1, 1]]));
    assert_eq!(e.field, "seq_idx");
    let e = wrong(&|o| o.seq_idx = Some(array![[0, 0, 1, 1, 2, 2]]));
    // Slot 3 starts document 1 with no new index (checked first), and slot
    // 2's new index splits document 0.
    assert_eq!((e.field.as_str(), e.index), ("seq_idx", Some(3)), "{e}");
    let e = wrong(&|o| o.seq_idx = Some(array![[0, 0, 1, 2, 3, 3]]));
    assert_eq!((e.field.as_str(), e.index), ("seq_idx", Some(2)), "{e}");
    assert!(e.message.contains("splits document 0"), "{e}");
    let e = wrong(&|o| o.max_seqlen = Some(2));
    assert_eq!(e.field, "max_seqlen");
    let e = wrong(&|o| o.num_items_in_batch = Some(4));
    assert_eq!(e.field, "num_items_in_batch");
    // A token lost, one repeated, one unknown, one out of order.
    let e = wrong(&|o| o.input_ids[[0, 5]] = 0);
    assert!(e.message.contains("document 2 token 1"), "{e}");
    let e = wrong(&|o| o.input_ids[[0, 5]] = 15);
    assert!(e.message.contains("again"), "{e}");
    let e = wrong(&|o| o.input_ids[[0, 5]] = 99);
    assert_eq!((e.field.as_str(), e.index), ("input_ids", Some(5)));
    let e = wrong(&|o| o.input_ids = array![[11, 13, 12, 14, 15, 16]]);
    assert!(e.message.contains("out of order"), "{e}");
    // Without position_ids the model numbers the row 0..6.
    let e = wrong(&|o| o.position_ids = None);
    assert_eq!((e.field.as_str(), e.index), ("position_ids", Some(3)));
    // Without any boundary.
    let e = wrong(&|o| {
        o.cu_seqlens = None;
        o.seq_idx = None
    });
    assert_eq!(e.field, "cu_seqlens");
    assert!(e.message.contains("no document boundaries"), "{e}");
    // Shapes.
    let e = wrong(&|o| o.labels = Array2::zeros((1, 5)));
    assert_eq!(e.field, "labels");
}

#[test]
fn unshifted_labels_are_judged_one_slot_later_and_slot_0_is_free() {
    let (features, mut out) = c3_batch();
    let ig = HF_IGNORE;
    out.labels = array![[555, 12, 13, ig, ig, 16]];
    let o = opts(LabelForm::Unshifted);
    judge_collated(&features, &out, &o).unwrap();
    // The shifted labels under the unshifted declaration are caught.
    let (_, shifted) = c3_batch();
    let e = judge_collated(&features, &shifted, &o).unwrap_err();
    assert_eq!((e.field.as_str(), e.index), ("labels", Some(1)), "{e}");
}

#[test]
fn masks_judged_in_each_form() {
    let (features, base) = c3_batch();
    let o = opts(LabelForm::Shifted);
    let doc = [0, 0, 0, 1, 2, 2];
    let block =
        ndarray::Array4::from_shape_fn((1, 1, 6, 6), |(_, _, i, j)| doc[i] == doc[j] && j <= i);
    let with = |m: Mask| Collated {
        attention_mask: Some(m),
        ..base.clone()
    };
    judge_collated(&features, &with(Mask::Block(block.clone())), &o).unwrap();
    let additive = block.mapv(|a| if a { 0.0 } else { f64::NEG_INFINITY });
    judge_collated(&features, &with(Mask::Additive(additive.clone())), &o).unwrap();
    // A key of document 0 left visible to document 1's query.
    let mut leak = block.clone();
    leak[[0, 0, 3, 2]] = true;
    let e = judge_collated(&features, &with(Mask::Block(leak)), &o).unwrap_err();
    assert_eq!((e.field.as_str(), e.index), ("attention_mask", Some(3)));
    // -1 is no mask in an additive mask (exp(-1) is far from 0).
    let mut weak = additive;
    weak[[0, 0, 3, 2]] = -1.0;
    let e = judge_collated(&features, &with(Mask::Additive(weak)), &o).unwrap_err();
    assert!(e.message.contains("is -1"), "{e}");
    let e = judge_collated(
        &features,
        &with(Mask::Padding(array![[1, 1, 1, 1, 1, 0]])),
        &o,
    )
    .unwrap_err();
    assert_eq!((e.field.as_str(), e.index), ("attention_mask", Some(5)));
}

#[test]
fn padding_inside_a_document_and_per_row_offsets() {
    // Two rows of 4: [11 12 13 0], [14 15 16 0]; per-row cu_seqlens.
    let features = vec![feature(&[11, 12, 13]), feature(&[14]), feature(&[15, 16])];
    let ig = HF_IGNORE;
    let out = Collated {
        input_ids: array![[11, 12, 13, 0], [14, 15, 16, 0]],
        labels: array![[12, 13, ig, ig], [ig, 16, ig, ig]],
        position_ids: Some(array![[0, 1, 2, 0], [0, 0, 1, 0]]),
        cu_seqlens: Some(CuSeqlens::PerRow(vec![vec![0, 3], vec![0, 1, 3]])),
        ..Default::default()
    };
    let o = opts(LabelForm::Shifted);
    let judged = judge_collated(&features, &out, &o).unwrap();
    assert_eq!((judged.rows, judged.slots), (2, 8));
    let mut short = out.clone();
    short.cu_seqlens = Some(CuSeqlens::PerRow(vec![vec![0, 3], vec![0, 1]]));
    let e = judge_collated(&features, &short, &o).unwrap_err();
    assert_eq!((e.field.as_str(), e.row), ("cu_seqlens", Some(1)), "{e}");
    // C4: padding between a document's tokens.
    let mut split = out;
    split.input_ids = array![[11, 12, 0, 13], [14, 15, 16, 0]];
    let e = judge_collated(&features, &split, &o).unwrap_err();
    assert_eq!(
        (e.field.as_str(), e.row, e.index),
        ("input_ids", Some(0), Some(3))
    );
}

#[test]
fn the_fixed_cases_hold_issue_36s_rows_and_every_kind() {
    let cases = generate(&CollatorOptions {
        cases: 100,
        ..Default::default()
    });
    let firsts: Vec<Vec<i64>> = cases
        .iter()
        .take(8)
        .map(|c| {
            c.features
                .iter()
                .flat_map(|f| (0..f.input_ids.len()).map(|t| f.position(t)))
                .collect()
        })
        .collect();
    assert!(firsts.contains(&vec![0, 1, 2, 0, 0, 1]));
    assert!(firsts.contains(&vec![5, 6, 7, 0, 1]));
    assert!(firsts.contains(&vec![0, 1, 2, 5, 6]));
    assert!(firsts.contains(&vec![2, 3, 4, 2, 3, 2, 0, 0]));
    let any = |p: &dyn Fn(&Feature) -> bool| cases.iter().any(|c| c.features.iter().any(p));
    assert!(any(&|f| f.input_ids.is_empty()));
    assert!(any(&|f| f.input_ids.len() == 1));
    assert!(any(&|f| f.labels.is_some()));
    assert!(any(&|f| f.input_ids.len() > 60));
    // Ids unique within a case.
    for c in &cases {
        let mut ids: Vec<i64> = c
            .features
            .iter()
            .flat_map(|f| f.input_ids.clone())
            .collect();
        let k = ids.len();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), k, "{}", c.source);
    }
}

/// C2 by hand: documents ending in EOS (id 2), `[11, 12, 2]` and
/// `[13, 14, 2]`. The planted boundary falls after each slot whose shifted
/// label is EOS, so each EOS token starts the next segment: `[0, 2, 5, 6]`
/// where `[0, 3, 6]` is right (a boundary at the EOS slot itself would be
/// another bug, not torchtitan's).
#[test]
fn the_eos_label_fault_puts_each_eos_in_the_next_segment() {
    let c = Planted {
        eos_token_id: Some(2),
        ..Planted::new(CollatorFault::BoundaryFromEosLabel, LabelForm::Shifted)
    };
    let features = vec![feature(&[11, 12, 2]), feature(&[13, 14, 2])];
    let out = c.collate(&features).unwrap();
    assert_eq!(out.cu_seqlens, Some(CuSeqlens::Slots(vec![0, 2, 5, 6])));
    let right = Flattening::new(LabelForm::Shifted)
        .collate(&features)
        .unwrap();
    assert_eq!(right.cu_seqlens, Some(CuSeqlens::Slots(vec![0, 3, 6])));
}

/// Per-row offsets (`CuSeqlens::PerRow`) are held to what the slots form is:
/// C3's row with its right offsets passes; with two swapped, the first one
/// below its predecessor is refused, naming row and index.
#[test]
fn per_row_offsets_that_decrease_are_refused_at_the_entry() {
    let (features, mut out) = c3_batch();
    let o = opts(LabelForm::Shifted);
    out.cu_seqlens = Some(CuSeqlens::PerRow(vec![vec![0, 3, 4, 6]]));
    judge_collated(&features, &out, &o).unwrap();
    out.cu_seqlens = Some(CuSeqlens::PerRow(vec![vec![0, 4, 3, 6]]));
    let e = judge_collated(&features, &out, &o).unwrap_err();
    assert_eq!(
        (e.field.as_str(), e.row, e.index),
        ("cu_seqlens", Some(0), Some(2)),
        "{e}"
    );
    assert!(e.message.contains("is 3, expected between"), "{e}");
}
