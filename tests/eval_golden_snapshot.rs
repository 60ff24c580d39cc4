//! `packshard eval` on the golden set, byte for byte: every golden case (the
//! f64 and the f32 set) sent to `eval` as a JSON case, through every impl its
//! op accepts, and the SHA-256 of each result's JSON text pinned in an insta
//! snapshot. A refactor that claims "behaviour unchanged" must leave this
//! snapshot as it is; a change to the numerics shows up as a changed hash in
//! review, naming the case and the impl.

use packshard::eval::{evaluate, list};
use packshard::golden::cases;
use packshard::golden::io::{sha256_hex, Dtype, Tensor, Values};
use serde_json::{json, Map, Value};

/// A JSON number, or `"inf"`, `"-inf"`, `"nan"` (the contract's spelling).
fn num(x: f64) -> Value {
    if x.is_finite() {
        json!(x)
    } else if x.is_nan() {
        json!("nan")
    } else if x > 0.0 {
        json!("inf")
    } else {
        json!("-inf")
    }
}

/// Row-major values as nested JSON arrays of `shape`.
fn nested(values: &[Value], shape: &[usize]) -> Value {
    match shape {
        [] => values[0].clone(),
        [_] => Value::Array(values.to_vec()),
        [n, rest @ ..] => {
            let step = rest.iter().product::<usize>();
            Value::Array(
                (0..*n)
                    .map(|i| nested(&values[i * step..(i + 1) * step], rest))
                    .collect(),
            )
        }
    }
}

fn tensor_json(t: &Tensor) -> Value {
    let flat: Vec<Value> = match &t.values {
        Values::F(v, _) => v.iter().map(|&x| num(x)).collect(),
        Values::I(v) => v.iter().map(|&x| json!(x)).collect(),
    };
    nested(&flat, &t.shape)
}

fn impls_of(op: &str) -> Vec<String> {
    let l = list();
    let entry = l["ops"]
        .as_array()
        .unwrap()
        .iter()
        .find(|o| o["op"] == op)
        .unwrap_or_else(|| panic!("eval has no op {op}"))
        .clone();
    entry["impls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_string())
        .collect()
}

#[test]
fn eval_results_on_the_golden_set_are_pinned() {
    let mut lines = Vec::new();
    let mut evaluated = 0;
    for dtype in [Dtype::F64, Dtype::F32] {
        for case in cases::all(dtype).unwrap() {
            let mut obj = Map::new();
            obj.insert("op".into(), json!(case.op));
            for (k, v) in &case.params {
                obj.insert(k.clone(), v.clone());
            }
            for t in &case.inputs {
                obj.insert(t.name.clone(), tensor_json(t));
            }
            if obj.contains_key("grad_output") && !obj.contains_key("want_grad") {
                obj.insert("want_grad".into(), json!(true));
            }
            for imp in impls_of(case.op) {
                let mut c = obj.clone();
                if imp != "reference" {
                    c.insert("impl".into(), json!(imp));
                }
                let text = match evaluate(&Value::Object(c)) {
                    Ok(v) => serde_json::to_string(&v).unwrap(),
                    Err(e) => serde_json::to_string(&e.to_json()).unwrap(),
                };
                evaluated += 1;
                lines.push(format!(
                    "{} {} {}: {} ({} bytes)",
                    dtype.name(),
                    case.name,
                    imp,
                    &sha256_hex(text.as_bytes())[..16],
                    text.len()
                ));
            }
        }
    }
    assert!(evaluated > 40, "only {evaluated} evaluations");
    insta::assert_snapshot!(lines.join("\n"));
}
