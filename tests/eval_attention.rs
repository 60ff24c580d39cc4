//! The `attention` op of `packshard eval`: results equal the reference
//! called directly, empty segments and one-token segments behave, and bad
//! input gives the contract's errors (insta snapshot of the messages).

use ndarray::Array3;
use packshard::eval::evaluate;
use packshard::reference::attention::{varlen_pass, ReferenceAttention};
use packshard::reference::ops::{Qkv, Varlen};
use serde_json::{json, Value};

fn tensor(n: usize, h: usize, d: usize, seed: f64) -> Array3<f64> {
    Array3::from_shape_fn((n, h, d), |(i, a, c)| {
        ((i * 7 + a * 3 + c) as f64 * seed).sin()
    })
}

fn to_json(x: &Array3<f64>) -> Value {
    Value::Array(
        x.outer_iter()
            .map(|m| Value::Array(m.rows().into_iter().map(|r| json!(r.to_vec())).collect()))
            .collect(),
    )
}

fn flat(v: &Value) -> Vec<f64> {
    match v {
        Value::Array(items) => items.iter().flat_map(flat).collect(),
        other => vec![other.as_f64().expect("a number")],
    }
}

#[test]
fn attention_op_matches_the_reference_with_gradients() {
    // Segments of 3, 0 (empty) and 1 tokens; 2 heads of dim 3; causal and not.
    let (q, k, v, g) = (
        tensor(4, 2, 3, 0.3),
        tensor(4, 2, 3, 0.7),
        tensor(4, 2, 3, 1.1),
        tensor(4, 2, 3, 1.3),
    );
    let cu = [0usize, 3, 3, 4];
    for causal in [false, true] {
        let out = evaluate(&json!({
            "op": "attention", "q": to_json(&q), "k": to_json(&k), "v": to_json(&v),
            "cu_seqlens": cu, "causal": causal, "want_grad": true, "grad_output": to_json(&g),
        }))
        .unwrap();
        let scale = 1.0 / 3f64.sqrt();
        let x = Qkv::new(q.view(), k.view(), v.view());
        let p = Varlen::new(&cu, causal, scale);
        let (f, b) = varlen_pass(&ReferenceAttention, x, &p, g.view()).unwrap();
        assert_eq!(
            flat(&out["output"]),
            f.output.iter().copied().collect::<Vec<_>>()
        );
        assert_eq!(flat(&out["lse"]), f.lse.iter().copied().collect::<Vec<_>>());
        assert_eq!(
            flat(&out["grad_q"]),
            b.grad_q.iter().copied().collect::<Vec<_>>()
        );
        assert_eq!(
            flat(&out["grad_k"]),
            b.grad_k.iter().copied().collect::<Vec<_>>()
        );
        assert_eq!(
            flat(&out["grad_v"]),
            b.grad_v.iter().copied().collect::<Vec<_>>()
        );
        // The one-token segment attends to itself: output = v, grad_v = grad_output.
        assert_eq!(out["output"][3], to_json(&v)[3]);
        assert_eq!(out["grad_v"][3], to_json(&g)[3]);
        // Causal: the first token of a segment attends to itself only.
        if causal {
            assert_eq!(out["output"][0], to_json(&v)[0]);
        } else {
            assert_ne!(out["output"][0], to_json(&v)[0]);
        }
    }
    // No gradients unless asked; an explicit scale is used.
    let out = evaluate(&json!({"op": "attention", "q": [[[1.0]]], "k": [[[2.0]]], "v": [[[3.0]]], "cu_seqlens": [0, 1], "scale": 0.5})).unwrap();
    assert_eq!(out["output"], json!([[[3.0]]]));
    assert_eq!(out["lse"], json!([[1.0]]));
    assert!(out.get("grad_q").is_none());
    // Zero tokens, every segment empty (P4): no crash, empty results.
    let out =
        evaluate(&json!({"op": "attention", "q": [], "k": [], "v": [], "cu_seqlens": [0, 0, 0]}))
            .unwrap();
    assert_eq!(out["output"], json!([]));
}

#[test]
fn attention_op_errors_follow_the_contract() {
    let one = json!([[[1.0, 2.0]], [[0.5, -1.0]]]);
    let base = json!({"op": "attention", "q": one, "k": one, "v": one, "cu_seqlens": [0, 2]});
    let with = |k: &str, v: Value| {
        let mut c = base.clone();
        c[k] = v;
        c
    };
    let mut without_cu = base.clone();
    without_cu.as_object_mut().unwrap().remove("cu_seqlens");
    let cases = vec![
        ("cu_seqlens not from 0", with("cu_seqlens", json!([1, 2]))),
        (
            "cu_seqlens decreasing",
            with("cu_seqlens", json!([0, 2, 1, 2])),
        ),
        (
            "cu_seqlens short of n_tok",
            with("cu_seqlens", json!([0, 1])),
        ),
        ("cu_seqlens missing", without_cu),
        ("k of another shape", with("k", json!([[[1.0, 2.0]]]))),
        (
            "NaN in q",
            with("q", json!([[[1.0, "nan"]], [[0.5, -1.0]]])),
        ),
        (
            "want_grad without grad_output",
            with("want_grad", json!(true)),
        ),
        (
            "grad_output without want_grad",
            with("grad_output", one.clone()),
        ),
        ("misspelt option", with("casual", json!(true))),
        ("ragged q", with("q", json!([[[1.0, 2.0]], [[0.5]]]))),
    ];
    let mut lines = String::new();
    for (name, case) in cases {
        let e = evaluate(&case).expect_err(name);
        lines.push_str(&format!("{name}: {} | {}\n", e.kind, e.message));
    }
    insta::assert_snapshot!(lines);
}
