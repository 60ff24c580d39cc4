//! `packshard._native`: the PyO3 layer over [`crate::core`] and
//! [`crate::cases`]. Arguments come positionally from the Python wrappers of
//! `packshard/__init__.py` (which name them as docs/INTERFACE.md does);
//! tensors are numpy arrays read in place (any strides, no copy) and results
//! are moved into new numpy arrays (no copy). Kernels run with the GIL
//! released.

use std::time::Instant;

use ndarray::{ArrayView2, ArrayView3};
use numpy::{PyArrayDyn, PyReadonlyArray1, PyReadonlyArray2, PyReadonlyArray3};
use packshard_oracle::eval::{self, EvalError};
use packshard_oracle::registry::{self, Family};
use packshard_reference::attention::varlen_pass;
use packshard_reference::ops::{Qkv, Varlen};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use pyo3::IntoPyObjectExt;

use crate::core::{
    self, AttentionArgs, AttnOptions, Fields, FlashArgs, KernelPrecision, LossArgs, Out, ReadFlash,
};
use crate::segments;

pyo3::create_exception!(
    _native,
    PackshardError,
    PyValueError,
    "Bad input or an impl that cannot run: `kind` (the eval error kind), `field` (the argument it names, or None), `index` (or None), `message`."
);

fn raise(py: Python<'_>, e: EvalError) -> PyErr {
    let err = PackshardError::new_err(e.message.clone());
    let v = err.value(py);
    let (field, index) = core::field_of(&e.message);
    let _ = v.setattr("kind", e.kind);
    let _ = v.setattr("field", field);
    let _ = v.setattr("index", index);
    let _ = v.setattr("message", e.message);
    err
}

/// Runs `f`, turning a panic inside it (a bug in packshard, never the
/// caller's) into a `PackshardError` of kind `internal`: PyO3 would raise
/// `PanicException`, a `BaseException` that `except Exception` lets through.
fn guard<T>(py: Python<'_>, f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| (*s).to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic without a message".into());
            let e = EvalError::new(
                "internal",
                format!("packshard panicked (a bug in packshard, please report it with the case): {what}"),
            );
            Err(raise(py, e))
        }
    }
}

fn json_to_py(py: Python<'_>, v: &serde_json::Value) -> PyResult<Py<PyAny>> {
    use serde_json::Value;
    match v {
        Value::Null => Ok(py.None()),
        Value::Bool(b) => b.into_py_any(py),
        Value::Number(n) => match (n.as_i64(), n.as_u64()) {
            (Some(i), _) => i.into_py_any(py),
            (None, Some(u)) => u.into_py_any(py),
            _ => n.as_f64().unwrap_or(f64::NAN).into_py_any(py),
        },
        Value::String(s) => s.into_py_any(py),
        Value::Array(xs) => {
            let items: Vec<Py<PyAny>> = xs
                .iter()
                .map(|x| json_to_py(py, x))
                .collect::<PyResult<_>>()?;
            PyList::new(py, items)?.into_py_any(py)
        }
        Value::Object(m) => {
            let d = PyDict::new(py);
            for (k, x) in m {
                d.set_item(k, json_to_py(py, x)?)?;
            }
            d.into_py_any(py)
        }
    }
}

fn out_to_py(py: Python<'_>, o: Out) -> PyResult<Py<PyAny>> {
    match o {
        Out::F64(x) => x.into_py_any(py),
        Out::Usize(x) => x.into_py_any(py),
        Out::I64(x) => x.into_py_any(py),
        Out::Bool(x) => x.into_py_any(py),
        Out::Str(s) => s.into_py_any(py),
        Out::Tensor(t) => PyArrayDyn::from_owned_array(py, t).into_py_any(py),
        Out::Ints(xs) => numpy::PyArray1::from_vec(py, xs).into_py_any(py),
        Out::Json(v) => json_to_py(py, &v),
    }
}

fn fields_to_py(py: Python<'_>, fields: Fields) -> PyResult<Py<PyAny>> {
    let d = PyDict::new(py);
    for (k, v) in fields {
        d.set_item(k, out_to_py(py, v)?)?;
    }
    d.into_py_any(py)
}

