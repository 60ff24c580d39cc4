//! Varlen attention checked against padded attention (docs/FAULTS.md P2, P4, P8).
//!
//! An implementation of [`AttentionOp`] gives both forms of the same
//! problem: the packed one, `q, k, v: [n_tok, h, d]` with `cu_seqlens: [b + 1]`
//! (flash-attention's `flash_attn_varlen_func`), and the padded one, a dense
//! `[L, h, d]` row per sequence with a boolean mask. [`check_attention`] runs
//! a case both ways and requires, under [`Tolerance::F64_REWRITE`]:
//!
//! - outputs, `lse` and `grad_q/k/v` of every real token agree (packed == padded);
//! - padding rows of the padded form, whose queries are masked like their
//!   keys (the block-diagonal mask of the packing paper), give output 0,
//!   `lse = -inf` and zero gradients, never NaN (P8);
//! - changing the tokens of one sequence leaves every other sequence's
//!   packed outputs bit-for-bit unchanged (P2).
//!
//! Padding slots hold planted garbage (large values) and padding rows get a
//! non-zero `grad_output`, so an implementation that lets padding in is seen.

use ndarray::{Array3, ArrayView3, Axis};
use packshard_reference::attention::{varlen_pass, ReferenceAttention};
use packshard_reference::bert::attention::{AttentionGrads, AttentionOutput};
use packshard_reference::ops::{AttentionOp, Grad, Qkv, Varlen};
use packshard_reference::Error;
use proptest::prelude::*;

use crate::baseline32;
use crate::compare::{assert_within_k, Allowance, Judge, Mismatch, RelativeRule, Tolerance};

mod padded;
pub(crate) mod report;
pub(crate) use padded::{PaddedSegment, PaddingLeak};
pub(crate) use report::{check_forward_shapes, IMPL};
pub use report::{Observed, RelativeReport};

/// One attention problem: sequence lengths (empty ones allowed), heads,
/// head dim, the padded row length, and the packed tensors.
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionCase {
    /// Tokens of each sequence.
    pub lengths: Vec<usize>,
    /// Padded row length `L >= max(lengths)`.
    pub row_len: usize,
    /// Softmax scale.
    pub scale: f64,
    /// `[n_tok, h, d]`.
    pub q: Array3<f64>,
    /// `[n_tok, h, d]`.
    pub k: Array3<f64>,
    /// `[n_tok, h, d]`.
    pub v: Array3<f64>,
    /// `[n_tok, h, d]`.
    pub grad_output: Array3<f64>,
}

impl AttentionCase {
    /// The case's `q, k, v`.
    pub fn qkv(&self) -> Qkv<'_> {
        Qkv::new(self.q.view(), self.k.view(), self.v.view())
    }

    /// `imp`'s varlen forward on the case (bidirectional, its `cu_seqlens`).
    ///
    /// # Errors
    /// `imp`'s.
    pub fn varlen_forward(&self, imp: &dyn AttentionOp) -> Result<AttentionOutput, Error> {
        let cu = self.cu_seqlens();
        imp.varlen_forward(self.qkv(), &Varlen::new(&cu, false, self.scale))
    }

    /// `imp`'s varlen backward of `fwd` on the case, with its `grad_output`.
    ///
    /// # Errors
    /// `imp`'s.
    pub fn varlen_backward(
        &self,
        imp: &dyn AttentionOp,
        fwd: &AttentionOutput,
    ) -> Result<AttentionGrads, Error> {
        let cu = self.cu_seqlens();
        let g = Grad::new(fwd, self.grad_output.view());
        imp.varlen_backward(self.qkv(), &Varlen::new(&cu, false, self.scale), g)
    }

    /// `imp`'s varlen forward, then its backward of that forward.
    ///
    /// # Errors
    /// `imp`'s.
    pub fn varlen_pass(
        &self,
        imp: &dyn AttentionOp,
    ) -> Result<(AttentionOutput, AttentionGrads), Error> {
        let cu = self.cu_seqlens();
        let p = Varlen::new(&cu, false, self.scale);
        varlen_pass(imp, self.qkv(), &p, self.grad_output.view())
    }
}

