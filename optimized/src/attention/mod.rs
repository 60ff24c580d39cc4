//! Variable-length attention (flash-attention's `flash_attn_varlen_func`
//! form) and its dense masked twin, forward and backward, in `f32`.
//!
//! Shapes as in `packshard_reference::bert::attention`: `q, k, v: [n_tok, h,
//! d]`, `cu_seqlens: [b + 1]` (leading 0, last `n_tok`), outputs `[n_tok, h,
//! d]`, `lse: [h, n_tok]` (natural log).
//!
//! ## How it works (Dao et al., FlashAttention-2, Algorithms 1 and 2)
//!
//! The work items are the pairs (segment, head) — for the dense form (row,
//! head) — run on rayon. An item gathers its head's rows of `q`, `k`, `v`
//! into contiguous tiles (zero-padded to multiples of [`BLOCK_Q`] /
//! [`BLOCK_K`] rows and of the SIMD width in `d`), then for each block of
//! [`BLOCK_Q`] queries streams the keys in tiles of [`BLOCK_K`]: scores `S =
//! scale Q K^T` for the tile, masked entries set to `-inf`, the running
//! maximum `m` and sum `l` updated with the online softmax (Milakov &
//! Gimelshein 2018), the accumulator rescaled and `P V` added; at the end
//! `o = acc / l` and `lse = m + ln l`. Nothing of size `[n_tok, n_tok]` (or `[len, len]`) exists, and no score
//! is computed across segments.
//!
//! The backward recomputes `P = exp(S - lse)` tile by tile (key tiles outer,
//! query blocks inner), with `delta_i = dO_i . O_i`, `dS = P (dP - delta)`:
//! `dV += P^T dO`, `dP = dO V^T`, `dQ += scale dS K`, `dK += scale dS^T Q`.
//!
//! The tile products run through [`crate::simd::mm_acc`], so a score, a sum
//! or an output of a query depends only on its own segment's tiles: the
//! varlen form and the dense form of a padded row give **bitwise equal**
//! outputs, `lse` and gradients for the real tokens (masked keys contribute
//! exact zeros; the tiles start at the segment's, or the row's, first token).
//!
//! A query with no allowed key (dense form only) gets output 0, `lse = -inf`
//! and zero gradients (docs/FAULTS.md P8).
//!
//! Inputs may be `f32` or `bf16` ([`Element`]); every sum is in `f32`.

use half::bf16;
use ndarray::{Array2, Array3, ArrayView2, ArrayView3, CowArray, Ix3};
use packshard_reference::bert::attention::{
    check_cu_seqlens, check_grad_shapes, check_mask_shape, check_qkv_same_shapes,
};
use packshard_reference::{Error, Result};
use pulp::{Simd, WithSimd};
use rayon::prelude::*;

use crate::simd::{self, mm_acc, mm_col_multiple};

/// Queries per block.
pub const BLOCK_Q: usize = 64;
/// Keys per tile.
pub const BLOCK_K: usize = 64;

/// An input element: `f32`, or `bf16` widened to `f32` as the tiles are
/// gathered (f32 accumulation throughout).
pub trait Element: Copy + Send + Sync + 'static {
    /// The value as `f32` (exact for both types).
    fn to_f32(self) -> f32;
}

impl Element for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}

impl Element for bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}

/// Output of a forward pass.
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionOutput32 {
    /// `[n_tok, h, d]`.
    pub output: Array3<f32>,
    /// `[h, n_tok]`, natural log; `-inf` for a query with no allowed key.
    pub lse: Array2<f32>,
}

/// Gradients of a backward pass, each `[n_tok, h, d]`.
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionGrads32 {
    /// `dL/dq`.
    pub grad_q: Array3<f32>,
    /// `dL/dk`.
    pub grad_k: Array3<f32>,
    /// `dL/dv`.
    pub grad_v: Array3<f32>,
}

