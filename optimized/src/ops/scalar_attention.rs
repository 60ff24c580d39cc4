//! `attention_varlen_scalar`: the slow twin of `attention_varlen_tiled`
//! (candle's habit: every fused kernel ships with a plain one that must
//! agree with it). f32 storage and arithmetic, plain loops, no SIMD, no
//! threads, no tiles: per query, the scores of its allowed keys, their
//! maximum, `exp(s - m)`, the sum, then the weighted values — the textbook
//! softmax in f32. The registry holds it to the same rule as the tiled
//! kernel (`RelativeRule::F32` against the f64 reference), so the two are
//! checked against each other through the reference.
//!
//! Shapes as [`AttentionOp`]'s: `q: [n_q, h, d]`, `k, v: [n_k, h_kv, d]`
//! with `h_kv` dividing `h` (query head `a` reads key head `a / (h /
//! h_kv)`), `cu_seqlens_k` other than `cu_seqlens_q` with bottom-right
//! causal masks, and flash-attention's `window_size`, `softcap`,
//! `alibi_slopes` and `seqused_k` ([`AttentionSupport::ALL`], through
//! [`crate::attention::mask`]); results widened to f64.

use ndarray::{Array2, Array3};
use packshard_reference::attention::{
    check_grad_shapes, check_grad_values, check_mask_shape2, check_masked_work, check_qkv_shapes,
    check_scores, check_varlen, check_varlen_options, check_varlen_work, AttentionGrads,
    AttentionOutput,
};
use packshard_reference::ops::{AttentionOp, AttentionSupport, Grad, Masked, Qkv, Varlen};
use packshard_reference::Result;

use crate::attention::check_finite;
use crate::attention::mask::SegmentMask;
use crate::convert::{to_f32, to_f64};

/// The scalar f32 attention (see the module docs).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ScalarAttention;

/// `q, k, v` in f32 (all of one shape), refusing non-finite inputs as the
/// kernels do (the boundary of the CUDA attention, `crate::cuda::ops`).
#[cfg(feature = "cuda")]
pub(crate) fn inputs(x: &Qkv<'_>) -> Result<[Array3<f32>; 3]> {
    packshard_reference::attention::check_qkv_same_shapes(x.q.shape(), x.k.shape(), x.v.shape())?;
    grouped_inputs(x)
}

/// `q: [n_q, h, d]` and `k, v: [n_k, h_kv, d]` in f32, refusing non-finite
/// inputs.
fn grouped_inputs(Qkv { q, k, v }: &Qkv<'_>) -> Result<[Array3<f32>; 3]> {
    check_qkv_shapes(q.shape(), k.shape(), v.shape())?;
    let out = [
        to_f32("q", q.view())?,
        to_f32("k", k.view())?,
        to_f32("v", v.view())?,
    ];
    for (name, t) in ["q", "k", "v"].iter().zip(&out) {
        check_finite(name, &t.view())?;
    }
    Ok(out)
}

/// Which keys a query may see: the whole problem as `[n_q, n_k]`, checked
/// against `n_q` queries over `n_k` keys as the reference checks it, with
/// its scale.
trait Mask {
    fn allowed(&self, i: usize, j: usize) -> bool;
    fn check(&self, n_q: usize, n_k: usize, h: usize) -> Result<()>;
    /// The work of `h` heads of `d` against the reference's bound
    /// ([`check_varlen_work`], [`check_masked_work`]), last as the reference
    /// checks it.
    fn check_work(&self, n_q: usize, n_k: usize, h: usize, d: usize) -> Result<()>;
    fn scale(&self) -> f64;
    /// The score of `(i, j)` at query head `a` from the scaled dot product.
    fn score(&self, _a: usize, _ij: (usize, usize), raw: f32) -> f32 {
        raw
    }
    /// `d score / d raw`.
    fn chain(&self, _raw: f32) -> f32 {
        1.0
    }
}

impl Mask for Masked<'_> {
    fn allowed(&self, i: usize, j: usize) -> bool {
        self.allowed[[i, j]]
    }
    fn check(&self, n_q: usize, n_k: usize, _h: usize) -> Result<()> {
        check_mask_shape2(self.allowed.shape(), n_q, n_k)
    }
    fn check_work(&self, n_q: usize, n_k: usize, h: usize, d: usize) -> Result<()> {
        check_masked_work(n_q, n_k, h, d)
    }
    fn scale(&self) -> f64 {
        self.scale
    }
}

