//! Scaled dot-product attention, dense with a mask and variable-length
//! (`cu_seqlens_q` / `cu_seqlens_k`), forward and backward, in `f64`: the
//! ground truth of the [`crate::ops::AttentionOp`] family.
//!
//! Shapes: `q: [n_q, h, d]`, `k, v: [n_k, h_kv, d]` (tokens, heads, head dim),
//! output `[n_q, h, d]`, log-sum-exp `lse: [h, n_q]` (natural log), as
//! flash-attention's `flash_attn_varlen_func` lays them out. `h_kv` divides
//! `h`: grouped-query attention (Ainslie et al. 2023, GQA) shares key/value
//! head `a / (h / h_kv)` among query heads `a`, as Hugging Face's `repeat_kv`
//! does; `h_kv == h` is multi-head attention, `h_kv == 1` multi-query.
//!
//! For query `i` and head `a` over its allowed keys `J(i)`:
//! `s_ij = scale * q_i . k_j`, `m_i = max_j s_ij`,
//! `lse_i = m_i + ln sum_j exp(s_ij - m_i)`, `p_ij = exp(s_ij - lse_i)`,
//! `o_i = sum_j p_ij v_j` (Vaswani et al. 2017, eq. 1). Masking follows the
//! additive convention of Hugging Face's `BertModel` taken to its limit: a
//! disallowed key adds `-inf` to its score, so `p_ij = 0` exactly.
//!
//! **Causal masks are bottom-right aligned** (flash-attention >= 2.1): in a
//! segment of `l_q` queries over `l_k` keys, query `r` (0-based) may attend key
//! `c` when `c <= r + l_k - l_q`. With `l_q == l_k` that is the usual lower
//! triangle; a continuation chunk of 2 queries over 5 keys gets rows
//! `[1,1,1,1,0]` and `[1,1,1,1,1]` (docs/FAULTS.md C5).
//!
//! **A query with no allowed key** (a padding row under a block-diagonal mask,
//! every row of an empty sequence under a padding mask, the top `l_q - l_k`
//! rows of a causal segment with more queries than keys) has output 0,
//! `lse = -inf` and zero gradients — never NaN (docs/FAULTS.md P8). In
//! variable-length attention an empty segment has no rows at all.
//!
//! Sums run over keys in increasing index order, so the dense and the
//! variable-length forms of the same problem perform the same operations in
//! the same order.

use ndarray::{Array2, Array3, ArrayView2, ArrayView3, Axis, Slice};

use crate::error::Result;
use crate::ops::{AttentionOp, AttentionSupport, Grad, Masked, Qkv, Varlen};

mod backward;
mod check;
pub mod options;

/// The contract's types (`packshard_reference::ops`), here where the
/// reference's users have always found them.
pub use crate::ops::{AttentionGrads, AttentionLayout, AttentionOutput};
pub use backward::{
    layout_backward, masked_attention_backward, varlen_attention_backward,
    varlen_attention_general_backward,
};
pub use check::{
    check_cu_seqlens, check_cu_seqlens_named, check_grad_bound, check_grad_shapes,
    check_grad_values, check_layout, check_layout_work, check_mask_shape, check_mask_shape2,
    check_masked_work, check_qkv_same_shapes, check_qkv_shapes, check_score_bound, check_scores,
    check_varlen, check_varlen_options, check_varlen_work, MAX_ATTENTION_WORK, MAX_SCORE,
};
use check::{check_grad, check_qkv};
pub use options::Window;

/// `1 / sqrt(d)`, the scale of Vaswani et al. and flash-attention's default.
pub fn default_scale(head_dim: usize) -> f64 {
    1.0 / (head_dim as f64).sqrt()
}

