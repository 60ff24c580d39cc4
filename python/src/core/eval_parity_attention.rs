//! The two front doors of the `attention` op, `packshard eval` and the
//! Python package's core, on the same cases: the same error (kind, field,
//! index, message) for bad input, the same fields in the same order for
//! good input. Each case is written once; the eval side gets it as the JSON
//! case `docs/INTERFACE.md` defines, the Python side as `py.rs` passes it
//! ([`FlashArgs::read`], then [`attention`]).

use super::eval_parity::{error, Answer};
use super::*;
use packshard_oracle::eval::fields::to_json;
use serde_json::{json, Map, Value};

/// An attention case: `q: [n_q, h, d]`, `k, v: [n_k, h_kv, d]`, the
/// offsets and options as flash-attention spells them.
struct Case {
    what: &'static str,
    imp: &'static str,
    q: Array3<f64>,
    k: Array3<f64>,
    v: Array3<f64>,
    flash: FlashArgs,
    causal: bool,
    scale: Option<f64>,
    grad_output: Option<Array3<f64>>,
}

/// `x` as the contract spells it (NaN as `"nan"`).
fn number(x: f64) -> Value {
    if x.is_nan() {
        json!("nan")
    } else {
        json!(x)
    }
}

fn tensor_json(a: &Array3<f64>) -> Value {
    Value::Array(
        a.outer_iter()
            .map(|m| {
                Value::Array(
                    m.rows()
                        .into_iter()
                        .map(|r| Value::Array(r.iter().map(|&x| number(x)).collect()))
                        .collect(),
                )
            })
            .collect(),
    )
}

/// The JSON case `packshard eval` reads: `cu_seqlens` alone for
/// self-attention, `cu_seqlens_q` and `cu_seqlens_k` otherwise.
fn eval_case(c: &Case) -> Value {
    let f = &c.flash;
    let mut m = Map::new();
    m.insert("op".into(), json!("attention"));
    m.insert("impl".into(), json!(c.imp));
    m.insert("q".into(), tensor_json(&c.q));
    m.insert("k".into(), tensor_json(&c.k));
    m.insert("v".into(), tensor_json(&c.v));
    match &f.cu_seqlens_k {
        Some(cu_k) => {
            m.insert("cu_seqlens_q".into(), json!(f.cu_seqlens));
            m.insert("cu_seqlens_k".into(), json!(cu_k));
        }
        None => {
            m.insert("cu_seqlens".into(), json!(f.cu_seqlens));
        }
    }
    m.insert("causal".into(), json!(c.causal));
    if let Some(s) = c.scale {
        m.insert("scale".into(), json!(s));
    }
    if let Some(go) = &c.grad_output {
        m.insert("want_grad".into(), json!(true));
        m.insert("grad_output".into(), tensor_json(go));
    }
    if let Some((l, r)) = f.window_size {
        m.insert("window_size".into(), json!([l, r]));
    }
    if let Some(s) = f.softcap {
        m.insert("softcap".into(), json!(s));
    }
    if let Some(a) = &f.alibi_slopes {
        let xs: Vec<Value> = a.iter().map(|&x| number(x)).collect();
        m.insert("alibi_slopes".into(), Value::Array(xs));
    }
    if let Some(u) = &f.seqused_k {
        m.insert("seqused_k".into(), json!(u));
    }
    Value::Object(m)
}

/// What the Python core gives: the offsets and options read as `py.rs`
/// reads them, then the runner.
fn python(c: &Case) -> Answer {
    let (cu_seqlens, cu_seqlens_k, options) = c.flash.clone().read().map_err(error)?;
    let a = AttentionArgs {
        q: c.q.view(),
        k: c.k.view(),
        v: c.v.view(),
        cu_seqlens,
        cu_seqlens_k,
        causal: c.causal,
        scale: c.scale,
        grad_output: c.grad_output.as_ref().map(|g| g.view()),
        options,
    };
    attention(c.imp, &a)
        .map(|f| {
            f.iter()
                .map(|(k, v)| ((*k).to_string(), to_json(v)))
                .collect()
        })
        .map_err(error)
}

