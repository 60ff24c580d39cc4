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
//! (FAULTS.md V2). A shard whose logits are all `-inf` — all padding, or all
//! masked — has `m_i = -inf`, `s_i = 0` and contributes exactly 0 (V6).

use std::fmt;
use std::str::FromStr;

use ndarray::{Array1, Array2, ArrayView2, Axis, Slice};
use serde::Serialize;

use super::collective::{run_ranks, Collective, CollectiveCounts, Reduce, MAX_RANKS};
use super::cross_entropy::{
    check_linear, check_logits, check_row, count_and_sum, target_term, token_loss, SoftmaxStats,
    STATS_WIDTH,
};
use super::sum;
use super::{check_logits_size, LossConfig};
use crate::error::{Error, Result};

/// The most shards a [`ShardMap`] may have (each in-process rank is a thread).
pub const MAX_SHARDS: usize = MAX_RANKS;

/// How `v` entries are split over `p` shards when `p` does not divide `v`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ShardLayout {
    /// Contiguous shards of `ceil(v / p)` or `floor(v / p)` entries, the
    /// larger ones first (`numpy.array_split`, `torch.tensor_split`).
    #[default]
    Uneven,
    /// The vocabulary padded to `p * ceil(v / p)` (Megatron's padded vocab);
    /// every shard holds `ceil(v / p)` columns, the last ones padding.
    Padded,
}

impl ShardLayout {
    /// The name used in JSON and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            ShardLayout::Uneven => "uneven",
            ShardLayout::Padded => "padded",
        }
    }
}

impl FromStr for ShardLayout {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "uneven" => Ok(ShardLayout::Uneven),
            "padded" => Ok(ShardLayout::Padded),
            _ => Err(Error::invalid(
                "layout",
                format!("unknown shard layout {s:?}; expected uneven or padded"),
            )),
        }
    }
}

/// One shard: the columns `start .. start + width` of the (padded)
/// vocabulary, of which the first `real` are real entries (`< v`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct Shard {
    /// Its rank.
    pub rank: usize,
    /// Global index of its first column.
    pub start: usize,
    /// Columns it holds (`w_r`).
    pub width: usize,
    /// Of which real (the rest is padding).
    pub real: usize,
}

/// The split of a vocabulary of `v` entries over `p` shards.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct ShardMap {
    vocab_size: usize,
    num_shards: usize,
    layout: ShardLayout,
}

impl ShardMap {
    /// `v` entries over `p` shards.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for `v = 0`, `p = 0`, `p > v` (a shard
    /// would hold no entry) or `p > MAX_SHARDS`. `p` need not divide `v`
    /// (FAULTS.md V4).
    pub fn new(vocab_size: usize, num_shards: usize, layout: ShardLayout) -> Result<Self> {
        if vocab_size == 0 {
            return Err(Error::invalid("vocab_size", "the vocabulary is empty"));
        }
        if num_shards == 0 {
            return Err(Error::invalid("num_shards", "must be at least 1"));
        }
        if num_shards > vocab_size {
            return Err(Error::invalid(
                "num_shards",
                format!("{num_shards} shards for a vocabulary of {vocab_size}: p must be <= v"),
            ));
        }
        if num_shards > MAX_SHARDS {
            return Err(Error::invalid(
                "num_shards",
                format!("{num_shards} shards; at most {MAX_SHARDS} are supported"),
            ));
        }
        Ok(ShardMap {
            vocab_size,
            num_shards,
            layout,
        })
    }

    /// `v`, the real vocabulary size.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// `p`.
    pub fn num_shards(&self) -> usize {
        self.num_shards
    }

    /// The layout.
    pub fn layout(&self) -> ShardLayout {
        self.layout
    }

    /// Columns over all shards: `v` (uneven) or `p * ceil(v / p)` (padded).
    pub fn padded_vocab_size(&self) -> usize {
        match self.layout {
            ShardLayout::Uneven => self.vocab_size,
            ShardLayout::Padded => self.num_shards * self.vocab_size.div_ceil(self.num_shards),
        }
    }

