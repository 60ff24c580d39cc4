//! Varlen attention, forward and backward, against the f64 reference on
//! arbitrary cases (docs/FAULTS.md P2, P4, P8).
//!
//! A case ([`AttentionFuzzCase`]) has 1 to [`MAX_SEGMENTS`] segments of 0 to
//! [`MAX_SEGMENT_LEN`] tokens (empty ones included, at most [`MAX_TOKENS`] in
//! all), 1 to [`MAX_HEADS`] heads of dimension 1 to [`MAX_HEAD_DIM`], a softmax
//! scale (mostly `1/sqrt(d)`), values in a style the bytes choose (uniform,
//! a grid with exact ties, one constant value), outliers x 8, planted extremes
//! (`±30`, `±100`, `0`), and in one case of about 16 a malformed
//! `cu_seqlens` (not starting at 0, decreasing, not ending at `n_tok`, empty)
//! that must be an error of the reference's kind, never a result or a panic.
//!
//! [`check`] runs the implementation's packed forward and backward (the
//! backward from its own forward, as training does) and the reference's,
//! and compares every segment's `output`, `lse`, `grad_q`, `grad_k`,
//! `grad_v` under the caller's [`Tolerance`] scaled by the magnitude of the
//! terms ([`ATTENTION_TERMS`]). Then the padded form: every segment alone in
//! a row with planted garbage in the padding slots, through the
//! implementation's masked forward and backward: padding rows exactly 0 with
//! `lse = -inf` (P8), real rows equal to the reference's packed results
//! under the same rule (packed == padded, P4 for empty segments). Last, a
//! change to one sequence must leave every other token's packed output
//! bit-for-bit unchanged (P2).

use arbitrary::{Arbitrary, Unstructured};
use ndarray::{Array3, ArrayView3, Axis, Slice};
use packshard_reference::bert::attention::{varlen_attention, varlen_attention_backward};
use packshard_reference::bert::{AttentionGrads, AttentionOutput};
use packshard_reference::Error;

use super::values::{plants, Gen};
use super::{brief, catch_panic, Failure, Outcome};
use crate::attention::{AttentionCase, PaddedSegment, PaddingLeak, IMPL};
use crate::compare::Judge;
use crate::compare::{assert_close_with_scale, Mismatch, Tolerance};
use packshard_reference::ops::{AttentionOp, Grad, Qkv, Varlen};

/// Most segments in a case.
pub const MAX_SEGMENTS: usize = 8;
/// Most tokens in a segment.
pub const MAX_SEGMENT_LEN: usize = 12;
/// Most tokens in a case (`n_tok`).
pub const MAX_TOKENS: usize = 48;
/// Most heads.
pub const MAX_HEADS: usize = 4;
/// Largest head dimension.
pub const MAX_HEAD_DIM: usize = 8;

/// The tolerance rule of the attention comparison, in words (see
/// [`AttentionTerms`]).
pub const ATTENTION_TERMS: &str = "|actual - expected| <= rel |expected| + abs T, T the largest running error bound (in ulp) of the tensor in its segment: the terms of every sum, each probability weighted by its own rounding";

