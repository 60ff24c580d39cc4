//! Unit tests of the vocabulary reference: the docs/FAULTS.md V1–V6 values, the
//! gradients against finite differences, the statistics merge, the shard map
//! and the in-process collective. The sharded == unsharded properties are the
//! equivalence suite's (`packshard-equivalence`, `vocab`).

use ndarray::{array, Array2};

use super::collective::{run_ranks, Reduce};
use super::cross_entropy::{log_softmax, softmax};
use super::embedding::{embedding_backward, embedding_forward, sharded_embedding};
use super::sharded::{sharded_cross_entropy, sharded_linear_cross_entropy, ShardLayout, ShardMap};
use super::*;
use crate::error::Error;

const V1_LOGITS: [f64; 8] = [1.0, 2.0, 0.0, -1.0, 3.0, 0.5, 1.5, -2.0];

fn row(z: &[f64]) -> Array2<f64> {
    Array2::from_shape_vec((1, z.len()), z.to_vec()).unwrap()
}

fn layouts() -> [ShardLayout; 2] {
    [ShardLayout::Uneven, ShardLayout::Padded]
}

#[test]
fn v1_label_smoothing_is_global_for_every_shard_count() {
    let logits = row(&V1_LOGITS);
    for (convention, want) in [
        (SmoothingConvention::PyTorch, "0.87051"),
        (SmoothingConvention::Megatron, "0.90444"),
    ] {
        let config = LossConfig::default().with_smoothing(0.1, convention);
        let call = LossCall::with_flag(&[4], &config, true);
        let unsharded = cross_entropy(logits.view(), &call).unwrap();
        assert_eq!(format!("{:.5}", unsharded.loss), want, "{convention:?}");
        for p in 1..=8 {
            for layout in layouts() {
                let map = ShardMap::new(8, p, layout).unwrap();
                for alg in ShardedAlgorithm::ALL {
                    let s = sharded_cross_entropy(alg, &map, logits.view(), &call).unwrap();
                    for r in &s.ranks {
                        assert_eq!(
                            format!("{:.5}", r.loss),
                            want,
                            "{alg} p {p} rank {}",
                            r.rank
                        );
                    }
                    assert!(s.ranks_agree());
                }
            }
        }
    }
}

#[test]
fn v1_pytorch_convention_matches_an_independent_formula() {
    // -Σ_j q_j log_softmax_j with q = (1 - a) onehot + a / V, from log_softmax.
    let logits = row(&V1_LOGITS);
    let lp = log_softmax(logits.view());
    let a = 0.1;
    let want: f64 = -(0..8)
        .map(|j| ((1.0 - a) * f64::from(u8::from(j == 4)) + a / 8.0) * lp[[0, j]])
        .sum::<f64>();
    let config = LossConfig::default().with_smoothing(a, SmoothingConvention::PyTorch);
    let got = cross_entropy(logits.view(), &LossCall::with_flag(&[4], &config, false))
        .unwrap()
        .loss;
    // The same f64 sum of 8 terms of order 1 in another order: a few ulps (eps 2.2e-16); 1e-15 is
    // ~4 ulps.
    assert!((got - want).abs() < 1e-15, "{got} vs {want}");
}

#[test]
fn v2_padded_vocabulary_entries_never_enter_the_softmax() {
    let real = [2.0, 1.0, 0.5, 3.0, -1.0, 0.0, 1.5, 2.5, -0.5, 1.0];
    let config = LossConfig::default();
    let unsharded = cross_entropy(
        row(&real).view(),
        &LossCall::with_flag(&[7], &config, false),
    )
    .unwrap();
    assert_eq!(format!("{:.6}", unsharded.loss), "1.474030");
    let map = ShardMap::new(10, 3, ShardLayout::Padded).unwrap();
    assert_eq!(map.padded_vocab_size(), 12);
    for padding in [
        [0.0, 0.0],
        [50.0, -3.0],
        [1e4, 1e4],
        [f64::NAN, f64::INFINITY],
    ] {
        let mut z = real.to_vec();
        z.extend(padding);
        let call = LossCall::with_flag(&[7], &config, true);
        for alg in ShardedAlgorithm::ALL {
            let s = sharded_cross_entropy(alg, &map, row(&z).view(), &call).unwrap();
            assert_eq!(format!("{:.6}", s.loss()), "1.474030", "{alg} {padding:?}");
            // Padding columns get no gradient.
            let last = s.ranks[2].grad_logits.as_ref().unwrap();
            assert_eq!(last.row(0).to_vec()[2..], [0.0, 0.0]);
        }
    }
}

