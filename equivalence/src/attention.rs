//! Varlen attention checked against padded attention (FAULTS.md P2, P4, P8).
//!
//! An implementation of [`VarlenAttention`] gives both forms of the same
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

use ndarray::{Array2, Array3, ArrayView2, ArrayView3, Axis};
use packshard_reference::bert::attention::{
    masked_attention, masked_attention_backward, varlen_attention, varlen_attention_backward,
    AttentionGrads, AttentionOutput,
};
use packshard_reference::Error;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

use crate::compare::{assert_close_with_scale, error_stats, Mismatch, Tolerance};

/// An attention implementation in its packed and padded forms.
pub trait VarlenAttention {
    /// A short name for reports.
    fn name(&self) -> String;
    /// Packed forward: `q, k, v: [n_tok, h, d]`, `cu_seqlens: [b + 1]`;
    /// returns `output: [n_tok, h, d]`, `lse: [h, n_tok]`.
    ///
    /// # Errors
    /// Shape or `cu_seqlens` errors.
    fn varlen_forward(
        &self,
        q: ArrayView3<f64>,
        k: ArrayView3<f64>,
        v: ArrayView3<f64>,
        cu_seqlens: &[usize],
        scale: f64,
    ) -> Result<AttentionOutput, Error>;
    /// Packed backward: `grad_output: [n_tok, h, d]`.
    ///
    /// # Errors
    /// Shape or `cu_seqlens` errors.
    #[allow(clippy::too_many_arguments)]
    fn varlen_backward(
        &self,
        q: ArrayView3<f64>,
        k: ArrayView3<f64>,
        v: ArrayView3<f64>,
        cu_seqlens: &[usize],
        scale: f64,
        fwd: &AttentionOutput,
        grad_output: ArrayView3<f64>,
    ) -> Result<AttentionGrads, Error>;
    /// Padded forward of one row: `q, k, v: [L, h, d]`, `allowed: [L, L]`.
    ///
    /// # Errors
    /// Shape errors.
    fn masked_forward(
        &self,
        q: ArrayView3<f64>,
        k: ArrayView3<f64>,
        v: ArrayView3<f64>,
        allowed: ArrayView2<bool>,
        scale: f64,
    ) -> Result<AttentionOutput, Error>;
    /// Padded backward of one row.
    ///
    /// # Errors
    /// Shape errors.
    #[allow(clippy::too_many_arguments)]
    fn masked_backward(
        &self,
        q: ArrayView3<f64>,
        k: ArrayView3<f64>,
        v: ArrayView3<f64>,
        allowed: ArrayView2<bool>,
        scale: f64,
        fwd: &AttentionOutput,
        grad_output: ArrayView3<f64>,
    ) -> Result<AttentionGrads, Error>;
}

/// The reference attention of `packshard-reference`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Reference;

impl VarlenAttention for Reference {
    fn name(&self) -> String {
        "reference".into()
    }
    fn varlen_forward(
        &self,
        q: ArrayView3<f64>,
        k: ArrayView3<f64>,
        v: ArrayView3<f64>,
        cu_seqlens: &[usize],
        scale: f64,
    ) -> Result<AttentionOutput, Error> {
        varlen_attention(q, k, v, cu_seqlens, false, scale)
    }
    fn varlen_backward(
        &self,
        q: ArrayView3<f64>,
        k: ArrayView3<f64>,
        v: ArrayView3<f64>,
        cu_seqlens: &[usize],
        scale: f64,
        fwd: &AttentionOutput,
        grad_output: ArrayView3<f64>,
    ) -> Result<AttentionGrads, Error> {
        varlen_attention_backward(q, k, v, cu_seqlens, false, scale, fwd, grad_output)
    }
    fn masked_forward(
        &self,
        q: ArrayView3<f64>,
        k: ArrayView3<f64>,
        v: ArrayView3<f64>,
        allowed: ArrayView2<bool>,
        scale: f64,
    ) -> Result<AttentionOutput, Error> {
        masked_attention(q, k, v, allowed, scale)
    }
    fn masked_backward(
        &self,
        q: ArrayView3<f64>,
        k: ArrayView3<f64>,
        v: ArrayView3<f64>,
        allowed: ArrayView2<bool>,
        scale: f64,
        fwd: &AttentionOutput,
        grad_output: ArrayView3<f64>,
    ) -> Result<AttentionGrads, Error> {
        masked_attention_backward(q, k, v, allowed, scale, fwd, grad_output)
    }
}

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
    /// `cu_seqlens: [b + 1]` of the lengths.
    pub fn cu_seqlens(&self) -> Vec<usize> {
        let mut cu = vec![0];
        for l in &self.lengths {
            cu.push(cu.last().unwrap() + l);
        }
        cu
    }

    /// A case with deterministic values from `seed` (uniform in [-2, 2],
    /// every 7th value x 8: planted outliers).
    pub fn seeded(lengths: &[usize], h: usize, d: usize, extra_pad: usize, seed: u64) -> Self {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let n: usize = lengths.iter().sum();
        let mut gen = |_| {
            let x = 4.0 * rng.random::<f64>() - 2.0;
            if rng.random_range(0..7) == 0 {
                8.0 * x
            } else {
                x
            }
        };
        let q = Array3::from_shape_fn((n, h, d), &mut gen);
        let k = Array3::from_shape_fn((n, h, d), &mut gen);
        let v = Array3::from_shape_fn((n, h, d), &mut gen);
        let grad_output = Array3::from_shape_fn((n, h, d), &mut gen);
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

/// What a passing run saw.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Observed {
    /// Largest `|packed - padded|` over all compared values.
    pub max_abs: f64,
    /// Largest `|packed - padded| / max |padded|` of a tensor.
    pub max_rel: f64,
    /// Values compared.
    pub values: usize,
}

