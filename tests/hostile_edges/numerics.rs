//! Numerics at the edge of the range, each once wrong with status 0: right
//! now, or refused naming the field. And the scalar attention's panic on
//! empty problems.

use packshard::reference::decoder::{DecoderConfig, DecoderModel, Norm};
use serde_json::Map;

use super::*;

/// A decoder case: the model's config and weights, `input_ids`, `fields`.
fn decoder_case(m: &DecoderModel, fields: Value) -> Value {
    let mut o = Map::new();
    o.insert("op".into(), json!("decoder_forward_backward"));
    let layers = ("num_layers", m.config.num_layers);
    for (k, v) in m.config.dims().into_iter().chain([layers]) {
        o.insert(k.into(), json!(v));
    }
    let norm = match m.config.norm {
        Norm::RmsNorm => "rms_norm",
        Norm::LayerNorm => "layer_norm",
    };
    o.insert("norm".into(), json!(norm));
    for (name, t) in m.params.named() {
        let v = match t.ndim() {
            1 => json!(t.iter().copied().collect::<Vec<_>>()),
            _ => Value::Array(
                t.outer_iter()
                    .map(|r| json!(r.iter().copied().collect::<Vec<_>>()))
                    .collect(),
            ),
        };
        o.insert(name, v);
    }
    o.insert("input_ids".into(), json!([1, 4, 2, 0]));
    for (k, v) in fields.as_object().unwrap() {
        o.insert(k.clone(), v.clone());
    }
    Value::Object(o)
}

#[test]
fn normalization_of_huge_rows_is_the_normalization_of_the_same_rows_scaled_down() {
    // No layers: the logits are the head over the final norm of the
    // embeddings, and a norm is scale-invariant, so embeddings times 2^600
    // (an exact scaling, rows of ~1e180) must give the loss and head
    // gradient of the plain ones. Unscaled squares overflowed: every row
    // normalized to 0, logits 0, the loss ln(v) with zero head gradients.
    for norm in [Norm::RmsNorm, Norm::LayerNorm] {
        let mut config = DecoderConfig::tiny(7, 2, 2, 2, 3, 0);
        config.norm = norm;
        let plain = DecoderModel::random(config, 3).unwrap();
        let mut huge = plain.clone();
        for (name, mut t) in huge.params.named_mut() {
            if name == "model.embed_tokens.weight" {
                t.mapv_inplace(|x| x * 2f64.powi(600));
            }
        }
        // eps far below every row's mean square, scaled or not, so that it
        // cannot tell the two apart (1e-300 vs ~1e-2).
        let eps = json!({"norm_eps": 1e-300});
        let a = answered(&decoder_case(&plain, eps.clone()));
        let b = answered(&decoder_case(&huge, eps));
        let (la, lb) = (a["loss"].as_f64().unwrap(), b["loss"].as_f64().unwrap());
        assert!(
            (la - (7f64).ln()).abs() > 1e-3,
            "{norm:?}: a degenerate case: loss {la} is ln(v)"
        );
        // A few roundings of an f64 loss of order 1: 1e-12 relative.
        assert!(
            (la - lb).abs() <= 1e-12 * la.abs(),
            "{norm:?}: {la} vs {lb}"
        );
        let (ga, gb) = (
            flat(&a["grad.lm_head.weight"]),
            flat(&b["grad.lm_head.weight"]),
        );
        assert!(ga.iter().any(|&x| x != 0.0));
        for (x, y) in ga.iter().zip(&gb) {
            assert!(
                // Two f64 runs of the same math, 1e-12 relative with a floor of 1e-3 (for entries
                // near 0), a margin chosen over a few ulps.
                (x - y).abs() <= 1e-12 * x.abs().max(1e-3),
                "{norm:?}: {x} vs {y}"
            );
        }
    }
}

#[test]
fn a_zero_norm_eps_is_refused_by_name() {
    let m = DecoderModel::random(DecoderConfig::tiny(7, 2, 2, 2, 3, 1), 3).unwrap();
    let msg = refused(&decoder_case(&m, json!({"norm_eps": 0.0})), "norm_eps");
    assert!(msg.contains("above 0"), "{msg}");
    // A negative control: the default eps runs.
    answered(&decoder_case(&m, json!({})));
}

#[test]
fn an_oversized_model_names_the_field_that_made_it_so() {
    let m = DecoderModel::random(DecoderConfig::tiny(7, 2, 2, 2, 3, 1), 3).unwrap();
    // num_heads x head_dim is the widest matrix: hidden_size is not named.
    let case = decoder_case(
        &m,
        json!({"num_heads": 1 << 20, "num_kv_heads": 1, "head_dim": 1 << 8, "hidden_size": 1 << 8}),
    );
    let msg = refused(&case, "num_heads");
    assert!(msg.contains("num_heads x head_dim"), "{msg}");
}

