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

/// The planted values a case's description lists (`... = x` after
/// `planted`, up to the eight it names).
fn planted_values(values: &str) -> Vec<String> {
    let Some((_, list)) = values.split_once("; planted ") else {
        return Vec::new();
    };
    list.split(", ")
        .filter_map(|item| item.split_once("] = ").map(|(_, x)| x.to_string()))
        .collect()
}

/// `CeFuzzCase::arbitrary`, small cases over 600 byte strings: gradients
/// asked for half the time; the four plants reach `±1e4`, `±1e8` and
/// `-inf`, both signs; random `-inf` logits one in 3, 8 or 32 in three
/// quarters of the cases, named in the description, and never "1 in 0".
#[test]
fn small_ce_cases_draw_gradients_plants_and_infinities_in_their_shares() {
    let (mut small, mut grads, mut with_inf) = (0, 0, 0);
    let mut planted = BTreeSet::new();
    let mut rates = BTreeSet::new();
    for s in 0..600u64 {
        let data = bytes(s);
        if SizeClass::of(&data[..1]) != SizeClass::Small {
            continue;
        }
        let c = CeFuzzCase::arbitrary(&mut Unstructured::new(&data)).unwrap();
        small += 1;
        grads += usize::from(c.want_grad);
        planted.extend(planted_values(&c.values));
        // "1 in k logits -inf" (the generator's own "1 in k x m" outliers
        // share the words "1 in").
        if let Some((before, _)) = c.values.split_once(" logits -inf") {
            with_inf += 1;
            let (_, k) = before.rsplit_once("1 in ").expect("1 in k logits -inf");
            rates.insert(k.to_string());
        }
    }
    assert!(small >= 300, "only {small} small cases");
    within_share("small cases asking for gradients", grads, small, 0.5);
    within_share("cases with random -inf logits", with_inf, small, 0.75);
    assert_eq!(rates, ["3", "32", "8"].map(String::from).into());
    for x in ["10000", "-10000", "100000000", "-100000000", "-inf"] {
        assert!(planted.contains(x), "no plant of {x}: {planted:?}");
    }
}

/// `LinearFuzzCase::arbitrary` over 600 byte strings: half the plants go
/// to `hidden`, half to `weight`, each with 100, -100 and 0.
#[test]
fn linear_case_plants_hit_both_tensors_with_both_signs() {
    let (mut hidden, mut all) = (0, 0);
    let mut seen = BTreeSet::new();
    for s in 0..600u64 {
        let data = bytes(s);
        let c = LinearFuzzCase::arbitrary(&mut Unstructured::new(&data)).unwrap();
        let Some((_, mut list)) = c.values.split_once("; planted ") else {
            continue;
        };
        // Items `hidden[i, k] = x` or `weight[j, k] = x`, comma-separated.
        while let Some(at) = list.find(['h', 'w']) {
            let item = &list[at..];
            let (tensor, rest) = item.split_once('[').expect("a planted tensor");
            let (_, after) = rest.split_once("] = ").expect("a planted value");
            let x = after.split([',', ';']).next().expect("a value");
            all += 1;
            hidden += usize::from(tensor == "hidden");
            seen.insert((tensor.to_string(), x.to_string()));
            list = &after[x.len()..];
        }
    }
    within_share("plants in hidden", hidden, all, 0.5);
    for t in ["hidden", "weight"] {
        for x in ["100", "-100", "0"] {
            assert!(
                seen.contains(&(t.to_string(), x.to_string())),
                "no plant of {x} in {t}: {seen:?}"
            );
        }
    }
}

