//! The backward of the tiled attention: per item, the probabilities
//! recomputed from the forward's `lse` (flash-attention's backward), then
//! `dq`, `dk`, `dv` tile by tile.
//!
//! Where the time went, and what this file does about it (issue 37):
//! - the work unit is a (segment, key head) with the query heads of its
//!   group: the key tiles are gathered once per unit, the group's key
//!   gradients summed in the unit (in head order, as before), and every
//!   gradient written straight into its output rows ([`Disjoint`]) — the
//!   per-item result vectors and the serial scatter after them are gone;
//! - a thread's buffers live as long as the thread ([`Scratch`]): fresh
//!   per-item vectors of up to 128 KiB were handed back to the kernel at each
//!   free (glibc trims the heap's top) and came back as zeroed pages, a
//!   sixth of the backward's time in page clearing;
//! - the tile products multiply only the rows and keys that exist (a
//!   block's rows rounded up to 4, a tile's keys to those some query of the
//!   block may see: `tile_keys`), as the forward does;
//! - the tiles are transposed (keys down, queries across the lanes, as the
//!   forward's): `S^T`, `P^T`, `dP^T` and `dS^T` feed `dV += P^T dO`, `dK +=
//!   dS^T Q` and `dQ += dS K` as they are, where the untransposed tiles were
//!   copied into their transposes twice per (key tile, query block), one
//!   element at a time; `lse` and `delta` are lane vectors, and `P` and `dS`
//!   are computed in one pass (plain backward on 64 `wikipedia-512`
//!   documents: 0.80 -> 0.71 s of one core).
//!
//! None of this changes a result's bits: each gradient element is still
//! accumulated over the same nonzero terms in the same order (the terms left
//! out are exact zeros at the end of a sum), so the varlen and dense forms
//! stay bitwise equal (module docs of [`super`]).

use std::cell::RefCell;

use super::disjoint::Disjoint;
use super::tile::{lanes_at, masked, BlockKeys, Prepare};
use super::*;
use crate::simd::{mm_acc_at, mm_scaled};

/// The buffers of one thread's units (resized per unit and item, never
/// shrunk).
#[derive(Default)]
struct Scratch {
    /// The unit's key and value rows, `[lpk, dp]`.
    kh: Vec<f32>,
    vh: Vec<f32>,
    /// The item's query rows and `dO` rows (`[lp, dp]`), their transposed
    /// panels (`[lp / BLOCK_Q, dp, BLOCK_Q]`), the output rows, the `dQ`
    /// accumulator.
    qh: Vec<f32>,
    qt: Vec<f32>,
    doh: Vec<f32>,
    dot: Vec<f32>,
    oh: Vec<f32>,
    dq: Vec<f32>,
    /// `delta_i = dO_i . O_i` and `lse_i` of the item's queries (`[lp]`;
    /// padding queries 0 and `-inf`).
    delta: Vec<f32>,
    row_lse: Vec<f32>,
    /// A tile's `S^T`, then `P^T`, then `dS^T`; `dP^T`; the cap's chain
    /// factor (all `[BLOCK_K, BLOCK_Q]`).
    s: Vec<f32>,
    dpt: Vec<f32>,
    chain: Vec<f32>,
    /// Each query block's keys ([`Item::block_keys`]) and per-query bounds,
    /// found once per item (not once per key tile).
    blocks: Vec<(Range<usize>, BlockKeys)>,
    /// A key tile's `dK`, `dV` accumulators.
    dk_t: Vec<f32>,
    dv_t: Vec<f32>,
    /// The unit's key gradients, summed over its query heads.
    dk: Vec<f32>,
    dv: Vec<f32>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// `v` resized to `n` zeros (its capacity kept).
fn zeroed(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    v.clear();
    v.resize(n, 0.0);
    v
}

/// The outputs of one problem's backward, written by the units in parallel.
struct Outputs<'a> {
    /// Whether units' key rows overlap (they run one after another).
    overlap: bool,
    dq: Disjoint<'a>,
    dk: Disjoint<'a>,
    dv: Disjoint<'a>,
}

