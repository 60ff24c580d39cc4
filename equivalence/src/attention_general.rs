//! Attention beyond bidirectional self-attention with `h_kv == h`: causal
//! masks, grouped-query attention (`h_kv` dividing `h`, query head `a`
//! reading key head `a / (h / h_kv)`) and `cu_seqlens_k != cu_seqlens_q`
//! (a continuation chunk over cached keys, bottom-right causal alignment:
//! docs/FAULTS.md C5), for the implementations that declare them
//! ([`AttentionOp::support`]). [`check_general`] runs a case and requires:
//!
//! - **packed == unpacked**: every segment's `output`, `lse`, `grad_q`,
//!   `grad_k` and `grad_v` in the packed call equal those of the segment
//!   run alone (within the judge's `packed` tolerance);
//! - **no key, no value**: a query that sees no key (the top `l_q - l_k`
//!   rows of a causal segment with more queries than keys, every query of a
//!   segment without keys) has output 0, `lse = -inf` and a zero `grad_q`,
//!   never NaN (P8);
//! - **against the f64 reference** (`reference::attention`'s
//!   `varlen_attention_general`): within the judge's tolerance for a
//!   rewrite, or for a lower-precision kernel within its [`RelativeRule`]
//!   of the same computation in f32 ([`baseline32::varlen_attention_general`]).
//!
//! Packed == unpacked alone cannot see a kernel that maps query heads to the
//! wrong key heads, or aligns the causal mask top-left: both are consistent
//! between the two forms. The reference comparison sees them.

use ndarray::{Array3, ArrayView3, Axis, Slice};
use packshard_reference::attention::{
    varlen_pass, AttentionGrads, AttentionOutput, ReferenceAttention,
};
use packshard_reference::ops::{AttentionOp, AttentionSupport, Grad, Qkv, Varlen};
use packshard_reference::Error;
use proptest::prelude::*;
use rand::{Rng, SeedableRng};

use crate::attention::report::{check_forward_shapes, Observed, RelativeReport, IMPL};
use crate::baseline32::Baseline32Attention;
use crate::compare::{assert_close_with_scale, assert_within_k, Allowance, Judge, Mismatch};

/// One problem: segments of `(queries, keys)`, heads, and the tensors.
#[derive(Debug, Clone, PartialEq)]
pub struct GeneralCase {
    /// `(l_q, l_k)` of each segment (either may be 0).
    pub segments: Vec<(usize, usize)>,
    /// Bottom-right causal masks.
    pub causal: bool,
    /// Softmax scale.
    pub scale: f64,
    /// `[n_q, h, d]`.
    pub q: Array3<f64>,
    /// `[n_k, h_kv, d]`.
    pub k: Array3<f64>,
    /// `[n_k, h_kv, d]`.
    pub v: Array3<f64>,
    /// `[n_q, h, d]`.
    pub grad_output: Array3<f64>,
}

impl GeneralCase {
    /// A case with values uniform in [-2, 2] from `seed`.
    pub fn seeded(
        segments: &[(usize, usize)],
        (h, h_kv, d): (usize, usize, usize),
        causal: bool,
        seed: u64,
    ) -> Self {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let n_q: usize = segments.iter().map(|s| s.0).sum();
        let n_k: usize = segments.iter().map(|s| s.1).sum();
        let mut gen = |shape: (usize, usize, usize)| {
            Array3::from_shape_fn(shape, |_| 4.0 * rng.random::<f64>() - 2.0)
        };
        GeneralCase {
            segments: segments.to_vec(),
            causal,
            scale: 1.0 / (d as f64).sqrt(),
            q: gen((n_q, h, d)),
            k: gen((n_k, h_kv, d)),
            v: gen((n_k, h_kv, d)),
            grad_output: gen((n_q, h, d)),
        }
    }

    /// `cu_seqlens_q: [b + 1]`.
    pub fn cu_q(&self) -> Vec<usize> {
        crate::cu_seqlens_of(self.segments.iter().map(|s| s.0))
    }

