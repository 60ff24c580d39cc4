//! A "user's kernel": naive scaled dot-product attention over variable-length
//! segments, in plain f64 loops, written without looking at packshard's
//! reference — the kind of kernel a framework author wants to check.
//!
//! It implements [`AttentionOp`], packshard's op trait for attention in
//! its packed (`q, k, v: [n_tok, h, d]` with `cu_seqlens: [b + 1]`, as
//! flash-attention's `flash_attn_varlen_func`) and padded (`[L, h, d]` with a
//! boolean mask) forms. It keeps the trait's default support (bidirectional
//! self-attention with as many key heads as query heads) and refuses causal
//! masks, grouped-query attention and `cu_seqlens_k != cu_seqlens_q`. `tests/differential.rs` fuzzes it against the f64
//! reference; `fuzz/` does the same under libFuzzer.

use ndarray::{Array2, Array3, ArrayView3};
use packshard_reference::bert::attention::check_cu_seqlens;
use packshard_reference::bert::{AttentionGrads, AttentionOutput};
use packshard_reference::ops::{AttentionOp, Grad, Masked, Qkv, Varlen};
use packshard_reference::{Error, Result};

/// The kernel: one query at a time, softmax with the row maximum subtracted.
#[derive(Debug, Clone, Copy, Default)]
pub struct NaiveAttention;

/// Forward and backward of the queries in `rows` of one head, each over the
/// keys `allowed(i)` gives (indices into the same tensors).
fn attend(
    Qkv { q, k, v }: &Qkv<'_>,
    head: usize,
    rows: std::ops::Range<usize>,
    allowed: &dyn Fn(usize) -> Vec<usize>,
    scale: f64,
    out: &mut AttentionOutput,
    backward: Option<(&ArrayView3<f64>, &mut AttentionGrads)>,
) {
    let d = q.dim().2;
    let mut backward = backward;
    for i in rows {
        let keys = allowed(i);
        if keys.is_empty() {
            // No key to attend to: output 0, lse -inf, no gradient.
            out.lse[[head, i]] = f64::NEG_INFINITY;
            continue;
        }
        let scores: Vec<f64> = keys
            .iter()
            .map(|&j| {
                scale
                    * (0..d)
                        .map(|c| q[[i, head, c]] * k[[j, head, c]])
                        .sum::<f64>()
            })
            .collect();
        let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
        let total: f64 = weights.iter().sum();
        let p: Vec<f64> = weights.iter().map(|w| w / total).collect();
        out.lse[[head, i]] = max + total.ln();
        for c in 0..d {
            out.output[[i, head, c]] = keys.iter().zip(&p).map(|(&j, p)| p * v[[j, head, c]]).sum();
        }
        if let Some((dout, grads)) = backward.as_mut() {
            // dO.O, then for each key dP = dO.v_j and dS = p (dP - dO.O).
            let dot_o: f64 = (0..d)
                .map(|c| dout[[i, head, c]] * out.output[[i, head, c]])
                .sum();
            for (&j, &pj) in keys.iter().zip(&p) {
                let dp: f64 = (0..d).map(|c| dout[[i, head, c]] * v[[j, head, c]]).sum();
                let ds = pj * (dp - dot_o);
                for c in 0..d {
                    grads.grad_q[[i, head, c]] += scale * ds * k[[j, head, c]];
                    grads.grad_k[[j, head, c]] += scale * ds * q[[i, head, c]];
                    grads.grad_v[[j, head, c]] += pj * dout[[i, head, c]];
                }
            }
        }
    }
}

fn check_shapes(Qkv { q, k, v }: &Qkv<'_>) -> Result<()> {
    for (name, t) in [("k", k), ("v", v)] {
        if t.dim() != q.dim() {
            return Err(Error::ShapeMismatch {
                field: name.into(),
                expected: format!("{:?} (the shape of q)", q.shape()),
                actual: t.shape().to_vec(),
            });
        }
    }
    Ok(())
}

fn zeros(q: &ArrayView3<f64>) -> (AttentionOutput, AttentionGrads) {
    let (n, h, d) = q.dim();
    (
        AttentionOutput {
            output: Array3::zeros((n, h, d)),
            lse: Array2::zeros((h, n)),
        },
        AttentionGrads {
            grad_q: Array3::zeros((n, h, d)),
            grad_k: Array3::zeros((n, h, d)),
            grad_v: Array3::zeros((n, h, d)),
        },
    )
}

impl NaiveAttention {
    fn varlen(
        x: Qkv<'_>,
        cu_seqlens: &[usize],
        scale: f64,
        dout: Option<&ArrayView3<f64>>,
    ) -> Result<(AttentionOutput, AttentionGrads)> {
        check_shapes(&x)?;
        // Bad cu_seqlens must be an error, not a panic or a silent result:
        // packshard's own checker gives the reference's error.
        check_cu_seqlens(cu_seqlens, x.q.dim().0)?;
        let (mut out, mut grads) = zeros(&x.q);
        for w in cu_seqlens.windows(2) {
            let (a, b) = (w[0], w[1]);
            for head in 0..x.q.dim().1 {
                let back = dout.map(|g| (g, &mut grads));
                let keys = |_| (a..b).collect();
                attend(&x, head, a..b, &keys, scale, &mut out, back);
            }
        }
        Ok((out, grads))
    }

    fn masked(
        x: Qkv<'_>,
        m: Masked<'_>,
        dout: Option<&ArrayView3<f64>>,
    ) -> Result<(AttentionOutput, AttentionGrads)> {
        check_shapes(&x)?;
        let n = x.q.dim().0;
        if m.allowed.dim() != (n, n) {
            return Err(Error::ShapeMismatch {
                field: "allowed".into(),
                expected: format!("[{n}, {n}]"),
                actual: m.allowed.shape().to_vec(),
            });
        }
        let (mut out, mut grads) = zeros(&x.q);
        let keys = |i: usize| (0..n).filter(|&j| m.allowed[[i, j]]).collect();
        for head in 0..x.q.dim().1 {
            let back = dout.map(|g| (g, &mut grads));
            attend(&x, head, 0..n, &keys, m.scale, &mut out, back);
        }
        Ok((out, grads))
    }
}

impl AttentionOp for NaiveAttention {
    fn varlen_forward(&self, x: Qkv<'_>, p: &Varlen<'_>) -> Result<AttentionOutput> {
        self.support().check(p, x.q.dim().1, x.k.dim().1)?;
        Ok(Self::varlen(x, p.cu_seqlens_q, p.scale, None)?.0)
    }

    fn varlen_backward(&self, x: Qkv<'_>, p: &Varlen<'_>, g: Grad<'_>) -> Result<AttentionGrads> {
        self.support().check(p, x.q.dim().1, x.k.dim().1)?;
        // Recomputes the forward (as flash-attention does) rather than trusting `g.fwd`.
        Ok(Self::varlen(x, p.cu_seqlens_q, p.scale, Some(&g.grad_output))?.1)
    }

    fn masked_forward(&self, x: Qkv<'_>, m: Masked<'_>) -> Result<AttentionOutput> {
        Ok(Self::masked(x, m, None)?.0)
    }

    fn masked_backward(&self, x: Qkv<'_>, m: Masked<'_>, g: Grad<'_>) -> Result<AttentionGrads> {
        Ok(Self::masked(x, m, Some(&g.grad_output))?.1)
    }
}
