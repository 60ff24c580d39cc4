//! Proptest strategies: random shard maps, loss options and cases with planted extremes.

use super::faults::LAYOUTS;
#[allow(clippy::wildcard_imports)]
use super::*;

/// Largest `n` (tokens) of a random case.
pub const MAX_N: usize = 9;
/// Largest `v` of a random case.
pub const MAX_V: usize = 41;
/// Largest `h` of a random case.
pub const MAX_H: usize = 6;
/// Largest `p` of a random case.
pub const MAX_P: usize = 8;

/// A shard map: `v` in `1..=MAX_V` (primes weighted up), `p` in
/// `1..=min(MAX_P, v)`, either layout.
pub fn shard_maps() -> impl Strategy<Value = ShardMap> {
    let vocab = prop_oneof![
        2 => prop::sample::select(vec![1usize, 2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41]),
        1 => 1usize..=MAX_V,
    ];
    (vocab, prop::sample::select(LAYOUTS.to_vec()))
        .prop_flat_map(|(v, layout)| (Just(v), 1usize..=v.min(MAX_P), Just(layout)))
        .prop_map(|(v, p, layout)| ShardMap::new(v, p, layout).expect("p <= v"))
}

/// Loss options: `ignore_index` -100 or -1; no smoothing half the time, else
/// `a` in `[0, 1]` in either convention; z-loss 0 or up to 0.1; any
/// reduction; a softcap in `[0.5, 50]` a third of the time (docs/FAULTS.md O1).
pub fn loss_configs() -> impl Strategy<Value = LossConfig> {
    (
        prop::sample::select(vec![-100i64, -1]),
        prop_oneof![1 => Just(0.0), 1 => 0.0f64..=1.0],
        prop::sample::select(vec![
            SmoothingConvention::PyTorch,
            SmoothingConvention::Megatron,
        ]),
        prop_oneof![2 => Just(0.0), 1 => 1e-4f64..0.1],
        prop::sample::select(vec![Reduction::Mean, Reduction::Sum, Reduction::None]),
        prop_oneof![2 => Just(None), 1 => (0.5f64..50.0).prop_map(Some)],
    )
        .prop_map(
            |(ignore_index, a, smoothing, z_loss, reduction, softcap)| LossConfig {
                ignore_index,
                label_smoothing: a,
                smoothing,
                z_loss,
                reduction,
                softcap,
            },
        )
}

/// A logit: mostly in `[-8, 8]`; small integers (ties at the maximum); planted
/// `±1e4`; `-inf` (masked).
pub fn logit() -> impl Strategy<Value = f64> {
    prop_oneof![
        16 => -8.0f64..8.0,
        3 => (-3i32..=3).prop_map(f64::from),
        1 => Just(1e4),
        1 => Just(-1e4),
        2 => Just(f64::NEG_INFINITY),
    ]
}

/// What a padding column or row holds: anything (it must never be read).
pub fn padding_value() -> impl Strategy<Value = f64> {
    prop_oneof![
        2 => -8.0f64..8.0,
        1 => Just(1e4),
        1 => Just(f64::NAN),
        1 => Just(f64::INFINITY),
    ]
}

/// A target: in range mostly, `ignore_index` sometimes, rarely out of range
/// (`v`, or -5) to exercise the errors.
fn target(v: usize, ignore: i64) -> impl Strategy<Value = i64> {
    prop_oneof![
        160 => 0..v as i64,
        30 => Just(ignore),
        1 => Just(v as i64),
        1 => Just(-5i64),
    ]
}

/// Rows with one shard's real logits all set to `-inf` (docs/FAULTS.md V6).
fn masked_shards(n: usize, p: usize) -> impl Strategy<Value = Vec<Option<usize>>> {
    prop::collection::vec(prop_oneof![5 => Just(None), 1 => (0..p).prop_map(Some)], n)
}

/// The upstream gradient of half the random cases (docs/FAULTS.md O2):
/// `[n]` under the reduction `none`, `[1]` otherwise; each value 0, 1 or
/// in `[-2, 2]` (a quarter, a quarter, a half). Derived from the case's
/// targets and `v` by its own seeded stream, not drawn from proptest's: the
/// other values of every case stay those of the seeds before the option
/// existed.
pub fn upstream(targets: &[i64], v: usize, config: &LossConfig) -> Option<Vec<f64>> {
    use rand::{Rng, SeedableRng};
    let seed = targets.iter().fold(v as u64, |h, &t| {
        h.wrapping_mul(0x0000_0100_0000_01B3).wrapping_add(t as u64)
    });
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    if rng.random::<bool>() {
        return None;
    }
    let len = if config.reduction == Reduction::None {
        targets.len()
    } else {
        1
    };
    let value = |rng: &mut rand_chacha::ChaCha8Rng| match rng.random_range(0..4) {
        0 => 0.0,
        1 => 1.0,
        _ => rng.random_range(-2.0..=2.0),
    };
    Some((0..len).map(|_| value(&mut rng)).collect())
}