/// The inputs of one problem's backward (flat, standard layout).
struct Inputs<'a, 'p, T> {
    pb: &'a Problem<'p, T>,
    out: &'a [f32],
    lse: &'a [f32],
    dout: &'a [f32],
}

/// The backward of one item (a query head of the unit), with the unit's key
/// and value rows in `sc.kh`, `sc.vh`: writes `dq` into its rows and adds
/// this head's share of `dk`, `dv` to `sc.dk`, `sc.dv` (`[k_len, d]`).
///
/// Per (key tile, query block), transposed tiles (module docs of
/// [`super::tile`]): `S^T = scale K Q^T`, `P^T = exp(S^T - lse)` (masked
/// scores exact zeros), `dV += P^T dO`, `dP^T = V dO^T`, `dS^T = P^T (dP^T -
/// delta) scale` (times the cap's chain factor), `dQ += dS K`
/// ([`crate::simd::mm_acc_at`] reading `dS^T`), `dK += dS^T Q`: no tile is
/// transposed.
///
/// Returns the largest [`magnitude_bits`](super::scan::magnitude_bits) of the item's rows of `q` and
/// `dO` (as read by the gathers).
#[inline(always)]
fn backward_item<S: Simd, T: Element>(
    simd: S,
    x: &Inputs<T>,
    it: &Item,
    sc: &mut Scratch,
    dq_out: &Disjoint,
) -> [u32; 2] {
    let pb = x.pb;
    let lanes = S::F32_LANES;
    let (h, d, len, k_len) = (pb.h, pb.d, it.q_len, it.k_len);
    let dp = round_up(d.max(1), mm_col_multiple::<S>());
    let lp = round_up(len, BLOCK_Q);
    let queries = it.queries();
    let seen = [
        gather_into(&mut sc.qh, pb.q, (h, d), queries, (lp, dp)),
        gather_into(&mut sc.doh, x.dout, (h, d), queries, (lp, dp)),
    ];
    gather_t_into(&mut sc.qt, pb.q, (h, d), queries, (lp, dp));
    gather_t_into(&mut sc.dot, x.dout, (h, d), queries, (lp, dp));
    gather_into(&mut sc.oh, x.out, (h, d), queries, (lp, dp));
    let n = x.lse.len() / h;
    sc.row_lse.clear();
    sc.row_lse
        .extend((0..len).map(|i| x.lse[it.head * n + it.q_start + i]));
    sc.row_lse.resize(lp, f32::NEG_INFINITY);
    // delta_i = dO_i . O_i, summed in the order (and with the fused
    // multiply-adds) of the dP tile product, so that a one-key segment,
    // where O = V exactly, gets dP - delta = 0 exactly (as the reference).
    sc.delta.clear();
    for i in 0..lp {
        let (g, o) = (&sc.doh[i * dp..(i + 1) * dp], &sc.oh[i * dp..(i + 1) * dp]);
        // A loop, not a fold's closure: the fused multiply-add must be
        // compiled with the dispatched target features (`simd::LaneFn`).
        let mut dl = 0.0f32;
        for (&g, &o) in g.iter().zip(o) {
            dl = g.mul_add(o, dl);
        }
        sc.delta.push(dl);
    }
    let Scratch {
        kh,
        vh,
        qh,
        qt,
        doh,
        dot,
        dq,
        delta,
        row_lse,
        s,
        dpt,
        chain,
        blocks,
        dk_t,
        dv_t,
        dk,
        dv,
        ..
    } = sc;
    let dq = zeroed(dq, lp * dp);
    let s = zeroed(s, BLOCK_K * BLOCK_Q);
    let dpt = zeroed(dpt, BLOCK_K * BLOCK_Q);
    let dk_t = zeroed(dk_t, BLOCK_K * dp);
    let dv_t = zeroed(dv_t, BLOCK_K * dp);
    let scale_v = simd.splat_f32s(pb.scale);
    // d score / d raw of a capped tile (softcap's chain factor, W5).
    let capped = it.transform.softcap > 0.0;
    #[cfg(test)]
    let capped = capped && !super::tests_faults::no_chain(it);
    let chain = zeroed(chain, if capped { BLOCK_K * BLOCK_Q } else { 0 });
    blocks.clear();
    blocks.extend((0..len).step_by(BLOCK_Q).map(|q0| {
        let rows = (len - q0).min(BLOCK_Q);
        (it.block_keys(q0), BlockKeys::new(it, q0, rows))
    }));
    for k0 in (0..k_len).step_by(BLOCK_K) {
        dk_t.fill(0.0);
        dv_t.fill(0.0);
        // The tile's keys some query of some visiting block may see.
        let mut tile_rows = 0;
        for (q0, (keys, bk)) in (0..len).step_by(BLOCK_Q).zip(blocks.iter()) {
            if !Item::tiles(keys).any(|t| t == k0) {
                continue;
            }
            let rows = (len - q0).min(BLOCK_Q);
            let (qcols, mrows) = (round_up(rows, lanes), round_up(rows, 4));
            // The keys some query of the block may see and the key rows
            // (multiple of 4) of the products: the others' probabilities
            // are exact zeros, neither computed nor multiplied (the
            // forward's cut).
            let kn = tile_keys(keys, k0);
            let krows = round_up(kn, 4);
            tile_rows = tile_rows.max(krows);
            // The block's panels of Q^T and dO^T: [dp, BLOCK_Q].
            let block = q0 * dp..(q0 + BLOCK_Q) * dp;
            let (q_panel, do_panel) = ((&qt[block.clone()], BLOCK_Q), (&dot[block], BLOCK_Q));
            // S^T = scale K Q^T, masked and transformed.
            let k_tile = (&kh[k0 * dp..], dp);
            mm_scaled(
                simd,
                (krows, qcols, d),
                k_tile,
                q_panel,
                (s, BLOCK_Q),
                pb.scale,
            );
            let cg = capped.then_some(&mut chain[..]);
            let prep = bk.prepare(s, it, (q0, k0, kn, rows), cg);
            // dP^T = V dO^T
            let v_tile = (&vh[k0 * dp..], dp);
            mm_scaled(
                simd,
                (krows, qcols, d),
                v_tile,
                do_panel,
                (dpt, BLOCK_Q),
                1.0,
            );
            // P^T = exp(S^T - lse) and dS^T = P^T (dP^T - delta) scale (times
            // the chain factor), lane-wise over the block's queries; the
            // key rows past kn are exact zeros.
            for g in (0..qcols).step_by(lanes) {
                let l = lanes_at::<S>(row_lse, q0 + g);
                let neg_inf = simd.splat_f32s(f32::NEG_INFINITY);
                // A query with no key (lse = -inf) has only masked scores.
                let shift = simd.select_f32s(simd.equal_f32s(l, neg_inf), simd.splat_f32s(0.0), l);
                let dl = lanes_at::<S>(delta, q0 + g);
                for j in 0..kn {
                    let at = j * BLOCK_Q + g;
                    let mut y = lanes_at::<S>(s, at);
                    if prep == Prepare::Mask {
                        y = masked(simd, bk, g, k0 + j, y);
                    }
                    let p = simd::exp(simd, simd.sub_f32s(y, shift));
                    let gp = simd.mul_f32s(p, simd.sub_f32s(lanes_at::<S>(dpt, at), dl));
                    let ds = if capped {
                        simd.mul_f32s(simd.mul_f32s(gp, lanes_at::<S>(chain, at)), scale_v)
                    } else {
                        simd.mul_f32s(gp, scale_v)
                    };
                    S::as_mut_simd_f32s(&mut s[at..at + lanes]).0[0] = p;
                    S::as_mut_simd_f32s(&mut dpt[at..at + lanes]).0[0] = ds;
                }
            }
            s[kn * BLOCK_Q..krows * BLOCK_Q].fill(0.0);
            dpt[kn * BLOCK_Q..krows * BLOCK_Q].fill(0.0);
            let (do_rows, q_rows) = (&doh[q0 * dp..], &qh[q0 * dp..]);
            // dV_tile += P^T dO_blk
            mm_acc(simd, krows, dp, rows, s, BLOCK_Q, do_rows, dp, dv_t, dp);
            // dQ_blk += dS K_tile
            let dq_blk = &mut dq[q0 * dp..];
            mm_acc_at(
                simd,
                mrows,
                dp,
                kn,
                dpt,
                BLOCK_Q,
                &kh[k0 * dp..],
                dp,
                dq_blk,
                dp,
            );
            // dK_tile += dS^T Q_blk
            mm_acc(simd, krows, dp, rows, dpt, BLOCK_Q, q_rows, dp, dk_t, dp);
        }
        // Keys no block sees keep zero gradients (tile_rows covers the rest).
        for j in 0..(k_len - k0).min(tile_rows) {
            let key = k0 + j;
            for (a, &t) in dk[key * d..(key + 1) * d].iter_mut().zip(&dk_t[j * dp..]) {
                *a += t;
            }
            for (a, &t) in dv[key * d..(key + 1) * d].iter_mut().zip(&dv_t[j * dp..]) {
                *a += t;
            }
        }
    }
    // SAFETY: this item is the only one writing its (query rows, head)
    // (`run_backward`).
    unsafe {
        dq_out.rows_mut(queries, |i, row| {
            row.copy_from_slice(&dq[i * dp..i * dp + d]);
        });
    }
    seen
}

