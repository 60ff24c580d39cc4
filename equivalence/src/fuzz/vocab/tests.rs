//! The small loss cases' builders draw what the module docs promise, each in
//! its share: the stored fuzz inputs and the bug zoo rely on these shares
//! (an option never drawn is a bug never caught).
//!
//! Every count bound is the expected count +- 4 binomial standard
//! deviations over the draws (`k +- 4 sqrt(n p (1 - p))`, rounded out), so a
//! bound fails by chance about once in 15,000 runs of a changed seed; the
//! seeds here are fixed, so the tests are deterministic.

use std::collections::BTreeSet;

use super::*;
use crate::fuzz::schedule::{budgeted_input, Budget};

/// Byte strings from the fuzz schedule's own stream, one per `s`.
fn bytes(s: u64) -> Vec<u8> {
    budgeted_input(&Budget::small(1), s, 0)
}

/// `count` of `n` draws is within 4 binomial standard deviations of `n p`.
fn within_share(what: &str, count: usize, n: usize, p: f64) {
    let (n_f, k) = (n as f64, count as f64);
    let sd = (n_f * p * (1.0 - p)).sqrt();
    assert!(
        (k - n_f * p).abs() <= 4.0 * sd + 1.0,
        "{what}: {count} of {n}, expected {:.0} +- {:.0}",
        n_f * p,
        4.0 * sd
    );
}

/// `shard_map`: an even first byte draws `v` from [`PRIMES`], an odd one
/// anywhere in `1..=MAX_V` (so non-primes too); `p` in `1..=min(v,
/// MAX_P)`; both layouts.
#[test]
fn small_splits_weight_primes_up_and_reach_both_layouts() {
    let (mut non_prime, mut padded, mut uneven) = (false, 0, 0);
    let mut shards = BTreeSet::new();
    for s in 0..400u64 {
        let data = bytes(s);
        let map = shard_map(&mut Unstructured::new(&data)).unwrap();
        let (v, p) = (map.vocab_size(), map.num_shards());
        if data[0].is_multiple_of(2) {
            assert!(PRIMES.contains(&v), "even first byte, v = {v}");
        } else {
            non_prime |= !PRIMES.contains(&v);
        }
        assert!(
            (1..=MAX_V).contains(&v) && (1..=v.min(MAX_P)).contains(&p),
            "v {v}, p {p}"
        );
        shards.insert(p);
        match map.layout() {
            ShardLayout::Padded => padded += 1,
            ShardLayout::Uneven => uneven += 1,
        }
    }
    assert!(non_prime, "no odd first byte drew a non-prime vocabulary");
    assert_eq!(shards, (1..=MAX_P).collect(), "shard counts drawn");
    within_share("padded layout", padded, padded + uneven, 0.5);
}

