//! Varlen attention, forward and backward, against the f64 reference on
//! arbitrary cases (docs/FAULTS.md P2, P4, P8, C5).
//!
//! A case ([`AttentionFuzzCase`], sized by [`super::schedule`]) has segments
//! of `(l_q, l_k)` queries over keys — around tile boundaries, tiny ones,
//! and in large cases one of 1,023 to 1,100 tokens beside many short ones —
//! grouped-query heads (`h / h_kv` 1, 2, 4, 8 or `h`), cross segments and
//! bottom-right causal masks, planted values, and in one case of about 16
//! malformed offsets (not starting at 0, decreasing, not ending at the
//! token count, empty) that must be an error of the reference's kind, never
//! a result or a panic.
//!
//! [`check`] first narrows the case to what the implementation declares
//! ([`AttentionOp::support`], [`AttentionFuzzCase::within`]: a kernel
//! without causal masks gets the case unmasked, one without grouped-query
//! heads gets the key heads repeated, one without cross attention gets
//! `min(l_q, l_k)` queries over as many keys per segment), counted in [`Outcome::narrowed`]. It then runs
//! the implementation's packed forward and backward (the backward from its
//! own forward, as training does) and the f64 reference's
//! (`varlen_attention_general`), and compares every segment's `output`,
//! `lse`, `grad_q` and, over the segment's keys, `grad_k` and `grad_v` under
//! the caller's [`Tolerance`] scaled by the magnitude of the terms
//! ([`ATTENTION_TERMS`]). Then, for self-attention with `h_kv == h`, the
//! padded form: every segment alone in a row with planted garbage in the
//! padding slots, through the implementation's masked forward and backward
//! (the causal block when causal): padding rows exactly 0 with `lse = -inf`
//! (P8), real rows equal to the reference's packed results under the same
//! rule (packed == padded, P4 for empty segments). Last, a change to one
//! segment's queries and keys must leave every other query's packed output
//! bit-for-bit unchanged (P2).

use std::ops::Range;

use ndarray::{Array2, Array3, ArrayView3, Axis, Slice};
use packshard_reference::attention::{varlen_attention_general, varlen_attention_general_backward};
use packshard_reference::bert::{AttentionGrads, AttentionOutput};
use packshard_reference::Error;

use super::{brief, catch_panic, Failure, Outcome};
use crate::attention::{PaddedSegment, PaddingLeak, IMPL};
use crate::compare::Judge;
use crate::compare::{assert_close_with_scale, Mismatch, Tolerance};
use packshard_reference::ops::{AttentionOp, Grad, Qkv, Varlen};

mod case;
mod terms;

pub use case::{
    AttentionFuzzCase, FuzzOptions, Malformed, FORWARD_ONLY_PERIOD, FORWARD_ONLY_SLOTS, GQA_RATIOS,
    HEAD_DIMS, HEAD_DIM_CLASSES, LARGE_MAX_SHORT, LARGE_MAX_WORK, LARGE_SHORT_LEN, LONG_LEN,
    LONG_WORK, SHORT_WORK, SMALL_FORWARD_ONLY, SMALL_MAX_LEN, SMALL_MAX_SEGMENTS, SMALL_MAX_WORK,
};
pub use terms::{AttentionTerms, SegmentOptions};

/// The tolerance rule of the attention comparison, in words (see
/// [`AttentionTerms`]).
pub const ATTENTION_TERMS: &str = "|actual - expected| <= rel |expected| + abs T, T the largest running error bound (in ulp) of the tensor in its segment: the terms of every sum, each probability weighted by its own rounding";

/// Compares `actual` with `expected` (row-major `shape`) under `tol` with
/// the absolute floor relative to `terms`; returns the largest share of the
/// tolerance used.
fn close(
    what: &str,
    expected: &[f64],
    actual: &[f64],
    shape: &[usize],
    tol: Tolerance,
    terms: f64,
) -> Result<f64, Mismatch> {
    assert_close_with_scale(what, expected, actual, shape, tol, Some(terms))?;
    let scale = expected
        .iter()
        .filter(|v| v.is_finite())
        .fold(terms.max(1e-300), |m, v| m.max(v.abs()));
    Ok(expected
        .iter()
        .zip(actual)
        .filter(|(e, a)| e.is_finite() && a.is_finite())
        .map(|(e, a)| {
            let allowed = tol.allowed(*e, scale);
            let d = (a - e).abs();
            if d == 0.0 {
                0.0
            } else if allowed > 0.0 {
                d / allowed
            } else {
                f64::INFINITY
            }
        })
        .fold(0.0, f64::max))
}

