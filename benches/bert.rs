//! The reference BERT, packed against padded: tokens per second of a forward
//! + backward pass, and of varlen attention against dense masked attention.
//!
//! No speed target (the reference is the slow, plain f64 ground truth); the
//! figures show what packing saves in the reference itself. Each pair is
//! checked equal (packed == padded) before it is timed.
//!
//! Lengths: 48 sequences drawn from the Wikipedia-512 length distribution
//! scaled to packs of 64 tokens (seeded), a BERT of hidden 64, 4 heads,
//! 2 layers, vocabulary 1000.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use ndarray::{Array2, Array3};
use packshard::equivalence::attention::Observed;
use packshard::equivalence::bert::compare_outputs;
use packshard::reference::bert::attention::{
    masked_attention, masked_attention_backward, varlen_attention, varlen_attention_backward,
};
use packshard::reference::bert::{
    BertConfig, BertModel, LossWeights, PackedAttention, Reduction, Targets, TokenBatch,
    IGNORE_INDEX,
};
use packshard::reference::packing::{Algorithm, PackedBatch, PackingConfig};
use rand::{Rng, SeedableRng};

const MSL: usize = 64;

fn bert(c: &mut Criterion) {
    // The real Wikipedia-512 histogram, scaled to MSL.
    let ls = packshard::bench::wikipedia_lengths(48, MSL, 3).unwrap();
    let config = BertConfig::tiny(1000, 64, 4, 2, 256, MSL);
    let model = BertModel::random(config, 1).unwrap();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(4);
    let seqs: Vec<Vec<i64>> = ls
        .iter()
        .map(|&l| (0..l).map(|_| rng.random_range(1..1000)).collect())
        .collect();
    let targets = Targets {
        mlm_labels: seqs
            .iter()
            .map(|s| {
                s.iter()
                    .map(|&t| {
                        if rng.random_range(0..7) == 0 {
                            t
                        } else {
                            IGNORE_INDEX
                        }
                    })
                    .collect()
            })
            .collect(),
        nsp_labels: seqs.iter().map(|_| rng.random_range(0..2)).collect(),
    };
    let w = LossWeights::new(&targets, Reduction::PerSequence);
    let (_, packed) =
        PackedBatch::from_sequences(&seqs, &PackingConfig::new(Algorithm::Lpfhp, MSL), 0, 0)
            .unwrap();
    let padded_tb = TokenBatch::padded(&seqs, None, MSL, 0, 0).unwrap();
    let varlen_tb = TokenBatch::packed(&packed, seqs.len(), None, PackedAttention::Varlen).unwrap();
    let block_tb =
        TokenBatch::packed(&packed, seqs.len(), None, PackedAttention::BlockDiagonal).unwrap();
    let reference = model.run(&padded_tb, &targets, &w, true).unwrap();
    for tb in [&varlen_tb, &block_tb] {
        compare_outputs(
            &reference,
            &model.run(tb, &targets, &w, true).unwrap(),
            &mut Observed::default(),
        )
        .unwrap();
    }
    let real: usize = ls.iter().sum();
    let mut group = c.benchmark_group("bert_forward_backward");
    group.sample_size(10);
    group.throughput(Throughput::Elements(real as u64));
    for (name, tb) in [
        ("padded", &padded_tb),
        ("packed_varlen", &varlen_tb),
        ("packed_block_diagonal", &block_tb),
    ] {
        group.bench_function(name, |b| {
            b.iter(|| model.run(tb, &targets, &w, true).unwrap())
        });
    }
    group.finish();

    // Attention alone: the same tokens varlen and as padded rows.
    let (h, d) = (4, 16);
    let mut cu = vec![0usize];
    for l in &ls {
        cu.push(cu.last().unwrap() + l);
    }
    let n = *cu.last().unwrap();
    let q = Array3::from_shape_fn((n, h, d), |_| rng.random::<f64>() - 0.5);
    let go = q.mapv(|x| 1.0 - x);
    let mut group = c.benchmark_group("attention_forward_backward");
    group.throughput(Throughput::Elements(n as u64));
    group.sample_size(20);
    group.bench_function("varlen", |b| {
        b.iter(|| {
            let f = varlen_attention(q.view(), q.view(), q.view(), &cu, false, 0.25).unwrap();
            varlen_attention_backward(
                q.view(),
                q.view(),
                q.view(),
                &cu,
                false,
                0.25,
                &f,
                go.view(),
            )
            .unwrap()
        })
    });
    let rows: Vec<(Array3<f64>, Array3<f64>, Array2<bool>)> = ls
        .iter()
        .zip(cu.iter())
        .map(|(&l, &at)| {
            let pad = |x: &Array3<f64>| {
                Array3::from_shape_fn(
                    (MSL, h, d),
                    |(i, a, c)| if i < l { x[[at + i, a, c]] } else { 0.0 },
                )
            };
            (
                pad(&q),
                pad(&go),
                Array2::from_shape_fn((MSL, MSL), |(i, j)| i < l && j < l),
            )
        })
        .collect();
    group.bench_function("padded_masked", |b| {
        b.iter(|| {
            for (x, g, m) in &rows {
                let f = masked_attention(x.view(), x.view(), x.view(), m.view(), 0.25).unwrap();
                masked_attention_backward(
                    x.view(),
                    x.view(),
                    x.view(),
                    m.view(),
                    0.25,
                    &f,
                    g.view(),
                )
                .unwrap();
            }
        })
    });
    group.finish();
}

criterion_group!(benches, bert);
criterion_main!(benches);
