//! Every registered kernel (`packshard::registry`, the entries below f64)
//! under criterion, through its op trait (the f64 boundary's conversions
//! included, as a user calls it), at sizes that run in a minute on two cores
//! (`packshard bench` times the f64 references too, on smaller workloads,
//! and has the full sizes):
//!
//! - attention, forward, on packs of `wikipedia-512` lengths scaled to rows
//!   of 256 (8 heads x 64); throughput in (query, key) pairs scored by varlen
//!   (`sum len^2`);
//! - the output layer with its cross-entropy, forward + backward, vocabulary
//!   30522 x hidden 384, 1024 tokens; throughput in tokens;
//! - the encoder layer, forward + backward, packed vs padded (hidden 256,
//!   4 heads, 1024, rows of 256); throughput in real tokens.
//!
//! Each kernel is checked against the first one of its family before it is
//! timed. A kernel added to the registry is benched here with no change.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use ndarray::{Array2, Array3};
use packshard::bench::{wikipedia_lengths, Batch};
use packshard::optimized::attention::varlen_pairs;
use packshard::reference::attention::AttentionLayout;
use packshard::reference::bert::{BertConfig, BertParams};
use packshard::reference::ops::{
    Layer, LayerInput, LinearCall, LinearInput, Precision, Qkv, Varlen,
};
use packshard::reference::vocab::LossConfig;
use packshard::registry;
use packshard_reference::vocab::LossCall;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn max_diff(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

fn attention(c: &mut Criterion) {
    let msl = 256;
    let batch = Batch::new(wikipedia_lengths(24, msl, 0).unwrap(), msl).unwrap();
    let (n, h, d) = (batch.packed_slots(), 8, 64);
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let mut t3 = || Array3::from_shape_fn((n, h, d), |_| rng.random_range(-2.0f64..2.0));
    let (q, k, v) = (t3(), t3(), t3());
    let cu = batch.cu_seqlens.clone();
    let p = Varlen::new(&cu, false, 0.125);
    let mut group = c.benchmark_group("attention_forward");
    group.sample_size(10);
    group.throughput(Throughput::Elements(varlen_pairs(&cu, false) * h as u64));
    let mut first: Option<Vec<f64>> = None;
    for entry in registry::attention() {
        let Ok(op) = entry.make() else { continue };
        if entry.precision == Precision::F64 {
            continue;
        }
        let run = || {
            op.varlen_forward(Qkv::new(q.view(), k.view(), v.view()), &p)
                .unwrap()
        };
        let got: Vec<f64> = run().output.iter().copied().collect();
        match &first {
            None => first = Some(got),
            Some(want) => {
                let err = max_diff(want, &got);
                assert!(err < 0.05, "{}: {err}", entry.name);
            }
        }
        group.bench_function(entry.name, |b| b.iter(run));
    }
    group.finish();
}

fn cross_entropy(c: &mut Criterion) {
    let (n, v, hd) = (1024, 30522, 384);
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let x = Array2::from_shape_fn((n, hd), |_| rng.random_range(-1.0f64..1.0));
    let w = Array2::from_shape_fn((v, hd), |_| rng.random_range(-0.1f64..0.1));
    let t: Vec<i64> = (0..n).map(|_| rng.random_range(0..v as i64)).collect();
    let config = LossConfig::default();
    let mut group = c.benchmark_group("linear_cross_entropy_fwd_bwd");
    group.sample_size(10);
    group.throughput(Throughput::Elements(n as u64));
    let mut first: Option<f64> = None;
    for entry in registry::linear_cross_entropy() {
        let Ok(op) = entry.make() else { continue };
        if entry.precision == Precision::F64 {
            continue;
        }
        let run = || {
            op.linear_cross_entropy(LinearCall::new(
                LinearInput::new(x.view(), w.view()),
                LossCall::with_flag(&t, &config, true),
            ))
            .unwrap()
            .ce
            .loss
        };
        let loss = run();
        match first {
            None => first = Some(loss),
            Some(want) => assert!((loss - want).abs() < 1e-4 * want.abs(), "{}", entry.name),
        }
        group.bench_function(entry.name, |b| b.iter(run));
    }
    group.finish();
}

fn layer(c: &mut Criterion) {
    let (hd, heads, inter, msl) = (256, 4, 1024, 256);
    let batch = Batch::new(wikipedia_lengths(16, msl, 3).unwrap(), msl).unwrap();
    let config = BertConfig::tiny(8, hd, heads, 1, inter, msl);
    let p = BertParams::random(&config, 0).layers.remove(0);
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    let packed = AttentionLayout::Varlen {
        cu_seqlens: batch.cu_seqlens.clone(),
    };
    let padded = batch.padded_layout();
    let mut group = c.benchmark_group("encoder_layer_fwd_bwd");
    group.sample_size(10);
    group.throughput(Throughput::Elements(batch.real_tokens() as u64));
    for entry in registry::encoder_layer() {
        let Ok(op) = entry.make() else { continue };
        if entry.precision == Precision::F64 {
            continue;
        }
        for (name, layout) in [("packed", &packed), ("padded", &padded)] {
            let n = layout.num_tokens();
            let x = Array2::from_shape_fn((n, hd), |_| rng.random_range(-1.0f64..1.0));
            let g = Array2::from_shape_fn((n, hd), |_| rng.random_range(-1.0f64..1.0));
            group.bench_function(format!("{}_{name}", entry.name), |b| {
                b.iter(|| {
                    op.forward_backward(
                        Layer::new(&p, heads, 1e-12),
                        LayerInput::new(x.view(), layout, g.view()),
                    )
                    .unwrap()
                })
            });
        }
    }
    group.finish();
}

criterion_group!(benches, attention, cross_entropy, layer);
criterion_main!(benches);
