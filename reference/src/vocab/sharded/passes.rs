//! The S and T passes of the three algorithms on one rank.

use ndarray::{Array1, Array2, ArrayView2, Axis, Slice};

use super::super::collective::Collective;
use super::super::cross_entropy::{
    check_grad_bound, check_row, count_and_sum, target_term, token_loss, SoftmaxStats, STATS_WIDTH,
};
use super::super::softcap;
use super::super::sum;
use super::super::LossCall;
use crate::error::Result;

use super::merge::{merge_stats_over, Alg2Record};
use super::rank::{
    check_rank_inputs, Grads, Linear, LinearGrads, Meter, RankLoss, RankRun, SState,
};
use super::{ShardMap, ShardedAlgorithm};

impl<'a> RankRun<'a> {
    pub(super) fn new(
        comm: &'a dyn Collective,
        algorithm: ShardedAlgorithm,
        map: &ShardMap,
        n: usize,
        call: &LossCall,
    ) -> Result<Self> {
        check_rank_inputs(comm, map, n, call)?;
        let v = map.vocab_size();
        let config = call.config;
        let targets = config.targets(call.targets, v)?;
        Ok(RankRun {
            comm,
            algorithm,
            shard: map.shard(comm.rank()),
            config: *config,
            weights: call.token_weights(&targets),
            targets,
            q: config.target_distribution(v),
            meter: Meter::default(),
        })
    }

    /// Soft-caps the real columns of this shard's logits `z: [n, w_r]` in
    /// place (docs/FAULTS.md O1; nothing without a softcap).
    pub(super) fn cap(&self, z: &mut Array2<f64>) {
        if let Some(c) = self.config.softcap {
            softcap::cap_columns(z.view_mut(), self.shard.real, c);
        }
    }

    /// `dL/dz` of a raw logit from `dL/dy` of its capped value `y`.
    fn chain(&self, grad: f64, capped: f64) -> f64 {
        softcap::chain(grad, capped, self.config.softcap)
    }

    /// `q_ij` of token `i` for local column `j` (0 for padding and ignored tokens).
    pub(super) fn q(&self, i: usize, j: usize) -> f64 {
        if j >= self.shard.real {
            return 0.0;
        }
        match self.targets[i] {
            None => 0.0,
            Some(t) if t == self.shard.start + j => self.q.0,
            Some(_) => self.q.1,
        }
    }

    /// `Σ_j q_ij W_j` over this shard: `q_other Σ_j W_j + (q_target -
    /// q_other) W_t` when the target is here. `[n, h]`.
    pub(super) fn target_rows(&self, w_real: ArrayView2<f64>) -> Array2<f64> {
        let n = self.targets.len();
        let colsum: Array1<f64> = (0..w_real.ncols())
            .map(|k| sum::sum(w_real.column(k).iter().copied()))
            .collect();
        let mut b = Array2::zeros((n, w_real.ncols()));
        for (i, t) in self.targets.iter().enumerate() {
            let Some(t) = *t else { continue };
            let mut row = b.row_mut(i);
            if self.q.1 != 0.0 {
                row.scaled_add(self.q.1, &colsum);
            }
            if t >= self.shard.start && t < self.shard.start + self.shard.real {
                row.scaled_add(self.q.0 - self.q.1, &w_real.row(t - self.shard.start));
            }
        }
        b
    }

    /// Per-token losses and the loss from the global statistics; the
    /// all-`-inf` row error (identical on every rank).
    pub(super) fn finish(&self, global: &[SoftmaxStats]) -> Result<(Array1<f64>, f64)> {
        for (i, g) in global.iter().enumerate() {
            check_row(i, g, self.targets[i])?;
        }
        self.meter.hold(global.len());
        let per_token: Array1<f64> = global
            .iter()
            .zip(&self.targets)
            .map(|(g, &t)| token_loss(g, t, &self.config))
            .collect();
        let loss = self
            .config
            .reduce(per_token.as_slice().expect("contiguous"), &self.targets);
        Ok((per_token, loss))
    }

