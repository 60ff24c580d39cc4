//! One (query block, key tile) of an item, shared by the forward and the
//! backward: which keys of the tile a block's queries see, and the scores
//! with flash-attention's transforms and the mask.
//!
//! Tiles are transposed, `[BLOCK_K, BLOCK_Q]`: key `k0 + j` down (row `j`),
//! query `q0 + r` of the block across (column `r`, the SIMD lanes), so that
//! everything per query (the softmax's maximum and sum, `lse`, `delta`) is a
//! lane-wise vector and no tile is ever transposed.

use super::*;

/// The keys of the tile at `k0` that some query of the block may see are
/// among its first `tile_keys(keys, k0)` (at least 1, at most [`BLOCK_K`]),
/// `keys` the block's [`Item::block_keys`]; the scores of the others are
/// masked, their probabilities exact zeros. The per-tile key range of the
/// forward and the backward: which tiles are visited at all is
/// [`Item::tiles`] of the same range.
#[inline(always)]
pub(super) fn tile_keys(keys: &Range<usize>, k0: usize) -> usize {
    keys.end.saturating_sub(k0).clamp(1, BLOCK_K)
}

/// The keys each query of a block may see ([`Item::key_range`]), one lane
/// per query: `lo[r]..hi[r]` as `f32` (exact below 2^24; padding queries
/// `0..0`), and how the tiles' scores are masked.
pub(super) struct BlockKeys {
    pub(super) lo: [f32; BLOCK_Q],
    pub(super) hi: [f32; BLOCK_Q],
    /// The largest `lo` and the smallest `hi` of the block's real queries.
    lo_max: usize,
    hi_min: usize,
    /// Whether the scores can be masked lane-wise ([`Prepare::Mask`]): a
    /// segment item with no transform, keys below 2^24, no planted fault.
    vector: bool,
}

/// What the scaled products `scale K Q^T` of a tile need to become scores.
#[derive(Clone, Copy, PartialEq)]
pub(super) enum Prepare {
    /// Each (key, query) outside the query's `lo..hi` set to `-inf`
    /// (lane-wise, [`masked`]).
    Mask,
    /// Nothing: every query of the block sees every key of the tile, or
    /// [`scores_scalar`] ran.
    Done,
}

impl BlockKeys {
    /// The bounds of the block at `q0` (its first `rows` queries real).
    pub(super) fn new(it: &Item, q0: usize, rows: usize) -> Self {
        let mut b = BlockKeys {
            lo: [0.0; BLOCK_Q],
            hi: [0.0; BLOCK_Q],
            lo_max: 0,
            hi_min: usize::MAX,
            vector: matches!(it.mask, Mask::Segment { .. })
                && it.transform.is_identity()
                && it.k_len < 1 << 24
                && !has_fault(it),
        };
        for r in 0..rows {
            let keys = it.key_range(q0 + r);
            (b.lo[r], b.hi[r]) = (keys.start as f32, keys.end as f32);
            (b.lo_max, b.hi_min) = (b.lo_max.max(keys.start), b.hi_min.min(keys.end));
        }
        b
    }

    /// How the tile at `k0` (its first `kn` keys) is masked: lane-wise, not
    /// at all (every query sees every key), or one score at a time by
    /// [`scores_scalar`] (which this runs; `chain` as there).
    pub(super) fn prepare(
        &self,
        s: &mut [f32],
        it: &Item,
        (q0, k0, kn, rows): (usize, usize, usize, usize),
        chain: Option<&mut [f32]>,
    ) -> Prepare {
        if !self.vector {
            scores_scalar(s, it, (q0, k0, kn, rows), chain);
            Prepare::Done
        } else if self.lo_max <= k0 && k0 + kn <= self.hi_min {
            Prepare::Done
        } else {
            Prepare::Mask
        }
    }
}

/// The vector of `x` at `at` (`S::F32_LANES` elements): a block's lanes of
/// a per-query array or of a tile row.
#[inline(always)]
pub(super) fn lanes_at<S: Simd>(x: &[f32], at: usize) -> S::f32s {
    S::as_simd_f32s(&x[at..at + S::F32_LANES]).0[0]
}