/// The magnitude of the terms of each attention output of one segment: a
/// running error bound, in units of the f64 epsilon, of the softmax
/// attention computed from the segment's inputs (its largest element per
/// tensor). A tolerance `64 x eps x T` (the project's 64 ulp of the terms)
/// then holds any f64 implementation that rounds differently — another
/// summation order, the scale applied before or after the dot product, an
/// online softmax — and nothing that computes something else.
///
/// Per query `i` (one head), with `a_j = |scale| d sum_c |q_ic k_jc|` the
/// rounding of score `s_j`, `m` the row maximum, `l` its `lse` and `p_j` the
/// probabilities:
///
/// - a probability carries a relative error of `r_j = a_j + max_k a_k + |l|
///   + |s_j - l| + L + 3` ulp: its score's rounding and the maximum's, `lse`
///   rounded relative to its own size and the `L` terms of its sum, and the
///   subtraction in `exp(s_j - lse)` — the form flash-attention and the
///   reference use, in which nothing renormalises the probabilities, so a
///   score of 5000 really does move them by thousands of ulp;
///   `b_j = p_j r_j`;
/// - `output_c`: `sum_j ((L + 1) p_j + b_j) |v_jc|`;
/// - `lse`: `|l| + max_k a_k + L`;
/// - `dS_j = p_j (dO.v_j - D)`, with `D = dO.O`: `b_j |dO.v_j - D| + p_j (d
///   sum_c |dO_c v_jc| + D's terms + (L + 1) |dO.v_j - D|)`;
/// - `grad_q_c = scale sum_j dS_j k_jc`: `|scale| sum_j (dS_j's terms)
///   |k_jc|`; `grad_k` the same with `|q_ic|` summed over queries;
///   `grad_v_jc`: `sum_i ((L + 1) p_ij + b_ij) |dO_ic|`.
///
/// Empty segments have no terms (and no rows).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct AttentionTerms {
    /// Of `output: [L, h, d]`.
    pub output: f64,
    /// Of `lse: [h, L]`.
    pub lse: f64,
    /// Of `grad_q: [L, h, d]`.
    pub grad_q: f64,
    /// Of `grad_k: [L, h, d]`.
    pub grad_k: f64,
    /// Of `grad_v: [L, h, d]`.
    pub grad_v: f64,
}

impl AttentionTerms {
    /// The terms of one segment: `q, k, v, grad_output: [L, h, d]`, keys after
    /// the query masked when `causal`.
    pub fn of(
        q: ArrayView3<f64>,
        k: ArrayView3<f64>,
        v: ArrayView3<f64>,
        grad_output: ArrayView3<f64>,
        scale: f64,
        causal: bool,
    ) -> Self {
        let (len, h, d) = q.dim();
        let (c, df, lf) = (scale.abs(), d as f64, len as f64);
        let mut t = AttentionTerms::default();
        let mut gk = Array3::<f64>::zeros((len, h, d));
        let mut gv = Array3::<f64>::zeros((len, h, d));
        for head in 0..h {
            for i in 0..len {
                let keys = if causal { i + 1 } else { len };
                let dot = |x: &ArrayView3<f64>, y: &ArrayView3<f64>, j: usize, abs: bool| {
                    (0..d)
                        .map(|x_| {
                            let v = x[[i, head, x_]] * y[[j, head, x_]];
                            if abs {
                                v.abs()
                            } else {
                                v
                            }
                        })
                        .sum::<f64>()
                };
                let s: Vec<f64> = (0..keys).map(|j| scale * dot(&q, &k, j, false)).collect();
                let a: Vec<f64> = (0..keys).map(|j| c * df * dot(&q, &k, j, true)).collect();
                let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                let l: f64 = e.iter().sum();
                let p: Vec<f64> = e.iter().map(|x| x / l).collect();
                let lse = m + l.ln();
                let max_a = a.iter().copied().fold(0.0, f64::max);
                let b: Vec<f64> = (0..keys)
                    .map(|j| p[j] * (a[j] + max_a + lse.abs() + (s[j] - lse).abs() + lf + 3.0))
                    .collect();
                t.lse = t.lse.max(lse.abs() + max_a + lf);
                let mut o = vec![0.0; d];
                let mut o_terms = vec![0.0; d];
                for x in 0..d {
                    for j in 0..keys {
                        o[x] += p[j] * v[[j, head, x]];
                        o_terms[x] += ((lf + 1.0) * p[j] + b[j]) * v[[j, head, x]].abs();
                    }
                    t.output = t.output.max(o_terms[x]);
                }
                let go = |x: usize| grad_output[[i, head, x]];
                let dd: f64 = (0..d).map(|x| go(x) * o[x]).sum();
                let dd_terms: f64 = (0..d)
                    .map(|x| df * (go(x) * o[x]).abs() + go(x).abs() * o_terms[x])
                    .sum();
                let mut gq = vec![0.0; d];
                for j in 0..keys {
                    let dp: f64 = (0..d).map(|x| go(x) * v[[j, head, x]]).sum();
                    let dp_terms: f64 = (0..d).map(|x| df * (go(x) * v[[j, head, x]]).abs()).sum();
                    let diff = (dp - dd).abs();
                    let ds = b[j] * diff + p[j] * (dp_terms + dd_terms + (lf + 1.0) * diff);
                    for x in 0..d {
                        gq[x] += c * ds * k[[j, head, x]].abs();
                        gk[[j, head, x]] += c * ds * q[[i, head, x]].abs();
                        gv[[j, head, x]] += ((lf + 1.0) * p[j] + b[j]) * go(x).abs();
                    }
                }
                t.grad_q = gq.iter().fold(t.grad_q, |m, x| m.max(*x));
            }
        }
        t.grad_k = gk.iter().fold(0.0, |m, x| m.max(*x));
        t.grad_v = gv.iter().fold(0.0, |m, x| m.max(*x));
        t
    }
}

