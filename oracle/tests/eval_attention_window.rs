//! `packshard eval`'s attention with a sliding window, bottom-right aligned
//! over grouped-query cross segments, against values computed outside the
//! project (`scripts/attention_window_expected.py`, plain Python floats
//! from flash-attention's documented semantics; the values it wrote are
//! committed in `tests/data/attention_window_gqa_cross.json`).

use packshard_oracle::eval::evaluate_str;
use serde_json::Value;

fn flat(v: &Value) -> Vec<f64> {
    match v {
        Value::Array(items) => items.iter().flat_map(flat).collect(),
        Value::String(s) if s == "-inf" => vec![f64::NEG_INFINITY],
        other => vec![other.as_f64().expect("a number")],
    }
}

const DATA: &str = include_str!("data/attention_window_gqa_cross.json");

/// Agreement with the values computed outside the project: both are f64
/// softmaxes of at most 4 keys with scores below 8 and values below 2, summed
/// in other orders (a few ulp of their size, 2.2e-16 each), and JSON's
/// shortest round-trip printing is exact.
const OUTSIDE_TOL: f64 = 1e-13;

#[test]
fn a_windowed_gqa_cross_case_equals_values_computed_outside_the_project() {
    let data: Value = serde_json::from_str(DATA).unwrap();
    let r = evaluate_str(&data["case"].to_string()).unwrap();
    for name in ["output", "lse"] {
        let (got, want) = (flat(&r[name]), flat(&data[name]));
        assert_eq!(got.len(), want.len(), "{name}");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                g == w || (g - w).abs() <= OUTSIDE_TOL,
                "{name}[{i}]: eval {g:e}, outside {w:e}"
            );
        }
    }
    // The window matters here: without it the output differs.
    let mut case = data["case"].clone();
    case.as_object_mut().unwrap().remove("window_size");
    let r2 = evaluate_str(&case.to_string()).unwrap();
    assert_ne!(flat(&r2["output"]), flat(&data["output"]));
}

#[test]
fn bad_options_name_their_field() {
    let base = r#"{"op": "attention", "q": [[[1.0]]], "k": [[[1.0]]], "v": [[[1.0]]],
        "cu_seqlens": [0, 1]"#;
    for (extra, field) in [
        (r#", "window_size": [-2, 0]"#, "window_size[0]"),
        (r#", "window_size": [1]"#, "window_size"),
        (r#", "softcap": -1.0"#, "softcap"),
        (r#", "alibi_slopes": [0.5, 0.5]"#, "alibi_slopes"),
        (r#", "seqused_k": [2]"#, "seqused_k[0]"),
        // The tiled kernel takes the options; its bad ones are refused alike.
        (
            r#", "window_size": [-2, 1], "impl": "attention_varlen_tiled""#,
            "window_size[0]",
        ),
    ] {
        let e = evaluate_str(&format!("{base}{extra}}}")).unwrap_err();
        assert!(e.to_string().contains(field), "{extra}: {e}");
    }
}
