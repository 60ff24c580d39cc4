//! The f32/bf16 attention kernels as [`AttentionOp`]s: inputs rounded on
//! entry ([`crate::convert`]), results widened on exit.

use ndarray::{Array2, ArrayView2, ArrayView3};
use packshard_reference::attention::{
    check_qkv_shapes, check_scores, check_varlen, AttentionGrads, AttentionOutput,
};
use packshard_reference::ops::{AttentionOp, AttentionSupport, Precision, Varlen};
use packshard_reference::{Error, Result};

use crate::attention::{
    dense_masked_attention, dense_masked_attention_backward, varlen_attention_general,
    varlen_attention_general_backward, AttentionGrads32, AttentionOutput32,
};
use crate::convert::{to_bf16, to_f32, to_f64};

/// The most tokens the dense masked kernel takes in its varlen form: it
/// builds an `[n_tok, n_tok]` boolean mask (64 MiB at this size).
pub const MAX_DENSE_TOKENS: usize = 8192;

fn widen(out: AttentionOutput32) -> AttentionOutput {
    AttentionOutput {
        output: to_f64(out.output.view()),
        lse: to_f64(out.lse.view()),
    }
}

fn widen_grads(g: AttentionGrads32) -> AttentionGrads {
    AttentionGrads {
        grad_q: to_f64(g.grad_q.view()),
        grad_k: to_f64(g.grad_k.view()),
        grad_v: to_f64(g.grad_v.view()),
    }
}

/// A forward result handed back to the backward (f32 values held in f64).
fn narrow(fwd: &AttentionOutput) -> Result<AttentionOutput32> {
    Ok(AttentionOutput32 {
        output: to_f32("output", fwd.output.view())?,
        lse: fwd.lse.mapv(|v| v as f32),
    })
}

/// Runs `$call` with `q, k, v` rounded to `$precision` (f32 or bf16).
macro_rules! with_inputs {
    ($precision:expr, $q:expr, $k:expr, $v:expr, |$qq:ident, $kk:ident, $vv:ident| $call:expr) => {
        match $precision {
            Precision::Bf16 => {
                let ($qq, $kk, $vv) = (to_bf16("q", $q)?, to_bf16("k", $k)?, to_bf16("v", $v)?);
                let ($qq, $kk, $vv) = ($qq.view(), $kk.view(), $vv.view());
                $call
            }
            _ => {
                let ($qq, $kk, $vv) = (to_f32("q", $q)?, to_f32("k", $k)?, to_f32("v", $v)?);
                let ($qq, $kk, $vv) = ($qq.view(), $kk.view(), $vv.view());
                $call
            }
        }
    };
}

/// Checks a varlen problem as the reference does, then what this kernel
/// supports.
fn check_problem(
    support: AttentionSupport,
    q: &ArrayView3<f64>,
    k: &ArrayView3<f64>,
    v: &ArrayView3<f64>,
    p: &Varlen<'_>,
) -> Result<()> {
    check_qkv_shapes(q.shape(), k.shape(), v.shape())?;
    check_varlen(p, q.dim().0, k.dim().0)?;
    support.check(p, q.dim().1, k.dim().1)?;
    check_scores(q, k, p.scale)
}

fn check_dense_heads(q: &ArrayView3<f64>, k: &ArrayView3<f64>, v: &ArrayView3<f64>) -> Result<()> {
    check_qkv_shapes(q.shape(), k.shape(), v.shape())?;
    if k.dim().0 != q.dim().0 {
        return Err(Error::invalid(
            "k",
            format!(
                "has {} tokens for {} queries: the dense kernel needs a square [n, n] mask",
                k.dim().0,
                q.dim().0
            ),
        ));
    }
    Ok(())
}

/// `attention_varlen_tiled` (f32 inputs) and `attention_varlen_tiled_bf16`
/// (bf16 inputs, f32 accumulation): the varlen form through
/// [`varlen_attention_general`] (online softmax per 64 x 64 tile of each
/// segment, never a mask; grouped-query attention, `cu_seqlens_k !=
/// cu_seqlens_q` with bottom-right causal masks: [`AttentionSupport::ALL`]),
/// the masked form (square `[n, n]` masks) through [`dense_masked_attention`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TiledAttention {
    /// What `q`, `k`, `v` are rounded to: [`Precision::F32`] or [`Precision::Bf16`].
    pub precision: Precision,
}

impl TiledAttention {
    /// f32 inputs.
    pub const F32: TiledAttention = TiledAttention {
        precision: Precision::F32,
    };
    /// bf16 inputs.
    pub const BF16: TiledAttention = TiledAttention {
        precision: Precision::Bf16,
    };
}