/// One arbitrary attention case: the case (lengths, shapes, values) and the
/// `cu_seqlens` handed to the implementation.
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionFuzzCase {
    /// Lengths, padded row length, scale and the tensors.
    pub case: AttentionCase,
    /// The case's own `cu_seqlens`, or (about one case in 16) a malformed one.
    pub cu_seqlens: Vec<usize>,
    /// How the values were drawn and what was planted, for reports.
    pub values: String,
}

impl AttentionFuzzCase {
    /// The case `data` describes (every byte string describes one).
    ///
    /// # Errors
    /// Never in practice: bytes that run out read as zeros.
    pub fn from_bytes(data: &[u8]) -> arbitrary::Result<Self> {
        Self::arbitrary(&mut Unstructured::new(data))
    }

    /// Whether `cu_seqlens` is the case's own (well-formed).
    pub fn well_formed(&self) -> bool {
        self.cu_seqlens == self.case.cu_seqlens()
    }

    /// A one-line description for failure reports.
    pub fn describe(&self) -> String {
        let (n, h, d) = self.case.q.dim();
        let cu = if self.well_formed() {
            format!("cu_seqlens {}", brief(&self.cu_seqlens))
        } else {
            format!(
                "malformed cu_seqlens {} (lengths say {})",
                brief(&self.cu_seqlens),
                brief(&self.case.cu_seqlens())
            )
        };
        format!(
            "lengths {} ({cu}), n_tok {n}, h {h}, d {d}, scale {:e}, padded rows of {}; {}",
            brief(&self.case.lengths),
            self.case.scale,
            self.case.row_len,
            self.values
        )
    }
}