/// V6 in `CeFuzzCase::arbitrary`'s small cases (those without random `-inf`
/// logits, so that a shard all `-inf` is the plant): a row's byte masks a
/// whole shard when `b % 6 == 5` (42 of 256 bytes) and the case has more
/// than one shard, the shard `b / 6 % p` (every rank reached at `p` = 2
/// and 3); a one-shard case never loses its whole row.
#[test]
fn v6_masks_whole_shards_of_about_a_sixth_of_the_rows() {
    let (mut rows, mut masked, mut single_masked) = (0, 0, 0);
    let mut ranks = BTreeSet::new();
    for s in 0..1500u64 {
        let data = bytes(s);
        if SizeClass::of(&data[..1]) != SizeClass::Small {
            continue;
        }
        let c = CeFuzzCase::arbitrary(&mut Unstructured::new(&data)).unwrap();
        if c.values.contains(" logits -inf") {
            continue;
        }
        let (map, z) = (&c.case.map, &c.case.logits);
        let p = map.num_shards();
        for i in 0..z.nrows() {
            // Shards of at least 3 real columns: the four plants cannot
            // fill one by themselves, two at most land in one row here.
            let all_inf = |r: usize| {
                let sh = map.shard(r);
                sh.real >= 3
                    && (sh.start..sh.start + sh.real).all(|j| z[[i, j]] == f64::NEG_INFINITY)
            };
            let hit: Vec<usize> = (0..p).filter(|&r| all_inf(r)).collect();
            if p == 1 {
                single_masked += hit.len();
                continue;
            }
            if (0..p).all(|r| map.shard(r).real >= 3) {
                rows += 1;
                masked += usize::from(!hit.is_empty());
                ranks.extend(hit.iter().map(|&r| (p, r)));
            }
        }
    }
    assert!(rows >= 300, "only {rows} rows");
    assert_eq!(single_masked, 0, "a one-shard row masked whole");
    within_share("rows with a shard masked", masked, rows, 42.0 / 256.0);
    for (p, r) in [(2, 0), (2, 1), (3, 0), (3, 1), (3, 2)] {
        assert!(
            ranks.contains(&(p, r)),
            "rank {r} of {p} never masked: {ranks:?}"
        );
    }
}

/// Whether `x` is one of `padding_value`'s marked values (NaN, infinity,
/// 1e4); a quarter of its draws are ordinary values.
fn marked_padding(x: f64) -> bool {
    x.is_nan() || x == f64::INFINITY || x == 1e4
}

/// A weight `[w, h]` over a vocabulary of `v`: asserts its real rows
/// finite; adds the first padding row's marked values and entries to
/// `tally` (`(marked, all)`).
fn tally_first_padding_row(weight: &Array2<f64>, v: usize, tally: &mut (usize, usize)) {
    for (j, row) in weight.rows().into_iter().enumerate() {
        if j < v {
            assert!(row.iter().all(|x| x.is_finite()), "real row {j} of {v}");
        } else if j == v {
            tally.1 += row.len();
            tally.0 += row.iter().filter(|&&x| marked_padding(x)).count();
        }
    }
}

/// The first padding rows' marked share, three quarters.
fn assert_padding_share((marked, all): (usize, usize)) {
    assert!(all >= 200, "only {all} first-padding-row entries");
    within_share("marked values in the first padding row", marked, all, 0.75);
}

/// `EmbeddingFuzzCase::arbitrary`, small cases over 1,500 byte strings:
/// every id is a class in `0..v` or one of the three out-of-range kinds
/// (`v`, `-1`, `i64::MAX`), each kind drawn; the in-range ids of a case are
/// spread (some case has several distinct ones); the weight's real rows are
/// finite and its first padding row holds `padding_value`'s marked values
/// three quarters of the time.
#[test]
fn embedding_cases_draw_every_id_kind_and_pad_only_padding_rows() {
    let mut kinds = BTreeSet::new();
    let (mut spread, mut padding) = (false, (0, 0));
    for s in 0..1500u64 {
        let data = bytes(s);
        if SizeClass::of(&data[..1]) != SizeClass::Small {
            continue;
        }
        let c = EmbeddingFuzzCase::arbitrary(&mut Unstructured::new(&data)).unwrap();
        let (map, ids, weight) = (&c.case.map, &c.case.ids, &c.case.weight);
        let v = map.vocab_size() as i64;
        let mut in_range = BTreeSet::new();
        for &id in ids {
            match id {
                x if (0..v).contains(&x) => {
                    in_range.insert(x);
                }
                x if x == v => {
                    kinds.insert("v");
                }
                -1 => {
                    kinds.insert("-1");
                }
                i64::MAX => {
                    kinds.insert("i64::MAX");
                }
                x => panic!("id {x} with v = {v}: {}", c.values),
            }
        }
        spread |= in_range.len() >= 2;
        tally_first_padding_row(weight, map.vocab_size(), &mut padding);
    }
    assert_eq!(kinds, ["-1", "i64::MAX", "v"].into());
    assert!(spread, "no case drew two distinct in-range ids");
    assert_padding_share(padding);
}