/// The score `y` of key `key` for the lanes `g..` of a block, `-inf` where
/// the lane's query may not see it (`b`'s bounds).
#[inline(always)]
pub(super) fn masked<S: Simd>(simd: S, b: &BlockKeys, g: usize, key: usize, y: S::f32s) -> S::f32s {
    let (lo, hi) = (lanes_at::<S>(&b.lo, g), lanes_at::<S>(&b.hi, g));
    let key = simd.splat_f32s(key as f32);
    let seen = simd.and_m32s(
        simd.less_than_or_equal_f32s(lo, key),
        simd.less_than_f32s(key, hi),
    );
    simd.select_f32s(seen, y, simd.splat_f32s(f32::NEG_INFINITY))
}

/// Whether the tests plant a fault in `it` that [`scores_scalar`] applies
/// (the cap after the mask, W4).
#[inline(always)]
fn has_fault(it: &Item) -> bool {
    #[cfg(test)]
    return tests_faults::cap_after_mask(it);
    #[cfg(not(test))]
    {
        let _ = it;
        false
    }
}

/// The [`Transform`] of one scaled score `x` of query `i` and key `key` (of
/// the item), before the mask: the score and `d score / d raw`, `1 -
/// tanh(raw / softcap)^2` where a cap applies (1 otherwise). The same f32
/// formulas as `crate::attention::mask::SegmentMask::score` and `chain`.
#[inline(always)]
pub(super) fn transformed(it: &Item, (i, key): (usize, usize), x: f32) -> (f32, f32) {
    let Transform {
        softcap,
        slope,
        offsets,
        ..
    } = it.transform;
    let (mut x, mut chain) = (x, 1.0);
    if softcap > 0.0 {
        let t = (x / softcap).tanh();
        x = softcap * t;
        chain = 1.0 - t * t;
    }
    if let Some(slope) = slope {
        // The diagonal of query i: key i + k_len - q_len.
        let diag = i as i64 + offsets.map_or(it.k_len as i64 - it.q_len as i64, |o| o[i]);
        let dist = (diag - key as i64).unsigned_abs();
        x -= slope * dist as f32;
    }
    (x, chain)
}

/// The scores of a tile where the item transforms them, masks them densely
/// or carries a planted fault: `s: [BLOCK_K, BLOCK_Q]` (`S^T`, keys `k0..k0
/// + kn` down, the block's first `rows` queries across), already scaled,
/// changed by the [`Transform`] ([`transformed`]) and then masked, one
/// score at a time; the lanes of padding queries masked. `chain` (the
/// backward's, `[BLOCK_K, BLOCK_Q]`) gets `d score / d raw`.
fn scores_scalar(
    s: &mut [f32],
    it: &Item,
    (q0, k0, kn, rows): (usize, usize, usize, usize),
    mut chain: Option<&mut [f32]>,
) {
    let mask_first = has_fault(it);
    // Query by query (a dense mask's row read in order, a segment's key
    // range found once), writing down the tile's column.
    for r in 0..rows {
        let i = q0 + r;
        let keys = it.key_range(i);
        for j in 0..kn {
            let key = k0 + j;
            let seen = match it.mask {
                Mask::Segment { .. } => keys.contains(&key),
                Mask::Dense(allowed) => i < it.q_len && key < it.k_len && allowed[[i, key]],
            };
            let x = &mut s[j * BLOCK_Q + r];
            if mask_first && !seen {
                *x = f32::NEG_INFINITY;
            }
            if !it.transform.is_identity() {
                let (y, dy) = transformed(it, (i, key), *x);
                *x = y;
                if let Some(c) = chain.as_deref_mut() {
                    c[j * BLOCK_Q + r] = dy;
                }
            }
            if !seen && !mask_first {
                *x = f32::NEG_INFINITY;
            }
        }
    }
    for j in 0..kn {
        s[j * BLOCK_Q + rows..(j + 1) * BLOCK_Q].fill(f32::NEG_INFINITY);
    }
}
