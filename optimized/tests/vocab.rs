//! The vocabulary suite of #4 instantiated for the optimized f32 `alg2`
//! shard kernels (`vocab::alg2`: the chunked, fused output layer on each
//! rank), under `Rule::Relative(RelativeRule::F32)`: every input rounded to
//! f32, each loss, `logsumexp` and gradient on every rank at most 32 x (per
//! tensor) and 4 x (over the suite) the error of the same reference math run
//! in f32, padding exactly 0, errors of the same kind as the reference's.
//! The random cases plant `±1e4` logits, `±100` activations, `-inf` shards,
//! NaN / `+inf` inputs and out-of-range targets.
//!
//! Plus the unsharded fused kernel against the materialized one and the f64
//! reference, with chunk sizes that do not divide the sizes.

use ndarray::{Array2, ArrayView2};
use packshard_equivalence::compare::RelativeRule;
use packshard_equivalence::vocab::{run_suite_with, Rule, VocabParallel};
use packshard_optimized::oracle::FusedAlg2;
use packshard_optimized::vocab::{
    cross_entropy, linear_cross_entropy_fused, linear_cross_entropy_materialized, Chunks,
};
use packshard_reference::vocab::embedding::ShardedEmbedding;
use packshard_reference::vocab::sharded::ShardedLoss;
use packshard_reference::vocab::{LossConfig, ShardMap, ShardedAlgorithm, SmoothingConvention};
use packshard_reference::Error;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Small chunks so that the suite's sizes (`n <= 9`, `v <= 40`) cross chunk
/// and tile edges.
const SMALL: Chunks = Chunks {
    tokens: 3,
    vocab: 5,
};

fn run(chunks: Chunks) {
    let imp = FusedAlg2(chunks);
    let c = run_suite_with(&imp, 64, Rule::Relative(RelativeRule::F32))
        .unwrap_or_else(|m| panic!("{m}"));
    let r = &c.relative;
    eprintln!(
        "{}: {} cases; over {} tensors ({} with an inexact f32 baseline), max relative error {:.2e} = {:.3} x the f32 baseline's, mean {:.3} x; worst single tensor {:.2} x ({})",
        imp.name(),
        c.cases,
        r.tensors,
        r.nonzero_baseline,
        r.totals.max,
        r.totals.max_ratio(),
        r.totals.mean_ratio(),
        r.worst_ratio,
        r.worst
    );
    assert!(r.nonzero_baseline >= 100, "{r:?}");
    assert!(
        r.totals.max_ratio() > 0.0 && r.totals.max_ratio() <= 4.0,
        "{r:?}"
    );
}

#[test]
fn alg2_shards_pass_the_vocab_suite_small_chunks() {
    run(SMALL);
}

#[test]
fn alg2_shards_pass_the_vocab_suite_default_chunks() {
    run(Chunks::default());
}

fn random(n: usize, h: usize, v: usize, seed: u64) -> (Array2<f32>, Array2<f32>, Vec<i64>) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let hidden = Array2::from_shape_fn((n, h), |_| rng.random_range(-1.0f32..1.0));
    let mut weight = Array2::from_shape_fn((v, h), |_| rng.random_range(-0.5f32..0.5));
    // Planted outliers: a row of large weights (a dominant logit for every
    // token), so the softmax is far from uniform.
    weight.row_mut(v / 3).mapv_inplace(|x| 8.0 * x);
    let targets = (0..n)
        .map(|i| {
            if i % 7 == 3 {
                -100
            } else {
                rng.random_range(0..v as i64)
            }
        })
        .collect();
    (hidden, weight, targets)
}

fn max_rel(a: &Array2<f32>, b: &Array2<f64>) -> f64 {
    let scale = b.iter().fold(0.0f64, |m, x| m.max(x.abs()));
    a.iter()
        .zip(b)
        .map(|(x, y)| (f64::from(*x) - y).abs())
        .fold(0.0, f64::max)
        / scale
}

