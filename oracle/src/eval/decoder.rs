//! The `decoder_forward_backward` op (issue #15): the f64 reference causal
//! decoder ([`packshard_reference::decoder::DecoderModel`]) on given
//! weights, over packed documents (`cu_seqlens`, causal within each), with
//! the next-token loss under a [`CausalReduction`] and the gradient of
//! every parameter.

use ndarray::{Array2, ArrayViewD};
use packshard_reference::attention::{ReferenceAttention, MAX_ATTENTION_WORK};
use packshard_reference::decoder::packing::{
    doc_ids_from_varlen, loss_weights, next_token_labels, position_ids_from_cu_seqlens,
    CausalReduction,
};
use packshard_reference::decoder::params::MAX_TENSOR;
use packshard_reference::decoder::{DecoderConfig, DecoderModel, DecoderParams, Mlp, Norm};
use packshard_reference::error::check_len;
use packshard_reference::vocab::IGNORE_INDEX;
use serde_json::{json, Value};

use super::attention::nested2;
use super::{check_values, num, Case, EvalError};
use crate::causal_lm::VarlenInput;

/// The config fields (the names of [`DecoderConfig`], so its errors name them).
const CONFIG_FIELDS: [&str; 13] = [
    "vocab_size",
    "hidden_size",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "intermediate_size",
    "num_layers",
    "norm",
    "mlp",
    "tie_embeddings",
    "rope_theta",
    "norm_eps",
    "sliding_window",
];

/// How many of [`CONFIG_FIELDS`], from the first, are sizes.
const SIZES: usize = 7;

/// The other fields.
const INPUT_FIELDS: [&str; 6] = [
    "input_ids",
    "position_ids",
    "cu_seqlens",
    "labels",
    "eos_token_id",
    "reduction",
];

/// The most `n_tok x parameters` (multiply-adds of the projections, forward)
/// one case may ask for: 2^32 (the backward doubles it; seconds in a dev
/// build).
pub const MAX_DECODER_WORK: u64 = 1 << 32;

/// `field`'s value among the named `options` (the first when absent).
///
/// # Errors
/// `invalid_argument` naming `field` for any other name.
fn choice<T: Copy, const N: usize>(
    case: &Case,
    field: &str,
    options: [(&str, T); N],
) -> Result<T, EvalError> {
    let given = case.opt_str(field)?.unwrap_or(options[0].0);
    match options.iter().find(|(name, _)| *name == given) {
        Some(&(_, value)) => Ok(value),
        None => {
            let names: Vec<&str> = options.iter().map(|(name, _)| *name).collect();
            Err(EvalError::invalid(
                field,
                format!("{given:?} is not {}", names.join(" or ")),
            ))
        }
    }
}

fn config(case: &Case) -> Result<DecoderConfig, EvalError> {
    // Each size at most MAX_TENSOR, so the products of two that the
    // config's checks form cannot overflow.
    for &field in &CONFIG_FIELDS[..SIZES] {
        if let Some(v) = case.opt_usize(field)? {
            if v > MAX_TENSOR {
                return Err(EvalError::invalid(
                    field,
                    format!("{v} is over {MAX_TENSOR}"),
                ));
            }
        }
    }
    let heads = case.usize("num_heads")?;
    let d = case.usize("head_dim")?;
    let norm = choice(
        case,
        "norm",
        [("rms_norm", Norm::RmsNorm), ("layer_norm", Norm::LayerNorm)],
    )?;
    let mlp = choice(case, "mlp", [("swiglu", Mlp::SwiGlu), ("gelu", Mlp::Gelu)])?;
    let c = DecoderConfig {
        vocab_size: case.usize("vocab_size")?,
        hidden_size: match case.opt_usize("hidden_size")? {
            Some(h) => h,
            None => heads.saturating_mul(d),
        },
        num_heads: heads,
        num_kv_heads: case.opt_usize("num_kv_heads")?.unwrap_or(heads),
        head_dim: d,
        intermediate_size: case.usize("intermediate_size")?,
        num_layers: case.usize("num_layers")?,
        norm,
        mlp,
        tie_embeddings: case.opt_bool("tie_embeddings")?.unwrap_or(false),
        rope_theta: case.opt_f64("rope_theta")?.unwrap_or(10_000.0),
        norm_eps: case.opt_f64("norm_eps")?.unwrap_or(1e-6),
        // Hugging Face's `sliding_window` (absent or null: none).
        sliding_window: case.opt_usize("sliding_window")?,
    };
    c.validate()?;
    Ok(c)
}

