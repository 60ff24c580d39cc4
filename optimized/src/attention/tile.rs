//! One (query block, key tile) of an item: the key panels, the scores with
//! flash-attention's transforms and the mask, and the `x y^T` tile product
//! the forward and the backward share.

use super::*;

/// The key tile at `k0` of [`gather_t_into`]'s panels: `[dp, BLOCK_K]`, row
/// stride [`BLOCK_K`].
#[inline(always)]
pub(super) fn key_panel(kt: &[f32], k0: usize, dp: usize) -> (&[f32], usize) {
    (&kt[k0 * dp..(k0 + BLOCK_K) * dp], BLOCK_K)
}

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

/// Sets the scores of keys a query may not see to `-inf` (after scaling
/// and the [`Transform`]): `s: [BLOCK_Q, BLOCK_K]` for queries `q0..` and
/// keys `k0..` of the item.
fn apply_mask(s: &mut [f32], it: &Item, q0: usize, k0: usize) {
    for r in 0..BLOCK_Q {
        let i = q0 + r;
        let row = &mut s[r * BLOCK_K..(r + 1) * BLOCK_K];
        match it.mask {
            Mask::Segment { .. } => {
                let keys = it.key_range(i);
                let end = keys.end.saturating_sub(k0).min(BLOCK_K);
                let start = keys.start.saturating_sub(k0).min(end);
                row[..start].fill(f32::NEG_INFINITY);
                row[end..].fill(f32::NEG_INFINITY);
            }
            Mask::Dense(allowed) => {
                for (j, x) in row.iter_mut().enumerate() {
                    let key = k0 + j;
                    if i >= it.q_len || key >= it.k_len || !allowed[[i, key]] {
                        *x = f32::NEG_INFINITY;
                    }
                }
            }
        }
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

/// The [`Transform`] of the scaled scores `s: [BLOCK_Q, BLOCK_K]` of
/// queries `q0..` over keys `k0..` (the first `cols` of each row, the real
/// queries only), before the mask ([`transformed`]); `chain` (the
/// backward's) gets `d score / d raw` where a cap applies.
fn transform_scores(
    s: &mut [f32],
    it: &Item,
    (q0, k0, cols): (usize, usize, usize),
    mut chain: Option<&mut [f32]>,
) {
    let capped = it.transform.softcap > 0.0;
    for r in 0..BLOCK_Q.min(it.q_len.saturating_sub(q0)) {
        for j in 0..cols {
            let x = &mut s[r * BLOCK_K + j];
            let (y, dy) = transformed(it, (q0 + r, k0 + j), *x);
            *x = y;
            if let (true, Some(c)) = (capped, chain.as_deref_mut()) {
                c[r * BLOCK_K + j] = dy;
            }
        }
    }
}

/// `out: [BLOCK_Q, BLOCK_K] += x y^T` for the row block `x: [BLOCK_Q, dp]`
/// and the key block of `y^T` (a [`key_panel`]: row stride `ld`, its first
/// column the block's first key): the forward's `Q K^T`, the backward's `dO
/// V^T`. Only the first `rows` rows (rounded up to 4) and `cols` columns (a
/// multiple of the vector width) are computed; the rest of `out` is left as
/// it is.
#[inline(always)]
pub(super) fn acc_by_transposed<S: Simd>(
    simd: S,
    (x, rows): (&[f32], usize),
    (yt, ld, cols): (&[f32], usize, usize),
    dp: usize,
    out: &mut [f32],
) {
    let m = round_up(rows.min(BLOCK_Q), 4);
    mm_acc(simd, m, cols, dp, x, dp, yt, ld, out, BLOCK_K);
}

/// `S = scale Q_blk K_tile^T` with the mask: `s: [BLOCK_Q, BLOCK_K]`
/// (`kt` the key panels of [`gather_t_into`]). Rows of the block past the item's
/// queries are 0 (as the zero rows of `Q` would give), not computed.
///
/// `cols`: the scores of keys `k0 + cols..` (a multiple of the vector width)
/// are not computed either: they are 0 before the mask, which must hide them
/// from every query of the block (the forward's `tile_keys`).
///
/// `chain`: where the item caps its scores, the backward's buffer of `d
/// score / d raw` ([`transform_scores`]).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) fn scores<S: Simd>(
    simd: S,
    s: &mut [f32],
    qh: &[f32],
    kt: &[f32],
    dp: usize,
    it: &Item,
    (q0, k0, cols): (usize, usize, usize),
    scale: f32,
    chain: Option<&mut [f32]>,
) {
    s.fill(0.0);
    let rows = it.q_len - q0;
    let (panel, ld) = key_panel(kt, k0, dp);
    acc_by_transposed(simd, (&qh[q0 * dp..], rows), (panel, ld, cols), dp, s);
    simd::scale(simd, scale, s);
    #[cfg(test)]
    if tests_faults::cap_after_mask(it) {
        apply_mask(s, it, q0, k0);
        return transform_scores(s, it, (q0, k0, cols), chain);
    }
    if !it.transform.is_identity() {
        transform_scores(s, it, (q0, k0, cols), chain);
    }
    apply_mask(s, it, q0, k0);
}