/// Which keys a query of a work item may see.
#[derive(Clone, Copy)]
enum Mask<'a> {
    /// Its own segment (all of it, or up to itself when causal).
    Segment { causal: bool },
    /// A dense `[row_len, row_len]` mask of its row.
    Dense(&'a ArrayView2<'a, bool>),
}

#[derive(Clone, Copy)]
struct Item<'a> {
    /// First token of the segment (row).
    start: usize,
    /// Tokens in it.
    len: usize,
    head: usize,
    mask: Mask<'a>,
}

/// The input tensors of a problem, flat `[n_tok, h, d]` (row-major).
#[derive(Clone, Copy)]
struct Problem<'a, T> {
    q: &'a [T],
    k: &'a [T],
    v: &'a [T],
    h: usize,
    d: usize,
    scale: f32,
}

fn round_up(x: usize, to: usize) -> usize {
    x.div_ceil(to) * to
}

/// `[rows, dp]` tile of head `head` rows `start..start + len` (zero-padded).
fn gather<T: Element>(x: &[T], h: usize, d: usize, it: &Item, rows: usize, dp: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; rows * dp];
    for i in 0..it.len {
        let src = &x[((it.start + i) * h + it.head) * d..][..d];
        for (o, &s) in out[i * dp..i * dp + d].iter_mut().zip(src) {
            *o = s.to_f32();
        }
    }
    out
}

/// `[dp, rows]`: the transpose of [`gather`].
fn gather_t<T: Element>(
    x: &[T],
    h: usize,
    d: usize,
    it: &Item,
    rows: usize,
    dp: usize,
) -> Vec<f32> {
    let mut out = vec![0.0f32; dp * rows];
    for i in 0..it.len {
        let src = &x[((it.start + i) * h + it.head) * d..][..d];
        for (c, &s) in src.iter().enumerate() {
            out[c * rows + i] = s.to_f32();
        }
    }
    out
}

/// Sets the scores of keys a query may not see to `-inf` (after scaling):
/// `s: [BLOCK_Q, BLOCK_K]` for queries `q0..` and keys `k0..` of the item.
fn apply_mask(s: &mut [f32], it: &Item, q0: usize, k0: usize) {
    let len = it.len;
    for r in 0..BLOCK_Q {
        let i = q0 + r;
        let row = &mut s[r * BLOCK_K..(r + 1) * BLOCK_K];
        match it.mask {
            Mask::Segment { causal } => {
                let mut end = len.saturating_sub(k0).min(BLOCK_K);
                if causal {
                    end = end.min((i + 1).saturating_sub(k0));
                }
                row[end..].fill(f32::NEG_INFINITY);
            }
            Mask::Dense(allowed) => {
                for (j, x) in row.iter_mut().enumerate() {
                    let key = k0 + j;
                    if i >= len || key >= len || !allowed[[i, key]] {
                        *x = f32::NEG_INFINITY;
                    }
                }
            }
        }
    }
}

/// Whether the whole key tile at `k0` is hidden from the query block at
/// `q0` by causality (then skipping it changes nothing: its terms are exact
/// zeros).
fn causal_skip(it: &Item, q0: usize, k0: usize) -> bool {
    matches!(it.mask, Mask::Segment { causal: true }) && k0 > q0 + BLOCK_Q - 1
}

/// `S = scale Q_blk K_tile^T` with the mask: `s: [BLOCK_Q, BLOCK_K]`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn scores<S: Simd>(
    simd: S,
    s: &mut [f32],
    qh: &[f32],
    kt: &[f32],
    lp: usize,
    dp: usize,
    it: &Item,
    q0: usize,
    k0: usize,
    scale: f32,
) {
    s.fill(0.0);
    mm_acc(
        simd,
        BLOCK_Q,
        BLOCK_K,
        dp,
        &qh[q0 * dp..],
        dp,
        &kt[k0..],
        lp,
        s,
        BLOCK_K,
    );
    simd::scale(simd, scale, s);
    apply_mask(s, it, q0, k0);
}

