//! One rank of a sharded loss: its results, its memory meter, the per-rank
//! entry points and the checks every rank makes first.

use ndarray::{Array1, Array2, ArrayView2, Axis, Slice};

use super::super::collective::Collective;
use super::super::cross_entropy::{check_linear, check_logits, SoftmaxStats, STATS_WIDTH};
use super::super::{check_logits_size, LossCall, LossConfig};
use crate::error::{Error, Result};

use super::super::collective::CollectiveCounts;
use super::{Shard, ShardMap, ShardedAlgorithm};

/// What one rank computes. Replicated outputs (`loss`, `per_token_loss`,
/// `global`, `grad_hidden`) are bitwise identical on every rank.
#[derive(Debug, Clone, PartialEq)]
pub struct RankLoss {
    /// The rank.
    pub rank: usize,
    /// The reduced loss (as [`super::CrossEntropy::loss`]).
    pub loss: f64,
    /// `[n]`: per-token losses.
    pub per_token_loss: Array1<f64>,
    /// `[n]`: this shard's statistics as the rank contributed them: relative to
    /// its own maximum `m_i` (alg1, alg2) or to the global `m` (naive).
    pub local: Vec<SoftmaxStats>,
    /// `[n]`: the whole row's statistics after the barrier (`m`, `S`, target).
    pub global: Vec<SoftmaxStats>,
    /// `[n, w_r]`: `∂L/∂z` of this shard's columns (padding columns 0).
    pub grad_logits: Option<Array2<f64>>,
    /// `[n, h]`: `∂L/∂hidden` (output layer only).
    pub grad_hidden: Option<Array2<f64>>,
    /// `[w_r, h]`: `∂L/∂W` of this shard's rows (padding rows 0; output layer only).
    pub grad_weight: Option<Array2<f64>>,
    /// The collectives the rank issued.
    pub counts: CollectiveCounts,
    /// The most bytes of f64 buffers the rank held at once (see [`Meter`]).
    pub peak_bytes: usize,
}

/// Counts the bytes of the working f64 buffers a rank allocates and keeps
/// alive: the logits / gradient buffer `[n, w_r]` (one, updated in place),
/// collective buffers, the input-gradient partials `[n, h]` and the per-token
/// vectors. Not counted: inputs (hidden states, the weight shard, given
/// logits) and the weight-gradient shard `[w_r, h]` (parameter-sized, the
/// same for every algorithm).
#[derive(Debug, Clone, Default)]
pub struct Meter {
    live: std::cell::Cell<usize>,
    peak: std::cell::Cell<usize>,
}

impl Meter {
    /// A buffer of `elements` f64 is allocated.
    pub fn hold(&self, elements: usize) {
        self.live.set(self.live.get() + 8 * elements);
        self.peak.set(self.peak.get().max(self.live.get()));
    }

    /// A buffer of `elements` f64 is freed.
    pub fn free(&self, elements: usize) {
        self.live.set(self.live.get().saturating_sub(8 * elements));
    }

    /// The peak so far, in bytes.
    pub fn peak(&self) -> usize {
        self.peak.get()
    }
}

/// The output layer on one rank: `hidden: [n, h]` (replicated), this rank's
/// rows `weight: [w_r, h]` of the output weight (`w_r` and the real rows as
/// `map.shard(comm.rank())` says; padding rows are never read), `targets:
/// [n]` (replicated, global ids). Computes the rank's logits `hidden @
/// weight^T`, then as [`cross_entropy_rank`], and with `want_grad` also
/// `∂L/∂hidden` (replicated) and this shard's `∂L/∂W`.
///
/// # Errors
/// [`Error::InvalidArgument`] when `comm.size() != p`; shape, finiteness and
/// target errors as the unsharded [`super::linear_cross_entropy`] (every rank
/// finds the replicated ones; a bad value in a weight shard is found by its
/// rank); collective failures.
pub fn linear_cross_entropy_rank(
    comm: &dyn Collective,
    algorithm: ShardedAlgorithm,
    map: &ShardMap,
    hidden: ArrayView2<f64>,
    weight: ArrayView2<f64>,
    call: &LossCall,
) -> Result<RankLoss> {
    let (rank, z) = output_rank_setup(comm, algorithm, map, (hidden, weight), call)?;
    let w_real = weight.slice_axis(Axis(0), Slice::from(..rank.shard.real));
    rank.run(z, Some((hidden, w_real)), call.want_grad())
}

