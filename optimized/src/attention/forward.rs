//! The forward of one work item (FlashAttention-2's Algorithm 1) over the
//! tiles of [`super`].
//!
//! Where the time goes, and what this file does about it (issue 37):
//! - the two tile products (`S^T = K Q^T`, `O += P V`) are most of the
//!   work, at the rate of [`mm_acc`] alone: only the queries and keys that
//!   exist are multiplied (a block's queries rounded up to whole vectors, a
//!   tile's keys to those some query of the block may see, [`tile_keys`],
//!   rounded up to 4), where fixed 64 x 64 tiles would multiply the zero
//!   padding of every segment's last block and tile;
//! - the tiles are transposed (keys down, queries across the lanes), so the
//!   online softmax's maximum, exponentials, sum and rescaling are lane-wise
//!   passes over the tile ([`softmax_lanes`]): no horizontal reduction, no
//!   branch per query, the mask folded into the maximum's pass, the scale
//!   into the product's store ([`mm_scaled`]), and the accumulator rescaled
//!   only when a maximum grows by more than [`LAZY`] (the untransposed
//!   tile's per-row softmax took a fifth of the time);
//! - `K` and `V` are gathered as rows, `Q` transposed once per item, and
//!   the accumulator kept untransposed (`O: [queries, d]`, the product
//!   reading `P^T` transposed, [`crate::simd::mm_acc_at`]), so that each
//!   output row is written with whole vectors (transposing `O^T` back one
//!   element at a time took 6 % of the forward; issue 37).
//!
//! Every output element is accumulated over the same terms in the same order
//! whichever form (varlen or dense) the item comes from (the terms left out
//! are exact zeros), so the two forms stay bitwise equal (module docs of
//! [`super`]).

use super::disjoint::Disjoint;
use super::tile::{lanes_at, masked, BlockKeys, Prepare};
use super::*;
use crate::simd::{mm_acc_at, mm_scaled};

/// The buffers of one thread's forward items (resized per item, never
/// shrunk; see `backward`'s `Scratch` for why they outlive the item).
#[derive(Default)]
pub(super) struct Scratch {
    /// `Q^T` in panels `[lpq / BLOCK_Q, dp, BLOCK_Q]` ([`gather_t_into`]).
    qt: Vec<f32>,
    /// `K: [lpk, dp]`.
    kh: Vec<f32>,
    /// `V: [lpk, dp]`.
    vh: Vec<f32>,
    /// The transposed score tile `S^T`, then `P^T`: `[BLOCK_K, BLOCK_Q]`.
    s: Vec<f32>,
    /// The accumulator `O: [BLOCK_Q, dp]` (a query per row, so that the
    /// output rows are written with whole vectors, not transposed back).
    acc: Vec<f32>,
}

thread_local! {
    pub(super) static SCRATCH: std::cell::RefCell<Scratch> =
        std::cell::RefCell::new(Scratch::default());
}

/// The online softmax's state of the queries of one block, one lane per
/// query: the running maximum `m` and sum `l`.
struct Block {
    m: [f32; BLOCK_Q],
    l: [f32; BLOCK_Q],
}

/// How far a tile's score maximum may exceed a lane's running maximum
/// before the lane's maximum moves (natural log units): the probabilities of
/// [`softmax_lanes`] stay below `e^8`, far from f32's range, and the
/// accumulator is rescaled only when some lane's maximum moves.
const LAZY: f32 = 8.0;

