//! The `cross_entropy`, `linear_cross_entropy` and `embedding` ops: the
//! vocabulary-parallel layers of `packshard_reference::vocab`, unsharded or
//! on `num_shards` in-process ranks (docs/INTERFACE.md), through any
//! registered implementation of the op's family ([`crate::registry`]).

use ndarray::{Array2, Axis, Slice};
use packshard_reference::ops::{CeCall, EmbeddingCall, LinearCall, LinearInput};
use packshard_reference::vocab::sharded::ShardedLoss;
use packshard_reference::vocab::{
    CollectiveCounts, CrossEntropy, GradRequest, LossCall, LossConfig, Reduction, ShardLayout,
    ShardMap, ShardPlan, ShardedAlgorithm, SmoothingConvention,
};
use serde_json::{json, Map, Value};

use super::{make, num, Case, EvalError, Tensor};
use crate::registry::{self, Entry};

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

/// The gradient request of a loss case, as read by [`grad_request`].
struct LossGrad {
    /// `want_grad`.
    want: bool,
    /// `grad_output`, where given.
    upstream: Option<Vec<f64>>,
}

impl LossGrad {
    /// The request a [`LossCall`] carries.
    fn request(&self) -> GradRequest<'_> {
        GradRequest::of(self.want, self.upstream.as_deref())
    }
}

/// The gradient request of a loss case: `want_grad` (default false) and
/// the optional upstream gradient `grad_output` (`[n]` under the reduction
/// `none`, `[1]` under `sum` and `mean`; docs/FAULTS.md O2), which needs
/// `want_grad: true` (as the embedding's).
fn grad_request(case: &Case) -> Result<LossGrad, EvalError> {
    let want_grad = case.opt_bool("want_grad")?.unwrap_or(false);
    if !case.has("grad_output") {
        return Ok(LossGrad {
            want: want_grad,
            upstream: None,
        });
    }
    if !want_grad {
        return Err(EvalError::invalid(
            "grad_output",
            "given without want_grad: true",
        ));
    }
    let g = case.tensor("grad_output", 1, "[n] (reduction none) or [1]")?;
    Ok(LossGrad {
        want: true,
        upstream: Some(g.data),
    })
}

/// Which algorithm runs: `unsharded` (the default without `num_shards`) or a
/// sharded one (`alg2` by default when `num_shards` is given).
pub enum Run {
    /// One shard, the unsharded form.
    Unsharded,
    /// `algorithm` over the shards of the map.
    Sharded(ShardedAlgorithm, ShardMap),
}

/// The loss options, the vocabulary size `v` (default: the given width `w`)
/// and the algorithm.
fn loss_options(case: &Case, width: usize) -> Result<(LossConfig, usize, Run), EvalError> {
    let defaults = LossConfig::default();
    let config = LossConfig {
        ignore_index: case
            .opt_i64("ignore_index")?
            .unwrap_or(defaults.ignore_index),
        label_smoothing: case.opt_f64("label_smoothing")?.unwrap_or(0.0),
        smoothing: case
            .opt_parse::<SmoothingConvention>("smoothing")?
            .unwrap_or_default(),
        z_loss: case.opt_f64("z_loss")?.unwrap_or(0.0),
        reduction: case
            .opt_parse::<Reduction>("reduction")?
            .unwrap_or_default(),
        softcap: case.opt_f64("softcap")?,
    };
    let v = vocab_size(case, width)?;
    Ok((config, v, run_of(case, v)?))
}

fn vocab_size(case: &Case, width: usize) -> Result<usize, EvalError> {
    check_vocab_size(case.opt_usize("vocab_size")?, width)
}

/// The vocabulary size `v`: `vocab_size` (default the given width `w`), at
/// most `w`.
///
/// # Errors
/// `shape_mismatch` naming `vocab_size` when it is over `w`.
pub fn check_vocab_size(vocab_size: Option<usize>, width: usize) -> Result<usize, EvalError> {
    let v = vocab_size.unwrap_or(width);
    if v > width {
        return Err(EvalError::new(
            "shape_mismatch",
            format!("vocab_size: {v} is more than the {width} vocabulary entries given"),
        ));
    }
    Ok(v)
}

