//! The f32 encoder layer as an [`EncoderLayerOp`].

use ndarray::ArrayView2;
use packshard_reference::attention::AttentionLayout;
use packshard_reference::bert::LayerParams;
use packshard_reference::ops::{EncoderLayerOp, LayerPass};
use packshard_reference::Result;

use crate::convert::{to_f32, to_f64};
use crate::layer::{layer_backward, layer_forward, layer_params_f32, widen_layer_params};

/// `encoder_layer`: the f32 BERT layer — matmuls through `gemm`, SIMD
/// LayerNorm and GELU, varlen attention on packed rows (the dense masked
/// kernel on padded ones).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EncoderLayerF32;

impl EncoderLayerOp for EncoderLayerF32 {
    fn forward_backward(
        &self,
        params: &LayerParams,
        num_heads: usize,
        eps: f64,
        x: ArrayView2<f64>,
        layout: &AttentionLayout,
        grad_output: ArrayView2<f64>,
    ) -> Result<LayerPass> {
        let p = layer_params_f32(params)?;
        let x = to_f32("hidden", x)?;
        let go = to_f32("grad_output", grad_output)?;
        let (out, cache) = layer_forward(&p, num_heads, eps as f32, x.view(), layout)?;
        let (dx, g) = layer_backward(&p, num_heads, &cache, layout, go.view())?;
        Ok(LayerPass {
            output: to_f64(out.view()),
            grad_x: to_f64(dx.view()),
            grads: widen_layer_params(&g),
        })
    }
}