fn attention_case(imp: &str, v: f64, grad: f64) -> Value {
    json!({
        "op": "attention", "impl": imp, "q": [[[1.0]]], "k": [[[1.0]]],
        "v": [[[v]]], "cu_seqlens": [0, 1], "want_grad": true, "grad_output": [[[grad]]],
    })
}

const ATTENTION_IMPLS: [&str; 4] = [
    "reference",
    "attention_varlen_tiled",
    "attention_varlen_scalar",
    "attention_dense_masked",
];

#[test]
fn the_attention_backward_never_answers_nan_for_a_zero_gradient() {
    // One key: the softmax is constant, so grad_q and grad_k are 0. With
    // |grad_output| x |v| past f64 (or f32) range, dP - delta was inf - inf.
    for imp in ATTENTION_IMPLS {
        let m = refused(&attention_case(imp, 1e30, 1e30), "grad_output");
        assert!(m.contains("would overflow"), "{imp}: {m}");
        // Within the bound: the true zero gradient.
        let v = answered(&attention_case(imp, 1e10, 1e10));
        assert_eq!(flat(&v["grad_q"]), vec![0.0], "{imp}: {v}");
        assert_eq!(flat(&v["grad_k"]), vec![0.0], "{imp}: {v}");
    }
}

#[test]
fn every_attention_impl_answers_an_empty_problem() {
    // Zero tokens (and so zero heads), and zero heads of one token: the
    // scalar impl divided by zero key heads.
    let empty = [
        json!({"q": [], "k": [], "v": [], "cu_seqlens": [0]}),
        json!({"q": [[]], "k": [[]], "v": [[]], "cu_seqlens": [0, 1]}),
    ];
    for case in &empty {
        for imp in ATTENTION_IMPLS {
            let mut c = case.clone();
            c["op"] = json!("attention");
            c["impl"] = json!(imp);
            let v = answered(&c);
            assert_eq!(v["output"], case["q"], "{imp}: {v}");
        }
    }
}

#[test]
fn label_smoothing_weighs_before_subtracting() {
    // q_other = 0.1 / 3 on each class: the target term is
    // q (m - z_1) + q (m - z_2) = (0.1 / 3) (2e308 + 1e308) = 1e307; the
    // gap 2e308 overflowed before it was weighted (loss inf).
    let case = json!({
        "op": "cross_entropy", "logits": [[1e308, -1e308, 0.0]], "targets": [0],
        "label_smoothing": 0.1,
    });
    let loss = answered(&case)["loss"].as_f64().unwrap();
    // Two products and a sum of f64: a few ulp (1e-14 relative).
    assert!((loss - 1e307).abs() <= 1e-14 * 1e307, "{loss}");
}

#[test]
fn the_f32_losses_refuse_options_beyond_f32() {
    let base = json!({
        "op": "cross_entropy", "impl": "cross_entropy_f32", "logits": [[1.0, -1.0, 0.0]],
        "targets": [0],
    });
    let with = |k: &str, v: Value| {
        let mut c = base.clone();
        c[k] = v;
        c
    };
    refused(&with("softcap", json!(1e39)), "softcap");
    refused(&with("softcap", json!(1e-50)), "softcap");
    refused(&with("z_loss", json!(1e39)), "z_loss");
    let mut g = with("want_grad", json!(true));
    g["grad_output"] = json!([1e39]);
    refused(&g, "grad_output[0]");
    // The same options inside the range run, and the reference takes all.
    answered(&with("softcap", json!(30.0)));
    let mut r = with("z_loss", json!(1e39));
    r["impl"] = json!("reference");
    answered(&r);
}

#[test]
fn a_z_loss_that_overflows_is_refused_not_nan() {
    // logsumexp 1.7e308: 3.4e38 x lse^2 overflows, and the gradient of
    // the underflowed classes was inf x 0 = NaN.
    let case = json!({
        "op": "cross_entropy", "logits": [[1.7e308, 1e-50, -1.0]], "targets": [2],
        "z_loss": 3.4e38, "want_grad": true,
    });
    let m = refused(&case, "z_loss");
    assert!(m.contains("logits[0]"), "{m}");
    // A negative control: a z-loss whose term is finite runs, finite.
    let mut ok = case.clone();
    ok["logits"] = json!([[10.0, 1e-50, -1.0]]);
    let v = answered(&ok);
    assert!(flat(&v["grad_logits"]).iter().all(|x| x.is_finite()), "{v}");
}