/// Checks one rank's output-layer inputs and computes its logits `[n, w_r]`
/// (padding columns `-inf`).
fn output_rank_setup<'a>(
    comm: &'a dyn Collective,
    algorithm: ShardedAlgorithm,
    map: &ShardMap,
    (hidden, weight): (ArrayView2<f64>, ArrayView2<f64>),
    call: &LossCall,
) -> Result<(RankRun<'a>, Array2<f64>)> {
    let rank = RankRun::new(comm, algorithm, map, hidden.nrows(), call)?;
    let shard = rank.shard;
    if weight.nrows() != shard.width {
        return Err(Error::ShapeMismatch {
            field: "weight".into(),
            expected: format!("[w_r, h] with w_r = {} (shard {})", shard.width, shard.rank),
            actual: weight.shape().to_vec(),
        });
    }
    check_linear(hidden, weight, shard.real, shard.start)?;
    check_logits_size("weight", hidden.nrows(), map.padded_vocab_size())?;
    super::super::check_linear_work(hidden.nrows(), map.padded_vocab_size(), hidden.ncols())?;
    let n = hidden.nrows();
    rank.meter.hold(n * shard.width);
    let mut z = Array2::from_elem((n, shard.width), f64::NEG_INFINITY);
    let w_real = weight.slice_axis(Axis(0), Slice::from(..shard.real));
    z.slice_axis_mut(Axis(1), Slice::from(..shard.real))
        .assign(&hidden.dot(&w_real.t()));
    rank.cap(&mut z);
    Ok((rank, z))
}

/// The output layer on one rank, split into its S and T passes so that a
/// pipeline schedule can put other work between them (arXiv:2411.05288 §5:
/// the S and T passes are inserted into 1F1B). Returned by
/// [`linear_cross_entropy_rank_s`]; [`OutputSPass::t_pass`] finishes it.
///
/// What each algorithm does where (the barriers each pass issues):
///
/// | algorithm | S pass | T pass |
/// |---|---|---|
/// | naive | logits, max (barrier), sum (barrier), loss | `∂L/∂z_i`, `∂L/∂x` (barrier), `∂L/∂W_i` |
/// | alg1 | logits, `m_i`, `s_i` (one merged barrier), loss | `∂L/∂z_i`, `∂L/∂x` (barrier), `∂L/∂W_i` |
/// | alg2 | logits, `m_i`, `s_i` and the `∂L/∂x` partials (one merged barrier), loss, `∂L/∂x` | `∂L/∂z_i`, `∂L/∂W_i` (no communication) |
///
/// `S` then `T` computes bit for bit what [`linear_cross_entropy_rank`] does.
#[derive(Debug, Clone)]
pub struct OutputSPass {
    algorithm: ShardedAlgorithm,
    shard: Shard,
    config: LossConfig,
    targets: Vec<Option<usize>>,
    weights: Vec<f64>,
    q: (f64, f64),
    meter: Meter,
    state: SState,
}

impl OutputSPass {
    /// The reduced loss (replicated on every rank).
    pub fn loss(&self) -> f64 {
        self.state.forward.1
    }

    /// `[n]`: the per-token losses.
    pub fn per_token_loss(&self) -> &Array1<f64> {
        &self.state.forward.0
    }

    /// `[n, h]`: `∂L/∂hidden` when the S pass formed it (alg2 with
    /// gradients; replicated on every rank), else `None` (naive and alg1 form
    /// it in the T pass).
    pub fn grad_hidden(&self) -> Option<&Array2<f64>> {
        self.state.grad_hidden.as_ref()
    }

