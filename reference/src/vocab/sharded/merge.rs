//! The merges of the records the barriers reduce (the online-softmax merge
//! and alg2's rescaled input-gradient partials).

use super::super::collective::{Collective, Reduce};
use super::super::cross_entropy::{SoftmaxStats, STATS_WIDTH};
use crate::error::Result;

/// The online-softmax merge of two [`SoftmaxStats`] records (alg1's barrier).
pub fn merge_stats(acc: &mut [f64], next: &[f64]) {
    let merged = SoftmaxStats::from_record(acc).merge(SoftmaxStats::from_record(next));
    acc[..STATS_WIDTH].copy_from_slice(&merged.to_record());
}

/// alg1's barrier: this rank's `local` statistics (`[n]`, one per token)
/// merged with every other rank's over `comm` ([`merge_stats`], in rank
/// order); the whole rows' statistics, `[n]`.
///
/// # Errors
/// The collective's.
pub fn merge_stats_over(
    comm: &dyn Collective,
    local: &[SoftmaxStats],
) -> Result<Vec<SoftmaxStats>> {
    let mut record: Vec<f64> = local.iter().flat_map(|s| s.to_record()).collect();
    comm.all_reduce(&mut [Reduce::Merge {
        data: &mut record,
        width: STATS_WIDTH,
        op: merge_stats,
    }])?;
    Ok(record
        .chunks(STATS_WIDTH)
        .map(SoftmaxStats::from_record)
        .collect())
}

/// The statistics of the records `acc` (set `K`) and `next` (set `L`), each
/// with its factor to the common maximum `m = max(m_K, m_L)`: `((K, e_K),
/// (L, e_L))`, `e_K = exp(m_K - m)`.
fn to_common_max(acc: &[f64], next: &[f64]) -> ((SoftmaxStats, f64), (SoftmaxStats, f64)) {
    let a = SoftmaxStats::from_record(acc);
    let b = SoftmaxStats::from_record(next);
    let m = a.max.max(b.max);
    ((a, a.scale_to(m)), (b, b.scale_to(m)))
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
    let ((a, ea), (b, eb)) = to_common_max(acc, next);
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
    let ((_, ea), (_, eb)) = to_common_max(acc, next);
    let at = STATS_WIDTH + 2 * h;
    for k in 0..h {
        acc[at + k] = ea * acc[at + k] + eb * next[at + k];
    }
    merge_alg2(&mut acc[..at], &next[..at]);
}

/// The layout of alg2's per-token record, shared by every implementation of
/// the algorithm: `[stats (4), s_i D_i (h), B_i (h)]`, plus `s_i A_i (h)`
/// with the z-loss, or the statistics alone when no input gradient is
/// formed; the merge that reduces it, and `∂L/∂x` from the merged record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Alg2Record {
    /// `h`: the hidden size.
    pub h: usize,
    /// Blocks of `h` values after the statistics: 0, 2, or 3 (z-loss).
    pub blocks: usize,
}

impl Alg2Record {
    /// The record of a run with hidden size `h` that forms the input
    /// gradient (`input_grad`) or not, with z-loss coefficient `z_loss`.
    pub fn new(h: usize, input_grad: bool, z_loss: f64) -> Self {
        let blocks = match (input_grad, z_loss > 0.0) {
            (false, _) => 0,
            (true, false) => 2,
            (true, true) => 3,
        };
        Alg2Record { h, blocks }
    }

    /// Values per token.
    pub fn width(&self) -> usize {
        STATS_WIDTH + self.blocks * self.h
    }

    /// The merge of the one barrier: [`merge_stats`], [`merge_alg2`] or
    /// [`merge_alg2_z_loss`].
    pub fn merge(&self) -> super::super::collective::MergeFn {
        match self.blocks {
            0 => merge_stats,
            2 => merge_alg2,
            _ => merge_alg2_z_loss,
        }
    }

    /// The one barrier: merges every rank's `record` in place over `comm`;
    /// the global statistics of each token.
    ///
    /// # Errors
    /// The collective's.
    pub fn all_reduce(
        &self,
        comm: &dyn super::super::collective::Collective,
        record: &mut [f64],
    ) -> crate::error::Result<Vec<SoftmaxStats>> {
        let width = self.width();
        comm.all_reduce(&mut [super::super::collective::Reduce::Merge {
            data: record,
            width,
            op: self.merge(),
        }])?;
        Ok(record
            .chunks(width)
            .map(SoftmaxStats::from_record)
            .collect())
    }

    /// Writes token `i`'s partials into `record`: `s_i D_i` (`d(k)`), `B_i`
    /// (`b(k)`) and, with the z-loss, `s_i A_i` (`a(k)`, `A_i = softmax'_i
    /// W_i`); `s_i` the local sum. Nothing without blocks.
    pub fn write_partials(
        &self,
        record: &mut [f64],
        i: usize,
        s_i: f64,
        d: impl Fn(usize) -> f64,
        b: impl Fn(usize) -> f64,
        a: impl Fn(usize) -> f64,
    ) {
        if self.blocks == 0 {
            return;
        }
        let (h, at) = (self.h, i * self.width() + STATS_WIDTH);
        for k in 0..h {
            record[at + k] = s_i * d(k);
            record[at + h + k] = b(k);
            if self.blocks == 3 {
                record[at + 2 * h + k] = s_i * a(k);
            }
        }
    }

    /// `∂L/∂x = w_i (Y / S + 2 c lse U / S)` (`[n, h]`) from the merged
    /// `record`, the global statistics and the token weights `w_i`: `Y / S =
    /// Σ_j (p_j - q_j) W_j` and `U / S = Σ_j p_j W_j`, no more communication.
    pub fn input_grad(
        &self,
        record: &[f64],
        global: &[SoftmaxStats],
        weights: &[f64],
        z_loss: f64,
    ) -> ndarray::Array2<f64> {
        let (h, width) = (self.h, self.width());
        ndarray::Array2::from_shape_fn((global.len(), h), |(i, k)| {
            if weights[i] == 0.0 {
                return 0.0;
            }
            let g = &global[i];
            let at = i * width + STATS_WIDTH;
            let y = record[at + k] / g.sum_exp();
            let z_part = if self.blocks == 3 {
                2.0 * z_loss * g.logsumexp() * (record[at + 2 * h + k] / g.sum_exp())
            } else {
                0.0
            };
            weights[i] * (y + z_part)
        })
    }
}
