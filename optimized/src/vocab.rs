//! Cross-entropy and the fused output layer (`logits = hidden @ weight^T`
//! and its cross-entropy) in `f32`, unsharded and as one vocabulary shard of
//! the sharded algorithm `alg2` (Yeung et al., arXiv:2411.05288, Algorithm 2;
//! `packshard_reference::vocab`).
//!
//! Shapes: `hidden: [n, h]`, `weight: [v, h]` (a shard: `[w_r, h]`),
//! `logits: [n, v]`, `targets: [n]`. The options are the reference's
//! [`LossConfig`] (`ignore_index`, label smoothing in PyTorch's or
//! Megatron's convention, z-loss, `mean` / `sum` / `none`).
//!
//! ## What is computed how
//!
//! Per-element work (logits, `exp`, gradients) is `f32` with SIMD
//! ([`crate::simd`]) on rayon row chunks, products through `gemm`
//! ([`crate::matmul`]). Per-row statistics are the reference's
//! [`SoftmaxStats`] (maximum, `s - 1`, target term, target mass): each tile of
//! a row is summarised in f32 and the summaries are merged with the
//! reference's online-softmax merge in f64; the losses, `logsumexp` and the
//! confident-target and tied-maximum gradient entries come from the
//! reference's formulas on those statistics ([`SoftmaxStats::gradient`],
//! [`SoftmaxStats::delta`]).
//!
//! - [`cross_entropy`]: on given logits (`-inf` allowed).
//! - [`linear_cross_entropy_materialized`]: the whole `[n, v]` logits by one
//!   product, then the row pass and two products: the baseline.
//! - [`linear_cross_entropy_fused`]: chunks of [`Chunks::tokens`] tokens;
//!   for each, tiles of [`Chunks::vocab`] entries: the tile's logits, its
//!   statistics merged into the row's while the tile is in cache; then per
//!   tile the gradient in place, `dL/dhidden += G W`, `dL/dW += G^T x`. Only
//!   a `[tokens, v]` buffer exists; the products are the materialized path's
//!   (no recomputation).
//! - [`alg2`]: one shard of the sharded algorithm: the S pass (local
//!   statistics and the input-gradient partials `s_i D_i`, `B_i` of the
//!   merged record, chunked) and the T pass (the weight gradient of the
//!   shard, logits recomputed chunk by chunk), with the reference's
//!   collectives and merge functions between them.

use ndarray::{s, Array1, Array2, ArrayView2, ArrayViewMut2};
use packshard_reference::vocab::cross_entropy::{check_row, token_loss};
use packshard_reference::vocab::{LossConfig, SoftmaxStats};
use packshard_reference::{Error, Result};
use pulp::{Simd, WithSimd};
use rayon::prelude::*;

use crate::matmul::{matmul, Threads};
use crate::simd::{self, load_tail};

/// The largest `h * max|hidden| * max|weight|` the f32 kernels accept (the
/// reference accepts 1e300): every logit, and every sum of `v` of them, then
/// stays far inside the f32 range (3.4e38).
pub const F32_LOGIT_BOUND: f64 = 1e30;

/// The most logits (`n * v`) the materialized f32 path holds: 2^30 (4 GiB).
pub const MAX_MATERIALIZED_LOGITS: usize = 1 << 30;

/// How the fused kernels chunk the work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunks {
    /// Tokens per chunk (the `[tokens, v]` buffer).
    pub tokens: usize,
    /// Vocabulary entries per tile.
    pub vocab: usize,
}

impl Default for Chunks {
    /// 256 tokens (1/16 of the logits of 4096 tokens) x 4096 entries.
    fn default() -> Self {
        Chunks {
            tokens: 256,
            vocab: 4096,
        }
    }
}

/// The result of a cross-entropy.
#[derive(Debug, Clone, PartialEq)]
pub struct CrossEntropy32 {
    /// The reduced loss (`none`: the sum of `per_token_loss`).
    pub loss: f64,
    /// `[n]`: each token's loss (0 for ignored tokens).
    pub per_token_loss: Array1<f64>,
    /// `[n]`: each row's statistics (ignored rows too).
    pub stats: Vec<SoftmaxStats>,
    /// Tokens whose target is not ignored.
    pub num_tokens: usize,
    /// `[n, v]`: `dL/dlogits` (only [`cross_entropy`] returns it).
    pub grad_logits: Option<Array2<f32>>,
}

impl CrossEntropy32 {
    /// `[n]`: `logsumexp` of each row.
    pub fn logsumexp(&self) -> Array1<f64> {
        self.stats.iter().map(SoftmaxStats::logsumexp).collect()
    }
}

/// The result of an output layer plus cross-entropy.
#[derive(Debug, Clone, PartialEq)]
pub struct LinearCrossEntropy32 {
    /// Loss, per-token losses, statistics.
    pub ce: CrossEntropy32,
    /// `[n, h]`: `dL/dhidden` with gradients.
    pub grad_hidden: Option<Array2<f32>>,
    /// `[v, h]`: `dL/dweight` with gradients.
    pub grad_weight: Option<Array2<f32>>,
    /// Bytes of the logits buffer the kernel held (`[n, v]` materialized,
    /// `[tokens, v]` fused), f32.
    pub logits_buffer_bytes: usize,
}

// ---- validation (the reference's checks, for f32 inputs) ----------------------

/// NaN and `+inf` logits are errors (`-inf` is a masked entry): as
/// `packshard_reference::vocab::cross_entropy::check_logits`, flat index
/// `i * row_len + offset + j` for the first `columns` columns.
///
/// # Errors
/// [`Error::NonFiniteInput`] naming `field`.
pub fn check_logits(
    field: &str,
    z: ArrayView2<f32>,
    columns: usize,
    row_len: usize,
    offset: usize,
) -> Result<()> {
    for ((i, j), &x) in z.indexed_iter() {
        if j < columns && (x.is_nan() || x == f32::INFINITY) {
            return Err(Error::NonFiniteInput {
                field: field.into(),
                index: i * row_len + offset + j,
                value: x as f64,
            });
        }
    }
    Ok(())
}

fn check_finite2(field: &str, x: ArrayView2<f32>, offset: usize) -> Result<()> {
    match x.iter().position(|v| !v.is_finite()) {
        None => Ok(()),
        Some(i) => Err(Error::NonFiniteInput {
            field: field.into(),
            index: offset + i,
            value: x.iter().nth(i).copied().unwrap_or(f32::NAN) as f64,
        }),
    }
}