fn eval(c: &Case) -> Answer {
    let v = packshard_oracle::eval::evaluate(&eval_case(c)).map_err(error)?;
    let Value::Object(m) = v else {
        panic!("{}: eval gave {v}", c.what)
    };
    Ok(m.into_iter().filter(|(k, _)| k != "op").collect())
}

/// Values with no common pattern: `((i * 37) % 23) / 7 - 1.5` over the
/// flat index plus `offset`, so q, k, v and grad_output differ.
fn values(shape: (usize, usize, usize), offset: usize) -> Array3<f64> {
    let (_, h, d) = shape;
    Array3::from_shape_fn(shape, |(t, a, j)| {
        let i = (t * h + a) * d + j + offset;
        ((i * 37) % 23) as f64 / 7.0 - 1.5
    })
}

fn cases() -> Vec<Case> {
    // Segments of 3 and 2 tokens, h = 2 query heads, d = 3.
    let (n, h, d) = (5, 2, 3);
    let base = |what, imp, h_kv: usize| Case {
        what,
        imp,
        q: values((n, h, d), 0),
        k: values((n, h_kv, d), 11),
        v: values((n, h_kv, d), 29),
        flash: FlashArgs {
            cu_seqlens: vec![0, 3, 5],
            ..FlashArgs::default()
        },
        causal: false,
        scale: None,
        grad_output: Some(values((n, h, d), 5)),
    };
    let with = |mut c: Case, f: &dyn Fn(&mut Case)| {
        f(&mut c);
        c
    };
    let options = FlashArgs {
        cu_seqlens: vec![0, 3, 5],
        window_size: Some((1, 0)),
        softcap: Some(5.0),
        alibi_slopes: Some(vec![0.5, 0.25]),
        seqused_k: Some(vec![2, 1]),
        ..FlashArgs::default()
    };
    // Cross attention: 5 queries (3 + 2) over 6 keys (4 + 2).
    let cross = |c: &mut Case| {
        c.k = values((6, 2, d), 11);
        c.v = values((6, 2, d), 29);
        c.flash.cu_seqlens_k = Some(vec![0, 4, 6]);
    };
    vec![
        // Good input: the fields, in order.
        with(base("reference, causal", "reference", 2), &|c| {
            c.causal = true
        }),
        base("tiled, grouped-query (h_kv 1)", "attention_varlen_tiled", 1),
        with(
            base(
                "scalar, causal cross attention",
                "attention_varlen_scalar",
                2,
            ),
            &|c| {
                c.causal = true;
                cross(c);
            },
        ),
        with(base("reference, every option", "reference", 2), &|c| {
            c.flash = options.clone()
        }),
        with(
            base("dense, every option, no grad", "attention_dense_masked", 2),
            &|c| {
                c.flash = options.clone();
                c.grad_output = None;
            },
        ),
        with(
            base("bf16 tiles, scale given", "attention_varlen_tiled_bf16", 2),
            &|c| c.scale = Some(0.3),
        ),
        // Bad input: the error.
        base("unknown impl", "nope", 2),
        with(base("NaN in q", "attention_varlen_tiled", 2), &|c| {
            c.q[[0, 1, 1]] = f64::NAN
        }),
        with(base("NaN in grad_output", "reference", 2), &|c| {
            if let Some(g) = c.grad_output.as_mut() {
                g[[4, 0, 2]] = f64::NAN;
            }
        }),
        with(base("NaN in alibi_slopes", "reference", 2), &|c| {
            c.flash.alibi_slopes = Some(vec![0.5, f64::NAN])
        }),
        with(base("negative cu_seqlens", "reference", 2), &|c| {
            c.flash.cu_seqlens = vec![0, -3, 5]
        }),
        with(
            base("negative cu_seqlens_q beside cu_seqlens_k", "reference", 2),
            &|c| {
                cross(c);
                c.flash.cu_seqlens = vec![0, -3, 5];
            },
        ),
        with(
            base("cu_seqlens not from 0", "attention_varlen_scalar", 2),
            &|c| c.flash.cu_seqlens = vec![1, 3, 5],
        ),
        with(base("cu_seqlens decreasing", "reference", 2), &|c| {
            c.flash.cu_seqlens = vec![0, 3, 2, 5]
        }),
        with(
            base("cu_seqlens short of n_q", "attention_varlen_tiled", 2),
            &|c| c.flash.cu_seqlens = vec![0, 3, 4],
        ),
        with(base("k of another shape", "reference", 2), &|c| {
            c.k = values((4, 2, d), 11)
        }),
        with(base("h_kv not dividing h", "reference", 2), &|c| {
            c.q = values((n, 3, d), 0);
            c.grad_output = Some(values((n, 3, d), 5));
        }),
        with(base("grad_output of another shape", "reference", 2), &|c| {
            c.grad_output = Some(values((n, 1, d), 5))
        }),
        with(base("window side below -1", "reference", 2), &|c| {
            c.flash.window_size = Some((-2, 0))
        }),
        with(base("negative seqused_k", "reference", 2), &|c| {
            c.flash.seqused_k = Some(vec![1, -1])
        }),
        with(
            base("seqused_k over the segment", "attention_varlen_tiled", 2),
            &|c| c.flash.seqused_k = Some(vec![4, 1]),
        ),
        with(
            base("alibi_slopes of another length", "reference", 2),
            &|c| c.flash.alibi_slopes = Some(vec![0.5]),
        ),
        with(base("negative softcap", "reference", 2), &|c| {
            c.flash.softcap = Some(-1.0)
        }),
        with(
            base(
                "cross attention on a self-attention kernel",
                "attention_dense_masked",
                2,
            ),
            &cross,
        ),
    ]
}

