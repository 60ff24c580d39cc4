//! The `decoder_forward_backward` op of `packshard eval` (issue #15):
//! through the binary, bit for bit the reference decoder called directly;
//! a pack of two documents gives the loss and the gradients of the two
//! documents run apart, weighted per token (no attention or label crosses a
//! document: docs/FAULTS.md C1, P7); bad input gives the contract's errors.

mod common;

use common::eval;
use packshard::oracle::causal_lm::VarlenInput;
use packshard::reference::attention::ReferenceAttention;
use packshard::reference::decoder::{
    loss_weights, next_token_labels, CausalReduction, DecoderConfig, DecoderModel,
};
use serde_json::{json, Map, Value};

fn flat(v: &Value) -> Vec<f64> {
    match v {
        Value::Array(items) => items.iter().flat_map(flat).collect(),
        other => vec![other.as_f64().expect("a number")],
    }
}

/// The result's parameter-gradient fields (`grad.<name>`).
fn grad_names(v: &Value) -> Vec<String> {
    v.as_object()
        .unwrap()
        .keys()
        .filter(|k| k.starts_with("grad."))
        .cloned()
        .collect()
}

/// A grouped-query model (4 heads over 2 key/value heads), 2 layers.
fn model() -> DecoderModel {
    DecoderModel::random(DecoderConfig::tiny(13, 4, 2, 4, 10, 2), 7).unwrap()
}

/// The case: config fields, the weights by name, `fields`.
fn case(m: &DecoderModel, fields: Value) -> Value {
    let mut o = Map::new();
    o.insert("op".into(), json!("decoder_forward_backward"));
    // `hidden_size` is left out: the op derives it as `h * d`.
    let layers = ("num_layers", m.config.num_layers);
    for (k, v) in m.config.dims().into_iter().chain([layers]) {
        if k != "hidden_size" {
            o.insert(k.into(), json!(v));
        }
    }
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
    for (k, v) in fields.as_object().unwrap() {
        o.insert(k.clone(), v.clone());
    }
    Value::Object(o)
}

/// How many of the model's weights serde_json's text parser reads back as
/// another f64 than the one printed (without its `float_roundtrip` feature,
/// 446 of about 1,000 here: the workspace turns it on).
fn weights_misread_from_text(m: &DecoderModel) -> usize {
    m.params
        .named()
        .iter()
        .flat_map(|(_, t)| t.iter().copied().collect::<Vec<_>>())
        .filter(|&x| {
            let back: f64 = serde_json::from_str(&json!(x).to_string()).unwrap();
            back.to_bits() != x.to_bits()
        })
        .count()
}

#[test]
fn eval_is_the_reference_bit_for_bit() {
    let m = model();
    let ids = [3i64, 1, 4, 1, 5, 9, 2];
    let cu = [0usize, 3, 3, 7];
    let c = case(
        &m,
        json!({"input_ids": ids, "cu_seqlens": cu, "reduction": "per-document"}),
    );
    // In process (no text): bit for bit.
    let v = packshard::eval::evaluate(&c).unwrap();
    // Through the binary (text): bit for bit too, since every f64 printed
    // reads back as itself.
    let (code, t) = eval(&c);
    assert_eq!(code, 0, "{t}");
    assert_eq!(
        weights_misread_from_text(&m),
        0,
        "serde_json float_roundtrip"
    );
    assert_eq!(t, v);
    let pos = [0usize, 1, 2, 0, 1, 2, 3];
    let docs = [1usize, 1, 1, 3, 3, 3, 3];
    let labels = next_token_labels(&ids, &docs, None).unwrap();
    assert_eq!(labels, [1, 4, -100, 5, 9, 2, -100]);
    let weights = loss_weights(&labels, &docs, CausalReduction::PerDocument, 3).unwrap();
    let input = VarlenInput::new(&ids, &pos, &cu);
    let run = m
        .run(&ReferenceAttention, &input.input(), &labels, &weights)
        .unwrap();
    assert_eq!(v["labels"], json!(labels));
    assert_eq!(flat(&v["loss_weights"]), weights);
    assert_eq!(v["loss"].as_f64().unwrap().to_bits(), run.loss.to_bits());
    assert_eq!(
        flat(&v["logits"]),
        run.logits.iter().copied().collect::<Vec<_>>()
    );
    assert_eq!(flat(&v["per_token_loss"]), run.token_losses);
    let named = run.grads.params.named();
    assert_eq!(grad_names(&v).len(), named.len());
    assert_eq!(
        named.len(),
        1 + 2 * 9 + 1 + 1,
        "embed, 9 per layer (RMSNorm, SwiGLU), norm, head"
    );
    for (name, g) in named {
        assert_eq!(
            flat(&v[format!("grad.{name}")]),
            g.iter().copied().collect::<Vec<_>>(),
            "{name}"
        );
    }
    assert_eq!(
        flat(&v["grad_inputs_embeds"]),
        run.grads
            .grad_inputs_embeds
            .iter()
            .copied()
            .collect::<Vec<_>>()
    );
    // Forward only: the same loss, no gradients.
    let (_, f) = eval(&case(
        &m,
        json!({"input_ids": ids, "cu_seqlens": cu, "reduction": "per-document", "want_grad": false}),
    ));
    assert_eq!(f["loss"], v["loss"]);
    assert!(grad_names(&f).is_empty());
}