/// The reference's `check_linear` for f32: `weight: [k, h]` matching
/// `hidden: [n, h]`, finite values (the first `rows` rows of the weight,
/// global flat indices from row `offset`), and logits that stay within
/// [`F32_LOGIT_BOUND`].
///
/// # Errors
/// [`Error::ShapeMismatch`] (`weight`), [`Error::NonFiniteInput`]
/// (`hidden`, `weight`), [`Error::InvalidArgument`] (`hidden`) as the reference.
pub fn check_linear(
    hidden: ArrayView2<f32>,
    weight: ArrayView2<f32>,
    rows: usize,
    offset: usize,
) -> Result<()> {
    let h = hidden.ncols();
    if weight.ncols() != h {
        return Err(Error::ShapeMismatch {
            field: "weight".into(),
            expected: format!("[v, h] with h = {h} (the columns of hidden)"),
            actual: weight.shape().to_vec(),
        });
    }
    check_finite2("hidden", hidden, 0)?;
    let real = weight.slice(s![..rows.min(weight.nrows()), ..]);
    check_finite2("weight", real, offset * h)?;
    let max_abs = |a: ArrayView2<f32>| a.iter().fold(0.0f64, |m, x| m.max(x.abs() as f64));
    let bound = h as f64 * max_abs(hidden) * max_abs(real);
    if bound > F32_LOGIT_BOUND {
        return Err(Error::invalid(
            "hidden",
            format!("h * max|hidden| * max|weight| = {bound:e} is over {F32_LOGIT_BOUND:e}: f32 logits could overflow"),
        ));
    }
    Ok(())
}

fn check_shapes(n: usize, v: usize, targets: &[i64]) -> Result<()> {
    if targets.len() != n {
        return Err(Error::ShapeMismatch {
            field: "targets".into(),
            expected: format!("[n] with n = {n} (the rows of the logits)"),
            actual: vec![targets.len()],
        });
    }
    if v == 0 {
        return Err(Error::ShapeMismatch {
            field: "logits".into(),
            expected: "[n, v] with v >= 1".into(),
            actual: vec![n, v],
        });
    }
    Ok(())
}

// ---- row kernels ----------------------------------------------------------------

/// The target distribution of one row restricted to some columns: `qo` on
/// every column, `qt` on `target` (a column index of the slice) if it is there.
#[derive(Debug, Clone, Copy)]
struct RowQ {
    /// Whether the row counts (its target is not ignored).
    active: bool,
    target: Option<usize>,
    qt: f64,
    qo: f64,
}

impl RowQ {
    fn at(&self, j: usize) -> f64 {
        if !self.active {
            0.0
        } else if Some(j) == self.target {
            self.qt
        } else {
            self.qo
        }
    }

    /// The same row restricted to columns `j0..j0 + width`.
    fn tile(&self, j0: usize, width: usize) -> RowQ {
        RowQ {
            target: self
                .target
                .filter(|&t| t >= j0 && t < j0 + width)
                .map(|t| t - j0),
            ..*self
        }
    }
}

/// The [`SoftmaxStats`] of `z` (finite or `-inf`) under `q`, the sums in f32.
#[inline(always)]
fn row_stats<S: Simd>(simd: S, z: &[f32], q: &RowQ) -> SoftmaxStats {
    let max = simd::max(simd, z);
    let (mut target, mut mass) = (0.0f64, 0.0f64);
    if q.active {
        let mut infinite = false;
        if q.qo > 0.0 && !z.is_empty() {
            mass += q.qo * z.len() as f64;
            if max == f32::NEG_INFINITY {
                // Every column is -inf: infinite, unless the only column is
                // the target, whose weight `qt` is judged below (Megatron's
                // smoothing at 1 gives it `qt = 0`).
                infinite = !(z.len() == 1 && q.target.is_some());
            } else {
                let (head, tail) = S::as_simd_f32s(z);
                let m = simd.splat_f32s(max);
                let mut acc = simd.splat_f32s(0.0);
                for &x in head {
                    acc = simd.add_f32s(acc, simd.sub_f32s(m, x));
                }
                if !tail.is_empty() {
                    acc = simd.add_f32s(acc, simd.sub_f32s(m, load_tail(simd, tail, max)));
                }
                let mut sum = simd.reduce_sum_f32s(acc) as f64;
                if sum == f64::INFINITY {
                    // A -inf column. If it is only the target's, its weight
                    // is `qt`, not `qo` (judged below): sum the others.
                    if let Some(t) = q.target.filter(|&t| z[t] == f32::NEG_INFINITY) {
                        sum = z
                            .iter()
                            .enumerate()
                            .filter(|&(j, _)| j != t)
                            .map(|(_, &x)| f64::from(max - x))
                            .sum();
                    }
                }
                infinite |= sum == f64::INFINITY;
                target += q.qo * sum;
            }
        }
        if let Some(t) = q.target {
            let extra = q.qt - q.qo;
            mass += extra;
            if z[t] == f32::NEG_INFINITY {
                infinite |= q.qt > 0.0;
            } else {
                target += extra * (max as f64 - z[t] as f64);
            }
        }
        if infinite {
            target = f64::INFINITY;
        }
    }
    if max == f32::NEG_INFINITY {
        return SoftmaxStats {
            max: f64::NEG_INFINITY,
            rest: -1.0,
            target,
            mass,
        };
    }
    let (head, tail) = S::as_simd_f32s(z);
    let m = simd.splat_f32s(max);
    let (zero, one) = (simd.splat_f32s(0.0), simd.splat_f32s(1.0));
    let (mut below, mut count) = (zero, zero);
    let mut step = |x: S::f32s| {
        let at_max = simd.equal_f32s(x, m);
        let e = simd::exp(simd, simd.sub_f32s(x, m));
        below = simd.add_f32s(below, simd.select_f32s(at_max, zero, e));
        count = simd.add_f32s(count, simd.select_f32s(at_max, one, zero));
    };
    for &x in head {
        step(x);
    }
    if !tail.is_empty() {
        step(load_tail(simd, tail, f32::NEG_INFINITY));
    }
    let count = simd.reduce_sum_f32s(count) as f64;
    let below = simd.reduce_sum_f32s(below) as f64;
    SoftmaxStats {
        max: max as f64,
        rest: (count - 1.0) + below,
        target,
        mass,
    }
}