/// A kernel op's fields as a dict, or its error raised.
fn fields_result(py: Python<'_>, r: Result<Fields, EvalError>) -> PyResult<Py<PyAny>> {
    fields_to_py(py, r.map_err(|e| raise(py, e))?)
}

fn precision(py: Python<'_>, s: &str) -> PyResult<KernelPrecision> {
    core::parse_precision(s).map_err(|e| raise(py, e))
}

fn cu(py: Python<'_>, xs: &PyReadonlyArray1<'_, i64>) -> PyResult<Vec<usize>> {
    let v = xs.as_array().to_vec();
    core::offsets("cu_seqlens", &v).map_err(|e| raise(py, e))
}

/// The offsets and options of an attention call, read as `eval` reads them
/// ([`FlashArgs::read`]).
fn flash_args(
    cu_seqlens: &PyReadonlyArray1<'_, i64>,
    cu_seqlens_k: Option<&PyReadonlyArray1<'_, i64>>,
    window_size: Option<(i64, i64)>,
    softcap: Option<f64>,
    alibi_slopes: Option<Vec<f64>>,
    seqused_k: Option<Vec<i64>>,
) -> Result<ReadFlash, EvalError> {
    FlashArgs {
        cu_seqlens: cu_seqlens.as_array().to_vec(),
        cu_seqlens_k: cu_seqlens_k.map(|c| c.as_array().to_vec()),
        window_size,
        softcap,
        alibi_slopes,
        seqused_k,
    }
    .read()
}