#[test]
fn a_pack_is_its_documents_run_apart() {
    let m = model();
    let (a, b) = ([2i64, 7, 1, 8, 2], [8i64, 1, 8]);
    let packed: Vec<i64> = a.iter().chain(&b).copied().collect();
    let (_, p) = eval(&case(
        &m,
        json!({"input_ids": packed, "cu_seqlens": [0, a.len(), packed.len()]}),
    ));
    let (_, ra) = eval(&case(&m, json!({"input_ids": a})));
    let (_, rb) = eval(&case(&m, json!({"input_ids": b})));
    // Per token over the pack: (4 la + 2 lb) / 6, each apart a mean over its own.
    let (ma, mb) = ((a.len() - 1) as f64, (b.len() - 1) as f64);
    let mix = |x: f64, y: f64| (ma * x + mb * y) / (ma + mb);
    let loss = p["loss"].as_f64().unwrap();
    let want = mix(ra["loss"].as_f64().unwrap(), rb["loss"].as_f64().unwrap());
    assert!(
        (loss - want).abs() <= 1e-13 * want.abs(),
        "{loss} vs {want}"
    );
    // The labels never cross the boundary (C1), nor do the logits leak.
    assert_eq!(p["labels"][a.len() - 1], -100);
    let (lp, la, lb) = (flat(&p["logits"]), flat(&ra["logits"]), flat(&rb["logits"]));
    let v = 13;
    for (i, (&x, &y)) in lp.iter().zip(la.iter().chain(&lb)).enumerate() {
        assert!(
            (x - y).abs() <= 1e-12 * (1.0 + y.abs()),
            "logit {}: {x} vs {y}",
            i / v
        );
    }
    // Every gradient is the same mixture.
    let mut checked = 0;
    for name in grad_names(&p) {
        let (gp, ga, gb) = (flat(&p[&name]), flat(&ra[&name]), flat(&rb[&name]));
        for ((&x, &y), &z) in gp.iter().zip(&ga).zip(&gb) {
            let want = mix(y, z);
            assert!(
                (x - want).abs() <= 1e-12 * (1.0 + want.abs()),
                "{name}: {x} vs {want}"
            );
            checked += 1;
        }
    }
    assert!(checked > 1000, "{checked}");
}

#[test]
fn decoder_errors_follow_the_contract() {
    let m = model();
    let base = || case(&m, json!({"input_ids": [1, 2, 3]}));
    let with = |k: &str, v: Value| {
        let mut c = base();
        c[k] = v;
        c
    };
    let without = |k: &str| {
        let mut c = base();
        c.as_object_mut().unwrap().remove(k);
        c
    };
    let cases: Vec<(&str, Value, &str)> = vec![
        (
            "missing weight",
            without("model.layers.1.mlp.up_proj.weight"),
            "missing_field",
        ),
        (
            "weight of another shape",
            with("model.norm.weight", json!([1.0, 2.0])),
            "shape_mismatch",
        ),
        (
            "NaN weight",
            with("model.norm.weight", json!(vec![json!("nan"); 16])),
            "non_finite_input",
        ),
        (
            "unknown weight",
            with("model.layers.2.mlp.up_proj.weight", json!([[1.0]])),
            "invalid_argument",
        ),
        (
            "kv heads not dividing",
            with("num_kv_heads", json!(3)),
            "invalid_argument",
        ),
        (
            "odd head_dim",
            with("head_dim", json!(3)),
            "invalid_argument",
        ),
        (
            "bad norm",
            with("norm", json!("batch_norm")),
            "invalid_argument",
        ),
        (
            "input id out of range",
            with("input_ids", json!([1, 13, 2])),
            "index_out_of_range",
        ),
        (
            "label out of range",
            with("labels", json!([1, 13, -100])),
            "index_out_of_range",
        ),
        (
            "labels of another length",
            with("labels", json!([1])),
            "shape_mismatch",
        ),
        (
            "cu_seqlens short",
            with("cu_seqlens", json!([0, 2])),
            "invalid_argument",
        ),
        (
            "position_ids of another length",
            with("position_ids", json!([0, 1])),
            "shape_mismatch",
        ),
        (
            "bad reduction",
            with("reduction", json!("mean")),
            "invalid_argument",
        ),
        (
            "huge model",
            with("vocab_size", json!(1u64 << 40)),
            "invalid_argument",
        ),
        (
            "huge head product",
            with("num_heads", json!(1u64 << 28)),
            "invalid_argument",
        ),
        (
            "one long segment",
            with("input_ids", json!(vec![1; 4000])),
            "invalid_argument",
        ),
        (
            "want_grad not a bool",
            with("want_grad", json!(1)),
            "invalid_argument",
        ),
    ];
    insta::assert_snapshot!(common::error_lines(&cases, 240));
}

