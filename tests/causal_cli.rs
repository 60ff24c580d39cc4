//! The causal-LM packing ops of `packshard eval` (issue #15), through the
//! binary: `causal_labels` and `causal_conversions` on the docs/FAULTS.md
//! examples (the values of `packshard::reference::faults`), and bad input
//! gives the contract's errors (exit 2, one JSON line; insta snapshot of
//! the messages).

mod common;

use common::eval;
use packshard::reference::faults::{
    C1_DOC_IDS, C1_INPUT_IDS, C1_LABELS, C2_LENGTHS, C3_CU_SEQLENS, C3_POSITION_IDS, C4_CU_SEQLENS,
    C4_DOC_IDS, C4_SLOTS, C6_POSITIONS, C7_PREDICTED, C7_ROW_LENGTHS,
};
use serde_json::{json, Value};

fn ok(case: Value) -> Value {
    let (code, v) = eval(&case);
    assert_eq!(code, 0, "{case} -> {v}");
    v
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

#[test]
fn c1_labels_never_cross_a_document() {
    let v = ok(json!({"op": "causal_labels", "input_ids": C1_INPUT_IDS, "doc_ids": C1_DOC_IDS}));
    assert_eq!(v["labels"], json!(C1_LABELS));
    assert_eq!(v["labels"], json!([11, -100, 13, -100]));
    assert_eq!(v["num_predicted"], 2);
    // Each document predicts one token: 1/2 per token, 1/(2 x 1) per
    // document, 1/2 per row; the last tokens weigh 0.
    for key in [
        "loss_weights_per_token",
        "loss_weights_per_document",
        "loss_weights_per_row",
    ] {
        assert_eq!(floats(&v[key]), [0.5, 0.0, 0.5, 0.0], "{key}");
    }
    // The same pack given as cu_seqlens (every slot real) is the same.
    let w = ok(json!({"op": "causal_labels", "input_ids": C1_INPUT_IDS, "cu_seqlens": [0, 2, 4]}));
    assert_eq!(w["labels"], v["labels"]);
    assert_eq!(w["doc_ids"], json!(C1_DOC_IDS));
    // Another ignore_index is used in the output (and the weights stay).
    let w = ok(
        json!({"op": "causal_labels", "input_ids": C1_INPUT_IDS, "doc_ids": C1_DOC_IDS, "ignore_index": -1}),
    );
    assert_eq!(w["labels"], json!([11, -1, 13, -1]));
    assert_eq!(w["loss_weights_per_token"], v["loss_weights_per_token"]);
}

#[test]
fn c2_eos_and_c7_reductions_differ_by_documents() {
    // C2: documents of 3 and 4 tokens, each last token predicts EOS (id 2).
    let ids: Vec<i64> = (20..27).collect();
    let cu = [0, C2_LENGTHS[0], C2_LENGTHS[0] + C2_LENGTHS[1]];
    let v =
        ok(json!({"op": "causal_labels", "input_ids": ids, "cu_seqlens": cu, "eos_token_id": 2}));
    assert_eq!(v["labels"], json!([21, 22, 2, 24, 25, 26, 2]));
    assert_eq!(v["num_predicted"], 7);
    let per_token = floats(&v["loss_weights_per_token"]);
    assert!(per_token.iter().all(|&w| w == 1.0 / 7.0));
    let per_doc = floats(&v["loss_weights_per_document"]);
    assert_eq!(per_doc[..3], [1.0 / 6.0; 3]);
    assert_eq!(per_doc[3..], [1.0 / 8.0; 4]);
    assert!(floats(&v["loss_weights_per_row"]).iter().all(|&w| w == 0.5));

    // C7: two rows of documents [3, 5] packed into one: 12 predicted tokens
    // over the batch; per-token weight 1/12 whatever the packing, and the
    // weights of each reduction sum to what it normalises.
    let docs: Vec<usize> = C7_ROW_LENGTHS
        .iter()
        .chain(&C7_ROW_LENGTHS)
        .enumerate()
        .flat_map(|(d, &l)| std::iter::repeat_n(d + 1, l))
        .collect();
    let ids: Vec<i64> = (0..docs.len() as i64).map(|i| 100 + i).collect();
    let v = ok(json!({"op": "causal_labels", "input_ids": ids, "doc_ids": docs}));
    assert_eq!(v["num_predicted"], C7_PREDICTED);
    assert_eq!(v["num_documents"], 4);
    // Per token and per document the weights sum to 1; per row (a sum
    // over each row, a mean over the rows) to M / R = 12 / 4.
    for (key, total) in [
        ("loss_weights_per_token", 1.0),
        ("loss_weights_per_document", 1.0),
        ("loss_weights_per_row", 3.0),
    ] {
        let sum: f64 = floats(&v[key]).iter().sum();
        assert!((sum - total).abs() < 1e-14, "{key}: {sum}");
    }
    assert_eq!(floats(&v["loss_weights_per_token"])[0], 1.0 / 12.0);
    // num_documents given: per-row divides by it (empty documents count).
    let v =
        ok(json!({"op": "causal_labels", "input_ids": ids, "doc_ids": docs, "num_documents": 5}));
    assert_eq!(floats(&v["loss_weights_per_row"])[0], 0.2);
}

#[test]
fn c3_position_ids_reset_starts_a_document() {
    let v = ok(json!({"op": "causal_conversions", "position_ids": C3_POSITION_IDS}));
    assert_eq!(v["cu_seqlens"], json!(C3_CU_SEQLENS));
    // Documents of 3, 1 and 2 tokens (a strict decrease would see [3, 3]).
    let cu: Vec<u64> = v["cu_seqlens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect();
    let lengths: Vec<u64> = cu.windows(2).map(|w| w[1] - w[0]).collect();
    assert_eq!(lengths, [3, 1, 2]);
    assert_eq!(v["max_seqlen"], 3);
    assert_eq!(v["num_segments"], 3);
    assert_eq!(v["position_ids"], json!(C3_POSITION_IDS));
    assert_eq!(v["seq_idx"], json!([0, 0, 0, 1, 2, 2]));
    assert_eq!(v["doc_ids"], json!([1, 1, 1, 2, 3, 3]));
    assert_eq!(v["slots"], json!([0, 1, 2, 3, 4, 5]));
    // And back: cu_seqlens, seq_idx and doc ids give the same positions.
    for (field, value) in [
        ("cu_seqlens", v["cu_seqlens"].clone()),
        ("seq_idx", v["seq_idx"].clone()),
        ("doc_ids", v["doc_ids"].clone()),
    ] {
        let w = ok(json!({"op": "causal_conversions", field: value}));
        assert_eq!(w["position_ids"], json!(C3_POSITION_IDS), "{field}");
        assert_eq!(w["cu_seqlens"], json!(C3_CU_SEQLENS), "{field}");
    }
}

#[test]
fn c4_doc_ids_keep_padding_between_documents() {
    let v = ok(json!({"op": "causal_conversions", "doc_ids": C4_DOC_IDS}));
    assert_eq!(v["slots"], json!(C4_SLOTS));
    assert_eq!(v["slots"], json!([0, 1, 2, 4, 5]));
    assert_eq!(v["cu_seqlens"], json!(C4_CU_SEQLENS));
    assert_eq!(v["position_ids"], json!([0, 1, 2, 0, 1]));
    assert_eq!(v["seq_idx"], json!([0, 0, 0, 1, 1]));
    assert_eq!(v["doc_ids"], json!(C4_DOC_IDS));
    assert_eq!(
        (v["n_tok"].as_u64(), v["n_slots"].as_u64()),
        (Some(5), Some(8))
    );
    assert_eq!(v["max_seqlen"], 3);
    // Labels on the same slots: padding predicts nothing and weighs 0.
    let ids: Vec<i64> = (10..18).collect();
    let l = ok(json!({"op": "causal_labels", "input_ids": ids, "doc_ids": C4_DOC_IDS}));
    assert_eq!(
        l["labels"],
        json!([11, 12, -100, -100, 15, -100, -100, -100])
    );
    assert_eq!(
        floats(&l["loss_weights_per_document"]),
        [0.25, 0.25, 0.0, 0.0, 0.5, 0.0, 0.0, 0.0]
    );
    // Other ids, renumbered in order.
    let v = ok(json!({"op": "causal_conversions", "doc_ids": [7, 7, 0, 3]}));
    assert_eq!(v["doc_ids"], json!([1, 1, 0, 2]));
}

#[test]
fn c6_seq_idx_with_empty_segments_and_a_first_offset() {
    let v = ok(
        json!({"op": "causal_conversions", "seq_idx": [0, 0, 2, 2, 2, 3],
        "num_segments": 5, "first_offset": C6_POSITIONS[0]}),
    );
    assert_eq!(v["cu_seqlens"], json!([0, 2, 2, 5, 6, 6]));
    assert_eq!(v["position_ids"], json!([5, 6, 0, 1, 2, 0]));
    assert_eq!(v["seq_idx"], json!([0, 0, 2, 2, 2, 3]));
    assert_eq!(v["num_segments"], 5);
    // A continuation chunk keeps its positions (C6).
    let v = ok(json!({"op": "causal_conversions", "position_ids": C6_POSITIONS}));
    assert_eq!(v["position_ids"], json!(C6_POSITIONS));
    assert_eq!(v["cu_seqlens"], json!([0, 4]));
    // The largest position is accepted and kept.
    let v = ok(json!({"op": "causal_conversions", "position_ids": [i64::MAX]}));
    assert_eq!(v["position_ids"], json!([i64::MAX]));
    // Nothing at all.
    let v = ok(json!({"op": "causal_conversions", "position_ids": []}));
    assert_eq!(
        (&v["cu_seqlens"], &v["max_seqlen"]),
        (&json!([0]), &json!(0))
    );
}

#[test]
fn causal_errors_follow_the_contract() {
    let big = "99999999999999";
    let cases: Vec<(&str, Value, &str)> = vec![
        (
            "labels: no documents",
            json!({"op": "causal_labels", "input_ids": [1, 2]}),
            "missing_field",
        ),
        (
            "labels: both forms",
            json!({"op": "causal_labels", "input_ids": [1, 2], "doc_ids": [1, 1], "cu_seqlens": [0, 2]}),
            "invalid_argument",
        ),
        (
            "labels: doc_ids of another length",
            json!({"op": "causal_labels", "input_ids": [1, 2], "doc_ids": [1]}),
            "shape_mismatch",
        ),
        (
            "labels: a document comes back",
            json!({"op": "causal_labels", "input_ids": [1, 2, 3], "doc_ids": [1, 2, 1]}),
            "invalid_argument",
        ),
        (
            "labels: cu_seqlens short",
            json!({"op": "causal_labels", "input_ids": [1, 2, 3], "cu_seqlens": [0, 2]}),
            "invalid_argument",
        ),
        (
            "labels: cu_seqlens decreasing",
            json!({"op": "causal_labels", "input_ids": [1, 2, 3], "cu_seqlens": [0, 2, 1, 3]}),
            "invalid_argument",
        ),
        (
            "labels: negative id",
            json!({"op": "causal_labels", "input_ids": [1, -5], "doc_ids": [1, 1]}),
            "invalid_argument",
        ),
        (
            "labels: id is ignore_index",
            json!({"op": "causal_labels", "input_ids": [1, 7], "doc_ids": [1, 1], "ignore_index": 7}),
            "invalid_argument",
        ),
        (
            "labels: eos is ignore_index",
            json!({"op": "causal_labels", "input_ids": [1, 2], "doc_ids": [1, 1], "eos_token_id": -100}),
            "invalid_argument",
        ),
        (
            "labels: too few num_documents",
            json!({"op": "causal_labels", "input_ids": [1, 2], "doc_ids": [1, 2], "num_documents": 1}),
            "invalid_argument",
        ),
        (
            "labels: want_grad",
            json!({"op": "causal_labels", "input_ids": [1], "doc_ids": [1], "want_grad": true}),
            "invalid_argument",
        ),
        (
            "labels: misspelt field",
            json!({"op": "causal_labels", "input_ids": [1], "doc_id": [1]}),
            "invalid_argument",
        ),
        (
            "conversions: no form",
            json!({"op": "causal_conversions"}),
            "missing_field",
        ),
        (
            "conversions: two forms",
            json!({"op": "causal_conversions", "position_ids": [0], "seq_idx": [0]}),
            "invalid_argument",
        ),
        (
            "conversions: cu_seqlens not from 0",
            json!({"op": "causal_conversions", "cu_seqlens": [1, 2]}),
            "invalid_argument",
        ),
        (
            "conversions: cu_seqlens empty",
            json!({"op": "causal_conversions", "cu_seqlens": []}),
            "invalid_argument",
        ),
        (
            "conversions: cu_seqlens over the budget",
            serde_json::from_str(&format!(
                r#"{{"op": "causal_conversions", "cu_seqlens": [0, {big}]}}"#
            ))
            .unwrap(),
            "invalid_argument",
        ),
        (
            "conversions: seq_idx decreasing",
            json!({"op": "causal_conversions", "seq_idx": [0, 1, 0]}),
            "invalid_argument",
        ),
        (
            "conversions: seq_idx past num_segments",
            json!({"op": "causal_conversions", "seq_idx": [0, 3], "num_segments": 2}),
            "index_out_of_range",
        ),
        (
            "conversions: num_segments over the budget",
            serde_json::from_str(&format!(
                r#"{{"op": "causal_conversions", "seq_idx": [0], "num_segments": {big}}}"#
            ))
            .unwrap(),
            "invalid_argument",
        ),
        (
            "conversions: num_segments without seq_idx",
            json!({"op": "causal_conversions", "position_ids": [0], "num_segments": 1}),
            "invalid_argument",
        ),
        (
            "conversions: doc id comes back",
            json!({"op": "causal_conversions", "doc_ids": [1, 0, 1]}),
            "invalid_argument",
        ),
        (
            "conversions: position too large",
            json!({"op": "causal_conversions", "position_ids": [0, u64::MAX]}),
            "invalid_argument",
        ),
        (
            "conversions: first_offset overflows",
            json!({"op": "causal_conversions", "cu_seqlens": [0, 2], "first_offset": i64::MAX}),
            "invalid_argument",
        ),
        (
            "conversions: first_offset with position_ids",
            json!({"op": "causal_conversions", "position_ids": [0], "first_offset": 1}),
            "invalid_argument",
        ),
        (
            "conversions: negative position",
            json!({"op": "causal_conversions", "position_ids": [0, -1]}),
            "invalid_argument",
        ),
    ];
    insta::assert_snapshot!(common::error_lines(&cases, usize::MAX));
}

#[test]
fn eval_list_has_the_causal_ops() {
    common::assert_listed(&["causal_labels", "causal_conversions"]);
}

/// Every list of up to 4 values from a small alphabet (with extremes) in
/// every field of both ops: a result or a typed error, never a panic (the
/// `eval_json` fuzz target's promise, here on the shapes that matter).
#[test]
fn small_hostile_inputs_get_a_result_or_a_typed_error() {
    let alphabet: [Value; 6] = [
        json!(0),
        json!(1),
        json!(2),
        json!(-100),
        json!(u64::MAX),
        json!(i64::MAX),
    ];
    let mut lists = vec![json!([])];
    for len in 1..=3u32 {
        for code in 0..6usize.pow(len) {
            let mut c = code;
            let items: Vec<Value> = (0..len)
                .map(|_| {
                    let v = alphabet[c % 6].clone();
                    c /= 6;
                    v
                })
                .collect();
            lists.push(Value::Array(items));
        }
    }
    let mut results = 0;
    let mut runs = 0;
    for list in &lists {
        for other in lists.iter().step_by(7) {
            let cases = [
                json!({"op": "causal_labels", "input_ids": other, "doc_ids": list}),
                json!({"op": "causal_labels", "input_ids": other, "cu_seqlens": list, "eos_token_id": 2}),
                json!({"op": "causal_labels", "input_ids": other, "doc_ids": list, "num_documents": 0, "ignore_index": 1}),
                json!({"op": "causal_conversions", "position_ids": list}),
                json!({"op": "causal_conversions", "cu_seqlens": list, "first_offset": other.get(0)}),
                json!({"op": "causal_conversions", "seq_idx": list, "num_segments": other.get(0)}),
                json!({"op": "causal_conversions", "doc_ids": list}),
            ];
            for case in cases {
                runs += 1;
                match packshard::eval::evaluate(&case) {
                    Ok(_) => results += 1,
                    Err(e) => assert!(
                        [
                            "missing_field",
                            "shape_mismatch",
                            "index_out_of_range",
                            "invalid_argument"
                        ]
                        .contains(&e.kind)
                            && !e.message.is_empty(),
                        "{case}: {e:?}"
                    ),
                }
            }
        }
    }
    // Not vacuous: many cases give results, many give errors.
    assert!(results > runs / 10 && results < runs, "{results} of {runs}");
}
