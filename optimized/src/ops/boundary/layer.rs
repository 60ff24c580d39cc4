//! The boundary of an f32 encoder layer, written once: a kernel implements
//! its math on f32 tensors ([`EncoderLayerMath`]) and
//! [`encoder_layer_op!`](crate::encoder_layer_op) makes it an
//! [`EncoderLayerOp`] that
//!
//! 1. rounds the parameters to f32 (finite values beyond its range refused
//!    naming the parameter and flat index, then their shapes checked:
//!    [`layer_params_f32`]), then `x` (`hidden`), then `grad_output`
//!    ([`to_f32`]);
//! 2. calls the math, which makes the reference's checks (the input and
//!    layout, `crate::layer::layer_forward`; `grad_output`'s shape and
//!    values, `crate::layer::layer_backward`) and computes, with `eps`
//!    rounded to f32;
//! 3. widens the results to f64 exactly.
//!
//! The encoder layer's op trait declares no support: a kernel implements
//! both layouts of `AttentionLayout` (packed `cu_seqlens`, padded rows with
//! masks).
//!
//! Shapes: `x, grad_output, output, grad_x: [n, hidden]`; the parameters as
//! [`LayerParams`](packshard_reference::bert::LayerParams).

use ndarray::{Array2, ArrayView2};
use packshard_reference::bert::attention::AttentionLayout;
use packshard_reference::ops::{Layer, LayerInput, LayerPass};
use packshard_reference::Result;

#[cfg(doc)]
use packshard_reference::ops::EncoderLayerOp;

use crate::convert::{to_f32, to_f64};
use crate::layer::{layer_params_f32, widen_layer_params, LayerParams32};

/// One layer's forward and backward results in f32.
#[derive(Debug, Clone)]
pub struct LayerPass32 {
    /// `[n, hidden]`.
    pub output: Array2<f32>,
    /// `[n, hidden]`: the gradient of `x`.
    pub grad_x: Array2<f32>,
    /// Every parameter's gradient, shaped as the parameters.
    pub grads: LayerParams32,
}

/// The math of an f32 encoder layer; [`encoder_layer_op!`](crate::encoder_layer_op)
/// gives it the boundary (see the module docs).
pub trait EncoderLayerMath: Send + Sync {
    /// The layer of parameters `p` with `num_heads` heads and LayerNorm's
    /// `eps` on `x: [n, hidden]` over `layout`, forward, then backward from
    /// `grad_output: [n, hidden]`.
    ///
    /// # Errors
    /// The reference's (`packshard_reference::bert::layer::layer_forward`,
    /// then `grad_output`'s), then the kernel's own.
    fn forward_backward(
        &self,
        p: &LayerParams32,
        num_heads: usize,
        eps: f32,
        x: ArrayView2<f32>,
        layout: &AttentionLayout,
        grad_output: ArrayView2<f32>,
    ) -> Result<LayerPass32>;
}

/// The encoder layer of `kernel` through the boundary.
///
/// # Errors
/// The rounding's refusals (parameters, `hidden`, `grad_output`), then the
/// math's.
pub fn encoder_layer<K: EncoderLayerMath + ?Sized>(
    kernel: &K,
    layer: Layer<'_>,
    input: LayerInput<'_>,
) -> Result<LayerPass> {
    let p = layer_params_f32(layer.params)?;
    let x = to_f32("hidden", input.x)?;
    let go = to_f32("grad_output", input.grad_output)?;
    let (heads, eps) = (layer.num_heads, layer.eps as f32);
    let r = kernel.forward_backward(&p, heads, eps, x.view(), input.layout, go.view())?;
    Ok(LayerPass {
        output: to_f64(r.output.view()),
        grad_x: to_f64(r.grad_x.view()),
        grads: widen_layer_params(&r.grads),
    })
}

/// `impl EncoderLayerOp for $kernel` through the boundary of this module,
/// for a `$kernel` that implements [`EncoderLayerMath`].
#[macro_export]
macro_rules! encoder_layer_op {
    ($kernel:ty) => {
        impl $crate::ops::boundary::reexport::EncoderLayerOp for $kernel {
            fn forward_backward(
                &self,
                layer: $crate::ops::boundary::reexport::Layer<'_>,
                input: $crate::ops::boundary::reexport::LayerInput<'_>,
            ) -> $crate::ops::boundary::reexport::Result<$crate::ops::boundary::reexport::LayerPass>
            {
                $crate::ops::boundary::encoder_layer(self, layer, input)
            }
        }
    };
}