/// `loss_config` over 1,200 byte strings at `v = 50`: ignore index -1 a
/// quarter, a real class a quarter (spread over the vocabulary), -100 a
/// half; label smoothing 0.1, 0.5, 1 and a drawn value in `[0, 1]` a sixth
/// each, none a third; both smoothing conventions; z-loss 1e-4, 0.1 and a
/// drawn value in `[0, 0.1]` a sixth each, none a half; each reduction a
/// third.
#[test]
fn small_loss_options_come_in_their_shares() {
    const N: usize = 1200;
    const V: usize = 50;
    let mut ignore = [0usize; 3]; // -1, a class, -100
    let mut classes = BTreeSet::new();
    let mut smoothing = [0usize; 5]; // 0.1, 0.5, 1, drawn, 0
    let (mut drawn_smoothing, mut drawn_z) = (Vec::new(), Vec::new());
    let mut z = [0usize; 4]; // 1e-4, 0.1, drawn, 0
    let (mut megatron, mut reductions) = (0, [0usize; 3]);
    for s in 0..N as u64 {
        let c = loss_config(&mut Unstructured::new(&bytes(s)), V).unwrap();
        match c.ignore_index {
            -1 => ignore[0] += 1,
            -100 => ignore[2] += 1,
            i => {
                assert!((0..V as i64).contains(&i), "ignore_index {i}");
                ignore[1] += 1;
                classes.insert(i);
            }
        }
        let ls = c.label_smoothing;
        smoothing[match ls {
            0.1 => 0,
            0.5 => 1,
            1.0 => 2,
            0.0 => 4,
            _ => {
                drawn_smoothing.push(ls);
                3
            }
        }] += 1;
        z[match c.z_loss {
            1e-4 => 0,
            0.1 => 1,
            0.0 => 3,
            x => {
                drawn_z.push(x);
                2
            }
        }] += 1;
        megatron += usize::from(c.smoothing == SmoothingConvention::Megatron);
        reductions[match c.reduction {
            Reduction::Mean => 0,
            Reduction::Sum => 1,
            Reduction::None => 2,
        }] += 1;
        assert_eq!(c.softcap, None, "the small case's softcap is small_tail's");
    }
    for (what, k, p) in [
        ("ignore -1", ignore[0], 0.25),
        ("ignore a class", ignore[1], 0.25),
        ("ignore -100", ignore[2], 0.5),
        ("smoothing 0.1", smoothing[0], 1.0 / 6.0),
        ("smoothing 0.5", smoothing[1], 1.0 / 6.0),
        ("smoothing 1", smoothing[2], 1.0 / 6.0),
        ("smoothing drawn", smoothing[3], 1.0 / 6.0),
        ("no smoothing", smoothing[4], 1.0 / 3.0),
        ("Megatron's convention", megatron, 0.5),
        ("z-loss 1e-4", z[0], 1.0 / 6.0),
        ("z-loss 0.1", z[1], 1.0 / 6.0),
        ("z-loss drawn", z[2], 1.0 / 6.0),
        ("no z-loss", z[3], 0.5),
        ("mean", reductions[0], 1.0 / 3.0),
        ("sum", reductions[1], 1.0 / 3.0),
        ("none", reductions[2], 1.0 / 3.0),
    ] {
        within_share(what, k, N, p);
    }
    // The classes spread over the vocabulary, not a corner of it.
    assert!(
        classes.len() > V / 2 && classes.iter().any(|&i| i >= 40),
        "{classes:?}"
    );
    // Drawn values fill their ranges.
    for (what, xs, hi) in [
        ("smoothing", &drawn_smoothing, 1.0),
        ("z-loss", &drawn_z, 0.1),
    ] {
        assert!(xs.iter().all(|x| (0.0..=hi).contains(x)), "{what}: {xs:?}");
        let lo_seen = xs.iter().copied().fold(f64::INFINITY, f64::min);
        let hi_seen = xs.iter().copied().fold(0.0, f64::max);
        assert!(
            lo_seen < 0.2 * hi && hi_seen > 0.8 * hi,
            "{what} drawn over {lo_seen}..{hi_seen}"
        );
    }
}

/// `small_tail` over 1,200 byte strings: a softcap a third of the time (1,
/// 30 or drawn in `[0.5, 50]`, a third each), independent of the upstream
/// gradient, given half of the time gradients are asked for and never
/// without them (`[n]` under `none`, else `[1]`).
#[test]
fn small_tails_draw_a_softcap_and_an_upstream_independently() {
    const N: usize = 1200;
    let (mut capped, mut at_one, mut at_thirty, mut drawn) = (0, 0, 0, Vec::new());
    let (mut asked, mut given, mut capped_asked, mut capped_given) = (0, 0, 0, 0);
    for s in 0..N as u64 {
        let data = bytes(s);
        let want_grad = s % 4 < 2;
        let reduction = if s % 2 == 0 {
            Reduction::None
        } else {
            Reduction::Mean
        };
        let mut config = LossConfig {
            reduction,
            ..LossConfig::default()
        };
        let up = small_tail(
            &mut Unstructured::new(&data),
            &mut Gen::seeded(s),
            5,
            &mut config,
            want_grad,
        )
        .unwrap();
        match config.softcap {
            Some(1.0) => at_one += 1,
            Some(30.0) => at_thirty += 1,
            Some(c) => drawn.push(c),
            None => {}
        }
        capped += usize::from(config.softcap.is_some());
        if let Some(up) = &up {
            assert!(want_grad, "an upstream gradient without gradients");
            assert_eq!(up.len(), if reduction == Reduction::None { 5 } else { 1 });
        }
        if want_grad {
            asked += 1;
            given += usize::from(up.is_some());
            capped_asked += usize::from(config.softcap.is_some());
            capped_given += usize::from(config.softcap.is_some() && up.is_some());
        }
    }
    within_share("softcap", capped, N, 1.0 / 3.0);
    within_share("softcap 1", at_one, capped, 1.0 / 3.0);
    within_share("softcap 30", at_thirty, capped, 1.0 / 3.0);
    within_share("softcap drawn", drawn.len(), capped, 1.0 / 3.0);
    assert!(drawn.iter().all(|c| (0.5..=50.0).contains(c)), "{drawn:?}");
    within_share("upstream", given, asked, 0.5);
    // Independent: a capped case gets an upstream half of the time too.
    within_share("upstream with a softcap", capped_given, capped_asked, 0.5);
}