#[test]
fn v3_input_gradient_is_summed_over_shards() {
    let x = array![[1.0, -1.0]];
    let w = array![[1.0, 0.0], [0.0, 1.0], [0.5, 0.5], [-1.0, 2.0]];
    let config = LossConfig::default();
    let call = LossCall::with_flag(&[2], &config, true);
    let u = linear_cross_entropy(x.view(), w.view(), &call).unwrap();
    let g = u.grad_hidden.unwrap();
    assert_eq!(
        format!("{:.4} {:.4}", g[[0, 0]], g[[0, 1]]),
        "0.2661 -0.2661"
    );
    let map = ShardMap::new(4, 2, ShardLayout::Uneven).unwrap();
    for alg in ShardedAlgorithm::ALL {
        let s = sharded_linear_cross_entropy(alg, &map, x.view(), w.view(), &call).unwrap();
        for r in &s.ranks {
            let g = r.grad_hidden.as_ref().unwrap();
            assert_eq!(
                format!("{:.4} {:.4}", g[[0, 0]], g[[0, 1]]),
                "0.2661 -0.2661",
                "{alg} rank {}",
                r.rank
            );
        }
    }
}

#[test]
fn v4_a_vocabulary_not_divisible_by_the_shard_count() {
    let v = 250_682;
    assert_ne!(v % 8, 0);
    let uneven = ShardMap::new(v, 8, ShardLayout::Uneven).unwrap();
    let widths: Vec<usize> = uneven.shards().iter().map(|s| s.width).collect();
    assert_eq!(
        widths,
        [31336, 31336, 31335, 31335, 31335, 31335, 31335, 31335]
    );
    let padded = ShardMap::new(v, 8, ShardLayout::Padded).unwrap();
    assert_eq!(padded.padded_vocab_size(), 250_688);
    assert_eq!(padded.shard(7).real, 31_336 - 6);
    // Targets in the first, a middle and the last shard.
    let n = 3;
    let logits = Array2::from_shape_fn((n, v), |(i, j)| {
        ((i * 7 + j * 13) % 101) as f64 / 17.0 - 3.0
    });
    let targets = [0, 125_000, v as i64 - 1];
    let config = LossConfig::default();
    let u = cross_entropy(logits.view(), &LossCall::with_flag(&targets, &config, true)).unwrap();
    for map in [uneven, padded] {
        let s = sharded_cross_entropy(
            ShardedAlgorithm::Alg2,
            &map,
            logits.view(),
            &LossCall::with_flag(&targets, &config, true),
        )
        .unwrap();
        let rel = (s.loss() - u.loss).abs() / u.loss;
        assert!(
            rel < 64.0 * f64::EPSILON,
            "{} vs {} ({rel:e})",
            s.loss(),
            u.loss
        );
    }
}

#[test]
fn v5_out_of_range_ids_are_errors_in_both_layers() {
    let w = Array2::from_shape_fn((5, 3), |(i, k)| (i * 3 + k) as f64);
    for bad in [5i64, -1] {
        let ids = [0, bad, 2];
        let e = embedding_forward(&ids, w.view()).unwrap_err();
        assert!(
            matches!(e, Error::IndexOutOfRange { ref field, index: 1, value, lo: 0, hi: 5 } if field == "ids" && value == bad),
            "{e}"
        );
        for layout in layouts() {
            let map = ShardMap::new(5, 2, layout).unwrap();
            assert_eq!(
                sharded_embedding(&map, &ids, w.view(), None).unwrap_err(),
                e
            );
            // Also on each rank on its own: every rank finds it before any collective.
            let parts = map.split_rows(w.view(), "weight").unwrap();
            let err = run_ranks(2, |c| {
                super::embedding::embedding_rank(c, &map, &ids, parts[c.rank()].view())
            })
            .unwrap_err();
            assert_eq!(err, e);
        }
    }
}

