//! Causal packing: the docs/FAULTS.md examples C1, C3, C4, C6, C7 by hand,
//! and round trips between document ids, `cu_seqlens`, `position_ids` and
//! `seq_idx` over generated layouts (one-token and empty documents, padding
//! between documents, a first document continuing at an offset).

use proptest::prelude::*;

use super::packing::*;
use crate::error::Error;
use crate::faults::*;
use crate::vocab::IGNORE_INDEX;

const X: i64 = IGNORE_INDEX;

#[test]
fn c1_labels_stay_inside_each_document() {
    // Pack [a b | c d] with a..d = 10..13.
    let labels = next_token_labels(&C1_INPUT_IDS, &C1_DOC_IDS, None).unwrap();
    assert_eq!(labels, C1_LABELS);
    let eos = next_token_labels(&[10, 11, 12, 13, 0], &[1, 1, 2, 2, 0], Some(99)).unwrap();
    assert_eq!(eos, [11, 99, 13, 99, X]);
    // One-token documents predict nothing (or EOS); padding between documents nothing.
    let l = next_token_labels(&[5, 6, 0, 7, 8], &[1, 2, 0, 3, 3], None).unwrap();
    assert_eq!(l, [X, X, X, 8, X]);
}

#[test]
fn c3_one_token_documents_are_not_merged() {
    assert_eq!(
        cu_seqlens_from_position_ids(&C3_POSITION_IDS),
        C3_CU_SEQLENS
    );
    // A continuation chunk first: [5, 6, 7] then a new document.
    assert_eq!(cu_seqlens_from_position_ids(&[5, 6, 7, 0, 1]), [0, 3, 5]);
    assert_eq!(cu_seqlens_from_position_ids(&[]), [0]);
}

#[test]
fn c4_padding_between_documents() {
    let (slots, cu) = varlen_from_doc_ids(&C4_DOC_IDS).unwrap();
    assert_eq!(slots, C4_SLOTS);
    assert_eq!(cu, C4_CU_SEQLENS);
    let e = varlen_from_doc_ids(&[1, 1, 2, 1]).unwrap_err();
    assert_error_field!(e, InvalidArgument, "doc_ids[3]");
}

#[test]
fn c6_a_continuation_chunk_keeps_its_positions() {
    assert_eq!(
        position_ids_from_cu_seqlens(&[0, 4], C6_POSITIONS[0]).unwrap(),
        C6_POSITIONS
    );
    assert_eq!(
        position_ids_from_cu_seqlens(&[0, 2, 2, 5], 3).unwrap(),
        [3, 4, 0, 1, 2]
    );
}

#[test]
fn c7_the_token_count_of_a_packed_batch() {
    // 2 rows, each documents [3, 5]: 2 + 4 + 2 + 4 = 12 predicted tokens.
    let doc_ids = [1, 1, 1, 2, 2, 2, 2, 2, 3, 3, 3, 4, 4, 4, 4, 4];
    let ids: Vec<i64> = (0..16).collect();
    let labels = next_token_labels(&ids, &doc_ids, None).unwrap();
    assert_eq!(C7_ROW_LENGTHS.iter().sum::<usize>() * 2, doc_ids.len());
    assert_eq!(labels.iter().filter(|&&l| l != X).count(), C7_PREDICTED);
    let w = loss_weights(&labels, &doc_ids, CausalReduction::PerToken, 4).unwrap();
    for (l, w) in labels.iter().zip(&w) {
        assert_eq!(*w, if *l == X { 0.0 } else { 1.0 / 12.0 });
    }
    let w = loss_weights(&labels, &doc_ids, CausalReduction::PerDocument, 4).unwrap();
    assert_eq!(w[0], 1.0 / 8.0); // 4 documents, 2 predicted tokens
    assert_eq!(w[3], 1.0 / 16.0); // 4 documents, 4 predicted tokens
    let w = loss_weights(&labels, &doc_ids, CausalReduction::PerRow, 5).unwrap();
    assert_eq!(w[0], 1.0 / 5.0);
    let e = loss_weights(&labels, &doc_ids, CausalReduction::PerRow, 3).unwrap_err();
    assert_error_field!(e, InvalidArgument, "num_documents");
}

