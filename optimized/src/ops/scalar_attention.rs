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
//! causal masks ([`AttentionSupport::ALL`]); results widened to f64.

use ndarray::{Array2, Array3, ArrayView2, ArrayView3};
use packshard_reference::attention::{
    check_grad_shapes, check_mask_shape2, check_qkv_shapes, check_scores, check_varlen,
    AttentionGrads, AttentionOutput,
};
use packshard_reference::ops::{AttentionOp, AttentionSupport, Varlen};
use packshard_reference::Result;

use crate::attention::check_finite;
use crate::convert::{to_f32, to_f64};

/// The scalar f32 attention (see the module docs).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ScalarAttention;

/// `q, k, v` in f32 (all of one shape), refusing non-finite inputs as the
/// kernels do (the boundary of the CUDA attention, `crate::cuda::ops`).
#[cfg(feature = "cuda")]
pub(crate) fn inputs(
    q: &ArrayView3<f64>,
    k: &ArrayView3<f64>,
    v: &ArrayView3<f64>,
) -> Result<[Array3<f32>; 3]> {
    packshard_reference::attention::check_qkv_same_shapes(q.shape(), k.shape(), v.shape())?;
    grouped_inputs(q, k, v)
}

/// `q: [n_q, h, d]` and `k, v: [n_k, h_kv, d]` in f32, refusing non-finite
/// inputs.
fn grouped_inputs(
    q: &ArrayView3<f64>,
    k: &ArrayView3<f64>,
    v: &ArrayView3<f64>,
) -> Result<[Array3<f32>; 3]> {
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

/// Which keys a query may see: the whole problem as `[n_q, n_k]`.
trait Mask {
    fn allowed(&self, i: usize, j: usize) -> bool;
}

impl Mask for ArrayView2<'_, bool> {
    fn allowed(&self, i: usize, j: usize) -> bool {
        self[[i, j]]
    }
}

/// Query `i` in segment `s` of `cu_seqlens_q`, key `j` in the same segment
/// of `cu_seqlens_k`, and when causal `j - k_s <= i - q_s + l_k - l_q`
/// (bottom-right aligned: docs/FAULTS.md C5).
struct Segments<'a>(&'a Varlen<'a>);

impl Mask for Segments<'_> {
    fn allowed(&self, i: usize, j: usize) -> bool {
        let (cu_q, cu_k) = (self.0.cu_seqlens_q, self.0.cu_seqlens_k);
        let s = cu_q.partition_point(|&c| c <= i) - 1;
        if !(cu_k[s]..cu_k[s + 1]).contains(&j) {
            return false;
        }
        // j - k_s <= i - q_s + l_k - l_q, with every term non-negative.
        !self.0.causal
            || j - cu_k[s] + (cu_q[s + 1] - cu_q[s]) <= i - cu_q[s] + (cu_k[s + 1] - cu_k[s])
    }
}

fn forward(
    [q, k, v]: &[Array3<f32>; 3],
    mask: &dyn Mask,
    scale: f32,
) -> (Array3<f32>, Array2<f32>) {
    let (n, h, d) = q.dim();
    let (n_k, group) = (k.dim().0, h / k.dim().1);
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
                    scores.push((j, scale * dot));
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
    scale: f32,
    (out, lse): (&Array3<f32>, &Array2<f32>),
    go: &Array3<f32>,
) -> [Array3<f32>; 3] {
    let (n, h, d) = q.dim();
    let (n_k, group) = (k.dim().0, h / k.dim().1);
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
                let p = (scale * dot - l).exp();
                let dp: f32 = (0..d).map(|c| go[[i, a, c]] * v[[j, kv, c]]).sum();
                let ds = p * (dp - delta) * scale;
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
    fwd: &AttentionOutput,
    grad_output: ArrayView3<f64>,
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

    fn varlen_forward(
        &self,
        q: ArrayView3<f64>,
        k: ArrayView3<f64>,
        v: ArrayView3<f64>,
        p: &Varlen<'_>,
    ) -> Result<AttentionOutput> {
        let x = grouped_inputs(&q, &k, &v)?;
        check_varlen(p, q.dim().0, k.dim().0)?;
        check_scores(&q, &k, p.scale)?;
        Ok(widen(forward(&x, &Segments(p), p.scale as f32)))
    }

    fn varlen_backward(
        &self,
        q: ArrayView3<f64>,
        k: ArrayView3<f64>,
        v: ArrayView3<f64>,
        p: &Varlen<'_>,
        fwd: &AttentionOutput,
        grad_output: ArrayView3<f64>,
    ) -> Result<AttentionGrads> {
        let x = grouped_inputs(&q, &k, &v)?;
        check_varlen(p, q.dim().0, k.dim().0)?;
        check_scores(&q, &k, p.scale)?;
        let (out, lse, go) = saved(fwd, grad_output, q.dim())?;
        Ok(widen_grads(backward(
            &x,
            &Segments(p),
            p.scale as f32,
            (&out, &lse),
            &go,
        )))
    }

    fn masked_forward(
        &self,
        q: ArrayView3<f64>,
        k: ArrayView3<f64>,
        v: ArrayView3<f64>,
        allowed: ArrayView2<bool>,
        scale: f64,
    ) -> Result<AttentionOutput> {
        let x = grouped_inputs(&q, &k, &v)?;
        check_mask_shape2(allowed.shape(), q.dim().0, k.dim().0)?;
        check_scores(&q, &k, scale)?;
        Ok(widen(forward(&x, &allowed, scale as f32)))
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
    ) -> Result<AttentionGrads> {
        let x = grouped_inputs(&q, &k, &v)?;
        check_mask_shape2(allowed.shape(), q.dim().0, k.dim().0)?;
        check_scores(&q, &k, scale)?;
        let (out, lse, go) = saved(fwd, grad_output, q.dim())?;
        Ok(widen_grads(backward(
            &x,
            &allowed,
            scale as f32,
            (&out, &lse),
            &go,
        )))
    }
}