    /// `cu_seqlens_k: [b + 1]`.
    pub fn cu_k(&self) -> Vec<usize> {
        crate::cu_seqlens_of(self.segments.iter().map(|s| s.1))
    }

    /// Whether it has grouped-query heads, other key offsets.
    pub fn kinds(&self) -> (bool, bool) {
        let gqa = self.k.dim().1 != self.q.dim().1;
        (gqa, self.segments.iter().any(|&(q, k)| q != k))
    }

    fn rounded(&self, round: fn(f64) -> f64) -> Self {
        GeneralCase {
            q: self.q.mapv(round),
            k: self.k.mapv(round),
            v: self.v.mapv(round),
            grad_output: self.grad_output.mapv(round),
            ..self.clone()
        }
    }
}

fn flat(x: ArrayView3<f64>) -> Vec<f64> {
    x.iter().copied().collect()
}

/// `imp`'s forward and backward on `q, k, v` over `(cu_q, cu_k)`.
fn run(
    imp: &dyn AttentionOp,
    (q, k, v, g): (
        ArrayView3<f64>,
        ArrayView3<f64>,
        ArrayView3<f64>,
        ArrayView3<f64>,
    ),
    p: &Varlen<'_>,
) -> Result<(AttentionOutput, AttentionGrads), Mismatch> {
    let err = |what: &str, e: Error| Mismatch::new(what, format!("{IMPL}: {e}"));
    let fwd = imp
        .varlen_forward(Qkv::new(q, k, v), p)
        .map_err(|e| err("varlen_forward", e))?;
    check_forward_shapes(&fwd, q.dim())?;
    let grads = imp
        .varlen_backward(Qkv::new(q, k, v), p, Grad::new(&fwd, g))
        .map_err(|e| err("varlen_backward", e))?;
    if grads.grad_q.dim() != q.dim() || grads.grad_k.dim() != k.dim() {
        return Err(Mismatch::new(
            "varlen_backward",
            format!(
                "grad_q {:?} and grad_k {:?}, expected {:?} and {:?}",
                grads.grad_q.shape(),
                grads.grad_k.shape(),
                q.shape(),
                k.shape()
            ),
        ));
    }
    Ok((fwd, grads))
}

/// The packed call against each segment alone, and the rows without a key.
fn check_packed(
    imp: &dyn AttentionOp,
    c: &GeneralCase,
    (fwd, grads): (&AttentionOutput, &AttentionGrads),
    judge: Judge,
) -> Result<Observed, Mismatch> {
    let (cu_q, cu_k) = (c.cu_q(), c.cu_k());
    let h = c.q.dim().1;
    let mut seen = Observed::default();
    for (s, &(lq, lk)) in c.segments.iter().enumerate() {
        let (qs, ks) = (cu_q[s]..cu_q[s + 1], cu_k[s]..cu_k[s + 1]);
        // Rows that see no key: bottom-right, query r sees keys c <= r + lk - lq.
        let blind = if lk == 0 {
            lq
        } else if c.causal {
            lq.saturating_sub(lk)
        } else {
            0
        };
        for r in 0..blind {
            let i = qs.start + r;
            let out = fwd.output.index_axis(Axis(0), i);
            let gq = grads.grad_q.index_axis(Axis(0), i);
            let lse_ok = (0..h).all(|a| fwd.lse[[a, i]] == f64::NEG_INFINITY);
            if out.iter().chain(gq.iter()).any(|&x| x != 0.0) || !lse_ok {
                return Err(Mismatch::new(
                    format!("segment {s}: query {r} of {lq} over {lk} keys"),
                    "sees no key (bottom-right causal alignment) and must have output 0, lse -inf and grad_q 0 (docs/FAULTS.md C5, P8)",
                ));
            }
        }
        let cu1 = [0, lq];
        let cu1k = [0, lk];
        let p1 = Varlen::cross(&cu1, &cu1k, c.causal, c.scale);
        let one = (
            c.q.slice_axis(Axis(0), Slice::from(qs.clone())),
            c.k.slice_axis(Axis(0), Slice::from(ks.clone())),
            c.v.slice_axis(Axis(0), Slice::from(ks.clone())),
            c.grad_output.slice_axis(Axis(0), Slice::from(qs.clone())),
        );
        let (f1, g1) = run(imp, one, &p1).map_err(|m| m.within(&format!("segment {s} alone")))?;
        let tol = judge.packed();
        let what =
            |t: &str| format!("segment {s} ({lq} queries over {lk} keys): packed vs alone: {t}");
        for (name, alone, packed, rows) in [
            ("output", &f1.output, &fwd.output, &qs),
            ("grad_q", &g1.grad_q, &grads.grad_q, &qs),
            ("grad_k", &g1.grad_k, &grads.grad_k, &ks),
            ("grad_v", &g1.grad_v, &grads.grad_v, &ks),
        ] {
            let mine = packed.slice_axis(Axis(0), Slice::from(rows.clone()));
            seen.close(
                &what(name),
                &flat(alone.view()),
                &flat(mine),
                alone.shape(),
                tol,
            )?;
        }
        let lse_p: Vec<f64> = fwd
            .lse
            .slice_axis(Axis(1), Slice::from(qs.clone()))
            .iter()
            .copied()
            .collect();
        let lse_1: Vec<f64> = f1.lse.iter().copied().collect();
        seen.close(&what("lse"), &lse_1, &lse_p, &[h, lq], tol)?;
    }
    Ok(seen)
}