fn run_of(case: &Case, v: usize) -> Result<Run, EvalError> {
    let shards = case.opt_usize("num_shards")?;
    let algorithm = case.opt_str("algorithm")?;
    let layout = case.opt_parse::<ShardLayout>("layout")?.unwrap_or_default();
    run_for(shards, algorithm, layout, v)
}

/// What runs for `num_shards` and `algorithm` (the eval op's defaults:
/// unsharded without `num_shards`, `alg2` with it) over a vocabulary of `v`
/// in `layout`.
///
/// # Errors
/// `invalid_argument` naming `algorithm` (unknown, or `unsharded` on more
/// than one shard) or the shard map's errors (`num_shards` out of range).
pub fn run_for(
    shards: Option<usize>,
    algorithm: Option<&str>,
    layout: ShardLayout,
    v: usize,
) -> Result<Run, EvalError> {
    match (algorithm, shards) {
        (None | Some("unsharded"), None) => Ok(Run::Unsharded),
        (Some("unsharded"), Some(1)) => Ok(Run::Unsharded),
        (Some("unsharded"), Some(p)) => Err(EvalError::invalid(
            "algorithm",
            format!(
                "unsharded runs on one shard, but num_shards is {p}; choose naive, alg1 or alg2"
            ),
        )),
        (a, p) => {
            let algorithm = a.map_or(Ok(ShardedAlgorithm::Alg2), str::parse::<ShardedAlgorithm>)?;
            Ok(Run::Sharded(
                algorithm,
                ShardMap::new(v, p.unwrap_or(1), layout)?,
            ))
        }
    }
}

/// The common part of the two loss results.
fn loss_result(
    op: &str,
    ce_loss: f64,
    per_token: &[f64],
    logsumexp: &[f64],
    num_tokens: usize,
    algorithm: &str,
) -> Map<String, Value> {
    let mut out = Map::new();
    out.insert("op".into(), json!(op));
    out.insert("algorithm".into(), json!(algorithm));
    out.insert("loss".into(), num(ce_loss));
    out.insert("per_token_loss".into(), vector(per_token));
    out.insert("logsumexp".into(), vector(logsumexp));
    out.insert("num_tokens".into(), json!(num_tokens));
    out
}

fn sharded_extras(out: &mut Map<String, Value>, s: &ShardedLoss) {
    out.insert("num_shards".into(), json!(s.map.num_shards()));
    out.insert("layout".into(), json!(s.map.layout().name()));
    out.insert("collectives".into(), counts_json(s.counts()));
    out.insert("peak_bytes_per_shard".into(), json!(s.peak_bytes()));
    out.insert(
        "shards".into(),
        Value::Array(
            s.map
                .shards()
                .iter()
                .map(
                    |sh| json!({"start": sh.start, "real": sh.real, "padding": sh.width - sh.real}),
                )
                .collect(),
        ),
    );
}

/// `[n, v]` gradient placed in a zero `[n, w]` array (padding columns 0).
pub fn widen_columns(g: &Array2<f64>, width: usize) -> Array2<f64> {
    let mut out = Array2::zeros((g.nrows(), width));
    out.slice_axis_mut(Axis(1), Slice::from(..g.ncols()))
        .assign(g);
    out
}

/// `[v, h]` gradient placed in a zero `[w, h]` array (padding rows 0).
pub fn widen_rows(g: &Array2<f64>, rows: usize) -> Array2<f64> {
    let mut out = Array2::zeros((rows, g.ncols()));
    out.slice_axis_mut(Axis(0), Slice::from(..g.nrows()))
        .assign(g);
    out
}

fn unsharded_json(op: &str, ce: &CrossEntropy) -> Map<String, Value> {
    let lse = ce.logsumexp();
    loss_result(
        op,
        ce.loss,
        ce.per_token_loss.as_slice().unwrap_or(&[]),
        lse.as_slice().unwrap_or(&[]),
        ce.num_tokens,
        "unsharded",
    )
}

