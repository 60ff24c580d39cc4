//! The vocabulary split over `p` shards, and the three algorithms that compute
//! the output layer's softmax / cross-entropy over the shards exactly
//! (Yeung et al., arXiv:2411.05288, §4; Megatron-LM's
//! `VocabParallelCrossEntropy` is the naive one).
//!
//! Shard `r` holds the columns `start_r .. start_r + w_r` of the logits (rows
//! of the output weight `[v, h]`); the hidden states `[n, h]` and the targets
//! `[n]` are replicated on every rank (as after the pipeline's broadcast of
//! the last stage's output). Each algorithm is per-rank code over a
//! [`Collective`]; [`sharded_cross_entropy`] and
//! [`sharded_linear_cross_entropy`] run it on `p` in-process ranks.
//!
//! ## The algorithms (notation of [`super`])
//!
//! **naive** (Megatron; paper §4.1). Forward: `m = allreduce_max(m_i)`
//! (barrier 1); `S = allreduce_sum(Σ_{j in shard} exp(z_j - m))` with the
//! target term (barrier 2); backward: `∂L/∂z = softmax - q` locally,
//! `∂L/∂x = allreduce_sum(∂L/∂z_i W_i)` (barrier 3), `∂L/∂W_i = ∂L/∂z_i^T x`
//! locally. **3 barriers.**
//!
//! **alg1** (paper §4.2, Algorithm 1). S pass: local `m_i`, `s_i` and the
//! target term; one barrier reduces the `[n]` records `(m_i, s_i, target)`
//! with the online-softmax merge (so `m`, the target logit and the rescaled sum
//! `S = Σ_i s_i exp(m_i - m)` arrive together). T pass: rescale the local
//! softmax, `softmax = alpha_i softmax'_i` with `alpha_i = s_i exp(m_i - m) / S`,
//! form `∂L/∂z_i`, and all-reduce `∂L/∂x` (barrier 2). **2 barriers.**
//!
//! **alg2** (paper §4.3, Algorithm 2). S pass forms the input-gradient
//! partials against the *local* softmax, `D_i = (softmax'_i - q_i) W_i` and
//! `B_i = q_i W_i`, and sends them with the statistics in one merged
//! all-reduce: the merge rescales them by `alpha_i`, so the result is `∂L/∂x =
//! Σ_i alpha_i D_i + Σ_i (alpha_i - 1) B_i` (which is `Σ_i alpha_i softmax'_i
//! W_i - q W`, with the target row's cancellation done exactly). T pass:
//! `∂L/∂z_i = alpha_i (softmax'_i - q_i) + (alpha_i - 1) q_i`, `∂L/∂W_i` — no
//! communication. **1 barrier** for the whole vocabulary pass.
//!
//! Forward only (no gradients), or on given logits (no input gradient), naive
//! needs 2 barriers and alg1, alg2 one each; see [`ShardedAlgorithm::barriers`].
//!
//! ## Padding, masking, `-inf`
//!
//! In the padded layout the entries `v..` of the last shards are padding: their
//! logits are set to `-inf` before anything reads them (so they never enter
//! the softmax, whatever the caller put there) and their gradients are 0
//! (docs/FAULTS.md V2). A shard whose logits are all `-inf` — all padding, or all
//! masked — has `m_i = -inf`, `s_i = 0` and contributes exactly 0 (V6).

mod map;
mod merge;
mod passes;
mod rank;

use ndarray::{Array1, Array2, ArrayView2};
use serde::Serialize;

use super::collective::{run_ranks, CollectiveCounts};
use super::cross_entropy::{check_linear, check_logits, SoftmaxStats};
use super::{check_logits_size, LossCall};
use crate::error::Result;

pub use map::{Shard, ShardLayout, ShardMap, MAX_SHARDS};
pub use merge::{merge_alg2, merge_alg2_z_loss, merge_stats, merge_stats_over, Alg2Record};
pub use passes::{local_delta, local_probability};
pub use rank::{
    check_rank_inputs, cross_entropy_rank, linear_cross_entropy_rank, linear_cross_entropy_rank_s,
    Meter, OutputSPass, RankLoss,
};