/// Overwrites `z` with `w * f(z_j, q_j)` where, for the bulk of the row,
/// `f = a * p - b * q + c * p` with `p = exp(z - m) / s` (vectorised), and
/// for the columns at the maximum `m` or holding the target, `exact(z, q)`
/// (the reference's formula in f64). `p = 0` at `-inf`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn gradient_row<S: Simd>(
    simd: S,
    z: &mut [f32],
    q: &RowQ,
    w: f64,
    m: f64,
    s: f64,
    a: f64,
    b: f64,
    exact: impl Fn(f64, f64) -> f64,
) {
    if w == 0.0 || !q.active {
        z.fill(0.0);
        return;
    }
    // The special columns first, from the logits.
    let mut special: Vec<(usize, f32)> = Vec::new();
    if m != f64::NEG_INFINITY {
        let m32 = m as f32;
        for (j, &x) in z.iter().enumerate() {
            if x == m32 {
                special.push((j, (w * exact(x as f64, q.at(j))) as f32));
            }
        }
    }
    if let Some(t) = q.target {
        if !special.iter().any(|&(j, _)| j == t) {
            special.push((t, (w * exact(z[t] as f64, q.at(t))) as f32));
        }
    }
    if m == f64::NEG_INFINITY || s == 0.0 {
        // No softmax mass here: p = 0, the gradient is -b q.
        let v = (-w * b * q.qo) as f32;
        z.fill(v);
    } else {
        let shift = simd.splat_f32s(m as f32);
        let coef = simd.splat_f32s((w * a / s) as f32);
        let off = simd.splat_f32s((-w * b * q.qo) as f32);
        simd::map_in_place(simd, z, f32::NEG_INFINITY, |x| {
            let p = simd::exp(simd, simd.sub_f32s(x, shift));
            simd.mul_add_f32s(p, coef, off)
        });
    }
    for (j, v) in special {
        z[j] = v;
    }
}

/// The unsharded gradient of a row with statistics `st`: `w ((p - q) + 2 c
/// lse p)` (the reference's [`SoftmaxStats::gradient`]).
#[inline(always)]
fn unsharded_gradient_row<S: Simd>(
    simd: S,
    z: &mut [f32],
    q: &RowQ,
    w: f64,
    st: &SoftmaxStats,
    z_loss: f64,
) {
    let zl = if z_loss == 0.0 {
        0.0
    } else {
        2.0 * z_loss * st.logsumexp()
    };
    gradient_row(
        simd,
        z,
        q,
        w,
        st.max,
        st.sum_exp(),
        1.0 + zl,
        1.0,
        |x, qj| st.gradient(x, qj, z_loss),
    );
}

struct RowsOp<'a, F> {
    rows: &'a mut [f32],
    width: usize,
    first: usize,
    f: &'a F,
}

impl<F: Fn(usize, &mut [f32]) + Sync> RowsOp<'_, F> {
    fn run(self) {
        for (i, row) in self.rows.chunks_mut(self.width).enumerate() {
            (self.f)(self.first + i, row);
        }
    }
}

/// Applies `f(row index, row)` to the rows of `buf: [n, width]` (columns
/// `j0..j0 + tile` of each), in parallel chunks, each chunk in the
/// dispatched SIMD context of `kernel`.
fn for_rows<K>(buf: &mut [f32], width: usize, j0: usize, tile: usize, kernel: K)
where
    K: Fn(pulp::Arch, usize, &mut [f32]) + Sync,
{
    const ROWS: usize = 16;
    if width == 0 {
        return;
    }
    let arch = simd::arch();
    buf.par_chunks_mut(ROWS * width)
        .enumerate()
        .for_each(|(c, chunk)| {
            let f = |i: usize, row: &mut [f32]| kernel(arch, i, &mut row[j0..j0 + tile]);
            RowsOp {
                rows: chunk,
                width,
                first: c * ROWS,
                f: &f,
            }
            .run();
        });
}

/// Row statistics of a tile under SIMD (dispatched).
struct StatsOp<'a> {
    z: &'a [f32],
    q: RowQ,
}

impl WithSimd for StatsOp<'_> {
    type Output = SoftmaxStats;
    #[inline(always)]
    fn with_simd<S: Simd>(self, simd: S) -> SoftmaxStats {
        row_stats(simd, self.z, &self.q)
    }
}

struct GradOp<'a> {
    z: &'a mut [f32],
    q: RowQ,
    w: f64,
    st: SoftmaxStats,
    z_loss: f64,
}

impl WithSimd for GradOp<'_> {
    type Output = ();
    #[inline(always)]
    fn with_simd<S: Simd>(self, simd: S) {
        unsharded_gradient_row(simd, self.z, &self.q, self.w, &self.st, self.z_loss);
    }
}

/// What every row needs: `q`, weights, the options.
struct Rows<'a> {
    q: Vec<RowQ>,
    weights: Vec<f64>,
    targets: Vec<Option<usize>>,
    config: &'a LossConfig,
}

impl<'a> Rows<'a> {
    /// Targets checked against `v` (global ids), restricted to the columns
    /// `start..start + real` of a shard (`start = 0, real = v` unsharded).
    fn new(
        targets: &[i64],
        config: &'a LossConfig,
        v: usize,
        start: usize,
        real: usize,
    ) -> Result<Self> {
        let parsed = config.targets(targets, v)?;
        let (qt, qo) = config.target_distribution(v);
        let weights = config.token_weights(&parsed);
        let q = parsed
            .iter()
            .map(|t| RowQ {
                active: t.is_some(),
                target: t
                    .filter(|&t| t >= start && t < start + real)
                    .map(|t| t - start),
                qt,
                qo,
            })
            .collect();
        Ok(Rows {
            q,
            weights,
            targets: parsed,
            config,
        })
    }

    /// Per-token losses and the loss from whole-row statistics.
    fn losses(&self, stats: &[SoftmaxStats]) -> Result<(Array1<f64>, f64)> {
        for (i, st) in stats.iter().enumerate() {
            check_row(i, st, self.targets[i])?;
        }
        let per_token: Array1<f64> = stats
            .iter()
            .zip(&self.targets)
            .map(|(st, &t)| token_loss(st, t, self.config))
            .collect();
        let loss = self
            .config
            .reduce(per_token.as_slice().expect("contiguous"), &self.targets);
        Ok((per_token, loss))
    }

