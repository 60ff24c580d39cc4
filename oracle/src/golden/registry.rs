//! The golden set through a registered implementation: every case whose op
//! has a family in [`crate::registry`] is sent to `eval` with `impl`, and
//! the outputs are collected under the names a results file must use
//! (`<case>/<output>`), so `packshard check` judges any registered kernel —
//! or the golden cases are what a new kernel is checked on before anything
//! else (`packshard check DIR --impl NAME`).
//!
//! The set to use follows the implementation's precision: f64 kernels on the
//! `f64` set, f32 on `f32`, bf16 on `bf16` (a golden [`Dtype`] is a
//! [`Precision`](crate::registry::Precision): the entry's `precision` is
//! the set's dtype).

use packshard_reference::attention::Window;
use packshard_reference::ops::{AttentionSupport, Varlen};
use serde_json::{json, Map, Value};

use super::io::{Dtype, Tensor, Values};
use super::{GoldenCase, GoldenError};
use crate::eval::{evaluate, num};
use crate::registry::{self, Family};

/// The family whose entries the `eval` op `op` runs, if any.
pub fn family_of(op: &str) -> Option<Family> {
    Family::ALL.into_iter().find(|f| f.eval_op() == Some(op))
}

/// Row-major values as nested JSON arrays of `shape`.
fn nested(values: &[Value], shape: &[usize]) -> Value {
    match shape {
        [] => values.first().cloned().unwrap_or(Value::Null),
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

/// A tensor as the nested JSON `eval` reads.
pub fn tensor_json(t: &Tensor) -> Value {
    let flat: Vec<Value> = match &t.values {
        Values::F(v, _) => v.iter().map(|&x| num(x)).collect(),
        Values::I(v) => v.iter().map(|&x| json!(x)).collect(),
    };
    nested(&flat, &t.shape)
}

/// The `eval` case of a golden case: its `op`, `params` and inputs (and
/// `want_grad` when it has a `grad_output`), with `impl` unless it is the
/// reference.
pub fn eval_case(case: &GoldenCase, imp: &str) -> Value {
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
    if imp != registry::REFERENCE {
        obj.insert("impl".into(), json!(imp));
    }
    Value::Object(obj)
}

fn flatten(v: &Value, out: &mut Vec<f64>) -> Result<(), String> {
    match v {
        Value::Array(items) => items.iter().try_for_each(|x| flatten(x, out)),
        Value::String(s) => {
            out.push(match s.as_str() {
                "inf" => f64::INFINITY,
                "-inf" => f64::NEG_INFINITY,
                "nan" => f64::NAN,
                other => return Err(format!("not a number: {other:?}")),
            });
            Ok(())
        }
        other => {
            out.push(
                other
                    .as_f64()
                    .ok_or_else(|| format!("not a number: {other}"))?,
            );
            Ok(())
        }
    }
}

/// Why an attention implementation declaring `support` must refuse the
/// golden case `case`: the refusal [`AttentionSupport::check`] (then
/// [`AttentionSupport::check_head_dim`]) gives for the case's problem (its
/// heads `q: [n_q, h, d]`, `k: [n_k, h_kv, d]`, offsets, `causal`,
/// `window_size`, `softcap`, `alibi_slopes`, `seqused_k`), so the golden
/// test and the kernel read one declaration. `None` when the case is within
/// the support, or is not an `attention` case.
pub fn outside_attention_support(case: &GoldenCase, support: AttentionSupport) -> Option<String> {
    if case.op != "attention" {
        return None;
    }
    let input = |name: &str| case.inputs.iter().find(|t| t.name == name);
    let offsets = |name: &str| {
        input(name).map(|t| t.as_f64().iter().map(|&x| x as usize).collect::<Vec<_>>())
    };
    let shape = |name: &str| input(name).map_or(vec![0; 3], |t| t.shape.clone());
    let (q, k) = (shape("q"), shape("k"));
    let cu_q = offsets("cu_seqlens")
        .or_else(|| offsets("cu_seqlens_q"))
        .unwrap_or_default();
    let cu_k = offsets("cu_seqlens_k").unwrap_or_else(|| cu_q.clone());
    let param = |name: &str| case.params.get(name);
    let window = param("window_size")
        .and_then(Value::as_array)
        .and_then(|w| Window::from_flash(w[0].as_i64()?, w[1].as_i64()?).ok())
        .unwrap_or(Window::UNBOUNDED);
    let alibi = input("alibi_slopes").map(Tensor::as_f64);
    let seqused_k = offsets("seqused_k");
    let p = Varlen::cross(
        &cu_q,
        &cu_k,
        param("causal").and_then(Value::as_bool).unwrap_or(false),
        param("scale").and_then(Value::as_f64).unwrap_or(1.0),
    )
    .with_window(window)
    .with_softcap(param("softcap").and_then(Value::as_f64).unwrap_or(0.0))
    .with_alibi_slopes(alibi.as_deref())
    .with_seqused_k(seqused_k.as_deref());
    support
        .check(&p, q[1], k[1])
        .and_then(|()| support.check_head_dim(q[2]))
        .err()
        .map(|e| e.to_string())
}

/// What one registered implementation gives on the golden set.
#[derive(Debug, Clone, PartialEq)]
pub struct ImplResults {
    /// The outputs, named `<case>/<output>`.
    pub tensors: Vec<Tensor>,
    /// The cases it ran.
    pub cases: Vec<String>,
    /// The cases it refused (an algorithm it does not implement), with the message.
    pub refused: Vec<(String, String)>,
}

/// Runs `imp` on every case of `cases` whose op's family has an entry
/// called `imp` (the reference runs every family's cases).
///
/// # Errors
/// A [`GoldenError`] when an output is missing from a result or is not
/// numbers.
pub fn results_of(cases: &[GoldenCase], imp: &str) -> Result<ImplResults, GoldenError> {
    let mut out = ImplResults {
        tensors: Vec::new(),
        cases: Vec::new(),
        refused: Vec::new(),
    };
    for case in cases {
        let Some(family) = family_of(case.op) else {
            continue;
        };
        if !registry::of(family).iter().any(|e| e.name == imp) {
            continue;
        }
        let result = match evaluate(&eval_case(case, imp)) {
            Ok(r) => r,
            Err(e) => {
                out.refused.push((case.name.clone(), e.to_string()));
                continue;
            }
        };
        for o in &case.outputs {
            let name = &o.tensor.name;
            let v = result.get(name).ok_or_else(|| {
                GoldenError::new(format!("{}: impl {imp} gave no {name}", case.name))
            })?;
            let mut values = Vec::new();
            flatten(v, &mut values)
                .map_err(|e| GoldenError::new(format!("{}/{name}: {e}", case.name)))?;
            out.tensors.push(Tensor::float(
                &case.result_name(name),
                &o.tensor.shape,
                values,
                Dtype::F64,
            ));
        }
        out.cases.push(case.name.clone());
    }
    Ok(out)
}