/// The three vocabulary-parallel algorithms (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ShardedAlgorithm {
    /// Global max, then global sum, then the input-gradient all-reduce.
    Naive,
    /// Paper Algorithm 1: one merged barrier in S, one for the input gradient.
    Alg1,
    /// Paper Algorithm 2: input-gradient partials formed in S, one barrier.
    Alg2,
}

impl ShardedAlgorithm {
    /// Every algorithm, in the order reports list them.
    pub const ALL: [ShardedAlgorithm; 3] = [
        ShardedAlgorithm::Naive,
        ShardedAlgorithm::Alg1,
        ShardedAlgorithm::Alg2,
    ];

    /// The barriers the algorithm needs: for the output layer with gradients
    /// (`linear && want_grad`) 3, 2, 1 for naive, alg1, alg2; otherwise (no
    /// input gradient to all-reduce) 2, 1, 1.
    pub fn barriers(self, linear: bool, want_grad: bool) -> u64 {
        let input_grad = linear && want_grad;
        match self {
            ShardedAlgorithm::Naive => 2 + u64::from(input_grad),
            ShardedAlgorithm::Alg1 => 1 + u64::from(input_grad),
            ShardedAlgorithm::Alg2 => 1,
        }
    }
}

/// A sharded run's plan: `algorithm` on the vocabulary split `map` (the two
/// travel together through every sharded loss,
/// [`crate::ops::CrossEntropyOp::sharded_cross_entropy`] and
/// [`crate::ops::LinearCrossEntropyOp::sharded_linear_cross_entropy`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardPlan {
    /// The algorithm every rank runs.
    pub algorithm: ShardedAlgorithm,
    /// The split of the vocabulary over the ranks.
    pub map: ShardMap,
}

impl ShardPlan {
    /// `algorithm` on `map`.
    pub fn new(algorithm: ShardedAlgorithm, map: ShardMap) -> Self {
        ShardPlan { algorithm, map }
    }
}

named_options!(display ShardedAlgorithm, field "algorithm", unknown "sharded algorithm", {
    Naive => "naive",
    Alg1 => "alg1",
    Alg2 => "alg2",
});

/// The result of a sharded run: every rank's [`RankLoss`].
#[derive(Debug, Clone, PartialEq)]
pub struct ShardedLoss {
    /// The split.
    pub map: ShardMap,
    /// Each rank's output, in rank order.
    pub ranks: Vec<RankLoss>,
}

impl ShardedLoss {
    /// The loss (rank 0's; see [`ShardedLoss::ranks_agree`]).
    pub fn loss(&self) -> f64 {
        self.ranks[0].loss
    }

    /// `[n]`: per-token losses (rank 0's).
    pub fn per_token_loss(&self) -> &Array1<f64> {
        &self.ranks[0].per_token_loss
    }

    /// `[n]`: `logsumexp` of each row (rank 0's).
    pub fn logsumexp(&self) -> Array1<f64> {
        self.ranks[0]
            .global
            .iter()
            .map(SoftmaxStats::logsumexp)
            .collect()
    }

    /// `[n, v]`: the shards' logit gradients side by side (real columns).
    pub fn grad_logits(&self) -> Option<Array2<f64>> {
        self.gather(|r| r.grad_logits.as_ref())
            .map(|parts| self.map.gather_columns(&parts))
    }

    /// `[n, h]`: `∂L/∂hidden` (rank 0's).
    pub fn grad_hidden(&self) -> Option<&Array2<f64>> {
        self.ranks[0].grad_hidden.as_ref()
    }

    /// `[v, h]`: the shards' weight gradients stacked (real rows).
    pub fn grad_weight(&self) -> Option<Array2<f64>> {
        self.gather(|r| r.grad_weight.as_ref())
            .map(|parts| self.map.gather_rows(&parts))
    }

    fn gather(&self, f: impl Fn(&RankLoss) -> Option<&Array2<f64>>) -> Option<Vec<Array2<f64>>> {
        self.ranks.iter().map(|r| f(r).cloned()).collect()
    }

    /// The collectives (rank 0's).
    pub fn counts(&self) -> CollectiveCounts {
        self.ranks[0].counts
    }

    /// The largest peak over the ranks, in bytes.
    pub fn peak_bytes(&self) -> usize {
        self.ranks.iter().map(|r| r.peak_bytes).max().unwrap_or(0)
    }

