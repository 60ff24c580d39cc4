//! Issue #32, "hostile input, round three", through the real binary: the
//! edges of the range that used to answer wrong with status 0 (an edited
//! golden manifest, normalization of huge rows, the attention backward's
//! overflow, label smoothing at 1e308, options outside the f32 range), the
//! panics and budget holes, and messages that name what the user wrote.
//! Every case: the exit status, no "panicked", at most one line on stderr.

use std::process::Output;

use serde_json::{json, Value};

mod common;
use common::{packshard, stderr_text as stderr, temp_path};

#[path = "hostile_edges/budget.rs"]
mod budget;
#[path = "hostile_edges/golden.rs"]
mod golden;
#[path = "hostile_edges/numerics.rs"]
mod numerics;

/// No panic, at most one line on standard error.
fn assert_clean(o: &Output, what: &str) {
    let e = stderr(o);
    assert!(!e.contains("panicked"), "{what}: {e}");
    assert!(e.lines().count() <= 1, "{what}: more than one line: {e}");
}

/// `eval` of one case: its exit status and single JSON output line.
fn eval(case: &Value) -> (i32, Value) {
    let o = packshard(&["eval", "-"], Some(&case.to_string()));
    assert_clean(&o, &case.to_string());
    let out = String::from_utf8(o.stdout.clone()).unwrap();
    assert_eq!(out.lines().count(), 1, "{case}: {out}");
    (
        o.status.code().unwrap(),
        serde_json::from_str(out.trim()).unwrap(),
    )
}

/// `eval` of `case` must fail with `invalid_argument` and a message naming
/// `field` first.
fn refused(case: &Value, field: &str) -> String {
    let (code, v) = eval(case);
    assert_eq!(code, 2, "{case}: {v}");
    assert_eq!(v["error"]["kind"], "invalid_argument", "{case}: {v}");
    let m = v["error"]["message"].as_str().unwrap().to_string();
    assert!(m.starts_with(field), "{m:?} does not name {field}");
    m
}

/// `eval` of `case` must succeed: its result.
fn answered(case: &Value) -> Value {
    let (code, v) = eval(case);
    assert_eq!(code, 0, "{case}: {v}");
    v
}

/// The numbers of a JSON tensor (nested lists), flattened.
fn flat(v: &Value) -> Vec<f64> {
    match v {
        Value::Array(a) => a.iter().flat_map(flat).collect(),
        x => vec![x.as_f64().unwrap_or(f64::NAN)],
    }
}

#[test]
fn the_helpers_see_what_they_are_given() {
    // A negative control for `flat`: nulls (NaN, as eval writes them) are NaN.
    assert_eq!(flat(&json!([[1.0, 2.0], [3.0]])), vec![1.0, 2.0, 3.0]);
    assert!(flat(&json!([null]))[0].is_nan());
    let _ = temp_path("edges", "x");
}
#[path = "hostile_edges/work.rs"]
mod work;
