//! Each registered implementation answers with its own numbers, never the
//! reference's under its name (issue #13): impl by impl
//! (`<family>::<impl>::own_numbers`),
//!
//! 1. `packshard eval` with `impl` gives bit for bit what a direct call of
//!    the entry's constructor gives (eval runs that constructor and nothing
//!    else);
//! 2. the results differ from the f64 reference the way the entry's
//!    precision predicts: an f64 entry within 64 ulp of the terms (the
//!    reference itself exactly); an f32 entry's f32-stored outputs are f32
//!    values, not all equal to the reference's, and within 1e-3 of its
//!    scale; a bf16 entry is further from the reference than the f32 error
//!    (its inputs lose 8 bits) and within 5e-2.
//!
//! Inputs carry values that f32 and bf16 cannot hold exactly, so an entry
//! that quietly ran the f64 reference would fail (2).

use libtest_mimic::Trial;
use ndarray::{Array2, Array3};
use packshard_oracle::eval::evaluate;
use packshard_oracle::eval::input::numbers as read_numbers;
use packshard_oracle::registry::{self, Entry, Family, Precision};
use packshard_reference::attention::varlen_pass;
use packshard_reference::ops::{
    AttentionOp, CeCall, CrossEntropyOp, EncoderLayerOp, Layer, LayerInput, LinearCall,
    LinearCrossEntropyOp, LinearInput, Qkv, Varlen,
};
use packshard_reference::vocab::{LossConfig, ShardLayout, ShardMap, ShardPlan, ShardedAlgorithm};
use serde_json::{json, Value};

use crate::harness::{Config, Tests};

fn wave3(shape: (usize, usize, usize), seed: f64) -> Array3<f64> {
    Array3::from_shape_fn(shape, |(i, j, k)| {
        1.7 * ((i * 7 + j * 3 + k) as f64 * seed + 0.1).sin() + 1e-9 * (i as f64)
    })
}

fn wave2(shape: (usize, usize), seed: f64, amp: f64) -> Array2<f64> {
    Array2::from_shape_fn(shape, |(i, j)| {
        amp * ((i * 5 + j * 3) as f64 * seed + 0.3).sin()
    })
}

fn json3(a: &Array3<f64>) -> Value {
    json!(a
        .outer_iter()
        .map(|m| m.rows().into_iter().map(|r| r.to_vec()).collect::<Vec<_>>())
        .collect::<Vec<_>>())
}

fn json2(a: &Array2<f64>) -> Value {
    json!(a.rows().into_iter().map(|r| r.to_vec()).collect::<Vec<_>>())
}

/// The family's f64 reference, as registered.
fn reference_of<K: ?Sized>(list: &[Entry<K>]) -> Box<K> {
    registry::find(list, registry::REFERENCE)
        .unwrap()
        .make()
        .unwrap()
}

/// `case` through `packshard eval` as the `impl` `name` (left out for the
/// reference): each of `fields` is bit for bit the numbers in `want`.
fn eval_says<'w>(
    name: &str,
    mut case: Value,
    fields: &[&str],
    want: impl IntoIterator<Item = &'w Vec<f64>>,
) {
    if name != registry::REFERENCE {
        case["impl"] = json!(name);
    }
    let out = evaluate(&case).unwrap();
    for (field, want) in fields.iter().zip(want) {
        let got = read_numbers(&out[*field], field).unwrap();
        assert_eq!(&got, want, "{name}: eval's {field}");
    }
}

fn is_f32(x: f64) -> bool {
    !x.is_finite() || (x as f32) as f64 == x
}

/// `max |a - b| / max |b|` over finite pairs.
fn rel(a: &[f64], b: &[f64]) -> f64 {
    let scale = b
        .iter()
        .filter(|x| x.is_finite())
        .fold(f64::MIN_POSITIVE, |m, x| m.max(x.abs()));
    a.iter()
        .zip(b)
        .filter(|(x, y)| x.is_finite() && y.is_finite())
        .fold(0.0f64, |m, (x, y)| m.max((x - y).abs()))
        / scale
}

