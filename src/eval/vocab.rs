//! The `cross_entropy`, `linear_cross_entropy` and `embedding` ops: the
//! vocabulary-parallel layers of `packshard_reference::vocab`, unsharded or
//! on `num_shards` in-process ranks (docs/INTERFACE.md).

use ndarray::{Array2, Axis, Slice};
use packshard_optimized::adapt::to_f32;
use packshard_optimized::vocab as opt;
use packshard_reference::vocab::embedding::{
    embedding_backward, embedding_forward, sharded_embedding,
};
use packshard_reference::vocab::sharded::{
    sharded_cross_entropy, sharded_linear_cross_entropy, ShardedLoss,
};
use packshard_reference::vocab::{
    cross_entropy, linear_cross_entropy, CollectiveCounts, CrossEntropy, LossConfig, Reduction,
    ShardLayout, ShardMap, ShardedAlgorithm, SmoothingConvention,
};
use serde_json::{json, Map, Value};

use super::{Case, EvalError, Tensor};

const LOSS_FIELDS: [&str; 10] = [
    "targets",
    "ignore_index",
    "label_smoothing",
    "smoothing",
    "z_loss",
    "reduction",
    "num_shards",
    "algorithm",
    "vocab_size",
    "layout",
];

/// A JSON number, or `"inf"`, `"-inf"`, `"nan"` (JSON has no literal for them).
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

/// Which algorithm runs: `unsharded` (the default without `num_shards`) or a
/// sharded one (`alg2` by default when `num_shards` is given).
enum Run {
    Unsharded,
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
    };
    let v = vocab_size(case, width)?;
    Ok((config, v, run_of(case, v)?))
}