/// `[a, ...]` of any rank as nested arrays.
fn nested(t: ArrayViewD<f64>) -> Value {
    match t.ndim() {
        1 => Value::Array(t.iter().map(|&x| num(x)).collect()),
        _ => match t.into_dimensionality::<ndarray::Ix2>() {
            Ok(m) => nested2(m),
            Err(_) => Value::Null,
        },
    }
}

/// `decoder_forward_backward`: the config ([`DecoderConfig`]'s fields),
/// the weights as top-level fields under their Hugging Face names
/// (`model.embed_tokens.weight`, `model.layers.0.self_attn.q_proj.weight`,
/// ...), `input_ids` ([n]), `cu_seqlens` ([b + 1], default `[0, n]`),
/// `position_ids` ([n], default each segment from 0), `labels` ([n],
/// default next-token labels per segment, with `eos_token_id`),
/// `reduction` (`per-token` default, `per-document`, `per-row`),
/// `want_grad` (default true). Result: `loss`, `logits` ([n, v]),
/// `per_token_loss`, `labels`, `loss_weights`, and with gradients
/// `grad.<name>` for every parameter and `grad_inputs_embeds` ([n, hidden]).
pub(super) fn decoder_forward_backward(value: &Value) -> Result<Value, EvalError> {
    // The weight names depend on the config: read the config first from a
    // view that allows every field, then check the fields properly.
    let obj = value
        .as_object()
        .ok_or_else(|| EvalError::new("invalid_json", "a case must be a JSON object"))?;
    let all: Vec<&str> = obj.keys().map(String::as_str).collect();
    let cfg = config(&Case::new(value, &all)?)?;
    let shapes = DecoderParams::shapes(&cfg);
    let param_values: usize = shapes
        .iter()
        .map(|(_, s)| s.iter().product::<usize>())
        .sum();
    let mut allowed: Vec<&str> = CONFIG_FIELDS.into_iter().chain(INPUT_FIELDS).collect();
    allowed.extend(
        shapes
            .iter()
            .filter(|(_, s)| !s.contains(&0))
            .map(|(n, _)| n.as_str()),
    );
    let case = Case::new(value, &allowed)?;
    let input_ids = case.i64_list("input_ids")?;
    let n = input_ids.len();
    // Parameters, their gradients and the init (3 x), and per token the
    // activations each layer keeps (~ 8 hidden + 4 inter + 6 h d) plus the
    // logits and their gradient.
    let c = &cfg;
    let per_token = c.num_layers.saturating_mul(
        c.hidden_size
            .saturating_mul(8)
            .saturating_add(c.intermediate_size.saturating_mul(4))
            .saturating_add((c.num_heads * c.head_dim).saturating_mul(6)),
    );
    let per_token = per_token.saturating_add(c.vocab_size.saturating_mul(3));
    check_values(
        "input_ids",
        &[param_values
            .saturating_mul(3)
            .saturating_add(n.saturating_mul(per_token))],
        "the decoder's weights, activations and gradients",
    )?;
    for (i, &id) in input_ids.iter().enumerate() {
        if id < 0 || id as u64 >= c.vocab_size as u64 {
            return Err(
                packshard_reference::Error::out_of_range("input_ids", i, id, c.vocab_size).into(),
            );
        }
    }
    let mut given = Vec::new();
    for (name, shape) in shapes.iter().filter(|(_, s)| !s.contains(&0)) {
        let legend = format!("{shape:?}");
        let t = case.tensor(name, shape.len(), &legend)?;
        if t.shape != *shape {
            return Err(packshard_reference::Error::ShapeMismatch {
                field: name.clone(),
                expected: legend,
                actual: t.shape,
            }
            .into());
        }
        t.require_finite(name)?;
        given.push(t.data);
    }
    let mut params = DecoderParams::random(c, 0)?;
    for ((_, mut dst), src) in params.named_mut().into_iter().zip(given) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = s;
        }
    }
    let cu = match case.has("cu_seqlens") {
        true => case.usize_list("cu_seqlens")?,
        false => vec![0, n],
    };
    packshard_reference::attention::check_cu_seqlens_named("cu_seqlens", "input_ids", &cu, n)?;
    let tokens_x_params = (n as u128) * (param_values as u128);
    if tokens_x_params > u128::from(MAX_DECODER_WORK) {
        return Err(EvalError::invalid(
            "input_ids",
            format!("{n} tokens x {param_values} parameters is over the {MAX_DECODER_WORK} multiply-adds one case may ask for"),
        ));
    }
    let pairs: u128 = cu.windows(2).map(|w| ((w[1] - w[0]) as u128).pow(2)).sum();
    let attention_work =
        pairs * (c.num_heads as u128) * (c.head_dim as u128 + 1) * (c.num_layers as u128);
    if attention_work > u128::from(MAX_ATTENTION_WORK) {
        return Err(EvalError::invalid(
            "cu_seqlens",
            format!("{attention_work} units of attention work over the layers (query-key pairs x heads x (head dim + 1) x layers) is over the {MAX_ATTENTION_WORK} one case may do"),
        ));
    }
    let position_ids = match case.has("position_ids") {
        true => case.usize_list("position_ids")?,
        false => position_ids_from_cu_seqlens(&cu, 0)?,
    };
    let doc_ids = doc_ids_from_varlen(&(0..n).collect::<Vec<_>>(), &cu, n)?;
    let labels = match case.has("labels") {
        true => {
            if case.has("eos_token_id") {
                return Err(EvalError::invalid(
                    "eos_token_id",
                    "only without labels (it makes the default labels)",
                ));
            }
            let l = case.i64_list("labels")?;
            check_len("labels", l.len(), "n", n, "one per input id")?;
            l
        }
        false => {
            let eos = case.opt_i64("eos_token_id")?;
            // The default labels are input ids (checked) and eos: a bad eos
            // is named as given, not as the labels[i] it would become.
            if let Some(e) = eos.filter(|&e| e != IGNORE_INDEX) {
                if e < 0 || e as u64 >= c.vocab_size as u64 {
                    return Err(EvalError::invalid(
                        "eos_token_id",
                        format!(
                            "{e} is outside 0..{} (the vocabulary) and is not the ignore index {IGNORE_INDEX}",
                            c.vocab_size
                        ),
                    ));
                }
            }
            next_token_labels(&input_ids, &doc_ids, eos)?
        }
    };
    let reduction = match case.opt_str("reduction")?.unwrap_or("per-token") {
        "per-token" => CausalReduction::PerToken,
        "per-document" => CausalReduction::PerDocument,
        "per-row" => CausalReduction::PerRow,
        other => {
            return Err(EvalError::invalid(
                "reduction",
                format!("{other:?} is not per-token, per-document or per-row"),
            ))
        }
    };
    // Labels outside 0..v are refused by the loss; check before weighing.
    for (i, &t) in labels.iter().enumerate() {
        if t != IGNORE_INDEX && (t < 0 || t as u64 >= c.vocab_size as u64) {
            return Err(
                packshard_reference::Error::out_of_range("labels", i, t, c.vocab_size).into(),
            );
        }
    }
    let weights = loss_weights(&labels, &doc_ids, reduction, cu.len() - 1)?;
    let want_grad = case.opt_bool("want_grad")?.unwrap_or(true);
    let model = DecoderModel {
        config: cfg.clone(),
        params,
    };
    let varlen = VarlenInput::new(&input_ids, &position_ids, &cu);
    let input = varlen.input();
    let op = ReferenceAttention;
    let mut out = json!({"op": "decoder_forward_backward"});
    let (logits, per_token_loss, loss) = if want_grad {
        let run = model.run(&op, &input, &labels, &weights)?;
        for (name, t) in run.grads.params.named() {
            out[format!("grad.{name}")] = nested(t);
        }
        out["grad_inputs_embeds"] = nested2(run.grads.grad_inputs_embeds.view());
        (run.logits, run.token_losses, run.loss)
    } else {
        let fwd = model.forward(&op, &input)?;
        let (l, _) = packshard_reference::decoder::token_cross_entropy(
            fwd.logits.view(),
            &labels,
            &weights,
        )?;
        let loss = l.iter().zip(&weights).map(|(a, b)| a * b).sum();
        (fwd.logits, l, loss)
    };
    let logits: Array2<f64> = logits;
    out["loss"] = num(loss);
    out["logits"] = nested2(logits.view());
    out["per_token_loss"] = Value::Array(per_token_loss.iter().map(|&x| num(x)).collect());
    out["labels"] = json!(labels);
    out["loss_weights"] = Value::Array(weights.iter().map(|&x| num(x)).collect());
    out["reduction"] = json!(reduction.name());
    Ok(out)
}