fn rows(x: &Array3<f64>, r: Range<usize>) -> Vec<f64> {
    x.slice_axis(Axis(0), Slice::from(r))
        .iter()
        .copied()
        .collect()
}

fn lse_rows(x: &Array2<f64>, r: Range<usize>) -> Vec<f64> {
    x.slice_axis(Axis(1), Slice::from(r))
        .iter()
        .copied()
        .collect()
}

fn view(x: &Array3<f64>, a: usize, b: usize) -> ArrayView3<'_, f64> {
    x.slice_axis(Axis(0), Slice::from(a..b))
}

/// The terms of every segment of `c` (its own offsets).
fn segment_terms(c: &AttentionFuzzCase) -> Vec<AttentionTerms> {
    let (cu_q, cu_k) = (c.own_cu_q(), c.own_cu_k());
    (0..c.segments.len())
        .map(|s| {
            let (qa, qb, ka, kb) = (cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]);
            let o = &c.options;
            AttentionTerms::of_with(
                view(&c.q, qa, qb),
                view(&c.k, ka, kb),
                view(&c.v, ka, kb),
                view(&c.grad_output, qa, qb),
                (c.scale, c.causal),
                SegmentOptions {
                    window: o.window,
                    softcap: o.softcap,
                    alibi_slopes: o.alibi_slopes.as_deref(),
                    used_keys: o.seqused_k.as_ref().and_then(|u| u.get(s).copied()),
                },
            )
        })
        .collect()
}

/// The two sides' outcomes agree: both results, or errors of the same kind.
fn outcome<A, B>(
    what: &str,
    expected: Result<A, Error>,
    actual: Result<B, Error>,
    cu: (&[usize], &[usize]),
) -> Result<Option<(A, B)>, Mismatch> {
    match (expected, actual) {
        (Ok(e), Ok(a)) => Ok(Some((e, a))),
        (Err(e), Err(a)) if e.kind() == a.kind() => Ok(None),
        (Err(e), Err(a)) => Err(Mismatch::new(
            what,
            format!(
                "expected the error {e} ({}), got the error {a} ({})",
                e.kind(),
                a.kind()
            ),
        )),
        (Err(e), Ok(_)) => Err(Mismatch::new(
            what,
            format!(
                "cu_seqlens_q {} with cu_seqlens_k {} must be refused: expected the error {e} ({}), got a result",
                brief(cu.0),
                brief(cu.1),
                e.kind()
            ),
        )),
        (Ok(_), Err(a)) => Err(Mismatch::new(what, format!("unexpected error {a}"))),
    }
}

/// Each named tensor has the shape wanted.
fn check_shapes(what: &str, tensors: &[(&str, &[usize], Vec<usize>)]) -> Result<(), Mismatch> {
    for (name, shape, want) in tensors {
        if *shape != want.as_slice() {
            return Err(Mismatch::new(
                format!("{what}: {name}"),
                format!("shape {shape:?}, expected {want:?}"),
            ));
        }
    }
    Ok(())
}

/// `output: [n_q, h, d]`, `lse: [h, n_q]`.
fn output_shapes(
    what: &str,
    (n, h, d): (usize, usize, usize),
    f: &AttentionOutput,
) -> Result<(), Mismatch> {
    check_shapes(
        what,
        &[
            ("output", f.output.shape(), vec![n, h, d]),
            ("lse", f.lse.shape(), vec![h, n]),
        ],
    )
}

/// `grad_q: [n_q, h, d]`, `grad_k, grad_v: [n_k, h_kv, d]`.
fn grad_shapes(what: &str, q: &[usize], k: &[usize], g: &AttentionGrads) -> Result<(), Mismatch> {
    check_shapes(
        what,
        &[
            ("grad_q", g.grad_q.shape(), q.to_vec()),
            ("grad_k", g.grad_k.shape(), k.to_vec()),
            ("grad_v", g.grad_v.shape(), k.to_vec()),
        ],
    )
}