/// Query `i` in segment `s` of `cu_seqlens_q`, key `j` in the same segment
/// of `cu_seqlens_k`, within the keys [`SegmentMask::keys`] gives (causal and
/// the window bottom-right aligned, docs/FAULTS.md C5; `seqused_k`).
struct Segments<'a>(&'a Varlen<'a>);

impl Segments<'_> {
    /// `(mask of i's segment, r, c)`: local indices, `None` when `j` is not
    /// in `i`'s segment.
    fn local(&self, i: usize, j: usize) -> Option<(SegmentMask<'_>, usize, usize)> {
        let (cu_q, cu_k) = (self.0.cu_seqlens_q, self.0.cu_seqlens_k);
        let s = cu_q.partition_point(|&c| c <= i) - 1;
        if !(cu_k[s]..cu_k[s + 1]).contains(&j) {
            return None;
        }
        Some((SegmentMask::of(self.0, s), i - cu_q[s], j - cu_k[s]))
    }
}

impl Mask for Segments<'_> {
    fn allowed(&self, i: usize, j: usize) -> bool {
        self.local(i, j)
            .is_some_and(|(m, r, c)| m.keys(r).contains(&c))
    }
    fn check(&self, n_q: usize, n_k: usize, h: usize) -> Result<()> {
        check_varlen(self.0, n_q, n_k)?;
        check_varlen_options(self.0, h)
    }
    fn check_work(&self, _: usize, _: usize, h: usize, d: usize) -> Result<()> {
        check_varlen_work(self.0, h, d)
    }
    fn scale(&self) -> f64 {
        self.0.scale
    }
    fn score(&self, a: usize, (i, j): (usize, usize), raw: f32) -> f32 {
        match self.local(i, j) {
            Some((m, r, c)) if m.transforms() => m.score(a, r, c, raw),
            _ => raw,
        }
    }
    fn chain(&self, raw: f32) -> f32 {
        crate::attention::mask::cap_grad(raw, crate::attention::mask::softcap_f32(self.0.softcap))
    }
}

/// `x` in f32, after the checks the reference makes: shapes and finite
/// values, the mask, the scores.
fn checked(x: &Qkv<'_>, mask: &dyn Mask) -> Result<[Array3<f32>; 3]> {
    let x32 = grouped_inputs(x)?;
    mask.check(x.q.dim().0, x.k.dim().0, x.q.dim().1)?;
    check_scores(&x.q, &x.k, mask.scale())?;
    Ok(x32)
}

/// The work of `x` under `mask`, checked last as the reference does.
fn check_work(x: &Qkv<'_>, mask: &dyn Mask) -> Result<()> {
    let (n_q, h, d) = x.q.dim();
    mask.check_work(n_q, x.k.dim().0, h, d)
}

fn run_forward(x: Qkv<'_>, mask: &dyn Mask) -> Result<AttentionOutput> {
    let x32 = checked(&x, mask)?;
    check_work(&x, mask)?;
    Ok(widen(forward(&x32, mask)))
}

fn run_backward(x: Qkv<'_>, mask: &dyn Mask, g: Grad<'_>) -> Result<AttentionGrads> {
    let x32 = checked(&x, mask)?;
    let grad_output = g.grad_output;
    let (out, lse, go) = saved(g, x.q.dim())?;
    check_grad_values(&grad_output, &x.v)?;
    check_work(&x, mask)?;
    Ok(widen_grads(backward(&x32, mask, (&out, &lse), &go)))
}

/// Query heads per key/value head, `h / h_kv`; 1 when there are no heads
/// (`h = h_kv = 0`: no head to loop over, an empty output as the other
/// impls answer, where the division panicked).
fn heads_per_kv(h: usize, h_kv: usize) -> usize {
    h.checked_div(h_kv).unwrap_or(1).max(1)
}

fn forward([q, k, v]: &[Array3<f32>; 3], mask: &dyn Mask) -> (Array3<f32>, Array2<f32>) {
    let scale = mask.scale() as f32;
    let (n, h, d) = q.dim();
    let (n_k, group) = (k.dim().0, heads_per_kv(h, k.dim().1));
    let mut out = Array3::<f32>::zeros((n, h, d));
    let mut lse = Array2::<f32>::from_elem((h, n), f32::NEG_INFINITY);
    let mut scores = Vec::with_capacity(n_k);
    for a in 0..h {
        let kv = a / group;
        for i in 0..n {
            scores.clear();
            for j in 0..n_k {
                if mask.allowed(i, j) {
                    let dot: f32 = (0..d).map(|c| q[[i, a, c]] * k[[j, kv, c]]).sum();
                    scores.push((j, mask.score(a, (i, j), scale * dot)));
                }
            }
            if scores.is_empty() {
                continue; // no key: output 0, lse -inf (docs/FAULTS.md P8)
            }
            let m = scores.iter().fold(f32::NEG_INFINITY, |m, &(_, s)| m.max(s));
            let sum: f32 = scores.iter().map(|&(_, s)| (s - m).exp()).sum();
            let l = m + sum.ln();
            lse[[a, i]] = l;
            for &(j, s) in &scores {
                let p = (s - l).exp();
                for c in 0..d {
                    out[[i, a, c]] += p * v[[j, kv, c]];
                }
            }
        }
    }
    (out, lse)
}

