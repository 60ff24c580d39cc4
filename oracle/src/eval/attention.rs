//! The `attention` op: variable-length attention (`flash_attn_varlen_func`'s
//! form) with its backward, through any registered [`registry::attention`]
//! implementation (the f64 reference by default).

use ndarray::{Array3, ArrayView2, ArrayView3};
use packshard_reference::attention::{default_scale, AttentionGrads, AttentionOutput};
use packshard_reference::ops::{Grad, Qkv, Varlen};
use serde_json::{json, Value};

use crate::registry;

use super::{num, Case, EvalError, Tensor};

/// `[a, b, c]` as nested arrays.
pub(crate) fn nested3(x: ArrayView3<f64>) -> Value {
    Value::Array(x.outer_iter().map(|m| nested2(m.view())).collect())
}

/// `[a, b]` as nested arrays.
pub(crate) fn nested2(x: ArrayView2<f64>) -> Value {
    Value::Array(
        x.rows()
            .into_iter()
            .map(|r| Value::Array(r.iter().map(|&v| num(v)).collect()))
            .collect(),
    )
}

fn array3(t: Tensor, name: &str) -> Result<Array3<f64>, EvalError> {
    t.require_finite(name)?;
    let shape = (t.shape[0], t.shape[1], t.shape[2]);
    Array3::from_shape_vec(shape, t.data)
        .map_err(|e| EvalError::new("shape_mismatch", format!("{name}: {e}")))
}

/// The forward and (with `grad_output`) backward of the registered attention `imp`.
fn run(
    imp: &str,
    (q, k, v): (&Array3<f64>, &Array3<f64>, &Array3<f64>),
    p: &Varlen<'_>,
    grad_output: Option<&Array3<f64>>,
) -> Result<(AttentionOutput, Option<AttentionGrads>), EvalError> {
    let op = super::make(&registry::attention(), imp)?;
    let x = Qkv::new(q.view(), k.view(), v.view());
    let fwd = op.varlen_forward(x, p)?;
    let g = match grad_output {
        Some(go) => Some(op.varlen_backward(x, p, Grad::new(&fwd, go.view()))?),
        None => None,
    };
    Ok((fwd, g))
}

/// `attention`: `q`, `k`, `v` (`[n_tok, h, d]`), `cu_seqlens` (`[b + 1]`),
/// `causal` (false), `scale` (`1/sqrt(d)`), `grad_output` when `want_grad`.
/// Result: `output` (`[n_tok, h, d]`), `lse` (`[h, n_tok]`), and `grad_q`,
/// `grad_k`, `grad_v` when asked. `imp`: `reference` (f64) or an optimized
/// registered implementation (inputs rounded to its precision, results widened).
pub(super) fn attention(value: &Value, imp: &str) -> Result<Value, EvalError> {
    let case = Case::new(
        value,
        &[
            "q",
            "k",
            "v",
            "cu_seqlens",
            "causal",
            "scale",
            "grad_output",
        ],
    )?;
    let legend = "[n_tok, h, d]";
    let q = array3(case.tensor("q", 3, legend)?, "q")?;
    let k = array3(case.tensor("k", 3, legend)?, "k")?;
    let v = array3(case.tensor("v", 3, legend)?, "v")?;
    let cu = case.usize_list("cu_seqlens")?;
    let causal = case.opt_bool("causal")?.unwrap_or(false);
    let scale = case
        .opt_f64("scale")?
        .unwrap_or_else(|| default_scale(q.dim().2.max(1)));
    let want_grad = case.opt_bool("want_grad")?.unwrap_or(false);
    if case.has("grad_output") && !want_grad {
        return Err(EvalError::invalid(
            "grad_output",
            "given without want_grad: true",
        ));
    }
    let grad_output = if want_grad {
        Some(array3(
            case.tensor("grad_output", 3, legend)?,
            "grad_output",
        )?)
    } else {
        None
    };
    let p = Varlen::new(&cu, causal, scale);
    let (fwd, grads) = run(imp, (&q, &k, &v), &p, grad_output.as_ref())?;
    let mut out = json!({
        "op": "attention",
        "output": nested3(fwd.output.view()),
        "lse": nested2(fwd.lse.view()),
    });
    if imp != "reference" {
        out["impl"] = json!(imp);
    }
    if let Some(g) = grads {
        out["grad_q"] = nested3(g.grad_q.view());
        out["grad_k"] = nested3(g.grad_k.view());
        out["grad_v"] = nested3(g.grad_v.view());
    }
    Ok(out)
}