#[test]
fn fused_equals_materialized_and_the_reference() {
    // 97 tokens, h 59, v 1025: chunks of 16 tokens x 100 entries cross every edge.
    let (n, h, v) = (97, 59, 1025);
    let (x, w, t) = random(n, h, v, 7);
    let configs = [
        LossConfig::default(),
        LossConfig::default().with_smoothing(0.1, SmoothingConvention::PyTorch),
        LossConfig {
            z_loss: 1e-3,
            ..LossConfig::default()
        },
    ];
    for config in configs {
        let chunks = Chunks {
            tokens: 16,
            vocab: 100,
        };
        let f = linear_cross_entropy_fused(x.view(), w.view(), &t, &config, true, chunks)
            .expect("fused");
        let m = linear_cross_entropy_materialized(x.view(), w.view(), &t, &config, true)
            .expect("materialized");
        let r = packshard_reference::vocab::linear_cross_entropy(
            x.mapv(f64::from).view(),
            w.mapv(f64::from).view(),
            &t,
            &config,
            true,
        )
        .expect("reference");
        assert_eq!(f.logits_buffer_bytes, 4 * 16 * v);
        assert_eq!(m.logits_buffer_bytes, 4 * n * v);
        assert!(r.ce.loss > 1.0, "non-degenerate loss {}", r.ce.loss);
        let rel = |a: f64, b: f64| (a - b).abs() / b.abs();
        assert!(
            rel(f.ce.loss, r.ce.loss) < 1e-5,
            "{} vs {}",
            f.ce.loss,
            r.ce.loss
        );
        assert!(
            rel(m.ce.loss, r.ce.loss) < 1e-5,
            "{} vs {}",
            m.ce.loss,
            r.ce.loss
        );
        let (gh, gw) = (f.grad_hidden.unwrap(), f.grad_weight.unwrap());
        let (rh, rw) = (r.grad_hidden.unwrap(), r.grad_weight.unwrap());
        let (mh, mw) = (m.grad_hidden.unwrap(), m.grad_weight.unwrap());
        for (name, e) in [
            ("fused grad_hidden", max_rel(&gh, &rh)),
            ("fused grad_weight", max_rel(&gw, &rw)),
            ("materialized grad_hidden", max_rel(&mh, &rh)),
            ("materialized grad_weight", max_rel(&mw, &rw)),
        ] {
            // f32 products of 59 (h) or 97 (n) terms: a few hundred ulp of
            // f32 relative to the largest entry at most.
            assert!(e < 1e-5, "{name}: relative error {e:e} ({config:?})");
        }
        // Not a vacuous comparison: the gradients are not zero.
        assert!(gh.iter().any(|x| x.abs() > 1e-3));
    }
}

#[test]
fn cross_entropy_on_logits_matches_the_reference() {
    let (n, v) = (13, 97);
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let mut z = Array2::from_shape_fn((n, v), |_| rng.random_range(-4.0f32..4.0));
    z[[2, 5]] = 1e4;
    z[[4, 7]] = f32::NEG_INFINITY;
    let t: Vec<i64> = (0..n as i64).map(|i| (i * 7) % v as i64).collect();
    let config = LossConfig::default();
    let o = cross_entropy(z.view(), &t, &config, true).expect("f32");
    let r = packshard_reference::vocab::cross_entropy(z.mapv(f64::from).view(), &t, &config, true)
        .expect("reference");
    assert!(
        (o.loss - r.loss).abs() <= 1e-5 * r.loss.abs(),
        "{} {}",
        o.loss,
        r.loss
    );
    let g = o.grad_logits.unwrap();
    assert!(max_rel(&g, r.grad_logits.as_ref().unwrap()) < 1e-6);
    assert_eq!(g[[4, 7]], 0.0);
}

/// Bad input: the same error kind (and field) as the reference.
#[test]
fn bad_input_gets_the_reference_errors() {
    let (x, w, t) = random(5, 4, 11, 1);
    let config = LossConfig::default();
    let chunks = Chunks::default();
    let x64 = x.mapv(f64::from);
    let w64 = w.mapv(f64::from);
    let ref_err = |x: &Array2<f64>, w: &Array2<f64>, t: &[i64]| {
        packshard_reference::vocab::linear_cross_entropy(x.view(), w.view(), t, &config, true)
            .expect_err("reference must refuse")
    };
    let same = |ours: Error, theirs: Error| {
        assert_eq!(ours.kind(), theirs.kind(), "{ours} vs {theirs}");
        assert_eq!(ours.to_string(), theirs.to_string());
    };
    // Wrong number of targets.
    let short = &t[..4];
    same(
        linear_cross_entropy_fused(x.view(), w.view(), short, &config, true, chunks).unwrap_err(),
        ref_err(&x64, &w64, short),
    );
    // Mismatched hidden width.
    let w5 = Array2::<f32>::zeros((11, 5));
    same(
        linear_cross_entropy_fused(x.view(), w5.view(), &t, &config, true, chunks).unwrap_err(),
        ref_err(&x64, &w5.mapv(f64::from), &t),
    );
    // NaN in the weight, at a named index.
    let mut wn = w.clone();
    wn[[6, 2]] = f32::NAN;
    let ours =
        linear_cross_entropy_materialized(x.view(), wn.view(), &t, &config, true).unwrap_err();
    same(ours.clone(), ref_err(&x64, &wn.mapv(f64::from), &t));
    assert_eq!(ours.kind(), "non_finite_input");
    // A target out of range.
    let mut tb = t.clone();
    tb[2] = 11;
    same(
        linear_cross_entropy_fused(x.view(), w.view(), &tb, &config, true, chunks).unwrap_err(),
        ref_err(&x64, &w64, &tb),
    );
    // Chunks of zero.
    let e = linear_cross_entropy_fused(
        x.view(),
        w.view(),
        &t,
        &config,
        true,
        Chunks {
            tokens: 0,
            vocab: 4,
        },
    )
    .unwrap_err();
    assert_eq!(e.kind(), "invalid_argument");
    // +inf logits.
    let mut z = Array2::<f32>::zeros((2, 3));
    z[[1, 2]] = f32::INFINITY;
    let theirs = packshard_reference::vocab::cross_entropy(
        z.mapv(f64::from).view(),
        &[0, 1],
        &config,
        false,
    )
    .unwrap_err();
    same(
        cross_entropy(z.view(), &[0, 1], &config, false).unwrap_err(),
        theirs,
    );
}