/// Declares a `#[pyfunction]` `$name(q, k, v, cu_seqlens, causal, scale,
/// grad_output, $last, cu_seqlens_k=None, window_size=None, softcap=None,
/// alibi_slopes=None, seqused_k=None)`: an attention case's arguments as
/// the Python wrappers pass them (`q`, `grad_output`: `[n_q, h, d]`; `k`,
/// `v`: `[n_k, h_kv, d]`; `cu_seqlens: [b + 1]` the query offsets,
/// `cu_seqlens_k` the key offsets when they differ; flash-attention's
/// options, [`AttnOptions`]), bundled into the
/// [`AttentionArgs`] `$a` that `$body` runs on.
macro_rules! attention_pyfunction {
    ($(#[$doc:meta])* fn $name:ident($py:ident, $a:ident, $last:ident: $lt:ty) -> $ret:ty $body:block) => {
        $(#[$doc])*
        #[pyfunction]
        #[pyo3(signature = (q, k, v, cu_seqlens, causal, scale, grad_output, $last, cu_seqlens_k=None, window_size=None, softcap=None, alibi_slopes=None, seqused_k=None))]
        #[allow(clippy::too_many_arguments)]
        fn $name<'py>(
            $py: Python<'py>,
            q: PyReadonlyArray3<'py, f64>,
            k: PyReadonlyArray3<'py, f64>,
            v: PyReadonlyArray3<'py, f64>,
            cu_seqlens: PyReadonlyArray1<'py, i64>,
            causal: bool,
            scale: Option<f64>,
            grad_output: Option<PyReadonlyArray3<'py, f64>>,
            $last: $lt,
            cu_seqlens_k: Option<PyReadonlyArray1<'py, i64>>,
            window_size: Option<(i64, i64)>,
            softcap: Option<f64>,
            alibi_slopes: Option<Vec<f64>>,
            seqused_k: Option<Vec<i64>>,
        ) -> PyResult<$ret> {
            guard($py, || {
            let (cu_seqlens, cu_seqlens_k, options) = flash_args(
                &cu_seqlens, cu_seqlens_k.as_ref(), window_size, softcap, alibi_slopes, seqused_k,
            ).map_err(|e| raise($py, e))?;
            let $a = AttentionArgs {
                q: q.as_array(),
                k: k.as_array(),
                v: v.as_array(),
                cu_seqlens,
                cu_seqlens_k,
                causal,
                scale,
                grad_output: grad_output.as_ref().map(|g| g.as_array()),
                options,
            };
            $body
            })
        }
    };
}

attention_pyfunction! {
    /// `attention(q, k, v, cu_seqlens, causal, scale, grad_output, impl)`.
    fn attention(py, a, imp: String) -> Py<PyAny> {
        fields_result(py, py.detach(|| core::attention(&imp, &a)))
    }
}

/// `attention_f32(q, k, v, cu_seqlens, causal, scale, grad_output, impl,
/// cu_seqlens_k=None, window_size=None, softcap=None, alibi_slopes=None,
/// seqused_k=None)`: [`core::attention_f32`] on float32 arrays read in
/// place (any strides; C-contiguous ones are used without a copy), the
/// float32 results moved into new numpy arrays.
#[pyfunction]
#[pyo3(signature = (q, k, v, cu_seqlens, causal, scale, grad_output, imp, cu_seqlens_k=None, window_size=None, softcap=None, alibi_slopes=None, seqused_k=None))]
#[allow(clippy::too_many_arguments)]
fn attention_f32<'py>(
    py: Python<'py>,
    q: PyReadonlyArray3<'py, f32>,
    k: PyReadonlyArray3<'py, f32>,
    v: PyReadonlyArray3<'py, f32>,
    cu_seqlens: PyReadonlyArray1<'py, i64>,
    causal: bool,
    scale: Option<f64>,
    grad_output: Option<PyReadonlyArray3<'py, f32>>,
    imp: String,
    cu_seqlens_k: Option<PyReadonlyArray1<'py, i64>>,
    window_size: Option<(i64, i64)>,
    softcap: Option<f64>,
    alibi_slopes: Option<Vec<f64>>,
    seqused_k: Option<Vec<i64>>,
) -> PyResult<Py<PyAny>> {
    guard(py, || {
        let (cu_seqlens, cu_seqlens_k, options) = flash_args(
            &cu_seqlens,
            cu_seqlens_k.as_ref(),
            window_size,
            softcap,
            alibi_slopes,
            seqused_k,
        )
        .map_err(|e| raise(py, e))?;
        let a = AttentionArgs {
            q: q.as_array(),
            k: k.as_array(),
            v: v.as_array(),
            cu_seqlens,
            cu_seqlens_k,
            causal,
            scale,
            grad_output: grad_output.as_ref().map(|g| g.as_array()),
            options,
        };
        let fields = py
            .detach(|| core::attention_f32(&imp, &a))
            .map_err(|e| raise(py, e))?;
        let d = PyDict::new(py);
        for (name, t) in fields {
            d.set_item(name, PyArrayDyn::from_owned_array(py, t))?;
        }
        d.into_py_any(py)
    })
}

fn judged_to_py(py: Python<'_>, j: core::Judged) -> PyResult<(Py<PyAny>, Py<PyAny>)> {
    let e = fields_to_py(py, j.expected)?;
    let b = match j.baseline {
        Some(b) => fields_to_py(py, b)?,
        None => py.None(),
    };
    Ok((e, b))
}

attention_pyfunction! {
    /// The f64 reference (on inputs rounded to `precision`) and the f32 baseline
    /// of an attention case.
    fn attention_judged(py, a, precision: String) -> (Py<PyAny>, Py<PyAny>) {
        let p = self::precision(py, &precision)?;
        let j = py
            .detach(|| core::attention_judged(&a, p))
            .map_err(|e| raise(py, e))?;
        judged_to_py(py, j)
    }
}