/// One block of a problem for one query head: queries `queries` over keys
/// `keys` (in key order) of key head `kv`, `allowed(i, j)` deciding the mask.
pub(super) struct Block<'b> {
    /// `(query head, key head)`.
    heads: (usize, usize),
    queries: std::ops::Range<usize>,
    keys: std::ops::Range<usize>,
    allowed: &'b dyn Fn(usize, usize) -> bool,
    scale: f64,
    /// flash-attention's `softcap` (0: none).
    softcap: f64,
    /// The additive bias of `(i, j)` (ALiBi), if any.
    bias: Option<&'b dyn Fn(usize, usize) -> f64>,
}

impl Block<'_> {
    /// `(raw, s)`: the scaled score `raw = scale * q_i . k_j` and the score
    /// the softmax takes, `s = cap(raw) + bias(i, j)`.
    fn score(
        &self,
        (q, k): (&ArrayView3<f64>, &ArrayView3<f64>),
        (i, j): (usize, usize),
    ) -> (f64, f64) {
        let raw = score((q, k), self.heads, (i, j), self.scale);
        let s = options::cap(raw, self.softcap);
        (raw, self.bias.map_or(s, |b| s + b(i, j)))
    }
}

/// `scale * q_i . k_j` for query head `head` over key head `kv`.
fn score(
    (q, k): (&ArrayView3<f64>, &ArrayView3<f64>),
    (head, kv): (usize, usize),
    (i, j): (usize, usize),
    scale: f64,
) -> f64 {
    let mut dot = 0.0;
    for c in 0..q.dim().2 {
        dot += q[[i, head, c]] * k[[j, kv, c]];
    }
    scale * dot
}

/// One block's attention: writes outputs and `lse` for its rows. Shared by
/// the dense and the varlen forms: same operations, same order.
fn head_forward(
    (q, k, v): (&ArrayView3<f64>, &ArrayView3<f64>, &ArrayView3<f64>),
    b: &Block<'_>,
    output: &mut Array3<f64>,
    lse: &mut Array2<f64>,
) {
    let (head, kv) = b.heads;
    let d = q.dim().2;
    let mut scores = Vec::with_capacity(b.keys.len());
    for i in b.queries.clone() {
        scores.clear();
        let mut m = f64::NEG_INFINITY;
        for j in b.keys.clone() {
            if (b.allowed)(i, j) {
                let sc = b.score((q, k), (i, j)).1;
                m = m.max(sc);
                scores.push((j, sc));
            }
        }
        if scores.is_empty() {
            lse[[head, i]] = f64::NEG_INFINITY;
            continue; // output row stays 0 (P8)
        }
        let sum: f64 = scores.iter().map(|&(_, sc)| (sc - m).exp()).sum();
        let l = m + sum.ln();
        lse[[head, i]] = l;
        for &(j, sc) in &scores {
            let p = (sc - l).exp();
            for c in 0..d {
                output[[i, head, c]] += p * v[[j, kv, c]];
            }
        }
    }
}

/// `(query head, key head)` pairs: key head `a / (h / h_kv)` for query head `a`.
fn head_pairs(h: usize, h_kv: usize) -> impl Iterator<Item = (usize, usize)> {
    let group = h.checked_div(h_kv).unwrap_or(1).max(1);
    (0..h).map(move |a| (a, a / group))
}

/// The mask of one problem: a dense `allowed: [n_q, n_k]` with its scale, or
/// the segments of a varlen problem. The dense and the varlen forms, forward
/// and backward, run the same per-head code over its blocks.
#[derive(Clone, Copy)]
enum Blocks<'a> {
    Dense(Masked<'a>),
    Varlen(&'a Varlen<'a>),
}

/// A pass over one block.
type BlockFn<'f> = dyn FnMut(&Block<'_>) + 'f;