/// Every cross-entropy variant of the one list has a check here.
#[test]
fn every_vocab_variant_in_the_list_is_checked() {
    use packshard_optimized::variants::{of, Kernel};
    let mut seen = 0;
    for variant in of(Kernel::CrossEntropy).chain(of(Kernel::LinearCrossEntropy)) {
        match variant.name {
            // The sharded form is alg2 through the suite; the unsharded one
            // against the reference.
            "cross_entropy_f32" => {
                run(SMALL);
                cross_entropy_on_logits_matches_the_reference();
            }
            "linear_ce_fused" => {
                run(Chunks {
                    tokens: 2,
                    vocab: 3,
                });
                fused_equals_materialized_and_the_reference();
            }
            "linear_ce_materialized" => fused_equals_materialized_and_the_reference(),
            other => panic!("variant {other} has no vocab check"),
        }
        seen += 1;
    }
    assert_eq!(seen, 3);
}

/// Negative control for the fuzz targets: the fused kernel with a planted
/// fault of 1e-3 of the value (every rank's `dL/dhidden` scaled by 1.001,
/// FAULTS.md V3's gradient class at its smallest) must fail the single-case
/// rule of the fuzz targets (`RelativeRule::F32_FUZZ`, floor 256 ulp of the
/// scale) on random fuzz inputs, while the unfaulted kernel passes them.
#[test]
#[allow(clippy::result_large_err)]
fn the_fuzz_rule_catches_a_small_planted_fault() {
    use packshard_equivalence::fuzz::{fuzz_random, vocab::run_linear_with};

    struct Scaled(FusedAlg2);
    impl VocabParallel for Scaled {
        fn name(&self) -> String {
            "fused_ce_alg2 with dL/dhidden x 1.001".into()
        }
        fn algorithms(&self) -> Vec<ShardedAlgorithm> {
            self.0.algorithms()
        }
        fn cross_entropy(
            &self,
            a: ShardedAlgorithm,
            map: &ShardMap,
            logits: ArrayView2<f64>,
            targets: &[i64],
            config: &LossConfig,
            want_grad: bool,
        ) -> Result<ShardedLoss, Error> {
            self.0
                .cross_entropy(a, map, logits, targets, config, want_grad)
        }
        fn linear_cross_entropy(
            &self,
            a: ShardedAlgorithm,
            map: &ShardMap,
            hidden: ArrayView2<f64>,
            weight: ArrayView2<f64>,
            targets: &[i64],
            config: &LossConfig,
            want_grad: bool,
        ) -> Result<ShardedLoss, Error> {
            let mut out = self
                .0
                .linear_cross_entropy(a, map, hidden, weight, targets, config, want_grad)?;
            for r in &mut out.ranks {
                if let Some(g) = r.grad_hidden.as_mut() {
                    g.mapv_inplace(|x| x * 1.001);
                }
            }
            Ok(out)
        }
        fn embedding(
            &self,
            map: &ShardMap,
            ids: &[i64],
            weight: ArrayView2<f64>,
            grad_output: Option<ArrayView2<f64>>,
        ) -> Result<ShardedEmbedding, Error> {
            self.0.embedding(map, ids, weight, grad_output)
        }
    }

    let rule = Rule::Relative(RelativeRule::F32_FUZZ);
    let good = FusedAlg2(SMALL);
    let seen =
        fuzz_random(300, 11, |d| run_linear_with(&good, rule, d)).unwrap_or_else(|f| panic!("{f}"));
    assert!(seen.compared >= 100, "{seen:?}");
    let failure = fuzz_random(300, 11, |d| {
        run_linear_with(&Scaled(FusedAlg2(SMALL)), rule, d)
    })
    .expect_err("a 1e-3 fault in dL/dhidden must fail the fuzz rule");
    assert!(failure.to_string().contains("grad_hidden"), "{failure}");
}