    fn num_tokens(&self) -> usize {
        self.targets.iter().filter(|t| t.is_some()).count()
    }
}

/// Statistics of the columns `j0..j0 + tile` of every row of `buf: [rows, width]`,
/// merged into `stats` (rows `i0..`).
fn merge_tile_stats(
    buf: &[f32],
    width: usize,
    j0: usize,
    tile: usize,
    rows: &Rows,
    i0: usize,
    stats: &mut [SoftmaxStats],
) {
    let arch = simd::arch();
    stats.par_iter_mut().enumerate().for_each(|(r, st)| {
        let z = &buf[r * width + j0..r * width + j0 + tile];
        let q = rows.q[i0 + r].tile(j0, tile);
        let t = arch.dispatch(StatsOp { z, q });
        *st = st.merge(t);
    });
}

/// The unsharded gradient of the columns `j0..j0 + tile` of every row of
/// `buf` (rows `i0..`), in place.
fn gradient_tile(
    buf: &mut [f32],
    width: usize,
    j0: usize,
    tile: usize,
    rows: &Rows,
    i0: usize,
    stats: &[SoftmaxStats],
) {
    let z_loss = rows.config.z_loss;
    for_rows(buf, width, j0, tile, |arch, r, z| {
        let i = i0 + r;
        arch.dispatch(GradOp {
            z,
            q: rows.q[i].tile(j0, tile),
            w: rows.weights[i],
            st: stats[r],
            z_loss,
        })
    });
}

// ---- unsharded ------------------------------------------------------------------

/// Cross-entropy of `logits: [n, v]` against `targets: [n]` (f32; `-inf`
/// allowed), with `dL/dlogits` when `want_grad`. The semantics of
/// `packshard_reference::vocab::cross_entropy`.
///
/// # Errors
/// As the reference: [`Error::ShapeMismatch`] (`targets`, `logits`),
/// [`Error::NonFiniteInput`] (`logits`, NaN or `+inf`), the option errors,
/// [`Error::IndexOutOfRange`] (`targets`), [`Error::InvalidArgument`]
/// (`logits[i]` all `-inf` with a target).
pub fn cross_entropy(
    logits: ArrayView2<f32>,
    targets: &[i64],
    config: &LossConfig,
    want_grad: bool,
) -> Result<CrossEntropy32> {
    let (n, v) = logits.dim();
    check_shapes(n, v, targets)?;
    check_logits("logits", logits, v, v, 0)?;
    config.validate(v)?;
    let rows = Rows::new(targets, config, v, 0, v)?;
    let mut buf = logits.as_standard_layout().into_owned();
    let mut stats = vec![SoftmaxStats::EMPTY; n];
    merge_tile_stats(
        buf.as_slice().expect("standard layout"),
        v,
        0,
        v,
        &rows,
        0,
        &mut stats,
    );
    let (per_token_loss, loss) = rows.losses(&stats)?;
    let grad_logits = if want_grad {
        gradient_tile(
            buf.as_slice_mut().expect("standard layout"),
            v,
            0,
            v,
            &rows,
            0,
            &stats,
        );
        Some(buf)
    } else {
        None
    };
    Ok(CrossEntropy32 {
        loss,
        per_token_loss,
        stats,
        num_tokens: rows.num_tokens(),
        grad_logits,
    })
}

fn check_linear_inputs(
    hidden: ArrayView2<f32>,
    weight: ArrayView2<f32>,
    targets: &[i64],
    config: &LossConfig,
) -> Result<()> {
    let (n, v) = (hidden.nrows(), weight.nrows());
    check_shapes(n, v, targets)?;
    check_linear(hidden, weight, v, 0)?;
    config.validate(v)?;
    config.targets(targets, v)?;
    Ok(())
}

/// The output layer with the whole logits materialized: `logits = hidden
/// @ weight^T` (`[n, v]`, one product), the row statistics and losses, and
/// with `want_grad` the gradient in place and `dL/dhidden = G W`, `dL/dW =
/// G^T hidden`. The baseline of [`linear_cross_entropy_fused`].
///
/// # Errors
/// As `packshard_reference::vocab::linear_cross_entropy` (with
/// [`F32_LOGIT_BOUND`]); [`Error::InvalidArgument`] (`weight`) when `n * v`
/// is over [`MAX_MATERIALIZED_LOGITS`].
pub fn linear_cross_entropy_materialized(
    hidden: ArrayView2<f32>,
    weight: ArrayView2<f32>,
    targets: &[i64],
    config: &LossConfig,
    want_grad: bool,
) -> Result<LinearCrossEntropy32> {
    check_linear_inputs(hidden, weight, targets, config)?;
    let (n, v) = (hidden.nrows(), weight.nrows());
    if n.checked_mul(v).is_none_or(|x| x > MAX_MATERIALIZED_LOGITS) {
        return Err(Error::invalid(
            "weight",
            format!("{n} tokens x {v} vocabulary entries is over the {MAX_MATERIALIZED_LOGITS} logits the materialized path may hold"),
        ));
    }
    let rows = Rows::new(targets, config, v, 0, v)?;
    let mut logits = Array2::zeros((n, v));
    matmul(logits.view_mut(), hidden, weight.t(), false, Threads::All);
    let mut stats = vec![SoftmaxStats::EMPTY; n];
    merge_tile_stats(
        logits.as_slice().expect("fresh"),
        v,
        0,
        v,
        &rows,
        0,
        &mut stats,
    );
    let (per_token_loss, loss) = rows.losses(&stats)?;
    let (mut grad_hidden, mut grad_weight) = (None, None);
    if want_grad {
        gradient_tile(
            logits.as_slice_mut().expect("fresh"),
            v,
            0,
            v,
            &rows,
            0,
            &stats,
        );
        let mut gh = Array2::zeros(hidden.dim());
        matmul(gh.view_mut(), logits.view(), weight, false, Threads::All);
        let mut gw = Array2::zeros(weight.dim());
        matmul(gw.view_mut(), logits.t(), hidden, false, Threads::All);
        grad_hidden = Some(gh);
        grad_weight = Some(gw);
    }
    Ok(LinearCrossEntropy32 {
        ce: CrossEntropy32 {
            loss,
            per_token_loss,
            stats,
            num_tokens: rows.num_tokens(),
            grad_logits: None,
        },
        grad_hidden,
        grad_weight,
        logits_buffer_bytes: 4 * n * v,
    })
}

