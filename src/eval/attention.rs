//! The `attention` op: variable-length attention (`flash_attn_varlen_func`'s
//! form) with its backward, from the f64 reference.

use ndarray::Array2;
use ndarray::{Array3, ArrayView2, ArrayView3};
use packshard_optimized::adapt::OptimizedAttention;
use packshard_reference::bert::attention::{
    check_cu_seqlens, default_scale, varlen_attention, varlen_attention_backward, AttentionGrads,
    AttentionOutput,
};
use serde_json::{json, Value};

use super::{Case, EvalError, Tensor};

/// A JSON number, or `"inf"`, `"-inf"`, `"nan"` for non-finite values
/// (JSON has no literal for them).
pub(crate) fn num(x: f64) -> Value {
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

/// The most tokens `impl: attention_dense_masked` takes: its mask is
/// `[n_tok, n_tok]` booleans (64 MiB at this size).
pub const MAX_DENSE_TOKENS: usize = 8192;

/// `[n_tok, n_tok]`: key `j` allowed for query `i` when both are in the same
/// segment of `cu` (and `j <= i` if `causal`). `cu` already checked.
fn block_diagonal(cu: &[usize], causal: bool) -> Array2<bool> {
    let n = cu.last().copied().unwrap_or(0);
    let seg = |i: usize| cu.partition_point(|&c| c <= i);
    Array2::from_shape_fn((n, n), |(i, j)| seg(i) == seg(j) && (!causal || j <= i))
}

/// The forward and (with `grad_output`) backward of `imp`.
#[allow(clippy::too_many_arguments)]
fn run(
    imp: &str,
    q: &Array3<f64>,
    k: &Array3<f64>,
    v: &Array3<f64>,
    cu: &[usize],
    causal: bool,
    scale: f64,
    grad_output: Option<&Array3<f64>>,
) -> Result<(AttentionOutput, Option<AttentionGrads>), EvalError> {
    let (q, k, v) = (q.view(), k.view(), v.view());
    let opt = match imp {
        "attention_varlen_tiled" | "attention_dense_masked" => OptimizedAttention::F32,
        "attention_varlen_tiled_bf16" => OptimizedAttention::BF16,
        _ => {
            let fwd = varlen_attention(q, k, v, cu, causal, scale)?;
            let g = match grad_output {
                Some(go) => Some(varlen_attention_backward(
                    q,
                    k,
                    v,
                    cu,
                    causal,
                    scale,
                    &fwd,
                    go.view(),
                )?),
                None => None,
            };
            return Ok((fwd, g));
        }
    };
    if imp == "attention_dense_masked" {
        packshard_reference::bert::attention::check_qkv_shapes(q.shape(), k.shape(), v.shape())?;
        let n = q.dim().0;
        check_cu_seqlens(cu, n)?;
        if n > MAX_DENSE_TOKENS {
            return Err(EvalError::invalid(
                "q",
                format!("{n} tokens: attention_dense_masked builds an [n_tok, n_tok] mask and takes at most {MAX_DENSE_TOKENS}"),
            ));
        }
        let mask = block_diagonal(cu, causal);
        let masks = [mask.view()];
        let fwd = opt.dense_forward(q, k, v, n, &masks, scale)?;
        let g = match grad_output {
            Some(go) => Some(opt.dense_backward(q, k, v, n, &masks, scale, &fwd, go.view())?),
            None => None,
        };
        return Ok((fwd, g));
    }
    let fwd = opt.varlen_forward(q, k, v, cu, causal, scale)?;
    let g = match grad_output {
        Some(go) => Some(opt.varlen_backward(q, k, v, cu, causal, scale, &fwd, go.view())?),
        None => None,
    };
    Ok((fwd, g))
}

/// `attention`: `q`, `k`, `v` (`[n_tok, h, d]`), `cu_seqlens` (`[b + 1]`),
/// `causal` (false), `scale` (`1/sqrt(d)`), `grad_output` when `want_grad`.
/// Result: `output` (`[n_tok, h, d]`), `lse` (`[h, n_tok]`), and `grad_q`,
/// `grad_k`, `grad_v` when asked. `imp`: `reference` (f64) or an optimized
/// attention variant (inputs rounded to f32 or bf16, results widened).
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
    let (fwd, grads) = run(imp, &q, &k, &v, &cu, causal, scale, grad_output.as_ref())?;
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