fn sharded_json(
    op: &str,
    algorithm: ShardedAlgorithm,
    s: &ShardedLoss,
    num_tokens: usize,
) -> Map<String, Value> {
    let lse = s.logsumexp();
    let mut out = loss_result(
        op,
        s.loss(),
        s.per_token_loss().as_slice().unwrap_or(&[]),
        lse.as_slice().unwrap_or(&[]),
        num_tokens,
        algorithm.name(),
    );
    sharded_extras(&mut out, s);
    out
}

/// Refuses a sharded algorithm the implementation `imp` does not declare
/// (`declared`), naming the implementations of the family that run it.
///
/// # Errors
/// `invalid_argument` naming `num_shards` (an unsharded-only `imp`) or
/// `algorithm`.
pub fn check_declared<K: ?Sized>(
    list: &[Entry<K>],
    algorithms: impl Fn(&K) -> Vec<ShardedAlgorithm>,
    imp: &str,
    algorithm: ShardedAlgorithm,
) -> Result<(), EvalError> {
    let of = |name: &str| -> Vec<ShardedAlgorithm> {
        registry::find(list, name)
            .and_then(|e| e.make().ok())
            .map(|k| algorithms(&k))
            .unwrap_or_default()
    };
    let declared = of(imp);
    if declared.contains(&algorithm) {
        return Ok(());
    }
    if declared.is_empty() {
        let others: Vec<String> = list
            .iter()
            .filter(|e| e.name != imp && e.name != registry::REFERENCE)
            .filter_map(|e| {
                let a = of(e.name);
                (!a.is_empty()).then(|| {
                    let names: Vec<&str> = a.iter().map(|a| a.name()).collect();
                    format!("{} runs {}", e.name, names.join(", "))
                })
            })
            .collect();
        let mut message = format!("impl {imp} is unsharded only");
        if !others.is_empty() {
            message.push_str(&format!("; {}", others.join("; ")));
        }
        return Err(EvalError::invalid("num_shards", message));
    }
    let names: Vec<&str> = declared.iter().map(|a| a.name()).collect();
    Err(EvalError::invalid(
        "algorithm",
        format!(
            "impl {imp} implements unsharded and {} only, not {algorithm}",
            names.join(", ")
        ),
    ))
}

/// Tokens whose target is not ignored.
pub fn predicted(targets: &[i64], config: &LossConfig) -> usize {
    targets
        .iter()
        .filter(|&&t| t != config.ignore_index)
        .count()
}

/// `cross_entropy`: `logits` ([n, w]; `-inf` allowed; columns `vocab_size..`
/// are padding values, never read), `targets` ([n]) and the loss options,
/// through the registered [`registry::cross_entropy`] `imp`.
pub(super) fn cross_entropy_op(value: &Value, imp: &str) -> Result<Value, EvalError> {
    let mut allowed = LOSS_FIELDS.to_vec();
    allowed.push("logits");
    let case = Case::new(value, &allowed)?;
    let grad = grad_request(&case)?;
    let logits = array2(case.tensor("logits", 2, "[n, v]")?);
    let targets = case.i64_list("targets")?;
    let width = logits.ncols();
    let (config, v, run) = loss_options(&case, width)?;
    let call = LossCall::new(&targets, &config, grad.request());
    let list = registry::cross_entropy();
    let (mut out, grad_logits) = match run {
        Run::Unsharded => {
            let op = make(&list, imp)?;
            let real = logits.slice_axis(Axis(1), Slice::from(..v));
            let ce = op.cross_entropy(CeCall::new(real, call))?;
            (unsharded_json("cross_entropy", &ce), ce.grad_logits)
        }
        Run::Sharded(algorithm, map) => {
            // Made first: an entry that cannot run here says so, not
            // that it declares no algorithm.
            let op = make(&list, imp)?;
            check_declared(&list, |k| k.algorithms(), imp, algorithm)?;
            let s = op.sharded_cross_entropy(
                ShardPlan::new(algorithm, map),
                CeCall::new(logits.view(), call),
            )?;
            let out = sharded_json("cross_entropy", algorithm, &s, predicted(&targets, &config));
            (out, s.grad_logits())
        }
    };
    if imp != registry::REFERENCE {
        out.insert("impl".into(), json!(imp));
    }
    if let Some(g) = grad_logits {
        out.insert("grad_logits".into(), matrix(&widen_columns(&g, width)));
    }
    Ok(Value::Object(out))
}

