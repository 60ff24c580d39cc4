//! The typed core of the Python package, free of PyO3 (so `cargo test`
//! runs it without Python): every kernel op through the registry's
//! constructor, the f64 reference and the f32 baseline of a case, and the
//! rule a user's kernel is held to.
//!
//! Shape legend as in `packshard-reference`: `n_tok` tokens, `b` segments,
//! `h` heads (or hidden size of the output layer), `d` head dim, `n` rows,
//! `v` vocabulary, `w >= v` given columns (rows), `p` shards.

use ndarray::{Array1, Array2, Array3, ArrayD, ArrayView2, ArrayView3, Axis, IxDyn, Slice};
use packshard_equivalence::baseline32;
use packshard_equivalence::compare::{self, RelativeRule, Tolerance};
use packshard_equivalence::fuzz::attention::{AttentionTerms, SegmentOptions};
use packshard_oracle::eval::loss::{check_vocab_size, widen_columns, widen_rows};
use packshard_oracle::eval::{make, EvalError};
use packshard_oracle::registry;
use packshard_reference::ops::{EmbeddingCall, Precision};
use packshard_reference::vocab::ShardLayout;

pub use packshard_oracle::eval::attention_runner::{
    attention, offsets, AttentionArgs, AttnOptions, FlashArgs, ReadFlash,
};
pub use packshard_oracle::eval::fields::{Fields, Out};
pub use packshard_oracle::eval::loss::{
    cross_entropy, cross_entropy_with, linear_cross_entropy, linear_cross_entropy_with, LossArgs,
    LossOptions,
};

fn t1(a: Array1<f64>) -> Out {
    Out::Tensor(a.into_dyn())
}
fn t2(a: Array2<f64>) -> Out {
    Out::Tensor(a.into_dyn())
}
fn t3(a: Array3<f64>) -> Out {
    Out::Tensor(a.into_dyn())
}

/// `name` or `name[i]` at the start of a message (`"cu_seqlens[3]: ..."`,
/// `"ids[2] = 9 is out of range ..."`): the field and index it names.
pub fn field_of(message: &str) -> (Option<String>, Option<usize>) {
    let name: String = message
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
        .collect();
    if name.is_empty() {
        return (None, None);
    }
    let rest = &message[name.len()..];
    let (index, rest) = match rest.strip_prefix('[') {
        Some(r) => {
            let digits: String = r.chars().take_while(char::is_ascii_digit).collect();
            match (digits.parse::<usize>(), r[digits.len()..].strip_prefix(']')) {
                (Ok(i), Some(after)) => (Some(i), after),
                _ => (None, rest),
            }
        }
        None => (None, rest),
    };
    if rest.starts_with(':') || rest.starts_with(" =") || rest.starts_with(" is ") {
        (Some(name), index)
    } else {
        (None, None)
    }
}

// ---- attention -------------------------------------------------------------

// `attention` is the typed runner of `packshard_oracle::eval::attention_runner`
// (re-exported above), the one `packshard eval` calls: the same checks,
// order, errors and fields.

/// The registered kernel that [`attention_f32`] runs on `f32` arrays in
/// place (every other one takes its inputs in `f64`).
pub const F32_NATIVE: &str = "attention_varlen_tiled";

