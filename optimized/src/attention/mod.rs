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
use packshard_reference::attention::{
    check_grad_shapes, check_mask_shape, check_qkv_shapes, check_varlen,
};
use packshard_reference::ops::{AttentionSupport, Varlen};
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

/// Output of a forward pass: `output: [n_q, h, d]`, `lse: [h, n_q]` (natural
/// log; `-inf` for a query with no allowed key), the reference's struct in `f32`.
pub type AttentionOutput32 = packshard_reference::attention::AttentionOutput<f32>;

/// Gradients of a backward pass: `grad_q: [n_q, h, d]`, `grad_k, grad_v:
/// [n_k, h_kv, d]` (each `[n_tok, h, d]` for self-attention), the
/// reference's struct in `f32`.
pub type AttentionGrads32 = packshard_reference::attention::AttentionGrads<f32>;

/// Which keys a query of a work item may see.
#[derive(Clone, Copy)]
enum Mask<'a> {
    /// Its own segment (all of it, or up to itself when causal).
    Segment { causal: bool },
    /// A dense `[row_len, row_len]` mask of its row.
    Dense(&'a ArrayView2<'a, bool>),
}

/// One (segment, query head) of a problem: queries `q_start..q_start +
/// q_len` of head `head` over keys `k_start..k_start + k_len` of key head
/// `kv_head` (`head / (h / h_kv)`, grouped-query attention).
#[derive(Clone, Copy)]
struct Item<'a> {
    /// First query of the segment (row).
    q_start: usize,
    /// Queries in it.
    q_len: usize,
    /// First key of the segment (row).
    k_start: usize,
    /// Keys in it.
    k_len: usize,
    head: usize,
    kv_head: usize,
    mask: Mask<'a>,
}

impl Item<'_> {
    /// Query `i` (of the item) may see keys `< key_limit(i)`: bottom-right
    /// causal alignment, `c <= i + k_len - q_len` (0 for the top `q_len -
    /// k_len` rows of a segment with more queries than keys).
    fn key_limit(&self, i: usize) -> usize {
        match self.mask {
            Mask::Segment { causal: true } => (i + self.k_len + 1)
                .saturating_sub(self.q_len)
                .min(self.k_len),
            _ => self.k_len,
        }
    }

    /// `(start, len, head)` of the query rows.
    fn queries(&self) -> Rows {
        Rows {
            start: self.q_start,
            len: self.q_len,
            head: self.head,
        }
    }

    /// `(start, len, head)` of the key rows.
    fn keys(&self) -> Rows {
        Rows {
            start: self.k_start,
            len: self.k_len,
            head: self.kv_head,
        }
    }
}

/// Rows `start..start + len` of head `head` of a flat `[n, heads, d]` tensor.
#[derive(Clone, Copy)]
struct Rows {
    start: usize,
    len: usize,
    head: usize,
}

/// The input tensors of a problem, flat `q: [n_q, h, d]`, `k, v: [n_k,
/// h_kv, d]` (row-major).
#[derive(Clone, Copy)]
struct Problem<'a, T> {
    q: &'a [T],
    k: &'a [T],
    v: &'a [T],
    h: usize,
    h_kv: usize,
    d: usize,
    scale: f32,
}

fn round_up(x: usize, to: usize) -> usize {
    x.div_ceil(to) * to
}

/// `[rows, dp]` tile of the rows `at` of `x: [n, h, d]` (zero-padded).
fn gather<T: Element>(x: &[T], h: usize, d: usize, at: Rows, rows: usize, dp: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; rows * dp];
    for i in 0..at.len {
        let src = &x[((at.start + i) * h + at.head) * d..][..d];
        for (o, &s) in out[i * dp..i * dp + d].iter_mut().zip(src) {
            *o = s.to_f32();
        }
    }
    out
}

/// The transpose of [`gather`] in key panels: `[rows / BLOCK_K, dp,
/// BLOCK_K]`, panel `t` the transpose `[dp, BLOCK_K]` of the rows
/// `t * BLOCK_K..(t + 1) * BLOCK_K` (`rows` a multiple of [`BLOCK_K`]). A tile's keys are one
/// contiguous 16 KiB block (at `d` = 64) read with row stride `BLOCK_K`: the
/// whole-segment transpose `[dp, rows]` read with row stride `rows` (2 KiB
/// apart at 512 keys) mapped the 64 rows of a tile onto a few L1 cache sets.
fn gather_t<T: Element>(x: &[T], h: usize, d: usize, at: Rows, rows: usize, dp: usize) -> Vec<f32> {
    debug_assert!(rows.is_multiple_of(BLOCK_K));
    let mut out = vec![0.0f32; dp * rows];
    for i in 0..at.len {
        let src = &x[((at.start + i) * h + at.head) * d..][..d];
        let panel = &mut out[(i / BLOCK_K) * dp * BLOCK_K..][..dp * BLOCK_K];
        for (c, &s) in src.iter().enumerate() {
            panel[c * BLOCK_K + i % BLOCK_K] = s.to_f32();
        }
    }
    out
}