    /// Shard `rank` (`rank < p`).
    pub fn shard(&self, rank: usize) -> Shard {
        let (v, p) = (self.vocab_size, self.num_shards);
        match self.layout {
            ShardLayout::Uneven => {
                let (base, extra) = (v / p, v % p);
                let width = base + usize::from(rank < extra);
                Shard {
                    rank,
                    start: rank * base + rank.min(extra),
                    width,
                    real: width,
                }
            }
            ShardLayout::Padded => {
                let k = v.div_ceil(p);
                let start = rank * k;
                Shard {
                    rank,
                    start,
                    width: k,
                    real: v.saturating_sub(start).min(k),
                }
            }
        }
    }

    /// Every shard, in rank order.
    pub fn shards(&self) -> Vec<Shard> {
        (0..self.num_shards).map(|r| self.shard(r)).collect()
    }

    /// The shard holding vocabulary entry `id` and its local column; `None`
    /// for `id >= v`.
    pub fn owner(&self, id: usize) -> Option<(usize, usize)> {
        self.shards()
            .into_iter()
            .find(|s| id >= s.start && id < s.start + s.real)
            .map(|s| (s.rank, id - s.start))
    }

    /// The shards' column ranges, e.g. `v 10, p 3, padded to 12: [0, 4) [4, 8)
    /// [8, 10) + 2 padding`.
    pub fn describe(&self) -> String {
        let ranges: Vec<String> = self
            .shards()
            .iter()
            .map(|s| {
                let pad = s.width - s.real;
                let range = format!("[{}, {})", s.start, s.start + s.real);
                if pad > 0 {
                    format!("{range} + {pad} padding")
                } else {
                    range
                }
            })
            .collect();
        let padded = if self.padded_vocab_size() > self.vocab_size {
            format!(" padded to {}", self.padded_vocab_size())
        } else {
            String::new()
        };
        format!(
            "v {}, p {}, {}{padded}: {}",
            self.vocab_size,
            self.num_shards,
            self.layout.name(),
            ranges.join(" ")
        )
    }

    /// Splits `full: [n, w]` (`w >= v`; columns `v..` are padding values)
    /// into the `p` shards `[n, w_r]`. Padding columns the caller did not give
    /// are NaN: anything that reads them shows.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when `w < v`.
    pub fn split_columns(&self, full: ArrayView2<f64>, field: &str) -> Result<Vec<Array2<f64>>> {
        let (n, w) = full.dim();
        self.check_width(field, w, &[n, w], "[n, v]")?;
        Ok(self
            .shards()
            .iter()
            .map(|s| {
                Array2::from_shape_fn((n, s.width), |(i, j)| {
                    let g = s.start + j;
                    if g < w {
                        full[[i, g]]
                    } else {
                        f64::NAN
                    }
                })
            })
            .collect())
    }

    /// Splits `full: [w, h]` (`w >= v` rows, rows `v..` padding) into the `p`
    /// shards `[w_r, h]`; missing padding rows are NaN.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when `w < v`.
    pub fn split_rows(&self, full: ArrayView2<f64>, field: &str) -> Result<Vec<Array2<f64>>> {
        let (w, h) = full.dim();
        self.check_width(field, w, &[w, h], "[v, h]")?;
        Ok(self
            .shards()
            .iter()
            .map(|s| {
                Array2::from_shape_fn((s.width, h), |(j, k)| {
                    let g = s.start + j;
                    if g < w {
                        full[[g, k]]
                    } else {
                        f64::NAN
                    }
                })
            })
            .collect())
    }