#[test]
fn embedding_forward_and_backward_match_sharded() {
    let w = Array2::from_shape_fn((7, 2), |(i, k)| i as f64 + 0.25 * k as f64);
    let ids = [6, 0, 3, 3, 5];
    let g = Array2::from_shape_fn((5, 2), |(i, k)| {
        (i + 1) as f64 * if k == 0 { 1.0 } else { -0.5 }
    });
    let out = embedding_forward(&ids, w.view()).unwrap();
    assert_eq!(out.row(0).to_vec(), vec![6.0, 6.25]);
    let gw = embedding_backward(&ids, g.view(), 7).unwrap();
    assert_eq!(gw.row(3).to_vec(), vec![3.0 + 4.0, -1.5 - 2.0]);
    for p in 1..=7 {
        for layout in layouts() {
            let map = ShardMap::new(7, p, layout).unwrap();
            let s = sharded_embedding(&map, &ids, w.view(), Some(g.view())).unwrap();
            for o in &s.outputs {
                assert_eq!(o, &out);
            }
            assert_eq!(s.grad_weight().unwrap(), gw);
            assert!(s
                .counts
                .iter()
                .all(|c| c.barriers == 1 && c.calls == 1 && c.elements == 10));
        }
    }
}

#[test]
fn v6_an_all_minus_inf_shard_contributes_nothing() {
    let inf = f64::NEG_INFINITY;
    let z = [1.0, 2.0, 0.0, -1.0, inf, inf, inf, inf];
    let config = LossConfig::default();
    let call = LossCall::with_flag(&[1], &config, true);
    let u = cross_entropy(row(&z).view(), &call).unwrap();
    assert!(u.loss.is_finite());
    let map = ShardMap::new(8, 2, ShardLayout::Uneven).unwrap();
    for alg in ShardedAlgorithm::ALL {
        let s = sharded_cross_entropy(alg, &map, row(&z).view(), &call).unwrap();
        assert_eq!(
            s.ranks[1].local[0].sum_exp(),
            0.0,
            "{alg}: the shard contributes 0"
        );
        assert!(
            (s.loss() - u.loss).abs() <= 4.0 * f64::EPSILON * u.loss,
            "{alg}"
        );
        assert!(s.grad_logits().unwrap().iter().all(|g| g.is_finite()));
    }
    // A shard that is all padding: v = 9 over 4 padded shards of 3.
    let map = ShardMap::new(9, 4, ShardLayout::Padded).unwrap();
    assert_eq!(map.shard(3).real, 0);
    let z9 = row(&[0.5, -1.0, 2.0, 1.0, 0.0, 3.0, -2.0, 1.5, 0.25]);
    let call = LossCall::with_flag(&[5], &config, true);
    let u = cross_entropy(z9.view(), &call).unwrap();
    for alg in ShardedAlgorithm::ALL {
        let s = sharded_cross_entropy(alg, &map, z9.view(), &call).unwrap();
        assert!(
            (s.loss() - u.loss).abs() <= 4.0 * f64::EPSILON * u.loss,
            "{alg}"
        );
    }
}

#[test]
fn a_row_of_minus_inf_is_an_error_unless_ignored() {
    let inf = f64::NEG_INFINITY;
    let z = Array2::from_shape_vec((2, 3), vec![0.0, 1.0, 2.0, inf, inf, inf]).unwrap();
    let config = LossConfig::default();
    let e = cross_entropy(z.view(), &LossCall::with_flag(&[0, 1], &config, false)).unwrap_err();
    assert_eq!(
        e.to_string(),
        "logits[1]: every logit is -inf, so the softmax is undefined (the target is not ignored)"
    );
    let map = ShardMap::new(3, 3, ShardLayout::Uneven).unwrap();
    for alg in ShardedAlgorithm::ALL {
        assert_eq!(
            sharded_cross_entropy(
                alg,
                &map,
                z.view(),
                &LossCall::with_flag(&[0, 1], &config, false)
            )
            .unwrap_err(),
            e
        );
    }
    let ok = cross_entropy(z.view(), &LossCall::with_flag(&[0, -100], &config, true)).unwrap();
    assert_eq!(ok.per_token_loss[1], 0.0);
    assert_eq!(ok.num_tokens, 1);
    assert!(ok.grad_logits.unwrap().row(1).iter().all(|&g| g == 0.0));
}

/// Central differences of `f` at `x`: each element moved by `eps`.
fn numeric_grad(x: &Array2<f64>, eps: f64, f: impl Fn(&Array2<f64>) -> f64) -> Array2<f64> {
    let mut g = Array2::zeros(x.raw_dim());
    for idx in 0..x.len() {
        let (i, j) = (idx / x.ncols(), idx % x.ncols());
        let mut plus = x.clone();
        plus[[i, j]] += eps;
        let mut minus = x.clone();
        minus[[i, j]] -= eps;
        g[[i, j]] = (f(&plus) - f(&minus)) / (2.0 * eps);
    }
    g
}

