//! The `attention` op: variable-length attention (`flash_attn_varlen_func`'s
//! form) with its backward, through any registered
//! [`crate::registry::attention`] implementation (the f64 reference by
//! default). This file reads the JSON; the op is checked and run by the
//! typed runner [`super::attention_runner`], the one the Python package
//! calls.

use ndarray::{Array3, ArrayView2};
use serde_json::{json, Value};

use super::attention_runner::{self, AttentionArgs, AttnOptions};
use super::fields::to_json;
use super::{num, Case, EvalError, Tensor};

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
    let shape = (t.shape[0], t.shape[1], t.shape[2]);
    Array3::from_shape_vec(shape, t.data)
        .map_err(|e| EvalError::new("shape_mismatch", format!("{name}: {e}")))
}

/// The query and key offsets of an `attention` case: `cu_seqlens` (the
/// self-attention form, both), or `cu_seqlens_q` with an optional
/// `cu_seqlens_k` (flash_attn_varlen_func's names; the keys default to the
/// queries' offsets).
///
/// # Errors
/// `invalid_argument` naming `cu_seqlens_q` (or `cu_seqlens_k`) when both
/// forms are given; `missing_field` naming `cu_seqlens` when neither is;
/// the list errors of [`Case::usize_list`].
fn offsets(case: &Case<'_>) -> Result<(Vec<usize>, Option<Vec<usize>>), EvalError> {
    let (self_form, q_form, k_form) = (
        case.has("cu_seqlens"),
        case.has("cu_seqlens_q"),
        case.has("cu_seqlens_k"),
    );
    if self_form && (q_form || k_form) {
        let field = if q_form {
            "cu_seqlens_q"
        } else {
            "cu_seqlens_k"
        };
        return Err(EvalError::invalid(
            field,
            "given with cu_seqlens: give cu_seqlens (self-attention) or cu_seqlens_q and cu_seqlens_k, not both forms",
        ));
    }
    if self_form {
        return Ok((case.usize_list("cu_seqlens")?, None));
    }
    if !q_form {
        // The self-attention form is the one most cases use: name it.
        return Ok((case.usize_list("cu_seqlens")?, None));
    }
    let q = case.usize_list("cu_seqlens_q")?;
    let k = if k_form {
        Some(case.usize_list("cu_seqlens_k")?)
    } else {
        None
    };
    Ok((q, k))
}

/// flash-attention's options: `window_size` (`[left, right]`, -1
/// unbounded), `softcap` (0: none), `alibi_slopes` (`[h]`), `seqused_k`
/// (`[b]`); absent: none. The window is read as the Python package reads
/// it ([`AttnOptions::from_flash`]); the values are checked by the runner.
fn options(case: &Case<'_>) -> Result<AttnOptions, EvalError> {
    let window = if case.has("window_size") {
        let w = case.i64_list("window_size")?;
        if w.len() != 2 {
            return Err(EvalError::invalid(
                "window_size",
                format!("has {} entries: it is [left, right]", w.len()),
            ));
        }
        Some((w[0], w[1]))
    } else {
        None
    };
    let window = AttnOptions::from_flash(window, None, None, None)?.window;
    let alibi_slopes = if case.has("alibi_slopes") {
        Some(case.tensor("alibi_slopes", 1, "[h]")?.data)
    } else {
        None
    };
    let seqused_k = if case.has("seqused_k") {
        Some(case.usize_list("seqused_k")?)
    } else {
        None
    };
    let softcap = case.opt_f64("softcap")?.unwrap_or(0.0);
    Ok(AttnOptions {
        window,
        softcap,
        alibi_slopes,
        seqused_k,
    })
}

/// `attention` (flash_attn_varlen_func's form): `q` (`[n_q, h, d]`), `k`,
/// `v` (`[n_k, h_kv, d]`, `h_kv` dividing `h`; query head `a` reads key
/// head `a / (h / h_kv)`), the offsets ([`offsets`]: `cu_seqlens`, or
/// `cu_seqlens_q` and `cu_seqlens_k`, each `[b + 1]`), `causal` (false;
/// bottom-right aligned: query `r` of a segment sees keys `c <= r + l_k -
/// l_q`), `scale` (`1/sqrt(d)`), `grad_output` (`[n_q, h, d]`) when
/// `want_grad`. Result: `output` (`[n_q, h, d]`), `lse` (`[h, n_q]`), and
/// `grad_q` (`[n_q, h, d]`), `grad_k`, `grad_v` (`[n_k, h_kv, d]`) when
/// asked. flash-attention's options, each absent by default:
/// `window_size: [left, right]` (-1 unbounded, bottom-right aligned),
/// `softcap` (0: none), `alibi_slopes: [h]`, `seqused_k: [b]`; an
/// implementation that does not declare one refuses it (`invalid_argument`
/// naming the field). `imp`: `reference` (f64) or an optimized registered
/// implementation (inputs rounded to its precision, results widened; one
/// that does not declare grouped-query or cross attention refuses it with
/// `invalid_argument`).
pub(super) fn attention(value: &Value, imp: &str) -> Result<Value, EvalError> {
    let case = Case::new(
        value,
        &[
            "q",
            "k",
            "v",
            "cu_seqlens",
            "cu_seqlens_q",
            "cu_seqlens_k",
            "causal",
            "scale",
            "grad_output",
            "window_size",
            "softcap",
            "alibi_slopes",
            "seqused_k",
        ],
    )?;
    let (legend_q, legend_k) = ("[n_q, h, d]", "[n_k, h_kv, d]");
    let q = array3(case.tensor("q", 3, legend_q)?, "q")?;
    let k = array3(case.tensor("k", 3, legend_k)?, "k")?;
    let v = array3(case.tensor("v", 3, legend_k)?, "v")?;
    let (cu, cu_k) = offsets(&case)?;
    let causal = case.opt_bool("causal")?.unwrap_or(false);
    let scale = case.opt_f64("scale")?;
    let want_grad = case.opt_bool("want_grad")?.unwrap_or(false);
    if case.has("grad_output") && !want_grad {
        return Err(EvalError::invalid(
            "grad_output",
            "given without want_grad: true",
        ));
    }
    let grad_output = if want_grad {
        Some(array3(
            case.tensor("grad_output", 3, legend_q)?,
            "grad_output",
        )?)
    } else {
        None
    };
    let options = options(&case)?;
    let args = AttentionArgs {
        q: q.view(),
        k: k.view(),
        v: v.view(),
        cu_seqlens: cu,
        cu_seqlens_k: cu_k,
        causal,
        scale,
        grad_output: grad_output.as_ref().map(|g| g.view()),
        options,
    };
    let fields = attention_runner::attention(imp, &args)?;
    let mut out = serde_json::Map::new();
    out.insert("op".into(), json!("attention"));
    for (name, value) in &fields {
        out.insert((*name).into(), to_json(value));
    }
    Ok(Value::Object(out))
}