/// Backward from the forward's output and `lse`: `ds = p (dp - delta) scale`;
/// a key head's gradients summed over the query heads of its group.
fn backward(
    [q, k, v]: &[Array3<f32>; 3],
    mask: &dyn Mask,
    (out, lse): (&Array3<f32>, &Array2<f32>),
    go: &Array3<f32>,
) -> [Array3<f32>; 3] {
    let scale = mask.scale() as f32;
    let (n, h, d) = q.dim();
    let (n_k, group) = (k.dim().0, heads_per_kv(h, k.dim().1));
    let (mut gq, mut gk, mut gv) = (
        Array3::<f32>::zeros((n, h, d)),
        Array3::<f32>::zeros(k.dim()),
        Array3::<f32>::zeros(k.dim()),
    );
    for a in 0..h {
        let kv = a / group;
        for i in 0..n {
            let l = lse[[a, i]];
            if l == f32::NEG_INFINITY {
                continue;
            }
            let delta: f32 = (0..d).map(|c| go[[i, a, c]] * out[[i, a, c]]).sum();
            for j in 0..n_k {
                if !mask.allowed(i, j) {
                    continue;
                }
                let dot: f32 = (0..d).map(|c| q[[i, a, c]] * k[[j, kv, c]]).sum();
                let raw = scale * dot;
                let p = (mask.score(a, (i, j), raw) - l).exp();
                let dp: f32 = (0..d).map(|c| go[[i, a, c]] * v[[j, kv, c]]).sum();
                // softcap's chain factor 1 - tanh^2 (1 without it).
                let ds = p * (dp - delta) * mask.chain(raw) * scale;
                for c in 0..d {
                    gv[[j, kv, c]] += p * go[[i, a, c]];
                    gq[[i, a, c]] += ds * k[[j, kv, c]];
                    gk[[j, kv, c]] += ds * q[[i, a, c]];
                }
            }
        }
    }
    [gq, gk, gv]
}

pub(crate) fn widen((out, lse): (Array3<f32>, Array2<f32>)) -> AttentionOutput {
    AttentionOutput {
        output: to_f64(out.view()),
        lse: to_f64(lse.view()),
    }
}

pub(crate) fn widen_grads([gq, gk, gv]: [Array3<f32>; 3]) -> AttentionGrads {
    AttentionGrads {
        grad_q: to_f64(gq.view()),
        grad_k: to_f64(gk.view()),
        grad_v: to_f64(gv.view()),
    }
}

/// The forward's results and the incoming gradient in f32, shapes checked.
pub(crate) fn saved(
    Grad { fwd, grad_output }: Grad<'_>,
    dim: (usize, usize, usize),
) -> Result<(Array3<f32>, Array2<f32>, Array3<f32>)> {
    check_grad_shapes(
        grad_output.shape(),
        fwd.output.shape(),
        fwd.lse.shape(),
        dim,
    )?;
    Ok((
        to_f32("output", fwd.output.view())?,
        fwd.lse.mapv(|x| x as f32),
        to_f32("grad_output", grad_output)?,
    ))
}

impl AttentionOp for ScalarAttention {
    fn support(&self) -> AttentionSupport {
        AttentionSupport::ALL
    }

    fn varlen_forward(&self, x: Qkv<'_>, p: &Varlen<'_>) -> Result<AttentionOutput> {
        run_forward(x, &Segments(p))
    }

    fn varlen_backward(&self, x: Qkv<'_>, p: &Varlen<'_>, g: Grad<'_>) -> Result<AttentionGrads> {
        run_backward(x, &Segments(p), g)
    }

    fn masked_forward(&self, x: Qkv<'_>, m: Masked<'_>) -> Result<AttentionOutput> {
        run_forward(x, &m)
    }

    fn masked_backward(&self, x: Qkv<'_>, m: Masked<'_>, g: Grad<'_>) -> Result<AttentionGrads> {
        run_backward(x, &m, g)
    }
}