/// The forward of one item, written into its rows of `out: [n, h, d]` and
/// its span of `lse: [h, n]`.
///
/// One sweep over the key tiles per query block (FlashAttention-2's
/// Algorithm 1): the running maximum `m` and sum `l` of the online softmax,
/// the accumulator `acc = sum exp(S - m) V` rescaled when `m` grows; at the
/// end `o = acc / l`, `lse = m + ln l`.
///
/// The tiles are transposed (keys down, queries across the SIMD lanes): `S^T
/// = K Q^T`, `O += P V` (`P` read from `P^T`), so that each query's maximum, sum and
/// rescaling are lane-wise operations over the tile's rows, with no
/// horizontal reduction and no branch per query (issue 37: the per-row
/// softmax of the untransposed tile was a fifth of the forward's time).
///
/// Returns the largest [`magnitude_bits`](super::scan::magnitude_bits) of the item's rows of `q`, `k`,
/// `v` (as read by the gathers).
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
) -> [u32; 3] {
    let (h, h_kv, d, len) = (pb.h, pb.h_kv, pb.d, it.q_len);
    let lanes = S::F32_LANES;
    let dp = round_up(d.max(1), mm_col_multiple::<S>());
    let (lpq, lpk) = (round_up(len, BLOCK_Q), round_up(it.k_len, BLOCK_K));
    let seen = [
        gather_t_into(&mut sc.qt, pb.q, (h, d), it.queries(), (lpq, dp)),
        gather_into(&mut sc.kh, pb.k, (h_kv, d), it.keys(), (lpk, dp)),
        gather_into(&mut sc.vh, pb.v, (h_kv, d), it.keys(), (lpk, dp)),
    ];
    let Scratch { qt, kh, vh, s, acc } = sc;
    s.clear();
    s.resize(BLOCK_K * BLOCK_Q, 0.0);
    acc.clear();
    acc.resize(BLOCK_Q * dp, 0.0);
    // SAFETY: the item's own rows and span (the function's contract).
    let lse = unsafe { lse_all.span_mut(it.head * lse_all.len_per(h) + it.q_start, len) };
    let mut b = Block {
        m: [f32::NEG_INFINITY; BLOCK_Q],
        l: [0.0; BLOCK_Q],
    };
    for q0 in (0..len).step_by(BLOCK_Q) {
        let rows = (len - q0).min(BLOCK_Q);
        // The query lanes the products compute (whole vectors).
        let qcols = round_up(rows, lanes);
        let panel = &qt[(q0 / BLOCK_Q) * dp * BLOCK_Q..][..dp * BLOCK_Q];
        acc.fill(0.0);
        b.m.fill(f32::NEG_INFINITY);
        b.l.fill(0.0);
        out_rows.prefetch_rows(Rows {
            start: it.q_start + q0,
            len: rows,
            head: it.head,
        });
        let bk = BlockKeys::new(it, q0, rows);
        // Only the key tiles some query of the block may see (causality
        // and the sliding window skip the others).
        let keys = it.block_keys(q0);
        for k0 in Item::tiles(&keys) {
            // The keys some query of the block may see (the others are
            // exact zeros after the exponential: neither computed nor
            // multiplied), rounded up to the product's 4 rows.
            let kn = tile_keys(&keys, k0);
            let krows = round_up(kn, 4);
            let (k_tile, scores) = ((&kh[k0 * dp..], dp), (&mut s[..], BLOCK_Q));
            mm_scaled(
                simd,
                (krows, qcols, d),
                k_tile,
                (panel, BLOCK_Q),
                scores,
                pb.scale,
            );
            let prep = bk.prepare(s, it, (q0, k0, kn, rows), None);
            for g in (0..qcols).step_by(lanes) {
                softmax_lanes(simd, (s, acc), (&mut b, &bk), (g, k0, kn, dp), prep);
            }
            // O += P V over the keys some query may see (P read from
            // the transposed tile P^T), on whole blocks of 4 query rows
            // (the product's; more than `qcols` only without SIMD, where
            // the extra rows are padding queries, never written out).
            let prows = round_up(qcols, 4);
            mm_acc_at(simd, prows, dp, kn, s, BLOCK_Q, &vh[k0 * dp..], dp, acc, dp);
        }
        let out_block = Rows {
            start: it.q_start + q0,
            len: rows,
            head: it.head,
        };
        for r in 0..rows {
            if b.l[r] == 0.0 {
                continue; // no allowed key: output 0, lse -inf (P8)
            }
            // SAFETY: the item's own row (the function's contract).
            let o = unsafe { out_rows.row_mut(out_block, r) };
            scaled_row(simd, &acc[r * dp..][..o.len()], 1.0 / b.l[r], o);
            lse[q0 + r] = b.m[r] + b.l[r].ln();
        }
    }
    seen
}