#[test]
fn eval_and_the_python_core_give_the_same_attention_errors_and_fields() {
    let (mut good, mut bad) = (0, 0);
    for c in cases() {
        let (e, p) = (eval(&c), python(&c));
        assert_eq!(e, p, "{}: eval and the Python core differ", c.what);
        match &p {
            Ok(fields) => {
                good += 1;
                let names: Vec<&str> = fields.iter().map(|(k, _)| k.as_str()).collect();
                let mut want = vec!["output", "lse"];
                if c.imp != "reference" {
                    want.push("impl");
                }
                if c.grad_output.is_some() {
                    want.extend(["grad_q", "grad_k", "grad_v"]);
                }
                assert_eq!(names, want, "{}", c.what);
            }
            Err((_, field, _, message)) => {
                bad += 1;
                assert!(
                    field.is_some(),
                    "{}: the error names no field: {message}",
                    c.what
                );
            }
        }
    }
    // Both kinds ran: a table that went all-error would prove nothing about
    // the fields, one that went all-good nothing about the errors.
    assert_eq!((good, bad), (6, 18), "{good} good, {bad} bad");
}

/// The errors of each refusal kind, spelled out: the field, the index and
/// the kind, as both doors give them.
#[test]
fn the_shared_attention_errors_name_their_field_and_index() {
    let by_what = |what: &str| {
        let c = cases().into_iter().find(|c| c.what == what).unwrap();
        python(&c).unwrap_err()
    };
    let expect = [
        ("unknown impl", "invalid_argument", "impl", None),
        ("NaN in q", "non_finite_input", "q", Some(4)),
        (
            "NaN in grad_output",
            "non_finite_input",
            "grad_output",
            Some(26),
        ),
        (
            "NaN in alibi_slopes",
            "non_finite_input",
            "alibi_slopes",
            Some(1),
        ),
        (
            "negative cu_seqlens",
            "invalid_argument",
            "cu_seqlens",
            Some(1),
        ),
        (
            "negative cu_seqlens_q beside cu_seqlens_k",
            "invalid_argument",
            "cu_seqlens_q",
            Some(1),
        ),
        (
            "cu_seqlens not from 0",
            "invalid_argument",
            "cu_seqlens",
            Some(0),
        ),
        ("k of another shape", "shape_mismatch", "k", None),
        (
            "window side below -1",
            "invalid_argument",
            "window_size",
            Some(0),
        ),
        (
            "negative seqused_k",
            "invalid_argument",
            "seqused_k",
            Some(1),
        ),
    ];
    for (what, kind, field, index) in expect {
        let (k, f, i, message) = by_what(what);
        assert_eq!(
            (k.as_str(), f.as_deref(), i),
            (kind, Some(field), index),
            "{what}: {message}"
        );
    }
    let (_, _, _, message) = by_what("negative cu_seqlens");
    assert_eq!(
        message,
        "cu_seqlens[1]: expected a non-negative integer, found the negative number -3"
    );
}
