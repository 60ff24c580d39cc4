//! The encoder-layer suites instantiated for the optimized f32 layer
//! (`encoder_layer`): packed == padded (varlen attention against the dense
//! masked kernel on padded rows, under `Tolerance::F32_REWRITE`), and against
//! the f64 reference layer under `RelativeRule::F32`.

use ndarray::{Array2, ArrayView2};
use packshard_equivalence::bert::{run_layer_relative_suite, run_layer_suite_with, EncoderLayer};
use packshard_equivalence::compare::{RelativeRule, Tolerance};
use packshard_optimized::adapt::to_f32;
use packshard_optimized::layer::{layer_backward, layer_forward, LayerParams32};
use packshard_reference::bert::{AttentionLayout, LayerParams};
use packshard_reference::Error;

/// The optimized layer behind the suite's f64 interface.
struct Optimized;

impl EncoderLayer for Optimized {
    fn name(&self) -> String {
        "encoder_layer".into()
    }
    fn forward_backward(
        &self,
        params: &LayerParams,
        num_heads: usize,
        eps: f64,
        x: ArrayView2<f64>,
        layout: &AttentionLayout,
        grad_output: ArrayView2<f64>,
    ) -> Result<(Array2<f64>, Array2<f64>, LayerParams), Error> {
        let p = LayerParams32::from_reference(params)?;
        let x = to_f32("hidden", x)?;
        let go = to_f32("grad_output", grad_output)?;
        let (out, cache) = layer_forward(&p, num_heads, eps as f32, x.view(), layout)?;
        let (dx, g) = layer_backward(&p, num_heads, &cache, layout, go.view())?;
        Ok((out.mapv(f64::from), dx.mapv(f64::from), g.to_reference()))
    }
}

#[test]
fn packed_equals_padded_within_64_f32_ulp() {
    let seen = run_layer_suite_with(&Optimized, 48, Tolerance::F32_REWRITE)
        .unwrap_or_else(|m| panic!("{m}"));
    eprintln!("encoder_layer packed vs padded: {seen:?}");
    assert!(seen.values > 1000, "{seen:?}");
}

#[test]
fn the_layer_is_within_4x_the_f32_reference_error() {
    let r = run_layer_relative_suite(&Optimized, 48, RelativeRule::F32)
        .unwrap_or_else(|m| panic!("{m}"));
    eprintln!(
        "encoder_layer: over {} tensors, max relative error {:.2e} = {:.3} x the f32 baseline's, mean {:.3} x; worst single tensor {:.2} x ({})",
        r.totals.count,
        r.totals.max,
        r.totals.max_ratio(),
        r.totals.mean_ratio(),
        r.worst_ratio,
        r.worst
    );
    assert!(
        r.totals.max_ratio() > 0.0 && r.totals.max_ratio() <= 4.0,
        "{r:?}"
    );
}

/// Every encoder-layer variant of the one list has a suite here.
#[test]
fn every_layer_variant_in_the_list_passes_the_relative_suite() {
    use packshard_optimized::variants::{of, Kernel};
    let mut seen = 0;
    for variant in of(Kernel::EncoderLayer) {
        let imp: &dyn EncoderLayer = match variant.name {
            "encoder_layer" => &Optimized,
            other => panic!("variant {other} has no layer suite"),
        };
        let r =
            run_layer_relative_suite(imp, 8, RelativeRule::F32).unwrap_or_else(|m| panic!("{m}"));
        assert!(
            r.totals.max_ratio() > 0.0 && r.totals.max_ratio() <= 4.0,
            "{r:?}"
        );
        seen += 1;
    }
    assert_eq!(seen, 1);
}