impl AttentionCase {
    /// `cu_seqlens: [b + 1]` of the lengths.
    pub fn cu_seqlens(&self) -> Vec<usize> {
        crate::cu_seqlens_of(self.lengths.iter().copied())
    }

    /// A case with deterministic values from `seed` (uniform in [-2, 2],
    /// every 7th value x 8: planted outliers).
    pub fn seeded(lengths: &[usize], h: usize, d: usize, extra_pad: usize, seed: u64) -> Self {
        let n: usize = lengths.iter().sum();
        let [q, k, v, grad_output] = Self::seeded_tensors((n, n), (h, h, d), seed);
        AttentionCase {
            lengths: lengths.to_vec(),
            row_len: lengths.iter().copied().max().unwrap_or(0) + extra_pad,
            scale: 1.0 / (d as f64).sqrt(),
            q,
            k,
            v,
            grad_output,
        }
    }
}

impl AttentionCase {
    /// `[q, k, v, grad_output]` with the values of [`AttentionCase::seeded`]
    /// (uniform in [-2, 2], one in 7 x 8, drawn in that order), for queries
    /// and keys of their own counts and heads: `q, grad_output: [n_q, h, d]`,
    /// `k, v: [n_k, h_kv, d]`. With `n_q == n_k` and `h_kv == h` they are
    /// exactly `seeded`'s tensors.
    pub fn seeded_tensors(
        (n_q, n_k): (usize, usize),
        (h, h_kv, d): (usize, usize, usize),
        seed: u64,
    ) -> [Array3<f64>; 4] {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let mut gen = |_| {
            let x = 4.0 * rng.random::<f64>() - 2.0;
            if rng.random_range(0..7) == 0 {
                8.0 * x
            } else {
                x
            }
        };
        let q = Array3::from_shape_fn((n_q, h, d), &mut gen);
        let k = Array3::from_shape_fn((n_k, h_kv, d), &mut gen);
        let v = Array3::from_shape_fn((n_k, h_kv, d), &mut gen);
        let grad_output = Array3::from_shape_fn((n_q, h, d), &mut gen);
        [q, k, v, grad_output]
    }
}

impl AttentionCase {
    /// The case with every tensor rounded by `round` (to f32, or bf16), so
    /// that a lower-precision kernel receives exactly the inputs the f64
    /// reference sees.
    pub fn rounded(&self, round: fn(f64) -> f64) -> Self {
        AttentionCase {
            q: self.q.mapv(round),
            k: self.k.mapv(round),
            v: self.v.mapv(round),
            grad_output: self.grad_output.mapv(round),
            ..self.clone()
        }
    }

    /// `[q, k, v, grad_output]` as f32 (exact on a case [`Self::rounded`]
    /// to f32).
    pub fn inputs_f32(&self) -> [Array3<f32>; 4] {
        [&self.q, &self.k, &self.v, &self.grad_output].map(|x| x.mapv(|v| v as f32))
    }
}

fn flat(x: ArrayView3<f64>) -> Vec<f64> {
    x.iter().copied().collect()
}

/// Checks `imp` on one case (see the module docs).
///
/// # Errors
/// The first [`Mismatch`], naming the sequence, tensor and index.
pub fn check_attention(imp: &dyn AttentionOp, case: &AttentionCase) -> Result<Observed, Mismatch> {
    check_attention_with(imp, case, Tolerance::F64_REWRITE)
}