/// The Rust kernel's own time: `reps` forward + backward passes of the
/// registered `imp` on these arrays, seconds each (no Python in between).
#[pyfunction]
#[pyo3(signature = (q, k, v, cu_seqlens, grad_output, imp, reps))]
#[allow(clippy::too_many_arguments)]
fn time_attention<'py>(
    py: Python<'py>,
    q: PyReadonlyArray3<'py, f64>,
    k: PyReadonlyArray3<'py, f64>,
    v: PyReadonlyArray3<'py, f64>,
    cu_seqlens: PyReadonlyArray1<'py, i64>,
    grad_output: PyReadonlyArray3<'py, f64>,
    imp: String,
    reps: usize,
) -> PyResult<Vec<f64>> {
    guard(py, || {
        let cu = cu(py, &cu_seqlens)?;
        let (q, k, v, go) = (
            q.as_array(),
            k.as_array(),
            v.as_array(),
            grad_output.as_array(),
        );
        let op = eval::make(&registry::attention(), &imp).map_err(|e| raise(py, e))?;
        let scale = packshard_reference::attention::default_scale(q.dim().2.max(1));
        let run =
            |q: ArrayView3<f64>, k: ArrayView3<f64>, v: ArrayView3<f64>, go: ArrayView3<f64>| {
                let p = Varlen::new(&cu, false, scale);
                let mut times = Vec::with_capacity(reps);
                for _ in 0..reps {
                    let t = Instant::now();
                    let g = varlen_pass(op.as_ref(), Qkv::new(q, k, v), &p, go)?;
                    std::hint::black_box(&g);
                    times.push(t.elapsed().as_secs_f64());
                }
                Ok::<_, packshard_reference::Error>(times)
            };
        py.detach(|| run(q, k, v, go))
            .map_err(|e| raise(py, e.into()))
    })
}

/// The f32 kernel's own time on float32 arrays read in place: `reps` calls of
/// `attention_varlen_tiled`'s forward (and its backward, with a
/// `grad_output`) under `causal`, seconds each (no Python, no conversion;
/// the tensors' checks included, as in every call). What
/// scripts/bench_torch.py compares with PyTorch.
#[pyfunction]
#[pyo3(signature = (q, k, v, cu_seqlens, causal, grad_output, reps))]
#[allow(clippy::too_many_arguments)]
fn time_attention_f32<'py>(
    py: Python<'py>,
    q: PyReadonlyArray3<'py, f32>,
    k: PyReadonlyArray3<'py, f32>,
    v: PyReadonlyArray3<'py, f32>,
    cu_seqlens: PyReadonlyArray1<'py, i64>,
    causal: bool,
    grad_output: Option<PyReadonlyArray3<'py, f32>>,
    reps: usize,
) -> PyResult<Vec<f64>> {
    guard(py, || {
        let a = AttentionArgs {
            q: q.as_array(),
            k: k.as_array(),
            v: v.as_array(),
            cu_seqlens: cu(py, &cu_seqlens)?,
            cu_seqlens_k: None,
            causal,
            scale: None,
            grad_output: grad_output.as_ref().map(|g| g.as_array()),
            options: AttnOptions::default(),
        };
        let run = || {
            let mut times = Vec::with_capacity(reps);
            for _ in 0..reps {
                let t = Instant::now();
                let r = core::attention_f32(core::F32_NATIVE, &a)?;
                std::hint::black_box(&r);
                times.push(t.elapsed().as_secs_f64());
            }
            Ok::<_, EvalError>(times)
        };
        py.detach(run).map_err(|e| raise(py, e))
    })
}

/// The options of a loss call (`cross_entropy`, `linear_cross_entropy`,
/// `loss_judged`), one dict from the Python side: the six loss options always
/// present, the sharding ones (`num_shards`, `algorithm`, `layout`) and
/// `softcap` optional;
/// `None` takes the contract's default (docs/INTERFACE.md).
#[derive(FromPyObject)]
#[pyo3(from_item_all)]
struct LossOptions {
    ignore_index: Option<i64>,
    label_smoothing: Option<f64>,
    smoothing: Option<String>,
    z_loss: Option<f64>,
    reduction: Option<String>,
    vocab_size: Option<usize>,
    #[pyo3(default)]
    num_shards: Option<usize>,
    #[pyo3(default)]
    algorithm: Option<String>,
    #[pyo3(default)]
    layout: Option<String>,
    /// `c` of the logit softcap `c * tanh(z / c)` (docs/FAULTS.md O1).
    #[pyo3(default)]
    softcap: Option<f64>,
    /// The upstream gradient (docs/FAULTS.md O2): `[n]` under the reduction
    /// `none`, `[1]` otherwise; needs `want_grad`.
    #[pyo3(default)]
    grad_output: Option<Vec<f64>>,
}

