//! The sizes of an arbitrary attention case: heads, segment lengths (small,
//! short and long, at tile boundaries), and how they are fitted to the work
//! budget of a small or a large case.

use arbitrary::Unstructured;

use super::*;

/// `(h, h_kv)`: `h / h_kv` 1 (two in six), 2, 4, 8 or `h` (multi-query).
pub(super) fn heads(u: &mut Unstructured<'_>) -> arbitrary::Result<(usize, usize)> {
    let pick = |u: &mut Unstructured<'_>, from: &[usize]| -> arbitrary::Result<usize> {
        Ok(from[u.choose_index(from.len())?])
    };
    Ok(match u.arbitrary::<u8>()? % 6 {
        0 | 1 => {
            let h = pick(u, &[1, 2, 3, 4, 8])?;
            (h, h)
        }
        2 => {
            let h = pick(u, &[2, 4, 8])?;
            (h, h / 2)
        }
        3 => {
            let h = pick(u, &[4, 8])?;
            (h, h / 4)
        }
        4 => (8, 1),
        _ => (pick(u, &[2, 3, 4, 8])?, 1),
    })
}

/// A small segment side: 0, 1, 2 (one in eight each), a dozen or fewer
/// (two in eight), a 16/32 boundary up to [`SMALL_MAX_LEN`] (three in eight).
fn small_len(u: &mut Unstructured<'_>) -> arbitrary::Result<usize> {
    Ok(match u.arbitrary::<u8>()? % 8 {
        b @ 0..=2 => b as usize,
        3 | 4 => u.int_in_range(3..=12)?,
        _ => boundary_len(u, &[16, 32], SMALL_MAX_LEN)?,
    })
}

/// A short side of a large case: 0, 1 or 2 (one in eight each), else a
/// tile boundary up to [`LARGE_SHORT_LEN`].
fn short_len(u: &mut Unstructured<'_>) -> arbitrary::Result<usize> {
    Ok(match u.arbitrary::<u8>()? % 8 {
        b @ 0..=2 => b as usize,
        _ => boundary_len(u, &TILE_GRAINS, LARGE_SHORT_LEN)?,
    })
}

/// A long side: `k g - 1`, `k g` or `k g + 1` within [`LONG_LEN`].
fn long_len(u: &mut Unstructured<'_>) -> arbitrary::Result<usize> {
    let g = TILE_GRAINS[u.choose_index(TILE_GRAINS.len())?];
    let ks: Vec<usize> = (1..=LONG_LEN.end() / g)
        .filter(|k| k * g + 1 >= *LONG_LEN.start())
        .collect();
    let k = ks[u.choose_index(ks.len())?];
    let e = u.choose_index(3)?;
    Ok((k * g + e)
        .saturating_sub(1)
        .clamp(*LONG_LEN.start(), *LONG_LEN.end()))
}

