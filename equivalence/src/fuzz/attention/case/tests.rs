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