    /// Checks that `w` columns (rows) cover the `v` real entries: `field`
    /// of shape `actual` (`legend` its shape in the legend, e.g. `[n, v]`).
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] naming `field` when `w < v`.
    pub fn check_width(&self, field: &str, w: usize, actual: &[usize], legend: &str) -> Result<()> {
        if w < self.vocab_size {
            return Err(Error::ShapeMismatch {
                field: field.into(),
                expected: format!(
                    "{legend} with at least v = {} vocabulary entries",
                    self.vocab_size
                ),
                actual: actual.to_vec(),
            });
        }
        Ok(())
    }

    /// The real columns of the shards `parts[r]: [n, w_r]`, side by side:
    /// `[n, v]`.
    pub fn gather_columns(&self, parts: &[Array2<f64>]) -> Array2<f64> {
        let n = parts.first().map_or(0, |a| a.nrows());
        let mut out = Array2::zeros((n, self.vocab_size));
        for (s, part) in self.shards().iter().zip(parts).filter(|(s, _)| s.real > 0) {
            out.slice_axis_mut(Axis(1), Slice::from(s.start..s.start + s.real))
                .assign(&part.slice_axis(Axis(1), Slice::from(..s.real)));
        }
        out
    }

    /// The real rows of the shards `parts[r]: [w_r, h]`, stacked: `[v, h]`.
    pub fn gather_rows(&self, parts: &[Array2<f64>]) -> Array2<f64> {
        let h = parts.first().map_or(0, |a| a.ncols());
        let mut out = Array2::zeros((self.vocab_size, h));
        for (s, part) in self.shards().iter().zip(parts).filter(|(s, _)| s.real > 0) {
            out.slice_axis_mut(Axis(0), Slice::from(s.start..s.start + s.real))
                .assign(&part.slice_axis(Axis(0), Slice::from(..s.real)));
        }
        out
    }
}

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

    /// The name used in JSON and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            ShardedAlgorithm::Naive => "naive",
            ShardedAlgorithm::Alg1 => "alg1",
            ShardedAlgorithm::Alg2 => "alg2",
        }
    }

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

impl fmt::Display for ShardedAlgorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ShardedAlgorithm {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "naive" => Ok(ShardedAlgorithm::Naive),
            "alg1" => Ok(ShardedAlgorithm::Alg1),
            "alg2" => Ok(ShardedAlgorithm::Alg2),
            _ => Err(Error::invalid(
                "algorithm",
                format!("unknown sharded algorithm {s:?}; expected naive, alg1 or alg2"),
            )),
        }
    }
}

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
#[allow(clippy::too_many_arguments)]
pub fn linear_cross_entropy_rank(
    comm: &dyn Collective,
    algorithm: ShardedAlgorithm,
    map: &ShardMap,
    hidden: ArrayView2<f64>,
    weight: ArrayView2<f64>,
    targets: &[i64],
    config: &LossConfig,
    want_grad: bool,
) -> Result<RankLoss> {
    let (rank, z) = output_rank_setup(comm, algorithm, map, hidden, weight, targets, config)?;
    let w_real = weight.slice_axis(Axis(0), Slice::from(..rank.shard.real));
    rank.run(z, Some((hidden, w_real)), want_grad)
}

