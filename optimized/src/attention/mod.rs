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
//! is computed across segments. The tiles are held transposed (keys down,
//! queries across the SIMD lanes: `tile`'s module docs), so the softmax's
//! per-query state is lane-wise and no tile is ever transposed.
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
//! A query with no allowed key gets output 0, `lse = -inf` and zero
//! gradients (docs/FAULTS.md P8).
//!
//! ## flash-attention's options (`packshard_reference::attention::options`)
//!
//! The varlen form takes `window_size`, `softcap`, `alibi_slopes` and
//! `seqused_k` ([`TILED_SUPPORT`]). A segment's item holds its first
//! `seqused_k[s]` keys only (the others are never gathered; their gradients
//! stay 0), and query `i` sees the keys [`visible_keys`] gives (causal and
//! the window, bottom-right aligned on `i + k_len - q_len`). A query block
//! visits only the key tiles that hold a key some of its queries see
//! (`Item::block_keys`, forward and backward alike): with a sliding window
//! of `w` keys a block visits about `(w + BLOCK_Q) / BLOCK_K + 1` tiles,
//! not all of them. The cap and ALiBi change each scaled score before the
//! mask (a masked key stays `-inf`, W4), and the backward multiplies `dS` by
//! the cap's chain factor `1 - tanh(raw / softcap)^2` (W5). The skipped tiles
//! hold only masked scores (exact zeros after the exponential), so the
//! varlen form stays bitwise equal to the dense form with the same mask and
//! score options ([`dense_masked_attention_with`]; `tests_options`).
//!
//! Inputs may be `f32` or `bf16` ([`Element`]); every sum is in `f32`.

use std::ops::Range;

use half::bf16;
use ndarray::{Array2, ArrayView2, ArrayView3, CowArray, Ix3};
use packshard_reference::attention::options::visible_keys;
use packshard_reference::attention::{
    check_grad_shapes, check_mask_shape, check_qkv_shapes, check_varlen, check_varlen_options,
    Window,
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

    /// The slice itself where the type is `f32` (read in place, not
    /// gathered).
    fn as_f32(x: &[Self]) -> Option<&[f32]>;
}

impl Element for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }

    #[inline(always)]
    fn as_f32(x: &[Self]) -> Option<&[f32]> {
        Some(x)
    }
}

impl Element for bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }

    fn as_f32(_: &[Self]) -> Option<&[f32]> {
        None
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
    /// Its own segment's keys within flash-attention's bounds, bottom-right
    /// aligned: causal (`c <= r + l_k - l_q`) and the window `(left,
    /// right)` ([`visible_keys`]).
    Segment { causal: bool, window: Window },
    /// A dense `[row_len, row_len]` mask of its row.
    Dense(&'a ArrayView2<'a, bool>),
}

/// flash-attention's per-score changes of a segment item, in f32, applied
/// to the scaled score before the mask (docs/FAULTS.md W4): `softcap *
/// tanh(s / softcap)` (`softcap == 0`: none), then ALiBi's `-slope |r + l_k
/// - l_q - c|` (`packshard_reference::attention::options`).
#[derive(Clone, Copy, Default)]
struct Transform<'a> {
    /// The cap (0: none).
    softcap: f32,
    /// The item's query head's ALiBi slope.
    slope: Option<f32>,
    /// The dense form's diagonal of each query: query `i` of the row is
    /// aligned on key `i + offsets[i]` (`l_k - l_q` of its segment, keys
    /// counted by `seqused_k`). `None`: the item's own `k_len - q_len`.
    offsets: Option<&'a [i64]>,
    /// A docs/FAULTS.md W fault the tests plant in this item.
    #[cfg(test)]
    planted: Option<tests_faults::Planted>,
}

impl<'a> Transform<'a> {
    fn new(softcap: f32, slope: Option<f32>, offsets: Option<&'a [i64]>) -> Self {
        Transform {
            softcap,
            slope,
            offsets,
            #[cfg(test)]
            planted: None,
        }
    }

    fn is_identity(&self) -> bool {
        self.softcap == 0.0 && self.slope.is_none()
    }
}

/// flash-attention's score options of a problem, for the dense form (whose
/// one row holds several segments): `softcap` (0: none), `alibi_slopes:
/// [h]` and the diagonal offset `l_k - l_q` of each query's segment
/// (`[row_len]`, needed with ALiBi), as the varlen form reads them from its
/// `Varlen`.
#[derive(Debug, Clone, Copy, Default)]
pub struct ScoreOptions<'a> {
    /// `c * tanh(s / c)` on the scaled scores (0: none).
    pub softcap: f64,
    /// `[h]`: ALiBi's slope of each query head.
    pub alibi_slopes: Option<&'a [f64]>,
    /// `[row_len]`: query `i` of a row aligned on key `i + diag_offsets[i]`
    /// (`None`: on key `i`).
    pub diag_offsets: Option<&'a [i64]>,
}

