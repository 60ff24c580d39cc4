//! The `cross_entropy`, `linear_cross_entropy` and `embedding` ops: the
//! vocabulary-parallel layers of `packshard_reference::vocab`, unsharded or
//! on `num_shards` in-process ranks (docs/INTERFACE.md), through any
//! registered implementation of the op's family ([`crate::registry`]).
//! This file reads the JSON; the loss ops are chosen, checked and run by the
//! typed runner [`super::loss`], the one the Python package calls.

use ndarray::{Array2, Axis, Slice};
use packshard_reference::ops::EmbeddingCall;
use packshard_reference::vocab::{CollectiveCounts, ShardLayout, ShardMap};
use serde_json::{json, Map, Value};

use super::fields::{to_json, Fields};
use super::loss::{self, check_vocab_size, widen_rows, LossOptions};
use super::{make, num, Case, EvalError, Tensor};
use crate::registry;

const LOSS_FIELDS: [&str; 12] = [
    "targets",
    "grad_output",
    "ignore_index",
    "label_smoothing",
    "smoothing",
    "z_loss",
    "reduction",
    "softcap",
    "num_shards",
    "algorithm",
    "vocab_size",
    "layout",
];

fn vector<'a>(xs: impl IntoIterator<Item = &'a f64>) -> Value {
    Value::Array(xs.into_iter().map(|&x| num(x)).collect())
}

fn matrix(a: &Array2<f64>) -> Value {
    Value::Array(a.rows().into_iter().map(|r| vector(r.iter())).collect())
}

fn counts_json(c: CollectiveCounts) -> Value {
    json!({"calls": c.calls, "barriers": c.barriers, "elements": c.elements})
}

fn array2(t: Tensor) -> Array2<f64> {
    Array2::from_shape_vec((t.shape[0], t.shape[1]), t.data)
        .expect("a 2-d tensor's data fills its shape")
}

/// The loss options of a case as [`LossOptions`], read (JSON types and
/// shapes) but unchecked: the runner checks them.
fn loss_options(case: &Case) -> Result<LossOptions, EvalError> {
    let want_grad = case.opt_bool("want_grad")?.unwrap_or(false);
    let grad_output = if case.has("grad_output") {
        Some(
            case.tensor("grad_output", 1, "[n] (reduction none) or [1]")?
                .data,
        )
    } else {
        None
    };
    Ok(LossOptions {
        ignore_index: case.opt_i64("ignore_index")?,
        label_smoothing: case.opt_f64("label_smoothing")?,
        smoothing: case.opt_str("smoothing")?.map(String::from),
        z_loss: case.opt_f64("z_loss")?,
        reduction: case.opt_str("reduction")?.map(String::from),
        softcap: case.opt_f64("softcap")?,
        vocab_size: case.opt_usize("vocab_size")?,
        num_shards: case.opt_usize("num_shards")?,
        algorithm: case.opt_str("algorithm")?.map(String::from),
        layout: case.opt_str("layout")?.map(String::from),
        want_grad,
        grad_output,
    })
}

/// A runner's fields as the eval result: `op` first, then the fields in
/// their order.
fn result(op: &str, fields: Fields) -> Value {
    let mut out = Map::new();
    out.insert("op".into(), json!(op));
    for (k, v) in &fields {
        out.insert((*k).into(), to_json(v));
    }
    Value::Object(out)
}

/// `cross_entropy`: `logits` ([n, w]; `-inf` allowed; columns `vocab_size..`
/// are padding values, never read), `targets` ([n]) and the loss options,
/// through the registered [`registry::cross_entropy`] `imp`, run by
/// [`loss::cross_entropy`].
pub(super) fn cross_entropy_op(value: &Value, imp: &str) -> Result<Value, EvalError> {
    let mut allowed = LOSS_FIELDS.to_vec();
    allowed.push("logits");
    let case = Case::new(value, &allowed)?;
    let logits = array2(case.tensor("logits", 2, "[n, v]")?);
    let targets = case.i64_list("targets")?;
    let options = loss_options(&case)?;
    Ok(result(
        "cross_entropy",
        loss::cross_entropy(imp, logits.view(), targets, options)?,
    ))
}