/// One segment: `(side, side)`, or when `cross` two independent sides
/// (`draw` for each).
fn segment(
    u: &mut Unstructured<'_>,
    cross: bool,
    draw: fn(&mut Unstructured<'_>) -> arbitrary::Result<usize>,
) -> arbitrary::Result<(usize, usize)> {
    let lq = draw(u)?;
    Ok((lq, if cross { draw(u)? } else { lq }))
}

/// `segments` cut to fit `budget` units of work at `hd = h d` per query-key
/// pair: each segment that does not fit is shortened (its longer side; both
/// when square), the ones after it too.
fn fit(segments: &mut [(usize, usize)], hd: usize, budget: usize) {
    let mut left = budget / hd.max(1);
    for s in segments.iter_mut() {
        if s.0 * s.1 > left {
            match s.0.cmp(&s.1) {
                std::cmp::Ordering::Equal => {
                    let l = (left as f64).sqrt() as usize;
                    *s = (l, l);
                }
                std::cmp::Ordering::Greater => s.0 = left / s.1.max(1),
                std::cmp::Ordering::Less => s.1 = left / s.0.max(1),
            }
        }
        left -= s.0 * s.1;
    }
}

/// Sizes of a small case: segments and `d`.
pub(super) fn small_sizes(
    u: &mut Unstructured<'_>,
    h: usize,
    cross: bool,
) -> arbitrary::Result<(Vec<(usize, usize)>, usize)> {
    // Head dims past a 32-wide block that are not a multiple of it (40, 80,
    // 100) in a quarter of the small cases, a few tokens each (the work cap
    // cuts the segments): a kernel that sums `q . k` over whole blocks of 32
    // dims (the zoo's `head_dim_tail`) escaped every small case before.
    let d = [1, 2, 3, 4, 5, 6, 7, 8, 16, 40, 80, 100][u.choose_index(12)?];
    let b = u.int_in_range(1..=SMALL_MAX_SEGMENTS)?;
    let mut segments = (0..b)
        .map(|_| segment(u, cross, small_len))
        .collect::<arbitrary::Result<Vec<_>>>()?;
    fit(&mut segments, h * d, SMALL_MAX_WORK);
    Ok((segments, d))
}

/// The head dim of a large case at `slot`: `HEAD_DIMS[slot % 9]`, or an odd
/// one in `1..=201` (drawn) at class 8.
fn large_head_dim(u: &mut Unstructured<'_>, slot: usize) -> arbitrary::Result<usize> {
    Ok(match HEAD_DIMS.get(slot % HEAD_DIM_CLASSES) {
        Some(&d) => d,
        None => 2 * u.int_in_range(0..=100)? + 1,
    })
}

/// The segments of a large case cut to its budget at `hd = h d` per
/// query-key pair: the long one (`long`, its index) first, to its own
/// [`LONG_WORK`]; then the others, the least work first, to theirs and what
/// the long one left ([`LARGE_MAX_WORK`] in all), or to [`SHORT_WORK`] when
/// there is no long one. Each cut as [`fit`] cuts.
fn fit_large(segments: &mut [(usize, usize)], long: Option<usize>, hd: usize) {
    let mut order: Vec<usize> = (0..segments.len()).collect();
    order.sort_by_key(|&i| (Some(i) != long, segments[i].0 * segments[i].1));
    let mut sorted: Vec<(usize, usize)> = order.iter().map(|&i| segments[i]).collect();
    let budget = match long {
        Some(_) => {
            fit(&mut sorted[..1], hd, LONG_WORK);
            LARGE_MAX_WORK - sorted[0].0 * sorted[0].1 * hd
        }
        None => SHORT_WORK,
    };
    let rest = usize::from(long.is_some());
    fit(&mut sorted[rest..], hd, budget);
    for (&i, s) in order.iter().zip(sorted) {
        segments[i] = s;
    }
}

/// `(segments, d, (h, h_kv))` of a large case.
pub(super) type LargeSizes = (Vec<(usize, usize)>, usize, (usize, usize));

/// Sizes of a large case: segments, `d`, `(h, h_kv)` (see
/// [`AttentionFuzzCase`]). A long self-attention segment keeps its length:
/// its heads fall to `(1, 1)`, and `d` to what fits; a long cross segment
/// keeps the heads and `d` down to what fits; then the other segments are
/// cut to the budget left, the longest last ([`fit_large`]).
pub(super) fn large_sizes(
    u: &mut Unstructured<'_>,
    (h, h_kv): (usize, usize),
    cross: bool,
    slot: usize,
    forward_only: bool,
) -> arbitrary::Result<LargeSizes> {
    let mut d = large_head_dim(u, slot)?;
    // A head dim past 128 keeps its value: the long segment (which would cut
    // it to what fits, one dim or a few) is not drawn with it.
    let wide = d > 128;
    let short = u.int_in_range(1..=LARGE_MAX_SHORT)?;
    let mut segments = (0..short)
        .map(|_| segment(u, cross, short_len))
        .collect::<arbitrary::Result<Vec<_>>>()?;
    let mut heads = (h, h_kv);
    let mut long = None;
    // A forward-only case always has the long segment: a forward-only path
    // (split-KV decoding, a kernel without saved state) breaks across tiles.
    if (u.arbitrary::<u8>()? % 8 < 5 || forward_only) && !wide {
        let side = long_len(u)?;
        let pair = match (cross, u.arbitrary::<u8>()? % 3) {
            (true, 0) => (short_len(u)?.min(128), side),
            (true, 1) => (side, short_len(u)?.min(128)),
            _ => (side, side),
        };
        if pair.0 == pair.1 {
            heads = (1, 1);
        }
        // The largest head dim (of those drawn, then smaller ones) that fits.
        let most = LONG_WORK / (pair.0 * pair.1 * heads.0).max(1);
        if d > most {
            d = [256, 128, 96, 80, 64, 32, 16, 8, 5, 3, 2, 1]
                .into_iter()
                .find(|&x| x <= most)
                .unwrap_or(1);
        }
        let at = u.int_in_range(0..=segments.len())?;
        segments.insert(at, pair);
        long = Some(at);
    }
    fit_large(&mut segments, long, heads.0 * d);
    Ok((segments, d, heads))
}

#[cfg(test)]
mod tests {
    //! The size drawers' shares over every first byte (with a spread of
    //! second bytes): each bound is the expected share of the 256 first
    //! bytes (their `% 6` or `% 8` classes are within one byte of equal)
    //! give or take a twentieth.

    use super::*;

    /// `draw` over every (first byte, second byte) pair.
    fn over_bytes<T>(draw: impl Fn(&mut Unstructured<'_>) -> T) -> Vec<T> {
        let mut out = Vec::new();
        for b0 in 0..=u8::MAX {
            for b1 in 0..=u8::MAX {
                out.push(draw(&mut Unstructured::new(&[b0, b1, b1 ^ 0x5a, 7, 200])));
            }
        }
        out
    }

    fn share<T>(xs: &[T], f: impl Fn(&T) -> bool) -> f64 {
        xs.iter().filter(|x| f(x)).count() as f64 / xs.len() as f64
    }

    fn near(what: &str, got: f64, want: f64) {
        assert!(
            (got - want).abs() <= 0.05,
            "{what}: {got:.3}, expected {want:.3}"
        );
    }

    /// `heads`: `h / h_kv` 1 two in six, 2, 4 one in six each, `(8, 1)` one
    /// in six, `(h, 1)` for the other `h` one in six; every head count.
    #[test]
    fn heads_come_in_their_group_ratios() {
        let hs = over_bytes(|u| heads(u).unwrap());
        // The last arm's `(h, 1)` adds a quarter of a sixth to ratios 2, 4
        // and (8, 1), and gives ratio 3 alone.
        let extra = 1.0 / 24.0;
        near("h_kv = h", share(&hs, |&(h, k)| h == k), 2.0 / 6.0);
        near(
            "h / h_kv = 2",
            share(&hs, |&(h, k)| h == 2 * k),
            1.0 / 6.0 + extra,
        );
        near(
            "h / h_kv = 4",
            share(&hs, |&(h, k)| h == 4 * k),
            1.0 / 6.0 + extra,
        );
        near("(8, 1)", share(&hs, |&hk| hk == (8, 1)), 1.0 / 6.0 + extra);
        near("(3, 1)", share(&hs, |&hk| hk == (3, 1)), extra);
        let mut seen: Vec<usize> = hs.iter().map(|&(h, _)| h).collect();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen, [1, 2, 3, 4, 8]);
    }

    /// `small_len`: 0, 1, 2 one in eight each, 3 to 12 two in eight, a
    /// 16/32 boundary length (over 12, at most [`SMALL_MAX_LEN`]) the rest.
    #[test]
    fn small_sides_come_in_their_shares() {
        let ls = over_bytes(|u| small_len(u).unwrap());
        for l in 0..3 {
            near(&format!("side {l}"), share(&ls, |&x| x == l), 1.0 / 8.0);
        }
        near("3 to 12", share(&ls, |x| (3..=12).contains(x)), 2.0 / 8.0);
        assert!(ls.iter().all(|&x| x <= SMALL_MAX_LEN));
        assert!(ls.iter().any(|&x| x > 12 && x % 16 == 0));
    }

    /// `short_len`: 0, 1, 2 one in eight each, else a tile boundary length
    /// (over 2, at most [`LARGE_SHORT_LEN`]).
    #[test]
    fn short_sides_come_in_their_shares() {
        let ls = over_bytes(|u| short_len(u).unwrap());
        for l in 0..3 {
            near(&format!("side {l}"), share(&ls, |&x| x == l), 1.0 / 8.0);
        }
        assert!(ls.iter().all(|&x| x <= LARGE_SHORT_LEN));
        assert!(ls.iter().any(|&x| x > 64));
    }

    /// `long_len`: a multiple of a tile grain, one less or one more, within
    /// [`LONG_LEN`]; all three offsets drawn, and spread over the range.
    #[test]
    fn long_sides_sit_at_tile_boundaries() {
        let ls = over_bytes(|u| long_len(u).unwrap());
        let mut offsets = std::collections::BTreeSet::new();
        for &l in &ls {
            assert!(LONG_LEN.contains(&l), "{l}");
            let at = [l, l + 1, l - 1]
                .iter()
                .position(|&x| x % 16 == 0)
                .unwrap_or_else(|| panic!("{l} is not within one of a tile grain"));
            offsets.insert(at);
        }
        assert_eq!(offsets.len(), 3, "offsets drawn: {offsets:?}");
        let mut distinct = ls.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert!(distinct.len() >= 9, "only {distinct:?}");
    }

    /// `fit` keeps what fits and cuts the first segment that does not to the
    /// work left (a square one to `floor(sqrt(left))` a side, else its
    /// longer side to `left / shorter`), then every one after it to what
    /// that left; a side of 0 is no work, so it always fits.
    #[test]
    fn fit_cuts_the_first_segment_past_the_budget_and_the_rest_to_what_is_left() {
        // hd 2, budget 100: 50 pairs.
        let mut s = [
            (3, 3),  // 9, left 41
            (10, 2), // 20, left 21
            (20, 2), // 40 > 21: the longer side to 21 / 2 = 10, left 1
            (2, 20), // 40 > 1: the longer side to 1 / 2 = 0, left 1
            (9, 9),  // 81 > 1: 1 x 1, left 0
            (5, 1),  // 5 > 0: 0 x 1
            (0, 5),  // no work: kept
            (6, 0),  // kept
        ];
        fit(&mut s, 2, 100);
        assert_eq!(
            s,
            [
                (3, 3),
                (10, 2),
                (10, 2),
                (2, 0),
                (1, 1),
                (0, 1),
                (0, 5),
                (6, 0)
            ]
        );
        // A square one past the budget: floor(sqrt(50)) = 7 a side.
        let mut s = [(10, 10), (4, 4)];
        fit(&mut s, 1, 50);
        assert_eq!(s, [(7, 7), (1, 1)]);
        // Segments that fit exactly are kept, and so is every one after
        // them that has no work.
        let mut s = [(4, 8), (0, 7), (3, 0)];
        fit(&mut s, 3, 96);
        assert_eq!(s, [(4, 8), (0, 7), (3, 0)]);
    }

    /// `fit_large`: the long segment first to [`LONG_WORK`], then the
    /// others, the least work first, to what is left of
    /// [`LARGE_MAX_WORK`] ([`SHORT_WORK`] without a long one); every
    /// segment stays where it was.
    #[test]
    fn large_cases_cut_the_long_segment_first_then_the_least_work_first() {
        // hd 32: the long (37, 1100) is 40,700 of the 40,960 pairs of
        // LONG_WORK, so it is kept; the others get (1,835,008 - 40,700 x
        // 32) / 32 = 16,644 pairs: (200, 50) 10,000 kept, (120, 120) cut to
        // 81 x 81 (6,561 of 6,644), (300, 300) to 9 x 9 (81 of 83).
        let mut s = [(300, 300), (37, 1100), (120, 120), (200, 50)];
        fit_large(&mut s, Some(1), 32);
        assert_eq!(s, [(9, 9), (37, 1100), (81, 81), (200, 50)]);
        // Without a long one: 524,288 / 32 = 16,384 pairs; (200, 50) kept,
        // (120, 120) to 79 x 79 (6,241 of 6,384), (300, 300) to 11 x 11.
        let mut s = [(300, 300), (120, 120), (200, 50)];
        fit_large(&mut s, None, 32);
        assert_eq!(s, [(11, 11), (79, 79), (200, 50)]);
        // A long segment past its own budget: 655,360 pairs at hd 2, so
        // 809 x 809 (654,481); the 100 pairs after it fit in what is left.
        let mut s = [(1100, 1100), (10, 10)];
        fit_large(&mut s, Some(0), 2);
        assert_eq!(s, [(809, 809), (10, 10)]);
    }

    /// `small_sizes` keeps a small case's work `l_q l_k h d` within
    /// [`SMALL_MAX_WORK`] at every head count, and the cut reaches it: some
    /// draws at 8 heads use more than half of it.
    #[test]
    fn small_cases_keep_their_work_within_the_cap() {
        for h in [1, 3, 8] {
            let mut most = 0;
            for (i, data) in random_inputs(400, 64).iter().enumerate() {
                let (segments, d) = small_sizes(&mut Unstructured::new(data), h, i % 3 == 0)
                    .expect("bytes that run out read as zeros");
                let work = segments.iter().map(|&(q, k)| q * k).sum::<usize>() * h * d;
                assert!(work <= SMALL_MAX_WORK, "h {h}, d {d}, {segments:?}: {work}");
                most = most.max(work);
            }
            assert!(most * 2 > SMALL_MAX_WORK, "h {h}: at most {most}");
        }
    }

    /// `n` byte strings of `len` random bytes (ChaCha8, seed 30).
    fn random_inputs(n: usize, len: usize) -> Vec<Vec<u8>> {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(30);
        (0..n)
            .map(|_| (0..len).map(|_| rng.random::<u8>()).collect())
            .collect()
    }

    /// What one `large_sizes` draw is checked against: its arguments and
    /// the head dim its slot gives before any cut.
    struct LargeDraw {
        heads: (usize, usize),
        cross: bool,
        forward_only: bool,
        d0: usize,
        out: LargeSizes,
    }

    /// `large_sizes` on each input, the slot class, heads, cross and
    /// forward-only drawn beside it from the same stream.
    fn large_draws(n: usize, slot_of: impl Fn(usize) -> usize) -> Vec<LargeDraw> {
        const HEADS: [(usize, usize); 6] = [(1, 1), (2, 1), (3, 3), (4, 4), (8, 1), (8, 2)];
        random_inputs(n, 96)
            .iter()
            .enumerate()
            .map(|(i, data)| {
                let slot = slot_of(i);
                let (meta, data) = data.split_at(3);
                let heads = HEADS[usize::from(meta[0]) % HEADS.len()];
                let (cross, forward_only) = (meta[1] % 2 == 0, meta[2] % 4 == 0);
                let d0 = large_head_dim(&mut Unstructured::new(data), slot).expect("drawn");
                let out = large_sizes(
                    &mut Unstructured::new(data),
                    heads,
                    cross,
                    slot,
                    forward_only,
                )
                .expect("bytes that run out read as zeros");
                LargeDraw {
                    heads,
                    cross,
                    forward_only,
                    d0,
                    out,
                }
            })
            .collect()
    }

    /// The largest head dim a long pair `(l_q, l_k)` at `h` heads keeps:
    /// `d0` when it fits in [`LONG_WORK`], else the largest of 256, 128,
    /// 96, 80, 64, 32, 16, 8, 5, 3, 2, 1 that does.
    fn kept_head_dim(d0: usize, (lq, lk): (usize, usize), h: usize) -> usize {
        let fits = |d: usize| lq * lk * h * d <= LONG_WORK;
        if fits(d0) {
            return d0;
        }
        [256, 128, 96, 80, 64, 32, 16, 8, 5, 3, 2, 1]
            .into_iter()
            .find(|&d| fits(d))
            .unwrap_or(1)
    }

    /// `large_sizes` over 3,600 inputs (every slot class): a long segment
    /// (a side in [`LONG_LEN`], the only side past [`LARGE_SHORT_LEN`]) in
    /// five draws of eight, in every forward-only one, never with `d > 128`;
    /// a cross case's long pair is (short, long), (long, short) or (long,
    /// long) a third of the time each, its short side at most 128; a square
    /// long pair runs at one head, a cross one at the heads drawn; `d` the
    /// largest that fits the pair; the whole within [`LARGE_MAX_WORK`]
    /// ([`SHORT_WORK`] without a long one). Shares: +- 4 binomial sd.
    #[test]
    fn large_cases_draw_and_keep_a_long_segment_in_their_shares() {
        let draws = large_draws(3600, |i| i % HEAD_DIM_CLASSES);
        let (mut n, mut long_n) = (0, 0);
        let mut shapes = [0usize; 3]; // (short, long), (long, short), square
        for g in &draws {
            let (segments, d, heads) = &g.out;
            let longs: Vec<usize> = (0..segments.len())
                .filter(|&i| segments[i].0.max(segments[i].1) > LARGE_SHORT_LEN)
                .collect();
            assert!(longs.len() <= 1, "{segments:?}");
            let work = segments.iter().map(|&(q, k)| q * k).sum::<usize>() * heads.0 * d;
            let wide = g.d0 > 128;
            if !g.forward_only && !wide {
                n += 1;
                long_n += longs.len();
            }
            let Some(&at) = longs.first() else {
                assert!(
                    wide || !g.forward_only,
                    "forward only, d {}: no long segment",
                    g.d0
                );
                assert_eq!((*d, *heads), (g.d0, g.heads));
                assert!(work <= SHORT_WORK, "{segments:?} d {d}: {work}");
                continue;
            };
            assert!(!wide, "d {}: a long segment {:?}", g.d0, segments[at]);
            let (lq, lk) = segments[at];
            let long_side = |l: usize| LONG_LEN.contains(&l);
            if lq == lk {
                assert!(long_side(lq), "{:?}", segments[at]);
                assert_eq!(*heads, (1, 1), "square long pair {lq}");
                shapes[2] += usize::from(g.cross);
            } else {
                assert!(
                    g.cross,
                    "a cross long pair {:?} in a self case",
                    segments[at]
                );
                assert!(
                    (long_side(lk) && lq <= 128) || (long_side(lq) && lk <= 128),
                    "{:?}",
                    segments[at]
                );
                assert_eq!(*heads, g.heads, "cross long pair {:?}", segments[at]);
                shapes[usize::from(lk <= 128)] += 1;
            }
            assert_eq!(
                *d,
                kept_head_dim(g.d0, (lq, lk), heads.0),
                "d0 {}, long pair {:?} at {} heads",
                g.d0,
                segments[at],
                heads.0
            );
            assert!(work <= LARGE_MAX_WORK, "{segments:?} d {d}: {work}");
        }
        within(n, long_n, 5.0 / 8.0, "draws with a long segment");
        let cross_n: usize = shapes.iter().sum();
        for (what, k) in ["(short, long)", "(long, short)", "square"]
            .iter()
            .zip(shapes)
        {
            within(cross_n, k, 1.0 / 3.0, what);
        }
    }

    /// An odd head dim (class 8) that is exactly the most a cross long pair
    /// allows (`LONG_WORK / (l_q l_k h)`, rounded down) fits, so it is
    /// kept: checked on the first 8 such draws among 40,000.
    #[test]
    fn an_odd_head_dim_that_just_fits_the_long_pair_is_kept() {
        let mut hits = 0;
        for g in large_draws(40_000, |_| 8) {
            let (segments, d, heads) = &g.out;
            let Some(&(lq, lk)) = segments.iter().find(|s| s.0.max(s.1) > LARGE_SHORT_LEN) else {
                continue;
            };
            if LONG_WORK / (lq * lk * heads.0).max(1) == g.d0 {
                assert_eq!(*d, g.d0, "long pair ({lq}, {lk}) at {} heads", heads.0);
                hits += 1;
                if hits == 8 {
                    return;
                }
            }
        }
        panic!("only {hits} draws fit their odd head dim exactly");
    }

    /// `k` of `n` within 4 binomial standard deviations of `n p`.
    fn within(n: usize, k: usize, p: f64, what: &str) {
        let sd = (n as f64 * p * (1.0 - p)).sqrt();
        assert!(
            (k as f64 - n as f64 * p).abs() <= 4.0 * sd + 1.0,
            "{what}: {k} of {n}, expected {:.0} +- {:.0}",
            n as f64 * p,
            4.0 * sd
        );
    }
}
