//! The golden set through a registered implementation: every case whose op
//! has a family in [`crate::registry`] is sent to `eval` with `impl`, and
//! the outputs are collected under the names a results file must use
//! (`<case>/<output>`), so `packshard check` judges any registered kernel —
//! or the golden cases are what a new kernel is checked on before anything
//! else (`packshard check DIR --impl NAME`).
//!
//! The set to use follows the implementation's precision: f64 kernels on the
//! `f64` set, f32 on `f32`, bf16 on `bf16` ([`dtype_for`]).

use serde_json::{json, Map, Value};

use super::io::{Dtype, Tensor, Values};
use super::{GoldenCase, GoldenError};
use crate::eval::{evaluate, num};
use crate::registry::{self, Family, Precision};

/// The golden set a kernel of `precision` is checked on.
pub fn dtype_for(precision: Precision) -> Dtype {
    match precision {
        Precision::F64 => Dtype::F64,
        Precision::F32 => Dtype::F32,
        Precision::Bf16 => Dtype::Bf16,
    }
}

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
