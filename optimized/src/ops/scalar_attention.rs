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
//! [`crate::attention::mask`]). Its math and its support only: the
//! boundary (the reference's checks, the support's refusals, rounding to f32
//! and widening) is [`super::boundary`]'s.

use ndarray::{Array2, Array3};
use packshard_reference::ops::AttentionSupport;

use super::boundary::{F32AttentionMath, KeyMask, Qkv32};

/// The scalar f32 attention (see the module docs).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ScalarAttention;

crate::f32_attention_op!(ScalarAttention);

impl F32AttentionMath for ScalarAttention {
    fn support(&self) -> AttentionSupport {
        AttentionSupport::ALL
    }

    fn forward(&self, x: &Qkv32, mask: &dyn KeyMask) -> (Array3<f32>, Array2<f32>) {
        forward(x, mask)
    }

    fn backward(
        &self,
        x: &Qkv32,
        mask: &dyn KeyMask,
        fwd: (&Array3<f32>, &Array2<f32>),
        grad_output: &Array3<f32>,
    ) -> [Array3<f32>; 3] {
        backward(x, mask, fwd, grad_output)
    }
}

/// Query heads per key/value head, `h / h_kv`; 1 when there are no heads
/// (`h = h_kv = 0`: no head to loop over, an empty output as the other
/// impls answer, where the division panicked).
fn heads_per_kv(h: usize, h_kv: usize) -> usize {
    h.checked_div(h_kv).unwrap_or(1).max(1)
}

fn forward([q, k, v]: &Qkv32, mask: &dyn KeyMask) -> (Array3<f32>, Array2<f32>) {
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
    [q, k, v]: &Qkv32,
    mask: &dyn KeyMask,
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