fn assert_grad_close(what: &str, analytic: &Array2<f64>, numeric: &Array2<f64>) {
    // Central differences with eps 1e-5 on smooth O(1) functions: truncation
    // error ~eps^2 * f''' ~ 1e-10, round-off ~1e-16 / eps ~ 1e-11.
    for (a, n) in analytic.iter().zip(numeric) {
        assert!((a - n).abs() < 1e-8, "{what}: analytic {a} vs numeric {n}");
    }
}

#[test]
fn gradients_match_finite_differences() {
    let hidden = Array2::from_shape_fn((4, 3), |(i, k)| ((i * 5 + k * 3) % 7) as f64 / 3.0 - 1.0);
    let weight = Array2::from_shape_fn((6, 3), |(j, k)| ((j * 2 + k * 5) % 11) as f64 / 5.0 - 1.0);
    let targets = [3, -100, 0, 5];
    for config in [
        LossConfig::default(),
        LossConfig::default().with_smoothing(0.2, SmoothingConvention::PyTorch),
        LossConfig::default()
            .with_smoothing(0.3, SmoothingConvention::Megatron)
            .with_z_loss(0.05)
            .with_reduction(Reduction::Sum),
        LossConfig::default()
            .with_z_loss(0.1)
            .with_reduction(Reduction::None),
        // O1: the softcap composes with smoothing, z-loss and ignore_index.
        LossConfig::default().with_softcap(0.7),
        LossConfig::default()
            .with_softcap(1.5)
            .with_smoothing(0.2, SmoothingConvention::Megatron)
            .with_z_loss(0.05),
    ] {
        let u = linear_cross_entropy(
            hidden.view(),
            weight.view(),
            &LossCall::with_flag(&targets, &config, true),
        )
        .unwrap();
        let loss = |x: &Array2<f64>, w: &Array2<f64>| {
            linear_cross_entropy(
                x.view(),
                w.view(),
                &LossCall::with_flag(&targets, &config, false),
            )
            .unwrap()
            .ce
            .loss
        };
        let eps = 1e-5;
        assert_grad_close(
            "grad_hidden",
            u.grad_hidden.as_ref().unwrap(),
            &numeric_grad(&hidden, eps, |x| loss(x, &weight)),
        );
        assert_grad_close(
            "grad_weight",
            u.grad_weight.as_ref().unwrap(),
            &numeric_grad(&weight, eps, |w| loss(&hidden, w)),
        );
        let z = u.logits.clone();
        assert_grad_close(
            "grad_logits",
            u.ce.grad_logits.as_ref().unwrap(),
            &numeric_grad(&z, eps, |z| {
                cross_entropy(z.view(), &LossCall::with_flag(&targets, &config, false))
                    .unwrap()
                    .loss
            }),
        );
    }
}

#[test]
fn z_loss_adds_c_times_logsumexp_squared() {
    let z = row(&[0.3, -1.2, 2.0]);
    let plain = cross_entropy(
        z.view(),
        &LossCall::with_flag(&[0], &LossConfig::default(), false),
    )
    .unwrap();
    let with = cross_entropy(
        z.view(),
        &LossCall::with_flag(&[0], &LossConfig::default().with_z_loss(1e-2), false),
    )
    .unwrap();
    let lse = plain.logsumexp()[0];
    // z_loss adds 1e-2 * lse^2 in f64 on a loss of order 1: the two rounded ~4 ulps apart at most
    // (1e-15).
    assert!((with.loss - plain.loss - 1e-2 * lse * lse).abs() < 1e-15);
    // lse independently: ln Σ exp.
    let direct = (0.3f64.exp() + (-1.2f64).exp() + 2.0f64.exp()).ln();
    assert!((lse - direct).abs() < 1e-15);
}