/// Random cross-entropy cases: sizes first (`map`, `n`), then logits with
/// planted `±1e4` and `-inf`, whole shards masked to `-inf`, padding columns
/// holding anything, targets on every shard and ignored, and half the time
/// an upstream gradient ([`upstream`]).
pub fn ce_cases() -> impl Strategy<Value = CeCase> {
    (shard_maps(), 1usize..=MAX_N, loss_configs())
        .prop_flat_map(|(map, n, config)| {
            let (v, w) = (map.vocab_size(), map.padded_vocab_size());
            (
                Just(map),
                Just(config),
                prop::collection::vec(logit(), n * v),
                prop::collection::vec(padding_value(), n * (w - v)),
                prop::collection::vec(target(v, config.ignore_index), n),
                masked_shards(n, map.num_shards()),
            )
        })
        .prop_map(|(map, config, real, padding, targets, masks)| {
            ce_case(map, config, &real, &padding, targets, &masks)
        })
}

/// A cross-entropy case from its drawn parts: `real: [n * v]` logits,
/// `padding: [n * (w - v)]`, `masks: [n]` (a rank whose real logits are all
/// `-inf` on that row), the upstream gradient [`upstream`].
fn ce_case(
    map: ShardMap,
    config: LossConfig,
    real: &[f64],
    padding: &[f64],
    targets: Vec<i64>,
    masks: &[Option<usize>],
) -> CeCase {
    let (v, w) = (map.vocab_size(), map.padded_vocab_size());
    let n = targets.len();
    let mut logits = Array2::from_shape_fn((n, w), |(i, j)| {
        if j < v {
            real[i * v + j]
        } else {
            padding[i * (w - v) + j - v]
        }
    });
    for (i, mask) in masks.iter().enumerate() {
        if let Some(r) = mask {
            let s = map.shard(*r);
            for j in s.start..s.start + s.real {
                logits[[i, j]] = f64::NEG_INFINITY;
            }
        }
    }
    CeCase {
        grad_output: upstream(&targets, v, &config),
        map,
        logits,
        targets,
        config,
    }
}

/// Vocabulary sizes and token counts past the chunks of chunked kernels:
/// one entry past a chunk of 4096 and of 1024 (a last partial chunk of one
/// entry) with a few tokens, and one past a chunk of 256 with tokens one
/// past 64 (a partial token chunk of 16, 32 and 64). The suites' random
/// cases have at most [`MAX_V`] entries and [`MAX_N`] tokens.
pub const CHUNK_CROSSING: [(usize, usize); 3] = [(4097, 3), (1025, 5), (257, 65)];

/// A split and `n` of [`CHUNK_CROSSING`]: `p` in `1..=4` (so a rank's own
/// width crosses a chunk too), either layout.
pub fn chunk_crossing_sizes() -> impl Strategy<Value = (ShardMap, usize)> {
    (
        prop::sample::select(CHUNK_CROSSING.to_vec()),
        1usize..=4,
        prop::sample::select(LAYOUTS.to_vec()),
    )
        .prop_map(|((v, n), p, layout)| (ShardMap::new(v, p, layout).expect("p <= v"), n))
}

/// Cross-entropy cases of [`chunk_crossing_sizes`], drawn as [`ce_cases`]
/// draws its values.
pub fn chunk_crossing_ce_cases() -> impl Strategy<Value = CeCase> {
    (chunk_crossing_sizes(), loss_configs())
        .prop_flat_map(|((map, n), config)| {
            let (v, w) = (map.vocab_size(), map.padded_vocab_size());
            (
                Just(map),
                Just(config),
                prop::collection::vec(logit(), n * v),
                prop::collection::vec(padding_value(), n * (w - v)),
                prop::collection::vec(target(v, config.ignore_index), n),
                masked_shards(n, map.num_shards()),
            )
        })
        .prop_map(|(map, config, real, padding, targets, masks)| {
            ce_case(map, config, &real, &padding, targets, &masks)
        })
}