/// The forward of one item: `out: [len, d]` and `lse: [len]`.
///
/// One sweep over the key tiles per query block (FlashAttention-2's
/// Algorithm 1): the running maximum `m` and sum `l` of the online softmax,
/// the accumulator `acc = sum exp(S - m) V` rescaled when `m` grows; at the
/// end `o = acc / l`, `lse = m + ln l`.
#[inline(always)]
fn forward_item<S: Simd, T: Element>(simd: S, pb: &Problem<T>, it: &Item) -> (Vec<f32>, Vec<f32>) {
    let (h, d, len) = (pb.h, pb.d, it.len);
    let dp = round_up(d.max(1), mm_col_multiple::<S>());
    let lp = round_up(len, BLOCK_K);
    let qh = gather(pb.q, h, d, it, lp, dp);
    let kt = gather_t(pb.k, h, d, it, lp, dp);
    let vh = gather(pb.v, h, d, it, lp, dp);
    let mut out = vec![0.0f32; len * d];
    let mut lse = vec![f32::NEG_INFINITY; len];
    let mut s = vec![0.0f32; BLOCK_Q * BLOCK_K];
    let mut acc = vec![0.0f32; BLOCK_Q * dp];
    let mut m = [f32::NEG_INFINITY; BLOCK_Q];
    let mut l = [0.0f32; BLOCK_Q];
    for q0 in (0..len).step_by(BLOCK_Q) {
        let rows = (len - q0).min(BLOCK_Q);
        acc.fill(0.0);
        m.fill(f32::NEG_INFINITY);
        l.fill(0.0);
        for k0 in (0..len).step_by(BLOCK_K) {
            if causal_skip(it, q0, k0) {
                break;
            }
            scores(simd, &mut s, &qh, &kt, lp, dp, it, q0, k0, pb.scale);
            for r in 0..BLOCK_Q {
                let row = &mut s[r * BLOCK_K..(r + 1) * BLOCK_K];
                if r >= rows {
                    row.fill(0.0);
                    continue;
                }
                let m_new = m[r].max(simd::max(simd, row));
                if m_new == f32::NEG_INFINITY {
                    row.fill(0.0); // nothing allowed so far
                    continue;
                }
                let shift = simd.splat_f32s(m_new);
                simd::map_in_place(simd, row, 0.0, |x| simd::exp(simd, simd.sub_f32s(x, shift)));
                let corr = if m[r] == m_new {
                    1.0
                } else {
                    (m[r] - m_new).exp()
                };
                l[r] = l[r] * corr + simd::sum(simd, row);
                if corr != 1.0 {
                    simd::scale(simd, corr, &mut acc[r * dp..(r + 1) * dp]);
                }
                m[r] = m_new;
            }
            mm_acc(
                simd,
                BLOCK_Q,
                dp,
                BLOCK_K,
                &s,
                BLOCK_K,
                &vh[k0 * dp..],
                dp,
                &mut acc,
                dp,
            );
        }
        for r in 0..rows {
            let i = q0 + r;
            if l[r] == 0.0 {
                continue; // no allowed key: output 0, lse -inf (P8)
            }
            let inv = 1.0 / l[r];
            for (o, &a) in out[i * d..(i + 1) * d].iter_mut().zip(&acc[r * dp..]) {
                *o = a * inv;
            }
            lse[i] = m[r] + l[r].ln();
        }
    }
    (out, lse)
}

/// `P = exp(S - lse)` row by row in place; rows with `lse = -inf` (no
/// allowed key, or padding) become 0.
#[inline(always)]
fn probabilities<S: Simd>(simd: S, s: &mut [f32], lse: &[f32; BLOCK_Q]) {
    for (r, &l) in lse.iter().enumerate() {
        let row = &mut s[r * BLOCK_K..(r + 1) * BLOCK_K];
        if l == f32::NEG_INFINITY {
            row.fill(0.0);
            continue;
        }
        let shift = simd.splat_f32s(l);
        simd::map_in_place(simd, row, 0.0, |x| simd::exp(simd, simd.sub_f32s(x, shift)));
    }
}