/// The key tile at `k0` of [`gather_t`]'s panels: `[dp, BLOCK_K]`, row
/// stride [`BLOCK_K`].
#[inline(always)]
fn key_panel(kt: &[f32], k0: usize, dp: usize) -> (&[f32], usize) {
    (&kt[k0 * dp..(k0 + BLOCK_K) * dp], BLOCK_K)
}

/// Sets the scores of keys a query may not see to `-inf` (after scaling):
/// `s: [BLOCK_Q, BLOCK_K]` for queries `q0..` and keys `k0..` of the item.
fn apply_mask(s: &mut [f32], it: &Item, q0: usize, k0: usize) {
    for r in 0..BLOCK_Q {
        let i = q0 + r;
        let row = &mut s[r * BLOCK_K..(r + 1) * BLOCK_K];
        match it.mask {
            Mask::Segment { .. } => {
                let end = it.key_limit(i).saturating_sub(k0).min(BLOCK_K);
                row[end..].fill(f32::NEG_INFINITY);
            }
            Mask::Dense(allowed) => {
                for (j, x) in row.iter_mut().enumerate() {
                    let key = k0 + j;
                    if i >= it.q_len || key >= it.k_len || !allowed[[i, key]] {
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
    matches!(it.mask, Mask::Segment { causal: true })
        && k0 >= it.key_limit((q0 + BLOCK_Q - 1).min(it.q_len.saturating_sub(1)))
}

/// `out: [BLOCK_Q, BLOCK_K] += x y^T` for the row block `x: [BLOCK_Q, dp]`
/// and the key block of `y^T` (a [`key_panel`]: row stride `ld`, its first
/// column the block's first key): the forward's `Q K^T`, the backward's `dO
/// V^T`. Only the first `rows` rows (rounded up to 4) and `cols` columns (a
/// multiple of the vector width) are computed; the rest of `out` is left as
/// it is.
#[inline(always)]
fn acc_by_transposed<S: Simd>(
    simd: S,
    (x, rows): (&[f32], usize),
    (yt, ld, cols): (&[f32], usize, usize),
    dp: usize,
    out: &mut [f32],
) {
    let m = round_up(rows.min(BLOCK_Q), 4);
    mm_acc(simd, m, cols, dp, x, dp, yt, ld, out, BLOCK_K);
}

/// `out: [BLOCK_Q, dp] += s y` for a tile `s: [BLOCK_Q, BLOCK_K]` and the
/// key block `y: [BLOCK_K, dp]`: the forward's `P V`, the backward's `dS K`.
#[inline(always)]
fn acc_tile_times<S: Simd>(simd: S, s: &[f32], y: &[f32], dp: usize, out: &mut [f32]) {
    mm_acc(simd, BLOCK_Q, dp, BLOCK_K, s, BLOCK_K, y, dp, out, dp);
}

/// `S = scale Q_blk K_tile^T` with the mask: `s: [BLOCK_Q, BLOCK_K]`
/// (`kt` the key panels of [`gather_t`]). Rows of the block past the item's
/// queries are 0 (as the zero rows of `Q` would give), not computed.
///
/// `cols`: the scores of keys `k0 + cols..` (a multiple of the vector width)
/// are not computed either: they are 0 before the mask, which must hide them
/// from every query of the block (the forward's `tile_keys`).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn scores<S: Simd>(
    simd: S,
    s: &mut [f32],
    qh: &[f32],
    kt: &[f32],
    dp: usize,
    it: &Item,
    (q0, k0, cols): (usize, usize, usize),
    scale: f32,
) {
    s.fill(0.0);
    let rows = it.q_len - q0;
    let (panel, ld) = key_panel(kt, k0, dp);
    acc_by_transposed(simd, (&qh[q0 * dp..], rows), (panel, ld, cols), dp, s);
    simd::scale(simd, scale, s);
    apply_mask(s, it, q0, k0);
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

/// Writes rows `part: [len, d]` into `flat: [n, h, d]` at the rows `at`.
fn scatter(flat: &mut [f32], (h, d): (usize, usize), at: Rows, part: &[f32]) {
    for i in 0..at.len {
        let o = ((at.start + i) * h + at.head) * d;
        flat[o..o + d].copy_from_slice(&part[i * d..(i + 1) * d]);
    }
}

/// Adds rows `part: [len, d]` into `flat: [n, h_kv, d]` at the rows `at`
/// (the key gradients of the query heads of a group).
fn scatter_add(flat: &mut [f32], (h, d): (usize, usize), at: Rows, part: &[f32]) {
    for i in 0..at.len {
        let o = ((at.start + i) * h + at.head) * d;
        for (x, &p) in flat[o..o + d].iter_mut().zip(&part[i * d..(i + 1) * d]) {
            *x += p;
        }
    }
}

mod backward;
mod forward;
pub mod mask;
use backward::run_backward;
use forward::forward_item;

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
        scatter(out_flat, (h, d), it.queries(), &o);
        for (i, &x) in l.iter().enumerate() {
            lse[[it.head, it.q_start + i]] = x;
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
    check_qkv_shapes(q.shape(), k.shape(), v.shape())?;
    check_finite("q", q)?;
    check_finite("k", k)?;
    check_finite("v", v)
}

/// The items of a varlen problem: one per (segment with queries and keys,
/// query head); a segment without keys has no item (its rows keep output 0,
/// `lse = -inf`: P8).
fn segment_items(
    (cu_q, cu_k): (&[usize], &[usize]),
    (h, h_kv): (usize, usize),
    causal: bool,
) -> Vec<Item<'static>> {
    let group = h / h_kv.max(1);
    let mut items: Vec<Item> = cu_q
        .windows(2)
        .zip(cu_k.windows(2))
        .filter(|(wq, wk)| wq[1] > wq[0] && wk[1] > wk[0])
        .flat_map(|(wq, wk)| {
            (0..h).map(move |head| Item {
                q_start: wq[0],
                q_len: wq[1] - wq[0],
                k_start: wk[0],
                k_len: wk[1] - wk[0],
                head,
                kv_head: head / group,
                mask: Mask::Segment { causal },
            })
        })
        .collect();
    // Most work first, so that the big items do not finish last (stable:
    // the heads of a group keep their order, and so their key gradients
    // their order of summation).
    items.sort_by_key(|it| std::cmp::Reverse(it.q_len * it.k_len));
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
        h_kv: k.dim().1,
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
    let n_k = qkv.1.dim().0;
    with_problem(qkv, scale, |pb, n| {
        run_backward(pb, (n, n_k), items, fwd, go)
    })
}

/// Varlen self-attention forward: `q, k, v: [n_tok, h, d]` (`f32` or
/// `bf16`), `cu_seqlens: [b + 1]`; queries attend to the keys of their own
/// segment (up to themselves if `causal`). Returns `output: [n_tok, h, d]`
/// and `lse: [h, n_tok]`. Empty segments are allowed. The self-attention
/// case of [`varlen_attention_general`].
///
/// # Errors
/// As [`varlen_attention_general`].
pub fn varlen_attention<T: Element>(
    q: ArrayView3<T>,
    k: ArrayView3<T>,
    v: ArrayView3<T>,
    cu_seqlens: &[usize],
    causal: bool,
    scale: f32,
) -> Result<AttentionOutput32> {
    varlen_attention_general(q, k, v, &Varlen::new(cu_seqlens, causal, f64::from(scale)))
}

/// Varlen attention forward in flash-attention's `flash_attn_varlen_func`
/// form: `q: [n_q, h, d]`, `k, v: [n_k, h_kv, d]` (`f32` or `bf16`, `h_kv`
/// dividing `h`: query head `a` reads key head `a / (h / h_kv)`,
/// grouped-query attention), segment `s` its queries
/// `cu_seqlens_q[s]..cu_seqlens_q[s + 1]` over its keys
/// `cu_seqlens_k[s]..cu_seqlens_k[s + 1]`, causal masks bottom-right aligned
/// (query `r` of `l_q` sees key `c` of `l_k` when `c <= r + l_k - l_q`: a
/// query with no key gets output 0 and `lse = -inf`, docs/FAULTS.md C5, P8).
/// `p.scale` is used in f32. Returns `output: [n_q, h, d]`, `lse: [h, n_q]`.
///
/// # Errors
/// As `packshard_reference::attention::varlen_attention_general`:
/// [`Error::ShapeMismatch`] for `k`/`v`, [`Error::InvalidArgument`] naming
/// `cu_seqlens[i]` (`cu_seqlens_q[i]`, `cu_seqlens_k[i]`); and
/// [`Error::NonFiniteInput`] naming `q`, `k` or `v` with the flat index (the
/// `attention` op's check).
pub fn varlen_attention_general<T: Element>(
    q: ArrayView3<T>,
    k: ArrayView3<T>,
    v: ArrayView3<T>,
    p: &Varlen<'_>,
) -> Result<AttentionOutput32> {
    check_inputs(&q, &k, &v)?;
    check_varlen(p, q.dim().0, k.dim().0)?;
    // flash-attention's window, softcap, ALiBi and seqused_k are not
    // implemented here: refused, never ignored.
    AttentionSupport::CAUSAL_GQA_CROSS.check(p, q.dim().1, k.dim().1)?;
    let items = segment_items(
        (p.cu_seqlens_q, p.cu_seqlens_k),
        (q.dim().1, k.dim().1),
        p.causal,
    );
    Ok(forward((&q, &k, &v), p.scale as f32, &items))
}

fn check_backward<T: Element>(
    q: &ArrayView3<T>,
    k: &ArrayView3<T>,
    v: &ArrayView3<T>,
    fwd: &AttentionOutput32,
    grad_output: &ArrayView3<f32>,
) -> Result<()> {
    check_qkv_shapes(q.shape(), k.shape(), v.shape())?;
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
/// As [`varlen_attention_general_backward`].
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
    let p = Varlen::new(cu_seqlens, causal, f64::from(scale));
    varlen_attention_general_backward(q, k, v, &p, fwd, grad_output)
}

/// Backward of [`varlen_attention_general`]: `fwd` its result,
/// `grad_output: [n_q, h, d]`; returns `grad_q: [n_q, h, d]` and `grad_k,
/// grad_v: [n_k, h_kv, d]`, each key head's gradient summed over the query
/// heads of its group (in head order).
///
/// # Errors
/// As [`varlen_attention_general`], and [`Error::ShapeMismatch`] for
/// `grad_output` or the forward's `lse`, [`Error::NonFiniteInput`] for
/// `grad_output`.
pub fn varlen_attention_general_backward<T: Element>(
    q: ArrayView3<T>,
    k: ArrayView3<T>,
    v: ArrayView3<T>,
    p: &Varlen<'_>,
    fwd: &AttentionOutput32,
    grad_output: ArrayView3<f32>,
) -> Result<AttentionGrads32> {
    check_backward(&q, &k, &v, fwd, &grad_output)?;
    check_varlen(p, q.dim().0, k.dim().0)?;
    // flash-attention's window, softcap, ALiBi and seqused_k are not
    // implemented here: refused, never ignored.
    AttentionSupport::CAUSAL_GQA_CROSS.check(p, q.dim().1, k.dim().1)?;
    let items = segment_items(
        (p.cu_seqlens_q, p.cu_seqlens_k),
        (q.dim().1, k.dim().1),
        p.causal,
    );
    Ok(backward(
        (&q, &k, &v),
        p.scale as f32,
        &items,
        fwd,
        &grad_output,
    ))
}

fn dense_items<'a>(
    masks: &'a [ArrayView2<'a, bool>],
    row_len: usize,
    (h, h_kv): (usize, usize),
) -> Vec<Item<'a>> {
    let mut items = Vec::with_capacity(masks.len() * h);
    let group = h / h_kv.max(1);
    for (r, mask) in masks.iter().enumerate() {
        if row_len == 0 {
            continue;
        }
        for head in 0..h {
            items.push(Item {
                q_start: r * row_len,
                q_len: row_len,
                k_start: r * row_len,
                k_len: row_len,
                head,
                kv_head: head / group,
                mask: Mask::Dense(mask),
            });
        }
    }
    items
}

fn check_dense<T: Element>(
    (q, k): (&ArrayView3<T>, &ArrayView3<T>),
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
    if k.dim().0 != n {
        return Err(Error::ShapeMismatch {
            field: "k".into(),
            expected: format!("[{n}, h_kv, d]: the rows of q"),
            actual: k.shape().to_vec(),
        });
    }
    for m in masks {
        check_mask_shape(m.shape(), row_len)?;
    }
    Ok(())
}

/// Dense masked attention: `q: [rows * row_len, h, d]` and `k, v: [rows *
/// row_len, h_kv, d]` (`h_kv` dividing `h`, as [`varlen_attention_general`]) hold `rows =
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
    check_dense((&q, &k), row_len, masks)?;
    let items = dense_items(masks, row_len, (q.dim().1, k.dim().1));
    Ok(forward((&q, &k, &v), scale, &items))
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
    check_dense((&q, &k), row_len, masks)?;
    let items = dense_items(masks, row_len, (q.dim().1, k.dim().1));
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