/// The runner's options of a Python call (checked by the runner `packshard
/// eval` calls, in its order).
fn options(o: LossOptions, want_grad: bool) -> core::LossOptions {
    core::LossOptions {
        ignore_index: o.ignore_index,
        label_smoothing: o.label_smoothing,
        smoothing: o.smoothing,
        z_loss: o.z_loss,
        reduction: o.reduction,
        softcap: o.softcap,
        vocab_size: o.vocab_size,
        num_shards: o.num_shards,
        algorithm: o.algorithm,
        layout: o.layout,
        want_grad,
        grad_output: o.grad_output,
    }
}

fn loss_args(
    py: Python<'_>,
    targets: &PyReadonlyArray1<'_, i64>,
    o: LossOptions,
    want_grad: bool,
) -> PyResult<LossArgs> {
    options(o, want_grad)
        .args(targets.as_array().to_vec())
        .map_err(|e| raise(py, e))
}

/// `cross_entropy(logits, targets, options, want_grad, impl)`: `options` a
/// dict of [`LossOptions`].
#[pyfunction]
#[pyo3(signature = (logits, targets, options, want_grad, imp))]
fn cross_entropy<'py>(
    py: Python<'py>,
    logits: PyReadonlyArray2<'py, f64>,
    targets: PyReadonlyArray1<'py, i64>,
    options: LossOptions,
    want_grad: bool,
    imp: String,
) -> PyResult<Py<PyAny>> {
    guard(py, || {
        let (o, t) = (
            self::options(options, want_grad),
            targets.as_array().to_vec(),
        );
        let z = logits.as_array();
        let r = py.detach(|| core::cross_entropy(&imp, z, t, o));
        fields_result(py, r)
    })
}

/// `linear_cross_entropy(hidden, weight, targets, options, want_grad, impl)`:
/// as `cross_entropy`.
#[pyfunction]
#[pyo3(signature = (hidden, weight, targets, options, want_grad, imp))]
fn linear_cross_entropy<'py>(
    py: Python<'py>,
    hidden: PyReadonlyArray2<'py, f64>,
    weight: PyReadonlyArray2<'py, f64>,
    targets: PyReadonlyArray1<'py, i64>,
    options: LossOptions,
    want_grad: bool,
    imp: String,
) -> PyResult<Py<PyAny>> {
    guard(py, || {
        let (o, t) = (
            self::options(options, want_grad),
            targets.as_array().to_vec(),
        );
        let (h, w) = (hidden.as_array(), weight.as_array());
        let r = py.detach(|| core::linear_cross_entropy(&imp, h, w, t, o));
        fields_result(py, r)
    })
}

/// The f64 reference and f32 baseline of a loss case (`logits`, or `hidden`
/// and `weight`).
#[pyfunction]
#[pyo3(signature = (logits, hidden, weight, targets, options, want_grad, precision))]
#[allow(clippy::too_many_arguments)]
fn loss_judged<'py>(
    py: Python<'py>,
    logits: Option<PyReadonlyArray2<'py, f64>>,
    hidden: Option<PyReadonlyArray2<'py, f64>>,
    weight: Option<PyReadonlyArray2<'py, f64>>,
    targets: PyReadonlyArray1<'py, i64>,
    options: LossOptions,
    want_grad: bool,
    precision: String,
) -> PyResult<(Py<PyAny>, Py<PyAny>)> {
    guard(py, || {
        let p = self::precision(py, &precision)?;
        let a = loss_args(py, &targets, options, want_grad)?;
        let z: Option<ArrayView2<f64>> = logits.as_ref().map(|x| x.as_array());
        let hw = match (&hidden, &weight) {
            (Some(h), Some(w)) => Some((h.as_array(), w.as_array())),
            _ => None,
        };
        let j = py
            .detach(|| core::loss_judged(z, hw, &a, p))
            .map_err(|e| raise(py, e))?;
        judged_to_py(py, j)
    })
}