/// Transposes `src: [rows, cols]` into `dst: [cols, rows]`.
fn transpose(src: &[f32], rows: usize, cols: usize, dst: &mut [f32]) {
    for r in 0..rows {
        for c in 0..cols {
            dst[c * rows + r] = src[r * cols + c];
        }
    }
}

struct Forward<'a, 'p, 'm, T> {
    pb: &'a Problem<'p, T>,
    it: &'a Item<'m>,
}

impl<T: Element> WithSimd for Forward<'_, '_, '_, T> {
    type Output = (Vec<f32>, Vec<f32>);
    #[inline(always)]
    fn with_simd<S: Simd>(self, simd: S) -> Self::Output {
        forward_item(simd, self.pb, self.it)
    }
}

/// Writes an item's rows `part: [len, d]` into `flat: [n, h, d]` at its
/// tokens and head.
fn scatter(flat: &mut [f32], (h, d): (usize, usize), it: &Item, part: &[f32]) {
    for i in 0..it.len {
        let at = ((it.start + i) * h + it.head) * d;
        flat[at..at + d].copy_from_slice(&part[i * d..(i + 1) * d]);
    }
}

mod backward;
use backward::run_backward;

/// Runs every item's forward in parallel and scatters the results.
fn run_forward<T: Element>(pb: &Problem<T>, n: usize, items: &[Item]) -> AttentionOutput32 {
    let (h, d) = (pb.h, pb.d);
    let arch = simd::arch();
    let parts: Vec<(Vec<f32>, Vec<f32>)> = items
        .par_iter()
        .map(|it| arch.dispatch(Forward { pb, it }))
        .collect();
    let mut output = Array3::zeros((n, h, d));
    let mut lse = Array2::from_elem((h, n), f32::NEG_INFINITY);
    let out_flat = output.as_slice_mut().expect("fresh array");
    for (it, (o, l)) in items.iter().zip(parts) {
        scatter(out_flat, (h, d), it, &o);
        for i in 0..it.len {
            lse[[it.head, it.start + i]] = l[i];
        }
    }
    AttentionOutput32 { output, lse }
}

/// Checks that every element is finite.
///
/// # Errors
/// [`Error::NonFiniteInput`] naming `field` with the flat index.
pub fn check_finite<T: Element>(field: &str, x: &ArrayView3<T>) -> Result<()> {
    for (index, v) in x.iter().enumerate() {
        let v = v.to_f32();
        if !v.is_finite() {
            return Err(Error::NonFiniteInput {
                field: field.into(),
                index,
                value: v as f64,
            });
        }
    }
    Ok(())
}

fn standard<'a, T: Element>(x: &'a ArrayView3<'a, T>) -> CowArray<'a, T, Ix3> {
    x.as_standard_layout()
}

fn check_inputs<T: Element>(q: &ArrayView3<T>, k: &ArrayView3<T>, v: &ArrayView3<T>) -> Result<()> {
    check_qkv_same_shapes(q.shape(), k.shape(), v.shape())?;
    check_finite("q", q)?;
    check_finite("k", k)?;
    check_finite("v", v)
}

fn segment_items(cu_seqlens: &[usize], h: usize, causal: bool) -> Vec<Item<'static>> {
    let mut items: Vec<Item> = cu_seqlens
        .windows(2)
        .filter(|w| w[1] > w[0])
        .flat_map(|w| {
            (0..h).map(move |head| Item {
                start: w[0],
                len: w[1] - w[0],
                head,
                mask: Mask::Segment { causal },
            })
        })
        .collect();
    // Longest first, so that the big items do not finish last.
    items.sort_by_key(|it| std::cmp::Reverse(it.len));
    items
}

/// Runs `f` on the problem of `q, k, v` (in standard layout) under `scale`,
/// with `n_tok`.
fn with_problem<T: Element, R>(
    (q, k, v): (&ArrayView3<T>, &ArrayView3<T>, &ArrayView3<T>),
    scale: f32,
    f: impl FnOnce(&Problem<T>, usize) -> R,
) -> R {
    let (n, h, d) = q.dim();
    let (qs, ks, vs) = (standard(q), standard(k), standard(v));
    let pb = Problem {
        q: qs.as_slice().expect("standard layout"),
        k: ks.as_slice().expect("standard layout"),
        v: vs.as_slice().expect("standard layout"),
        h,
        d,
        scale,
    };
    f(&pb, n)
}