/// `LinearFuzzCase::arbitrary`: the weight's first padding row holds
/// `padding_value`'s marked values three quarters of the time (its real
/// rows are `gen`'s, finite).
#[test]
fn linear_cases_pad_only_the_padding_rows() {
    let mut padding = (0, 0);
    for s in 0..1500u64 {
        let data = bytes(s);
        if SizeClass::of(&data[..1]) != SizeClass::Small {
            continue;
        }
        let c = LinearFuzzCase::arbitrary(&mut Unstructured::new(&data)).unwrap();
        tally_first_padding_row(&c.case.weight, c.case.map.vocab_size(), &mut padding);
    }
    assert_padding_share(padding);
}

/// V6 in a large cross-entropy case: one row in 4 draws its byte from
/// `gen`, so whole shards are masked on `42 / 256 / 4` of the rows (a
/// large case has too many rows for the small cases' one in six).
#[test]
fn large_ce_cases_mask_whole_shards_of_one_row_in_24() {
    let (mut rows, mut masked) = (0, 0);
    for s in 0..1200u64 {
        let mut data = bytes(s);
        data[0] = u8::MAX - (s % 8) as u8; // a large case, several slots
        if SizeClass::of(&data[..1]) != SizeClass::Large {
            continue;
        }
        let c = CeFuzzCase::arbitrary(&mut Unstructured::new(&data)).unwrap();
        let (map, z) = (&c.case.map, &c.case.logits);
        let p = map.num_shards();
        // Shards of 8 real columns or more, no random -inf: a shard all
        // -inf is the plant.
        if p < 2 || c.values.contains(" logits -inf") || (0..p).any(|r| map.shard(r).real < 8) {
            continue;
        }
        for i in 0..z.nrows() {
            rows += 1;
            masked += usize::from((0..p).any(|r| {
                let sh = map.shard(r);
                (sh.start..sh.start + sh.real).all(|j| z[[i, j]] == f64::NEG_INFINITY)
            }));
        }
    }
    assert!(rows >= 5000, "only {rows} rows");
    within_share(
        "large rows with a shard masked",
        masked,
        rows,
        42.0 / 256.0 / 4.0,
    );
}

/// `plant_at` is the row-major unravelling of `at` modulo the cell count:
/// over three times the count, every `at` lands on the cell whose flat
/// index is `at % (rows cols)`, so every cell is reachable.
#[test]
fn plants_land_on_the_row_major_cell_of_their_index() {
    for (rows, cols) in [(1, 1), (3, 4), (4, 3), (7, 1), (1, 6), (5, 9)] {
        for at in 0..3 * rows * cols {
            let flat = at % (rows * cols);
            assert_eq!(
                plant_at(at, rows, cols),
                (flat / cols, flat % cols),
                "{rows} x {cols} at {at}"
            );
        }
    }
}

/// A linear case's plant choice byte: even into `hidden`, odd into
/// `weight`, `choice / 2 % 3` picks 100, -100, 0: bytes 0 to 5 give each
/// (tensor, value) pair once, 6 and 7 start again, 255 is `weight`, -100
/// (`127 % 3 = 1`). A stored input keeps its plant only while each byte
/// keeps its meaning.
#[test]
fn linear_plant_bytes_pick_the_tensor_by_parity_and_the_value_by_half() {
    let want = [
        (true, 100.0),
        (false, 100.0),
        (true, -100.0),
        (false, -100.0),
        (true, 0.0),
        (false, 0.0),
        (true, 100.0),
        (false, 100.0),
    ];
    for (choice, w) in (0u8..).zip(want) {
        assert_eq!(linear_plant(choice), w, "choice {choice}");
    }
    assert_eq!(linear_plant(255), (false, -100.0));
}

/// An embedding case's distinct ids are a prime stride (7,919) apart modulo
/// `v`: at `v = 1000` the first four are 0, 919, 838, 757 (not one run
/// of four rows); at `v = 50,000` the stride itself and, at 7, its wrap.
#[test]
fn embedding_ids_are_a_prime_stride_apart() {
    let ids: Vec<usize> = (0..4).map(|x| spread_id(x, 1000)).collect();
    assert_eq!(ids, [0, 919, 838, 757]);
    assert_eq!(spread_id(1, 50_000), 7919);
    assert_eq!(spread_id(7, 50_000), 5433);
}