/// `embedding(ids, weight, vocab_size, num_shards, layout, grad_output, impl)`.
#[pyfunction]
#[pyo3(signature = (ids, weight, vocab_size, num_shards, layout, grad_output, imp))]
#[allow(clippy::too_many_arguments)]
fn embedding<'py>(
    py: Python<'py>,
    ids: PyReadonlyArray1<'py, i64>,
    weight: PyReadonlyArray2<'py, f64>,
    vocab_size: Option<usize>,
    num_shards: Option<usize>,
    layout: Option<String>,
    grad_output: Option<PyReadonlyArray2<'py, f64>>,
    imp: String,
) -> PyResult<Py<PyAny>> {
    guard(py, || {
        let ids = ids.as_array().to_vec();
        let w = weight.as_array();
        let go = grad_output.as_ref().map(|g| g.as_array());
        let r = py.detach(|| {
            core::embedding(&imp, &ids, w, vocab_size, num_shards, layout.as_deref(), go)
        });
        fields_result(py, r)
    })
}

/// One `packshard eval` case as JSON text; the result as JSON text.
#[pyfunction]
fn eval_json(py: Python<'_>, case: String) -> PyResult<String> {
    guard(py, || {
        let r = py.detach(|| eval::evaluate_str(&case));
        r.map(|v| v.to_string()).map_err(|e| raise(py, e))
    })
}

/// One generated case: `(args, describe, size, input)`.
type GeneratedCase = (Py<PyAny>, String, usize, usize);

/// `n` generated cases of `op` from `seed`, `large` of them large (`None`:
/// 12 in 100, the default checks' share): `[(args, describe, size, input)]`.
#[pyfunction]
#[pyo3(name = "cases", signature = (op, n, seed, large=None))]
fn generated_cases(
    py: Python<'_>,
    op: String,
    n: usize,
    seed: u64,
    large: Option<usize>,
) -> PyResult<Vec<GeneratedCase>> {
    guard(py, || {
        let cs = py
            .detach(|| crate::cases::generate(&op, n, seed, large))
            .map_err(|e| raise(py, e))?;
        cs.into_iter()
            .map(|c| Ok((fields_to_py(py, c.args)?, c.describe, c.size, c.input)))
            .collect()
    })
}

/// Holds one tensor to the rule ([`core::judge_tensor`]): a dict with
/// `failure` (text or None), `error`, `baseline_error`, `allowed` (the error
/// allowed at `index`), `share` (largest `error / allowed`, at most 1 on a
/// pass), `index` (a list), and `expected` and `actual` there.
#[pyfunction]
#[pyo3(signature = (what, expected, baseline, actual, precision, scale=None, terms=None))]
#[allow(clippy::too_many_arguments)]
fn judge_tensor<'py>(
    py: Python<'py>,
    what: String,
    expected: numpy::PyReadonlyArrayDyn<'py, f64>,
    baseline: Option<numpy::PyReadonlyArrayDyn<'py, f64>>,
    actual: numpy::PyReadonlyArrayDyn<'py, f64>,
    precision: String,
    scale: Option<f64>,
    terms: Option<String>,
) -> PyResult<Py<PyAny>> {
    guard(py, || {
        let p = self::precision(py, &precision)?;
        let (e, a) = (expected.as_array(), actual.as_array());
        let v = if e.shape() != a.shape() {
            core::Verdict::shape_mismatch(&what, a.shape(), e.shape())
        } else {
            let e: Vec<f64> = e.iter().copied().collect();
            let a: Vec<f64> = a.iter().copied().collect();
            let b: Option<Vec<f64>> = baseline
                .as_ref()
                .map(|b| b.as_array().iter().copied().collect());
            let shape = expected.as_array().shape().to_vec();
            match terms
                .as_deref()
                .map(serde_json::from_str::<serde_json::Value>)
            {
                Some(Ok(t)) => {
                    segments::judge_result(&what, &shape, &e, b.as_deref(), &a, p, Some(&t))
                }
                Some(Err(e)) => {
                    return Err(raise(
                        py,
                        EvalError::invalid("terms", format!("not JSON: {e}")),
                    ))
                }
                None => core::judge_tensor(&what, &shape, &e, b.as_deref(), &a, p, scale),
            }
        };
        let d = PyDict::new(py);
        d.set_item("failure", v.failure)?;
        d.set_item("error", v.error)?;
        d.set_item("baseline_error", v.baseline_error)?;
        d.set_item("allowed", v.allowed)?;
        d.set_item("share", v.share)?;
        d.set_item("index", v.index)?;
        d.set_item("expected", v.expected)?;
        d.set_item("actual", v.actual)?;
        d.into_py_any(py)
    })
}