    /// Whether every rank holds bitwise the same replicated outputs (loss,
    /// per-token loss, global statistics, `∂L/∂hidden`, counts).
    pub fn ranks_agree(&self) -> bool {
        let bits = |a: &Array1<f64>| a.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let first = &self.ranks[0];
        self.ranks.iter().all(|r| {
            r.loss.to_bits() == first.loss.to_bits()
                && bits(&r.per_token_loss) == bits(&first.per_token_loss)
                && r.global.iter().zip(&first.global).all(|(a, b)| {
                    a.to_record()
                        .iter()
                        .zip(b.to_record())
                        .all(|(x, y)| x.to_bits() == y.to_bits())
                })
                && match (&r.grad_hidden, &first.grad_hidden) {
                    (Some(a), Some(b)) => a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                    (None, None) => true,
                    _ => false,
                }
                && r.counts == first.counts
        })
    }
}

/// Validates like the unsharded reference (so errors are the same), bounds
/// the sizes, then runs `p` in-process ranks of `algorithm` on `logits: [n,
/// w]` (`w >= v`; columns `v..` are padding values, masked) and `targets: [n]`.
///
/// # Errors
/// As [`super::cross_entropy()`]; [`Error::ShapeMismatch`](crate::error::Error::ShapeMismatch) for `w < v`.
pub fn sharded_cross_entropy(
    algorithm: ShardedAlgorithm,
    map: &ShardMap,
    logits: ArrayView2<f64>,
    call: &LossCall,
) -> Result<ShardedLoss> {
    let (n, w) = logits.dim();
    let v = map.vocab_size();
    map.check_width("logits", w, &[n, w], "[n, v]")?;
    check_inputs(n, call, v)?;
    check_logits("logits", logits, v, v, 0)?;
    check_logits_size("logits", n, map.padded_vocab_size())?;
    let parts = map.split_columns(logits, "logits")?;
    let ranks = run_ranks(map.num_shards(), |comm| {
        cross_entropy_rank(comm, algorithm, map, parts[comm.rank()].view(), call)
    })?;
    Ok(ShardedLoss {
        map: *map,
        ranks: ranks.into_iter().map(|r| r.output).collect(),
    })
}

/// As [`sharded_cross_entropy`] for the output layer: `hidden: [n, h]`,
/// `weight: [w, h]` (`w >= v`; rows `v..` are padding rows, never read).
///
/// # Errors
/// As [`super::linear_cross_entropy`]; [`Error::ShapeMismatch`](crate::error::Error::ShapeMismatch) for `w < v`.
pub fn sharded_linear_cross_entropy(
    algorithm: ShardedAlgorithm,
    map: &ShardMap,
    hidden: ArrayView2<f64>,
    weight: ArrayView2<f64>,
    call: &LossCall,
) -> Result<ShardedLoss> {
    let n = hidden.nrows();
    let v = map.vocab_size();
    map.check_width("weight", weight.nrows(), weight.shape(), "[v, h]")?;
    check_inputs(n, call, v)?;
    check_linear(hidden, weight, v, 0)?;
    check_logits_size("weight", n, map.padded_vocab_size())?;
    let parts = map.split_rows(weight, "weight")?;
    let ranks = run_ranks(map.num_shards(), |comm| {
        let weight = parts[comm.rank()].view();
        linear_cross_entropy_rank(comm, algorithm, map, hidden, weight, call)
    })?;
    Ok(ShardedLoss {
        map: *map,
        ranks: ranks.into_iter().map(|r| r.output).collect(),
    })
}

/// The checks of a whole sharded run before any rank starts: `targets` is
/// `[n]`, `config` is valid for `v` entries, every target is in range or
/// ignored. Shared with the other implementations of the algorithms (the
/// optimized `alg2`).
///
/// # Errors
/// [`Error::ShapeMismatch`](crate::error::Error::ShapeMismatch) naming `targets`; [`super::LossConfig::validate`]'s and
/// [`super::LossConfig::targets`]'.
pub fn check_inputs(n: usize, call: &LossCall, v: usize) -> Result<()> {
    call.check_rows(n, "the rows of the logits", v)?;
    call.config.targets(call.targets, v)?;
    Ok(())
}