#[test]
fn confident_predictions_keep_relative_precision() {
    // Loss exp(-40) ≈ 4.2e-18: as logsumexp - z_t it would be 0.
    let z = row(&[40.0, 0.0, 0.0]);
    let config = LossConfig::default();
    let call = LossCall::with_flag(&[0], &config, true);
    let u = cross_entropy(z.view(), &call).unwrap();
    let want = 2.0 * (-40.0f64).exp();
    assert!(
        (u.loss - want).abs() <= 4.0 * f64::EPSILON * want,
        "{} vs {want}",
        u.loss
    );
    let g = u.grad_logits.unwrap();
    assert!(
        (g[[0, 0]] + want).abs() <= 4.0 * f64::EPSILON * want,
        "{}",
        g[[0, 0]]
    );
    let map = ShardMap::new(3, 3, ShardLayout::Uneven).unwrap();
    for alg in ShardedAlgorithm::ALL {
        let s = sharded_cross_entropy(alg, &map, z.view(), &call).unwrap();
        assert!(
            (s.loss() - want).abs() <= 4.0 * f64::EPSILON * want,
            "{alg}: {}",
            s.loss()
        );
        let gs = s.grad_logits().unwrap();
        assert!(
            (gs[[0, 0]] + want).abs() <= 4.0 * f64::EPSILON * want,
            "{alg}: {}",
            gs[[0, 0]]
        );
    }
}

#[test]
fn softmax_stats_merge_in_any_grouping() {
    let inf = f64::NEG_INFINITY;
    let z = [0.5, 3.0, inf, 3.0, -7.0, inf, inf, 1.0, 2.5];
    let q = |j: usize| if j == 4 { 0.9 } else { 0.1 / 8.0 };
    let whole = SoftmaxStats::of(&z, q);
    for cuts in [
        vec![0, 9],
        vec![0, 2, 9],
        vec![0, 5, 7, 9],
        vec![0, 1, 2, 3, 4, 5, 6, 7, 8, 9],
    ] {
        let merged = cuts
            .windows(2)
            .map(|w| SoftmaxStats::of(&z[w[0]..w[1]], |j| q(j + w[0])))
            .reduce(SoftmaxStats::merge)
            .unwrap();
        assert_eq!(merged.max, whole.max);
        for (a, b) in [
            (merged.rest, whole.rest),
            (merged.target, whole.target),
            (merged.mass, whole.mass),
        ] {
            assert!(
                a == b || (a - b).abs() <= 8.0 * f64::EPSILON * b.abs(),
                "{cuts:?}: {a} vs {b}"
            );
        }
    }
    // Two ties at the maximum: s = 2 + ..., rest >= 1.
    assert!(whole.rest >= 1.0);
    let empty = SoftmaxStats::of(&[inf, inf], |_| 0.0);
    assert_eq!(empty, SoftmaxStats::EMPTY);
    assert_eq!(empty.merge(empty), SoftmaxStats::EMPTY);
    assert_eq!(whole.merge(empty), whole);
}

#[test]
fn softmax_rows_sum_to_one() {
    let z = array![[1.0, 2.0, f64::NEG_INFINITY], [-1e4, 1e4, 0.0]];
    let p = softmax(z.view());
    for r in p.rows() {
        // A softmax row sums to 1 up to a few ulps (3 terms): 1e-15 is ~4 ulps of 1.
        assert!((r.sum() - 1.0).abs() < 1e-15);
    }
    assert_eq!(p[[0, 2]], 0.0);
}

#[test]
fn shard_maps_uneven_and_padded() {
    let d = |v, p, l| ShardMap::new(v, p, l).unwrap().describe();
    assert_eq!(
        d(10, 3, ShardLayout::Uneven),
        "v 10, p 3, uneven: [0, 4) [4, 7) [7, 10)"
    );
    assert_eq!(
        d(10, 3, ShardLayout::Padded),
        "v 10, p 3, padded to 12: [0, 4) [4, 8) [8, 10) + 2 padding"
    );
    assert_eq!(
        d(9, 4, ShardLayout::Padded),
        "v 9, p 4, padded to 12: [0, 3) [3, 6) [6, 9) [9, 9) + 3 padding"
    );
    // A padded layout that needs no padding still says which layout it is.
    assert_eq!(
        d(12, 3, ShardLayout::Padded),
        "v 12, p 3, padded: [0, 4) [4, 8) [8, 12)"
    );
    let e = ShardMap::new(3, 4, ShardLayout::Uneven).unwrap_err();
    assert_eq!(
        e.to_string(),
        "num_shards: 4 shards for a vocabulary of 3: p must be <= v"
    );
    assert!(ShardMap::new(0, 1, ShardLayout::Uneven).is_err());
    assert!(ShardMap::new(5, 0, ShardLayout::Uneven).is_err());
    let m = ShardMap::new(10, 3, ShardLayout::Uneven).unwrap();
    assert_eq!(m.owner(4), Some((1, 0)));
    assert_eq!(m.owner(10), None);
}