/// As [`check_attention`] with packed == padded judged under `tol` (an f32
/// kernel that is not bitwise equal in both forms passes
/// [`Tolerance::F32_REWRITE`]); padding rows must still be exactly 0 and
/// other sequences bitwise unchanged.
///
/// # Errors
/// As [`check_attention`].
pub fn check_attention_with(
    imp: &dyn AttentionOp,
    case: &AttentionCase,
    tol: Tolerance,
) -> Result<Observed, Mismatch> {
    let cu = case.cu_seqlens();
    let (n, h, d) = case.q.dim();
    let err = |what: &str, e: Error| Mismatch::new(what, format!("{}: {e}", IMPL));
    let fwd = case
        .varlen_forward(imp)
        .map_err(|e| err("varlen_forward", e))?;
    check_forward_shapes(&fwd, (n, h, d))?;
    let grads = case
        .varlen_backward(imp, &fwd)
        .map_err(|e| err("varlen_backward", e))?;
    let mut seen = Observed::default();
    for (s, &len) in case.lengths.iter().enumerate() {
        let at = cu[s];
        let padded = PaddedSegment::of(case, at, len);
        let pf = padded.forward(imp).map_err(|e| err("masked_forward", e))?;
        let pgr = padded
            .backward(imp, &pf)
            .map_err(|e| err("masked_backward", e))?;
        // Padding rows: no allowed key, so exactly 0 and no gradient (P8).
        match padded.leak(&pf, &pgr) {
            Some(PaddingLeak::Value {
                name,
                row: i,
                at: c,
                x,
            }) => {
                return Err(Mismatch::new(
                    format!("sequence {s}: padded {name}"),
                    format!(
                        "padding row {i} (no allowed key) holds {x:e} at flat {c}; it must be exactly 0, never NaN (docs/FAULTS.md P8)"
                    ),
                ));
            }
            Some(PaddingLeak::Lse { row: i, head: a, x }) => {
                return Err(Mismatch::new(
                    format!("sequence {s}: padded lse"),
                    format!(
                        "padding row {i} head {a}: lse {x:e}, expected -inf (empty softmax, P8)"
                    ),
                ));
            }
            None => {}
        }
        let pick = |x: &Array3<f64>| flat(x.slice_axis(Axis(0), (0..len).into()));
        let mine = |x: &Array3<f64>| flat(x.slice_axis(Axis(0), (at..at + len).into()));
        let shape = [len, h, d];
        seen.close(
            &format!("sequence {s}: output"),
            &pick(&pf.output),
            &mine(&fwd.output),
            &shape,
            tol,
        )?;
        let lse_p: Vec<f64> = (0..h)
            .flat_map(|a| (0..len).map(move |i| (a, i)))
            .map(|(a, i)| pf.lse[[a, i]])
            .collect();
        let lse_v: Vec<f64> = (0..h)
            .flat_map(|a| (0..len).map(move |i| (a, i)))
            .map(|(a, i)| fwd.lse[[a, at + i]])
            .collect();
        seen.close(
            &format!("sequence {s}: lse"),
            &lse_p,
            &lse_v,
            &[h, len],
            tol,
        )?;
        for (name, p, v) in [
            ("grad_q", &pgr.grad_q, &grads.grad_q),
            ("grad_k", &pgr.grad_k, &grads.grad_k),
            ("grad_v", &pgr.grad_v, &grads.grad_v),
        ] {
            seen.close(
                &format!("sequence {s}: {name}"),
                &pick(p),
                &mine(v),
                &shape,
                tol,
            )?;
        }
    }
    // P2: change the first non-empty sequence; no other output may move.
    if let Some(s) = case.lengths.iter().position(|&l| l > 0) {
        let (a, b) = (cu[s], cu[s + 1]);
        let mut q2 = case.q.clone();
        let mut v2 = case.v.clone();
        q2.slice_axis_mut(Axis(0), (a..b).into())
            .mapv_inplace(|x| -3.0 * x + 1.0);
        v2.slice_axis_mut(Axis(0), (a..b).into())
            .mapv_inplace(|x| 5.0 - x);
        let f2 = imp
            .varlen_forward(
                Qkv::new(q2.view(), case.k.view(), v2.view()),
                &Varlen::new(&cu, false, case.scale),
            )
            .map_err(|e| err("varlen_forward", e))?;
        for i in (0..a).chain(b..n) {
            if f2.output.index_axis(Axis(0), i) != fwd.output.index_axis(Axis(0), i) {
                let t = cu.partition_point(|&c| c <= i) - 1;
                return Err(Mismatch::new(
                    "cross-sequence leak",
                    format!(
                        "changing sequence {s} (tokens {a}..{b}) changed the output of token {i} of sequence {t} (docs/FAULTS.md P2)"
                    ),
                ));
            }
        }
    }
    Ok(seen)
}