/// The reference's results on `c` against `imp`'s, under `judge`.
fn check_reference(
    c: &GeneralCase,
    (fwd, grads): (&AttentionOutput, &AttentionGrads),
    judge: Judge,
    report: &mut RelativeReport,
) -> Result<(), Mismatch> {
    let (cu_q, cu_k) = (c.cu_q(), c.cu_k());
    let p = Varlen::cross(&cu_q, &cu_k, c.causal, c.scale);
    let x = Qkv::new(c.q.view(), c.k.view(), c.v.view());
    let pass = |op: &dyn AttentionOp| varlen_pass(op, x, &p, c.grad_output.view());
    let err = |e: Error| Mismatch::new("reference", e.to_string());
    let (want, want_g) = pass(&ReferenceAttention).map_err(err)?;
    // The gradients are one vector (see `attention::check_attention_relative`).
    let grad_scale = [&want_g.grad_q, &want_g.grad_k, &want_g.grad_v]
        .iter()
        .flat_map(|t| t.iter())
        .fold(0.0f64, |m, v| m.max(v.abs()));
    let lse_shape = [want.lse.dim().0, want.lse.dim().1];
    // The f32 baseline on the same inputs, its results widened (exactly).
    let baseline = match judge.relative_rule() {
        Some(rule) => Some((rule, pass(&Baseline32Attention).map_err(err)?)),
        None => None,
    };
    let tensors = [
        ("output", &want.output, &fwd.output, None),
        ("grad_q", &want_g.grad_q, &grads.grad_q, Some(grad_scale)),
        ("grad_k", &want_g.grad_k, &grads.grad_k, Some(grad_scale)),
        ("grad_v", &want_g.grad_v, &grads.grad_v, Some(grad_scale)),
    ];
    for (i, (name, e, a, scale)) in tensors.into_iter().enumerate() {
        let what = format!("against the reference: {name}");
        let shape = e.shape().to_vec();
        let (e, a) = (flat(e.view()), flat(a.view()));
        match &baseline {
            None => assert_close_with_scale(&what, &e, &a, &shape, judge.packed(), scale)?,
            Some((rule, (bo, bg))) => {
                let b = [&bo.output, &bg.grad_q, &bg.grad_k, &bg.grad_v][i];
                let r = assert_within_k(
                    &what,
                    &e,
                    &flat(b.view()),
                    &a,
                    &shape,
                    *rule,
                    Allowance::with_scale(scale),
                )?;
                report.note(&what, r);
            }
        }
    }
    let (e, a): (Vec<f64>, Vec<f64>) = (
        want.lse.iter().copied().collect(),
        fwd.lse.iter().copied().collect(),
    );
    match &baseline {
        None => assert_close_with_scale(
            "against the reference: lse",
            &e,
            &a,
            &lse_shape,
            judge.packed(),
            None,
        ),
        Some((rule, (bo, _))) => {
            let b: Vec<f64> = bo.lse.iter().copied().collect();
            let r = assert_within_k(
                "against the reference: lse",
                &e,
                &b,
                &a,
                &lse_shape,
                *rule,
                Allowance::default(),
            )?;
            report.note("lse", r);
            Ok(())
        }
    }
}