/// `linear_cross_entropy`: `hidden` ([n, h]), `weight` ([w, h]; rows
/// `vocab_size..` are padding rows, never read), `targets` and the loss
/// options, through the registered [`registry::linear_cross_entropy`]
/// `imp`, run by [`loss::linear_cross_entropy`].
pub(super) fn linear_cross_entropy_op(value: &Value, imp: &str) -> Result<Value, EvalError> {
    let mut allowed = LOSS_FIELDS.to_vec();
    allowed.extend(["hidden", "weight"]);
    let case = Case::new(value, &allowed)?;
    let hidden = array2(case.tensor("hidden", 2, "[n, h]")?);
    let weight = array2(case.tensor("weight", 2, "[v, h]")?);
    let targets = case.i64_list("targets")?;
    let options = loss_options(&case)?;
    Ok(result(
        "linear_cross_entropy",
        loss::linear_cross_entropy(imp, hidden.view(), weight.view(), targets, options)?,
    ))
}

/// `embedding`: `ids` ([n]), `weight` ([w, h]; rows `vocab_size..` padding),
/// `num_shards` (absent: unsharded), `layout`, `grad_output` ([n, h]) with
/// `want_grad`, through the registered [`registry::embedding`] `imp`.
pub(super) fn embedding_op(value: &Value, imp: &str) -> Result<Value, EvalError> {
    let case = Case::new(
        value,
        &[
            "ids",
            "weight",
            "num_shards",
            "vocab_size",
            "layout",
            "grad_output",
        ],
    )?;
    let want_grad = case.opt_bool("want_grad")?.unwrap_or(false);
    let ids = case.i64_list("ids")?;
    let weight = array2(case.tensor("weight", 2, "[v, h]")?);
    let rows = weight.nrows();
    let v = check_vocab_size(case.opt_usize("vocab_size")?, rows)?;
    let grad_output = if want_grad {
        let g = case.tensor("grad_output", 2, "[n, h]")?;
        Some(array2(g))
    } else if case.has("grad_output") {
        return Err(EvalError::invalid(
            "grad_output",
            "given without want_grad: true",
        ));
    } else {
        None
    };
    // The `[n, h]` lookup (and the `[w, h]` gradient) are not in the input.
    super::check_values(
        "ids",
        &[ids.len() + if want_grad { rows } else { 0 }, weight.ncols()],
        "the [n, h] lookup of ids in weight",
    )?;
    let real = weight.slice_axis(Axis(0), Slice::from(..v));
    let op = make(&registry::embedding(), imp)?;
    let mut out = Map::new();
    out.insert("op".into(), json!("embedding"));
    match case.opt_usize("num_shards")? {
        None => {
            if case.has("layout") {
                return Err(EvalError::invalid("layout", "needs num_shards"));
            }
            let e = op.embedding(EmbeddingCall::new(
                &ids,
                real,
                grad_output.as_ref().map(|g| g.view()),
            ))?;
            out.insert("output".into(), matrix(&e.output));
            if let Some(gw) = &e.grad_weight {
                out.insert("grad_weight".into(), matrix(&widen_rows(gw, rows)));
            }
        }
        Some(p) => {
            let layout = case.opt_parse::<ShardLayout>("layout")?.unwrap_or_default();
            let map = ShardMap::new(v, p, layout)?;
            let s = op.sharded_embedding(
                &map,
                EmbeddingCall::new(&ids, weight.view(), grad_output.as_ref().map(|g| g.view())),
            )?;
            out.insert("output".into(), matrix(&s.outputs[0]));
            if let Some(gw) = s.grad_weight() {
                out.insert("grad_weight".into(), matrix(&widen_rows(&gw, rows)));
            }
            out.insert("num_shards".into(), json!(p));
            out.insert("layout".into(), json!(layout.name()));
            out.insert("collectives".into(), counts_json(s.counts[0]));
        }
    }
    Ok(Value::Object(out))
}