/// Shared size limits of the random cases.
pub const MAX_LEN: usize = 9;
/// Most sequences in a random case.
pub const MAX_SEQS: usize = 6;

/// Random cases: sizes first (lengths with empty ones, heads 1..=3, head dim
/// 1..=5, extra padding 0..=3), then the values from a seed.
pub fn attention_cases() -> impl Strategy<Value = AttentionCase> {
    (
        prop::collection::vec(
            prop_oneof![1 => Just(0usize), 1 => Just(1usize), 4 => 1usize..=MAX_LEN],
            1..=MAX_SEQS,
        ),
        1usize..=3,
        1usize..=5,
        0usize..=3,
        any::<u64>(),
    )
        .prop_map(|(lengths, h, d, pad, seed)| AttentionCase::seeded(&lengths, h, d, pad, seed))
}

/// The first `n` [`attention_cases`] of proptest's deterministic runner
/// (`TestRunner::deterministic`), rounded to f32: the cases on which the f32
/// baseline and the relative rule's own tests measure f32 error.
pub fn deterministic_f32_cases(n: usize) -> impl Iterator<Item = AttentionCase> {
    use proptest::strategy::ValueTree;
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let strategy = attention_cases();
    (0..n).map(move |_| {
        let tree = strategy
            .new_tree(&mut runner)
            .expect("a strategy without filters");
        tree.current().rounded(baseline32::round_f32)
    })
}

/// The docs/FAULTS.md examples and edge shapes, as `(name, lengths, extra padding)`.
pub fn fault_cases() -> Vec<(&'static str, Vec<usize>, usize)> {
    vec![
        ("P2 lengths [3, 5] in a pack of 8", vec![3, 5], 0),
        ("P4 zero-length sequence [1, 0, 1]", vec![1, 0, 1], 1),
        ("P8 sequence ids [1, 1, 2, 0]", vec![2, 1], 1),
        ("one sequence filling the pack", vec![8], 0),
        ("many tiny sequences", vec![1, 1, 1, 1, 1, 1, 1], 2),
        ("only empty sequences", vec![0, 0], 2),
    ]
}

/// The whole attention suite for one implementation: the fault cases, then
/// `cases` random ones (a fixed proptest seed, so failures reproduce).
///
/// # Errors
/// The first failure with its case.
pub fn run_attention_suite(imp: &dyn AttentionOp, cases: u32) -> Result<Observed, Mismatch> {
    run_attention_suite_with(imp, cases, Tolerance::F64_REWRITE)
}

/// As [`run_attention_suite`] with packed == padded judged under `tol`.
///
/// # Errors
/// The first failure with its case.
pub fn run_attention_suite_with(
    imp: &dyn AttentionOp,
    cases: u32,
    tol: Tolerance,
) -> Result<Observed, Mismatch> {
    let mut seen = Observed::default();
    for (i, (name, lengths, pad)) in fault_cases().into_iter().enumerate() {
        for (h, d) in [(1, 1), (2, 3)] {
            let case = AttentionCase::seeded(&lengths, h, d, pad, i as u64);
            let o = check_attention_with(imp, &case, tol).map_err(|m| m.within(name))?;
            seen.merge(o);
        }
    }
    let suite = format!("{} attention suite", IMPL);
    crate::run_cases(cases, &attention_cases(), &suite, seen, |seen, case| {
        seen.merge(check_attention_with(imp, &case, tol)?);
        Ok(())
    })
}