/// The forward over `items`, inputs checked.
fn forward<T: Element>(
    qkv: (&ArrayView3<T>, &ArrayView3<T>, &ArrayView3<T>),
    scale: f32,
    items: &[Item],
) -> AttentionOutput32 {
    with_problem(qkv, scale, |pb, n| run_forward(pb, n, items))
}

/// The backward over `items`, inputs checked.
fn backward<T: Element>(
    qkv: (&ArrayView3<T>, &ArrayView3<T>, &ArrayView3<T>),
    scale: f32,
    items: &[Item],
    fwd: &AttentionOutput32,
    grad_output: &ArrayView3<f32>,
) -> AttentionGrads32 {
    let go = grad_output.as_standard_layout();
    let go = go.as_slice().expect("standard layout");
    with_problem(qkv, scale, |pb, n| run_backward(pb, n, items, fwd, go))
}

/// Varlen attention forward: `q, k, v: [n_tok, h, d]` (`f32` or `bf16`),
/// `cu_seqlens: [b + 1]`; queries attend to the keys of their own segment
/// (up to themselves if `causal`). Returns `output: [n_tok, h, d]` and `lse:
/// [h, n_tok]`. Empty segments are allowed.
///
/// # Errors
/// As `packshard_reference::bert::attention::varlen_attention`:
/// [`Error::ShapeMismatch`] for `k`/`v`, [`Error::InvalidArgument`] naming
/// `cu_seqlens[i]`; and [`Error::NonFiniteInput`] naming `q`, `k` or `v`
/// with the flat index (the `attention` op's check).
pub fn varlen_attention<T: Element>(
    q: ArrayView3<T>,
    k: ArrayView3<T>,
    v: ArrayView3<T>,
    cu_seqlens: &[usize],
    causal: bool,
    scale: f32,
) -> Result<AttentionOutput32> {
    check_inputs(&q, &k, &v)?;
    let (n, h, _) = q.dim();
    check_cu_seqlens(cu_seqlens, n)?;
    Ok(forward(
        (&q, &k, &v),
        scale,
        &segment_items(cu_seqlens, h, causal),
    ))
}

fn check_backward<T: Element>(
    q: &ArrayView3<T>,
    k: &ArrayView3<T>,
    v: &ArrayView3<T>,
    fwd: &AttentionOutput32,
    grad_output: &ArrayView3<f32>,
) -> Result<()> {
    check_qkv_same_shapes(q.shape(), k.shape(), v.shape())?;
    check_grad_shapes(
        grad_output.shape(),
        fwd.output.shape(),
        fwd.lse.shape(),
        q.dim(),
    )?;
    check_finite("q", q)?;
    check_finite("k", k)?;
    check_finite("v", v)?;
    check_finite("grad_output", grad_output)
}

/// Backward of [`varlen_attention`]: `fwd` its result, `grad_output: [n_tok,
/// h, d]`; returns `grad_q`, `grad_k`, `grad_v`, each `[n_tok, h, d]`.
///
/// # Errors
/// As [`varlen_attention`], and [`Error::ShapeMismatch`] for `grad_output`
/// or the forward's `lse`, [`Error::NonFiniteInput`] for `grad_output`.
#[allow(clippy::too_many_arguments)]
pub fn varlen_attention_backward<T: Element>(
    q: ArrayView3<T>,
    k: ArrayView3<T>,
    v: ArrayView3<T>,
    cu_seqlens: &[usize],
    causal: bool,
    scale: f32,
    fwd: &AttentionOutput32,
    grad_output: ArrayView3<f32>,
) -> Result<AttentionGrads32> {
    check_backward(&q, &k, &v, fwd, &grad_output)?;
    let (n, h, _) = q.dim();
    check_cu_seqlens(cu_seqlens, n)?;
    let items = segment_items(cu_seqlens, h, causal);
    Ok(backward((&q, &k, &v), scale, &items, fwd, &grad_output))
}