#[test]
fn collective_reduces_in_rank_order_and_counts() {
    let out = run_ranks(4, |c| {
        let r = c.rank() as f64;
        let mut a = vec![r, -r];
        let mut b = vec![0.1 * (r + 1.0); 3];
        c.all_reduce(&mut [Reduce::Max(&mut a), Reduce::Sum(&mut b)])?;
        let mut x = vec![r; 2];
        c.broadcast(2, &mut x)?;
        Ok((a, b, x))
    })
    .unwrap();
    let want_sum = ((0.1 + 0.2) + 0.30000000000000004) + 0.4;
    for r in &out {
        assert_eq!(r.output.0, vec![3.0, 0.0]);
        assert_eq!(r.output.1, vec![want_sum; 3]);
        assert_eq!(r.output.2, vec![2.0, 2.0]);
        assert_eq!(
            (r.counts.barriers, r.counts.calls, r.counts.elements),
            (2, 3, 7)
        );
    }
}

#[test]
fn collective_mismatches_and_failures_are_errors_not_hangs() {
    // Different lengths on different ranks.
    let e = run_ranks(3, |c| {
        let mut a = vec![0.0; 1 + c.rank()];
        c.all_reduce_sum(&mut a)
    })
    .unwrap_err();
    assert!(
        e.to_string().contains(
            "rank 1 issued all_reduce[sum of 2] where rank 0 issued all_reduce[sum of 1]"
        ),
        "{e}"
    );
    // One rank skips the collective.
    let e = run_ranks(2, |c| {
        if c.rank() == 0 {
            let mut a = vec![0.0];
            c.all_reduce_sum(&mut a)?;
        }
        Ok(())
    })
    .unwrap_err();
    assert!(
        e.to_string()
            .contains("rank 1 ended its program while rank 0 waits"),
        "{e}"
    );
    // One rank fails: its error is the one reported.
    let e = run_ranks(3, |c| {
        if c.rank() == 2 {
            return Err(Error::invalid("x", "rank 2's own error"));
        }
        let mut a = vec![0.0];
        c.all_reduce_sum(&mut a)
    })
    .unwrap_err();
    assert_eq!(e.to_string(), "x: rank 2's own error");
    assert!(run_ranks(0, |_| Ok(())).is_err());
}

#[test]
fn collective_counts_per_algorithm() {
    // n = 3 tokens, h = 2, v = 5 over p = 2: the elements each barrier carries.
    let (n, h) = (3u64, 2u64);
    let x = Array2::from_shape_fn((3, 2), |(i, k)| i as f64 - k as f64);
    let w = Array2::from_shape_fn((5, 2), |(j, k)| 0.5 * j as f64 + k as f64);
    let map = ShardMap::new(5, 2, ShardLayout::Uneven).unwrap();
    let config = LossConfig::default();
    for (alg, barriers, calls, elements) in [
        (ShardedAlgorithm::Naive, 3, 3, n + 3 * n + n * h),
        (ShardedAlgorithm::Alg1, 2, 2, 4 * n + n * h),
        (ShardedAlgorithm::Alg2, 1, 1, (4 + 2 * h) * n),
    ] {
        let run = |want_grad| {
            let call = LossCall::with_flag(&[0, 4, 2], &config, want_grad);
            sharded_linear_cross_entropy(alg, &map, x.view(), w.view(), &call).unwrap()
        };
        let s = run(true);
        let c = s.counts();
        assert_eq!(
            (c.barriers, c.calls, c.elements),
            (barriers, calls, elements),
            "{alg}"
        );
        assert_eq!(c.barriers, alg.barriers(true, true));
        let f = run(false);
        assert_eq!(
            f.counts().barriers,
            alg.barriers(true, false),
            "{alg} forward"
        );
    }
}