#[test]
fn other_shapes_and_edge_inputs_run() {
    // LayerNorm, GELU, a tied head, multi-query attention: every gradient named.
    let mut c = DecoderConfig::tiny(9, 2, 1, 2, 6, 1);
    c.norm = packshard::reference::decoder::Norm::LayerNorm;
    c.mlp = packshard::reference::decoder::Mlp::Gelu;
    c.tie_embeddings = true;
    let m = DecoderModel::random(c, 3).unwrap();
    let mut fields = json!({"input_ids": [1, 2, 3, 4], "cu_seqlens": [0, 1, 4], "eos_token_id": 8,
        "norm": "layer_norm", "mlp": "gelu", "tie_embeddings": true, "reduction": "per-row"});
    let v = packshard::eval::evaluate(&case(&m, fields.clone())).unwrap();
    assert_eq!(v["labels"], json!([8, 3, 4, 8]));
    assert_eq!(flat(&v["loss_weights"]), [0.5; 4]);
    let grads = grad_names(&v);
    assert!(grads.contains(&"grad.model.layers.0.input_layernorm.bias".to_string()));
    assert!(
        !grads.contains(&"grad.lm_head.weight".to_string())
            && !grads.contains(&"grad.model.layers.0.mlp.gate_proj.weight".to_string())
    );
    // No tokens at all: loss 0, empty logits.
    fields["input_ids"] = json!([]);
    fields["cu_seqlens"] = json!([0]);
    let v = packshard::eval::evaluate(&case(&m, fields)).unwrap();
    assert_eq!((v["loss"].as_f64(), &v["logits"]), (Some(0.0), &json!([])));
}

#[test]
fn zero_layers_and_huge_weights_never_panic() {
    // No layers: logits are the head over the normed embedding.
    let m = DecoderModel::random(DecoderConfig::tiny(5, 2, 2, 2, 3, 0), 1).unwrap();
    let v = packshard::eval::evaluate(&case(&m, json!({"input_ids": [0, 4, 2]}))).unwrap();
    assert_eq!(grad_names(&v).len(), 3, "embed, final norm, head");
    // Weights near the f64 limit: a result (non-finite values spelt as
    // strings) or a typed error, never a panic.
    let mut m = model();
    for (_, mut t) in m.params.named_mut() {
        t.mapv_inplace(|x| x * 1e300);
    }
    match packshard::eval::evaluate(&case(&m, json!({"input_ids": [1, 2, 3]}))) {
        Ok(v) => assert!(v["loss"].is_string() || v["loss"].is_number()),
        Err(e) => assert!(
            ["invalid_argument", "non_finite_input"].contains(&e.kind),
            "{e:?}"
        ),
    }
}

#[test]
fn sliding_window_reaches_the_reference_through_eval() {
    // Hugging Face's sliding_window = 2 (each token sees itself and the one
    // before it): eval's loss and logits are the in-process reference's with
    // that config, bit for bit, and differ from the full causal ones.
    let mut m = model();
    let ids = [3i64, 1, 4, 1, 5, 9, 2];
    let cu = [0usize, 4, 7];
    let fields = |w: Value| json!({"input_ids": ids, "cu_seqlens": cu, "sliding_window": w});
    let v = packshard::eval::evaluate(&case(&m, fields(json!(2)))).unwrap();
    let full = packshard::eval::evaluate(&case(&m, fields(Value::Null))).unwrap();
    m.config.sliding_window = Some(2);
    let pos = [0usize, 1, 2, 3, 0, 1, 2];
    let docs = [1usize, 1, 1, 1, 2, 2, 2];
    let labels = next_token_labels(&ids, &docs, None).unwrap();
    let weights = loss_weights(&labels, &docs, CausalReduction::PerToken, 2).unwrap();
    let input = VarlenInput::new(&ids, &pos, &cu);
    let run = m
        .run(&ReferenceAttention, &input.input(), &labels, &weights)
        .unwrap();
    assert_eq!(v["loss"].as_f64().unwrap().to_bits(), run.loss.to_bits());
    assert_eq!(
        flat(&v["logits"]),
        run.logits.iter().copied().collect::<Vec<_>>()
    );
    assert_ne!(v["loss"], full["loss"], "the window changes nothing");
    let (code, e) = eval(&case(&m, fields(json!(0))));
    assert_eq!(code, 2);
    assert_eq!(e["error"]["kind"], "invalid_argument");
    let msg = e["error"]["message"].as_str().unwrap();
    assert!(msg.starts_with("sliding_window"), "{msg}");
}
