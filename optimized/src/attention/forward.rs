//! The forward of one work item (FlashAttention-2's Algorithm 1) over the
//! tiles of [`super`].
//!
//! Where the time goes, and what this file does about it (issue 37):
//! - the two tile products (`Q K^T`, `P V`) are most of the work: the keys
//!   are read as contiguous [`super::key_panel`]s, and only the rows and keys
//!   that exist are multiplied (a block's rows rounded up to 4, a tile's keys
//!   to those some query of the block may see: [`tile_keys`]), where the
//!   fixed 64 x 64 tiles multiplied the zero padding of every segment's last
//!   block and tile too;
//! - the online softmax takes each score row once for its maximum and once
//!   for `exp(s - m)` and its sum ([`exp_row_sum`], one pass).
//!
//! None of this changes a result's bits: each output element is still
//! accumulated over the same terms in the same order (the terms left out are
//! exact zeros added at the end), so the varlen and dense forms stay bitwise
//! equal (module docs of [`super`]).

use super::disjoint::Disjoint;
use super::*;

/// Row `row` of a score tile (scaled and masked) becomes `exp(row - m)`;
/// returns its sum. Summed lane-wise in order, then across the lanes: the
/// bits of `simd::map_in_place` followed by `simd::sum` over the whole tile
/// row (`row` is whole vectors; the vectors past it hold `-inf` scores, whose
/// exact zeros change neither the sum nor the maximum).
#[inline(always)]
fn exp_row_sum<S: Simd>(simd: S, row: &mut [f32], m: f32) -> f32 {
    let shift = simd.splat_f32s(m);
    let (head, tail) = S::as_mut_simd_f32s(row);
    debug_assert!(tail.is_empty());
    let mut sum = simd.splat_f32s(0.0);
    for x in head {
        *x = simd::exp(simd, simd.sub_f32s(*x, shift));
        sum = simd.add_f32s(sum, *x);
    }
    simd.reduce_sum_f32s(sum)
}

/// The buffers of one thread's forward items (resized per item, never
/// shrunk; see `backward`'s `Scratch` for why they outlive the item).
#[derive(Default)]
pub(super) struct Scratch {
    qh: Vec<f32>,
    kt: Vec<f32>,
    vh: Vec<f32>,
    s: Vec<f32>,
    acc: Vec<f32>,
}

thread_local! {
    pub(super) static SCRATCH: std::cell::RefCell<Scratch> =
        std::cell::RefCell::new(Scratch::default());
}

/// The forward of one item, written into its rows of `out: [n, h, d]` and
/// its span of `lse: [h, n]`.
///
/// One sweep over the key tiles per query block (FlashAttention-2's
/// Algorithm 1): the running maximum `m` and sum `l` of the online softmax,
/// the accumulator `acc = sum exp(S - m) V` rescaled when `m` grows; at the
/// end `o = acc / l`, `lse = m + ln l`.
///
/// # Safety
/// No other call writes the item's (query rows, head) of `out` or its span
/// of `lse` meanwhile (`run_forward`: one call per item, items disjoint).
#[inline(always)]
pub(super) unsafe fn forward_item<S: Simd, T: Element>(
    simd: S,
    pb: &Problem<T>,
    it: &Item,
    sc: &mut Scratch,
    (out_rows, lse_all): (&Disjoint, &Disjoint),
) {
    let (h, h_kv, d, len) = (pb.h, pb.h_kv, pb.d, it.q_len);
    let dp = round_up(d.max(1), mm_col_multiple::<S>());
    let (lpq, lpk) = (round_up(len, BLOCK_Q), round_up(it.k_len, BLOCK_K));
    gather_into(&mut sc.qh, pb.q, (h, d), it.queries(), (lpq, dp));
    gather_t_into(&mut sc.kt, pb.k, (h_kv, d), it.keys(), (lpk, dp));
    gather_into(&mut sc.vh, pb.v, (h_kv, d), it.keys(), (lpk, dp));
    let Scratch { qh, kt, vh, s, acc } = sc;
    s.clear();
    s.resize(BLOCK_Q * BLOCK_K, 0.0);
    acc.clear();
    acc.resize(BLOCK_Q * dp, 0.0);
    // SAFETY: the item's own rows and span (the function's contract).
    let lse = unsafe { lse_all.span_mut(it.head * lse_all.len_per(h) + it.q_start, len) };
    let mut m = [f32::NEG_INFINITY; BLOCK_Q];
    let mut l = [0.0f32; BLOCK_Q];
    for q0 in (0..len).step_by(BLOCK_Q) {
        let rows = (len - q0).min(BLOCK_Q);
        // The rows the products compute (mm_acc's multiple of 4).
        let mrows = round_up(rows, 4);
        acc.fill(0.0);
        m.fill(f32::NEG_INFINITY);
        l.fill(0.0);
        // Only the key tiles some query of the block may see (causality
        // and the sliding window skip the others).
        let keys = it.block_keys(q0);
        for k0 in Item::tiles(&keys) {
            // The keys some query of the block may see, and the columns
            // (whole vectors) that hold them: the others are exact zeros
            // after the exponential, so neither computed nor multiplied.
            let kn = tile_keys(&keys, k0);
            let cols = round_up(kn, S::F32_LANES);
            let at = (q0, k0, cols);
            scores(simd, s, qh, kt, dp, it, at, pb.scale, None);
            for r in 0..mrows {
                let row = &mut s[r * BLOCK_K..r * BLOCK_K + cols];
                if r >= rows {
                    row.fill(0.0);
                    continue;
                }
                let m_new = m[r].max(simd::max(simd, row));
                if m_new == f32::NEG_INFINITY {
                    row.fill(0.0); // nothing allowed so far
                    continue;
                }
                let row_sum = exp_row_sum(simd, row, m_new);
                let corr = if m[r] == m_new {
                    1.0
                } else {
                    (m[r] - m_new).exp()
                };
                l[r] = l[r] * corr + row_sum;
                if corr != 1.0 {
                    simd::scale(simd, corr, &mut acc[r * dp..(r + 1) * dp]);
                }
                m[r] = m_new;
            }
            // acc += P V over the keys some row may see (the rest are zeros).
            mm_acc(simd, mrows, dp, kn, s, BLOCK_K, &vh[k0 * dp..], dp, acc, dp);
        }
        let out_block = Rows {
            start: it.q_start + q0,
            len: rows,
            head: it.head,
        };
        // SAFETY: the item's own rows (the function's contract).
        unsafe {
            out_rows.rows_mut(out_block, |r, o| {
                if l[r] == 0.0 {
                    return; // no allowed key: output 0, lse -inf (P8)
                }
                let inv = 1.0 / l[r];
                for (o, &a) in o.iter_mut().zip(&acc[r * dp..]) {
                    *o = a * inv;
                }
                lse[q0 + r] = m[r] + l[r].ln();
            });
        }
    }
}

/// The (query, key) scores the forward of `it` computes: over the key tiles
/// each query block visits ([`Item::block_keys`], [`Item::tiles`]), the
/// block's queries times the tile's first [`tile_keys`] keys (before their
/// rounding up to whole vectors), the loop of [`forward_item`] without the
/// arithmetic. The benchmark's unit of work.
pub(super) fn scored_pairs(it: &Item) -> u64 {
    (0..it.q_len)
        .step_by(BLOCK_Q)
        .map(|q0| {
            let rows = (it.q_len - q0).min(BLOCK_Q) as u64;
            let keys = it.block_keys(q0);
            Item::tiles(&keys)
                .map(|k0| rows * tile_keys(&keys, k0) as u64)
                .sum::<u64>()
        })
        .sum()
}
