//! The typed runner of the loss ops (`cross_entropy`,
//! `linear_cross_entropy`): the one place that chooses, checks and runs
//! them. `packshard eval` (JSON, [`super::vocab`]) and the Python package
//! (`python/src/py.rs`) read their inputs into [`LossOptions`] and call
//! [`cross_entropy`] / [`linear_cross_entropy`] (the `_with` forms take
//! arguments already checked: the Python judge's reference runs), so both front doors give
//! the same checks in the same order, the same errors and the same fields.
//!
//! The checks, in order: `impl` (a name of the op's family, as `eval`
//! checks it for every op); `grad_output` without `want_grad` (in
//! [`LossOptions::args`]); `smoothing`,
//! `reduction` (parsed); `vocab_size` (at most the given width `w`);
//! `layout`, `num_shards` and `algorithm` (which algorithm runs); for the
//! output layer, the memory bound of its `[n, v]` logits; `impl` (registered
//! and able to run here); a sharded algorithm the implementation declares;
//! then the implementation's own (the reference's checks, and the options it
//! declares through `LossOp::check_declared`).
//!
//! Shape legend as in `packshard-reference`: `n` tokens, `h` hidden size,
//! `v` vocabulary, `w >= v` given columns (rows), `p` shards.

use ndarray::{Array1, Array2, ArrayView2, Axis, Slice};
use packshard_reference::ops::{CeCall, LinearCall, LinearInput};
use packshard_reference::vocab::sharded::ShardedLoss;
use packshard_reference::vocab::{
    CrossEntropy, GradRequest, LossCall, LossConfig, Reduction, ShardLayout, ShardMap, ShardPlan,
    ShardedAlgorithm, SmoothingConvention,
};
use serde_json::json;

use super::fields::{Fields, Out};
use super::{make, EvalError};
use crate::registry::{self, Entry};

/// The loss options as a front door reads them (docs/INTERFACE.md), not yet
/// checked: the strings unparsed, every option `None` for the contract's
/// default.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LossOptions {
    /// Default -100 (PyTorch's).
    pub ignore_index: Option<i64>,
    /// Default 0.
    pub label_smoothing: Option<f64>,
    /// `pytorch` (default) or `megatron`.
    pub smoothing: Option<String>,
    /// Default 0.
    pub z_loss: Option<f64>,
    /// `mean` (default), `sum` or `none`.
    pub reduction: Option<String>,
    /// `c` of the logit softcap `c * tanh(z / c)` (docs/FAULTS.md O1).
    pub softcap: Option<f64>,
    /// Real vocabulary entries (`<= w`); `None`: all of them.
    pub vocab_size: Option<usize>,
    /// `None`: unsharded.
    pub num_shards: Option<usize>,
    /// `unsharded`, `naive`, `alg1`, `alg2`.
    pub algorithm: Option<String>,
    /// `uneven` (default) or `padded`.
    pub layout: Option<String>,
    /// Also the gradients of the loss.
    pub want_grad: bool,
    /// The upstream gradient, with `want_grad`: `[n]` under the reduction
    /// `none`, `[1]` otherwise (docs/FAULTS.md O2).
    pub grad_output: Option<Vec<f64>>,
}

impl LossOptions {
    /// The checked arguments of a call on `targets: [n]`.
    ///
    /// # Errors
    /// `invalid_argument` naming `grad_output` (given without
    /// `want_grad`), `smoothing` or `reduction` (unknown name).
    pub fn args(self, targets: Vec<i64>) -> Result<LossArgs, EvalError> {
        if self.grad_output.is_some() && !self.want_grad {
            return Err(EvalError::invalid(
                "grad_output",
                "given without want_grad: true",
            ));
        }
        let defaults = LossConfig::default();
        let config = LossConfig {
            ignore_index: self.ignore_index.unwrap_or(defaults.ignore_index),
            label_smoothing: self.label_smoothing.unwrap_or(0.0),
            smoothing: self
                .smoothing
                .as_deref()
                .map(str::parse::<SmoothingConvention>)
                .transpose()?
                .unwrap_or_default(),
            z_loss: self.z_loss.unwrap_or(0.0),
            reduction: self
                .reduction
                .as_deref()
                .map(str::parse::<Reduction>)
                .transpose()?
                .unwrap_or_default(),
            softcap: self.softcap,
        };
        Ok(LossArgs {
            targets,
            config,
            vocab_size: self.vocab_size,
            num_shards: self.num_shards,
            algorithm: self.algorithm,
            layout: self.layout,
            want_grad: self.want_grad,
            grad_output: self.grad_output,
        })
    }
}