    /// This rank's local statistics (`m_i`, `s_i`, target term) of its
    /// logits `z: [n, w_r]`.
    fn local_stats(&self, z: &Array2<f64>) -> Vec<SoftmaxStats> {
        z.rows()
            .into_iter()
            .enumerate()
            .map(|(i, row)| SoftmaxStats::of(&row.to_vec(), |j| self.q(i, j)))
            .collect()
    }

    /// The S state once the global statistics are known: the forward
    /// ([`Self::finish`], with its all-`-inf` row error) and no input
    /// gradient yet.
    fn s_state(
        &self,
        z: Array2<f64>,
        local: Vec<SoftmaxStats>,
        global: Vec<SoftmaxStats>,
        want_grad: bool,
    ) -> Result<SState> {
        let forward = self.finish(&global)?;
        if want_grad {
            check_grad_bound(&self.weights, &global, self.config.z_loss)?;
        }
        Ok(SState {
            z,
            local,
            global,
            forward,
            want_grad,
            grad_hidden: None,
        })
    }

    /// `∂L/∂z_i` in place of the logits `z: [n, w_r]`: `w_i dy(i, j, z_ij)`
    /// through the softcap ([`Self::chain`]), where `dy` is the loss term's
    /// gradient in its logit; 0 for a token of weight 0 and on padding columns.
    fn logit_grads_in_place(&self, z: &mut Array2<f64>, dy: impl Fn(usize, usize, f64) -> f64) {
        let weights = &self.weights;
        for ((i, j), x) in z.indexed_iter_mut() {
            *x = if weights[i] == 0.0 || j >= self.shard.real {
                0.0
            } else {
                self.chain(weights[i] * dy(i, j, *x), *x)
            };
        }
    }

    /// A T pass whose input gradient takes a barrier (naive, alg1): `∂L/∂z`
    /// in place ([`Self::logit_grads_in_place`], `dy(global_i, local_i, i,
    /// j, z_ij)`), then `∂L/∂x = allreduce_sum(∂L/∂z_i W_i)` and `∂L/∂W_i`.
    fn t_then_input_barrier(
        &self,
        s: SState,
        lin: Linear<'_>,
        dy: impl Fn(&SoftmaxStats, &SoftmaxStats, usize, usize, f64) -> f64,
    ) -> Result<RankLoss> {
        let SState {
            mut z,
            local,
            global,
            forward,
            ..
        } = s;
        self.logit_grads_in_place(&mut z, |i, j, zij| dy(&global[i], &local[i], i, j, zij));
        let (gx, gw) = self.linear_grads(&z, lin, true)?;
        Ok(self.output(forward, local, global, (Some(z), gx, gw)))
    }

    pub(super) fn run(self, z: Array2<f64>, lin: Linear<'_>, want_grad: bool) -> Result<RankLoss> {
        let state = self.s_pass(z, lin, want_grad)?;
        self.t_pass(state, lin)
    }

    /// The S pass of the algorithm: everything up to (and including) the
    /// barriers the forward needs; alg2 also forms `∂L/∂x`.
    pub(super) fn s_pass(
        &self,
        z: Array2<f64>,
        lin: Linear<'_>,
        want_grad: bool,
    ) -> Result<SState> {
        match self.algorithm {
            ShardedAlgorithm::Naive => self.naive_s(z, want_grad),
            ShardedAlgorithm::Alg1 => self.alg1_s(z, want_grad),
            ShardedAlgorithm::Alg2 => self.alg2_s(z, lin, want_grad),
        }
    }

    /// The T pass: `∂L/∂z` and `∂L/∂W_i` (naive and alg1 also all-reduce
    /// `∂L/∂x` here; alg2 communicates no more).
    pub(super) fn t_pass(&self, s: SState, lin: Linear<'_>) -> Result<RankLoss> {
        if !s.want_grad {
            return Ok(self.output(s.forward, s.local, s.global, (None, None, None)));
        }
        match self.algorithm {
            ShardedAlgorithm::Naive => self.naive_t(s, lin),
            ShardedAlgorithm::Alg1 => self.alg1_t(s, lin),
            ShardedAlgorithm::Alg2 => self.alg2_t(s, lin),
        }
    }

