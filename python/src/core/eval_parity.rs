//! The two front doors of the loss ops, `packshard eval` and the Python
//! package's core, on the same cases: the same error (kind, field, index,
//! message) for bad input, the same fields in the same order for good input.
//! Each case is written once as typed options; the eval side gets it as the
//! JSON case `docs/INTERFACE.md` defines, the Python side as `py.rs` passes
//! it.

use super::*;
use packshard_oracle::eval::fields::to_json;
use serde_json::{json, Map, Value};

/// An error as the Python package raises it: `(kind, field, index, message)`.
pub(super) type Raised = (String, Option<String>, Option<usize>, String);

/// What a door answers: the result's fields (less `op`) or its error.
pub(super) type Answer = Result<Vec<(String, Value)>, Raised>;

/// A loss case: `logits` (cross_entropy) or `hidden` and `weight`.
struct Case {
    what: &'static str,
    imp: &'static str,
    logits: Option<Array2<f64>>,
    linear: Option<(Array2<f64>, Array2<f64>)>,
    targets: Vec<i64>,
    options: LossOptions,
}

fn matrix_json(a: &Array2<f64>) -> Value {
    let x = |v: f64| {
        if v.is_nan() {
            json!("nan")
        } else {
            json!(v)
        }
    };
    Value::Array(
        a.rows()
            .into_iter()
            .map(|r| Value::Array(r.iter().map(|&v| x(v)).collect()))
            .collect(),
    )
}

/// The JSON case `packshard eval` reads.
fn eval_case(c: &Case) -> Value {
    let o = &c.options;
    let mut m = Map::new();
    let op = if c.logits.is_some() {
        "cross_entropy"
    } else {
        "linear_cross_entropy"
    };
    m.insert("op".into(), json!(op));
    m.insert("impl".into(), json!(c.imp));
    if let Some(z) = &c.logits {
        m.insert("logits".into(), matrix_json(z));
    }
    if let Some((h, w)) = &c.linear {
        m.insert("hidden".into(), matrix_json(h));
        m.insert("weight".into(), matrix_json(w));
    }
    m.insert("targets".into(), json!(c.targets));
    let mut put = |k: &str, v: Option<Value>| {
        if let Some(v) = v {
            m.insert(k.into(), v);
        }
    };
    put("ignore_index", o.ignore_index.map(|x| json!(x)));
    put("label_smoothing", o.label_smoothing.map(|x| json!(x)));
    put("smoothing", o.smoothing.as_ref().map(|x| json!(x)));
    put("z_loss", o.z_loss.map(|x| json!(x)));
    put("reduction", o.reduction.as_ref().map(|x| json!(x)));
    put("softcap", o.softcap.map(|x| json!(x)));
    put("vocab_size", o.vocab_size.map(|x| json!(x)));
    put("num_shards", o.num_shards.map(|x| json!(x)));
    put("algorithm", o.algorithm.as_ref().map(|x| json!(x)));
    put("layout", o.layout.as_ref().map(|x| json!(x)));
    put("want_grad", Some(json!(o.want_grad)));
    put("grad_output", o.grad_output.as_ref().map(|x| json!(x)));
    Value::Object(m)
}

/// What the Python core gives, as (kind, field, index, message) or the
/// fields as the eval result spells them (less `op`).
fn python(c: &Case) -> Answer {
    let r = match (&c.logits, &c.linear) {
        (Some(z), _) => cross_entropy(c.imp, z.view(), c.targets.clone(), c.options.clone()),
        (None, Some((h, w))) => linear_cross_entropy(
            c.imp,
            h.view(),
            w.view(),
            c.targets.clone(),
            c.options.clone(),
        ),
        _ => unreachable!("a case has logits or hidden and weight"),
    };
    r.map(|f| {
        f.iter()
            .map(|(k, v)| ((*k).to_string(), to_json(v)))
            .collect()
    })
    .map_err(error)
}

pub(super) fn error(e: EvalError) -> Raised {
    let (field, index) = field_of(&e.message);
    (e.kind.to_string(), field, index, e.message)
}

fn eval(c: &Case) -> Answer {
    let v = packshard_oracle::eval::evaluate(&eval_case(c)).map_err(error)?;
    let Value::Object(m) = v else {
        panic!("{}: eval gave {v}", c.what)
    };
    Ok(m.into_iter().filter(|(k, _)| k != "op").collect())
}