/// `targets` over every byte value ten times: 0 is `v` and 1 is -5 (out of
/// range, V5), every other multiple of 5 the ignore index (51 of 256), the
/// rest real classes spread over the vocabulary.
#[test]
fn small_targets_are_classes_ignored_or_out_of_range_by_their_byte() {
    let data: Vec<u8> = (0..=255u8).cycle().take(2560).collect();
    let (v, ignore) = (50usize, -100i64);
    let t = targets(
        &mut Unstructured::new(&data),
        &mut Gen::seeded(3),
        2560,
        v,
        ignore,
    )
    .unwrap();
    let count = |x: i64| t.iter().filter(|&&y| y == x).count();
    assert_eq!(count(v as i64), 10, "out of range past the end");
    assert_eq!(count(-5), 10, "out of range below 0");
    assert_eq!(count(ignore), 510, "ignored");
    let classes: BTreeSet<i64> = t
        .iter()
        .copied()
        .filter(|c| (0..v as i64).contains(c))
        .collect();
    assert_eq!(
        t.len() - 530,
        t.iter().filter(|c| (0..v as i64).contains(c)).count()
    );
    assert_eq!(classes.len(), v, "every class drawn");
}

/// `padding_value`: NaN, infinity and 1e4 a quarter of the time each, else
/// a finite value of the generator's (anything, never to be read).
#[test]
fn padding_holds_nan_infinity_large_or_ordinary_values() {
    let mut gen = Gen::seeded(11);
    let xs: Vec<f64> = (0..800).map(|_| padding_value(&mut gen)).collect();
    let nan = xs.iter().filter(|x| x.is_nan()).count();
    let inf = xs.iter().filter(|&&x| x == f64::INFINITY).count();
    let big = xs.iter().filter(|&&x| x == 1e4).count();
    let other: Vec<f64> = xs
        .iter()
        .copied()
        .filter(|x| x.is_finite() && *x != 1e4)
        .collect();
    for (what, k) in [
        ("NaN", nan),
        ("inf", inf),
        ("1e4", big),
        ("ordinary", other.len()),
    ] {
        within_share(what, k, 800, 0.25);
    }
    assert!(
        other.iter().any(|&x| x < -1.0) && other.iter().any(|&x| x > 1.0),
        "{other:?}"
    );
}

/// A stored input read before the trailing byte existed ends early: the
/// missing byte reads 0 and must draw neither a softcap nor an upstream
/// gradient, so the input still means the case it did.
#[test]
fn a_missing_tail_byte_draws_nothing() {
    for reduction in [Reduction::None, Reduction::Mean] {
        let mut config = LossConfig {
            reduction,
            ..LossConfig::default()
        };
        let up = small_tail(
            &mut Unstructured::new(&[]),
            &mut Gen::seeded(1),
            4,
            &mut config,
            true,
        )
        .unwrap();
        assert_eq!((config.softcap, up), (None, None));
    }
}