impl Blocks<'_> {
    fn scale(&self) -> f64 {
        match self {
            Blocks::Dense(m) => m.scale,
            Blocks::Varlen(p) => p.scale,
        }
    }

    /// Every check of the problem in the order the forms have always made
    /// them: `q, k, v`, the mask (or `cu_seqlens`), the backward's
    /// `grad_output` and forward (`grad`), the scores, the work.
    fn check(&self, Qkv { q, k, v }: &Qkv<'_>, grad: Option<&Grad<'_>>) -> Result<()> {
        check_qkv(q, k, v)?;
        let (n, h, d) = q.dim();
        let n_k = k.dim().0;
        match self {
            Blocks::Dense(m) => check_mask_shape2(m.allowed.shape(), n, n_k)?,
            Blocks::Varlen(p) => {
                check_varlen(p, n, n_k)?;
                check_varlen_options(p, h)?;
            }
        }
        if let Some(g) = grad {
            check_grad(&g.grad_output, g.fwd, (n, h, d))?;
        }
        check_scores(q, k, self.scale())?;
        if let Some(g) = grad {
            check_grad_values(&g.grad_output, v)?;
        }
        match self {
            Blocks::Dense(..) => check_masked_work(n, n_k, h, d),
            Blocks::Varlen(p) => check_varlen_work(p, h, d),
        }
    }

    /// Runs `f` over every block and head pair: the whole `[n_q, n_k]` under
    /// the dense mask, or each segment (causal: bottom-right aligned).
    fn for_each(&self, (n, h): (usize, usize), (n_k, h_kv): (usize, usize), f: &mut BlockFn<'_>) {
        match self {
            Blocks::Dense(m) => {
                let ok = |i: usize, j: usize| m.allowed[[i, j]];
                for heads in head_pairs(h, h_kv) {
                    f(&Block {
                        heads,
                        queries: 0..n,
                        keys: 0..n_k,
                        allowed: &ok,
                        scale: self.scale(),
                        softcap: 0.0,
                        bias: None,
                    });
                }
            }
            Blocks::Varlen(p) => {
                let segments = p.cu_seqlens_q.windows(2).zip(p.cu_seqlens_k.windows(2));
                for (s, (wq, wk)) in segments.enumerate() {
                    let (q0, lq, k0) = (wq[0], wq[1] - wq[0], wk[0]);
                    let lk = p.used_keys(s);
                    let ok = |i: usize, j: usize| {
                        options::visible_keys(i - q0, lq, lk, p.causal, p.window)
                            .contains(&(j - k0))
                    };
                    for heads in head_pairs(h, h_kv) {
                        let slope = p.alibi_slopes.map(|a| a[heads.0]);
                        let alibi = move |i: usize, j: usize| {
                            options::alibi_bias(slope.unwrap_or(0.0), i - q0, j - k0, lq, lk)
                        };
                        f(&Block {
                            heads,
                            queries: wq[0]..wq[1],
                            keys: wk[0]..wk[0] + lk,
                            allowed: &ok,
                            scale: p.scale,
                            softcap: p.softcap,
                            bias: slope.map(|_| &alibi as &dyn Fn(usize, usize) -> f64),
                        });
                    }
                }
            }
        }
    }
}

/// The forward of either form.
fn forward(x: Qkv<'_>, blocks: Blocks<'_>) -> Result<AttentionOutput> {
    blocks.check(&x, None)?;
    let Qkv { q, k, v } = x;
    let (n, h, d) = q.dim();
    let (n_k, h_kv, _) = k.dim();
    let mut output = Array3::zeros((n, h, d));
    let mut lse = Array2::zeros((h, n));
    blocks.for_each((n, h), (n_k, h_kv), &mut |b| {
        head_forward((&q, &k, &v), b, &mut output, &mut lse);
    });
    Ok(AttentionOutput { output, lse })
}