/// Checks (2) for one entry: `stored` are the outputs the entry stores in
/// its precision, `computed` those it forms in f64 from them (losses from
/// f64-merged statistics), `reference` the f64 reference's, in the same order.
fn check_precision(
    name: &str,
    precision: Precision,
    stored: &[Vec<f64>],
    computed: &[Vec<f64>],
    reference: &[Vec<f64>],
) -> String {
    let all: Vec<f64> = stored.iter().chain(computed).flatten().copied().collect();
    let want: Vec<f64> = reference.iter().flatten().copied().collect();
    assert_eq!(all.len(), want.len(), "{name}: output sizes");
    let r = rel(&all, &want);
    match precision {
        // 1e-13: 64 ulp of f64 (64 x 2^-52 = 1.4e-14) of terms a few times
        // the scale, as Tolerance::F64_REWRITE.
        Precision::F64 => assert!(r <= 1e-13, "{name}: f64 entry {r:e} from the reference"),
        Precision::F32 => {
            for t in stored {
                assert!(
                    t.iter().all(|&x| is_f32(x)),
                    "{name}: an f32-stored output is not an f32 value"
                );
            }
            assert!(r > 0.0, "{name}: bit for bit the f64 reference's numbers");
            // 1e-3: about 8,000 unit roundoffs of f32 (2^-24 = 6e-8), far
            // above an f32 kernel's error on 9 tokens, far below a wrong formula.
            assert!(r < 1e-3, "{name}: {r:e} from the reference");
        }
        Precision::Bf16 => {
            let u = Precision::Bf16.unit_roundoff();
            // 1e-5: above the f32 error of these sizes (under 1e-6) and
            // below bf16's input rounding (u = 3.9e-3 per value).
            assert!(
                r > 1e-5,
                "{name}: {r:e} is closer than bf16 inputs allow: not its own numbers"
            );
            // 12.8 unit roundoffs of bf16 (5e-2) of the scale.
            assert!(r < 12.8 * u, "{name}: {r:e} from the reference");
        }
        Precision::F16 => panic!("{name}: no f16 entry had its own numbers bounded here"),
    }
    format!(
        "{} precision: {r:.2e} of the reference's scale",
        precision.name()
    )
}