/// What [`run_suite`] saw.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SuiteReport {
    /// Packed against padded, over the fault, tile and random cases.
    pub packed: Observed,
    /// Against the f64 reference, for a lower-precision kernel.
    pub relative: Option<RelativeReport>,
    /// Causal, grouped-query and cross cases, for a kernel that declares
    /// them ([`crate::attention_general`]).
    pub general: Option<crate::attention_general::GeneralReport>,
}

impl std::fmt::Display for SuiteReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "packed == padded over {} values (max |diff| {:.2e})",
            self.packed.values, self.packed.max_abs
        )?;
        if let Some(r) = &self.relative {
            write!(
                f,
                "; against the f64 reference over {} tensors: max {:.3} x, mean {:.3} x the f32 baseline's error",
                r.totals.count,
                r.totals.max_ratio(),
                r.totals.mean_ratio()
            )?;
        }
        if let Some(g) = &self.general {
            write!(f, "; {g}")?;
        }
        Ok(())
    }
}

/// The attention suite for one implementation under `judge`: packed ==
/// padded (the fault cases, [`tile_cases`] and `cases` random ones, fixed
/// seed) within `judge.packed()`, padding rows exactly 0 and other sequences
/// bitwise unchanged; for a lower-precision kernel,
/// [`run_attention_relative_suite`] against the f64 reference; and the
/// causal, grouped-query and cross cases the kernel declares
/// ([`crate::attention_general::run_general_suite`]).
///
/// # Errors
/// The first failure with its case.
pub fn run_suite(imp: &dyn AttentionOp, judge: Judge, cases: u32) -> Result<SuiteReport, Mismatch> {
    let tol = judge.packed();
    let mut packed = run_attention_suite_with(imp, cases, tol)?;
    for (i, (name, lengths, h, d)) in tile_cases().into_iter().enumerate() {
        let case = AttentionCase::seeded(&lengths, h, d, 7, 50 + i as u64);
        packed.merge(check_attention_with(imp, &case, tol).map_err(|m| m.within(name))?);
    }
    let relative = match judge.relative_rule() {
        Some(rule) => Some(run_attention_relative_suite(
            imp,
            cases,
            rule,
            judge.round(),
        )?),
        None => None,
    };
    let general = crate::attention_general::run_general_suite(imp, judge, cases)?;
    Ok(SuiteReport {
        packed,
        relative,
        general,
    })
}

// ---- lower-precision kernels against the f64 reference --------------------------

fn flat3(x: &Array3<f64>) -> Vec<f64> {
    x.iter().copied().collect()
}