/// Runs `case` through `imp` and the reference and compares them (see the
/// module docs), then runs the packed == padded check on `imp`.
///
/// # Errors
/// The first difference: a tensor of a segment (`output (sequence 2)`),
/// the index within the segment, both values, the error figures and the
/// tolerance; an error where the reference gives a result or the reverse;
/// a panic.
pub fn check(
    imp: &dyn AttentionOp,
    tol: Tolerance,
    case: &AttentionFuzzCase,
) -> Result<Outcome, Mismatch> {
    let (c, narrowed) = case.within(imp.support());
    let (cu_q, cu_k) = (c.cu_seqlens_q(), c.cu_seqlens_k());
    let p = c
        .options
        .apply(Varlen::cross(&cu_q, &cu_k, c.causal, c.scale));
    let (q, k, v, go) = (c.q.view(), c.k.view(), c.v.view(), c.grad_output.view());
    let expected = varlen_attention_general(q, k, v, &p);
    let actual = catch_panic("varlen_forward", || {
        imp.varlen_forward(Qkv::new(q, k, v), &p)
    })?;
    let cus = (cu_q.as_slice(), cu_k.as_slice());
    let mark = |o: Outcome| Outcome {
        narrowed: usize::from(!narrowed.is_empty()),
        ..o
    };
    let Some((ef, af)) = outcome("varlen_forward", expected, actual, cus)? else {
        return Ok(mark(Outcome::errors_alike()));
    };
    output_shapes("varlen_forward", c.q.dim(), &af)?;
    let eg = varlen_attention_general_backward(q, k, v, &p, &ef, go);
    let ag = catch_panic("varlen_backward", || {
        imp.varlen_backward(Qkv::new(q, k, v), &p, Grad::new(&af, go))
    })?;
    let Some((eg, ag)) = outcome::<AttentionGrads, AttentionGrads>("varlen_backward", eg, ag, cus)?
    else {
        return Err(Mismatch::new(
            "varlen_backward",
            "both sides refused a case whose forward they accepted",
        ));
    };
    grad_shapes("varlen_backward", c.q.shape(), c.k.shape(), &ag)?;
    let terms = segment_terms(&c);
    let (values, worst) = compare_segments(tol, &c, &terms, (&ef, &eg), (&af, &ag))?;
    let (padded_values, padded_worst) = check_padded(imp, tol, &c, &terms, (&ef, &eg))?;
    check_no_leak(imp, &c, &p, &af)?;
    Ok(mark(Outcome::compared(
        values + padded_values,
        worst.max(padded_worst),
    )))
}

/// The padded row of a segment of `len` tokens: the longest segment plus
/// the case's extra slots in a small case (one row length for the batch, as
/// a padded batch has), the segment's own length plus them in a large one
/// (a 1,100-token row per short segment would cost more than the rest of
/// the check).
fn row_len(c: &AttentionFuzzCase, len: usize) -> usize {
    match c.class {
        super::schedule::SizeClass::Small => c.longest() + c.extra_pad,
        super::schedule::SizeClass::Large => len + c.extra_pad,
    }
}