fn vocab_size(case: &Case, width: usize) -> Result<usize, EvalError> {
    let v = case.opt_usize("vocab_size")?.unwrap_or(width);
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
fn widen_columns(g: &Array2<f64>, width: usize) -> Array2<f64> {
    let mut out = Array2::zeros((g.nrows(), width));
    out.slice_axis_mut(Axis(1), Slice::from(..g.ncols()))
        .assign(g);
    out
}

/// `[v, h]` gradient placed in a zero `[w, h]` array (padding rows 0).
fn widen_rows(g: &Array2<f64>, rows: usize) -> Array2<f64> {
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

/// The optimized variants run the unsharded form or `alg2` only.
fn alg2_only(imp: &str, algorithm: ShardedAlgorithm) -> Result<(), EvalError> {
    if algorithm == ShardedAlgorithm::Alg2 {
        Ok(())
    } else {
        Err(EvalError::invalid(
            "algorithm",
            format!("impl {imp} implements unsharded and alg2 only, not {algorithm}"),
        ))
    }
}

/// `[n, w]` as f32: the real columns `..v` through [`to_f32`] (values beyond
/// the f32 range refused, naming `field[i]`), padding columns cast (never read).
fn narrow_columns(field: &str, a: &Array2<f64>, v: usize) -> Result<Array2<f32>, EvalError> {
    to_f32(field, a.slice_axis(Axis(1), Slice::from(..v)))?;
    Ok(a.mapv(|x| x as f32))
}

/// As [`narrow_columns`] for the rows `..v` of `[w, h]`.
fn narrow_rows(field: &str, a: &Array2<f64>, v: usize) -> Result<Array2<f32>, EvalError> {
    to_f32(field, a.slice_axis(Axis(0), Slice::from(..v)))?;
    Ok(a.mapv(|x| x as f32))
}

fn f32_json(op: &str, ce: &opt::CrossEntropy32, imp: &str) -> Map<String, Value> {
    let lse = ce.logsumexp();
    let mut out = loss_result(
        op,
        ce.loss,
        ce.per_token_loss.as_slice().unwrap_or(&[]),
        lse.as_slice().unwrap_or(&[]),
        ce.num_tokens,
        "unsharded",
    );
    out.insert("impl".into(), json!(imp));
    out
}

fn widen32(a: &Array2<f32>) -> Array2<f64> {
    a.mapv(f64::from)
}

/// `cross_entropy` under an optimized `imp` (`cross_entropy_f32`).
fn cross_entropy_optimized(
    imp: &str,
    logits: &Array2<f64>,
    targets: &[i64],
    config: &LossConfig,
    v: usize,
    run: Run,
    want_grad: bool,
) -> Result<Map<String, Value>, EvalError> {
    let width = logits.ncols();
    let z = narrow_columns("logits", logits, v)?;
    Ok(match run {
        Run::Unsharded => {
            let ce = opt::cross_entropy(
                z.slice_axis(Axis(1), Slice::from(..v)),
                targets,
                config,
                want_grad,
            )?;
            let mut out = f32_json("cross_entropy", &ce, imp);
            if let Some(g) = &ce.grad_logits {
                out.insert(
                    "grad_logits".into(),
                    matrix(&widen_columns(&widen32(g), width)),
                );
            }
            out
        }
        Run::Sharded(algorithm, map) => {
            alg2_only(imp, algorithm)?;
            let s = opt::alg2::sharded_cross_entropy(&map, z.view(), targets, config, want_grad)?;
            let tokens = targets
                .iter()
                .filter(|&&t| t != config.ignore_index)
                .count();
            let mut out = sharded_json("cross_entropy", algorithm, &s, tokens);
            out.insert("impl".into(), json!(imp));
            if let Some(g) = s.grad_logits() {
                out.insert("grad_logits".into(), matrix(&widen_columns(&g, width)));
            }
            out
        }
    })
}

/// `cross_entropy`: `logits` ([n, w]; `-inf` allowed; columns `vocab_size..`
/// are padding values, never read), `targets` ([n]) and the loss options.
/// `imp`: `reference` or `cross_entropy_f32` (unsharded or `alg2`).
pub(super) fn cross_entropy_op(value: &Value, imp: &str) -> Result<Value, EvalError> {
    let mut allowed = LOSS_FIELDS.to_vec();
    allowed.push("logits");
    let case = Case::new(value, &allowed)?;
    let want_grad = case.opt_bool("want_grad")?.unwrap_or(false);
    let logits = array2(case.tensor("logits", 2, "[n, v]")?);
    let targets = case.i64_list("targets")?;
    let width = logits.ncols();
    let (config, v, run) = loss_options(&case, width)?;
    if imp != "reference" {
        let out = cross_entropy_optimized(imp, &logits, &targets, &config, v, run, want_grad)?;
        return Ok(Value::Object(out));
    }
    let real = logits.slice_axis(Axis(1), Slice::from(..v));
    let out = match run {
        Run::Unsharded => {
            let ce = cross_entropy(real, &targets, &config, want_grad)?;
            let mut out = unsharded_json("cross_entropy", &ce);
            if let Some(g) = &ce.grad_logits {
                out.insert("grad_logits".into(), matrix(&widen_columns(g, width)));
            }
            out
        }
        Run::Sharded(algorithm, map) => {
            let s = sharded_cross_entropy(
                algorithm,
                &map,
                logits.view(),
                &targets,
                &config,
                want_grad,
            )?;
            let tokens = targets
                .iter()
                .filter(|&&t| t != config.ignore_index)
                .count();
            let mut out = sharded_json("cross_entropy", algorithm, &s, tokens);
            if let Some(g) = s.grad_logits() {
                out.insert("grad_logits".into(), matrix(&widen_columns(&g, width)));
            }
            out
        }
    };
    Ok(Value::Object(out))
}

/// `linear_cross_entropy` under an optimized `imp`: `linear_ce_materialized`
/// (unsharded) or `linear_ce_fused` (unsharded, or `alg2` with the fused
/// shard kernel), default chunks.
#[allow(clippy::too_many_arguments)]
fn linear_optimized(
    imp: &str,
    hidden: &Array2<f64>,
    weight: &Array2<f64>,
    targets: &[i64],
    config: &LossConfig,
    v: usize,
    run: Run,
    want_grad: bool,
) -> Result<Map<String, Value>, EvalError> {
    let rows = weight.nrows();
    let x = to_f32("hidden", hidden.view())?;
    let w = narrow_rows("weight", weight, v)?;
    let chunks = opt::Chunks::default();
    Ok(match run {
        Run::Unsharded => {
            let real = w.slice_axis(Axis(0), Slice::from(..v));
            let l = if imp == "linear_ce_materialized" {
                opt::linear_cross_entropy_materialized(x.view(), real, targets, config, want_grad)?
            } else {
                opt::linear_cross_entropy_fused(x.view(), real, targets, config, want_grad, chunks)?
            };
            let mut out = f32_json("linear_cross_entropy", &l.ce, imp);
            out.insert("logits_buffer_bytes".into(), json!(l.logits_buffer_bytes));
            grads(
                &mut out,
                None,
                l.grad_hidden.map(|g| widen32(&g)).as_ref(),
                l.grad_weight.map(|g| widen32(&g)).as_ref(),
                rows,
            );
            out
        }
        Run::Sharded(algorithm, map) => {
            if imp == "linear_ce_materialized" {
                return Err(EvalError::invalid(
                    "num_shards",
                    "impl linear_ce_materialized is unsharded only; linear_ce_fused runs alg2",
                ));
            }
            alg2_only(imp, algorithm)?;
            let s = opt::alg2::sharded_linear_cross_entropy(
                &map,
                x.view(),
                w.view(),
                targets,
                config,
                want_grad,
                chunks,
                false,
            )?;
            let tokens = targets
                .iter()
                .filter(|&&t| t != config.ignore_index)
                .count();
            let mut out = sharded_json("linear_cross_entropy", algorithm, &s, tokens);
            out.insert("impl".into(), json!(imp));
            grads(
                &mut out,
                None,
                s.grad_hidden(),
                s.grad_weight().as_ref(),
                rows,
            );
            out
        }
    })
}

/// `linear_cross_entropy`: `hidden` ([n, h]), `weight` ([w, h]; rows
/// `vocab_size..` are padding rows, never read), `targets` and the loss
/// options. `imp`: `reference`, `linear_ce_materialized` or `linear_ce_fused`.
pub(super) fn linear_cross_entropy_op(value: &Value, imp: &str) -> Result<Value, EvalError> {
    let mut allowed = LOSS_FIELDS.to_vec();
    allowed.extend(["hidden", "weight"]);
    let case = Case::new(value, &allowed)?;
    let want_grad = case.opt_bool("want_grad")?.unwrap_or(false);
    let hidden = array2(case.tensor("hidden", 2, "[n, h]")?);
    let weight = array2(case.tensor("weight", 2, "[v, h]")?);
    let targets = case.i64_list("targets")?;
    let rows = weight.nrows();
    let (config, v, run) = loss_options(&case, rows)?;
    if imp != "reference" {
        let mut out =
            linear_optimized(imp, &hidden, &weight, &targets, &config, v, run, want_grad)?;
        out.insert("vocab_size".into(), json!(v));
        return Ok(Value::Object(out));
    }
    let real = weight.slice_axis(Axis(0), Slice::from(..v));
    let mut out = match run {
        Run::Unsharded => {
            let l = linear_cross_entropy(hidden.view(), real, &targets, &config, want_grad)?;
            let mut out = unsharded_json("linear_cross_entropy", &l.ce);
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
            let s = sharded_linear_cross_entropy(
                algorithm,
                &map,
                hidden.view(),
                weight.view(),
                &targets,
                &config,
                want_grad,
            )?;
            let tokens = targets
                .iter()
                .filter(|&&t| t != config.ignore_index)
                .count();
            let mut out = sharded_json("linear_cross_entropy", algorithm, &s, tokens);
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
/// `want_grad`.
pub(super) fn embedding_op(value: &Value) -> Result<Value, EvalError> {
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
    let real = weight.slice_axis(Axis(0), Slice::from(..v));
    let mut out = Map::new();
    out.insert("op".into(), json!("embedding"));
    match case.opt_usize("num_shards")? {
        None => {
            if case.has("layout") {
                return Err(EvalError::invalid("layout", "needs num_shards"));
            }
            let output = embedding_forward(&ids, real)?;
            out.insert("output".into(), matrix(&output));
            if let Some(g) = &grad_output {
                let gw = embedding_backward(&ids, g.view(), v)?;
                out.insert("grad_weight".into(), matrix(&widen_rows(&gw, rows)));
            }
        }
        Some(p) => {
            let layout = case.opt_parse::<ShardLayout>("layout")?.unwrap_or_default();
            let map = ShardMap::new(v, p, layout)?;
            let s = sharded_embedding(
                &map,
                &ids,
                weight.view(),
                grad_output.as_ref().map(|g| g.view()),
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