/// The results of [`attention_f32`], `f32` as the kernel computes them:
/// `output: [n_q, h, d]`, `lse: [h, n_q]`, and `grad_q: [n_q, h, d]`,
/// `grad_k`, `grad_v: [n_k, h_kv, d]` with a `grad_output`.
pub type Fields32 = Vec<(&'static str, ndarray::ArrayD<f32>)>;

/// `attention` through [`F32_NATIVE`] on `f32` inputs read in place: the same
/// checks, in the same order, and bit for bit the same values as
/// [`attention`] on the same inputs given in `f64`, without the widening
/// of inputs and results.
///
/// # Errors
/// As [`attention`]; `invalid_argument` on `impl` for any other kernel.
pub fn attention_f32(imp: &str, a: &AttentionArgs<'_, f32>) -> Result<Fields32, EvalError> {
    use packshard_optimized::ops::boundary::InPlaceF32;
    use packshard_optimized::ops::TiledAttention;
    if imp != F32_NATIVE {
        return Err(EvalError::invalid(
            "impl",
            format!("{imp}: only {F32_NATIVE} runs on f32 arrays in place"),
        ));
    }
    let x = InPlaceF32::new(a.q, a.k, a.v, a.grad_output);
    let p = a.problem();
    let op = TiledAttention::F32;
    let fwd = op.varlen_forward_f32(&x, &p)?;
    let grads = match a.grad_output {
        Some(_) => Some(op.varlen_backward_f32(&x, &p, &fwd)?),
        None => None,
    };
    let mut out: Fields32 = vec![
        ("output", fwd.output.into_dyn()),
        ("lse", fwd.lse.into_dyn()),
    ];
    if let Some(g) = grads {
        out.push(("grad_q", g.grad_q.into_dyn()));
        out.push(("grad_k", g.grad_k.into_dyn()));
        out.push(("grad_v", g.grad_v.into_dyn()));
    }
    Ok(out)
}

/// What a user's kernel stores its tensors in, for the judge: its inputs
/// are rounded to it (the f64 reference runs on the rounded values), and the
/// baseline is the reference math run in f32 on them with its results
/// stored in it ([`Precision::round`], applied by [`judge_tensor`]).
///
/// - `f32`: f32 storage and arithmetic, held to [`RelativeRule::F32_FUZZ`];
/// - `bf16`, `f16`: bf16 / f16 storage (inputs and results), f32
///   arithmetic (the registry's bf16 kernels: `Judge::Relative` with
///   `inputs: Precision::Bf16`, here with the results stored in bf16 too),
///   held to [`RelativeRule::BF16_STORED_FUZZ`] / `F16_STORED_FUZZ`
///   against the baseline with its results rounded to the storage type,
///   as flash-attention's tests judge their fp16/bf16 kernels against the
///   reference run in the kernel's dtype;
/// - `f64`: f64 throughout, held to [`Tolerance::F64_REWRITE`].
///
/// The workspace's one precision type ([`Precision`]: its names, unit
/// roundoff and rounding); this crate adds only its parsing with the
/// package's error ([`parse_precision`]), the rounding of a whole array
/// ([`round_all`]) and the rule it is held to ([`rule_of`]).
pub type KernelPrecision = Precision;

/// The precision called `s` (`f64`, `f32`, `bf16`, `f16`).
///
/// # Errors
/// `invalid_argument` naming `precision` and the allowed values.
pub fn parse_precision(s: &str) -> Result<KernelPrecision, EvalError> {
    Precision::from_name(s).ok_or_else(|| {
        let names: Vec<String> = Precision::ALL
            .iter()
            .map(|p| format!("{:?}", p.name()))
            .collect();
        EvalError::invalid(
            "precision",
            format!(
                "{s:?} is not a precision; expected one of {}",
                names.join(", ")
            ),
        )
    })
}

/// Every value of `x` rounded to `p` ([`Precision::round`]: to nearest,
/// ties to even, through f32 as PyTorch's `.to(dtype)` does), in standard
/// layout: `mapv` would keep the view's strides, which ndarray refuses for
/// an empty view of a non-empty allocation (numpy's `reshape(0, ..)`
/// strides), a panic.
pub fn round_all<D: ndarray::Dimension>(
    p: KernelPrecision,
    x: &ndarray::ArrayView<'_, f64, D>,
) -> ndarray::Array<f64, D> {
    let values: Vec<f64> = x.iter().map(|&v| p.round(v)).collect();
    ndarray::Array::from_shape_vec(x.raw_dim(), values)
        .expect("as many values as the view's shape holds")
}

/// The rule a kernel of precision `p` is held to on one case, against the
/// f32 baseline stored in it: [`RelativeRule::F32_FUZZ`] (f32),
/// [`RelativeRule::BF16_STORED_FUZZ`], [`RelativeRule::F16_STORED_FUZZ`];
/// `None` for f64 ([`Tolerance::F64_REWRITE`], no baseline).
pub fn rule_of(p: KernelPrecision) -> Option<RelativeRule> {
    match p {
        Precision::F32 => Some(RelativeRule::F32_FUZZ),
        Precision::Bf16 => Some(RelativeRule::BF16_STORED_FUZZ),
        Precision::F16 => Some(RelativeRule::F16_STORED_FUZZ),
        Precision::F64 => None,
    }
}

/// The f64 reference on the inputs as the kernel sees them (rounded to
/// `precision`), and the same math run in f32 on them (the baseline; `None`
/// for an f64 kernel): the two sides of the rule.
pub struct Judged {
    /// The f64 reference's result fields.
    pub expected: Fields,
    /// The f32 baseline's tensors, named as `expected`'s.
    pub baseline: Option<Fields>,
}

/// The magnitude of the terms of each attention result ([`AttentionTerms`],
/// the fuzz targets' floor): a tensor that cancels to nearly 0 is judged
/// against the size of what was summed, not its own. The largest over the
/// segments under each result's name, and under `segments` each segment's
/// own with the offsets (`q`: `cu_seqlens_q`, `k`: `cu_seqlens_k`), which
/// [`crate::segments::judge_result`] judges each segment by, as the Rust
/// fuzz does (a short segment is not judged by a long one's terms).
fn attention_terms(a: &AttentionArgs<'_>) -> serde_json::Value {
    let mut t = AttentionTerms::default();
    let mut each = Vec::new();
    let zeros = Array3::<f64>::zeros(a.q.raw_dim());
    let go = a.grad_output.unwrap_or(zeros.view());
    let (n_q, n_k) = (a.q.dim().0, a.k.dim().0);
    let o = &a.options;
    for (s, (wq, wk)) in a.cu_seqlens.windows(2).zip(a.cu_k().windows(2)).enumerate() {
        // Called on offsets the reference accepted; skip any other.
        if wq[1] < wq[0] || wq[1] > n_q || wk[1] < wk[0] || wk[1] > n_k {
            continue;
        }
        let (sq, sk) = (Slice::from(wq[0]..wq[1]), Slice::from(wk[0]..wk[1]));
        let rows = |x: &ArrayView3<'_, f64>, s: Slice| x.slice_axis(Axis(0), s).to_owned();
        let (q, k, v, g) = (
            rows(&a.q, sq),
            rows(&a.k, sk),
            rows(&a.v, sk),
            rows(&go, sq),
        );
        let u = AttentionTerms::of_with(
            q.view(),
            k.view(),
            v.view(),
            g.view(),
            (a.scale(), a.causal),
            SegmentOptions {
                window: o.window,
                softcap: o.softcap,
                alibi_slopes: o.alibi_slopes.as_deref(),
                used_keys: o.used_keys(s, wk[1] - wk[0]),
            },
        );
        t = t.max(u);
        each.push(u);
    }
    let seg = |f: fn(&AttentionTerms) -> f64| each.iter().map(f).collect::<Vec<f64>>();
    let segments = (each.len() + 1 == a.cu_seqlens.len()).then(|| {
        serde_json::json!({
            "q": a.cu_seqlens, "k": a.cu_k(),
            "output": seg(|t| t.output), "lse": seg(|t| t.lse), "grad_q": seg(|t| t.grad_q),
            "grad_k": seg(|t| t.grad_k), "grad_v": seg(|t| t.grad_v),
        })
    });
    serde_json::json!({"output": t.output, "lse": t.lse, "grad_q": t.grad_q, "grad_k": t.grad_k, "grad_v": t.grad_v, "segments": segments})
}

/// [`Judged`] for an `attention` case.
///
/// # Errors
/// The reference's errors for bad input.
pub fn attention_judged(
    a: &AttentionArgs<'_>,
    precision: KernelPrecision,
) -> Result<Judged, EvalError> {
    let r = |x: &ArrayView3<f64>| round_all(precision, x);
    let (q, k, v) = (r(&a.q), r(&a.k), r(&a.v));
    let go = a.grad_output.as_ref().map(r);
    let rounded = AttentionArgs {
        q: q.view(),
        k: k.view(),
        v: v.view(),
        cu_seqlens: a.cu_seqlens.clone(),
        cu_seqlens_k: a.cu_seqlens_k.clone(),
        causal: a.causal,
        scale: Some(a.scale()),
        grad_output: go.as_ref().map(|g| g.view()),
        options: a.options.clone(),
    };
    let mut expected = attention(registry::REFERENCE, &rounded)?;
    expected.push(("terms", Out::Json(attention_terms(&rounded))));
    if precision == KernelPrecision::F64 {
        return Ok(Judged {
            expected,
            baseline: None,
        });
    }
    let f = |x: &Array3<f64>| baseline32::to_f32(&x.view());
    let (q32, k32, v32) = (f(&q), f(&k), f(&v));
    let p = rounded.problem();
    let (o, lse) = baseline32::varlen_attention_options(q32.view(), k32.view(), v32.view(), &p);
    let w = |x: &Array3<f32>| t3(baseline32::to_f64(&x.view()));
    let mut base: Fields = vec![
        ("output", w(&o)),
        ("lse", t2(baseline32::to_f64(&lse.view()))),
    ];
    if let Some(go) = &go {
        let go32 = f(go);
        let [gq, gk, gv] = baseline32::varlen_attention_options_backward(
            (q32.view(), k32.view(), v32.view()),
            &p,
            (o.view(), lse.view()),
            go32.view(),
        );
        base.push(("grad_q", w(&gq)));
        base.push(("grad_k", w(&gk)));
        base.push(("grad_v", w(&gv)));
    }
    Ok(Judged {
        expected,
        baseline: Some(base),
    })
}

// ---- the vocabulary-parallel layers -----------------------------------------

// `cross_entropy` and `linear_cross_entropy` are the typed runner of
// `packshard_oracle::eval::loss` (re-exported above), the one `packshard
// eval` calls: the same checks, order, errors and fields.

/// The loss ops' [`Judged`]: `inputs` are `logits: [n, w]` (`hidden` `None`)
/// or `hidden: [n, h]` and `weight: [w, h]`. The reference runs unsharded on
/// the real vocabulary (what every sharded form must equal); gradients are
/// widened to the given width with zero padding.
///
/// # Errors
/// The reference's errors for bad input.
pub fn loss_judged(
    logits: Option<ArrayView2<'_, f64>>,
    hidden: Option<(ArrayView2<'_, f64>, ArrayView2<'_, f64>)>,
    a: &LossArgs,
    precision: KernelPrecision,
) -> Result<Judged, EvalError> {
    let r = |x: &ArrayView2<f64>| round_all(precision, x);
    let unsharded = LossArgs {
        num_shards: None,
        algorithm: None,
        layout: None,
        ..a.clone()
    };
    // Rounding a padding value may overflow f32; padding is never read, so
    // only the real part is rounded and the rest left as given.
    match (logits, hidden) {
        (Some(z), None) => {
            let width = z.ncols();
            let v = check_vocab_size(a.vocab_size, width)?;
            let mut zr = z.to_owned();
            let real_r = r(&z.slice_axis(Axis(1), Slice::from(..v)));
            zr.slice_axis_mut(Axis(1), Slice::from(..v)).assign(&real_r);
            let mut expected = cross_entropy_with(registry::REFERENCE, zr.view(), &unsharded)?;
            expected.retain(|(k, _)| *k != "algorithm");
            if precision == KernelPrecision::F64 {
                return Ok(Judged {
                    expected,
                    baseline: None,
                });
            }
            let z32 = baseline32::to_f32(&real_r.view());
            let b = baseline32::cross_entropy(z32.view(), &a.call());
            let mut base = ce32_fields(&b);
            if let Some(g) = &b.grad_logits {
                let g = baseline32::to_f64(&g.view());
                base.push(("grad_logits", t2(widen_columns(&g, width))));
            }
            Ok(Judged {
                expected,
                baseline: Some(base),
            })
        }
        (None, Some((hid, w))) => {
            let rows = w.nrows();
            let v = check_vocab_size(a.vocab_size, rows)?;
            let hr = r(&hid);
            let mut wr = w.to_owned();
            let real_r = r(&w.slice_axis(Axis(0), Slice::from(..v)));
            wr.slice_axis_mut(Axis(0), Slice::from(..v)).assign(&real_r);
            let mut expected =
                linear_cross_entropy_with(registry::REFERENCE, hr.view(), wr.view(), &unsharded)?;
            expected.retain(|(k, _)| *k != "algorithm" && *k != "vocab_size");
            if precision == KernelPrecision::F64 {
                return Ok(Judged {
                    expected,
                    baseline: None,
                });
            }
            let h32 = baseline32::to_f32(&hr.view());
            let w32 = baseline32::to_f32(&real_r.view());
            let (b, grads) = baseline32::linear_cross_entropy(h32.view(), w32.view(), &a.call());
            let mut base = ce32_fields(&b);
            if let Some(g) = &b.grad_logits {
                base.push(("grad_logits", t2(baseline32::to_f64(&g.view()))));
            }
            if let Some((gh, gw)) = grads {
                base.push(("grad_hidden", t2(baseline32::to_f64(&gh.view()))));
                let gw = baseline32::to_f64(&gw.view());
                base.push(("grad_weight", t2(widen_rows(&gw, rows))));
            }
            Ok(Judged {
                expected,
                baseline: Some(base),
            })
        }
        _ => Err(EvalError::invalid(
            "logits",
            "give logits, or hidden and weight",
        )),
    }
}

fn ce32_fields(b: &baseline32::CrossEntropy32) -> Fields {
    let v1 = |x: &[f32]| t1(x.iter().map(|&v| f64::from(v)).collect());
    vec![
        ("loss", Out::F64(f64::from(b.loss))),
        ("per_token_loss", v1(&b.per_token_loss)),
        ("logsumexp", v1(&b.logsumexp)),
    ]
}

/// `embedding` through the registered `imp`: `ids: [n]`, `weight: [w, h]`
/// (rows `vocab_size..` padding), `grad_output: [n, h]` for the weight
/// gradient, `num_shards` for the sharded lookup.
///
/// # Errors
/// The eval op's.
pub fn embedding(
    imp: &str,
    ids: &[i64],
    weight: ArrayView2<'_, f64>,
    vocab_size: Option<usize>,
    num_shards: Option<usize>,
    layout: Option<&str>,
    grad_output: Option<ArrayView2<'_, f64>>,
) -> Result<Fields, EvalError> {
    let rows = weight.nrows();
    let v = check_vocab_size(vocab_size, rows)?;
    let real = weight.slice_axis(Axis(0), Slice::from(..v));
    let op = make(&registry::embedding(), imp)?;
    let mut out: Fields = Vec::new();
    match num_shards {
        None => {
            if layout.is_some() {
                return Err(EvalError::invalid("layout", "needs num_shards"));
            }
            let e = op.embedding(EmbeddingCall::new(ids, real, grad_output))?;
            out.push(("output", t2(e.output)));
            if let Some(gw) = &e.grad_weight {
                out.push(("grad_weight", t2(widen_rows(gw, rows))));
            }
        }
        Some(p) => {
            let layout = layout
                .map(str::parse::<ShardLayout>)
                .transpose()?
                .unwrap_or_default();
            let map = packshard_reference::vocab::ShardMap::new(v, p, layout)?;
            let s = op.sharded_embedding(&map, EmbeddingCall::new(ids, weight, grad_output))?;
            let c = s.counts[0];
            out.push(("output", t2(s.outputs[0].clone())));
            if let Some(gw) = s.grad_weight() {
                out.push(("grad_weight", t2(widen_rows(&gw, rows))));
            }
            out.push(("num_shards", Out::Usize(p)));
            out.push(("layout", Out::Str(layout.name().into())));
            out.push((
                "collectives",
                Out::Json(
                    serde_json::json!({"calls": c.calls, "barriers": c.barriers, "elements": c.elements}),
                ),
            ));
        }
    }
    Ok(out)
}

// ---- the rule ------------------------------------------------------------------

/// How one tensor of a user's kernel compared.
#[derive(Debug, Clone, PartialEq)]
pub struct Verdict {
    /// `None` when within the rule; the failure's text (index, both values,
    /// the kernel's and the baseline's error, the tolerance) otherwise.
    pub failure: Option<String>,
    /// `max |actual - expected|` over finite values.
    pub error: f64,
    /// `max |baseline - expected|`, the baseline stored in the kernel's
    /// precision (0 for an f64 kernel).
    pub baseline_error: f64,
    /// The error the rule allows at [`Verdict::index`]: `k_tensor x
    /// baseline_error + floor` for the relative rule (the same for every
    /// element), `rel x |expected| + abs x scale` for an f64 kernel.
    pub allowed: f64,
    /// The largest share of the allowed error used, `error / allowed` over
    /// the elements (at most 1 on a pass; infinite where the non-finite
    /// values disagree, or the shapes).
    pub share: f64,
    /// The multi-index of that element (empty for a scalar or no values).
    pub index: Vec<usize>,
    /// The reference's value there.
    pub expected: f64,
    /// The kernel's value there.
    pub actual: f64,
}

impl Verdict {
    /// The verdict on outputs of shape `got` where `want` was expected.
    pub fn shape_mismatch(what: &str, got: &[usize], want: &[usize]) -> Verdict {
        Verdict {
            failure: Some(format!("{what}: shape {got:?} where {want:?} was expected")),
            error: f64::INFINITY,
            baseline_error: 0.0,
            allowed: 0.0,
            share: f64::INFINITY,
            index: vec![],
            expected: f64::NAN,
            actual: f64::NAN,
        }
    }
}

/// The element with the largest share of `allowed(i)` used (ties: the
/// first), and that share; a non-finite disagreement counts as infinite.
fn worst_share(
    expected: &[f64],
    actual: &[f64],
    allowed: impl Fn(usize) -> f64,
) -> (Option<usize>, f64) {
    let mut worst = (None, 0.0f64);
    for (i, (&e, &a)) in expected.iter().zip(actual).enumerate() {
        let share = if e.is_finite() && a.is_finite() {
            let d = (a - e).abs();
            match allowed(i) {
                t if t > 0.0 => d / t,
                _ if d == 0.0 => 0.0,
                _ => f64::INFINITY,
            }
        } else if e == a {
            0.0
        } else {
            f64::INFINITY
        };
        if worst.0.is_none() || share > worst.1 {
            worst = (Some(i), share);
        }
    }
    worst
}

/// Holds `actual` (row-major, of `shape`) to the rule for `precision`
/// ([`rule_of`]): for f32, [`RelativeRule::F32_FUZZ`] (at most
/// 32 x the error of the baseline, the reference math run in f32, plus 256
/// ulp of f32 of the tensor's scale); for bf16 and f16, 8 x the baseline
/// stored in that precision plus one of its ulp of the scale; for f64,
/// [`Tolerance::F64_REWRITE`]. `baseline` (the reference math run in f32) is
/// required below f64; it is rounded to the kernel's storage here. `scale`,
/// when given, is the magnitude the floor is relative to (at least the
/// tensor's own largest value: the magnitude of the terms).
pub fn judge_tensor(
    what: &str,
    shape: &[usize],
    expected: &[f64],
    baseline: Option<&[f64]>,
    actual: &[f64],
    precision: KernelPrecision,
    scale: Option<f64>,
) -> Verdict {
    let err = expected
        .iter()
        .zip(actual)
        .filter(|(e, a)| e.is_finite() && a.is_finite())
        .fold(0.0f64, |m, (e, a)| m.max((a - e).abs()));
    let verdict = |failure: Option<String>, baseline_error: f64, allowed: &dyn Fn(usize) -> f64| {
        let (at, share) = worst_share(expected, actual, allowed);
        let at = at.unwrap_or(0);
        let pick = |x: &[f64]| x.get(at).copied().unwrap_or(f64::NAN);
        Verdict {
            failure,
            error: err,
            baseline_error,
            allowed: if expected.is_empty() {
                0.0
            } else {
                allowed(at)
            },
            share,
            index: if expected.is_empty() {
                vec![]
            } else {
                compare::unravel(at, shape)
            },
            expected: pick(expected),
            actual: pick(actual),
        }
    };
    let tensor_scale = expected
        .iter()
        .filter(|v| v.is_finite())
        .fold(0.0f64, |m, v| m.max(v.abs()));
    match (precision, baseline) {
        (Precision::F64, _) | (_, None) => {
            let tol = Tolerance::F64_REWRITE;
            let s = scale.unwrap_or(1e-300).max(1e-300).max(tensor_scale);
            let r = compare::assert_close_with_scale(what, expected, actual, shape, tol, scale);
            let failure = r.err().map(|m| format!("{}: {}", m.what, m.detail));
            verdict(failure, 0.0, &|i| tol.allowed(expected[i], s))
        }
        (p, Some(b)) => {
            let stored: Vec<f64> = b.iter().map(|&x| p.round(x)).collect();
            let rule = rule_of(p).unwrap_or(RelativeRule::F32_FUZZ);
            // `scale` (the terms' running bound) measures f32 arithmetic: a
            // bf16 / f16 kernel computes in f32, so its floor there is the f32
            // rule's (256 ulp of f32 of the terms), not its storage's ulp of
            // them; the storage floor applies to the tensor's own magnitude.
            let f32_floor = RelativeRule::F32_FUZZ.floor * RelativeRule::F32_FUZZ.eps;
            let scale = scale.map(|t| t * f32_floor / (rule.floor * rule.eps));
            let r = compare::assert_within_k(
                what,
                expected,
                &stored,
                actual,
                shape,
                rule,
                compare::Allowance::with_scale(scale),
            );
            match r {
                Ok(s) => {
                    let allowed = rule.k_tensor * s.baseline + s.floor;
                    verdict(None, s.baseline, &|_| allowed)
                }
                Err(m) => {
                    let failure = Some(format!("{}: {}", m.what, m.detail));
                    // The baseline's error and floor as the rule computed
                    // them, for the report (a failed shape check has none).
                    let berr = stored
                        .iter()
                        .zip(expected)
                        .filter(|(b, e)| b.is_finite() && e.is_finite())
                        .fold(0.0f64, |m, (b, e)| m.max((b - e).abs()));
                    let floor = rule.floor * rule.eps * tensor_scale.max(scale.unwrap_or(0.0));
                    let allowed = rule.k_tensor * berr + floor;
                    let mut v = verdict(failure, berr, &|_| allowed);
                    // A failure is never reported as within the rule (a
                    // non-finite baseline disagreeing, say).
                    v.share = v.share.max(1.0 + f64::EPSILON).max(if allowed > 0.0 {
                        err / allowed
                    } else {
                        f64::INFINITY
                    });
                    v
                }
            }
        }
    }
}

/// A tensor field of `fields` as a dynamic array (a scalar as shape `[]`).
pub fn tensor_of(fields: &Fields, name: &str) -> Option<ArrayD<f64>> {
    fields
        .iter()
        .find(|(k, _)| *k == name)
        .and_then(|(_, v)| match v {
            Out::Tensor(t) => Some(t.clone()),
            Out::F64(x) => Some(ArrayD::from_elem(IxDyn(&[]), *x)),
            _ => None,
        })
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod eval_parity;

#[cfg(test)]
mod eval_parity_attention;