/// Checks one rank's output-layer inputs and computes its logits `[n, w_r]`
/// (padding columns `-inf`).
fn output_rank_setup<'a>(
    comm: &'a dyn Collective,
    algorithm: ShardedAlgorithm,
    map: &ShardMap,
    hidden: ArrayView2<f64>,
    weight: ArrayView2<f64>,
    targets: &[i64],
    config: &LossConfig,
) -> Result<(RankRun<'a>, Array2<f64>)> {
    let rank = RankRun::new(comm, algorithm, map, hidden.nrows(), targets, config)?;
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
    let n = hidden.nrows();
    rank.meter.hold(n * shard.width);
    let mut z = Array2::from_elem((n, shard.width), f64::NEG_INFINITY);
    let w_real = weight.slice_axis(Axis(0), Slice::from(..shard.real));
    z.slice_axis_mut(Axis(1), Slice::from(..shard.real))
        .assign(&hidden.dot(&w_real.t()));
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
#[allow(clippy::too_many_arguments)]
pub fn linear_cross_entropy_rank_s(
    comm: &dyn Collective,
    algorithm: ShardedAlgorithm,
    map: &ShardMap,
    hidden: ArrayView2<f64>,
    weight: ArrayView2<f64>,
    targets: &[i64],
    config: &LossConfig,
    want_grad: bool,
) -> Result<OutputSPass> {
    let (rank, z) = output_rank_setup(comm, algorithm, map, hidden, weight, targets, config)?;
    let shard = rank.shard;
    let w_real = weight.slice_axis(Axis(0), Slice::from(..shard.real));
    let state = rank.s_pass(z, Some((hidden, w_real)), want_grad)?;
    Ok(OutputSPass {
        algorithm,
        shard,
        config: rank.config,
        targets: rank.targets,
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
#[allow(clippy::too_many_arguments)]
pub fn cross_entropy_rank(
    comm: &dyn Collective,
    algorithm: ShardedAlgorithm,
    map: &ShardMap,
    logits: ArrayView2<f64>,
    targets: &[i64],
    config: &LossConfig,
    want_grad: bool,
) -> Result<RankLoss> {
    let n = logits.nrows();
    let rank = RankRun::new(comm, algorithm, map, n, targets, config)?;
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
    rank.run(z, None, want_grad)
}

/// The state of one rank's run.
struct RankRun<'a> {
    comm: &'a dyn Collective,
    algorithm: ShardedAlgorithm,
    shard: Shard,
    config: LossConfig,
    targets: Vec<Option<usize>>,
    /// `(q_target, q_other)`.
    q: (f64, f64),
    meter: Meter,
}

type Linear<'x> = Option<(ArrayView2<'x, f64>, ArrayView2<'x, f64>)>;

/// What an S pass leaves for its T pass on one rank.
#[derive(Debug, Clone)]
struct SState {
    /// `[n, w_r]`: the logits (turned into `∂L/∂z_i` in place by T).
    z: Array2<f64>,
    local: Vec<SoftmaxStats>,
    global: Vec<SoftmaxStats>,
    /// Per-token losses and the loss.
    forward: (Array1<f64>, f64),
    want_grad: bool,
    /// `∂L/∂x`, when S forms it (alg2).
    grad_hidden: Option<Array2<f64>>,
}

/// `(∂L/∂x, ∂L/∂W_i)`.
type LinearGrads = (Option<Array2<f64>>, Option<Array2<f64>>);
/// `(∂L/∂z_i, ∂L/∂x, ∂L/∂W_i)`.
type Grads = (
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
    targets: &[i64],
    config: &LossConfig,
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
    if targets.len() != n {
        return Err(Error::ShapeMismatch {
            field: "targets".into(),
            expected: format!("[n] with n = {n}"),
            actual: vec![targets.len()],
        });
    }
    config.validate(map.vocab_size())
}

impl<'a> RankRun<'a> {
    fn new(
        comm: &'a dyn Collective,
        algorithm: ShardedAlgorithm,
        map: &ShardMap,
        n: usize,
        targets: &[i64],
        config: &LossConfig,
    ) -> Result<Self> {
        check_rank_inputs(comm, map, n, targets, config)?;
        let v = map.vocab_size();
        Ok(RankRun {
            comm,
            algorithm,
            shard: map.shard(comm.rank()),
            config: *config,
            targets: config.targets(targets, v)?,
            q: config.target_distribution(v),
            meter: Meter::default(),
        })
    }

    /// `q_ij` of token `i` for local column `j` (0 for padding and ignored tokens).
    fn q(&self, i: usize, j: usize) -> f64 {
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
    fn target_rows(&self, w_real: ArrayView2<f64>) -> Array2<f64> {
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
    fn finish(&self, global: &[SoftmaxStats]) -> Result<(Array1<f64>, f64)> {
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

    fn run(self, z: Array2<f64>, lin: Linear<'_>, want_grad: bool) -> Result<RankLoss> {
        let state = self.s_pass(z, lin, want_grad)?;
        self.t_pass(state, lin)
    }

    /// The S pass of the algorithm: everything up to (and including) the
    /// barriers the forward needs; alg2 also forms `∂L/∂x`.
    fn s_pass(&self, z: Array2<f64>, lin: Linear<'_>, want_grad: bool) -> Result<SState> {
        match self.algorithm {
            ShardedAlgorithm::Naive => self.naive_s(z, want_grad),
            ShardedAlgorithm::Alg1 => self.alg1_s(z, want_grad),
            ShardedAlgorithm::Alg2 => self.alg2_s(z, lin, want_grad),
        }
    }

    /// The T pass: `∂L/∂z` and `∂L/∂W_i` (naive and alg1 also all-reduce
    /// `∂L/∂x` here; alg2 communicates no more).
    fn t_pass(&self, s: SState, lin: Linear<'_>) -> Result<RankLoss> {
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
    fn linear_grads(
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

    fn output(
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
    fn naive_s(&self, z: Array2<f64>, want_grad: bool) -> Result<SState> {
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
        let forward = self.finish(&global)?;
        Ok(SState {
            z,
            local,
            global,
            forward,
            want_grad,
            grad_hidden: None,
        })
    }

    /// naive T: `∂L/∂z` from the global statistics, then `∂L/∂x =
    /// allreduce_sum(∂L/∂z_i W_i)`.
    fn naive_t(&self, s: SState, lin: Linear<'_>) -> Result<RankLoss> {
        let SState {
            mut z,
            local,
            global,
            forward,
            ..
        } = s;
        // Backward: ∂L/∂z = w_i (softmax - q + 2 c lse softmax), in place.
        let weights = self.config.token_weights(&self.targets);
        for ((i, j), x) in z.indexed_iter_mut() {
            *x = if weights[i] == 0.0 || j >= self.shard.real {
                0.0
            } else {
                weights[i] * global[i].gradient(*x, self.q(i, j), self.config.z_loss)
            };
        }
        // Barrier 3: the input gradient.
        let (gx, gw) = self.linear_grads(&z, lin, true)?;
        Ok(self.output(forward, local, global, (Some(z), gx, gw)))
    }

    /// alg1: S pass (local `m_i`, `s_i`, target term) → one merged barrier →
    /// T pass (rescale the local softmax by `alpha_i`) → the input-gradient
    /// barrier.
    fn alg1_s(&self, z: Array2<f64>, want_grad: bool) -> Result<SState> {
        let n = z.nrows();
        // S pass.
        let local: Vec<SoftmaxStats> = z
            .rows()
            .into_iter()
            .enumerate()
            .map(|(i, row)| SoftmaxStats::of(&row.to_vec(), |j| self.q(i, j)))
            .collect();
        // Barrier 1: (m_i, s_i, target) records, online-softmax merge.
        self.meter.hold(STATS_WIDTH * n);
        let mut record: Vec<f64> = local.iter().flat_map(|s| s.to_record()).collect();
        self.comm.all_reduce(&mut [Reduce::Merge {
            data: &mut record,
            width: STATS_WIDTH,
            op: merge_stats,
        }])?;
        let global: Vec<SoftmaxStats> = record
            .chunks(STATS_WIDTH)
            .map(SoftmaxStats::from_record)
            .collect();
        let forward = self.finish(&global)?;
        Ok(SState {
            z,
            local,
            global,
            forward,
            want_grad,
            grad_hidden: None,
        })
    }

    /// alg1 T: rescale the local softmax, `∂L/∂z_i`, the input-gradient
    /// barrier, `∂L/∂W_i`.
    fn alg1_t(&self, s: SState, lin: Linear<'_>) -> Result<RankLoss> {
        let SState {
            mut z,
            local,
            global,
            forward,
            ..
        } = s;
        // T pass: softmax = alpha_i softmax'_i, alpha_i = s_i exp(m_i - m) / S.
        let weights = self.config.token_weights(&self.targets);
        let c = self.config.z_loss;
        for ((i, j), x) in z.indexed_iter_mut() {
            let (g, l, zij) = (&global[i], &local[i], *x);
            *x = if weights[i] == 0.0 || j >= self.shard.real {
                0.0
            } else {
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
                weights[i] * (delta + 2.0 * c * g.logsumexp() * p)
            };
        }
        // Barrier 2: the input gradient.
        let (gx, gw) = self.linear_grads(&z, lin, true)?;
        Ok(self.output(forward, local, global, (Some(z), gx, gw)))
    }

    /// alg2: S pass forms the input-gradient partials against the local
    /// softmax → one merged barrier → T pass with no communication. The rank
    /// keeps its logits and recomputes `softmax'_i` in T (as alg1 does; the
    /// paper keeps `softmax'_i` itself — the same memory).
    fn alg2_s(&self, z: Array2<f64>, lin: Linear<'_>, want_grad: bool) -> Result<SState> {
        let n = z.nrows();
        let c = self.config.z_loss;
        // S pass: local statistics.
        let local: Vec<SoftmaxStats> = z
            .rows()
            .into_iter()
            .enumerate()
            .map(|(i, row)| SoftmaxStats::of(&row.to_vec(), |j| self.q(i, j)))
            .collect();
        // softmax'_i - q_i (the stable form for a confident target; -q for an
        // all -inf shard) and softmax'_i.
        let delta = |i: usize, j: usize, zij: f64| {
            let q = self.q(i, j);
            if local[i].sum_exp() == 0.0 {
                -q
            } else {
                local[i].delta(zij, q)
            }
        };
        let prob = |i: usize, zij: f64| {
            if local[i].sum_exp() == 0.0 {
                0.0
            } else {
                local[i].probability(zij)
            }
        };
        let input_grad = want_grad && lin.is_some();
        let h = lin.map_or(0, |(x, _)| x.ncols());
        // Blocks per token after the statistics: s_i D_i and B_i, plus s_i A_i
        // with the z-loss (A_i = softmax'_i W_i, its gradient is 2 c lse p W).
        let blocks = match (input_grad, c > 0.0) {
            (false, _) => 0,
            (true, false) => 2,
            (true, true) => 3,
        };
        let width = STATS_WIDTH + blocks * h;
        self.meter.hold(width * n);
        let mut record = vec![0.0; width * n];
        for (i, l) in local.iter().enumerate() {
            record[i * width..i * width + STATS_WIDTH].copy_from_slice(&l.to_record());
        }
        if let (true, Some((_, w_real))) = (input_grad, lin) {
            // D_i = (softmax'_i - q_i) W_i, B_i = q_i W_i, A_i = softmax'_i W_i.
            self.meter.hold(blocks * n * h);
            let d = sum::matmul_with(n, |i, j| delta(i, j, z[[i, j]]), w_real);
            let b = self.target_rows(w_real);
            let a = (blocks == 3).then(|| sum::matmul_with(n, |i, j| prob(i, z[[i, j]]), w_real));
            for i in 0..n {
                let at = i * width + STATS_WIDTH;
                let s_i = local[i].sum_exp();
                for k in 0..h {
                    record[at + k] = s_i * d[[i, k]];
                    record[at + h + k] = b[[i, k]];
                    if let Some(a) = &a {
                        record[at + 2 * h + k] = s_i * a[[i, k]];
                    }
                }
            }
            self.meter.free(blocks * n * h);
        }
        // The one barrier.
        let op: super::collective::MergeFn = match blocks {
            0 => merge_stats,
            2 => merge_alg2,
            _ => merge_alg2_z_loss,
        };
        self.comm.all_reduce(&mut [Reduce::Merge {
            data: &mut record,
            width,
            op,
        }])?;
        let global: Vec<SoftmaxStats> = record
            .chunks(width)
            .map(SoftmaxStats::from_record)
            .collect();
        let forward = self.finish(&global)?;
        if !want_grad {
            return Ok(SState {
                z,
                local,
                global,
                forward,
                want_grad,
                grad_hidden: None,
            });
        }
        let weights = self.config.token_weights(&self.targets);
        // ∂L/∂x = w_i (Y / S + 2 c lse U / S), Y / S = Σ_j (p_j - q_j) W_j and
        // U / S = Σ_j p_j W_j: no more communication.
        let gx = input_grad.then(|| {
            self.meter.hold(n * h);
            Array2::from_shape_fn((n, h), |(i, k)| {
                if weights[i] == 0.0 {
                    return 0.0;
                }
                let g = &global[i];
                let at = i * width + STATS_WIDTH;
                let y = record[at + k] / g.sum_exp();
                let z_part = if blocks == 3 {
                    2.0 * c * g.logsumexp() * (record[at + 2 * h + k] / g.sum_exp())
                } else {
                    0.0
                };
                weights[i] * (y + z_part)
            })
        });
        Ok(SState {
            z,
            local,
            global,
            forward,
            want_grad,
            grad_hidden: gx,
        })
    }

    /// alg2 T: `∂L/∂z_i` from the local softmax rescaled by `alpha_i`, and
    /// `∂L/∂W_i` — no communication.
    fn alg2_t(&self, s: SState, lin: Linear<'_>) -> Result<RankLoss> {
        let SState {
            mut z,
            local,
            global,
            forward,
            grad_hidden: gx,
            ..
        } = s;
        let real = self.shard.real;
        let c = self.config.z_loss;
        let weights = self.config.token_weights(&self.targets);
        let delta = |i: usize, j: usize, zij: f64| {
            let q = self.q(i, j);
            if local[i].sum_exp() == 0.0 {
                -q
            } else {
                local[i].delta(zij, q)
            }
        };
        let prob = |i: usize, zij: f64| {
            if local[i].sum_exp() == 0.0 {
                0.0
            } else {
                local[i].probability(zij)
            }
        };
        // T pass: p = alpha_i softmax'_i and p - q = alpha_i (softmax'_i - q)
        // + (alpha_i - 1) q, with alpha_i - 1 = (s_i - S) / S exactly when
        // m_i = m.
        for ((i, j), x) in z.indexed_iter_mut() {
            let (g, l) = (&global[i], &local[i]);
            *x = if weights[i] == 0.0 || j >= real {
                0.0
            } else {
                let q = self.q(i, j);
                let alpha = l.sum_exp() * l.scale_to(g.max) / g.sum_exp();
                let alpha_minus_1 = if l.max == g.max {
                    (l.rest - g.rest) / g.sum_exp()
                } else {
                    alpha - 1.0
                };
                let d = alpha * delta(i, j, *x) + alpha_minus_1 * q;
                let p = alpha * prob(i, *x);
                weights[i] * (d + 2.0 * c * g.logsumexp() * p)
            };
        }
        let (_, gw) = self.linear_grads(&z, lin, false)?;
        Ok(self.output(forward, local, global, (Some(z), gx, gw)))
    }
}

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
/// As [`super::cross_entropy()`]; [`Error::ShapeMismatch`] for `w < v`.
pub fn sharded_cross_entropy(
    algorithm: ShardedAlgorithm,
    map: &ShardMap,
    logits: ArrayView2<f64>,
    targets: &[i64],
    config: &LossConfig,
    want_grad: bool,
) -> Result<ShardedLoss> {
    let (n, w) = logits.dim();
    let v = map.vocab_size();
    map.check_width("logits", w, &[n, w], "[n, v]")?;
    validate(n, targets, config, v)?;
    check_logits("logits", logits, v, v, 0)?;
    check_logits_size("logits", n, map.padded_vocab_size())?;
    let parts = map.split_columns(logits, "logits")?;
    let ranks = run_ranks(map.num_shards(), |comm| {
        cross_entropy_rank(
            comm,
            algorithm,
            map,
            parts[comm.rank()].view(),
            targets,
            config,
            want_grad,
        )
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
/// As [`super::linear_cross_entropy`]; [`Error::ShapeMismatch`] for `w < v`.
pub fn sharded_linear_cross_entropy(
    algorithm: ShardedAlgorithm,
    map: &ShardMap,
    hidden: ArrayView2<f64>,
    weight: ArrayView2<f64>,
    targets: &[i64],
    config: &LossConfig,
    want_grad: bool,
) -> Result<ShardedLoss> {
    let n = hidden.nrows();
    let v = map.vocab_size();
    map.check_width("weight", weight.nrows(), weight.shape(), "[v, h]")?;
    validate(n, targets, config, v)?;
    check_linear(hidden, weight, v, 0)?;
    check_logits_size("weight", n, map.padded_vocab_size())?;
    let parts = map.split_rows(weight, "weight")?;
    let ranks = run_ranks(map.num_shards(), |comm| {
        linear_cross_entropy_rank(
            comm,
            algorithm,
            map,
            hidden,
            parts[comm.rank()].view(),
            targets,
            config,
            want_grad,
        )
    })?;
    Ok(ShardedLoss {
        map: *map,
        ranks: ranks.into_iter().map(|r| r.output).collect(),
    })
}

fn validate(n: usize, targets: &[i64], config: &LossConfig, v: usize) -> Result<()> {
    if targets.len() != n {
        return Err(Error::ShapeMismatch {
            field: "targets".into(),
            expected: format!("[n] with n = {n} (the rows of the logits)"),
            actual: vec![targets.len()],
        });
    }
    config.validate(v)?;
    config.targets(targets, v)?;
    Ok(())
}