    /// `∂L/∂x` partial and `∂L/∂W_i` from the gradient `g: [n, w_r]`; the
    /// partial is all-reduced when `all_reduce` (naive, alg1).
    pub(super) fn linear_grads(
        &self,
        g: &Array2<f64>,
        lin: Linear<'_>,
        all_reduce: bool,
    ) -> Result<LinearGrads> {
        let Some((x, w_real)) = lin else {
            return Ok((None, None));
        };
        let real = self.shard.real;
        let g_real = g.slice_axis(Axis(1), Slice::from(..real));
        let mut gx = None;
        if all_reduce {
            self.meter.hold(x.len());
            let mut partial = sum::matmul(g_real, w_real);
            self.comm.all_reduce_sum(
                partial
                    .as_slice_mut()
                    .expect("a fresh product is contiguous"),
            )?;
            gx = Some(partial);
        }
        // The weight-gradient shard is parameter-sized and the same for every
        // algorithm: not counted.
        let mut gw = Array2::zeros((self.shard.width, x.ncols()));
        gw.slice_axis_mut(Axis(0), Slice::from(..real))
            .assign(&g_real.t().dot(&x));
        Ok((gx, Some(gw)))
    }

    pub(super) fn output(
        &self,
        (per_token_loss, loss): (Array1<f64>, f64),
        local: Vec<SoftmaxStats>,
        global: Vec<SoftmaxStats>,
        grads: Grads,
    ) -> RankLoss {
        RankLoss {
            rank: self.shard.rank,
            loss,
            per_token_loss,
            local,
            global,
            grad_logits: grads.0,
            grad_hidden: grads.1,
            grad_weight: grads.2,
            counts: self.comm.counts(),
            peak_bytes: self.meter.peak(),
        }
    }

    /// naive S: `m = allreduce_max(m_i)`; `S = allreduce_sum(s_i against m)`.
    pub(super) fn naive_s(&self, z: Array2<f64>, want_grad: bool) -> Result<SState> {
        let n = z.nrows();
        // Barrier 1: the global max m.
        self.meter.hold(n);
        let mut max: Vec<f64> = z
            .rows()
            .into_iter()
            .map(|r| r.fold(f64::NEG_INFINITY, |a, &b| a.max(b)))
            .collect();
        self.comm.all_reduce_max(&mut max)?;
        // Barrier 2: the global sum against m, as [C | Σ_{z<m} exp(z - m) |
        // target term], so that the count of maxima stays an exact integer.
        self.meter.hold(3 * n);
        let mut local = Vec::with_capacity(n);
        let mut sums = vec![0.0; 3 * n];
        for (i, row) in z.rows().into_iter().enumerate() {
            let row = row.to_vec();
            let m = max[i];
            let (target, mass) = target_term(&row, |j| self.q(i, j), m);
            let (at_max, below) = if m == f64::NEG_INFINITY {
                (0.0, 0.0) // nothing enters the sum (V6)
            } else {
                count_and_sum(&row, m)
            };
            sums[i] = at_max;
            sums[n + i] = below;
            sums[2 * n + i] = target;
            local.push(SoftmaxStats {
                max: m,
                rest: (at_max - 1.0) + below,
                target,
                mass,
            });
        }
        self.comm.all_reduce_sum(&mut sums)?;
        let total_mass = |i: usize| if self.targets[i].is_some() { 1.0 } else { 0.0 };
        let global: Vec<SoftmaxStats> = (0..n)
            .map(|i| SoftmaxStats {
                max: max[i],
                rest: (sums[i] - 1.0) + sums[n + i],
                target: sums[2 * n + i],
                mass: total_mass(i),
            })
            .collect();
        self.s_state(z, local, global, want_grad)
    }

    /// naive T: `∂L/∂z` from the global statistics, then `∂L/∂x =
    /// allreduce_sum(∂L/∂z_i W_i)`.
    pub(super) fn naive_t(&self, s: SState, lin: Linear<'_>) -> Result<RankLoss> {
        // Backward: ∂L/∂z = w_i (softmax - q + 2 c lse softmax), in place;
        // barrier 3: the input gradient.
        self.t_then_input_barrier(s, lin, |g, _, i, j, zij| {
            g.gradient(zij, self.q(i, j), self.config.z_loss)
        })
    }