/// The S/T split (for pipeline schedules): two output layers run as S(a),
/// S(b), T(a), T(b) on every rank give bit for bit what the monolithic
/// per-rank code gives for each; alg2's T pass issues no collective and its
/// S pass already holds `∂L/∂x`; naive's and alg1's T pass issue the
/// input-gradient barrier.
#[test]
fn s_and_t_passes_split_by_other_work_equal_the_monolithic_rank_code() {
    use super::sharded::{linear_cross_entropy_rank, linear_cross_entropy_rank_s};
    let (n, h, v) = (5, 3, 11);
    let hidden_a = Array2::from_shape_fn((n, h), |(i, k)| ((i * 5 + k * 3) % 7) as f64 / 3.0 - 1.0);
    let hidden_b = Array2::from_shape_fn((n, h), |(i, k)| ((i * 2 + k * 7) % 5) as f64 / 2.0 - 0.7);
    let weight = Array2::from_shape_fn((v, h), |(j, k)| ((j * 3 + k * 5) % 13) as f64 / 6.0 - 1.0);
    let targets_a = [0, 10, -100, 4, 7];
    let targets_b = [3, 3, 9, -100, 1];
    let config = LossConfig::default().with_smoothing(0.05, SmoothingConvention::PyTorch);
    for p in [1, 2, 3, 4] {
        let map = ShardMap::new(v, p, ShardLayout::Padded).unwrap();
        let parts = map.split_rows(weight.view(), "weight").unwrap();
        for alg in ShardedAlgorithm::ALL {
            let out = run_ranks(p, |comm| {
                let w = parts[comm.rank()].view();
                // Batch a and batch b, whole and S pass alone, in this order.
                let call = |targets| LossCall::with_flag(targets, &config, true);
                let whole = |x: &Array2<f64>, targets| {
                    linear_cross_entropy_rank(comm, alg, &map, x.view(), w, &call(targets))
                };
                let s_pass = |x: &Array2<f64>, targets| {
                    linear_cross_entropy_rank_s(comm, alg, &map, x.view(), w, &call(targets))
                };
                let whole_a = whole(&hidden_a, &targets_a)?;
                let whole_b = whole(&hidden_b, &targets_b)?;
                let before = comm.counts().barriers;
                let s_a = s_pass(&hidden_a, &targets_a)?;
                let s_b = s_pass(&hidden_b, &targets_b)?;
                let s_barriers = comm.counts().barriers - before;
                assert_eq!(s_a.loss().to_bits(), whole_a.loss.to_bits());
                assert_eq!(
                    s_a.grad_hidden().is_some(),
                    alg == ShardedAlgorithm::Alg2,
                    "{alg}: only alg2 forms dL/dx in S"
                );
                if let Some(g) = s_a.grad_hidden() {
                    assert_eq!(Some(g), whole_a.grad_hidden.as_ref());
                }
                let t_a = s_a.t_pass(comm, hidden_a.view(), w)?;
                let t_b = s_b.t_pass(comm, hidden_b.view(), w)?;
                let t_barriers = comm.counts().barriers - before - s_barriers;
                Ok((whole_a, whole_b, t_a, t_b, s_barriers, t_barriers))
            })
            .unwrap();
            for r in out {
                let (whole_a, whole_b, t_a, t_b, s_barriers, t_barriers) = r.output;
                for (whole, split) in [(&whole_a, &t_a), (&whole_b, &t_b)] {
                    assert_eq!(whole.loss.to_bits(), split.loss.to_bits(), "{alg} p {p}");
                    assert_eq!(whole.grad_logits, split.grad_logits, "{alg} p {p}");
                    assert_eq!(whole.grad_hidden, split.grad_hidden, "{alg} p {p}");
                    assert_eq!(whole.grad_weight, split.grad_weight, "{alg} p {p}");
                    assert!(split.grad_weight.is_some() && split.grad_hidden.is_some());
                }
                let (s_want, t_want) = match alg {
                    ShardedAlgorithm::Naive => (4, 2),
                    ShardedAlgorithm::Alg1 => (2, 2),
                    ShardedAlgorithm::Alg2 => (2, 0),
                };
                assert_eq!((s_barriers, t_barriers), (s_want, t_want), "{alg}");
            }
        }
    }
}

