//! `packshard eval` on the golden set, byte for byte: every golden case (the
//! f64 and the f32 set) sent to `eval` as a JSON case, through every impl its
//! op accepts, and the SHA-256 of each result's JSON text pinned in an insta
//! snapshot. A refactor that claims "behaviour unchanged" must leave this
//! snapshot as it is; a change to the numerics shows up as a changed hash in
//! review, naming the case and the impl.

use packshard::eval::{evaluate, list};
use packshard::golden::cases;
use packshard::golden::io::{sha256_hex, Dtype};
use packshard::golden::registry::eval_case;

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
            for imp in impls_of(case.op) {
                let text = match evaluate(&eval_case(&case, &imp)) {
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