/// The padded form (self-attention with `h_kv == h` only: the masked form
/// is one dense row per sequence): every segment alone in a row with the
/// block mask (padding queries and keys masked, docs/FAULTS.md P8; the
/// causal block when causal), through `imp`'s masked forward and backward.
/// Padding rows must be exactly 0 with `lse = -inf`; real rows must match
/// the reference's packed results under the same rule as the packed form.
fn check_padded(
    imp: &dyn AttentionOp,
    tol: Tolerance,
    c: &AttentionFuzzCase,
    terms: &[AttentionTerms],
    expected: (&AttentionOutput, &AttentionGrads),
) -> Result<(usize, f64), Mismatch> {
    let (h, h_kv, d) = c.heads();
    // The masked form carries none of flash-attention's options.
    if !c.is_self() || h_kv != h || c.options.any() {
        return Ok((0, 0.0));
    }
    let cu = c.own_cu_q();
    let mut values = 0;
    let mut worst = 0.0f64;
    for (s, w) in cu.windows(2).enumerate() {
        let (a, b) = (w[0], w[1]);
        let len = b - a;
        let l = row_len(c, len);
        let t = [&c.q, &c.k, &c.v, &c.grad_output];
        let padded = PaddedSegment::rows(t, c.scale, (a, len, l), c.causal);
        let err = |what: &str, e: Error| {
            Mismatch::new(
                what,
                format!("sequence {s} padded to {l}: unexpected error {e}"),
            )
        };
        let pf = catch_panic("masked_forward", || padded.forward(imp))?
            .map_err(|e| err("masked_forward", e))?;
        output_shapes("masked_forward", (l, h, d), &pf)?;
        let pgr = catch_panic("masked_backward", || padded.backward(imp, &pf))?
            .map_err(|e| err("masked_backward", e))?;
        grad_shapes("masked_backward", &[l, h, d], &[l, h, d], &pgr)?;
        // P8: a padding query has no allowed key: exactly 0, never NaN.
        match padded.leak(&pf, &pgr) {
            Some(PaddingLeak::Value {
                name,
                row: i,
                at: k,
                x,
            }) => {
                return Err(Mismatch::new(
                    format!("padded {name} (sequence {s})"),
                    format!(
                        "padding row {i} of {l} (no allowed key) holds {x:e} at [{}, {}]; it must be exactly 0, never NaN (docs/FAULTS.md P8)",
                        k / d,
                        k % d
                    ),
                ));
            }
            Some(PaddingLeak::Lse { row: i, head: j, x }) => {
                return Err(Mismatch::new(
                    format!("padded lse (sequence {s})"),
                    format!("padding row {i} head {j}: lse {x:e}, expected -inf (an empty softmax, docs/FAULTS.md P8)"),
                ));
            }
            None => {}
        }
        if len == 0 {
            continue;
        }
        let (v, w) = close_sequence(
            tol,
            &terms[s],
            ((len, h, d), (len, h_kv)),
            tensors(expected, a..b, a..b),
            tensors((&pf, &pgr), 0..len, 0..len),
            &|name| {
                format!("padded {name} (sequence {s} in a row of {l}, index [token, head, dim] within the sequence)")
            },
        )?;
        values += v;
        worst = worst.max(w);
    }
    Ok((values, worst))
}

/// The changed sequence's new values in [`check_no_leak`]: any change
/// serves (every other token is compared bit for bit), this one keeps them
/// finite and of the same scale (a fixed point only at `x = 0.25`).
fn perturbed(x: f64) -> f64 {
    1.0 - 3.0 * x
}

/// docs/FAULTS.md P2: changing the queries and keys of the first segment
/// that has either must leave every other query's packed output bit-for-bit
/// unchanged.
fn check_no_leak(
    imp: &dyn AttentionOp,
    c: &AttentionFuzzCase,
    p: &Varlen<'_>,
    before: &AttentionOutput,
) -> Result<(), Mismatch> {
    let (cu_q, cu_k) = (c.own_cu_q(), c.own_cu_k());
    let n = c.q.dim().0;
    let Some(s) = c.segments.iter().position(|&(q, k)| q + k > 0) else {
        return Ok(());
    };
    let change = |t: &Array3<f64>, r: Range<usize>| {
        let mut t = t.clone();
        t.slice_axis_mut(Axis(0), Slice::from(r))
            .mapv_inplace(perturbed);
        t
    };
    let (a, b) = (cu_q[s], cu_q[s + 1]);
    let keys = cu_k[s]..cu_k[s + 1];
    let q2 = change(&c.q, a..b);
    let (k2, v2) = (change(&c.k, keys.clone()), change(&c.v, keys));
    let after = catch_panic("varlen_forward", || {
        imp.varlen_forward(Qkv::new(q2.view(), k2.view(), v2.view()), p)
    })?
    .map_err(|e| Mismatch::new("varlen_forward", format!("unexpected error {e}")))?;
    for i in (0..a).chain(b..n) {
        let (x, y) = (
            before.output.index_axis(Axis(0), i),
            after.output.index_axis(Axis(0), i),
        );
        if x != y {
            let t = cu_q.partition_point(|&c| c <= i) - 1;
            return Err(Mismatch::new(
                "cross-sequence leak",
                format!(
                    "changing sequence {s} (tokens {a}..{b}) changed the output of token {i} (sequence {t}) from {:?} to {:?} (docs/FAULTS.md P2)",
                    x.iter().take(4).collect::<Vec<_>>(),
                    y.iter().take(4).collect::<Vec<_>>()
                ),
            ));
        }
    }
    Ok(())
}