/// What [`check_general`] and [`run_general_suite`] saw.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GeneralReport {
    /// Packed against each segment alone.
    pub packed: Observed,
    /// Against the f64 reference under the relative rule (lower-precision
    /// kernels only).
    pub relative: Option<RelativeReport>,
    /// Cases run, of which with grouped-query heads, other key offsets and
    /// causal masks.
    pub cases: usize,
    /// Cases with `h_kv < h`.
    pub gqa: usize,
    /// Cases with `cu_seqlens_k != cu_seqlens_q`.
    pub cross: usize,
    /// Causal cases.
    pub causal: usize,
}

impl GeneralReport {
    fn merge(&mut self, o: GeneralReport) {
        self.packed.merge(o.packed);
        self.relative = match (self.relative.take(), o.relative) {
            (Some(mut a), Some(b)) => {
                a.merge(b);
                Some(a)
            }
            (a, b) => a.or(b),
        };
        self.cases += o.cases;
        self.gqa += o.gqa;
        self.cross += o.cross;
        self.causal += o.causal;
    }
}

impl std::fmt::Display for GeneralReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} GQA/cross/causal cases ({} GQA, {} cross, {} causal), packed == alone over {} values",
            self.cases, self.gqa, self.cross, self.causal, self.packed.values
        )?;
        if let Some(r) = &self.relative {
            write!(
                f,
                ", against the f64 reference: max {:.3} x the f32 baseline's error",
                r.totals.max_ratio()
            )?;
        }
        Ok(())
    }
}

/// Checks `imp` on `case` (see the module docs), the inputs rounded as
/// `judge` says first.
///
/// # Errors
/// The first [`Mismatch`].
pub fn check_general(
    imp: &dyn AttentionOp,
    case: &GeneralCase,
    judge: Judge,
) -> Result<GeneralReport, Mismatch> {
    let c = case.rounded(judge.round());
    let (cu_q, cu_k) = (c.cu_q(), c.cu_k());
    let p = Varlen::cross(&cu_q, &cu_k, c.causal, c.scale);
    let all = (c.q.view(), c.k.view(), c.v.view(), c.grad_output.view());
    let (fwd, grads) = run(imp, all, &p)?;
    let packed = check_packed(imp, &c, (&fwd, &grads), judge)?;
    let mut rel = RelativeReport::default();
    check_reference(&c, (&fwd, &grads), judge, &mut rel)?;
    let (gqa, cross) = c.kinds();
    Ok(GeneralReport {
        packed,
        relative: judge.relative_rule().map(|_| rel),
        cases: 1,
        gqa: usize::from(gqa),
        cross: usize::from(cross),
        causal: usize::from(c.causal),
    })
}

/// Most queries or keys of a segment in a random case.
pub const MAX_LEN: usize = 9;

/// Random cases within `support`: 1 to 4 segments of up to [`MAX_LEN`]
/// queries over as many keys, or (cross) any number of keys, 0 included;
/// `h_kv` 1..=2 and groups 1..=3 (GQA) or `h_kv == h` 1..=3; head dim 1..=5;
/// causal or not (when supported).
pub fn general_cases(support: AttentionSupport) -> impl Strategy<Value = GeneralCase> {
    let segment = (0usize..=MAX_LEN, 0usize..=MAX_LEN, any::<bool>())
        .prop_map(move |(lq, lk, other)| (lq, if support.cross && other { lk } else { lq }));
    (
        prop::collection::vec(segment, 1..=4),
        1usize..=2,
        1usize..=3,
        1usize..=5,
        any::<bool>(),
        any::<u64>(),
    )
        .prop_map(move |(segments, h_kv, group, d, causal, seed)| {
            let (h, h_kv) = if support.gqa {
                (h_kv * group, h_kv)
            } else {
                (group, group)
            };
            GeneralCase::seeded(&segments, (h, h_kv, d), causal && support.causal, seed)
        })
}