impl Observed {
    /// Compares `actual` with `expected` under `tol` and records the error.
    ///
    /// # Errors
    /// The [`Mismatch`] of [`assert_close`].
    pub fn close(
        &mut self,
        what: &str,
        expected: &[f64],
        actual: &[f64],
        shape: &[usize],
        tol: Tolerance,
    ) -> Result<(), Mismatch> {
        self.close_scaled(what, expected, actual, shape, tol, None)
    }

    /// As [`Observed::close`] with the absolute floor relative to `scale`
    /// (see [`assert_close_with_scale`]).
    ///
    /// # Errors
    /// The [`Mismatch`] of [`assert_close_with_scale`].
    pub fn close_scaled(
        &mut self,
        what: &str,
        expected: &[f64],
        actual: &[f64],
        shape: &[usize],
        tol: Tolerance,
        scale: Option<f64>,
    ) -> Result<(), Mismatch> {
        assert_close_with_scale(what, expected, actual, shape, tol, scale)?;
        if expected.len() == actual.len() {
            let s = error_stats(expected, actual);
            let scale = expected
                .iter()
                .fold(scale.unwrap_or(0.0), |m, v| m.max(v.abs()));
            self.max_abs = self.max_abs.max(s.max_abs);
            if scale > 0.0 {
                self.max_rel = self.max_rel.max(s.max_abs / scale);
            }
            self.values += expected.len();
        }
        Ok(())
    }

    /// Merges another run's figures.
    pub fn merge(&mut self, other: Observed) {
        self.max_abs = self.max_abs.max(other.max_abs);
        self.max_rel = self.max_rel.max(other.max_rel);
        self.values += other.values;
    }
}

fn rows(x: &Array3<f64>, from: usize, len: usize, row_len: usize, fill: f64) -> Array3<f64> {
    let (_, h, d) = x.dim();
    Array3::from_shape_fn((row_len, h, d), |(i, a, c)| {
        if i < len {
            x[[from + i, a, c]]
        } else {
            fill * (1.0 + (i * 7 + a * 3 + c) as f64)
        }
    })
}

fn flat(x: ArrayView3<f64>) -> Vec<f64> {
    x.iter().copied().collect()
}

