//! The backward of the tiled attention: per item, the probabilities
//! recomputed from the forward's `lse` (flash-attention's backward), then
//! `dq`, `dk`, `dv` tile by tile.

use super::*;

/// `out: [BLOCK_K, dp] += s^T x` for a tile `s: [BLOCK_Q, BLOCK_K]` and
/// `x: [BLOCK_Q, dp]` (`tr` the scratch of the transpose).
#[inline(always)]
fn acc_transposed<S: Simd>(
    simd: S,
    (s, tr): (&[f32], &mut [f32]),
    x: &[f32],
    out: &mut [f32],
    dp: usize,
) {
    transpose(s, BLOCK_Q, BLOCK_K, tr);
    mm_acc(simd, BLOCK_K, dp, BLOCK_Q, tr, BLOCK_Q, x, dp, out, dp);
}

/// The backward of one item: `dq: [q_len, d]`, `dk, dv: [k_len, d]` (this
/// query head's share of its key head's gradients).
#[inline(always)]
fn backward_item<S: Simd, T: Element>(
    simd: S,
    pb: &Problem<T>,
    out: &[f32],
    lse: &[f32],
    dout: &[f32],
    it: &Item,
) -> [Vec<f32>; 3] {
    let (h, h_kv, d, len, k_len) = (pb.h, pb.h_kv, pb.d, it.q_len, it.k_len);
    let dp = round_up(d.max(1), mm_col_multiple::<S>());
    let (lp, lpk) = (round_up(len, BLOCK_Q), round_up(k_len, BLOCK_K));
    let (queries, keys) = (it.queries(), it.keys());
    let qh = gather(pb.q, h, d, queries, lp, dp);
    let kh = gather(pb.k, h_kv, d, keys, lpk, dp);
    let kt = gather_t(pb.k, h_kv, d, keys, lpk, dp);
    let vt = gather_t(pb.v, h_kv, d, keys, lpk, dp);
    let doh = gather(dout, h, d, queries, lp, dp);
    let oh = gather(out, h, d, queries, lp, dp);
    let n = lse.len() / h;
    let row_lse: Vec<f32> = (0..len)
        .map(|i| lse[it.head * n + it.q_start + i])
        .collect();
    // delta_i = dO_i . O_i, summed in the order (and with the fused
    // multiply-adds) of the dP tile product, so that a one-key segment,
    // where O = V exactly, gets dP - delta = 0 exactly (as the reference).
    let delta: Vec<f32> = (0..lp)
        .map(|i| {
            let (g, o) = (&doh[i * dp..(i + 1) * dp], &oh[i * dp..(i + 1) * dp]);
            g.iter()
                .zip(o)
                .fold(0.0f32, |acc, (&g, &o)| g.mul_add(o, acc))
        })
        .collect();
    let mut dq = vec![0.0f32; lp * dp];
    let mut dk = vec![0.0f32; k_len * d];
    let mut dv = vec![0.0f32; k_len * d];
    let mut s = vec![0.0f32; BLOCK_Q * BLOCK_K];
    let mut dpt = vec![0.0f32; BLOCK_Q * BLOCK_K];
    let mut tr = vec![0.0f32; BLOCK_K * BLOCK_Q];
    let mut dk_t = vec![0.0f32; BLOCK_K * dp];
    let mut dv_t = vec![0.0f32; BLOCK_K * dp];
    let scale_v = simd.splat_f32s(pb.scale);
    // d score / d raw of a capped tile (softcap's chain factor, W5).
    let capped = it.transform.softcap > 0.0;
    #[cfg(test)]
    let capped = capped && !super::tests_faults::no_chain(it);
    let mut chain = vec![0.0f32; if capped { BLOCK_Q * BLOCK_K } else { 0 }];
    // The keys each query block may see: the tiles the forward visits.
    let block_keys: Vec<Range<usize>> = (0..len)
        .step_by(BLOCK_Q)
        .map(|q0| it.block_keys(q0))
        .collect();
    for k0 in (0..k_len).step_by(BLOCK_K) {
        dk_t.fill(0.0);
        dv_t.fill(0.0);
        for (q0, keys) in (0..len).step_by(BLOCK_Q).zip(&block_keys) {
            if !Item::tiles(keys).any(|t| t == k0) {
                continue;
            }
            let cg = capped.then_some(chain.as_mut_slice());
            let at = (q0, k0, BLOCK_K);
            scores(simd, &mut s, &qh, &kt, dp, it, at, pb.scale, cg);
            // P = exp(S - lse); 0 for padded rows and rows with no key.
            let mut block_lse = [f32::NEG_INFINITY; BLOCK_Q];
            for (r, l) in block_lse.iter_mut().enumerate() {
                if q0 + r < len {
                    *l = row_lse[q0 + r];
                }
            }
            probabilities(simd, &mut s, &block_lse);
            // dV_tile += P^T dO_blk
            acc_transposed(simd, (&s, &mut tr), &doh[q0 * dp..], &mut dv_t, dp);
            // dP = dO_blk V_tile^T
            dpt.fill(0.0);
            acc_by_transposed(
                simd,
                (&doh[q0 * dp..], len - q0),
                (key_panel(&vt, k0, dp).0, BLOCK_K, BLOCK_K),
                dp,
                &mut dpt,
            );
            // dS = P (dP - delta) scale, in place of P; with a softcap,
            // times its chain factor (P (dP - delta) chain scale).
            for r in 0..BLOCK_Q {
                let dl = simd.splat_f32s(delta.get(q0 + r).copied().unwrap_or(0.0));
                let (ps, _) = S::as_mut_simd_f32s(&mut s[r * BLOCK_K..(r + 1) * BLOCK_K]);
                let (dps, _) = S::as_simd_f32s(&dpt[r * BLOCK_K..(r + 1) * BLOCK_K]);
                if capped {
                    let (cs, _) = S::as_simd_f32s(&chain[r * BLOCK_K..(r + 1) * BLOCK_K]);
                    for ((p, &g), &c) in ps.iter_mut().zip(dps).zip(cs) {
                        let x = simd.mul_f32s(*p, simd.sub_f32s(g, dl));
                        *p = simd.mul_f32s(simd.mul_f32s(x, c), scale_v);
                    }
                    continue;
                }
                for (p, &g) in ps.iter_mut().zip(dps) {
                    *p = simd.mul_f32s(simd.mul_f32s(*p, simd.sub_f32s(g, dl)), scale_v);
                }
            }
            // dQ_blk += dS K_tile
            acc_tile_times(simd, &s, &kh[k0 * dp..], dp, &mut dq[q0 * dp..]);
            // dK_tile += dS^T Q_blk
            acc_transposed(simd, (&s, &mut tr), &qh[q0 * dp..], &mut dk_t, dp);
        }
        for j in 0..(k_len - k0).min(BLOCK_K) {
            let key = k0 + j;
            dk[key * d..(key + 1) * d].copy_from_slice(&dk_t[j * dp..j * dp + d]);
            dv[key * d..(key + 1) * d].copy_from_slice(&dv_t[j * dp..j * dp + d]);
        }
    }
    let mut dq_out = vec![0.0f32; len * d];
    for i in 0..len {
        dq_out[i * d..(i + 1) * d].copy_from_slice(&dq[i * dp..i * dp + d]);
    }
    [dq_out, dk, dv]
}