#[test]
fn o1_softcap_is_applied_first_sharded_as_unsharded() {
    let hidden = Array2::from_shape_fn((5, 3), |(i, k)| ((i * 5 + k * 3) % 7) as f64 - 3.0);
    let weight = Array2::from_shape_fn((7, 3), |(j, k)| ((j * 2 + k * 5) % 11) as f64 / 2.0 - 2.0);
    let targets = [3, -100, 0, 6, 2];
    let c = 2.0;
    let config = LossConfig::default()
        .with_softcap(c)
        .with_smoothing(0.1, SmoothingConvention::PyTorch)
        .with_z_loss(1e-3);
    let call = LossCall::with_flag(&targets, &config, true);
    let u = linear_cross_entropy(hidden.view(), weight.view(), &call).unwrap();
    // The capped logits through the uncapped loss give the same loss.
    let capped = u.logits.mapv(|z| c * (z / c).tanh());
    let plain = LossConfig {
        softcap: None,
        ..config
    };
    let direct =
        cross_entropy(capped.view(), &LossCall::with_flag(&targets, &plain, false)).unwrap();
    assert!((direct.loss - u.ce.loss).abs() < 1e-14 * u.ce.loss.abs().max(1.0));
    // lse <= c + ln(7) for logits capped at c over 7 entries; 1e-12 for the f64 rounding of the
    // sum.
    assert!(u.ce.logsumexp().iter().all(|l| *l < c + 7f64.ln() + 1e-12));
    for algorithm in ShardedAlgorithm::ALL {
        for layout in layouts() {
            let map = ShardMap::new(7, 3, layout).unwrap();
            let mut w = weight.clone();
            if map.padded_vocab_size() > 7 {
                w = Array2::from_shape_fn((map.padded_vocab_size(), 3), |(j, k)| {
                    if j < 7 {
                        weight[[j, k]]
                    } else {
                        1e3
                    }
                });
            }
            let s = sharded_linear_cross_entropy(algorithm, &map, hidden.view(), w.view(), &call)
                .unwrap();
            // Sharded against unsharded in f64: the same sums in another order, 1e-12 a margin
            // chosen over a few ulps.
            assert!((s.loss() - u.ce.loss).abs() < 1e-12, "{algorithm}");
            let close = |a: &Array2<f64>, b: &Array2<f64>| {
                a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-12)
            };
            assert!(close(
                s.grad_hidden().unwrap(),
                u.grad_hidden.as_ref().unwrap()
            ));
            assert!(close(
                &s.grad_weight().unwrap(),
                u.grad_weight.as_ref().unwrap()
            ));
            assert!(close(
                &s.grad_logits().unwrap(),
                u.ce.grad_logits.as_ref().unwrap()
            ));
        }
    }
    for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        let config = LossConfig::default().with_softcap(bad);
        let err = cross_entropy(
            u.logits.view(),
            &LossCall::with_flag(&targets, &config, false),
        )
        .unwrap_err();
        assert!(
            matches!(&err, Error::InvalidArgument { field, .. } if field == "softcap"),
            "{err}"
        );
    }
}

/// The hostile sweep's case (docs/HOSTILE.md): a softcap of 1e-300 saturates
/// a logit (chain factor rounds to 0) while `grad_output x z_loss` takes the
/// capped logit's gradient past f64; formed, that is `0 x inf` = NaN where
/// the true gradient is finite. Refused naming `grad_output`, unsharded and
/// under every algorithm; the same case with `grad_output` 1 answers finite
/// gradients (the bound refuses only what is beyond f64).
#[test]
fn a_gradient_beyond_f64_is_refused_naming_grad_output() {
    let z = [1e3, 0.0, -5.0, 2.0];
    let config = LossConfig::default()
        .with_softcap(1e-300)
        .with_z_loss(3.5e38)
        .with_reduction(Reduction::Sum);
    let map = ShardMap::new(4, 2, ShardLayout::Uneven).unwrap();
    for (g, refused) in [(1.7e308, true), (1.0, false)] {
        let upstream = [g];
        let call = LossCall::new(&[0], &config, GradRequest::Upstream(&upstream));
        let u = cross_entropy(row(&z).view(), &call);
        let sharded: Vec<_> = ShardedAlgorithm::ALL
            .iter()
            .map(|&alg| sharded_cross_entropy(alg, &map, row(&z).view(), &call))
            .collect();
        if refused {
            let e = u.unwrap_err();
            assert!(e.to_string().contains("grad_output"), "{e}");
            for s in sharded {
                let e = s.unwrap_err();
                assert!(e.to_string().contains("grad_output"), "{e}");
            }
        } else {
            let u = u.unwrap();
            assert!(u.grad_logits.unwrap().iter().all(|x| x.is_finite()));
            for s in sharded {
                assert!(s
                    .unwrap()
                    .grad_logits()
                    .unwrap()
                    .iter()
                    .all(|x| x.is_finite()));
            }
        }
    }
}
