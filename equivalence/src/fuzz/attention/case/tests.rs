//! The attention case's option drawers draw what their docs promise, from
//! the bytes their docs name: a stored fuzz input keeps meaning its case
//! only while each byte keeps meaning its option.

use super::*;

/// `window_side` over every byte: the low four bits pick the side, 0..=11
/// one of the twelve tile-boundary sides, 12 past the longest segment, 13 to
/// 15 unbounded; so each bounded side comes 16 times in 256, unbounded 48.
#[test]
fn window_sides_come_from_the_low_four_bits() {
    const LONGEST: usize = 100;
    let side = |b: u8| window_side(&mut Unstructured::new(&[b]), LONGEST).unwrap();
    let mut counts = std::collections::BTreeMap::new();
    for b in 0..=u8::MAX {
        *counts.entry(side(b)).or_insert(0) += 1;
    }
    let mut want: std::collections::BTreeMap<Option<usize>, usize> =
        [0, 1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65, LONGEST + 3]
            .into_iter()
            .map(|s| (Some(s), 16))
            .collect();
    want.insert(None, 48);
    assert_eq!(counts, want);
    // The high bits do not matter: 0x02, 0x12, 0xf2 are all side 2; 0x1c
    // is past the longest segment; 0x0b is 65; 0x1d unbounded.
    for (b, s) in [(0x02, Some(2)), (0x12, Some(2)), (0xf2, Some(2))] {
        assert_eq!(side(b), s, "byte {b:#x}");
    }
    assert_eq!(side(0x1c), Some(LONGEST + 3));
    assert_eq!(side(0x0b), Some(65));
    assert_eq!(side(0x1d), None);
}

/// `options`: a first byte without its high bit draws nothing; with it, its
/// bits 0 to 3 turn on the window, the softcap, ALiBi and `seqused_k`, each
/// independently of the others.
#[test]
fn option_bits_turn_on_their_options_alone() {
    let segments = [(5, 7), (3, 3)];
    for which in 0..=u8::MAX {
        // Bytes after `which`: 0x21 (side 1), 0x42 (side 2 / softcap 1), odd
        // cuts, ALiBi's standard slopes (the bool byte 0x01) ...
        let mut data = vec![which];
        data.extend([0x21, 0x42, 0x03, 0x01, 0x05, 0x07, 0x09]);
        let o = options(&mut Unstructured::new(&data), &segments, 2).unwrap();
        let on = |bit: u8| which & 0x80 != 0 && which & bit != 0;
        assert_eq!(
            o.window != Window::UNBOUNDED,
            on(1),
            "window, which {which:#x}"
        );
        assert_eq!(o.softcap != 0.0, on(2), "softcap, which {which:#x}");
        assert_eq!(o.alibi_slopes.is_some(), on(4), "alibi, which {which:#x}");
        assert_eq!(o.seqused_k.is_some(), on(8), "seqused_k, which {which:#x}");
    }
}

/// The drawn values: every softcap of the five; ALiBi's standard slopes
/// (Press et al.) or drawn ones in `[-1, 3)`; `seqused_k` the whole segment
/// on an even byte, else fewer keys (never more than the segment has).
#[test]
fn option_values_reach_every_cap_both_slope_kinds_and_cut_keys() {
    let mut caps = Vec::new();
    for b in 0..5u8 {
        let o = options(&mut Unstructured::new(&[0x82, b]), &[(4, 4)], 1).unwrap();
        caps.push(o.softcap);
    }
    caps.sort_by(f64::total_cmp);
    assert_eq!(caps, [0.5, 1.0, 5.0, 30.0, 50.0]);
    let standard = options(&mut Unstructured::new(&[0x84, 1]), &[(4, 4)], 4).unwrap();
    assert_eq!(
        standard.alibi_slopes.unwrap(),
        [0.25, 0.0625, 0.015625, 0.00390625]
    );
    let drawn = options(&mut Unstructured::new(&[0x84, 0, 0, 64, 255]), &[(4, 4)], 3).unwrap();
    assert_eq!(drawn.alibi_slopes.unwrap(), [-1.0, 0.0, 255.0 / 64.0 - 1.0]);
    let used = options(
        &mut Unstructured::new(&[0x88, 4, 7, 3]),
        &[(2, 9), (1, 9), (1, 2)],
        1,
    )
    .unwrap()
    .seqused_k
    .unwrap();
    // 4: even, all 9; 7: 9 - 3 % 10 = 6; 3: 2 - 1 % 3 = 1.
    assert_eq!(used, [9, 6, 1]);
}