/// The attention's own numbers on one varlen case with grads.
pub fn attention(
    op: &(dyn AttentionOp + 'static),
    entry: &Entry<dyn AttentionOp>,
) -> Result<String, String> {
    let (q, k, v, go) = (
        wave3((9, 2, 5), 0.37),
        wave3((9, 2, 5), 0.53),
        wave3((9, 2, 5), 0.71),
        wave3((9, 2, 5), 0.29),
    );
    let cu = [0usize, 4, 4, 9];
    let p = Varlen::new(&cu, false, 0.45);
    let x = Qkv::new(q.view(), k.view(), v.view());
    // Output, the three gradients and lse, flat.
    let numbers = |op: &dyn AttentionOp| -> Result<Vec<Vec<f64>>, String> {
        let (f, g) = varlen_pass(op, x, &p, go.view()).map_err(|e| e.to_string())?;
        Ok([&f.output, &g.grad_q, &g.grad_k, &g.grad_v]
            .iter()
            .map(|a| a.iter().copied().collect::<Vec<f64>>())
            .chain([f.lse.iter().copied().collect()])
            .collect())
    };
    let reference = numbers(reference_of(&registry::attention()).as_ref())?;
    let mine = numbers(op)?;
    // (1) eval runs exactly this constructor (a planted entry is not in
    // eval's registry: (2) alone judges it).
    if registry::find(&registry::attention(), entry.name).is_some() {
        let case = json!({"op": "attention", "q": json3(&q), "k": json3(&k), "v": json3(&v),
                          "cu_seqlens": cu, "scale": 0.45, "want_grad": true,
                          "grad_output": json3(&go)});
        let fields = ["output", "grad_q", "grad_k", "grad_v", "lse"];
        eval_says(entry.name, case, &fields, &mine);
    }
    // (2) its numbers are its precision's.
    Ok(check_precision(
        entry.name,
        entry.precision,
        &mine,
        &[],
        &reference,
    ))
}

fn cross_entropy(
    op: &(dyn CrossEntropyOp + 'static),
    entry: &Entry<dyn CrossEntropyOp>,
) -> Result<String, String> {
    let logits = wave2((6, 11), 0.37, 6.0);
    let targets = [0i64, 10, -100, 4, 5, 9];
    let config = LossConfig::default();
    let call = packshard_reference::vocab::LossCall::with_flag(&targets, &config, true);
    let reference = reference_of(&registry::cross_entropy())
        .cross_entropy(CeCall::new(logits.view(), call))
        .map_err(|e| e.to_string())?;
    let ref_out = vec![
        reference
            .grad_logits
            .unwrap()
            .iter()
            .copied()
            .collect::<Vec<_>>(),
        reference.per_token_loss.to_vec(),
        reference.stats.iter().map(|s| s.logsumexp()).collect(),
    ];
    let map = ShardMap::new(11, 3, ShardLayout::Uneven).unwrap();
    let ce = op
        .cross_entropy(CeCall::new(logits.view(), call))
        .map_err(|e| e.to_string())?;
    let stored = vec![ce
        .grad_logits
        .clone()
        .unwrap()
        .iter()
        .copied()
        .collect::<Vec<_>>()];
    let computed = vec![
        ce.per_token_loss.to_vec(),
        ce.stats.iter().map(|s| s.logsumexp()).collect(),
    ];
    let case = json!({"op": "cross_entropy", "logits": json2(&logits),
                      "targets": targets, "want_grad": true});
    let fields = ["grad_logits", "per_token_loss"];
    eval_says(entry.name, case, &fields, [&stored[0], &computed[0]]);
    let report = check_precision(entry.name, entry.precision, &stored, &computed, &ref_out);
    // Every declared algorithm runs sharded; an undeclared one is refused.
    for algorithm in ShardedAlgorithm::ALL {
        let r = op.sharded_cross_entropy(
            ShardPlan::new(algorithm, map),
            CeCall::new(logits.view(), call),
        );
        assert_eq!(
            r.is_ok(),
            op.algorithms().contains(&algorithm),
            "{} {algorithm}",
            entry.name
        );
    }
    Ok(report)
}

/// Registered and small configurations both.
fn output_layer(
    _: &(dyn LinearCrossEntropyOp + 'static),
    entry: &Entry<dyn LinearCrossEntropyOp>,
) -> Result<String, String> {
    let hidden = wave2((7, 5), 0.21, 1.0);
    let weight = wave2((13, 5), 0.53, 2.0);
    let targets = [0i64, 12, -100, 4, 5, 9, 3];
    let config = LossConfig::default();
    let call = packshard_reference::vocab::LossCall::with_flag(&targets, &config, true);
    let reference = reference_of(&registry::linear_cross_entropy())
        .linear_cross_entropy(LinearCall::new(
            LinearInput::new(hidden.view(), weight.view()),
            call,
        ))
        .map_err(|e| e.to_string())?;
    let ref_out = vec![
        reference
            .grad_hidden
            .unwrap()
            .iter()
            .copied()
            .collect::<Vec<_>>(),
        reference.grad_weight.unwrap().iter().copied().collect(),
        reference.ce.per_token_loss.to_vec(),
    ];
    let mut reports = Vec::new();
    for small in [false, true] {
        let made = if small {
            entry.here_small()
        } else {
            entry.here()
        };
        let Some(op) = made.or_fail(entry.name)? else {
            continue;
        };
        let l = op
            .linear_cross_entropy(LinearCall::new(
                LinearInput::new(hidden.view(), weight.view()),
                call,
            ))
            .map_err(|e| e.to_string())?;
        let stored = vec![
            l.grad_hidden
                .clone()
                .unwrap()
                .iter()
                .copied()
                .collect::<Vec<_>>(),
            l.grad_weight.clone().unwrap().iter().copied().collect(),
        ];
        let computed = vec![l.ce.per_token_loss.to_vec()];
        if !small {
            let case = json!({"op": "linear_cross_entropy", "hidden": json2(&hidden),
                              "weight": json2(&weight), "targets": targets,
                              "want_grad": true});
            eval_says(entry.name, case, &["grad_hidden", "grad_weight"], &stored);
        }
        reports.push(check_precision(
            entry.name,
            entry.precision,
            &stored,
            &computed,
            &ref_out,
        ));
    }
    Ok(reports.join("; small: "))
}

fn encoder_layer(
    op: &(dyn EncoderLayerOp + 'static),
    entry: &Entry<dyn EncoderLayerOp>,
) -> Result<String, String> {
    use packshard_reference::attention::AttentionLayout;
    use packshard_reference::bert::{BertConfig, BertParams};
    let config = BertConfig::tiny(8, 12, 3, 1, 20, 16);
    let params = BertParams::random(&config, 3).layers.remove(0);
    let x = wave2((9, 12), 0.31, 1.0);
    let g = wave2((9, 12), 0.47, 1.0);
    let layout = AttentionLayout::Varlen {
        cu_seqlens: vec![0, 4, 9],
    };
    let run = |op: &dyn EncoderLayerOp| -> Result<Vec<Vec<f64>>, String> {
        let r = op
            .forward_backward(
                Layer::new(&params, 3, 1e-12),
                LayerInput::new(x.view(), &layout, g.view()),
            )
            .map_err(|e| e.to_string())?;
        Ok(vec![
            r.output.iter().copied().collect::<Vec<_>>(),
            r.grad_x.iter().copied().collect(),
        ])
    };
    let reference = run(reference_of(&registry::encoder_layer()).as_ref())?;
    let mine = run(op)?;
    Ok(check_precision(
        entry.name,
        entry.precision,
        &mine,
        &[],
        &reference,
    ))
}

/// Adds the own-numbers test of every entry of every family that has one,
/// and the test of eval's listing.
pub fn add(t: &mut Tests, attention_list: &[Entry<dyn AttentionOp>]) {
    let (own, r) = ("own_numbers", Config::Registered);
    t.each(Family::Attention, attention_list, own, r, 5, attention);
    t.each(
        Family::CrossEntropy,
        &registry::cross_entropy(),
        own,
        r,
        2,
        cross_entropy,
    );
    t.each(
        Family::LinearCrossEntropy,
        &registry::linear_cross_entropy(),
        own,
        r,
        4,
        output_layer,
    );
    t.each(
        Family::EncoderLayer,
        &registry::encoder_layer(),
        own,
        r,
        2,
        encoder_layer,
    );
    t.trials.push(Trial::test(
        "eval::lists_exactly_the_registry_and_refuses_other_names",
        || {
            eval_lists_exactly_the_registry_and_refuses_other_names();
            Ok(())
        },
    ));
}

fn eval_lists_exactly_the_registry_and_refuses_other_names() {
    let l = packshard_oracle::eval::list();
    for family in registry::Family::ALL {
        let Some(op) = family.eval_op() else { continue };
        let listed: Vec<String> = l["ops"]
            .as_array()
            .unwrap()
            .iter()
            .find(|o| o["op"] == op)
            .unwrap()["impls"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap().to_string())
            .collect();
        let registered: Vec<String> = registry::of(family)
            .iter()
            .map(|e| e.name.to_string())
            .collect();
        assert_eq!(listed, registered, "{op}");
        assert_eq!(listed[0], registry::REFERENCE, "{op}: the default first");
    }
    let e = evaluate(
        &json!({"op": "attention", "impl": "attention_varlen_tiled_fp8",
                             "q": [[[1.0]]], "k": [[[1.0]]], "v": [[[1.0]]], "cu_seqlens": [0, 1]}),
    )
    .unwrap_err();
    assert_eq!(e.kind, "invalid_argument");
    assert!(
        e.message.contains("impl") && e.message.contains("attention_varlen_tiled"),
        "{e:?}"
    );
}