fn check_chunks(chunks: Chunks) -> Result<()> {
    if chunks.tokens == 0 || chunks.vocab == 0 {
        return Err(Error::invalid(
            "chunks",
            format!("{chunks:?}: tokens and vocab must be at least 1"),
        ));
    }
    Ok(())
}

/// The output layer and its cross-entropy, fused and chunked (see the module
/// docs): the same results as [`linear_cross_entropy_materialized`] while
/// holding a `[min(n, chunks.tokens), v]` buffer instead of `[n, v]`.
///
/// # Errors
/// As `packshard_reference::vocab::linear_cross_entropy` (with
/// [`F32_LOGIT_BOUND`], and no bound on `n * v`: nothing of that size
/// exists); [`Error::InvalidArgument`] (`chunks`) for a zero chunk size.
pub fn linear_cross_entropy_fused(
    hidden: ArrayView2<f32>,
    weight: ArrayView2<f32>,
    targets: &[i64],
    config: &LossConfig,
    want_grad: bool,
    chunks: Chunks,
) -> Result<LinearCrossEntropy32> {
    check_linear_inputs(hidden, weight, targets, config)?;
    check_chunks(chunks)?;
    let (n, v) = (hidden.nrows(), weight.nrows());
    let rows = Rows::new(targets, config, v, 0, v)?;
    let tn = chunks.tokens.min(n).max(1);
    let mut buf = Array2::<f32>::zeros((tn, v));
    let mut stats = vec![SoftmaxStats::EMPTY; n];
    let mut grads = want_grad.then(|| {
        (
            Array2::<f32>::zeros(hidden.dim()),
            Array2::<f32>::zeros(weight.dim()),
        )
    });
    for i0 in (0..n).step_by(tn) {
        let m = (n - i0).min(tn);
        let x = hidden.slice(s![i0..i0 + m, ..]);
        let mut b = buf.slice_mut(s![..m, ..]);
        for j0 in (0..v).step_by(chunks.vocab) {
            let tile = (v - j0).min(chunks.vocab);
            matmul(
                b.slice_mut(s![.., j0..j0 + tile]),
                x,
                weight.slice(s![j0..j0 + tile, ..]).t(),
                false,
                Threads::All,
            );
            merge_tile_stats(
                b.as_slice().expect("rows of a standard buffer"),
                v,
                j0,
                tile,
                &rows,
                i0,
                &mut stats[i0..i0 + m],
            );
        }
        // The whole row's statistics exist now: losses are checked at the
        // end, gradients can be formed tile by tile.
        if let Some((gh, gw)) = grads.as_mut() {
            for j0 in (0..v).step_by(chunks.vocab) {
                let tile = (v - j0).min(chunks.vocab);
                gradient_tile(
                    b.as_slice_mut().expect("rows of a standard buffer"),
                    v,
                    j0,
                    tile,
                    &rows,
                    i0,
                    &stats[i0..i0 + m],
                );
                let g = b.slice(s![.., j0..j0 + tile]);
                matmul(
                    gh.slice_mut(s![i0..i0 + m, ..]),
                    g,
                    weight.slice(s![j0..j0 + tile, ..]),
                    true,
                    Threads::All,
                );
                matmul(
                    gw.slice_mut(s![j0..j0 + tile, ..]),
                    g.t(),
                    x,
                    true,
                    Threads::All,
                );
            }
        }
    }
    let (per_token_loss, loss) = rows.losses(&stats)?;
    let (grad_hidden, grad_weight) = match grads {
        Some((gh, gw)) => (Some(gh), Some(gw)),
        None => (None, None),
    };
    Ok(LinearCrossEntropy32 {
        ce: CrossEntropy32 {
            loss,
            per_token_loss,
            stats,
            num_tokens: rows.num_tokens(),
            grad_logits: None,
        },
        grad_hidden,
        grad_weight,
        logits_buffer_bytes: 4 * tn * v,
    })
}

/// `[rows, cols]` mutable view helper for the shard passes.
fn rows_view(buf: &mut Array2<f32>, m: usize) -> ArrayViewMut2<'_, f32> {
    buf.slice_mut(s![..m, ..])
}

pub mod alg2 {
    //! One vocabulary shard of `alg2` (Yeung et al., Algorithm 2; the
    //! reference's `sharded` module), per rank over a [`Collective`]:
    //!
    //! - **S pass**, chunked over tokens and vocabulary: the local
    //!   statistics `(m_i, s_i, target term)` of each row over the shard's
    //!   real columns, then `D_i = (softmax'_i - q_i) W_i` (one product per
    //!   tile with the local deltas), `B_i = q_i W_i`, and with the z-loss
    //!   `A_i = softmax'_i W_i = D_i + B_i`, into the reference's record
    //!   `[stats, s_i D_i, B_i (, s_i A_i)]`;
    //! - **the one barrier**: the reference's merge ([`merge_alg2`],
    //!   [`merge_alg2_z_loss`]) in the collective, which gives the global
    //!   statistics and `dL/dhidden` (no further communication);
    //! - **T pass**: the logits recomputed chunk by chunk, `dL/dz_i =
    //!   alpha_i (softmax'_i - q_i) + (alpha_i - 1) q_i (+ z-loss)` in place,
    //!   `dL/dW_i += G^T hidden`.
    //!
    //! No `[n, w_r]` buffer exists (the reference's alg2 keeps the shard's
    //! logits between S and T; this one recomputes them: four products
    //! instead of three). The record and the merge are f64, the rest f32.

    use super::*;
    use packshard_reference::vocab::cross_entropy::STATS_WIDTH;
    use packshard_reference::vocab::sharded::{
        check_rank_inputs, merge_alg2, merge_alg2_z_loss, merge_stats, RankLoss, ShardedLoss,
    };
    use packshard_reference::vocab::{run_ranks, Collective, Reduce, ShardMap, ShardedAlgorithm};