    /// A planted bug for negative controls (the multi-process pipeline's
    /// check, `packshard-pipeline --plant-bug t-shard-offset`): the T pass
    /// reads this rank's shard as starting at vocabulary row `start` instead
    /// of its own, so the target column of the one-hot subtraction is looked
    /// up at the wrong offset (the pattern of an output layer's shard offset
    /// wrong in the T pass). Never call it outside a negative control.
    pub fn with_wrong_shard_start(mut self, start: usize) -> Self {
        self.shard.start = start;
        self
    }

    /// The algorithm.
    pub fn algorithm(&self) -> ShardedAlgorithm {
        self.algorithm
    }

    /// Bytes of the working buffers held between the passes (the `[n, w_r]`
    /// logits, the statistics and, for alg2, `∂L/∂x`).
    pub fn held_bytes(&self) -> usize {
        let s = &self.state;
        8 * (s.z.len()
            + (s.local.len() + s.global.len()) * STATS_WIDTH
            + s.forward.0.len()
            + s.grad_hidden.as_ref().map_or(0, |g| g.len()))
    }

    /// The T pass, on the same rank with the same `hidden: [n, h]` and
    /// `weight: [w_r, h]` as the S pass (the T pass of naive and alg1 issues
    /// the input-gradient barrier, so every rank calls it in the same order).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for another rank's collective;
    /// [`Error::ShapeMismatch`] for inputs of other shapes than the S pass
    /// had; collective failures.
    pub fn t_pass(
        self,
        comm: &dyn Collective,
        hidden: ArrayView2<f64>,
        weight: ArrayView2<f64>,
    ) -> Result<RankLoss> {
        if comm.rank() != self.shard.rank {
            return Err(Error::invalid(
                "collective",
                format!(
                    "the S pass ran on rank {}, the T pass on rank {}",
                    self.shard.rank,
                    comm.rank()
                ),
            ));
        }
        let (n, w) = self.state.z.dim();
        if hidden.nrows() != n || weight.nrows() != w || weight.ncols() != hidden.ncols() {
            return Err(Error::ShapeMismatch {
                field: "weight".into(),
                expected: format!("hidden [n, h] with n = {n} and weight [w_r, h] with w_r = {w}, as in the S pass"),
                actual: weight.shape().to_vec(),
            });
        }
        let run = RankRun {
            comm,
            algorithm: self.algorithm,
            shard: self.shard,
            config: self.config,
            targets: self.targets,
            weights: self.weights,
            q: self.q,
            meter: self.meter,
        };
        let w_real = weight.slice_axis(Axis(0), Slice::from(..self.shard.real));
        run.t_pass(self.state, Some((hidden, w_real)))
    }
}

/// The S pass of the output layer on one rank (see [`OutputSPass`]); the
/// arguments and checks are those of [`linear_cross_entropy_rank`].
///
/// # Errors
/// As [`linear_cross_entropy_rank`].
pub fn linear_cross_entropy_rank_s(
    comm: &dyn Collective,
    algorithm: ShardedAlgorithm,
    map: &ShardMap,
    hidden: ArrayView2<f64>,
    weight: ArrayView2<f64>,
    call: &LossCall,
) -> Result<OutputSPass> {
    let (rank, z) = output_rank_setup(comm, algorithm, map, (hidden, weight), call)?;
    let shard = rank.shard;
    let w_real = weight.slice_axis(Axis(0), Slice::from(..shard.real));
    let state = rank.s_pass(z, Some((hidden, w_real)), call.want_grad())?;
    Ok(OutputSPass {
        algorithm,
        shard,
        config: rank.config,
        targets: rank.targets,
        weights: rank.weights,
        q: rank.q,
        meter: rank.meter,
        state,
    })
}

