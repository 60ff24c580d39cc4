//! The optimized variants (`packshard_optimized::variants::VARIANTS`) under
//! criterion, each beside its baseline, at sizes that run in a minute on two
//! cores (`packshard bench` has the full sizes and prints the ratios):
//!
//! - attention variants, forward, on packs of `wikipedia-512` lengths scaled
//!   to rows of 256 (8 heads x 64); throughput in (query, key) pairs scored
//!   by varlen (`sum len^2`);
//! - the linear cross-entropy variants, forward + backward, vocabulary 30522
//!   x hidden 384, 1024 tokens; throughput in tokens;
//! - the encoder layer, forward + backward, packed vs padded (hidden 256,
//!   4 heads, 1024, rows of 256); throughput in real tokens.
//!
//! Each variant is checked against its baseline before it is timed.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use half::bf16;
use ndarray::{Array2, Array3};
use packshard::bench::{wikipedia_lengths, Batch};
use packshard::optimized::attention::{dense_masked_attention, varlen_attention, varlen_pairs};
use packshard::optimized::layer::{layer_backward, layer_forward, LayerParams32};
use packshard::optimized::variants::{of, Kernel};
use packshard::optimized::vocab::{
    linear_cross_entropy_fused, linear_cross_entropy_materialized, Chunks,
};
use packshard::reference::bert::attention::AttentionLayout;
use packshard::reference::bert::{BertConfig, BertParams};
use packshard::reference::vocab::LossConfig;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn attention(c: &mut Criterion) {
    let msl = 256;
    let batch = Batch::new(wikipedia_lengths(24, msl, 0).unwrap(), msl).unwrap();
    let (n, h, d) = (batch.packed_slots(), 8, 64);
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let mut t3 = || Array3::from_shape_fn((n, h, d), |_| rng.random_range(-2.0f32..2.0));
    let (q, k, v) = (t3(), t3(), t3());
    let (qb, kb, vb) = (
        q.mapv(bf16::from_f32),
        k.mapv(bf16::from_f32),
        v.mapv(bf16::from_f32),
    );
    let cu = batch.cu_seqlens.clone();
    let masks = batch.block_diagonal_masks();
    let mv: Vec<_> = masks.iter().map(|m| m.view()).collect();
    let scale = 0.125;
    let want = varlen_attention(q.view(), k.view(), v.view(), &cu, false, scale).unwrap();
    let mut group = c.benchmark_group("attention_forward");
    group.sample_size(10);
    group.throughput(Throughput::Elements(varlen_pairs(&cu, false) * h as u64));
    for variant in of(Kernel::Attention) {
        let run: Box<dyn Fn() -> Array3<f32>> = match variant.name {
            "attention_varlen_tiled" => Box::new(|| {
                varlen_attention(q.view(), k.view(), v.view(), &cu, false, scale)
                    .unwrap()
                    .output
            }),
            "attention_varlen_tiled_bf16" => Box::new(|| {
                varlen_attention(qb.view(), kb.view(), vb.view(), &cu, false, scale)
                    .unwrap()
                    .output
            }),
            "attention_dense_masked" => Box::new(|| {
                dense_masked_attention(q.view(), k.view(), v.view(), msl, &mv, scale)
                    .unwrap()
                    .output
            }),
            other => panic!("variant {other} has no attention bench"),
        };
        let got = run();
        let err = got
            .iter()
            .zip(&want.output)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(err < 0.05, "{}: {err}", variant.name);
        group.bench_function(variant.name, |b| b.iter(&run));
    }
    group.finish();
}

fn cross_entropy(c: &mut Criterion) {
    let (n, v, hd) = (1024, 30522, 384);
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let x = Array2::from_shape_fn((n, hd), |_| rng.random_range(-1.0f32..1.0));
    let w = Array2::from_shape_fn((v, hd), |_| rng.random_range(-0.1f32..0.1));
    let t: Vec<i64> = (0..n).map(|_| rng.random_range(0..v as i64)).collect();
    let config = LossConfig::default();
    let want = linear_cross_entropy_materialized(x.view(), w.view(), &t, &config, false)
        .unwrap()
        .ce
        .loss;
    let mut group = c.benchmark_group("linear_cross_entropy_fwd_bwd");
    group.sample_size(10);
    group.throughput(Throughput::Elements(n as u64));
    for variant in of(Kernel::LinearCrossEntropy) {
        let run: Box<dyn Fn() -> f64> = match variant.name {
            "linear_ce_materialized" => Box::new(|| {
                linear_cross_entropy_materialized(x.view(), w.view(), &t, &config, true)
                    .unwrap()
                    .ce
                    .loss
            }),
            "linear_ce_fused" => Box::new(|| {
                linear_cross_entropy_fused(x.view(), w.view(), &t, &config, true, Chunks::default())
                    .unwrap()
                    .ce
                    .loss
            }),
            other => panic!("variant {other} has no cross-entropy bench"),
        };
        assert!((run() - want).abs() < 1e-4 * want.abs(), "{}", variant.name);
        group.bench_function(variant.name, |b| b.iter(&run));
    }
    group.finish();
}

fn layer(c: &mut Criterion) {
    let (hd, heads, inter, msl) = (256, 4, 1024, 256);
    let batch = Batch::new(wikipedia_lengths(16, msl, 3).unwrap(), msl).unwrap();
    let config = BertConfig::tiny(8, hd, heads, 1, inter, msl);
    let p = LayerParams32::from_reference(&BertParams::random(&config, 0).layers[0]).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    let packed = AttentionLayout::Varlen {
        cu_seqlens: batch.cu_seqlens.clone(),
    };
    let padded = batch.padded_layout();
    let mut group = c.benchmark_group("encoder_layer_fwd_bwd");
    group.sample_size(10);
    group.throughput(Throughput::Elements(batch.real_tokens() as u64));
    for variant in of(Kernel::EncoderLayer) {
        assert_eq!(
            variant.name, "encoder_layer",
            "no layer bench for {}",
            variant.name
        );
        for (name, layout) in [("packed", &packed), ("padded", &padded)] {
            let n = layout.num_tokens();
            let x = Array2::from_shape_fn((n, hd), |_| rng.random_range(-1.0f32..1.0));
            let g = Array2::from_shape_fn((n, hd), |_| rng.random_range(-1.0f32..1.0));
            group.bench_function(format!("{}_{name}", variant.name), |b| {
                b.iter(|| {
                    let (_, cache) = layer_forward(&p, heads, 1e-12, x.view(), layout).unwrap();
                    layer_backward(&p, heads, &cache, layout, g.view()).unwrap()
                })
            });
        }
    }
    group.finish();
}

criterion_group!(benches, attention, cross_entropy, layer);
criterion_main!(benches);