    /// The local and global statistics of a row: `alpha_i` and `alpha_i - 1`
    /// as the reference's alg2 forms them.
    fn alphas(l: &SoftmaxStats, g: &SoftmaxStats) -> (f64, f64) {
        let alpha = l.sum_exp() * l.scale_to(g.max) / g.sum_exp();
        let minus_1 = if l.max == g.max {
            (l.rest - g.rest) / g.sum_exp()
        } else {
            alpha - 1.0
        };
        (alpha, minus_1)
    }

    /// `softmax'_i - q_i` of one logit against the local statistics (the
    /// stable form at the maximum; `-q` for an all `-inf` shard).
    fn local_delta(l: &SoftmaxStats, z: f64, q: f64) -> f64 {
        if l.sum_exp() == 0.0 {
            -q
        } else {
            l.delta(z, q)
        }
    }

    fn local_prob(l: &SoftmaxStats, z: f64) -> f64 {
        if l.sum_exp() == 0.0 {
            0.0
        } else {
            l.probability(z)
        }
    }

    struct DeltaOp<'a> {
        z: &'a mut [f32],
        q: RowQ,
        l: SoftmaxStats,
    }

    impl WithSimd for DeltaOp<'_> {
        type Output = ();
        #[inline(always)]
        fn with_simd<S: Simd>(self, simd: S) {
            let l = self.l;
            gradient_row(
                simd,
                self.z,
                &self.q,
                1.0,
                l.max,
                l.sum_exp(),
                1.0,
                1.0,
                |x, q| local_delta(&l, x, q),
            );
        }
    }

    struct TOp<'a> {
        z: &'a mut [f32],
        q: RowQ,
        w: f64,
        l: SoftmaxStats,
        g: SoftmaxStats,
        z_loss: f64,
    }

    impl WithSimd for TOp<'_> {
        type Output = ();
        #[inline(always)]
        fn with_simd<S: Simd>(self, simd: S) {
            let (l, g, c) = (self.l, self.g, self.z_loss);
            let (alpha, am1) = alphas(&l, &g);
            let zl = if c == 0.0 {
                0.0
            } else {
                2.0 * c * g.logsumexp()
            };
            // w (alpha (p' - q) + (alpha - 1) q + zl alpha p')
            //   = w ((alpha + zl alpha) p' - (alpha - am1) q)
            gradient_row(
                simd,
                self.z,
                &self.q,
                self.w,
                l.max,
                l.sum_exp(),
                alpha * (1.0 + zl),
                alpha - am1,
                |x, q| alpha * local_delta(&l, x, q) + am1 * q + zl * alpha * local_prob(&l, x),
            );
        }
    }

    /// A rank's shard and what it may read.
    struct Shard<'a> {
        comm: &'a dyn Collective,
        rank: usize,
        start: usize,
        width: usize,
        real: usize,
        rows: Rows<'a>,
    }

    fn shard<'a>(
        comm: &'a dyn Collective,
        map: &ShardMap,
        n: usize,
        targets: &[i64],
        config: &'a LossConfig,
    ) -> Result<Shard<'a>> {
        check_rank_inputs(comm, map, n, targets, config)?;
        let v = map.vocab_size();
        let s = map.shard(comm.rank());
        Ok(Shard {
            comm,
            rank: s.rank,
            start: s.start,
            width: s.width,
            real: s.real,
            rows: Rows::new(targets, config, v, s.start, s.real)?,
        })
    }

    impl Shard<'_> {
        /// The barrier: merges the records; returns the global statistics.
        fn barrier(
            &self,
            record: &mut [f64],
            width: usize,
            blocks: usize,
        ) -> Result<Vec<SoftmaxStats>> {
            let op: packshard_reference::vocab::collective::MergeFn = match blocks {
                0 => merge_stats,
                2 => merge_alg2,
                _ => merge_alg2_z_loss,
            };
            self.comm.all_reduce(&mut [Reduce::Merge {
                data: record,
                width,
                op,
            }])?;
            Ok(record
                .chunks(width)
                .map(SoftmaxStats::from_record)
                .collect())
        }

        #[allow(clippy::too_many_arguments)]
        fn output(
            &self,
            (per_token_loss, loss): (Array1<f64>, f64),
            local: Vec<SoftmaxStats>,
            global: Vec<SoftmaxStats>,
            grad_logits: Option<Array2<f64>>,
            grad_hidden: Option<Array2<f64>>,
            grad_weight: Option<Array2<f64>>,
            peak_bytes: usize,
        ) -> RankLoss {
            RankLoss {
                rank: self.rank,
                loss,
                per_token_loss,
                local,
                global,
                grad_logits,
                grad_hidden,
                grad_weight,
                counts: self.comm.counts(),
                peak_bytes,
            }
        }

        /// `T` pass gradient of the tile `j0..j0 + tile` of rows `i0..` in `buf`.
        fn t_tile(
            &self,
            buf: &mut [f32],
            j0: usize,
            tile: usize,
            i0: usize,
            local: &[SoftmaxStats],
            global: &[SoftmaxStats],
        ) {
            let z_loss = self.rows.config.z_loss;
            let rows = &self.rows;
            for_rows(buf, self.real, j0, tile, |arch, r, z| {
                let i = i0 + r;
                arch.dispatch(TOp {
                    z,
                    q: rows.q[i].tile(j0, tile),
                    w: rows.weights[i],
                    l: local[i],
                    g: global[i],
                    z_loss,
                })
            });
        }
    }

    /// `alg2` on one rank, from its shard of the logits `logits: [n, w_r]`
    /// (f32; padding columns never read) and the replicated `targets: [n]`.
    /// The semantics (and errors) of the reference's `cross_entropy_rank`
    /// with `ShardedAlgorithm::Alg2`; the gradient `[n, w_r]` (padding
    /// columns 0) with `want_grad`.
    ///
    /// # Errors
    /// As the reference.
    pub fn cross_entropy_rank(
        comm: &dyn Collective,
        map: &ShardMap,
        logits: ArrayView2<f32>,
        targets: &[i64],
        config: &LossConfig,
        want_grad: bool,
    ) -> Result<RankLoss> {
        let n = logits.nrows();
        let sh = shard(comm, map, n, targets, config)?;
        if logits.ncols() != sh.width {
            return Err(Error::ShapeMismatch {
                field: "logits".into(),
                expected: format!("[n, w_r] with w_r = {} (shard {})", sh.width, sh.rank),
                actual: logits.shape().to_vec(),
            });
        }
        check_logits("logits", logits, sh.real, map.vocab_size(), sh.start)?;
        let mut z = logits
            .slice(s![.., ..sh.real])
            .as_standard_layout()
            .into_owned();
        let mut local = vec![SoftmaxStats::EMPTY; n];
        merge_tile_stats(
            z.as_slice().expect("standard"),
            sh.real,
            0,
            sh.real,
            &sh.rows,
            0,
            &mut local,
        );
        let mut record: Vec<f64> = local.iter().flat_map(|s| s.to_record()).collect();
        let global = sh.barrier(&mut record, STATS_WIDTH, 0)?;
        let forward = sh.rows.losses(&global)?;
        let peak = 4 * n * sh.real + 8 * STATS_WIDTH * n;
        if !want_grad {
            return Ok(sh.output(forward, local, global, None, None, None, peak));
        }
        sh.t_tile(
            z.as_slice_mut().expect("standard"),
            0,
            sh.real,
            0,
            &local,
            &global,
        );
        let mut g = Array2::zeros((n, sh.width));
        g.slice_mut(s![.., ..sh.real]).assign(&z.mapv(f64::from));
        Ok(sh.output(forward, local, global, Some(g), None, None, peak))
    }

    /// `alg2` on one rank for the output layer: `hidden: [n, h]`
    /// (replicated), this rank's rows `weight: [w_r, h]` (padding rows never
    /// read), `targets: [n]`. Chunked as `chunks` says; with `want_grad`,
    /// `dL/dhidden` (replicated) and this shard's `dL/dW` (padding rows 0), and
    /// with `keep_grad_logits` also `dL/dz` of the shard `[n, w_r]` (for
    /// checking: that buffer is what the fused kernel avoids).
    ///
    /// # Errors
    /// As the reference's `linear_cross_entropy_rank` (with
    /// [`F32_LOGIT_BOUND`]); [`Error::InvalidArgument`] (`chunks`).
    #[allow(clippy::too_many_arguments)]
    pub fn linear_cross_entropy_rank(
        comm: &dyn Collective,
        map: &ShardMap,
        hidden: ArrayView2<f32>,
        weight: ArrayView2<f32>,
        targets: &[i64],
        config: &LossConfig,
        want_grad: bool,
        chunks: Chunks,
        keep_grad_logits: bool,
    ) -> Result<RankLoss> {
        let (n, h) = hidden.dim();
        let sh = shard(comm, map, n, targets, config)?;
        if weight.nrows() != sh.width {
            return Err(Error::ShapeMismatch {
                field: "weight".into(),
                expected: format!("[w_r, h] with w_r = {} (shard {})", sh.width, sh.rank),
                actual: weight.shape().to_vec(),
            });
        }
        check_linear(hidden, weight, sh.real, sh.start)?;
        check_chunks(chunks)?;
        let w_real = weight.slice(s![..sh.real, ..]);
        let real = sh.real;
        let tn = chunks.tokens.min(n).max(1);
        let tv = chunks.vocab;
        let mut buf = Array2::<f32>::zeros((tn, real));
        let c = config.z_loss;
        let blocks = match (want_grad, c > 0.0) {
            (false, _) => 0,
            (true, false) => 2,
            (true, true) => 3,
        };
        let width = STATS_WIDTH + blocks * h;
        let mut record = vec![0.0f64; width * n];
        let mut local = vec![SoftmaxStats::EMPTY; n];
        // B_i = q_other colsum(W) + (q_target - q_other) W_t (f64 sums).
        let colsum: Vec<f64> = if blocks > 0 && sh.rows.q.first().is_some_and(|q| q.qo != 0.0) {
            (0..h)
                .map(|k| w_real.column(k).iter().map(|&x| x as f64).sum())
                .collect()
        } else {
            vec![0.0; h]
        };
        let mut d_chunk = Array2::<f32>::zeros((tn, h));
        // S pass.
        for i0 in (0..n).step_by(tn) {
            let m = (n - i0).min(tn);
            let x = hidden.slice(s![i0..i0 + m, ..]);
            let mut b = rows_view(&mut buf, m);
            for j0 in (0..real).step_by(tv) {
                let tile = (real - j0).min(tv);
                matmul(
                    b.slice_mut(s![.., j0..j0 + tile]),
                    x,
                    w_real.slice(s![j0..j0 + tile, ..]).t(),
                    false,
                    Threads::All,
                );
                merge_tile_stats(
                    b.as_slice().expect("standard rows"),
                    real,
                    j0,
                    tile,
                    &sh.rows,
                    i0,
                    &mut local[i0..i0 + m],
                );
            }
            if blocks > 0 {
                let mut d = d_chunk.slice_mut(s![..m, ..]);
                d.fill(0.0);
                for j0 in (0..real).step_by(tv) {
                    let tile = (real - j0).min(tv);
                    for_rows(
                        b.as_slice_mut().expect("standard rows"),
                        real,
                        j0,
                        tile,
                        |arch, r, z| {
                            arch.dispatch(DeltaOp {
                                z,
                                q: sh.rows.q[i0 + r].tile(j0, tile),
                                l: local[i0 + r],
                            })
                        },
                    );
                    matmul(
                        d.view_mut(),
                        b.slice(s![.., j0..j0 + tile]),
                        w_real.slice(s![j0..j0 + tile, ..]),
                        true,
                        Threads::All,
                    );
                }
                for r in 0..m {
                    let i = i0 + r;
                    let q = &sh.rows.q[i];
                    let at = i * width + STATS_WIDTH;
                    let s_i = local[i].sum_exp();
                    for k in 0..h {
                        let d_ik = d[[r, k]] as f64;
                        let mut b_ik = 0.0;
                        if q.active {
                            b_ik = q.qo * colsum[k];
                            if let Some(t) = q.target {
                                b_ik += (q.qt - q.qo) * w_real[[t, k]] as f64;
                            }
                        }
                        record[at + k] = s_i * d_ik;
                        record[at + h + k] = b_ik;
                        if blocks == 3 {
                            record[at + 2 * h + k] = s_i * (d_ik + b_ik);
                        }
                    }
                }
            }
        }
        for (i, l) in local.iter().enumerate() {
            record[i * width..i * width + STATS_WIDTH].copy_from_slice(&l.to_record());
        }
        // The one barrier.
        let global = sh.barrier(&mut record, width, blocks)?;
        let forward = sh.rows.losses(&global)?;
        let peak = 4 * tn * (real + h) + 8 * width * n;
        if !want_grad {
            return Ok(sh.output(forward, local, global, None, None, None, peak));
        }
        // dL/dx from the merged record: w (Y / S + 2 c lse U / S).
        let gx = Array2::from_shape_fn((n, h), |(i, k)| {
            let w = sh.rows.weights[i];
            if w == 0.0 {
                return 0.0;
            }
            let g = &global[i];
            let at = i * width + STATS_WIDTH;
            let y = record[at + k] / g.sum_exp();
            let z_part = if blocks == 3 {
                2.0 * c * g.logsumexp() * (record[at + 2 * h + k] / g.sum_exp())
            } else {
                0.0
            };
            w * (y + z_part)
        });
        // T pass: recompute the logits, the gradient in place, dW += G^T x.
        let mut gw = Array2::<f32>::zeros((sh.width, h));
        let mut gz = keep_grad_logits.then(|| Array2::<f64>::zeros((n, sh.width)));
        for i0 in (0..n).step_by(tn) {
            let m = (n - i0).min(tn);
            let x = hidden.slice(s![i0..i0 + m, ..]);
            let mut b = rows_view(&mut buf, m);
            for j0 in (0..real).step_by(tv) {
                let tile = (real - j0).min(tv);
                matmul(
                    b.slice_mut(s![.., j0..j0 + tile]),
                    x,
                    w_real.slice(s![j0..j0 + tile, ..]).t(),
                    false,
                    Threads::All,
                );
                sh.t_tile(
                    b.as_slice_mut().expect("standard rows"),
                    j0,
                    tile,
                    i0,
                    &local,
                    &global,
                );
                matmul(
                    gw.slice_mut(s![j0..j0 + tile, ..]),
                    b.slice(s![.., j0..j0 + tile]).t(),
                    x,
                    true,
                    Threads::All,
                );
            }
            if let Some(gz) = gz.as_mut() {
                gz.slice_mut(s![i0..i0 + m, ..real])
                    .assign(&b.mapv(f64::from));
            }
        }
        Ok(sh.output(
            forward,
            local,
            global,
            gz,
            Some(gx),
            Some(gw.mapv(f64::from)),
            peak,
        ))
    }

    fn validate(n: usize, targets: &[i64], config: &LossConfig, v: usize) -> Result<()> {
        if targets.len() != n {
            return Err(Error::ShapeMismatch {
                field: "targets".into(),
                expected: format!("[n] with n = {n} (the rows of the logits)"),
                actual: vec![targets.len()],
            });
        }
        config.validate(v)?;
        config.targets(targets, v)?;
        Ok(())
    }

    fn finish(
        map: &ShardMap,
        ranks: Vec<packshard_reference::vocab::collective::RankResult<RankLoss>>,
    ) -> ShardedLoss {
        ShardedLoss {
            map: *map,
            ranks: ranks.into_iter().map(|r| r.output).collect(),
        }
    }

    /// `alg2` on `p` in-process ranks over `logits: [n, w]` (f32, `w >= v`,
    /// columns `v..` padding, never read): the reference's
    /// `sharded_cross_entropy` with `ShardedAlgorithm::Alg2`.
    ///
    /// # Errors
    /// As the reference (validation in the same order).
    pub fn sharded_cross_entropy(
        map: &ShardMap,
        logits: ArrayView2<f32>,
        targets: &[i64],
        config: &LossConfig,
        want_grad: bool,
    ) -> Result<ShardedLoss> {
        let (n, w) = logits.dim();
        let v = map.vocab_size();
        map.check_width("logits", w, &[n, w], "[n, v]")?;
        validate(n, targets, config, v)?;
        check_logits("logits", logits, v, v, 0)?;
        let parts: Vec<Array2<f32>> = map
            .shards()
            .iter()
            .map(|s| {
                Array2::from_shape_fn((n, s.width), |(i, j)| {
                    let g = s.start + j;
                    if g < w {
                        logits[[i, g]]
                    } else {
                        f32::NAN
                    }
                })
            })
            .collect();
        let ranks = run_ranks(map.num_shards(), |comm| {
            cross_entropy_rank(
                comm,
                map,
                parts[comm.rank()].view(),
                targets,
                config,
                want_grad,
            )
        })?;
        Ok(finish(map, ranks))
    }

    /// `alg2` on `p` in-process ranks for the output layer: `hidden: [n, h]`,
    /// `weight: [w, h]` (`w >= v`, rows `v..` padding, never read).
    ///
    /// # Errors
    /// As the reference's `sharded_linear_cross_entropy` (with
    /// [`F32_LOGIT_BOUND`] and no bound on `n * v`).
    #[allow(clippy::too_many_arguments)]
    pub fn sharded_linear_cross_entropy(
        map: &ShardMap,
        hidden: ArrayView2<f32>,
        weight: ArrayView2<f32>,
        targets: &[i64],
        config: &LossConfig,
        want_grad: bool,
        chunks: Chunks,
        keep_grad_logits: bool,
    ) -> Result<ShardedLoss> {
        let n = hidden.nrows();
        let v = map.vocab_size();
        map.check_width("weight", weight.nrows(), weight.shape(), "[v, h]")?;
        validate(n, targets, config, v)?;
        check_linear(hidden, weight, v, 0)?;
        check_chunks(chunks)?;
        let h = hidden.ncols();
        let rows = weight.nrows();
        let parts: Vec<Array2<f32>> = map
            .shards()
            .iter()
            .map(|s| {
                Array2::from_shape_fn((s.width, h), |(j, k)| {
                    let g = s.start + j;
                    if g < rows {
                        weight[[g, k]]
                    } else {
                        f32::NAN
                    }
                })
            })
            .collect();
        let ranks = run_ranks(map.num_shards(), |comm| {
            linear_cross_entropy_rank(
                comm,
                map,
                hidden,
                parts[comm.rank()].view(),
                targets,
                config,
                want_grad,
                chunks,
                keep_grad_logits,
            )
        })?;
        Ok(finish(map, ranks))
    }

    /// The algorithm this module implements.
    pub const ALGORITHM: ShardedAlgorithm = ShardedAlgorithm::Alg2;
}
