//! The f32 kernels behind the reference's f64 interfaces: conversions that
//! refuse values f32 cannot hold, and [`OptimizedAttention`], an
//! [`AttentionKernel`] that the reference BERT (and `packshard eval`) can run.

use half::bf16;
use ndarray::{Array, ArrayView, ArrayView2, ArrayView3, Dimension};
use packshard_reference::bert::attention::{
    check_layout, AttentionGrads, AttentionKernel, AttentionLayout, AttentionOutput,
};
use packshard_reference::{Error, Result};

use crate::attention::{
    dense_masked_attention, dense_masked_attention_backward, varlen_attention,
    varlen_attention_backward, AttentionGrads32, AttentionOutput32,
};

/// `x` as f32, rounded to nearest. Non-finite values pass through (the
/// kernels report them as [`Error::NonFiniteInput`] with the same index).
///
/// # Errors
/// [`Error::InvalidArgument`] naming `field[i]` (flat index) for a finite
/// value beyond the f32 range (`|x| > 3.4e38`).
pub fn to_f32<D: Dimension>(field: &str, x: ArrayView<f64, D>) -> Result<Array<f32, D>> {
    if let Some((i, &v)) = x
        .iter()
        .enumerate()
        .find(|(_, v)| v.is_finite() && v.abs() > f32::MAX as f64)
    {
        return Err(Error::invalid(
            format!("{field}[{i}]"),
            format!("{v:e} is beyond the f32 range of the optimized kernels"),
        ));
    }
    Ok(x.mapv(|v| v as f32))
}

/// `x` as bf16 (round to nearest even), checked as [`to_f32`].
///
/// # Errors
/// As [`to_f32`].
pub fn to_bf16<D: Dimension>(field: &str, x: ArrayView<f64, D>) -> Result<Array<bf16, D>> {
    Ok(to_f32(field, x)?.mapv(bf16::from_f32))
}

/// An f32 tensor as f64 (exact).
pub fn to_f64<D: Dimension>(x: ArrayView<f32, D>) -> Array<f64, D> {
    x.mapv(f64::from)
}

/// The element type the attention variant reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    /// `f32` inputs.
    F32,
    /// `bf16` inputs (f32 accumulation).
    Bf16,
}

/// An optimized attention variant with f64 inputs and outputs (converted at
/// the boundary): varlen layouts run [`varlen_attention`], dense layouts
/// [`dense_masked_attention`], on inputs in `precision`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptimizedAttention {
    /// What the inputs are rounded to.
    pub precision: Precision,
}

impl OptimizedAttention {
    /// f32 inputs.
    pub const F32: OptimizedAttention = OptimizedAttention {
        precision: Precision::F32,
    };
    /// bf16 inputs.
    pub const BF16: OptimizedAttention = OptimizedAttention {
        precision: Precision::Bf16,
    };

    /// The forward of the varlen form (`causal` as the reference's).
    ///
    /// # Errors
    /// As [`varlen_attention`] and [`to_f32`].
    pub fn varlen_forward(
        &self,
        q: ArrayView3<f64>,
        k: ArrayView3<f64>,
        v: ArrayView3<f64>,
        cu_seqlens: &[usize],
        causal: bool,
        scale: f64,
    ) -> Result<AttentionOutput> {
        let out = match self.precision {
            Precision::F32 => varlen_attention(
                to_f32("q", q)?.view(),
                to_f32("k", k)?.view(),
                to_f32("v", v)?.view(),
                cu_seqlens,
                causal,
                scale as f32,
            )?,
            Precision::Bf16 => varlen_attention(
                to_bf16("q", q)?.view(),
                to_bf16("k", k)?.view(),
                to_bf16("v", v)?.view(),
                cu_seqlens,
                causal,
                scale as f32,
            )?,
        };
        Ok(widen(out))
    }

    /// The backward of the varlen form.
    ///
    /// # Errors
    /// As [`varlen_attention_backward`] and [`to_f32`].
    #[allow(clippy::too_many_arguments)]
    pub fn varlen_backward(
        &self,
        q: ArrayView3<f64>,
        k: ArrayView3<f64>,
        v: ArrayView3<f64>,
        cu_seqlens: &[usize],
        causal: bool,
        scale: f64,
        fwd: &AttentionOutput,
        grad_output: ArrayView3<f64>,
    ) -> Result<AttentionGrads> {
        let f = narrow(fwd)?;
        let go = to_f32("grad_output", grad_output)?;
        let g = match self.precision {
            Precision::F32 => varlen_attention_backward(
                to_f32("q", q)?.view(),
                to_f32("k", k)?.view(),
                to_f32("v", v)?.view(),
                cu_seqlens,
                causal,
                scale as f32,
                &f,
                go.view(),
            )?,
            Precision::Bf16 => varlen_attention_backward(
                to_bf16("q", q)?.view(),
                to_bf16("k", k)?.view(),
                to_bf16("v", v)?.view(),
                cu_seqlens,
                causal,
                scale as f32,
                &f,
                go.view(),
            )?,
        };
        Ok(widen_grads(g))
    }