/// `output, lse, grad_q` of queries `qr` and `grad_k, grad_v` of keys `kr`, flat.
fn tensors(
    (f, g): (&AttentionOutput, &AttentionGrads),
    qr: Range<usize>,
    kr: Range<usize>,
) -> [Vec<f64>; 5] {
    [
        rows(&f.output, qr.clone()),
        lse_rows(&f.lse, qr.clone()),
        rows(&g.grad_q, qr),
        rows(&g.grad_k, kr.clone()),
        rows(&g.grad_v, kr),
    ]
}

/// Compares every segment's outputs; returns the values compared and the
/// largest share of the tolerance used.
fn compare_segments(
    tol: Tolerance,
    c: &AttentionFuzzCase,
    terms: &[AttentionTerms],
    expected: (&AttentionOutput, &AttentionGrads),
    actual: (&AttentionOutput, &AttentionGrads),
) -> Result<(usize, f64), Mismatch> {
    let (h, h_kv, d) = c.heads();
    let (cu_q, cu_k) = (c.own_cu_q(), c.own_cu_k());
    let mut values = 0;
    let mut worst = 0.0f64;
    for (s, &(lq, lk)) in c.segments.iter().enumerate() {
        if lq + lk == 0 {
            continue;
        }
        let (qr, kr) = (cu_q[s]..cu_q[s + 1], cu_k[s]..cu_k[s + 1]);
        let where_ = if c.is_self() {
            format!("sequence {s}, tokens {}..{}", qr.start, qr.end)
        } else {
            format!(
                "sequence {s}, queries {}..{} over keys {}..{}",
                qr.start, qr.end, kr.start, kr.end
            )
        };
        let (v, w) = close_sequence(
            tol,
            &terms[s],
            ((lq, h, d), (lk, h_kv)),
            tensors(expected, qr.clone(), kr.clone()),
            tensors(actual, qr, kr),
            &|name| format!("{name} ({where_}, index [token, head, dim] within the sequence)"),
        )?;
        values += v;
        worst = worst.max(w);
    }
    Ok((values, worst))
}

/// Compares one sequence's five tensors (`l_q` queries, `l_k` keys), each
/// under the magnitude of its terms, named by `what(tensor)`; returns the
/// values compared and the largest share of the tolerance used.
fn close_sequence(
    tol: Tolerance,
    terms: &AttentionTerms,
    ((lq, h, d), (lk, h_kv)): ((usize, usize, usize), (usize, usize)),
    expected: [Vec<f64>; 5],
    actual: [Vec<f64>; 5],
    what: &dyn Fn(&str) -> String,
) -> Result<(usize, f64), Mismatch> {
    let (qs, ks) = ([lq, h, d], [lk, h_kv, d]);
    let checks: [(&str, &[usize], f64); 5] = [
        ("output", &qs, terms.output),
        ("lse", &[h, lq], terms.lse),
        ("grad_q", &qs, terms.grad_q),
        ("grad_k", &ks, terms.grad_k),
        ("grad_v", &ks, terms.grad_v),
    ];
    let (mut values, mut worst) = (0, 0.0f64);
    for (((name, shape, t), e), x) in checks.into_iter().zip(expected).zip(actual) {
        let used = close(&what(name), &e, &x, shape, tol, t).map_err(|m| {
            Mismatch::new(
                m.what,
                format!("{}; terms magnitude {t:e} (the rule: packshard_equivalence::fuzz::attention::AttentionTerms)", m.detail),
            )
        })?;
        worst = worst.max(used);
        values += e.len();
    }
    Ok((values, worst))
}

/// The fuzz body: `data` as an [`AttentionFuzzCase`], checked with
/// [`check`] under the tolerance of `judge` (a registry entry's
/// `fuzz_judge`: [`Tolerance::F64_REWRITE`] for an f64 implementation).
///
/// # Errors
/// A [`Failure`] describing the case and the first mismatch.
pub fn run(imp: &dyn AttentionOp, judge: Judge, data: &[u8]) -> Result<Outcome, Failure> {
    let Ok(case) = AttentionFuzzCase::from_bytes(data) else {
        return Ok(Outcome::default());
    };
    check(imp, judge.packed(), &case)
        .map_err(|m| Failure::new("attention", IMPL, case.describe(), m))
}