    /// alg1: S pass (local `m_i`, `s_i`, target term) → one merged barrier →
    /// T pass (rescale the local softmax by `alpha_i`) → the input-gradient
    /// barrier.
    pub(super) fn alg1_s(&self, z: Array2<f64>, want_grad: bool) -> Result<SState> {
        let n = z.nrows();
        // S pass.
        let local = self.local_stats(&z);
        // Barrier 1: (m_i, s_i, target) records, online-softmax merge.
        self.meter.hold(STATS_WIDTH * n);
        let global = merge_stats_over(self.comm, &local)?;
        self.s_state(z, local, global, want_grad)
    }

    /// alg1 T: rescale the local softmax, `∂L/∂z_i`, the input-gradient
    /// barrier, `∂L/∂W_i`.
    pub(super) fn alg1_t(&self, s: SState, lin: Linear<'_>) -> Result<RankLoss> {
        // T pass: softmax = alpha_i softmax'_i, alpha_i = s_i exp(m_i - m) / S;
        // barrier 2: the input gradient.
        let c = self.config.z_loss;
        self.t_then_input_barrier(s, lin, |g, l, i, j, zij| {
            let q = self.q(i, j);
            let p = if zij == f64::NEG_INFINITY {
                0.0
            } else if zij == g.max {
                1.0 / g.sum_exp()
            } else {
                let alpha = l.sum_exp() * l.scale_to(g.max) / g.sum_exp();
                alpha * ((zij - l.max).exp() / l.sum_exp())
            };
            let delta = if zij == g.max { g.delta(zij, q) } else { p - q };
            delta + 2.0 * c * g.logsumexp() * p
        })
    }

    /// alg2: S pass forms the input-gradient partials against the local
    /// softmax → one merged barrier → T pass with no communication. The rank
    /// keeps its logits and recomputes `softmax'_i` in T (as alg1 does; the
    /// paper keeps `softmax'_i` itself — the same memory).
    pub(super) fn alg2_s(
        &self,
        z: Array2<f64>,
        lin: Linear<'_>,
        want_grad: bool,
    ) -> Result<SState> {
        let n = z.nrows();
        let c = self.config.z_loss;
        // S pass: local statistics.
        let local = self.local_stats(&z);
        // softmax'_i - q_i (the stable form for a confident target; -q for an
        // all -inf shard) and softmax'_i.
        let delta = |i: usize, j: usize, zij: f64| local_delta(&local[i], zij, self.q(i, j));
        let prob = |i: usize, zij: f64| local_probability(&local[i], zij);
        let input_grad = want_grad && lin.is_some();
        let h = lin.map_or(0, |(x, _)| x.ncols());
        // Blocks per token after the statistics: s_i D_i and B_i, plus s_i A_i
        // with the z-loss (A_i = softmax'_i W_i, its gradient is 2 c lse p W).
        let layout = Alg2Record::new(h, input_grad, c);
        let (blocks, width) = (layout.blocks, layout.width());
        self.meter.hold(width * n);
        let mut record = vec![0.0; width * n];
        for (i, l) in local.iter().enumerate() {
            record[i * width..i * width + STATS_WIDTH].copy_from_slice(&l.to_record());
        }
        if let (true, Some((_, w_real))) = (input_grad, lin) {
            // D_i = (softmax'_i - q_i) W_i, B_i = q_i W_i, A_i = softmax'_i W_i
            // (with a softcap every term carries its logit's factor dy/dz).
            self.meter.hold(blocks * n * h);
            let f = |i: usize, j: usize, x: f64| self.chain(x, z[[i, j]]);
            let d = sum::matmul_with(n, |i, j| f(i, j, delta(i, j, z[[i, j]])), w_real);
            let b = match self.config.softcap {
                None => self.target_rows(w_real),
                Some(_) => sum::matmul_with(n, |i, j| f(i, j, self.q(i, j)), w_real),
            };
            let a = (blocks == 3)
                .then(|| sum::matmul_with(n, |i, j| f(i, j, prob(i, z[[i, j]])), w_real));
            for (i, l) in local.iter().enumerate() {
                layout.write_partials(
                    &mut record,
                    i,
                    l.sum_exp(),
                    |k| d[[i, k]],
                    |k| b[[i, k]],
                    |k| a.as_ref().map_or(0.0, |a| a[[i, k]]),
                );
            }
            self.meter.free(blocks * n * h);
        }
        // The one barrier.
        let global = layout.all_reduce(self.comm, &mut record)?;
        let state = self.s_state(z, local, global, want_grad)?;
        if !want_grad {
            return Ok(state);
        }
        let weights = &self.weights;
        // ∂L/∂x = w_i (Y / S + 2 c lse U / S), Y / S = Σ_j (p_j - q_j) W_j and
        // U / S = Σ_j p_j W_j: no more communication.
        let gx = input_grad.then(|| {
            self.meter.hold(n * h);
            layout.input_grad(&record, &state.global, weights, c)
        });
        Ok(SState {
            grad_hidden: gx,
            ..state
        })
    }