    /// The forward of the dense form: `masks[r]: [row_len, row_len]`.
    ///
    /// # Errors
    /// As [`dense_masked_attention`] and [`to_f32`].
    pub fn dense_forward(
        &self,
        q: ArrayView3<f64>,
        k: ArrayView3<f64>,
        v: ArrayView3<f64>,
        row_len: usize,
        masks: &[ArrayView2<bool>],
        scale: f64,
    ) -> Result<AttentionOutput> {
        let out = match self.precision {
            Precision::F32 => dense_masked_attention(
                to_f32("q", q)?.view(),
                to_f32("k", k)?.view(),
                to_f32("v", v)?.view(),
                row_len,
                masks,
                scale as f32,
            )?,
            Precision::Bf16 => dense_masked_attention(
                to_bf16("q", q)?.view(),
                to_bf16("k", k)?.view(),
                to_bf16("v", v)?.view(),
                row_len,
                masks,
                scale as f32,
            )?,
        };
        Ok(widen(out))
    }

    /// The backward of the dense form.
    ///
    /// # Errors
    /// As [`dense_masked_attention_backward`] and [`to_f32`].
    #[allow(clippy::too_many_arguments)]
    pub fn dense_backward(
        &self,
        q: ArrayView3<f64>,
        k: ArrayView3<f64>,
        v: ArrayView3<f64>,
        row_len: usize,
        masks: &[ArrayView2<bool>],
        scale: f64,
        fwd: &AttentionOutput,
        grad_output: ArrayView3<f64>,
    ) -> Result<AttentionGrads> {
        let f = narrow(fwd)?;
        let go = to_f32("grad_output", grad_output)?;
        let g = match self.precision {
            Precision::F32 => dense_masked_attention_backward(
                to_f32("q", q)?.view(),
                to_f32("k", k)?.view(),
                to_f32("v", v)?.view(),
                row_len,
                masks,
                scale as f32,
                &f,
                go.view(),
            )?,
            Precision::Bf16 => dense_masked_attention_backward(
                to_bf16("q", q)?.view(),
                to_bf16("k", k)?.view(),
                to_bf16("v", v)?.view(),
                row_len,
                masks,
                scale as f32,
                &f,
                go.view(),
            )?,
        };
        Ok(widen_grads(g))
    }
}

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

impl AttentionKernel for OptimizedAttention {
    fn name(&self) -> String {
        match self.precision {
            Precision::F32 => "attention_varlen_tiled".into(),
            Precision::Bf16 => "attention_varlen_tiled_bf16".into(),
        }
    }

    fn forward(
        &self,
        q: ArrayView3<f64>,
        k: ArrayView3<f64>,
        v: ArrayView3<f64>,
        layout: &AttentionLayout,
        scale: f64,
    ) -> Result<AttentionOutput> {
        check_layout(layout, q.dim().0)?;
        match layout {
            AttentionLayout::Varlen { cu_seqlens } => {
                self.varlen_forward(q, k, v, cu_seqlens, false, scale)
            }
            AttentionLayout::Dense { row_len, allowed } => {
                let masks: Vec<ArrayView2<bool>> = allowed.iter().map(|a| a.view()).collect();
                self.dense_forward(q, k, v, *row_len, &masks, scale)
            }
        }
    }

    fn backward(
        &self,
        q: ArrayView3<f64>,
        k: ArrayView3<f64>,
        v: ArrayView3<f64>,
        layout: &AttentionLayout,
        scale: f64,
        fwd: &AttentionOutput,
        grad_output: ArrayView3<f64>,
    ) -> Result<AttentionGrads> {
        check_layout(layout, q.dim().0)?;
        match layout {
            AttentionLayout::Varlen { cu_seqlens } => {
                self.varlen_backward(q, k, v, cu_seqlens, false, scale, fwd, grad_output)
            }
            AttentionLayout::Dense { row_len, allowed } => {
                let masks: Vec<ArrayView2<bool>> = allowed.iter().map(|a| a.view()).collect();
                self.dense_backward(q, k, v, *row_len, &masks, scale, fwd, grad_output)
            }
        }
    }
}