impl<'a> ScoreOptions<'a> {
    fn transform(&self, head: usize) -> Transform<'a> {
        Transform::new(
            mask::softcap_f32(self.softcap),
            self.alibi_slopes.map(|a| a[head] as f32),
            self.diag_offsets,
        )
    }
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
    /// The score changes.
    transform: Transform<'a>,
}

impl Item<'_> {
    /// The keys query `i` (of the item) may see, for a segment item: its
    /// window and causal bounds, bottom-right aligned ([`visible_keys`];
    /// empty for the top `q_len - k_len` rows of a causal segment with more
    /// queries than keys, and for a padding row `i >= q_len`). A dense item:
    /// all its keys (its mask decides).
    fn key_range(&self, i: usize) -> Range<usize> {
        match self.mask {
            Mask::Segment { causal, window } if i < self.q_len => {
                #[cfg(test)]
                if let Some(keys) = tests_faults::key_range(self, i, causal, window) {
                    return keys;
                }
                visible_keys(i, self.q_len, self.k_len, causal, window)
            }
            Mask::Segment { .. } => 0..0,
            Mask::Dense(_) => 0..self.k_len,
        }
    }

    /// The keys some query of the block at `q0` may see are within
    /// `block_keys(q0)` (the union of the rows' [`Item::key_range`]s; empty
    /// when no row sees a key): the key tiles a block visits, forward and
    /// backward. A key tile outside it holds only masked scores, whose
    /// probabilities are exact zeros, so skipping it changes no bit (the
    /// sliding window's saving, and causality's).
    fn block_keys(&self, q0: usize) -> Range<usize> {
        let rows = q0..(q0 + BLOCK_Q).min(self.q_len);
        let (lo, hi) = rows
            .map(|i| self.key_range(i))
            .filter(|r| !r.is_empty())
            .fold((usize::MAX, 0), |(lo, hi), r| {
                (lo.min(r.start), hi.max(r.end))
            });
        if lo < hi {
            lo..hi
        } else {
            0..0
        }
    }

    /// The starts of the key tiles that hold `keys` (tiles aligned on
    /// multiples of [`BLOCK_K`] from the segment's first key).
    fn tiles(keys: &Range<usize>) -> impl Iterator<Item = usize> {
        let first = keys.start - keys.start % BLOCK_K;
        (first..keys.end).step_by(BLOCK_K)
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

struct Forward<'a, 'p, 'm, T> {
    pb: &'a Problem<'p, T>,
    it: &'a Item<'m>,
    sc: &'a mut forward::Scratch,
    outs: (&'a Disjoint<'a>, &'a Disjoint<'a>),
}

impl<T: Element> WithSimd for Forward<'_, '_, '_, T> {
    type Output = [u32; 3];
    #[inline(always)]
    fn with_simd<S: Simd>(self, simd: S) -> [u32; 3] {
        // SAFETY: one call per item, and items own disjoint rows
        // (`run_forward`).
        unsafe { forward_item(simd, self.pb, self.it, self.sc, self.outs) }
    }
}

mod backward;
mod dense;
mod disjoint;
mod forward;
mod gather;
mod scan;
use gather::{gather_into, gather_t_into};
use scan::max_bits;
pub(crate) use scan::Seen;
pub use scan::{check_finite, finite_amax};
pub mod mask;
#[cfg(test)]
mod tests_faults;
#[cfg(test)]
mod tests_options;
mod tile;
use backward::run_backward;
pub use dense::{
    dense_masked_attention, dense_masked_attention_backward, dense_masked_attention_backward_with,
    dense_masked_attention_with,
};
use disjoint::Disjoint;
use forward::forward_item;
use tile::tile_keys;

