//! The f32 encoder layer: its math, made an `EncoderLayerOp` by the
//! boundary of [`super::boundary::layer`].

use ndarray::ArrayView2;
use packshard_reference::bert::attention::AttentionLayout;
use packshard_reference::Result;

use super::boundary::{EncoderLayerMath, LayerPass32};
use crate::layer::{layer_backward, layer_forward, LayerParams32};

/// `encoder_layer`: the f32 BERT layer — matmuls through `gemm`, SIMD
/// LayerNorm and GELU, varlen attention on packed rows (the dense masked
/// kernel on padded ones).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EncoderLayerF32;

impl EncoderLayerMath for EncoderLayerF32 {
    fn forward_backward(
        &self,
        p: &LayerParams32,
        num_heads: usize,
        eps: f32,
        x: ArrayView2<f32>,
        layout: &AttentionLayout,
        grad_output: ArrayView2<f32>,
    ) -> Result<LayerPass32> {
        let (output, cache) = layer_forward(p, num_heads, eps, x, layout)?;
        let (grad_x, grads) = layer_backward(p, num_heads, &cache, layout, grad_output)?;
        Ok(LayerPass32 {
            output,
            grad_x,
            grads,
        })
    }
}

crate::encoder_layer_op!(EncoderLayerF32);
