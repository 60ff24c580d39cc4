//! The merges of the records the barriers reduce (the online-softmax merge
//! and alg2's rescaled input-gradient partials).

use super::super::cross_entropy::{SoftmaxStats, STATS_WIDTH};

/// The online-softmax merge of two [`SoftmaxStats`] records (alg1's barrier).
pub fn merge_stats(acc: &mut [f64], next: &[f64]) {
    let merged = SoftmaxStats::from_record(acc).merge(SoftmaxStats::from_record(next));
    acc[..STATS_WIDTH].copy_from_slice(&merged.to_record());
}

/// alg2's merge of records `[stats (4), Y (h), Z (h)]`.
///
/// For a set `K` of shards, relative to its maximum `m_K` and sum `S_K`, with
/// weights `w_i = s_i exp(m_i - m_K)`:
///
/// ```text
/// Y_K = Σ_{i in K} w_i D_i + Σ_{i in K} (w_i - S_K) B_i
/// Z_K = Σ_{i in K} B_i
/// ```
///
/// so that over all shards `Y / S = Σ_i alpha_i D_i + Σ_i (alpha_i - 1) B_i`,
/// the part of `∂L/∂x` that is `Σ_j (p_j - q_j) W_j`. A single shard has `Y =
/// s_i D_i`; merging `K` and `L` under `m = max(m_K, m_L)`, `e_K = exp(m_K -
/// m)`:
///
/// ```text
/// Y = e_K Y_K + e_L Y_L - S_L e_L Z_K - S_K e_K Z_L
/// ```
///
/// Every term is small when the target is predicted with probability close
/// to 1, so nothing cancels.
pub fn merge_alg2(acc: &mut [f64], next: &[f64]) {
    let h = (acc.len() - STATS_WIDTH) / 2;
    let a = SoftmaxStats::from_record(acc);
    let b = SoftmaxStats::from_record(next);
    let m = a.max.max(b.max);
    let (ea, eb) = (a.scale_to(m), b.scale_to(m));
    let (sa, sb) = (a.sum_exp() * ea, b.sum_exp() * eb);
    let (y_a, z_a) = acc[STATS_WIDTH..].split_at_mut(h);
    let (y_b, z_b) = next[STATS_WIDTH..].split_at(h);
    for k in 0..h {
        y_a[k] = ea * y_a[k] + eb * y_b[k] - sb * z_a[k] - sa * z_b[k];
        z_a[k] += z_b[k];
    }
    acc[..STATS_WIDTH].copy_from_slice(&a.merge(b).to_record());
}

/// [`merge_alg2`] with a third block `U` (`h` values) merged like the
/// softmax-weighted sum it is: `U = e_K U_K + e_L U_L`, so that `U / S =
/// Σ_i alpha_i A_i = Σ_j p_j W_j` (the z-loss part of `∂L/∂x`).
pub fn merge_alg2_z_loss(acc: &mut [f64], next: &[f64]) {
    let h = (acc.len() - STATS_WIDTH) / 3;
    let a = SoftmaxStats::from_record(acc);
    let b = SoftmaxStats::from_record(next);
    let m = a.max.max(b.max);
    let (ea, eb) = (a.scale_to(m), b.scale_to(m));
    let at = STATS_WIDTH + 2 * h;
    for k in 0..h {
        acc[at + k] = ea * acc[at + k] + eb * next[at + k];
    }
    merge_alg2(&mut acc[..at], &next[..at]);
}