struct Backward<'a, 'p, 'm, T> {
    pb: &'a Problem<'p, T>,
    out: &'a [f32],
    lse: &'a [f32],
    dout: &'a [f32],
    it: &'a Item<'m>,
}

impl<T: Element> WithSimd for Backward<'_, '_, '_, T> {
    type Output = [Vec<f32>; 3];
    #[inline(always)]
    fn with_simd<S: Simd>(self, simd: S) -> Self::Output {
        backward_item(simd, self.pb, self.out, self.lse, self.dout, self.it)
    }
}

/// Runs every item's backward in parallel and scatters the results (the
/// key gradients added over the query heads of a group, in item order).
pub(super) fn run_backward<T: Element>(
    pb: &Problem<T>,
    (n, n_k): (usize, usize),
    items: &[Item],
    fwd: &AttentionOutput32,
    dout: &[f32],
) -> AttentionGrads32 {
    let (h, h_kv, d) = (pb.h, pb.h_kv, pb.d);
    let arch = simd::arch();
    let fo = fwd.output.as_standard_layout();
    let fl = fwd.lse.as_standard_layout();
    let out = fo.as_slice().expect("standard layout");
    let lse = fl.as_slice().expect("standard layout");
    let parts: Vec<[Vec<f32>; 3]> = items
        .par_iter()
        .map(|it| {
            arch.dispatch(Backward {
                pb,
                out,
                lse,
                dout,
                it,
            })
        })
        .collect();
    let mut grad_q = Array3::zeros((n, h, d));
    let mut grad_k = Array3::zeros((n_k, h_kv, d));
    let mut grad_v = Array3::zeros((n_k, h_kv, d));
    for (it, [dq, dk, dv]) in items.iter().zip(parts) {
        let gq = grad_q.as_slice_mut().expect("fresh array");
        scatter(gq, (h, d), it.queries(), &dq);
        let gk = grad_k.as_slice_mut().expect("fresh array");
        scatter_add(gk, (h_kv, d), it.keys(), &dk);
        let gv = grad_v.as_slice_mut().expect("fresh array");
        scatter_add(gv, (h_kv, d), it.keys(), &dv);
    }
    AttentionGrads32 {
        grad_q,
        grad_k,
        grad_v,
    }
}