impl<'a> Arbitrary<'a> for AttentionFuzzCase {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        // Sizes first.
        let b = u.int_in_range(1..=MAX_SEGMENTS)?;
        let mut lengths = Vec::with_capacity(b);
        let mut total = 0;
        for _ in 0..b {
            let l = match u.arbitrary::<u8>()? % 8 {
                0 => 0,
                1 => 1,
                _ => u.int_in_range(1..=MAX_SEGMENT_LEN)?,
            };
            let l = l.min(MAX_TOKENS - total);
            total += l;
            lengths.push(l);
        }
        let h = u.int_in_range(1..=MAX_HEADS)?;
        let d = u.int_in_range(1..=MAX_HEAD_DIM)?;
        let extra_pad = u.int_in_range(0..=3)?;
        let scale = match u.arbitrary::<u8>()? % 16 {
            0 => 1.0,
            1 => 0.125,
            2 => 2.0,
            3 => 0.01,
            _ => 1.0 / (d as f64).sqrt(),
        };
        // Then values.
        let mut gen = Gen::arbitrary(u)?;
        let mut tensor = || Array3::from_shape_fn((total, h, d), |_| gen.value(2.0));
        let mut t = [tensor(), tensor(), tensor(), tensor()];
        let mut planted = Vec::new();
        if total > 0 {
            for (at, choice) in plants(u, 4)? {
                let which = choice as usize % 4;
                let x = [100.0, -100.0, 30.0, -30.0, 0.0][(choice as usize / 4) % 5];
                let flat = at % (total * h * d);
                let idx = (flat / (h * d), (flat / d) % h, flat % d);
                t[which][idx] = x;
                planted.push(format!(
                    "{}[{}, {}, {}] = {x}",
                    ["q", "k", "v", "grad_output"][which],
                    idx.0,
                    idx.1,
                    idx.2
                ));
            }
        }
        let [q, k, v, grad_output] = t;
        let case = AttentionCase {
            row_len: lengths.iter().copied().max().unwrap_or(0) + extra_pad,
            lengths,
            scale,
            q,
            k,
            v,
            grad_output,
        };
        let mut cu = case.cu_seqlens();
        if u.arbitrary::<u8>()? % 16 == 15 {
            match u.arbitrary::<u8>()? % 4 {
                0 => cu[0] = 1,
                1 => {
                    // A decrease: the first rise, lowered below its predecessor.
                    if let Some(i) = (1..cu.len()).find(|&i| cu[i] > cu[i - 1]) {
                        if i + 1 < cu.len() {
                            cu[i] = cu[i + 1] + 1;
                        } else {
                            cu.push(0);
                        }
                    } else {
                        cu.push(total + 1);
                    }
                }
                2 => *cu.last_mut().expect("cu_seqlens holds [0] at least") += 1,
                _ => cu.clear(),
            }
        }
        let mut values = gen.describe();
        if !planted.is_empty() {
            values.push_str(&format!("; planted {}", planted.join(", ")));
        }
        Ok(AttentionFuzzCase {
            case,
            cu_seqlens: cu,
            values,
        })
    }
}

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
            let allowed = tol.rel * e.abs() + tol.abs * scale;
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

fn rows(x: &Array3<f64>, a: usize, b: usize) -> ArrayView3<'_, f64> {
    x.slice_axis(Axis(0), Slice::from(a..b))
}

/// The terms of tokens `a..b` of `c` (one segment, bidirectional).
fn segment_terms(c: &AttentionCase, a: usize, b: usize) -> AttentionTerms {
    let r = |x| rows(x, a, b);
    AttentionTerms::of(r(&c.q), r(&c.k), r(&c.v), r(&c.grad_output), c.scale, false)
}

fn flat(x: ArrayView3<f64>) -> Vec<f64> {
    x.iter().copied().collect()
}

/// The two sides' outcomes agree: both results, or errors of the same kind.
fn outcome<A, B>(
    what: &str,
    expected: Result<A, Error>,
    actual: Result<B, Error>,
    cu: &[usize],
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
                "cu_seqlens {} must be refused: expected the error {e} ({}), got a result",
                brief(cu),
                e.kind()
            ),
        )),
        (Ok(_), Err(a)) => Err(Mismatch::new(what, format!("unexpected error {a}"))),
    }
}

/// `f`'s shapes: `output: [n, h, d]`, `lse: [h, n]`.
fn output_shapes(
    what: &str,
    dim: (usize, usize, usize),
    f: &AttentionOutput,
) -> Result<(), Mismatch> {
    let tensors = [("output", f.output.shape()), ("lse", f.lse.shape())];
    check_shapes(what, dim, &tensors)
}

/// `g`'s shapes: `grad_q, grad_k, grad_v: [n, h, d]`.
fn grad_shapes(what: &str, dim: (usize, usize, usize), g: &AttentionGrads) -> Result<(), Mismatch> {
    let tensors = [
        ("grad_q", g.grad_q.shape()),
        ("grad_k", g.grad_k.shape()),
        ("grad_v", g.grad_v.shape()),
    ];
    check_shapes(what, dim, &tensors)
}

