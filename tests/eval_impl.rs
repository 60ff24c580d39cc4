//! `packshard eval` with `impl`: every registered implementation of a family
//! that has an eval op (looping over `packshard::registry`) gives the
//! reference's results to its precision's accuracy and the reference's error
//! kinds on bad input; `--list` names them; unknown impls are refused.

use packshard::eval::{evaluate, list};
use packshard::registry::{self, Family, Info, Precision};
use serde_json::{json, Value};

/// Whether `entry` runs a sharded case: it declares `alg2` (the cases'
/// algorithm) or is not a vocabulary family.
fn runs_sharded(entry: &Info) -> bool {
    match entry.family {
        Family::CrossEntropy => registry::find(&registry::cross_entropy(), entry.name)
            .and_then(|e| e.make().ok())
            .is_some_and(|k| !k.algorithms().is_empty()),
        Family::LinearCrossEntropy => registry::find(&registry::linear_cross_entropy(), entry.name)
            .and_then(|e| e.make().ok())
            .is_some_and(|k| !k.algorithms().is_empty()),
        _ => true,
    }
}

/// Whether `entry` runs a causal case: it is not an attention, or one that
/// declares causal masks (the CUDA kernels do not, feature `cuda`).
fn runs_causal(entry: &Info) -> bool {
    registry::find(&registry::attention(), entry.name)
        .and_then(|e| e.make().ok())
        .is_none_or(|k| k.support().causal)
}

/// Whether `entry` can run here, under the registry's one availability
/// policy (`registry::here`): one that cannot and need not (a GPU kernel
/// without a device, feature `cuda`) is skipped, saying why; one that this
/// run requires fails the test.
fn available(entry: &Info) -> bool {
    fn runs<K: ?Sized>(list: &[registry::Entry<K>], name: &str) -> bool {
        let Some(e) = registry::find(list, name) else {
            return true;
        };
        match e.here() {
            registry::Here::Runs(_) => true,
            registry::Here::Skipped(why) => {
                eprintln!("{name}: skipped: {why}");
                false
            }
            registry::Here::Missing(why) => panic!("{name}: required here but cannot run: {why}"),
        }
    }
    match entry.family {
        Family::Attention => runs(&registry::attention(), entry.name),
        Family::CrossEntropy => runs(&registry::cross_entropy(), entry.name),
        Family::LinearCrossEntropy => runs(&registry::linear_cross_entropy(), entry.name),
        Family::Embedding | Family::EncoderLayer | Family::CausalLm => true,
    }
}

/// Every registered entry other than the reference, in a family with an eval
/// op, that can run here.
fn entries() -> Vec<Info> {
    registry::all()
        .into_iter()
        .filter(|e| e.name != registry::REFERENCE && e.family.eval_op().is_some())
        .filter(available)
        .collect()
}

fn flat(v: &Value) -> Vec<f64> {
    match v {
        Value::Array(items) => items.iter().flat_map(flat).collect(),
        Value::String(s) if s == "inf" => vec![f64::INFINITY],
        Value::String(s) if s == "-inf" => vec![f64::NEG_INFINITY],
        other => vec![other.as_f64().expect("a number")],
    }
}

fn wave(n: usize, m: usize, seed: f64, amp: f64) -> Value {
    Value::Array(
        (0..n)
            .map(|i| {
                json!((0..m)
                    .map(|j| amp * ((i * 7 + j * 3) as f64 * seed).sin())
                    .collect::<Vec<_>>())
            })
            .collect(),
    )
}