/// One unit: a segment's key head with the query heads of its group (in
/// head order).
struct Unit<'a, 'b, 'p, 'm, T> {
    x: &'a Inputs<'b, 'p, T>,
    items: &'a [Item<'m>],
    sc: &'a mut Scratch,
    outs: &'a Outputs<'b>,
}

impl<T: Element> WithSimd for Unit<'_, '_, '_, '_, T> {
    /// The largest [`magnitude_bits`](super::scan::magnitude_bits) of the unit's rows of `q`, `k`, `v`,
    /// `dO`.
    type Output = [u32; 4];
    #[inline(always)]
    fn with_simd<S: Simd>(self, simd: S) -> [u32; 4] {
        let Unit { x, items, sc, outs } = self;
        let first = &items[0];
        let (h_kv, d, k_len) = (x.pb.h_kv, x.pb.d, first.k_len);
        let dp = round_up(d.max(1), mm_col_multiple::<S>());
        let lpk = round_up(k_len, BLOCK_K);
        let keys = first.keys();
        {
            let bk = gather_into(&mut sc.kh, x.pb.k, (h_kv, d), keys, (lpk, dp));
            let bv = gather_into(&mut sc.vh, x.pb.v, (h_kv, d), keys, (lpk, dp));
            zeroed(&mut sc.dk, k_len * d);
            zeroed(&mut sc.dv, k_len * d);
            let mut seen = [0, bk, bv, 0];
            for it in items {
                let [bq, bo] = backward_item(simd, x, it, sc, &outs.dq);
                seen = max_bits(seen, [bq, 0, 0, bo]);
            }
            // Copied (units that overlap, only ever a planted fault's, add
            // to what the earlier ones wrote). A fresh output is read only
            // where it must be: reading a zero page before writing it costs
            // a second fault and a TLB flush on every core (a fifth of the
            // backward's time, issue 37).
            // SAFETY: no other unit writes its (key rows, key head)
            // meanwhile (`run_backward`).
            unsafe {
                for (out, grad) in [(&outs.dk, &sc.dk), (&outs.dv, &sc.dv)] {
                    out.rows_mut(keys, |j, row| {
                        let g = &grad[j * d..(j + 1) * d];
                        if outs.overlap {
                            row.iter_mut().zip(g).for_each(|(o, &g)| *o += g);
                        } else {
                            row.copy_from_slice(g);
                        }
                    });
                }
            }
            seen
        }
    }
}