/// `malform(cu, how)` breaks `cu` the way `how % 4` says, and the reference
/// refuses the result: 0 starts at 1, 1 has a decrease (where `cu` rises
/// at all), 2 ends one past the token count, 3 is empty.
#[test]
fn malform_breaks_offsets_the_way_its_byte_says() {
    use packshard_reference::attention::check_cu_seqlens;
    for cu in [
        vec![0, 3, 7],
        vec![0, 0, 5],
        vec![0, 5],
        vec![0, 2, 2, 9],
        vec![0, 0],
    ] {
        let total = *cu.last().expect("non-empty");
        for how in 0..16u8 {
            let bad = malform(cu.clone(), how);
            assert!(
                check_cu_seqlens(&bad, total).is_err(),
                "{cu:?} how {how}: {bad:?} accepted"
            );
            let rises = cu.windows(2).any(|w| w[1] > w[0]);
            match how % 4 {
                0 => assert_eq!((bad[0], bad.len()), (1, cu.len()), "{cu:?} how {how}"),
                1 if rises => {
                    assert!(
                        bad.windows(2).any(|w| w[1] < w[0]),
                        "{cu:?} how {how}: {bad:?} has no decrease"
                    );
                    // A rise before the last offset: the count is kept.
                    let early = cu[..cu.len() - 1].windows(2).any(|w| w[1] > w[0]);
                    if early {
                        assert_eq!(bad.len(), cu.len(), "{cu:?} how {how}: {bad:?}");
                    }
                }
                1 => assert_eq!(bad.last(), Some(&(total + 1)), "{cu:?} how {how}"),
                2 => {
                    assert_eq!(bad.last(), Some(&(total + 1)), "{cu:?} how {how}");
                    assert_eq!(bad[..cu.len() - 1], cu[..cu.len() - 1]);
                }
                _ => assert!(bad.is_empty(), "{cu:?} how {how}: {bad:?}"),
            }
        }
    }
}

/// `AttentionFuzzCase::arbitrary` over 1,500 small inputs: cross attention
/// a third of the time; the scale 1, 1/8, 2, 0.01 a sixteenth each and
/// `1/sqrt(d)` the rest, half of that flash-attention's default; plants of
/// both signs, 100 and 30.
#[test]
fn small_attention_cases_draw_cross_scales_and_plants_in_their_shares() {
    use crate::fuzz::schedule::{budgeted_input, Budget};
    let (mut n, mut cross, mut defaults) = (0usize, 0, 0);
    let mut scales = [0usize; 5]; // 1, 0.125, 2, 0.01, 1/sqrt(d)
    let mut plants = std::collections::BTreeSet::new();
    let (mut malformed, mut keys, mut cross_malformed) = (0, 0, 0);
    for s in 0..1500u64 {
        let data = budgeted_input(&Budget::small(1), s, 0);
        let c = AttentionFuzzCase::arbitrary(&mut Unstructured::new(&data)).unwrap();
        if c.class != SizeClass::Small {
            continue;
        }
        n += 1;
        let is_cross = c.segments.iter().any(|&(q, k)| q != k);
        cross += usize::from(is_cross);
        match c.malformed {
            Some(Malformed::Keys(how)) => {
                assert!(is_cross && how & 4 != 0, "keys broken in {:?}", c.segments);
                keys += 1;
                cross_malformed += 1;
                malformed += 1;
            }
            Some(Malformed::Queries(_)) => {
                cross_malformed += usize::from(is_cross);
                malformed += 1;
            }
            None => {}
        }
        let d = c.q.dim().2 as f64;
        let at = [1.0, 0.125, 2.0, 0.01]
            .iter()
            .position(|&x| x == c.scale && x != 1.0 / d.sqrt())
            .unwrap_or(4);
        scales[at] += 1;
        if c.default_scale {
            assert_eq!(c.scale, 1.0 / d.sqrt(), "a default scale is 1/sqrt(d)");
            defaults += 1;
        }
        if let Some((_, list)) = c.values.split_once("; planted ") {
            for item in list.split("] = ").skip(1) {
                plants.insert(item.split(',').next().expect("a value").to_string());
            }
        }
    }
    assert!(n >= 1000, "only {n} small cases");
    // Cross attention needs a segment with l_q != l_k: a few cross draws
    // come out square, so the share is at most a third.
    assert!(cross <= n / 3 + 4 * (n as f64 * 2.0 / 9.0).sqrt() as usize + 1);
    assert!(cross * 4 >= n, "{cross} of {n} cases cross");
    // 1/sqrt(d) can equal 1 (d = 1) or 1/8 (d = 64): count those as drawn.
    for (what, k) in [
        ("1", scales[0]),
        ("0.125", scales[1]),
        ("2", scales[2]),
        ("0.01", scales[3]),
    ] {
        assert!(k * 32 >= n && k * 10 <= n, "scale {what}: {k} of {n}");
    }
    assert!(scales[4] * 2 >= n, "1/sqrt(d): {} of {n}", scales[4]);
    within_share_of("default scales", defaults, n, 0.25);
    // One case in 16 malformed; a cross case breaks its keys half the time.
    within_share_of("malformed cases", malformed, n, 1.0 / 16.0);
    assert!(
        cross_malformed >= 8,
        "only {cross_malformed} cross cases malformed"
    );
    within_share_of("cross cases breaking keys", keys, cross_malformed, 0.5);
    for x in ["100", "-100", "30", "-30", "0"] {
        assert!(plants.contains(x), "no plant of {x}: {plants:?}");
    }
}