/// A case for `kernel` and the fields its result must match.
fn cases(family: Family) -> Vec<(Value, Vec<&'static str>)> {
    match family {
        Family::Attention => {
            // [5, 2, 3]: segments of 3, 0 and 2 tokens.
            let t = |s: f64| {
                Value::Array(
                    (0..5)
                        .map(|i| wave(2, 3, s + i as f64 * 0.1, 1.5))
                        .collect(),
                )
            };
            let mut out = Vec::new();
            for causal in [false, true] {
                out.push((
                    json!({"op": "attention", "q": t(0.3), "k": t(0.7), "v": t(1.1),
                           "cu_seqlens": [0, 3, 3, 5], "causal": causal,
                           "want_grad": true, "grad_output": t(1.3)}),
                    vec!["output", "lse", "grad_q", "grad_k", "grad_v"],
                ));
            }
            out
        }
        Family::CrossEntropy => {
            let logits = wave(6, 11, 0.37, 6.0);
            let base = json!({"op": "cross_entropy", "logits": logits,
                              "targets": [0, 10, -100, 4, 5, 9], "want_grad": true,
                              "label_smoothing": 0.1, "z_loss": 0.01});
            let mut sharded = base.clone();
            sharded["num_shards"] = json!(3);
            sharded["algorithm"] = json!("alg2");
            let fields = vec!["loss", "per_token_loss", "logsumexp", "grad_logits"];
            vec![(base, fields.clone()), (sharded, fields)]
        }
        Family::LinearCrossEntropy => {
            let base = json!({"op": "linear_cross_entropy", "hidden": wave(7, 5, 0.21, 1.0),
                              "weight": wave(13, 5, 0.53, 2.0),
                              "targets": [0, 12, -100, 4, 5, 9, 3], "want_grad": true,
                              "z_loss": 0.01});
            let mut sharded = base.clone();
            sharded["num_shards"] = json!(4);
            let fields = vec![
                "loss",
                "per_token_loss",
                "logsumexp",
                "grad_hidden",
                "grad_weight",
            ];
            vec![(base, fields.clone()), (sharded, fields)]
        }
        Family::Embedding | Family::EncoderLayer | Family::CausalLm => vec![],
    }
}

#[test]
fn every_eval_variant_matches_the_reference() {
    let mut checked = 0;
    for variant in entries() {
        let Some(op) = variant.family.eval_op() else {
            continue;
        };
        for (case, fields) in cases(variant.family) {
            let mut ours = case.clone();
            ours["impl"] = json!(variant.name);
            let declined = (case.get("num_shards").is_some() && !runs_sharded(&variant))
                || (case["causal"] == json!(true) && !runs_causal(&variant));
            if declined {
                let e = evaluate(&ours).unwrap_err();
                assert_eq!(e.kind, "invalid_argument", "{e}");
                continue;
            }
            let want = evaluate(&case).unwrap_or_else(|e| panic!("{op}: {e}"));
            let got = evaluate(&ours).unwrap_or_else(|e| panic!("{}: {e}", variant.name));
            for field in &fields {
                let (a, b) = (flat(&got[*field]), flat(&want[*field]));
                assert_eq!(a.len(), b.len(), "{} {field}", variant.name);
                let scale = b.iter().fold(0.0f64, |m, x| m.max(x.abs()));
                assert!(scale > 0.0, "{} {field}: degenerate", variant.name);
                let err = a
                    .iter()
                    .zip(&b)
                    .map(|(x, y)| (x - y).abs())
                    .fold(0.0, f64::max);
                // bf16 inputs round to 8 bits, up to u = 2^-8 relative: 2e-2
                // (5.12 u) of the largest entry; f32 kernels: well under 1e-5.
                let tol = if variant.precision == Precision::Bf16 {
                    5.12 * Precision::Bf16.unit_roundoff()
                } else {
                    1e-5
                };
                assert!(
                    err <= tol * scale,
                    "{} {field}: max error {err:e}, scale {scale:e}",
                    variant.name
                );
                if variant.precision == Precision::F32 {
                    // Not the reference itself: f32 results differ from f64.
                    checked += usize::from(err > 0.0);
                }
            }
        }
    }
    assert!(
        checked >= 15,
        "only {checked} fields differed from f64 at all"
    );
}