impl AttentionOp for TiledAttention {
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
        check_problem(self.support(), &q, &k, &v, p)?;
        let out = with_inputs!(self.precision, q, k, v, |q, k, v| {
            varlen_attention_general(q, k, v, p)?
        });
        Ok(widen(out))
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
        check_problem(self.support(), &q, &k, &v, p)?;
        let f = narrow(fwd)?;
        let go = to_f32("grad_output", grad_output)?;
        let g = with_inputs!(self.precision, q, k, v, |q, k, v| {
            varlen_attention_general_backward(q, k, v, p, &f, go.view())?
        });
        Ok(widen_grads(g))
    }

    fn masked_forward(
        &self,
        q: ArrayView3<f64>,
        k: ArrayView3<f64>,
        v: ArrayView3<f64>,
        allowed: ArrayView2<bool>,
        scale: f64,
    ) -> Result<AttentionOutput> {
        dense_forward(self.precision, q, k, v, allowed, scale)
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
        dense_backward(self.precision, q, k, v, allowed, scale, fwd, grad_output)
    }
}

fn dense_forward(
    precision: Precision,
    q: ArrayView3<f64>,
    k: ArrayView3<f64>,
    v: ArrayView3<f64>,
    allowed: ArrayView2<bool>,
    scale: f64,
) -> Result<AttentionOutput> {
    check_dense_heads(&q, &k, &v)?;
    check_scores(&q, &k, scale)?;
    let n = q.dim().0;
    let out = with_inputs!(precision, q, k, v, |q, k, v| dense_masked_attention(
        q,
        k,
        v,
        n,
        &[allowed],
        scale as f32
    )?);
    Ok(widen(out))
}

#[allow(clippy::too_many_arguments)]
fn dense_backward(
    precision: Precision,
    q: ArrayView3<f64>,
    k: ArrayView3<f64>,
    v: ArrayView3<f64>,
    allowed: ArrayView2<bool>,
    scale: f64,
    fwd: &AttentionOutput,
    grad_output: ArrayView3<f64>,
) -> Result<AttentionGrads> {
    check_dense_heads(&q, &k, &v)?;
    check_scores(&q, &k, scale)?;
    let n = q.dim().0;
    let f = narrow(fwd)?;
    let go = to_f32("grad_output", grad_output)?;
    let g = with_inputs!(precision, q, k, v, |q, k, v| {
        dense_masked_attention_backward(q, k, v, n, &[allowed], scale as f32, &f, go.view())?
    });
    Ok(widen_grads(g))
}

/// `attention_dense_masked`: every score of the whole row computed, the mask
/// applied after (the padded / block-diagonal-mask baseline). Its varlen form
/// is one row of all `n_tok` tokens with the `[n_tok, n_tok]` mask of the
/// segments (bottom-right causal within each when asked), at most
/// [`MAX_DENSE_TOKENS`] tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DenseMaskedAttention;

/// The `[n, n]` mask of a self-attention varlen problem (already checked).
fn segment_mask(p: &Varlen<'_>, n: usize) -> Array2<bool> {
    let cu = p.cu_seqlens_q;
    let seg = |i: usize| cu.partition_point(|&c| c <= i);
    Array2::from_shape_fn((n, n), |(i, j)| seg(i) == seg(j) && (!p.causal || j <= i))
}

impl DenseMaskedAttention {
    fn mask(
        &self,
        q: &ArrayView3<f64>,
        k: &ArrayView3<f64>,
        v: &ArrayView3<f64>,
        p: &Varlen<'_>,
    ) -> Result<Array2<bool>> {
        check_problem(self.support(), q, k, v, p)?;
        let n = q.dim().0;
        if n > MAX_DENSE_TOKENS {
            return Err(Error::invalid(
                "q",
                format!("{n} tokens: attention_dense_masked builds an [n_tok, n_tok] mask and takes at most {MAX_DENSE_TOKENS}"),
            ));
        }
        Ok(segment_mask(p, n))
    }
}

impl AttentionOp for DenseMaskedAttention {
    /// Self-attention (its mask is square), grouped-query or not.
    fn support(&self) -> AttentionSupport {
        AttentionSupport {
            cross: false,
            ..AttentionSupport::ALL
        }
    }

    fn varlen_forward(
        &self,
        q: ArrayView3<f64>,
        k: ArrayView3<f64>,
        v: ArrayView3<f64>,
        p: &Varlen<'_>,
    ) -> Result<AttentionOutput> {
        let mask = self.mask(&q, &k, &v, p)?;
        dense_forward(Precision::F32, q, k, v, mask.view(), p.scale)
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
        let mask = self.mask(&q, &k, &v, p)?;
        dense_backward(
            Precision::F32,
            q,
            k,
            v,
            mask.view(),
            p.scale,
            fwd,
            grad_output,
        )
    }

    fn masked_forward(
        &self,
        q: ArrayView3<f64>,
        k: ArrayView3<f64>,
        v: ArrayView3<f64>,
        allowed: ArrayView2<bool>,
        scale: f64,
    ) -> Result<AttentionOutput> {
        dense_forward(Precision::F32, q, k, v, allowed, scale)
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
        dense_backward(Precision::F32, q, k, v, allowed, scale, fwd, grad_output)
    }
}