/// Cross-entropy on one rank, from its shard of the logits `logits: [n, w_r]`
/// (padding columns may hold anything; they are masked to `-inf`) and the
/// replicated `targets: [n]` (global ids). The loss and per-token losses are
/// those of the whole row; with `want_grad`, `∂L/∂z` of this shard.
///
/// # Errors
/// As [`linear_cross_entropy_rank`], for the logits as the unsharded
/// [`super::cross_entropy()`] checks them (flat indices are global).
pub fn cross_entropy_rank(
    comm: &dyn Collective,
    algorithm: ShardedAlgorithm,
    map: &ShardMap,
    logits: ArrayView2<f64>,
    call: &LossCall,
) -> Result<RankLoss> {
    let n = logits.nrows();
    let rank = RankRun::new(comm, algorithm, map, n, call)?;
    let shard = rank.shard;
    if logits.ncols() != shard.width {
        return Err(Error::ShapeMismatch {
            field: "logits".into(),
            expected: format!("[n, w_r] with w_r = {} (shard {})", shard.width, shard.rank),
            actual: logits.shape().to_vec(),
        });
    }
    check_logits("logits", logits, shard.real, map.vocab_size(), shard.start)?;
    rank.meter.hold(n * shard.width);
    let mut z = logits.to_owned();
    z.slice_axis_mut(Axis(1), Slice::from(shard.real..))
        .fill(f64::NEG_INFINITY);
    rank.cap(&mut z);
    rank.run(z, None, call.want_grad())
}

/// The state of one rank's run.
pub(super) struct RankRun<'a> {
    pub(super) comm: &'a dyn Collective,
    pub(super) algorithm: ShardedAlgorithm,
    pub(super) shard: Shard,
    pub(super) config: LossConfig,
    pub(super) targets: Vec<Option<usize>>,
    /// `[n]`: each token's gradient weight ([`LossCall::token_weights`]).
    pub(super) weights: Vec<f64>,
    /// `(q_target, q_other)`.
    pub(super) q: (f64, f64),
    pub(super) meter: Meter,
}

pub(super) type Linear<'x> = Option<(ArrayView2<'x, f64>, ArrayView2<'x, f64>)>;

/// What an S pass leaves for its T pass on one rank.
#[derive(Debug, Clone)]
pub(super) struct SState {
    /// `[n, w_r]`: the logits (turned into `∂L/∂z_i` in place by T).
    pub(super) z: Array2<f64>,
    pub(super) local: Vec<SoftmaxStats>,
    pub(super) global: Vec<SoftmaxStats>,
    /// Per-token losses and the loss.
    pub(super) forward: (Array1<f64>, f64),
    pub(super) want_grad: bool,
    /// `∂L/∂x`, when S forms it (alg2).
    pub(super) grad_hidden: Option<Array2<f64>>,
}

/// `(∂L/∂x, ∂L/∂W_i)`.
pub(super) type LinearGrads = (Option<Array2<f64>>, Option<Array2<f64>>);
/// `(∂L/∂z_i, ∂L/∂x, ∂L/∂W_i)`.
pub(super) type Grads = (
    Option<Array2<f64>>,
    Option<Array2<f64>>,
    Option<Array2<f64>>,
);

/// The checks every rank of a sharded loss makes before any work: the
/// collective has one rank per shard of `map`, `targets` is `[n]`, and
/// `config` is valid for the map's vocabulary. Shared by the reference's
/// algorithms and other implementations of them (the optimized `alg2`).
///
/// # Errors
/// [`Error::InvalidArgument`] (`num_shards`) for a collective of another
/// size, [`Error::ShapeMismatch`] (`targets`), and [`LossConfig::validate`]'s.
pub fn check_rank_inputs(
    comm: &dyn Collective,
    map: &ShardMap,
    n: usize,
    call: &LossCall,
) -> Result<()> {
    if comm.size() != map.num_shards() {
        return Err(Error::invalid(
            "num_shards",
            format!(
                "the shard map has {} shards but the collective {} ranks",
                map.num_shards(),
                comm.size()
            ),
        ));
    }
    call.check_rows(n, "", map.vocab_size())
}
