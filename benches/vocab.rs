//! The vocabulary-parallel output layer (forward + backward, f64 reference)
//! at MiniLM's size, v = 30522, h = 384, 16 tokens: unsharded and each
//! algorithm on 4 in-process ranks. Every variant is checked against the
//! unsharded result before it is timed. Throughput in tokens.
//!
//! The reference is not built for speed (compensated sums, plain loops): the
//! point is the relative cost of the algorithms and of the rank simulation.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use packshard::reference::vocab::sharded::sharded_linear_cross_entropy;
use packshard::reference::vocab::{
    linear_cross_entropy, LossConfig, ShardLayout, ShardMap, ShardedAlgorithm,
};
use packshard::vocab_report::{random_inputs, MINILM_HIDDEN, MINILM_VOCAB};
use packshard_reference::vocab::LossCall;

fn vocab(c: &mut Criterion) {
    let n = 16;
    let (hidden, weight, targets) = random_inputs(MINILM_VOCAB, MINILM_HIDDEN, n, 0);
    let config = LossConfig::default();
    let mut group = c.benchmark_group("vocab/30522x384");
    group.throughput(Throughput::Elements(n as u64));
    group.sample_size(10);
    let u = linear_cross_entropy(
        hidden.view(),
        weight.view(),
        &LossCall::with_flag(&targets, &config, true),
    )
    .unwrap();
    group.bench_function("unsharded", |b| {
        b.iter(|| {
            linear_cross_entropy(
                hidden.view(),
                weight.view(),
                &LossCall::with_flag(&targets, &config, true),
            )
            .unwrap()
        })
    });
    let map = ShardMap::new(MINILM_VOCAB, 4, ShardLayout::Uneven).unwrap();
    for algorithm in ShardedAlgorithm::ALL {
        let run = || {
            sharded_linear_cross_entropy(
                algorithm,
                &map,
                hidden.view(),
                weight.view(),
                &LossCall::with_flag(&targets, &config, true),
            )
            .unwrap()
        };
        let s = run();
        assert!(
            (s.loss() - u.ce.loss).abs() <= 64.0 * f64::EPSILON * u.ce.loss,
            "{algorithm}"
        );
        let (gh, want) = (s.grad_hidden().unwrap(), u.grad_hidden.as_ref().unwrap());
        let scale = want.iter().fold(0.0f64, |m, x| m.max(x.abs()));
        assert!(
            gh.iter()
                .zip(want)
                .all(|(a, b)| (a - b).abs() <= 64.0 * f64::EPSILON * scale),
            "{algorithm}"
        );
        group.bench_with_input(
            BenchmarkId::new(algorithm.name(), "p4"),
            &algorithm,
            |b, _| b.iter(run),
        );
    }
    group.finish();
}

criterion_group!(benches, vocab);
criterion_main!(benches);
