//! The backward of [`super::masked_attention`] and
//! [`super::varlen_attention_general`] (flash-attention's: probabilities
//! recomputed from the forward's `lse`), and of a layout.

use ndarray::{Array3, ArrayView2, ArrayView3, Axis, Slice};

use super::check::{check_grad, check_layout, check_layout_work, check_qkv};
use super::{options, AttentionGrads, AttentionLayout, AttentionOutput, Block, Blocks};
use crate::error::Result;
use crate::ops::{AttentionOp, Grad, Masked, Qkv, Varlen};

/// Backward of one block, given the forward's `lse` (probabilities are
/// recomputed as `exp(s - lse)`, as flash-attention does). Key and value
/// gradients accumulate into key head `kv`.
fn head_backward(
    (q, k, v): (&ArrayView3<f64>, &ArrayView3<f64>, &ArrayView3<f64>),
    (out, dout, lse): (&ArrayView3<f64>, &ArrayView3<f64>, &ArrayView2<f64>),
    b: &Block<'_>,
    grads: &mut AttentionGrads,
) {
    let ((head, kv), scale) = (b.heads, b.scale);
    let d = q.dim().2;
    for i in b.queries.clone() {
        let l = lse[[head, i]];
        if l == f64::NEG_INFINITY {
            continue; // no allowed key: no gradient (P8)
        }
        // delta_i = sum_c dO_ic O_ic = sum_j p_ij dP_ij
        let mut delta = 0.0;
        for c in 0..d {
            delta += dout[[i, head, c]] * out[[i, head, c]];
        }
        for j in b.keys.clone() {
            if !(b.allowed)(i, j) {
                continue;
            }
            let (raw, sc) = b.score((q, k), (i, j));
            let p = (sc - l).exp();
            let mut dp = 0.0;
            for c in 0..d {
                dp += dout[[i, head, c]] * v[[j, kv, c]];
                grads.grad_v[[j, kv, c]] += p * dout[[i, head, c]];
            }
            // d s / d raw: softcap's chain factor 1 - tanh^2 (1 without it).
            let ds = p * (dp - delta) * options::cap_grad(raw, b.softcap) * scale;
            for c in 0..d {
                grads.grad_q[[i, head, c]] += ds * k[[j, kv, c]];
                grads.grad_k[[j, kv, c]] += ds * q[[i, head, c]];
            }
        }
    }
}

/// Backward of [`masked_attention`]: `grad_output: [n_q, h, d]`, `fwd` the
/// forward's result. Rows with no allowed key get zero gradients.
///
/// # Errors
/// [`Error::ShapeMismatch`] if the tensors do not fit `q`.
pub fn masked_attention_backward(
    q: ArrayView3<f64>,
    k: ArrayView3<f64>,
    v: ArrayView3<f64>,
    allowed: ArrayView2<bool>,
    scale: f64,
    fwd: &AttentionOutput,
    grad_output: ArrayView3<f64>,
) -> Result<AttentionGrads> {
    backward(
        Qkv::new(q, k, v),
        Blocks::Dense(Masked::new(allowed, scale)),
        Grad::new(fwd, grad_output),
    )
}

fn zero_grads(qdim: (usize, usize, usize), kdim: (usize, usize, usize)) -> AttentionGrads {
    AttentionGrads {
        grad_q: Array3::zeros(qdim),
        grad_k: Array3::zeros(kdim),
        grad_v: Array3::zeros(kdim),
    }
}

/// Backward of [`varlen_attention_general`]: `grad_output: [n_q, h, d]`;
/// returns `grad_q: [n_q, h, d]` and `grad_k`, `grad_v: [n_k, h_kv, d]`.
///
/// # Errors
/// As [`varlen_attention_general`], and [`Error::ShapeMismatch`] for
/// `grad_output`.
pub fn varlen_attention_general_backward(
    q: ArrayView3<f64>,
    k: ArrayView3<f64>,
    v: ArrayView3<f64>,
    p: &Varlen<'_>,
    fwd: &AttentionOutput,
    grad_output: ArrayView3<f64>,
) -> Result<AttentionGrads> {
    backward(
        Qkv::new(q, k, v),
        Blocks::Varlen(p),
        Grad::new(fwd, grad_output),
    )
}

/// The backward of either form.
pub(super) fn backward(x: Qkv<'_>, blocks: Blocks<'_>, g: Grad<'_>) -> Result<AttentionGrads> {
    blocks.check(&x, Some(&g))?;
    let Qkv { q, k, v } = x;
    let (n, h, d) = q.dim();
    let (n_k, h_kv, _) = k.dim();
    let mut grads = zero_grads((n, h, d), (n_k, h_kv, d));
    let (out, lse) = (g.fwd.output.view(), g.fwd.lse.view());
    blocks.for_each((n, h), (n_k, h_kv), &mut |b| {
        head_backward((&q, &k, &v), (&out, &g.grad_output, &lse), b, &mut grads);
    });
    Ok(grads)
}

/// Backward of [`varlen_attention`].
///
/// # Errors
/// As [`varlen_attention_general_backward`].
#[allow(clippy::too_many_arguments)] // the argument list of flash-attention's varlen backward
pub fn varlen_attention_backward(
    q: ArrayView3<f64>,
    k: ArrayView3<f64>,
    v: ArrayView3<f64>,
    cu_seqlens: &[usize],
    causal: bool,
    scale: f64,
    fwd: &AttentionOutput,
    grad_output: ArrayView3<f64>,
) -> Result<AttentionGrads> {
    varlen_attention_general_backward(
        q,
        k,
        v,
        &Varlen::new(cu_seqlens, causal, scale),
        fwd,
        grad_output,
    )
}

/// The backward over a [`AttentionLayout`] through any [`AttentionOp`], as
/// [`layout_forward`].
///
/// # Errors
/// Those of the op, [`check_layout`]'s and [`check_grad_shapes`]'.
pub fn layout_backward<A: AttentionOp + ?Sized>(
    op: &A,
    x: Qkv<'_>,
    layout: &AttentionLayout,
    scale: f64,
    g: Grad<'_>,
) -> Result<AttentionGrads> {
    check_qkv(&x.q, &x.k, &x.v)?;
    let (n, h, d) = x.q.dim();
    check_layout(layout, n)?;
    check_layout_work(layout, h, d)?;
    match layout {
        AttentionLayout::Varlen { cu_seqlens } => {
            op.varlen_backward(x, &Varlen::new(cu_seqlens, false, scale), g)
        }
        AttentionLayout::Dense { row_len, allowed } => {
            let (fwd, grad_output) = (g.fwd, g.grad_output);
            check_grad(&grad_output, fwd, (n, h, d))?;
            let mut grads = zero_grads((n, h, d), x.k.dim());
            for (r, mask) in allowed.iter().enumerate() {
                let rows = Slice::from(r * row_len..(r + 1) * row_len);
                let sub = AttentionOutput {
                    output: fwd.output.slice_axis(Axis(0), rows).to_owned(),
                    lse: fwd.lse.slice_axis(Axis(1), rows).to_owned(),
                };
                let g = op.masked_backward(
                    x.rows(rows),
                    Masked::new(mask.view(), scale),
                    Grad::new(&sub, grad_output.slice_axis(Axis(0), rows)),
                )?;
                grads.grad_q.slice_axis_mut(Axis(0), rows).assign(&g.grad_q);
                grads.grad_k.slice_axis_mut(Axis(0), rows).assign(&g.grad_k);
                grads.grad_v.slice_axis_mut(Axis(0), rows).assign(&g.grad_v);
            }
            Ok(grads)
        }
    }
}
