//! `packshard eval`'s attention in flash_attn_varlen_func's form:
//! `cu_seqlens_q` and `cu_seqlens_k`, grouped-query `k, v: [n_k, h_kv, d]`,
//! bottom-right causal masks, against values worked out by hand; and the
//! two forms of the offsets refused together.

use packshard_oracle::eval::evaluate_str;
use serde_json::Value;

fn flat(v: &Value) -> Vec<f64> {
    match v {
        Value::Array(items) => items.iter().flat_map(flat).collect(),
        Value::String(s) if s == "-inf" => vec![f64::NEG_INFINITY],
        other => vec![other.as_f64().expect("a number")],
    }
}

/// One segment of 2 queries over 3 keys, `h = 2` query heads over one key
/// head (multi-query: both read key head `a / 2 = 0`), `d = 1`, scale 1,
/// causal. Bottom-right: query `r` sees keys `c <= r + 3 - 2`, so query 0
/// sees keys 0 and 1 (top-left alignment would give it key 0 alone) and
/// query 1 all three. `k = [0, 1, 2]`, `v = [1, 2, 4]`; query 0 has `q = 1`
/// (head 0) and `2` (head 1), query 1 has `0` and `1`:
///
/// - query 0, head 0: scores `0, 1`: output `(1 + 2e) / (1 + e)`, lse `ln(1 + e)`;
/// - query 0, head 1: scores `0, 2`: `(1 + 2e^2) / (1 + e^2)`;
/// - query 1, head 0: scores `0, 0, 0`: `7 / 3`, lse `ln 3`;
/// - query 1, head 1: scores `0, 1, 2`: `(1 + 2e + 4e^2) / (1 + e + e^2)`.
#[test]
fn a_bottom_right_multi_query_cross_case_gives_the_values_worked_by_hand() {
    let case = r#"{"op": "attention",
        "q": [[[1.0], [2.0]], [[0.0], [1.0]]],
        "k": [[[0.0]], [[1.0]], [[2.0]]],
        "v": [[[1.0]], [[2.0]], [[4.0]]],
        "cu_seqlens_q": [0, 2], "cu_seqlens_k": [0, 3],
        "causal": true, "scale": 1.0}"#;
    let r = evaluate_str(case).unwrap();
    let e = std::f64::consts::E;
    let want = [
        (1.0 + 2.0 * e) / (1.0 + e),
        (1.0 + 2.0 * e * e) / (1.0 + e * e),
        7.0 / 3.0,
        (1.0 + 2.0 * e + 4.0 * e * e) / (1.0 + e + e * e),
    ];
    let got = flat(&r["output"]);
    assert_eq!(got.len(), 4, "{r}");
    for (g, w) in got.iter().zip(want) {
        // The reference in f64 against the closed form: a few ulp.
        assert!(
            (g - w).abs() <= 8.0 * f64::EPSILON * w.abs(),
            "{got:?} vs {want:?}"
        );
    }
    // lse: [h, n_q].
    let lse = flat(&r["lse"]);
    // 1e-14: about 64 ulp of f64 at |lse| <= 1.6 (Tolerance::F64_REWRITE's
    // size); the reference sums two or three exact exponentials.
    assert!((lse[0] - (1.0 + e).ln()).abs() < 1e-14, "{lse:?}");
    assert!((lse[3] - (1.0 + e + e * e).ln()).abs() < 1e-14, "{lse:?}");
    assert!((lse[1] - 3f64.ln()).abs() < 1e-14, "{lse:?}");
}

/// The same case with a key-less second segment and the backward: its
/// query's output is 0 and lse `-inf`, `grad_k` has the keys' shape `[n_k,
/// h_kv, d]`, and the tiled kernel (which declares GQA and cross) agrees.
#[test]
fn grads_have_the_key_shape_and_the_tiled_kernel_agrees() {
    let case = |imp: &str| {
        format!(
            r#"{{"op": "attention", "impl": "{imp}",
            "q": [[[1.0], [2.0]], [[0.0], [1.0]], [[3.0], [1.0]]],
            "k": [[[0.0]], [[1.0]], [[2.0]]],
            "v": [[[1.0]], [[2.0]], [[4.0]]],
            "cu_seqlens_q": [0, 2, 3], "cu_seqlens_k": [0, 3, 3],
            "causal": true, "scale": 1.0, "want_grad": true,
            "grad_output": [[[1.0], [-1.0]], [[0.5], [2.0]], [[1.0], [1.0]]]}}"#
        )
    };
    let r = evaluate_str(&case("reference")).unwrap();
    let out = flat(&r["output"]);
    assert_eq!(&out[4..], &[0.0, 0.0], "{r}");
    assert_eq!(flat(&r["lse"])[2], f64::NEG_INFINITY, "{r}");
    assert_eq!(r["grad_k"].as_array().unwrap().len(), 3);
    assert_eq!(r["grad_k"][0].as_array().unwrap().len(), 1, "h_kv = 1");
    let t = evaluate_str(&case("attention_varlen_tiled")).unwrap();
    for name in ["output", "grad_q", "grad_k", "grad_v"] {
        for (a, b) in flat(&r[name]).iter().zip(flat(&t[name])) {
            // f32 kernel on inputs exact in f32: 1e-5 is ~100 ulp of f32 at
            // these magnitudes (at most 4).
            assert!(
                (a - b).abs() <= 1e-5 * a.abs().max(1.0),
                "{name}: {a} vs {b}"
            );
        }
    }
}

#[test]
fn both_forms_of_the_offsets_are_refused_naming_the_field() {
    let case = r#"{"op": "attention", "q": [[[1.0]]], "k": [[[1.0]]], "v": [[[1.0]]],
        "cu_seqlens": [0, 1], "cu_seqlens_k": [0, 1]}"#;
    let e = evaluate_str(case).unwrap_err();
    assert_eq!(e.kind, "invalid_argument");
    assert!(e.message.starts_with("cu_seqlens_k:"), "{}", e.message);
    let both = case.replace("cu_seqlens_k", "cu_seqlens_q");
    let e = evaluate_str(&both).unwrap_err();
    assert!(e.message.starts_with("cu_seqlens_q:"), "{}", e.message);
    // A kernel without cross attention refuses it (never the reference's answer).
    let cross = r#"{"op": "attention", "impl": "attention_dense_masked",
        "q": [[[1.0]]], "k": [[[1.0]], [[2.0]]], "v": [[[1.0]], [[2.0]]],
        "cu_seqlens_q": [0, 1], "cu_seqlens_k": [0, 2]}"#;
    let e = evaluate_str(cross).unwrap_err();
    assert_eq!(e.kind, "invalid_argument", "{}", e.message);
    assert!(e.message.contains("cu_seqlens_k"), "{}", e.message);
}
