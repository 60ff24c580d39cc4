//! The f32 encoder layer as an [`EncoderLayerOp`].

use packshard_reference::ops::{EncoderLayerOp, Layer, LayerInput, LayerPass};
use packshard_reference::Result;

use crate::convert::{to_f32, to_f64};
use crate::layer::{layer_backward, layer_forward, layer_params_f32, widen_layer_params};

/// `encoder_layer`: the f32 BERT layer — matmuls through `gemm`, SIMD
/// LayerNorm and GELU, varlen attention on packed rows (the dense masked
/// kernel on padded ones).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EncoderLayerF32;

impl EncoderLayerOp for EncoderLayerF32 {
    fn forward_backward(&self, layer: Layer<'_>, input: LayerInput<'_>) -> Result<LayerPass> {
        let (p, num_heads, eps) = (layer_params_f32(layer.params)?, layer.num_heads, layer.eps);
        let x = to_f32("hidden", input.x)?;
        let go = to_f32("grad_output", input.grad_output)?;
        let layout = input.layout;
        let (out, cache) = layer_forward(&p, num_heads, eps as f32, x.view(), layout)?;
        let (dx, g) = layer_backward(&p, num_heads, &cache, layout, go.view())?;
        Ok(LayerPass {
            output: to_f64(out.view()),
            grad_x: to_f64(dx.view()),
            grads: widen_layer_params(&g),
        })
    }
}