/// Checks `imp` on one case (see the module docs).
///
/// # Errors
/// The first [`Mismatch`], naming the sequence, tensor and index.
pub fn check_attention(
    imp: &dyn VarlenAttention,
    case: &AttentionCase,
) -> Result<Observed, Mismatch> {
    let tol = Tolerance::F64_REWRITE;
    let cu = case.cu_seqlens();
    let (n, h, d) = case.q.dim();
    let err = |what: &str, e: Error| Mismatch::new(what, format!("{}: {e}", imp.name()));
    let fwd = imp
        .varlen_forward(case.q.view(), case.k.view(), case.v.view(), &cu, case.scale)
        .map_err(|e| err("varlen_forward", e))?;
    if fwd.output.dim() != (n, h, d) || fwd.lse.dim() != (h, n) {
        return Err(Mismatch::new(
            "varlen_forward",
            format!(
                "output {:?} and lse {:?}, expected [{n}, {h}, {d}] and [{h}, {n}]",
                fwd.output.shape(),
                fwd.lse.shape()
            ),
        ));
    }
    let grads = imp
        .varlen_backward(
            case.q.view(),
            case.k.view(),
            case.v.view(),
            &cu,
            case.scale,
            &fwd,
            case.grad_output.view(),
        )
        .map_err(|e| err("varlen_backward", e))?;
    let mut seen = Observed::default();
    let big = 1e3; // planted garbage in padding slots
    for (s, &len) in case.lengths.iter().enumerate() {
        let at = cu[s];
        let l = case.row_len;
        let (pq, pk, pv) = (
            rows(&case.q, at, len, l, big),
            rows(&case.k, at, len, l, -big),
            rows(&case.v, at, len, l, big),
        );
        let pg = rows(&case.grad_output, at, len, l, 1.0);
        let mask = Array2::from_shape_fn((l, l), |(i, j)| i < len && j < len);
        let pf = imp
            .masked_forward(pq.view(), pk.view(), pv.view(), mask.view(), case.scale)
            .map_err(|e| err("masked_forward", e))?;
        let pgr = imp
            .masked_backward(
                pq.view(),
                pk.view(),
                pv.view(),
                mask.view(),
                case.scale,
                &pf,
                pg.view(),
            )
            .map_err(|e| err("masked_backward", e))?;
        // Padding rows: no allowed key, so exactly 0 and no gradient (P8).
        for (name, t) in [
            ("output", &pf.output),
            ("grad_q", &pgr.grad_q),
            ("grad_k", &pgr.grad_k),
            ("grad_v", &pgr.grad_v),
        ] {
            for i in len..l {
                if let Some((c, &x)) = t
                    .index_axis(Axis(0), i)
                    .iter()
                    .enumerate()
                    .find(|(_, x)| **x != 0.0)
                {
                    return Err(Mismatch::new(
                        format!("sequence {s}: padded {name}"),
                        format!(
                            "padding row {i} (no allowed key) holds {x:e} at flat {c}; it must be exactly 0, never NaN (FAULTS.md P8)"
                        ),
                    ));
                }
            }
        }
        for i in len..l {
            for a in 0..h {
                if pf.lse[[a, i]] != f64::NEG_INFINITY {
                    return Err(Mismatch::new(
                        format!("sequence {s}: padded lse"),
                        format!(
                            "padding row {i} head {a}: lse {:e}, expected -inf (empty softmax, P8)",
                            pf.lse[[a, i]]
                        ),
                    ));
                }
            }
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
            .varlen_forward(q2.view(), case.k.view(), v2.view(), &cu, case.scale)
            .map_err(|e| err("varlen_forward", e))?;
        for i in (0..a).chain(b..n) {
            if f2.output.index_axis(Axis(0), i) != fwd.output.index_axis(Axis(0), i) {
                let t = cu.partition_point(|&c| c <= i) - 1;
                return Err(Mismatch::new(
                    "cross-sequence leak",
                    format!(
                        "changing sequence {s} (tokens {a}..{b}) changed the output of token {i} of sequence {t} (FAULTS.md P2)"
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

/// The FAULTS.md examples and edge shapes, as `(name, lengths, extra padding)`.
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
pub fn run_attention_suite(imp: &dyn VarlenAttention, cases: u32) -> Result<Observed, Mismatch> {
    let mut seen = Observed::default();
    for (i, (name, lengths, pad)) in fault_cases().into_iter().enumerate() {
        for (h, d) in [(1, 1), (2, 3)] {
            let case = AttentionCase::seeded(&lengths, h, d, pad, i as u64);
            let o = check_attention(imp, &case)
                .map_err(|m| Mismatch::new(format!("{name}: {}", m.what), m.detail))?;
            seen.merge(o);
        }
    }
    let mut runner = TestRunner::new_with_rng(
        Config {
            cases,
            failure_persistence: None,
            ..Config::default()
        },
        proptest::test_runner::TestRng::deterministic_rng(
            proptest::test_runner::RngAlgorithm::ChaCha,
        ),
    );
    let acc = std::cell::RefCell::new(seen);
    runner
        .run(&attention_cases(), |case| {
            let o = check_attention(imp, &case).map_err(|m| TestCaseError::fail(m.to_string()))?;
            acc.borrow_mut().merge(o);
            Ok(())
        })
        .map_err(|e| Mismatch::new(format!("{} attention suite", imp.name()), e.to_string()))?;
    Ok(acc.into_inner())
}