/// `x` rounded to the storage type `precision` (`f32`, `bf16`, `f16`,
/// `f64`), as the judge rounds a kernel's inputs; a new float64 array.
#[pyfunction]
fn round_to<'py>(
    py: Python<'py>,
    x: numpy::PyReadonlyArrayDyn<'py, f64>,
    precision: String,
) -> PyResult<Py<PyAny>> {
    guard(py, || {
        let p = self::precision(py, &precision)?;
        PyArrayDyn::from_owned_array(py, core::round_all(p, &x.as_array())).into_py_any(py)
    })
}

/// `precision` when it names one (`f32`, `bf16`, `f16`, `f64`); a
/// `PackshardError` naming `precision` and the allowed values otherwise.
#[pyfunction]
fn check_precision(py: Python<'_>, precision: String) -> PyResult<String> {
    guard(py, || {
        Ok(self::precision(py, &precision)?.name().to_string())
    })
}

/// Panics inside [`guard`], for the test that no panic escapes as
/// `PanicException` (raises `PackshardError` of kind `internal`).
#[pyfunction]
fn _panic_probe(py: Python<'_>) -> PyResult<()> {
    guard(py, || panic!("the panic probe"))
}

/// Every registered implementation: `[{family, name, changed, precision, needs}]`.
#[pyfunction]
fn registry_list(py: Python<'_>) -> PyResult<Py<PyAny>> {
    guard(py, || {
        let rows: Vec<serde_json::Value> = registry::all()
            .iter()
            .map(|i| {
                serde_json::json!({
                    "family": i.family.name(),
                    "op": i.family.eval_op(),
                    "name": i.name,
                    "changed": i.changed,
                    "precision": i.precision.name(),
                    "needs": i.needs.name(),
                })
            })
            .collect();
        let _ = Family::ALL;
        json_to_py(py, &serde_json::Value::Array(rows))
    })
}

/// The native module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // The extension's allocator reads PACKSHARD_KEPT_BYTES and cannot fail:
    // a value that is not a byte count is refused here, at import.
    packshard_reference::limits::kept_bytes(0)
        .map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))?;
    m.add("PackshardError", m.py().get_type::<PackshardError>())?;
    m.add_function(wrap_pyfunction!(attention, m)?)?;
    m.add_function(wrap_pyfunction!(attention_f32, m)?)?;
    m.add_function(wrap_pyfunction!(attention_judged, m)?)?;
    m.add_function(wrap_pyfunction!(time_attention, m)?)?;
    m.add_function(wrap_pyfunction!(time_attention_f32, m)?)?;
    m.add_function(wrap_pyfunction!(cross_entropy, m)?)?;
    m.add_function(wrap_pyfunction!(linear_cross_entropy, m)?)?;
    m.add_function(wrap_pyfunction!(loss_judged, m)?)?;
    m.add_function(wrap_pyfunction!(embedding, m)?)?;
    m.add_function(wrap_pyfunction!(eval_json, m)?)?;
    m.add_function(wrap_pyfunction!(generated_cases, m)?)?;
    m.add_function(wrap_pyfunction!(judge_tensor, m)?)?;
    m.add_function(wrap_pyfunction!(registry_list, m)?)?;
    m.add_function(wrap_pyfunction!(round_to, m)?)?;
    m.add_function(wrap_pyfunction!(check_precision, m)?)?;
    m.add_function(wrap_pyfunction!(_panic_probe, m)?)?;
    m.add_function(wrap_pyfunction!(crate::collator::collator_json, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