/// Dense attention with a boolean mask: `q: [n_q, h, d]`, `k, v: [n_k, h_kv,
/// d]`, `allowed: [n_q, n_k]` (`allowed[[i, j]]`: query `i` may attend to key
/// `j`).
///
/// This is the padded (and packed-with-a-block-diagonal-mask) form: Hugging
/// Face's additive mask `0 / -inf` expressed as booleans.
///
/// # Errors
/// [`Error::ShapeMismatch`](crate::Error::ShapeMismatch) if `k`, `v` or `allowed` do not fit `q`.
pub fn masked_attention(
    q: ArrayView3<f64>,
    k: ArrayView3<f64>,
    v: ArrayView3<f64>,
    allowed: ArrayView2<bool>,
    scale: f64,
) -> Result<AttentionOutput> {
    forward(
        Qkv::new(q, k, v),
        Blocks::Dense(Masked::new(allowed, scale)),
    )
}

/// Variable-length attention, the form of flash-attention's
/// `flash_attn_varlen_func`: `q: [n_q, h, d]` and `k, v: [n_k, h_kv, d]` hold
/// the tokens of `b` segments back to back, segment `s` being queries
/// `cu_seqlens_q[s]..cu_seqlens_q[s + 1]` over keys
/// `cu_seqlens_k[s]..cu_seqlens_k[s + 1]` (both `[b + 1]`, leading 0).
/// Queries attend only to keys of their own segment (and, if `p.causal`, only
/// to keys at or before their own position, bottom-right aligned). Empty
/// segments are allowed and have no rows.
///
/// Returns `output: [n_q, h, d]` and `lse: [h, n_q]`.
///
/// # Errors
/// [`Error::ShapeMismatch`](crate::Error::ShapeMismatch) for `k`/`v` that do not fit `q`; the errors of
/// [`check_varlen`].
pub fn varlen_attention_general(
    q: ArrayView3<f64>,
    k: ArrayView3<f64>,
    v: ArrayView3<f64>,
    p: &Varlen<'_>,
) -> Result<AttentionOutput> {
    forward(Qkv::new(q, k, v), Blocks::Varlen(p))
}

/// Self-attention over one `cu_seqlens` (queries and keys the same tokens):
/// [`varlen_attention_general`] with `cu_seqlens_q == cu_seqlens_k`.
///
/// # Errors
/// As [`varlen_attention_general`].
pub fn varlen_attention(
    q: ArrayView3<f64>,
    k: ArrayView3<f64>,
    v: ArrayView3<f64>,
    cu_seqlens: &[usize],
    causal: bool,
    scale: f64,
) -> Result<AttentionOutput> {
    varlen_attention_general(q, k, v, &Varlen::new(cu_seqlens, causal, scale))
}

/// The attention probabilities `p: [h, n, n]` of a dense masked problem (an
/// intermediate exposed for comparison; 0 where masked, a zero row for a
/// query with no allowed key).
///
/// # Errors
/// As [`masked_attention`].
pub fn masked_attention_probs(
    q: ArrayView3<f64>,
    k: ArrayView3<f64>,
    allowed: ArrayView2<bool>,
    scale: f64,
) -> Result<Array3<f64>> {
    check_qkv(&q, &k, &k)?;
    let (n, h, _) = q.dim();
    let (n_k, h_kv, _) = k.dim();
    check_mask_shape2(allowed.shape(), n, n_k)?;
    let fwd = masked_attention(q, k, k, allowed, scale)?;
    let mut p = Array3::zeros((h, n, n_k));
    for (head, kv) in head_pairs(h, h_kv) {
        for i in 0..n {
            let l = fwd.lse[[head, i]];
            if l == f64::NEG_INFINITY {
                continue;
            }
            for j in 0..n_k {
                if allowed[[i, j]] {
                    p[[head, i, j]] = (score((&q, &k), (head, kv), (i, j), scale) - l).exp();
                }
            }
        }
    }
    Ok(p)
}