#[test]
fn bad_input_gets_the_reference_error_kinds_under_every_impl() {
    let bad: Vec<Value> = vec![
        json!({"op": "attention", "q": [[[1.0]]], "k": [[["nan"]]], "v": [[[1.0]]], "cu_seqlens": [0, 1]}),
        json!({"op": "attention", "q": [[[1.0]], [[1.0]]], "k": [[[1.0]], [[1.0]]], "v": [[[1.0]], [[1.0]]], "cu_seqlens": [0, 3]}),
        json!({"op": "attention", "q": [[[1.0]]], "k": [[[1.0, 2.0]]], "v": [[[1.0]]], "cu_seqlens": [0, 1]}),
        json!({"op": "cross_entropy", "logits": [[1.0, "nan"]], "targets": [0]}),
        json!({"op": "cross_entropy", "logits": [[1.0, "inf"]], "targets": [0], "num_shards": 2}),
        json!({"op": "cross_entropy", "logits": [[1.0, 2.0]], "targets": [0, 1]}),
        json!({"op": "cross_entropy", "logits": [[1.0, 2.0]], "targets": [2]}),
        json!({"op": "cross_entropy", "logits": [["-inf", "-inf"]], "targets": [1]}),
        json!({"op": "linear_cross_entropy", "hidden": [[1.0, 2.0]], "weight": [[1.0]], "targets": [0]}),
        json!({"op": "linear_cross_entropy", "hidden": [[1.0]], "weight": [[1.0], ["nan"]], "targets": [0]}),
        json!({"op": "linear_cross_entropy", "hidden": [[1.0]], "weight": [[1.0], [2.0]], "targets": [-3], "num_shards": 2}),
        json!({"op": "linear_cross_entropy", "hidden": [[1.0]], "weight": [[1.0], [2.0]], "targets": [0], "label_smoothing": 2.0}),
    ];
    for case in bad {
        let op = case["op"].as_str().unwrap().to_string();
        let want = evaluate(&case).expect_err("the reference refuses it");
        for variant in entries()
            .into_iter()
            .filter(|v| v.family.eval_op() == Some(op.as_str()))
        {
            if case.get("num_shards").is_some() && !runs_sharded(&variant) {
                continue;
            }
            let mut ours = case.clone();
            ours["impl"] = json!(variant.name);
            let got = evaluate(&ours).expect_err("refused");
            assert_eq!(
                got.kind, want.kind,
                "{} on {case}: {got} vs the reference's {want}",
                variant.name
            );
        }
    }
}

#[test]
fn list_names_the_registry_and_unknown_impls_are_refused() {
    let l = list();
    let ops = l["ops"].as_array().unwrap();
    let impls = |op: &str| -> Vec<String> {
        ops.iter().find(|o| o["op"] == op).unwrap()["impls"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s.as_str().unwrap().to_string())
            .collect()
    };
    let names =
        |f: Family| -> Vec<String> { registry::of(f).iter().map(|e| e.name.to_string()).collect() };
    assert_eq!(
        impls("linear_cross_entropy"),
        names(Family::LinearCrossEntropy)
    );
    assert_eq!(impls("attention"), names(Family::Attention));
    assert_eq!(impls("pack"), ["reference"]);
    let e = evaluate(&json!({"op": "cross_entropy", "logits": [[1.0]], "targets": [0], "impl": "linear_ce_fused"}))
        .unwrap_err();
    assert_eq!(e.kind, "invalid_argument");
    assert!(e.message.contains("cross_entropy_f32"), "{e}");
    let e = evaluate(&json!({"op": "cross_entropy", "logits": [[1.0, 2.0]], "targets": [0], "num_shards": 2, "algorithm": "alg1", "impl": "cross_entropy_f32"}))
        .unwrap_err();
    assert_eq!(e.kind, "invalid_argument");
    assert!(e.message.contains("alg2"), "{e}");
}
