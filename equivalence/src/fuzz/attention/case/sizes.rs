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
            if s.0 == s.1 {
                let l = (left as f64).sqrt() as usize;
                *s = (l, l);
            } else if s.0 > s.1 {
                s.0 = left / s.1.max(1);
            } else {
                s.1 = left / s.0.max(1);
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

/// `(segments, d, (h, h_kv))` of a large case.
pub(super) type LargeSizes = (Vec<(usize, usize)>, usize, (usize, usize));

/// Sizes of a large case: segments, `d`, `(h, h_kv)` (see
/// [`AttentionFuzzCase`]). A long self-attention segment keeps its length:
/// its heads fall to 2 (a grouped case) or 1, and `d` to what fits; a long
/// cross segment keeps `d` down to what fits; then the other segments are
/// cut to the budget left, the longest last.
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
    // Cut to the budget: the long segment first (to its own), then the
    // others, shortest first (to theirs and what the long one left).
    let mut order: Vec<usize> = (0..segments.len()).collect();
    order.sort_by_key(|&i| (Some(i) != long, segments[i].0 * segments[i].1));
    let mut sorted: Vec<(usize, usize)> = order.iter().map(|&i| segments[i]).collect();
    let hd = heads.0 * d;
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
}