/// The arguments of `cross_entropy` and `linear_cross_entropy` with the
/// loss options parsed ([`LossOptions::args`]): `targets: [n]`, the
/// [`LossConfig`], `vocab_size` (default the given width), `num_shards`,
/// `algorithm`, `layout`.
#[derive(Debug, Clone)]
pub struct LossArgs {
    /// `[n]`.
    pub targets: Vec<i64>,
    /// `ignore_index`, `label_smoothing`, `smoothing`, `z_loss`, `reduction`,
    /// `softcap`.
    pub config: LossConfig,
    /// Real vocabulary entries (`<= w`); `None`: all of them.
    pub vocab_size: Option<usize>,
    /// `None`: unsharded.
    pub num_shards: Option<usize>,
    /// `unsharded`, `naive`, `alg1`, `alg2`.
    pub algorithm: Option<String>,
    /// `uneven` (default) or `padded`.
    pub layout: Option<String>,
    /// Also the gradients of the loss.
    pub want_grad: bool,
    /// The upstream gradient, with `want_grad`: `[n]` under the reduction
    /// `none`, `[1]` otherwise (docs/FAULTS.md O2).
    pub grad_output: Option<Vec<f64>>,
}

impl LossArgs {
    /// The loss call of these arguments.
    pub fn call(&self) -> LossCall<'_> {
        let grad = GradRequest::of(self.want_grad, self.grad_output.as_deref());
        LossCall::new(&self.targets, &self.config, grad)
    }

    /// The vocabulary size `v` over a given width `w` and what runs.
    fn run(&self, width: usize) -> Result<(usize, Run), EvalError> {
        let v = check_vocab_size(self.vocab_size, width)?;
        let layout = match &self.layout {
            Some(s) => s.parse::<ShardLayout>()?,
            None => ShardLayout::default(),
        };
        Ok((
            v,
            run_for(self.num_shards, self.algorithm.as_deref(), layout, v)?,
        ))
    }
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