/// A hidden or weight value: mostly in `[-2, 2]`, planted `±100` (so that a
/// logit reaches `±1e4`).
pub fn activation() -> impl Strategy<Value = f64> {
    prop_oneof![12 => -2.0f64..2.0, 1 => Just(100.0), 1 => Just(-100.0)]
}

/// Random output-layer cases: `h` in `1..=MAX_H`, planted outliers, padding
/// rows holding anything, half the time an upstream gradient ([`upstream`]).
pub fn linear_cases() -> impl Strategy<Value = LinearCase> {
    (shard_maps(), 1usize..=MAX_N, 1usize..=MAX_H, loss_configs())
        .prop_flat_map(|(map, n, h, config)| {
            let (v, w) = (map.vocab_size(), map.padded_vocab_size());
            (
                Just(map),
                Just(config),
                prop::collection::vec(activation(), n * h),
                prop::collection::vec(activation(), v * h),
                prop::collection::vec(padding_value(), (w - v) * h),
                prop::collection::vec(target(v, config.ignore_index), n),
            )
        })
        .prop_map(|(map, config, x, wr, wp, targets)| {
            linear_case(map, config, x, &wr, &wp, targets)
        })
}

/// An output-layer case from its drawn parts: `x: [n * h]` hidden states,
/// `wr: [v * h]` real weight rows, `wp: [(w - v) * h]` padding rows, the
/// upstream gradient [`upstream`].
fn linear_case(
    map: ShardMap,
    config: LossConfig,
    x: Vec<f64>,
    wr: &[f64],
    wp: &[f64],
    targets: Vec<i64>,
) -> LinearCase {
    let n = targets.len();
    let h = x.len() / n;
    let (v, w) = (map.vocab_size(), map.padded_vocab_size());
    let hidden = Array2::from_shape_vec((n, h), x).expect("n x h");
    let weight = Array2::from_shape_fn((w, h), |(j, k)| {
        if j < v {
            wr[j * h + k]
        } else {
            wp[(j - v) * h + k]
        }
    });
    LinearCase {
        grad_output: upstream(&targets, v, &config),
        map,
        hidden,
        weight,
        targets,
        config,
    }
}

/// Output-layer cases of [`chunk_crossing_sizes`], `h` in `1..=MAX_H`, drawn
/// as [`linear_cases`] draws its values.
pub fn chunk_crossing_linear_cases() -> impl Strategy<Value = LinearCase> {
    (chunk_crossing_sizes(), 1usize..=MAX_H, loss_configs())
        .prop_flat_map(|((map, n), h, config)| {
            let (v, w) = (map.vocab_size(), map.padded_vocab_size());
            (
                Just(map),
                Just(config),
                prop::collection::vec(activation(), n * h),
                prop::collection::vec(activation(), v * h),
                prop::collection::vec(padding_value(), (w - v) * h),
                prop::collection::vec(target(v, config.ignore_index), n),
            )
        })
        .prop_map(|(map, config, x, wr, wp, targets)| {
            linear_case(map, config, x, &wr, &wp, targets)
        })
}

/// Random embedding cases: ids mostly in range, rarely `v` or `-1`.
pub fn embedding_cases() -> impl Strategy<Value = EmbeddingCase> {
    (shard_maps(), 0usize..=MAX_N, 1usize..=MAX_H)
        .prop_flat_map(|(map, n, h)| {
            let (v, w) = (map.vocab_size(), map.padded_vocab_size());
            (
                Just(map),
                prop::collection::vec(
                    prop_oneof![30 => 0..v as i64, 1 => Just(v as i64), 1 => Just(-1i64)],
                    n,
                ),
                prop::collection::vec(-2.0f64..2.0, v * h),
                prop::collection::vec(padding_value(), (w - v) * h),
                prop::collection::vec(-1.0f64..1.0, n * h),
                Just(h),
            )
        })
        .prop_map(|(map, ids, wr, wp, g, h)| {
            let (v, w) = (map.vocab_size(), map.padded_vocab_size());
            let weight = Array2::from_shape_fn((w, h), |(j, k)| {
                if j < v {
                    wr[j * h + k]
                } else {
                    wp[(j - v) * h + k]
                }
            });
            let grad_output = Array2::from_shape_vec((ids.len(), h), g).expect("n x h");
            EmbeddingCase {
                map,
                ids,
                weight,
                grad_output,
            }
        })
}
