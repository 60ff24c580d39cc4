//! `step_plan` (issue #34, docs/STEP.md): the CP split and the step's loss
//! weights as `packshard eval` gives them.

use packshard_oracle::eval::evaluate;
use serde_json::{json, Value};

fn ints(v: &Value) -> Vec<i64> {
    v.as_array()
        .expect("an array")
        .iter()
        .map(|x| x.as_i64().expect("an integer"))
        .collect()
}

/// docs/STEP.md's picture: documents of 5 and 2 tokens at C = 2.
/// The step's loss weights sum to 1: 7 terms of 1/7 (per token) or 3
/// documents' shares (per document) summed in f64, a few ulp (2.2e-16) of 1.
const WEIGHTS_SUM_TOL: f64 = 1e-15;

#[test]
fn the_split_of_the_picture() {
    let r = evaluate(&json!({
        "op": "step_plan",
        "documents": [[10, 11, 12, 13, 14], [20, 21]],
        "cp": 2,
    }))
    .expect("a valid case");
    let mb = &r["microbatches"][0];
    assert_eq!(ints(&mb["cu_seqlens"]), [0, 5, 7]);
    assert_eq!(ints(&mb["cu_seqlens_padded"]), [0, 8, 12]);
    let r0 = &mb["ranks"][0];
    assert_eq!(ints(&r0["token_index"]), [0, 1, 6, 7, 8, 11]);
    assert_eq!(ints(&r0["cu_seqlens_padded"]), [0, 4, 6]);
    assert_eq!(ints(&r0["cu_seqlens"]), [0, 2, 3]);
    assert_eq!(ints(&r0["position_ids"]), [0, 1, 6, 7, 0, 3]);
    assert_eq!(ints(&r0["labels"]), [11, 12, -100, -100, 21, -100]);
    let r1 = &mb["ranks"][1];
    assert_eq!(ints(&r1["token_index"]), [2, 3, 4, 5, 9, 10]);
    // Token 13 predicts 14 on rank 1; 14 is the last: no target.
    assert_eq!(ints(&r1["labels"]), [13, 14, -100, -100, -100, -100]);
    assert_eq!(r["num_predicted"], 5);
    // Per token: 1 / 5 on each predicted slot, 0 elsewhere.
    let w = r0["loss_weights"].as_array().unwrap();
    assert_eq!(w[0].as_f64(), Some(0.2));
    assert_eq!(w[2].as_f64(), Some(0.0));
}

/// The weights add up to 1 over the whole step (per token, per document),
/// not per microbatch (docs/FAULTS.md D1, D2).
#[test]
fn the_weights_use_the_global_denominators() {
    for reduction in ["per-token", "per-document"] {
        let r = evaluate(&json!({
            "op": "step_plan",
            "documents": [[1, 2, 3], [4, 5], [6, 7, 8, 9, 1, 2], [3]],
            "grad_accum": 2, "dp": 2, "cp": 2,
            "reduction": reduction,
        }))
        .expect("a valid case");
        let mbs = r["microbatches"].as_array().unwrap();
        assert_eq!(mbs.len(), 4);
        let sum: f64 = mbs
            .iter()
            .flat_map(|m| m["ranks"].as_array().unwrap())
            .flat_map(|k| k["loss_weights"].as_array().unwrap())
            .map(|w| w.as_f64().unwrap())
            .sum();
        assert!((sum - 1.0).abs() < WEIGHTS_SUM_TOL, "{reduction}: {sum}");
        assert_eq!(mbs[3]["dp_rank"], 1);
        assert_eq!(mbs[3]["grad_accum_step"], 1);
    }
}

#[test]
fn bad_layouts_name_the_field() {
    for (case, field) in [
        (
            json!({"op": "step_plan", "documents": [[1]], "cp": 0}),
            "cp",
        ),
        (
            json!({"op": "step_plan", "documents": [[1]], "cp": 5000}),
            "cp",
        ),
        (
            json!({"op": "step_plan", "documents": [[1]], "dp": 2}),
            "docs",
        ),
        (
            json!({"op": "step_plan", "documents": [[1]], "dp": u64::MAX, "grad_accum": 3}),
            "docs",
        ),
        (
            json!({"op": "step_plan", "documents": [[1, -2]]}),
            "documents[0][1]",
        ),
        (
            json!({"op": "step_plan", "documents": [[1]], "reduction": "mean"}),
            "reduction",
        ),
    ] {
        let e = evaluate(&case).expect_err("refused");
        assert_eq!(e.kind, "invalid_argument", "{case}");
        assert!(e.message.starts_with(field), "{case}: {}", e.message);
    }
}