#[test]
fn conversion_errors_are_typed() {
    let e = cu_seqlens_from_seq_idx(&[0, 1, 0], 2).unwrap_err();
    assert_error_field!(e, InvalidArgument, "seq_idx[2]");
    let e = cu_seqlens_from_seq_idx(&[0, 3], 2).unwrap_err();
    assert!(matches!(
        e,
        Error::IndexOutOfRange {
            index: 1,
            value: 3,
            ..
        }
    ));
    let e = doc_ids_from_varlen(&[0, 9], &[0, 2], 4).unwrap_err();
    assert!(matches!(
        e,
        Error::IndexOutOfRange {
            index: 1,
            value: 9,
            ..
        }
    ));
    let e = next_token_labels(&[1, 2], &[1], None).unwrap_err();
    assert_error_field!(e, ShapeMismatch, "doc_ids");
    let e = loss_weights(&[3, X], &[0, 1], CausalReduction::PerToken, 1).unwrap_err();
    assert_error_field!(e, InvalidArgument, "labels[0]");
}

/// A packed row: document lengths (0 = an empty document, which has no
/// slots), padding slots before each document, tail padding, the first
/// document's position offset.
fn layouts() -> impl Strategy<Value = (Vec<usize>, Vec<usize>, usize, usize)> {
    (0usize..=6).prop_flat_map(|b| {
        (
            prop::collection::vec(
                prop_oneof![1 => Just(0usize), 2 => Just(1usize), 4 => 1usize..=5],
                b,
            ),
            prop::collection::vec(prop_oneof![3 => Just(0usize), 1 => 1usize..=2], b),
            0usize..=3,
            prop_oneof![2 => Just(0usize), 1 => 1usize..=9],
        )
    })
}

/// Canonical document ids (1.. in order, empty documents skipped) of a layout.
fn doc_ids_of(lengths: &[usize], gaps: &[usize], tail: usize) -> Vec<usize> {
    let mut ids = Vec::new();
    let mut next = 1;
    for (&l, &g) in lengths.iter().zip(gaps) {
        ids.extend(std::iter::repeat_n(0, g));
        if l > 0 {
            ids.extend(std::iter::repeat_n(next, l));
            next += 1;
        }
    }
    ids.extend(std::iter::repeat_n(0, tail));
    ids
}

fn cu_of(lengths: impl IntoIterator<Item = usize>) -> Vec<usize> {
    let mut cu = vec![0];
    for l in lengths {
        cu.push(cu.last().unwrap() + l);
    }
    cu
}