fn cases() -> Vec<Case> {
    let z = Array2::from_shape_fn((3, 5), |(i, j)| ((i * 5 + j) % 7) as f64 * 0.5 - 1.5);
    let h = Array2::from_shape_fn((3, 2), |(i, k)| (i + 2 * k) as f64 * 0.25 - 0.5);
    let w = Array2::from_shape_fn((5, 2), |(j, k)| (j * 2 + k) as f64 * 0.125 - 0.5);
    let grad = LossOptions {
        want_grad: true,
        ..LossOptions::default()
    };
    let ce = |what, imp, t: Vec<i64>, o: LossOptions| Case {
        what,
        imp,
        logits: Some(z.clone()),
        linear: None,
        targets: t,
        options: o,
    };
    let lin = |what, imp, o: LossOptions| Case {
        what,
        imp,
        logits: None,
        linear: Some((h.clone(), w.clone())),
        targets: vec![1, 4, 0],
        options: o,
    };
    let t = vec![1, 4, -100];
    let mut nan = ce("a NaN logit", "cross_entropy_f32", t.clone(), grad.clone());
    if let Some(z) = nan.logits.as_mut() {
        z[[1, 2]] = f64::NAN;
    }
    vec![
        // Good input: the fields, in order.
        ce(
            "reference, smoothed",
            "reference",
            t.clone(),
            LossOptions {
                label_smoothing: Some(0.1),
                ..grad.clone()
            },
        ),
        ce(
            "reference on 2 shards, alg1",
            "reference",
            t.clone(),
            LossOptions {
                num_shards: Some(2),
                algorithm: Some("alg1".into()),
                ..grad.clone()
            },
        ),
        ce(
            "f32, 4 of 5 columns real",
            "cross_entropy_f32",
            vec![1, 3, 0],
            LossOptions {
                vocab_size: Some(4),
                reduction: Some("sum".into()),
                ..grad.clone()
            },
        ),
        ce(
            "f32 on 2 shards",
            "cross_entropy_f32",
            t.clone(),
            LossOptions {
                num_shards: Some(2),
                ..grad.clone()
            },
        ),
        lin("linear reference", "reference", grad.clone()),
        lin(
            "linear filtered: traded",
            "linear_ce_tiled_filtered",
            grad.clone(),
        ),
        lin(
            "linear fused on 2 shards",
            "linear_ce_fused",
            LossOptions {
                num_shards: Some(2),
                ..grad.clone()
            },
        ),
        // Bad input: the error.
        ce("unknown impl", "nope", t.clone(), grad.clone()),
        ce(
            "grad_output without want_grad",
            "reference",
            t.clone(),
            LossOptions {
                grad_output: Some(vec![1.0]),
                ..LossOptions::default()
            },
        ),
        ce(
            "unknown reduction",
            "reference",
            t.clone(),
            LossOptions {
                reduction: Some("avg".into()),
                ..grad.clone()
            },
        ),
        ce(
            "vocab_size over the width",
            "reference",
            t.clone(),
            LossOptions {
                vocab_size: Some(9),
                ..grad.clone()
            },
        ),
        ce(
            "unsharded on 2 shards",
            "reference",
            t.clone(),
            LossOptions {
                num_shards: Some(2),
                algorithm: Some("unsharded".into()),
                ..grad.clone()
            },
        ),
        ce(
            "0 shards",
            "reference",
            t.clone(),
            LossOptions {
                num_shards: Some(0),
                ..grad.clone()
            },
        ),
        ce(
            "target out of range",
            "cross_entropy_f32",
            vec![1, 7, 0],
            grad.clone(),
        ),
        nan,
        ce(
            "grad_output of the wrong length",
            "reference",
            t.clone(),
            LossOptions {
                reduction: Some("none".into()),
                grad_output: Some(vec![1.0, 2.0]),
                ..grad.clone()
            },
        ),
        ce(
            "label_smoothing over 1",
            "cross_entropy_f32",
            t.clone(),
            LossOptions {
                label_smoothing: Some(1.5),
                ..grad.clone()
            },
        ),
        ce(
            "softcap on the f32 kernel",
            "cross_entropy_f32",
            t.clone(),
            LossOptions {
                softcap: Some(30.0),
                ..grad.clone()
            },
        ),
        lin(
            "an unsharded-only kernel on 2 shards",
            "linear_ce_tiled_filtered",
            LossOptions {
                num_shards: Some(2),
                ..grad.clone()
            },
        ),
    ]
}

#[test]
fn eval_and_the_python_core_give_the_same_errors_and_fields() {
    let (mut good, mut bad) = (0, 0);
    let mut traded = false;
    for c in cases() {
        let (e, p) = (eval(&c), python(&c));
        assert_eq!(e, p, "{}: eval and the Python core differ", c.what);
        match &p {
            Ok(fields) => {
                good += 1;
                let names: Vec<&str> = fields.iter().map(|(k, _)| k.as_str()).collect();
                assert_eq!(names.contains(&"impl"), c.imp != "reference", "{}", c.what);
                traded |= names.contains(&"traded");
            }
            Err((_, field, _, _)) => {
                bad += 1;
                assert!(field.is_some(), "{}: the error names no field", c.what);
            }
        }
    }
    // Both kinds ran (a table that went all-error would prove nothing about
    // the fields), and the filtered kernel's `traded` reached Python.
    assert!(good >= 6 && bad >= 10, "{good} good, {bad} bad");
    assert!(traded, "no case reported traded");
}

/// The errors, spelled out for the cases whose order the two doors used to
/// differ in (docs: `eval` checked `grad_output` with the message below, the
/// Python core with `want_grad=True`; an index in the field).
#[test]
fn the_shared_errors_name_their_field_and_index() {
    let by_what = |what: &str| {
        let c = cases().into_iter().find(|c| c.what == what).unwrap();
        python(&c).unwrap_err()
    };
    let (kind, field, _, message) = by_what("grad_output without want_grad");
    assert_eq!(kind, "invalid_argument");
    assert_eq!(field.as_deref(), Some("grad_output"));
    assert_eq!(message, "grad_output: given without want_grad: true");
    let (kind, field, _, _) = by_what("unknown impl");
    assert_eq!(
        (kind.as_str(), field.as_deref()),
        ("invalid_argument", Some("impl"))
    );
    let (_, field, index, _) = by_what("target out of range");
    assert_eq!((field.as_deref(), index), (Some("targets"), Some(1)));
    let (_, field, _, _) = by_what("an unsharded-only kernel on 2 shards");
    assert_eq!(field.as_deref(), Some("num_shards"));
}