/// Runs every item's forward in parallel, each writing its own rows of the
/// output and its span of `lse` (items own disjoint (query rows, head)
/// pairs: one item per (segment, head), segments disjoint token ranges,
/// checked by the callers).
///
/// Returns the largest [`magnitude_bits`](scan::magnitude_bits) the items read of `q`, `k`, `v`.
fn run_forward<T: Element>(
    pb: &Problem<T>,
    n: usize,
    items: &[Item],
) -> (AttentionOutput32, [u32; 3]) {
    let (h, d) = (pb.h, pb.d);
    let arch = simd::arch();
    // Tens of MiB at a batch's size: cleared on every thread, faulted in
    // 2 MiB at a time.
    let mut output = crate::alloc::zeros_parallel(Ix3(n, h, d));
    let mut lse = Array2::from_elem((h, n), f32::NEG_INFINITY);
    let out = Disjoint::new(output.as_slice_mut().expect("fresh array"), (h, d));
    let lse_all = Disjoint::new(lse.as_slice_mut().expect("fresh array"), (1, 1));
    // The thread's buffers are borrowed outside the dispatch, so that the
    // kernel is compiled inside pulp's target-feature context (a closure
    // between the two is compiled without them: 50 times slower).
    let seen = items
        .par_iter()
        .map(|it| {
            forward::SCRATCH.with_borrow_mut(|sc| {
                arch.dispatch(Forward {
                    pb,
                    it,
                    sc,
                    outs: (&out, &lse_all),
                })
            })
        })
        .reduce(|| [0; 3], max_bits);
    (AttentionOutput32 { output, lse }, seen)
}

fn standard<'a, T: Element>(x: &'a ArrayView3<'a, T>) -> CowArray<'a, T, Ix3> {
    x.as_standard_layout()
}

fn check_inputs<T: Element>(q: &ArrayView3<T>, k: &ArrayView3<T>, v: &ArrayView3<T>) -> Result<()> {
    check_qkv_shapes(q.shape(), k.shape(), v.shape())?;
    values_finite([("q", q), ("k", k), ("v", v)], None)
}