/// A fixed case of the general suite: the layout and heads of a
/// [`GeneralCase::seeded`].
#[derive(Debug, Clone, PartialEq)]
pub struct FixedCase {
    /// What the case shows.
    pub name: &'static str,
    /// `(queries, keys)` of each segment.
    pub segments: Vec<(usize, usize)>,
    /// `(h, h_kv, d)`.
    pub heads: (usize, usize, usize),
    /// Bottom-right causal masks.
    pub causal: bool,
}

impl FixedCase {
    /// A case with causal masks (most fixed cases have them).
    fn new(name: &'static str, segments: &[(usize, usize)], heads: (usize, usize, usize)) -> Self {
        FixedCase {
            name,
            segments: segments.to_vec(),
            heads,
            causal: true,
        }
    }

    /// The case without causal masks (bidirectional).
    fn bidirectional(self) -> Self {
        FixedCase {
            causal: false,
            ..self
        }
    }

    /// The case with values from `seed`.
    pub fn case(&self, seed: u64) -> GeneralCase {
        GeneralCase::seeded(&self.segments, self.heads, self.causal, seed)
    }
}

/// The fixed cases: the C5 example, a segment with more queries than keys,
/// MQA and GQA, and segments that cross a blocked kernel's 64-token tiles.
pub fn general_fixed_cases() -> Vec<FixedCase> {
    vec![
        FixedCase::new("C5: 2 queries over 5 keys", &[(2, 5)], (2, 2, 3)),
        FixedCase::new(
            "3 queries over 1 key, then 2 over 4",
            &[(3, 1), (2, 4)],
            (4, 2, 3),
        ),
        FixedCase::new(
            "MQA: 3 query heads over 1",
            &[(4, 4), (0, 3), (5, 5)],
            (3, 1, 4),
        ),
        FixedCase::new(
            "GQA, bidirectional, other keys",
            &[(3, 6), (4, 2)],
            (4, 2, 2),
        )
        .bidirectional(),
        FixedCase::new(
            "tiles: 70 over 130 and 130 over 70",
            &[(70, 130), (130, 70)],
            (4, 2, 16),
        ),
        FixedCase::new("tiles: self 200, GQA", &[(200, 200), (1, 1)], (4, 1, 8)),
    ]
}

fn supported(support: AttentionSupport, c: &GeneralCase) -> bool {
    let (gqa, cross) = c.kinds();
    (support.gqa || !gqa) && (support.cross || !cross) && (support.causal || !c.causal)
}

/// The general suite for `imp` under `judge`: the fixed cases and `cases`
/// random ones (fixed seed), each within `imp.support()`; `None` when it
/// declares nothing beyond bidirectional self-attention with `h_kv == h`.
/// Under a relative judge, the rule's suite totals must hold too.
///
/// # Errors
/// The first failure with its case.
pub fn run_general_suite(
    imp: &dyn AttentionOp,
    judge: Judge,
    cases: u32,
) -> Result<Option<GeneralReport>, Mismatch> {
    let support = imp.support();
    if !(support.causal || support.gqa || support.cross) {
        return Ok(None);
    }
    let mut report = GeneralReport::default();
    for (i, fixed) in general_fixed_cases().iter().enumerate() {
        let case = fixed.case(200 + i as u64);
        if supported(support, &case) {
            report.merge(check_general(imp, &case, judge).map_err(|m| m.within(fixed.name))?);
        }
    }
    let suite = format!("{IMPL} GQA/cross attention suite");
    let report = crate::run_cases(cases, &general_cases(support), &suite, report, |r, case| {
        r.merge(check_general(imp, &case, judge)?);
        Ok(())
    })?;
    if let (Some(rule), Some(rel)) = (judge.relative_rule(), &report.relative) {
        rel.totals.check(&suite, rule)?;
    }
    Ok(Some(report))
}