/// The `[n_q, n_k]` mask of a varlen problem: key `j` allowed for query `i`
/// when both are in the same segment (and, if causal, `j` is visible to `i`,
/// bottom-right aligned). The dense twin of [`varlen_attention_general`].
///
/// # Errors
/// As [`check_varlen`].
pub fn varlen_mask(p: &Varlen<'_>, n_q: usize, n_k: usize) -> Result<Array2<bool>> {
    check_varlen(p, n_q, n_k)?;
    let mut mask = Array2::from_elem((n_q, n_k), false);
    let segments = p.cu_seqlens_q.windows(2).zip(p.cu_seqlens_k.windows(2));
    for (s, (wq, wk)) in segments.enumerate() {
        let (lq, lk) = (wq[1] - wq[0], p.used_keys(s));
        for r in 0..lq {
            for c in options::visible_keys(r, lq, lk, p.causal, p.window) {
                mask[[wq[0] + r, wk[0] + c]] = true;
            }
        }
    }
    Ok(mask)
}

/// The forward over a [`AttentionLayout`] through any [`AttentionOp`]: a
/// varlen layout is one varlen call (bidirectional), a dense layout one
/// masked call per row. The models (BERT, the decoder) use it.
///
/// # Errors
/// Those of the op, and [`check_layout`]'s.
pub fn layout_forward<A: AttentionOp + ?Sized>(
    op: &A,
    x: Qkv<'_>,
    layout: &AttentionLayout,
    scale: f64,
) -> Result<AttentionOutput> {
    check_qkv(&x.q, &x.k, &x.v)?;
    let (n, h, d) = x.q.dim();
    check_layout(layout, n)?;
    check_layout_work(layout, h, d)?;
    match layout {
        AttentionLayout::Varlen { cu_seqlens } => {
            op.varlen_forward(x, &Varlen::new(cu_seqlens, false, scale))
        }
        AttentionLayout::Dense { row_len, allowed } => {
            let mut output = Array3::zeros((n, h, d));
            let mut lse = Array2::zeros((h, n));
            for (r, mask) in allowed.iter().enumerate() {
                let rows = Slice::from(r * row_len..(r + 1) * row_len);
                let f = op.masked_forward(x.rows(rows), Masked::new(mask.view(), scale))?;
                output.slice_axis_mut(Axis(0), rows).assign(&f.output);
                lse.slice_axis_mut(Axis(1), rows).assign(&f.lse);
            }
            Ok(AttentionOutput { output, lse })
        }
    }
}

/// `op`'s varlen forward on `x` over `p`, then its backward of that forward
/// with `grad_output: [n_q, h, d]`.
///
/// # Errors
/// `op`'s.
pub fn varlen_pass<A: AttentionOp + ?Sized>(
    op: &A,
    x: Qkv<'_>,
    p: &Varlen<'_>,
    grad_output: ArrayView3<f64>,
) -> Result<(AttentionOutput, AttentionGrads)> {
    let fwd = op.varlen_forward(x, p)?;
    let grads = op.varlen_backward(x, p, Grad::new(&fwd, grad_output))?;
    Ok((fwd, grads))
}

/// The reference attention: [`varlen_attention_general`] and
/// [`masked_attention`], everything the op family allows (causal, GQA,
/// `cu_seqlens_q != cu_seqlens_k`).
#[derive(Debug, Clone, Copy, Default)]
pub struct ReferenceAttention;

impl AttentionOp for ReferenceAttention {
    fn support(&self) -> AttentionSupport {
        AttentionSupport::ALL
    }

    fn varlen_forward(&self, x: Qkv<'_>, p: &Varlen<'_>) -> Result<AttentionOutput> {
        forward(x, Blocks::Varlen(p))
    }

    fn varlen_backward(&self, x: Qkv<'_>, p: &Varlen<'_>, g: Grad<'_>) -> Result<AttentionGrads> {
        backward::backward(x, Blocks::Varlen(p), g)
    }

    fn masked_forward(&self, x: Qkv<'_>, m: Masked<'_>) -> Result<AttentionOutput> {
        forward(x, Blocks::Dense(m))
    }

    fn masked_backward(&self, x: Qkv<'_>, m: Masked<'_>, g: Grad<'_>) -> Result<AttentionGrads> {
        backward::backward(x, Blocks::Dense(m), g)
    }
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_options;