/// Runs every unit's backward in parallel, each writing its own rows of the
/// gradients (the key gradients summed over the query heads of a group, in
/// head order). Returns the largest [`magnitude_bits`](super::scan::magnitude_bits) the units read of
/// `q`, `k`, `v`, `dO`.
pub(super) fn run_backward<T: Element>(
    pb: &Problem<T>,
    (n, n_k): (usize, usize),
    items: &[Item],
    fwd: &AttentionOutput32,
    dout: &[f32],
) -> (AttentionGrads32, [u32; 4]) {
    let (h, h_kv, d) = (pb.h, pb.h_kv, pb.d);
    let arch = simd::arch();
    let fo = fwd.output.as_standard_layout();
    let fl = fwd.lse.as_standard_layout();
    let x = Inputs {
        pb,
        out: fo.as_slice().expect("standard layout"),
        lse: fl.as_slice().expect("standard layout"),
        dout,
    };
    // Tens of MiB each at a batch's size: cleared on every thread, faulted
    // in 2 MiB at a time.
    let mut grad_q = crate::alloc::zeros_parallel(Ix3(n, h, d));
    let mut grad_k = crate::alloc::zeros_parallel(Ix3(n_k, h_kv, d));
    let mut grad_v = crate::alloc::zeros_parallel(Ix3(n_k, h_kv, d));
    // The units: runs of items with the same segment and key head (the
    // items list a segment's query heads in order, so a group's heads are
    // adjacent). Units own disjoint rows: a query row of one (segment,
    // head), a key row of one (segment, key head); segments are disjoint
    // token ranges (checked by the callers' `check_varlen` / row layout),
    // and so are the units' key spans (checked below).
    let units: Vec<&[Item]> = items
        .chunk_by(|a, b| (a.q_start, a.k_start, a.kv_head) == (b.q_start, b.k_start, b.kv_head))
        .collect();
    // A test's planted W3 fault builds items whose keys overlap the
    // previous segment's: such units run one after another (their key
    // gradients added in unit order, as the serial scatter did).
    let disjoint = {
        let mut spans: Vec<_> = units
            .iter()
            .map(|u| (u[0].kv_head, u[0].k_start, u[0].k_start + u[0].k_len))
            .collect();
        spans.sort_unstable();
        spans
            .windows(2)
            .all(|w| w[0].0 != w[1].0 || w[0].2 <= w[1].1)
    };
    let outs = Outputs {
        overlap: !disjoint,
        dq: Disjoint::new(grad_q.as_slice_mut().expect("fresh array"), (h, d)),
        dk: Disjoint::new(grad_k.as_slice_mut().expect("fresh array"), (h_kv, d)),
        dv: Disjoint::new(grad_v.as_slice_mut().expect("fresh array"), (h_kv, d)),
    };
    // The thread's buffers are borrowed outside the dispatch, so that the
    // kernel is compiled inside pulp's target-feature context (a closure
    // between the two is compiled without them: 50 times slower).
    let run = |items: &&[Item]| {
        SCRATCH.with_borrow_mut(|sc| {
            arch.dispatch(Unit {
                x: &x,
                items,
                sc,
                outs: &outs,
            })
        })
    };
    let seen = if disjoint {
        units.par_iter().map(run).reduce(|| [0; 4], max_bits)
    } else {
        units.iter().map(run).fold([0; 4], max_bits)
    };
    let grads = AttentionGrads32 {
        grad_q,
        grad_k,
        grad_v,
    };
    (grads, seen)
}