/// Which algorithm runs: `unsharded` (the default without `num_shards`) or a
/// sharded one (`alg2` by default when `num_shards` is given).
pub enum Run {
    /// One shard, the unsharded form.
    Unsharded,
    /// `algorithm` over the shards of the map.
    Sharded(ShardedAlgorithm, ShardMap),
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

fn t1(a: Array1<f64>) -> Out {
    Out::Tensor(a.into_dyn())
}

fn t2(a: Array2<f64>) -> Out {
    Out::Tensor(a.into_dyn())
}

/// `algorithm`, `loss`, `per_token_loss: [n]`, `logsumexp: [n]`,
/// `num_tokens` of an unsharded run.
fn unsharded_fields(ce: &CrossEntropy) -> Fields {
    vec![
        ("algorithm", Out::Str("unsharded".into())),
        ("loss", Out::F64(ce.loss)),
        ("per_token_loss", t1(ce.per_token_loss.clone())),
        ("logsumexp", t1(ce.logsumexp())),
        ("num_tokens", Out::Usize(ce.num_tokens)),
    ]
}

/// The unsharded fields, then `num_shards`, `layout`, `collectives`,
/// `peak_bytes_per_shard` and `shards` of a sharded run.
fn sharded_fields(s: &ShardedLoss, num_tokens: usize, algorithm: ShardedAlgorithm) -> Fields {
    let c = s.counts();
    let shards: Vec<serde_json::Value> = s
        .map
        .shards()
        .iter()
        .map(|sh| json!({"start": sh.start, "real": sh.real, "padding": sh.width - sh.real}))
        .collect();
    vec![
        ("algorithm", Out::Str(algorithm.name().into())),
        ("loss", Out::F64(s.loss())),
        ("per_token_loss", t1(s.per_token_loss().clone())),
        ("logsumexp", t1(s.logsumexp())),
        ("num_tokens", Out::Usize(num_tokens)),
        ("num_shards", Out::Usize(s.map.num_shards())),
        ("layout", Out::Str(s.map.layout().name().into())),
        (
            "collectives",
            Out::Json(json!({"calls": c.calls, "barriers": c.barriers, "elements": c.elements})),
        ),
        ("peak_bytes_per_shard", Out::Usize(s.peak_bytes())),
        ("shards", Out::Json(serde_json::Value::Array(shards))),
    ]
}

/// `imp` is a name of `list`, the family of `op`.
///
/// # Errors
/// `invalid_argument` naming `impl`, as `eval` gives it ([`super::no_impl`]).
pub(super) fn known<K: ?Sized>(list: &[Entry<K>], op: &str, imp: &str) -> Result<(), EvalError> {
    if registry::find(list, imp).is_some() {
        return Ok(());
    }
    let names: Vec<&str> = list.iter().map(|e| e.name).collect();
    Err(super::no_impl(op, imp, &names))
}

/// `impl`, named unless it is the reference (docs/INTERFACE.md).
fn push_impl(out: &mut Fields, imp: &str) {
    if imp != registry::REFERENCE {
        out.push(("impl", Out::Str(imp.into())));
    }
}

/// `cross_entropy` as a front door calls it: `impl` checked first (as
/// `eval` does for every op), then `options` ([`LossOptions::args`]) on
/// `targets: [n]`, then [`cross_entropy_with`].
///
/// # Errors
/// The checks of the module docs, in their order.
pub fn cross_entropy(
    imp: &str,
    logits: ArrayView2<'_, f64>,
    targets: Vec<i64>,
    options: LossOptions,
) -> Result<Fields, EvalError> {
    known(&registry::cross_entropy(), "cross_entropy", imp)?;
    cross_entropy_with(imp, logits, &options.args(targets)?)
}

/// `linear_cross_entropy` as a front door calls it: as [`cross_entropy`],
/// then [`linear_cross_entropy_with`].
///
/// # Errors
/// The checks of the module docs, in their order.
pub fn linear_cross_entropy(
    imp: &str,
    hidden: ArrayView2<'_, f64>,
    weight: ArrayView2<'_, f64>,
    targets: Vec<i64>,
    options: LossOptions,
) -> Result<Fields, EvalError> {
    known(
        &registry::linear_cross_entropy(),
        "linear_cross_entropy",
        imp,
    )?;
    linear_cross_entropy_with(imp, hidden, weight, &options.args(targets)?)
}

/// `cross_entropy` through the registered `imp`: `logits: [n, w]` (`-inf`
/// allowed; columns `vocab_size..` padding, never read). Fields, in order:
/// `algorithm`, `loss`, `per_token_loss: [n]`, `logsumexp: [n]`,
/// `num_tokens`, the sharded run's (`num_shards`, `layout`, `collectives`,
/// `peak_bytes_per_shard`, `shards`), `impl` (not for the reference),
/// `grad_logits: [n, w]` with `want_grad` (padding columns 0).
///
/// # Errors
/// The checks of the module docs, in their order.
pub fn cross_entropy_with(
    imp: &str,
    logits: ArrayView2<'_, f64>,
    a: &LossArgs,
) -> Result<Fields, EvalError> {
    let list = registry::cross_entropy();
    known(&list, "cross_entropy", imp)?;
    let width = logits.ncols();
    let (v, run) = a.run(width)?;
    // Made first: an entry that cannot run here says so, not that it
    // declares no algorithm.
    let op = make(&list, imp)?;
    let (mut out, grad) = match run {
        Run::Unsharded => {
            let real = logits.slice_axis(Axis(1), Slice::from(..v));
            let ce = op.cross_entropy(CeCall::new(real, a.call()))?;
            (unsharded_fields(&ce), ce.grad_logits)
        }
        Run::Sharded(algorithm, map) => {
            check_declared(&list, |k| k.algorithms(), imp, algorithm)?;
            let s = op.sharded_cross_entropy(
                ShardPlan::new(algorithm, map),
                CeCall::new(logits, a.call()),
            )?;
            let n = predicted(&a.targets, &a.config);
            (sharded_fields(&s, n, algorithm), s.grad_logits())
        }
    };
    push_impl(&mut out, imp);
    if let Some(g) = grad {
        out.push(("grad_logits", t2(widen_columns(&g, width))));
    }
    Ok(out)
}

/// `linear_cross_entropy` through the registered `imp`: `hidden: [n, h]`,
/// `weight: [w, h]` (rows `vocab_size..` padding, never read). Fields as
/// [`cross_entropy_with`]'s up to `impl`, then `logits_buffer_bytes` and
/// `traded` (unsharded, where the kernel reports them), `grad_logits: [n,
/// v]` (where materialized), `grad_hidden: [n, h]`, `grad_weight: [w, h]`
/// (padding rows 0) with `want_grad`, and `vocab_size`.
///
/// # Errors
/// The checks of the module docs, in their order.
pub fn linear_cross_entropy_with(
    imp: &str,
    hidden: ArrayView2<'_, f64>,
    weight: ArrayView2<'_, f64>,
    a: &LossArgs,
) -> Result<Fields, EvalError> {
    let list = registry::linear_cross_entropy();
    known(&list, "linear_cross_entropy", imp)?;
    let rows = weight.nrows();
    let (v, run) = a.run(rows)?;
    // The `[n, v]` logits (and their gradient) are not in the input; with
    // them the f64 `hidden` and `weight` and, asked for, their gradients.
    let copies = if a.want_grad { 2u128 } else { 1 };
    let (n, h) = hidden.dim();
    let values = copies * (n as u128 * rows.max(v) as u128 + (n + rows) as u128 * h as u128);
    super::check_values(
        "weight",
        &[usize::try_from(values).unwrap_or(usize::MAX)],
        "the [n, v] logits of hidden @ weight^T, hidden, weight and their gradients",
    )?;
    let op = make(&list, imp)?;
    let (mut out, gl, gh, gw) = match run {
        Run::Unsharded => {
            let real = weight.slice_axis(Axis(0), Slice::from(..v));
            let l =
                op.linear_cross_entropy(LinearCall::new(LinearInput::new(hidden, real), a.call()))?;
            let mut out = unsharded_fields(&l.ce);
            push_impl(&mut out, imp);
            if let Some(b) = l.logits_buffer_bytes {
                out.push(("logits_buffer_bytes", Out::Usize(b)));
            }
            if let Some(t) = l.traded {
                out.push((
                    "traded",
                    Out::Json(
                        json!({"grad_hidden": t.grad_hidden, "grad_weight": t.grad_weight,
                           "skipped_tiles": t.skipped_tiles}),
                    ),
                ));
            }
            (out, l.ce.grad_logits, l.grad_hidden, l.grad_weight)
        }
        Run::Sharded(algorithm, map) => {
            check_declared(&list, |k| k.algorithms(), imp, algorithm)?;
            let s = op.sharded_linear_cross_entropy(
                ShardPlan::new(algorithm, map),
                LinearCall::new(LinearInput::new(hidden, weight), a.call()),
            )?;
            let n = predicted(&a.targets, &a.config);
            let mut out = sharded_fields(&s, n, algorithm);
            push_impl(&mut out, imp);
            (
                out,
                s.grad_logits(),
                s.grad_hidden().cloned(),
                s.grad_weight(),
            )
        }
    };
    if let Some(g) = gl {
        out.push(("grad_logits", t2(g)));
    }
    if let Some(g) = gh {
        out.push(("grad_hidden", t2(g)));
    }
    if let Some(g) = gw {
        out.push(("grad_weight", t2(widen_rows(&g, rows))));
    }
    out.push(("vocab_size", Out::Usize(v)));
    Ok(out)
}