/// The online softmax of one vector of queries (lanes `g..g + lanes` of the
/// block) over the tile's first `kn` keys: the scores (prepared as `prep`
/// says) become `p = exp(s - m_new)`, the lanes' `acc` columns are rescaled
/// by `exp(m_old - m_new)` and `l = l exp(m_old - m_new) + sum p`, where
/// `m_new` is the tile's maximum if it exceeds `m_old` by more than [`LAZY`]
/// and `m_old` otherwise. A lane with no allowed key so far keeps `m =
/// -inf`, `l = 0` and zero probabilities.
#[inline(always)]
fn softmax_lanes<S: Simd>(
    simd: S,
    (s, acc): (&mut [f32], &mut [f32]),
    (b, bk): (&mut Block, &BlockKeys),
    (g, k0, kn, dp): (usize, usize, usize, usize),
    prep: Prepare,
) {
    let lanes = S::F32_LANES;
    let neg_inf = simd.splat_f32s(f32::NEG_INFINITY);
    let m_old = lanes_at::<S>(&b.m, g);
    let mut mx = m_old;
    for j in 0..kn {
        let x = &mut S::as_mut_simd_f32s(&mut s[j * BLOCK_Q + g..][..lanes]).0[0];
        let mut y = *x;
        if prep == Prepare::Mask {
            y = masked(simd, bk, g, k0 + j, y);
        }
        *x = y;
        mx = simd.max_f32s(mx, y);
    }
    // Lazy rescaling: a lane's maximum moves only when the tile's exceeds it
    // by more than LAZY, so most tiles rescale nothing (the probabilities
    // stay below e^LAZY; o = acc / l and lse = m + ln l are the same sums).
    let grow = simd.greater_than_f32s(mx, simd.add_f32s(m_old, simd.splat_f32s(LAZY)));
    let moved = simd.first_true_m32s(grow) < lanes;
    let m_new = simd.select_f32s(grow, mx, m_old);
    // exp(s - m) with m = 0 where nothing is allowed yet (exact zeros).
    let shift = simd.select_f32s(simd.equal_f32s(m_new, neg_inf), simd.splat_f32s(0.0), m_new);
    let mut sum = simd.splat_f32s(0.0);
    for j in 0..kn {
        let x = &mut S::as_mut_simd_f32s(&mut s[j * BLOCK_Q + g..][..lanes]).0[0];
        *x = simd::exp_at_most_88(simd, simd.sub_f32s(*x, shift));
        sum = simd.add_f32s(sum, *x);
    }
    let mut l = lanes_at::<S>(&b.l, g);
    if moved {
        let corr = simd.select_f32s(
            simd.equal_f32s(m_old, m_new),
            simd.splat_f32s(1.0),
            simd::exp(simd, simd.sub_f32s(m_old, shift)),
        );
        l = simd.mul_f32s(l, corr);
        let mut by = [1.0f32; BLOCK_Q];
        S::as_mut_simd_f32s(&mut by[..lanes]).0[0] = corr;
        for (r, &c) in by[..lanes].iter().enumerate() {
            if c != 1.0 {
                let row = &mut acc[(g + r) * dp..][..dp];
                let (v, _) = S::as_mut_simd_f32s(row);
                let c = simd.splat_f32s(c);
                for a in v {
                    *a = simd.mul_f32s(*a, c);
                }
            }
        }
        S::as_mut_simd_f32s(&mut b.m[g..g + lanes]).0[0] = m_new;
    }
    S::as_mut_simd_f32s(&mut b.l[g..g + lanes]).0[0] = simd.add_f32s(l, sum);
}

/// `o = a * by`, lane-wise (`a` and `o` of one length; its tail past the
/// last whole vector one element at a time): an output row from its
/// accumulator row and `1 / l`.
#[inline(always)]
fn scaled_row<S: Simd>(simd: S, a: &[f32], by: f32, o: &mut [f32]) {
    let (av, at) = S::as_simd_f32s(a);
    let (ov, ot) = S::as_mut_simd_f32s(o);
    let byv = simd.splat_f32s(by);
    for (o, &a) in ov.iter_mut().zip(av) {
        *o = simd.mul_f32s(a, byv);
    }
    for (o, &a) in ot.iter_mut().zip(at) {
        *o = a * by;
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