/// `count` of `n` within 4 binomial standard deviations of `n p`.
fn within_share_of(what: &str, count: usize, n: usize, p: f64) {
    let sd = (n as f64 * p * (1.0 - p)).sqrt();
    assert!(
        (count as f64 - n as f64 * p).abs() <= 4.0 * sd + 1.0,
        "{what}: {count} of {n}, expected {:.0} +- {:.0}",
        n as f64 * p,
        4.0 * sd
    );
}

/// `plant_index` is the row-major unravelling of `at` modulo the element
/// count: over three times the count, every `at` lands on the element whose
/// row-major flat index is `at % len`, so every element is reachable.
#[test]
fn plants_land_on_the_row_major_element_of_their_index() {
    for dim in [(2, 3, 4), (3, 2, 1), (1, 1, 5), (4, 1, 3), (5, 6, 2)] {
        let (n, th, d) = dim;
        let len = n * th * d;
        let flat = Array3::from_shape_fn(dim, |(i, a, e)| (i * th + a) * d + e);
        for at in 0..3 * len {
            assert_eq!(flat[plant_index(at, dim)], at % len, "{dim:?} at {at}");
        }
    }
}

/// The large forward-only cases (slots 1, 4, 10 modulo 12) never draw
/// constant values (every key tile would have the same row maximum, so
/// nothing rescales), and keep the grid style they draw: of 64 such cases,
/// none constant, and grid values in some (2 in 8 of the draws: at least
/// one of 64 but for a chance of `(3/4)^64`, about 1e-8).
#[test]
fn large_forward_only_cases_never_draw_constant_values() {
    use crate::fuzz::schedule::{budgeted_input, Budget, LARGE_FROM};
    let (mut grid, mut n) = (0, 0);
    for s in 0..64u64 {
        let mut data = budgeted_input(&Budget::small(1), 300 + s, 0);
        data[0] = LARGE_FROM | [1u8, 4, 10][s as usize % 3];
        let c = AttentionFuzzCase::from_bytes(&data).unwrap();
        assert!(!c.want_grad, "slot {} is forward only", data[0] & 0x1f);
        assert!(!c.values.starts_with("Constant"), "{}", c.values);
        grid += usize::from(c.values.starts_with("Grid"));
        n += 1;
    }
    assert!(grid >= 1, "no grid values in {n} forward-only cases");
}

/// The scale byte's low four bits pick the scale (the high ones do not
/// matter): 0 gives 1 (0x10 and 0xf0 too), 1 to 3 give 1/8, 2, 0.01; 4 to 7
/// (0x14 too) `1/sqrt(d)` left to the kernel's default; 8 to 15 (0xff too)
/// `1/sqrt(d)` given.
#[test]
fn scale_bytes_pick_the_scale_by_their_low_four_bits() {
    let d = 16; // 1/sqrt(d) = 0.25
    for (b, want) in [
        (0x00, (1.0, false)),
        (0x10, (1.0, false)),
        (0xf0, (1.0, false)),
        (0x01, (0.125, false)),
        (0x21, (0.125, false)),
        (0x02, (2.0, false)),
        (0x03, (0.01, false)),
        (0x04, (0.25, true)),
        (0x07, (0.25, true)),
        (0x14, (0.25, true)),
        (0x08, (0.25, false)),
        (0x0f, (0.25, false)),
        (0xff, (0.25, false)),
    ] {
        assert_eq!(scale_of(b, d), want, "byte {b:#x}");
    }
}

/// The malformation byte's low four bits: all set (0x0f, 0x1f, 0xff) asks
/// for malformed offsets, anything else (0x00, 0x0e, 0xf0, 0xfe) not; 16
/// bytes of 256.
#[test]
fn malformation_bytes_have_their_low_four_bits_set() {
    for b in [0x0f, 0x1f, 0xff] {
        assert!(malformed_byte(b), "byte {b:#x}");
    }
    for b in [0x00, 0x0e, 0xf0, 0xfe] {
        assert!(!malformed_byte(b), "byte {b:#x}");
    }
    assert_eq!((0..=u8::MAX).filter(|&b| malformed_byte(b)).count(), 16);
}

/// A plant's choice byte: `choice % 4` picks `q`, `k`, `v`, `grad_output`
/// and `choice / 4 % 5` the value: 0 to 3 plant 100 in each, 4 to 7 -100,
/// 8 to 11 30, 12 to 15 -30, 16 to 19 0; 20 starts again; 255 is -30 in
/// `grad_output` (`63 % 5 = 3`).
#[test]
fn plant_choice_bytes_pick_the_tensor_and_the_value() {
    for c in 0..20u8 {
        let value = [100.0, -100.0, 30.0, -30.0, 0.0][usize::from(c / 4)];
        assert_eq!(plant_choice(c), (usize::from(c % 4), value), "choice {c}");
    }
    assert_eq!(plant_choice(20), (0, 100.0));
    assert_eq!(plant_choice(255), (3, -30.0));
}