/// Checks a lower-precision `imp` on `case` against the f64 reference under
/// `rule`: the case is rounded with `round` first (f32 or bf16 inputs, as the
/// kernel receives them); `output`, `lse`, `grad_q`, `grad_k`, `grad_v` of
/// the varlen form must each be within `k` times the error of
/// [`baseline32`] (the reference math in f32 on the same inputs).
///
/// # Errors
/// The first tensor outside the rule, as a [`Mismatch`].
pub fn check_attention_relative(
    imp: &dyn AttentionOp,
    case: &AttentionCase,
    rule: RelativeRule,
    round: fn(f64) -> f64,
) -> Result<RelativeReport, Mismatch> {
    let c = case.rounded(round);
    let (n, h, d) = c.q.dim();
    let err = |what: &str, e: Error| Mismatch::new(what, format!("{}: {e}", IMPL));
    let (want, want_g) = c
        .varlen_pass(&ReferenceAttention)
        .map_err(|e| err("reference", e))?;
    // The f32 baseline on the same inputs, its results widened (exactly).
    let (base, base_g) = c
        .varlen_pass(&baseline32::Baseline32Attention)
        .map_err(|e| err("baseline", e))?;
    let fwd = c
        .varlen_forward(imp)
        .map_err(|e| err("varlen_forward", e))?;
    let grads = c
        .varlen_backward(imp, &fwd)
        .map_err(|e| err("varlen_backward", e))?;
    let mut report = RelativeReport::default();
    let shape = [n, h, d];
    // The three gradients are one gradient vector: those of q and k are zero
    // by symmetry for a one-token segment (dP = delta), and then computed as
    // round-off of terms as large as v's gradient; their floor is relative
    // to the largest gradient.
    let grad_scale = [&want_g.grad_q, &want_g.grad_k, &want_g.grad_v]
        .iter()
        .flat_map(|t| t.iter())
        .fold(0.0f64, |m, v| m.max(v.abs()));
    for (name, e, b, a, scale) in [
        ("output", &want.output, &base.output, &fwd.output, None),
        (
            "grad_q",
            &want_g.grad_q,
            &base_g.grad_q,
            &grads.grad_q,
            Some(grad_scale),
        ),
        (
            "grad_k",
            &want_g.grad_k,
            &base_g.grad_k,
            &grads.grad_k,
            Some(grad_scale),
        ),
        (
            "grad_v",
            &want_g.grad_v,
            &base_g.grad_v,
            &grads.grad_v,
            Some(grad_scale),
        ),
    ] {
        if a.dim() != (n, h, d) {
            return Err(Mismatch::new(
                name,
                format!("shape {:?}, expected {shape:?}", a.shape()),
            ));
        }
        let r = assert_within_k(
            name,
            &flat3(e),
            &flat3(b),
            &flat3(a),
            &shape,
            rule,
            Allowance::with_scale(scale),
        )?;
        report.note(name, r);
    }
    let lse_b: Vec<f64> = base.lse.iter().copied().collect();
    let lse_e: Vec<f64> = want.lse.iter().copied().collect();
    let lse_a: Vec<f64> = fwd.lse.iter().copied().collect();
    let r = assert_within_k(
        "lse",
        &lse_e,
        &lse_b,
        &lse_a,
        &[h, n],
        rule,
        Allowance::default(),
    )?;
    report.note("lse", r);
    Ok(report)
}

/// Cases that cross the tiles of a blocked kernel (segments longer than 64
/// and 128 tokens, one exactly 64, empty ones), as `(name, lengths, heads,
/// head dim)`.
pub fn tile_cases() -> Vec<(&'static str, Vec<usize>, usize, usize)> {
    vec![
        (
            "segments of 130, 3, 0 and 70 tokens",
            vec![130, 3, 0, 70],
            2,
            16,
        ),
        (
            "one segment of exactly 64 and one of 65",
            vec![64, 65],
            3,
            7,
        ),
        ("a segment of 200, head dim 64", vec![200, 1], 2, 64),
    ]
}

/// The suite for a lower-precision kernel: the fault cases and
/// [`tile_cases`], then `cases` random ones (fixed seed), each checked by
/// [`check_attention_relative`]; fails if the rule was vacuous.
///
/// # Errors
/// The first failure with its case.
pub fn run_attention_relative_suite(
    imp: &dyn AttentionOp,
    cases: u32,
    rule: RelativeRule,
    round: fn(f64) -> f64,
) -> Result<RelativeReport, Mismatch> {
    let mut report = RelativeReport::default();
    let named = |name: &str, m: Mismatch| m.within(name);
    for (i, (name, lengths, pad)) in fault_cases().into_iter().enumerate() {
        for (h, d) in [(1, 1), (2, 3)] {
            let case = AttentionCase::seeded(&lengths, h, d, pad, i as u64);
            report.merge(
                check_attention_relative(imp, &case, rule, round).map_err(|m| named(name, m))?,
            );
        }
    }
    for (i, (name, lengths, h, d)) in tile_cases().into_iter().enumerate() {
        let case = AttentionCase::seeded(&lengths, h, d, 0, 100 + i as u64);
        report
            .merge(check_attention_relative(imp, &case, rule, round).map_err(|m| named(name, m))?);
    }
    let suite = format!("{} relative attention suite", IMPL);
    let report = crate::run_cases(cases, &attention_cases(), &suite, report, |report, case| {
        report.merge(check_attention_relative(imp, &case, rule, round)?);
        Ok(())
    })?;
    report.require_nonvacuous(10)?;
    report.totals.check(&suite, rule)?;
    Ok(report)
}