/// The items of a varlen problem: one per (segment with queries and used
/// keys, query head); a segment without either has no item (its rows keep
/// output 0, `lse = -inf`: P8). An item's keys are the segment's first
/// `seqused_k[s]` (all when not given): the keys past them are never
/// gathered, and their gradients stay 0.
fn segment_items<'a>(p: &Varlen<'_>, (h, h_kv): (usize, usize)) -> Vec<Item<'a>> {
    let group = h / h_kv.max(1);
    let mask = Mask::Segment {
        causal: p.causal,
        window: p.window,
    };
    let slopes = p.alibi_slopes;
    let mut items: Vec<Item> = p
        .cu_seqlens_q
        .windows(2)
        .zip(p.cu_seqlens_k.windows(2))
        .enumerate()
        .map(|(s, (wq, wk))| (wq[0], wq[1] - wq[0], wk[0], p.used_keys(s)))
        .filter(|&(_, q_len, _, k_len)| q_len > 0 && k_len > 0)
        .flat_map(|(q_start, q_len, k_start, k_len)| {
            (0..h).map(move |head| Item {
                q_start,
                q_len,
                k_start,
                k_len,
                head,
                kv_head: head / group,
                mask,
                transform: Transform::new(
                    mask::softcap_f32(p.softcap),
                    slopes.map(|a| a[head] as f32),
                    None,
                ),
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
    with_problem(qkv, scale, |pb, n| run_forward(pb, n, items)).0
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
    .0
}

/// [`varlen_attention_general`] on inputs (`f32` or `bf16`) whose shapes the
/// caller has checked (`crate::ops::boundary::forward_in_place`,
/// [`varlen_attention_general`]): the offsets and
/// options are checked here, and the values are not read for their checks
/// before the work but seen by the gathers that read them anyway: the
/// caller checks [`Seen`] (the largest magnitudes of `q`, `k`, `v`, and
/// whether every element was read; non-finite values give an output that
/// must be discarded).
///
/// # Errors
/// As [`varlen_attention_general`]'s for `cu_seqlens` and the options.
pub(crate) fn varlen_forward_seen<T: Element>(
    (q, k, v): (&ArrayView3<T>, &ArrayView3<T>, &ArrayView3<T>),
    p: &Varlen<'_>,
) -> Result<(AttentionOutput32, Seen)> {
    let (n, h) = (q.dim(), k.dim());
    check_options(p, (n.0, h.0), (n.1, h.1))?;
    let items = segment_items(p, (n.1, h.1));
    let (out, [bq, bk, bv]) = with_problem((q, k, v), p.scale as f32, |pb, n_q| {
        run_forward(pb, n_q, &items)
    });
    let seen = Seen::of([bq, bk, bv, 0], &items, (n.0, h.0), (n.1, h.1));
    Ok((out, seen))
}

/// [`varlen_attention_general_backward`] as [`varlen_forward_seen`] is the
/// forward: shapes checked by the caller (`fwd` and `grad_output` too,
/// `crate::ops::boundary::backward_in_place`), the values of `q`,
/// `k`, `v` and `grad_output` seen by the gathers ([`Seen`]).
///
/// # Errors
/// As [`varlen_forward_seen`].
pub(crate) fn varlen_backward_seen<T: Element>(
    (q, k, v): (&ArrayView3<T>, &ArrayView3<T>, &ArrayView3<T>),
    p: &Varlen<'_>,
    fwd: &AttentionOutput32,
    grad_output: &ArrayView3<f32>,
) -> Result<(AttentionGrads32, Seen)> {
    let (n, h) = (q.dim(), k.dim());
    check_options(p, (n.0, h.0), (n.1, h.1))?;
    let items = segment_items(p, (n.1, h.1));
    let go = grad_output.as_standard_layout();
    let go = go.as_slice().expect("standard layout");
    let (grads, bits) = with_problem((q, k, v), p.scale as f32, |pb, n_q| {
        run_backward(pb, (n_q, h.0), &items, fwd, go)
    });
    Ok((grads, Seen::of(bits, &items, (n.0, h.0), (n.1, h.1))))
}

/// What the tiled kernel implements ([`AttentionSupport::ALL`]: causal,
/// GQA, cross, and flash-attention's window, softcap, ALiBi and
/// `seqused_k`).
pub const TILED_SUPPORT: AttentionSupport = AttentionSupport::ALL;

/// The offsets and options of `p` for `n_q` queries of `h` heads over
/// `n_k` keys of `h_kv` heads.
fn check_options(
    p: &Varlen<'_>,
    (n_q, n_k): (usize, usize),
    (h, h_kv): (usize, usize),
) -> Result<()> {
    check_varlen(p, n_q, n_k)?;
    TILED_SUPPORT.check(p, h, h_kv)?;
    check_varlen_options(p, h)
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
    check_qkv_shapes(q.shape(), k.shape(), v.shape())?;
    // The values are checked between the shapes and the offsets, by the
    // kernel's own reads ([`Seen`]); a separate pass only where those did
    // not read every element, or an offset is refused (a bad value is
    // named first).
    let values = || values_finite([("q", &q), ("k", &k), ("v", &v)], None);
    let (out, seen) =
        varlen_forward_seen((&q, &k, &v), p).map_err(|e| values().err().unwrap_or(e))?;
    if seen.amax().is_none() {
        values()?;
    }
    Ok(out)
}

/// Checks that every element of `x` (then `grad_output`) is finite, in
/// order ([`check_finite`]).
fn values_finite<T: Element>(
    x: [(&str, &ArrayView3<T>); 3],
    grad_output: Option<&ArrayView3<f32>>,
) -> Result<()> {
    for (name, t) in x {
        check_finite(name, t)?;
    }
    grad_output.map_or(Ok(()), |g| check_finite("grad_output", g))
}

fn check_backward<T: Element>(
    q: &ArrayView3<T>,
    k: &ArrayView3<T>,
    v: &ArrayView3<T>,
    fwd: &AttentionOutput32,
    grad_output: &ArrayView3<f32>,
) -> Result<()> {
    check_backward_shapes(q, k, v, fwd, grad_output)?;
    values_finite([("q", q), ("k", k), ("v", v)], Some(grad_output))
}

fn check_backward_shapes<T: Element>(
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
    )
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
    check_backward_shapes(&q, &k, &v, fwd, &grad_output)?;
    // As the forward: the values seen by the kernel's reads ([`Seen`]).
    let values = || values_finite([("q", &q), ("k", &k), ("v", &v)], Some(&grad_output));
    let (grads, seen) = varlen_backward_seen((&q, &k, &v), p, fwd, &grad_output)
        .map_err(|e| values().err().unwrap_or(e))?;
    if seen.amax().is_none() {
        values()?;
    }
    Ok(grads)
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

/// The (query, key) scores the tiled forward computes for one head of `p`
/// (after `check_varlen`): the pairs of the key tiles it visits, masked ones
/// included (the forward's own loop over blocks and tiles, without the
/// arithmetic); with a sliding window, the tiles wholly outside every
/// query's window of a block are not among them. The work ratio of the
/// issue's benchmark (window against none).
pub fn varlen_scored_pairs(p: &Varlen<'_>) -> u64 {
    // One head (the slopes change no tile).
    let p = p.with_alibi_slopes(None);
    segment_items(&p, (1, 1))
        .iter()
        .map(forward::scored_pairs)
        .sum()
}