fn check_shapes(
    what: &str,
    (n, h, d): (usize, usize, usize),
    tensors: &[(&str, &[usize])],
) -> Result<(), Mismatch> {
    for (name, shape) in tensors {
        let want: Vec<usize> = if *name == "lse" {
            vec![h, n]
        } else {
            vec![n, h, d]
        };
        if *shape != want.as_slice() {
            return Err(Mismatch::new(
                format!("{what}: {name}"),
                format!("shape {shape:?}, expected {want:?}"),
            ));
        }
    }
    Ok(())
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
    let c = &case.case;
    let cu = &case.cu_seqlens;
    let (n, h, d) = c.q.dim();
    let (q, k, v, go) = (c.q.view(), c.k.view(), c.v.view(), c.grad_output.view());
    let expected = varlen_attention(q, k, v, cu, false, c.scale);
    let actual = catch_panic("varlen_forward", || {
        imp.varlen_forward(Qkv::new(q, k, v), &Varlen::new(cu, false, c.scale))
    })?;
    let Some((ef, af)) = outcome("varlen_forward", expected, actual, cu)? else {
        return Ok(Outcome::errors_alike());
    };
    output_shapes("varlen_forward", (n, h, d), &af)?;
    let eg = varlen_attention_backward(q, k, v, cu, false, c.scale, &ef, go);
    let ag = catch_panic("varlen_backward", || {
        imp.varlen_backward(
            Qkv::new(q, k, v),
            &Varlen::new(cu, false, c.scale),
            Grad::new(&af, go),
        )
    })?;
    let Some((eg, ag)) = outcome::<AttentionGrads, AttentionGrads>("varlen_backward", eg, ag, cu)?
    else {
        return Err(Mismatch::new(
            "varlen_backward",
            "both sides refused a case whose forward they accepted",
        ));
    };
    grad_shapes("varlen_backward", (n, h, d), &ag)?;
    let (values, worst) = compare_segments(tol, c, cu, (&ef, &eg), (&af, &ag))?;
    let (padded_values, padded_worst) = check_padded(imp, tol, c, (&ef, &eg))?;
    check_no_leak(imp, c, &af)?;
    Ok(Outcome::compared(
        values + padded_values,
        worst.max(padded_worst),
    ))
}