/// `linear_cross_entropy`: `hidden` ([n, h]), `weight` ([w, h]; rows
/// `vocab_size..` are padding rows, never read), `targets` and the loss
/// options, through the registered [`registry::linear_cross_entropy`] `imp`.
pub(super) fn linear_cross_entropy_op(value: &Value, imp: &str) -> Result<Value, EvalError> {
    let mut allowed = LOSS_FIELDS.to_vec();
    allowed.extend(["hidden", "weight"]);
    let case = Case::new(value, &allowed)?;
    let grad = grad_request(&case)?;
    let hidden = array2(case.tensor("hidden", 2, "[n, h]")?);
    let weight = array2(case.tensor("weight", 2, "[v, h]")?);
    let targets = case.i64_list("targets")?;
    let rows = weight.nrows();
    let (config, v, run) = loss_options(&case, rows)?;
    let call = LossCall::new(&targets, &config, grad.request());
    // The `[n, v]` logits (and their gradient) are not in the input; with
    // them the f64 `hidden` and `weight` and, asked for, their gradients.
    let copies = if grad.want { 2u128 } else { 1 };
    let (n, h) = hidden.dim();
    let values = copies * (n as u128 * rows.max(v) as u128 + (n + rows) as u128 * h as u128);
    super::check_values(
        "weight",
        &[usize::try_from(values).unwrap_or(usize::MAX)],
        "the [n, v] logits of hidden @ weight^T, hidden, weight and their gradients",
    )?;
    let list = registry::linear_cross_entropy();
    let mut out = match run {
        Run::Unsharded => {
            let op = make(&list, imp)?;
            let real = weight.slice_axis(Axis(0), Slice::from(..v));
            let l = op.linear_cross_entropy(LinearCall::new(
                LinearInput::new(hidden.view(), real),
                call,
            ))?;
            let mut out = unsharded_json("linear_cross_entropy", &l.ce);
            if imp != registry::REFERENCE {
                out.insert("impl".into(), json!(imp));
            }
            if let Some(bytes) = l.logits_buffer_bytes {
                out.insert("logits_buffer_bytes".into(), json!(bytes));
            }
            if let Some(t) = l.traded {
                out.insert(
                    "traded".into(),
                    json!({"grad_hidden": t.grad_hidden, "grad_weight": t.grad_weight,
                           "skipped_tiles": t.skipped_tiles}),
                );
            }
            grads(
                &mut out,
                l.ce.grad_logits.as_ref(),
                l.grad_hidden.as_ref(),
                l.grad_weight.as_ref(),
                rows,
            );
            out
        }
        Run::Sharded(algorithm, map) => {
            // Made first: an entry that cannot run here says so, not
            // that it declares no algorithm.
            let op = make(&list, imp)?;
            check_declared(&list, |k| k.algorithms(), imp, algorithm)?;
            let s = op.sharded_linear_cross_entropy(
                ShardPlan::new(algorithm, map),
                LinearCall::new(LinearInput::new(hidden.view(), weight.view()), call),
            )?;
            let mut out = sharded_json(
                "linear_cross_entropy",
                algorithm,
                &s,
                predicted(&targets, &config),
            );
            if imp != registry::REFERENCE {
                out.insert("impl".into(), json!(imp));
            }
            grads(
                &mut out,
                s.grad_logits().as_ref(),
                s.grad_hidden(),
                s.grad_weight().as_ref(),
                rows,
            );
            out
        }
    };
    out.insert("vocab_size".into(), json!(v));
    Ok(Value::Object(out))
}

fn grads(
    out: &mut Map<String, Value>,
    logits: Option<&Array2<f64>>,
    hidden: Option<&Array2<f64>>,
    weight: Option<&Array2<f64>>,
    rows: usize,
) {
    if let Some(g) = logits {
        out.insert("grad_logits".into(), matrix(g));
    }
    if let Some(g) = hidden {
        out.insert("grad_hidden".into(), matrix(g));
    }
    if let Some(g) = weight {
        out.insert("grad_weight".into(), matrix(&widen_rows(g, rows)));
    }
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
    let v = vocab_size(&case, rows)?;
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
