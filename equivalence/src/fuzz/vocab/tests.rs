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