    /// alg2 T: `∂L/∂z_i` from the local softmax rescaled by `alpha_i`, and
    /// `∂L/∂W_i` — no communication.
    pub(super) fn alg2_t(&self, s: SState, lin: Linear<'_>) -> Result<RankLoss> {
        let SState {
            mut z,
            local,
            global,
            forward,
            grad_hidden: gx,
            ..
        } = s;
        let c = self.config.z_loss;
        let delta = |i: usize, j: usize, zij: f64| local_delta(&local[i], zij, self.q(i, j));
        let prob = |i: usize, zij: f64| local_probability(&local[i], zij);
        // T pass: p = alpha_i softmax'_i and p - q = alpha_i (softmax'_i - q)
        // + (alpha_i - 1) q, with alpha_i - 1 = (s_i - S) / S exactly when
        // m_i = m.
        self.logit_grads_in_place(&mut z, |i, j, zij| {
            let (g, l) = (&global[i], &local[i]);
            let q = self.q(i, j);
            let alpha = l.sum_exp() * l.scale_to(g.max) / g.sum_exp();
            let alpha_minus_1 = if l.max == g.max {
                (l.rest - g.rest) / g.sum_exp()
            } else {
                alpha - 1.0
            };
            let d = alpha * delta(i, j, zij) + alpha_minus_1 * q;
            let p = alpha * prob(i, zij);
            d + 2.0 * c * g.logsumexp() * p
        });
        let (_, gw) = self.linear_grads(&z, lin, false)?;
        Ok(self.output(forward, local, global, (Some(z), gx, gw)))
    }
}

/// `softmax'_j - q_j` of the local softmax `l` (the stable form for a
/// confident target; `-q` for an all `-inf` shard): one element of a shard's
/// local gradient before alg2's T-pass correction (Yeung et al.,
/// arXiv:2411.05288, Algorithm 2).
///
/// `l`: the row's statistics over this shard's columns; `zij`: the
/// shard-local logit of token `i`, column `j` (softcapped where the call
/// asks for it); `q`: the target distribution's entry for that token and
/// column (`q_ij`: the target's weight at the target column, the label
/// smoothing share elsewhere, 0 for padding and ignored tokens). Unitless;
/// never fails.
pub fn local_delta(l: &SoftmaxStats, zij: f64, q: f64) -> f64 {
    if l.sum_exp() == 0.0 {
        -q
    } else {
        l.delta(zij, q)
    }
}

/// `softmax'_j` of the local softmax `l` (0 for an all `-inf` shard): the
/// local probability alg2's T pass rescales to the global softmax (Yeung et
/// al., arXiv:2411.05288, Algorithm 2). `l` and `zij` as in
/// [`local_delta`]. Unitless; never fails.
pub fn local_probability(l: &SoftmaxStats, zij: f64) -> f64 {
    if l.sum_exp() == 0.0 {
        0.0
    } else {
        l.probability(zij)
    }
}