fn dense_items<'a>(masks: &'a [ArrayView2<'a, bool>], row_len: usize, h: usize) -> Vec<Item<'a>> {
    let mut items = Vec::with_capacity(masks.len() * h);
    for (r, mask) in masks.iter().enumerate() {
        if row_len == 0 {
            continue;
        }
        for head in 0..h {
            items.push(Item {
                start: r * row_len,
                len: row_len,
                head,
                mask: Mask::Dense(mask),
            });
        }
    }
    items
}

fn check_dense<T: Element>(
    q: &ArrayView3<T>,
    row_len: usize,
    masks: &[ArrayView2<bool>],
) -> Result<()> {
    let n = q.dim().0;
    if row_len * masks.len() != n {
        return Err(Error::ShapeMismatch {
            field: "q".into(),
            expected: format!("[rows * row_len = {}, h, d]", row_len * masks.len()),
            actual: vec![n],
        });
    }
    for m in masks {
        check_mask_shape(m.shape(), row_len)?;
    }
    Ok(())
}

/// Dense masked attention: `q, k, v: [rows * row_len, h, d]` hold `rows =
/// masks.len()` rows of `row_len` tokens; token `i` of row `r` may attend to
/// key `j` of the same row where `masks[r][[i, j]]`. The same tiles as
/// [`varlen_attention`] over whole rows: every `[row_len, row_len]` score is
/// computed (the padded, or packed-with-a-block-diagonal-mask, baseline).
///
/// # Errors
/// [`Error::ShapeMismatch`] for `k`/`v`, a mask not `[row_len, row_len]`
/// (field `mask`) or `rows * row_len != n_tok` (field `q`);
/// [`Error::NonFiniteInput`] as [`varlen_attention`].
pub fn dense_masked_attention<T: Element>(
    q: ArrayView3<T>,
    k: ArrayView3<T>,
    v: ArrayView3<T>,
    row_len: usize,
    masks: &[ArrayView2<bool>],
    scale: f32,
) -> Result<AttentionOutput32> {
    check_inputs(&q, &k, &v)?;
    check_dense(&q, row_len, masks)?;
    let h = q.dim().1;
    Ok(forward(
        (&q, &k, &v),
        scale,
        &dense_items(masks, row_len, h),
    ))
}

/// Backward of [`dense_masked_attention`]. Queries with no allowed key get
/// zero gradients.
///
/// # Errors
/// As [`dense_masked_attention`] and [`varlen_attention_backward`].
#[allow(clippy::too_many_arguments)]
pub fn dense_masked_attention_backward<T: Element>(
    q: ArrayView3<T>,
    k: ArrayView3<T>,
    v: ArrayView3<T>,
    row_len: usize,
    masks: &[ArrayView2<bool>],
    scale: f32,
    fwd: &AttentionOutput32,
    grad_output: ArrayView3<f32>,
) -> Result<AttentionGrads32> {
    check_backward(&q, &k, &v, fwd, &grad_output)?;
    check_dense(&q, row_len, masks)?;
    let h = q.dim().1;
    let items = dense_items(masks, row_len, h);
    Ok(backward((&q, &k, &v), scale, &items, fwd, &grad_output))
}

/// The work of a varlen problem in the unit of the benchmark: the
/// number of (query, key) pairs that must be scored, `sum_s len_s^2` (per
/// head), or for causal attention `sum_s len_s (len_s + 1) / 2`.
pub fn varlen_pairs(cu_seqlens: &[usize], causal: bool) -> u64 {
    cu_seqlens
        .windows(2)
        .map(|w| {
            let l = (w[1] - w[0]) as u64;
            if causal {
                l * (l + 1) / 2
            } else {
                l * l
            }
        })
        .sum()
}