/// The padded form: every segment alone in a row of `row_len` with the
/// block mask (padding queries and keys masked, docs/FAULTS.md P8), through
/// `imp`'s masked forward and backward. Padding rows must be exactly 0 with
/// `lse = -inf`; real rows must match the reference's packed results under
/// the same rule as the packed form.
fn check_padded(
    imp: &dyn AttentionOp,
    tol: Tolerance,
    c: &AttentionCase,
    expected: (&AttentionOutput, &AttentionGrads),
) -> Result<(usize, f64), Mismatch> {
    let cu = c.cu_seqlens();
    let (_, h, d) = c.q.dim();
    let l = c.row_len;
    let mut values = 0;
    let mut worst = 0.0f64;
    for (s, w) in cu.windows(2).enumerate() {
        let (a, b) = (w[0], w[1]);
        let len = b - a;
        let padded = PaddedSegment::of(c, a, len);
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
        grad_shapes("masked_backward", (l, h, d), &pgr)?;
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
        let terms = segment_terms(c, a, b);
        let mine = |x: &Array3<f64>| flat(rows(x, 0, len));
        let theirs = |x: &Array3<f64>| flat(rows(x, a, b));
        let lse = |from: usize| {
            move |x: &ndarray::Array2<f64>| -> Vec<f64> {
                x.slice_axis(Axis(1), Slice::from(from..from + len))
                    .iter()
                    .copied()
                    .collect()
            }
        };
        let (lse_a, lse_0) = (lse(a), lse(0));
        let (v, w) = close_sequence(
            tol,
            &terms,
            (len, h, d),
            Side(expected.0, expected.1, &theirs, &lse_a),
            Side(&pf, &pgr, &mine, &lse_0),
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

/// docs/FAULTS.md P2: changing the tokens of the first non-empty sequence must
/// leave every other token's packed output bit-for-bit unchanged.
fn check_no_leak(
    imp: &dyn AttentionOp,
    c: &AttentionCase,
    before: &AttentionOutput,
) -> Result<(), Mismatch> {
    let cu = c.cu_seqlens();
    let n = c.q.dim().0;
    let Some(s) = c.lengths.iter().position(|&l| l > 0) else {
        return Ok(());
    };
    let (a, b) = (cu[s], cu[s + 1]);
    let [q2, k2, v2] = [&c.q, &c.k, &c.v].map(|t| {
        let mut t = t.clone();
        t.slice_axis_mut(Axis(0), Slice::from(a..b))
            .mapv_inplace(perturbed);
        t
    });
    let after = catch_panic("varlen_forward", || {
        imp.varlen_forward(
            Qkv::new(q2.view(), k2.view(), v2.view()),
            &Varlen::new(&cu, false, c.scale),
        )
    })?
    .map_err(|e| Mismatch::new("varlen_forward", format!("unexpected error {e}")))?;
    for i in (0..a).chain(b..n) {
        let (x, y) = (
            before.output.index_axis(Axis(0), i),
            after.output.index_axis(Axis(0), i),
        );
        if x != y {
            let t = cu.partition_point(|&c| c <= i) - 1;
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

/// Compares every segment's outputs; returns the values compared and the
/// largest share of the tolerance used.
fn compare_segments(
    tol: Tolerance,
    c: &AttentionCase,
    cu: &[usize],
    expected: (&AttentionOutput, &AttentionGrads),
    actual: (&AttentionOutput, &AttentionGrads),
) -> Result<(usize, f64), Mismatch> {
    let (_, h, d) = c.q.dim();
    let mut values = 0;
    let mut worst = 0.0f64;
    for (s, w) in cu.windows(2).enumerate() {
        let (a, b) = (w[0], w[1]);
        let len = b - a;
        if len == 0 {
            continue;
        }
        let terms = segment_terms(c, a, b);
        let seg = |x: &Array3<f64>| flat(rows(x, a, b));
        let lse = |x: &ndarray::Array2<f64>| -> Vec<f64> {
            x.slice_axis(Axis(1), Slice::from(a..b))
                .iter()
                .copied()
                .collect()
        };
        let (v, w) = close_sequence(
            tol,
            &terms,
            (len, h, d),
            Side(expected.0, expected.1, &seg, &lse),
            Side(actual.0, actual.1, &seg, &lse),
            &|name| {
                format!("{name} (sequence {s}, tokens {a}..{b}, index [token, head, dim] within the sequence)")
            },
        )?;
        values += v;
        worst = worst.max(w);
    }
    Ok((values, worst))
}

/// One side of a comparison: a forward and a backward, and how to take the
/// sequence's rows of a `[n, h, d]` tensor and of `lse: [h, n]`.
struct Side<'a>(
    &'a AttentionOutput,
    &'a AttentionGrads,
    &'a dyn Fn(&Array3<f64>) -> Vec<f64>,
    &'a dyn Fn(&ndarray::Array2<f64>) -> Vec<f64>,
);

impl Side<'_> {
    /// `output, lse, grad_q, grad_k, grad_v` of the sequence, flat.
    fn tensors(&self) -> [Vec<f64>; 5] {
        let (f, g, rows, lse) = (self.0, self.1, self.2, self.3);
        [
            rows(&f.output),
            lse(&f.lse),
            rows(&g.grad_q),
            rows(&g.grad_k),
            rows(&g.grad_v),
        ]
    }
}

/// Compares one sequence's five tensors (`len` tokens), each under the
/// magnitude of its terms, named by `what(tensor)`; returns the values
/// compared and the largest share of the tolerance used.
fn close_sequence(
    tol: Tolerance,
    terms: &AttentionTerms,
    (len, h, d): (usize, usize, usize),
    expected: Side<'_>,
    actual: Side<'_>,
    what: &dyn Fn(&str) -> String,
) -> Result<(usize, f64), Mismatch> {
    let shape = [len, h, d];
    let checks: [(&str, &[usize], f64); 5] = [
        ("output", &shape, terms.output),
        ("lse", &[h, len], terms.lse),
        ("grad_q", &shape, terms.grad_q),
        ("grad_k", &shape, terms.grad_k),
        ("grad_v", &shape, terms.grad_v),
    ];
    let (mut values, mut worst) = (0, 0.0f64);
    for (((name, shape, t), e), x) in checks
        .into_iter()
        .zip(expected.tensors())
        .zip(actual.tensors())
    {
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