proptest! {
    #[test]
    fn doc_ids_and_varlen_round_trip((lengths, gaps, tail, _) in layouts()) {
        let ids = doc_ids_of(&lengths, &gaps, tail);
        let (slots, cu) = varlen_from_doc_ids(&ids).unwrap();
        // The real slots are exactly the non-padding ones; one segment per
        // non-empty document, of its length.
        let real: Vec<usize> = (0..ids.len()).filter(|&i| ids[i] != 0).collect();
        prop_assert_eq!(&slots, &real);
        prop_assert_eq!(&cu, &cu_of(lengths.iter().copied().filter(|&l| l > 0)));
        prop_assert_eq!(doc_ids_from_varlen(&slots, &cu, ids.len()).unwrap(), ids);
    }

    #[test]
    fn cu_seqlens_and_position_ids_round_trip((lengths, _, _, offset) in layouts()) {
        let nonempty: Vec<usize> = lengths.iter().copied().filter(|&l| l > 0).collect();
        let cu = cu_of(nonempty.iter().copied());
        let pos = position_ids_from_cu_seqlens(&cu, offset).unwrap();
        // Independently: each document counts from 0, the first from the offset.
        let want: Vec<usize> = nonempty.iter().enumerate()
            .flat_map(|(s, &l)| { let o = if s == 0 { offset } else { 0 }; o..o + l })
            .collect();
        prop_assert_eq!(&pos, &want);
        prop_assert_eq!(cu_seqlens_from_position_ids(&pos), cu.clone());
        let first = pos.first().copied().unwrap_or(0);
        prop_assert_eq!(position_ids_from_cu_seqlens(&cu_seqlens_from_position_ids(&pos), first).unwrap(), pos);
    }

    #[test]
    fn cu_seqlens_and_seq_idx_round_trip((lengths, _, _, _) in layouts()) {
        // Empty segments included: seq_idx skips their index.
        let cu = cu_of(lengths.iter().copied());
        let idx = seq_idx_from_cu_seqlens(&cu).unwrap();
        prop_assert_eq!(idx.len(), *cu.last().unwrap());
        for (s, w) in cu.windows(2).enumerate() {
            prop_assert!(idx[w[0]..w[1]].iter().all(|&i| i == s));
        }
        prop_assert_eq!(cu_seqlens_from_seq_idx(&idx, lengths.len()).unwrap(), cu);
    }

    #[test]
    fn labels_packed_equal_labels_unpacked((lengths, gaps, tail, _) in layouts(), eos in prop::option::of(0i64..50)) {
        // Packed: the row of the layout. Unpacked: each document alone in a
        // right-padded row. Labels of each document's tokens agree, padding
        // predicts nothing, and the predicted count is sum(len - 1) (+1 per
        // document with EOS).
        let ids = doc_ids_of(&lengths, &gaps, tail);
        let input: Vec<i64> = (0..ids.len() as i64).map(|i| 100 + i).collect();
        let packed = next_token_labels(&input, &ids, eos).unwrap();
        let (slots, cu) = varlen_from_doc_ids(&ids).unwrap();
        let mut predicted = 0;
        for w in cu.windows(2) {
            let doc: Vec<i64> = slots[w[0]..w[1]].iter().map(|&s| input[s]).collect();
            let row_len = doc.len() + 2;
            let mut row = doc.clone();
            row.resize(row_len, 0);
            let mut row_ids = vec![1; doc.len()];
            row_ids.resize(row_len, 0);
            let alone = next_token_labels(&row, &row_ids, eos).unwrap();
            for (t, &s) in slots[w[0]..w[1]].iter().enumerate() {
                prop_assert_eq!(packed[s], alone[t]);
                let want = if t + 1 < doc.len() { doc[t + 1] } else { eos.unwrap_or(X) };
                prop_assert_eq!(packed[s], want);
            }
            prop_assert!(alone[doc.len()..].iter().all(|&l| l == X));
            predicted += doc.len() - 1 + usize::from(eos.is_some());
        }
        for (i, &d) in ids.iter().enumerate() {
            if d == 0 { prop_assert_eq!(packed[i], X); }
        }
        prop_assert_eq!(packed.iter().filter(|&&l| l != X).count(), predicted);
    }
}

/// Slots that do not increase are refused naming the first one out of order
/// (a repeated slot would give two tokens one document id); increasing slots
/// with gaps are accepted, the gaps padding (id 0).
#[test]
fn slots_that_do_not_increase_are_refused() {
    let e = doc_ids_from_varlen(&[0, 2, 2], &[0, 3], 4).unwrap_err();
    assert_error_field!(e, InvalidArgument, "slots[2]");
    let e = doc_ids_from_varlen(&[1, 0], &[0, 2], 4).unwrap_err();
    assert_error_field!(e, InvalidArgument, "slots[1]");
    assert_eq!(
        doc_ids_from_varlen(&[0, 2], &[0, 1, 2], 4).unwrap(),
        vec![1, 0, 2, 0]
    );
}
