//! A vocabulary-chunked cross-entropy in f64, the structure of Liger's and
//! Apple's cut-cross-entropy kernels: each row's logits are read in chunks
//! of `chunk` entries, each chunk summarised (maximum, `s - 1`, target
//! term) and merged into the running summary by the online-softmax rule
//! (Milakov & Gimelshein 2018; [`SoftmaxStats::merge`]); then the loss
//! `Σ q_j (m - z_j) + ln s` (+ `c lse^2`), and the gradient `w (p - q + 2 c
//! lse p)` chunk by chunk, times the softcap's `1 - tanh^2`. Correct by
//! default, with the mistakes of [`LossBug`] one at a time.
//!
//! Shapes: `logits: [n, v]`, `targets: [n]`, `grad_logits: [n, v]`. The
//! unsharded form only: the sharded calls are refused
//! ([`check_algorithm`]).

use ndarray::{Array1, Array2};
use packshard_reference::ops::{check_algorithm, CeCall, CrossEntropyOp, LossOp, LossSupport};
use packshard_reference::vocab::cross_entropy::{
    check_logits, check_row, check_shapes, CrossEntropy,
};
use packshard_reference::vocab::sharded::ShardedLoss;
use packshard_reference::vocab::{
    softcap, sum, LossCall, LossConfig, Reduction, ShardPlan, ShardedAlgorithm,
    SmoothingConvention, SoftmaxStats,
};
use packshard_reference::{Error, Result};

/// One mistake of [`ChunkedCrossEntropy`], each one kernel authors have made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LossBug {
    /// The chunk count rounds down (`v / chunk`, one masked chunk when `v <
    /// chunk`): the last partial chunk of a larger vocabulary is left out of
    /// the logsumexp.
    LastChunkDropped,
    /// The last partial chunk loaded with `other=0.0` instead of `-inf`: its
    /// `chunk - v % chunk` out-of-range entries join the sum as logits of 0.
    TailLoadedAsZero,
    /// The mean's denominator counts `ignore_index` tokens (`n`, not the
    /// tokens with a target).
    IgnoredInDenominator,
    /// Label smoothing spread over the padded width (`v` rounded up to the
    /// chunk), not the `v` real classes.
    SmoothingOverPadded,
    /// The z-loss gradient `2 c lse p` written `2 c p`.
    ZLossGradNoLse,
    /// The online maximum starts at 0 instead of `-inf`: rows whose logits
    /// are all far below 0 underflow, and small losses lose their precision.
    MaxInitZero,
    /// The softcap's gradient misses the chain factor `1 - tanh^2(z / c)`.
    SoftcapNoChain,
    /// `ignore_index` hard-coded to -100: the caller's other value (-1, or
    /// a real class) is not ignored.
    HardcodedIgnoreIndex,
}

impl LossBug {
    /// Every cross-entropy bug of the zoo.
    pub const ALL: [LossBug; 8] = [
        LossBug::LastChunkDropped,
        LossBug::TailLoadedAsZero,
        LossBug::IgnoredInDenominator,
        LossBug::SmoothingOverPadded,
        LossBug::ZLossGradNoLse,
        LossBug::MaxInitZero,
        LossBug::SoftcapNoChain,
        LossBug::HardcodedIgnoreIndex,
    ];

    /// A short name (`last_chunk_dropped`).
    pub fn name(self) -> &'static str {
        match self {
            LossBug::LastChunkDropped => "last_chunk_dropped",
            LossBug::TailLoadedAsZero => "tail_loaded_as_zero",
            LossBug::IgnoredInDenominator => "ignored_in_denominator",
            LossBug::SmoothingOverPadded => "smoothing_over_padded",
            LossBug::ZLossGradNoLse => "z_loss_grad_no_lse",
            LossBug::MaxInitZero => "max_init_zero",
            LossBug::SoftcapNoChain => "softcap_no_chain",
            LossBug::HardcodedIgnoreIndex => "hardcoded_ignore_index",
        }
    }

    /// The vocabulary chunk the zoo's kernel with this bug uses (256 or
    /// 1024, the chunk widths of Liger's and cut-cross-entropy's kernels).
    pub fn chunk(self) -> usize {
        match self {
            LossBug::LastChunkDropped
            | LossBug::SmoothingOverPadded
            | LossBug::MaxInitZero
            | LossBug::HardcodedIgnoreIndex => 256,
            LossBug::TailLoadedAsZero
            | LossBug::IgnoredInDenominator
            | LossBug::ZLossGradNoLse
            | LossBug::SoftcapNoChain => 1024,
        }
    }
}

/// The vocabulary-chunked cross-entropy: chunks of `chunk` entries, with at
/// most one [`LossBug`]. Declares every loss option ([`LossSupport::ALL`])
/// and no sharded algorithm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkedCrossEntropy {
    /// Vocabulary entries per chunk.
    pub chunk: usize,
    /// The mistake switched in; `None`: the correct kernel.
    pub bug: Option<LossBug>,
}

impl ChunkedCrossEntropy {
    /// The correct kernel with chunks of `chunk` entries (at least 1).
    pub fn correct(chunk: usize) -> Self {
        ChunkedCrossEntropy {
            chunk: chunk.max(1),
            bug: None,
        }
    }

    /// The kernel with `bug`, at the bug's [`LossBug::chunk`].
    pub fn with(bug: LossBug) -> Self {
        ChunkedCrossEntropy {
            chunk: bug.chunk(),
            bug: Some(bug),
        }
    }

    /// The same kernel without its bug.
    pub fn fixed(self) -> Self {
        ChunkedCrossEntropy { bug: None, ..self }
    }

    fn has(&self, bug: LossBug) -> bool {
        self.bug == Some(bug)
    }

    /// `(q_target, q_other)` over `v` classes.
    fn smoothing(&self, config: &LossConfig, v: usize) -> (f64, f64) {
        if !self.has(LossBug::SmoothingOverPadded) {
            return config.target_distribution(v);
        }
        let (a, w) = (config.label_smoothing, v.div_ceil(self.chunk) * self.chunk);
        match (a == 0.0, config.smoothing) {
            (true, _) => (1.0, 0.0),
            (false, SmoothingConvention::PyTorch) => (1.0 - a + a / w as f64, a / w as f64),
            (false, SmoothingConvention::Megatron) => (1.0 - a, a / (w as f64 - 1.0)),
        }
    }

    fn row(&self) -> RowScan {
        RowScan {
            chunk: self.chunk,
            drop_last_partial: self.has(LossBug::LastChunkDropped),
            tail_as_zero: self.has(LossBug::TailLoadedAsZero),
            max_from_zero: self.has(LossBug::MaxInitZero),
        }
    }
}

/// How one row's logits are scanned, chunk by chunk.
#[derive(Debug, Clone, Copy)]
pub(super) struct RowScan {
    pub(super) chunk: usize,
    drop_last_partial: bool,
    tail_as_zero: bool,
    max_from_zero: bool,
}

impl RowScan {
    /// A correct scan in chunks of `chunk`.
    pub(super) fn chunks_of(chunk: usize) -> Self {
        RowScan {
            chunk: chunk.max(1),
            drop_last_partial: false,
            tail_as_zero: false,
            max_from_zero: false,
        }
    }

    /// The summary of one row of (capped) logits `z: [v]` with target
    /// weights `q(j)`, merged chunk by chunk.
    pub(super) fn summary(&self, z: &[f64], q: impl Fn(usize) -> f64) -> SoftmaxStats {
        let v = z.len();
        let chunks = if self.drop_last_partial {
            (v / self.chunk).max(1)
        } else {
            v.div_ceil(self.chunk)
        };
        let mut running = if self.max_from_zero {
            SoftmaxStats {
                max: 0.0,
                ..SoftmaxStats::EMPTY
            }
        } else {
            SoftmaxStats::EMPTY
        };
        let mut buf = Vec::with_capacity(self.chunk);
        for c in 0..chunks {
            let (j0, j1) = (c * self.chunk, ((c + 1) * self.chunk).min(v));
            buf.clear();
            buf.extend_from_slice(&z[j0..j1]);
            if self.tail_as_zero {
                buf.resize(self.chunk, 0.0); // `tl.load(..., other=0.0)`
            }
            let part = SoftmaxStats::of(&buf, |j| if j0 + j < v { q(j0 + j) } else { 0.0 });
            running = running.merge(part);
        }
        running
    }
}

/// `d L / d per_token_loss_i`: 0 for an ignored token, else `1 / valid`
/// (mean, `1 / n` when `count_ignored`) or 1, times `grad_output[i]` (none;
/// `grad_output[0]` when `first_upstream_only`) or `grad_output[0]`.
pub(super) fn token_weights(
    call: &LossCall<'_>,
    targets: &[Option<usize>],
    count_ignored: bool,
    first_upstream_only: bool,
) -> Vec<f64> {
    let denominator = mean_denominator(targets, count_ignored);
    let base = match call.config.reduction {
        Reduction::Mean if denominator > 0 => 1.0 / denominator as f64,
        Reduction::Mean => 0.0,
        Reduction::Sum | Reduction::None => 1.0,
    };
    let upstream = call.grad.upstream();
    (0..targets.len())
        .map(|i| {
            if targets[i].is_none() {
                return 0.0;
            }
            let g = match (upstream, call.config.reduction) {
                (None, _) => 1.0,
                (Some(g), Reduction::None) if !first_upstream_only => g[i],
                (Some(g), _) => g[0],
            };
            base * g
        })
        .collect()
}

/// Tokens the mean divides by: those with a target (all `n` when
/// `count_ignored`).
pub(super) fn mean_denominator(targets: &[Option<usize>], count_ignored: bool) -> usize {
    if count_ignored {
        targets.len()
    } else {
        targets.iter().filter(|t| t.is_some()).count()
    }
}

/// The loss of one token: cross-entropy plus `c lse^2`, 0 when ignored.
pub(super) fn token_loss(st: &SoftmaxStats, target: Option<usize>, z_loss: f64) -> f64 {
    match target {
        None => 0.0,
        Some(_) if z_loss == 0.0 => st.cross_entropy(),
        Some(_) => {
            let lse = st.logsumexp();
            st.cross_entropy() + z_loss * lse * lse
        }
    }
}

/// `d loss / d z` of a raw logit whose capped value is `y`, target weight
/// `q`, token weight `w`: `w (p - q + 2 c lse p)` times the softcap's `1 -
/// tanh^2` (without the `lse` factor under `z_loss_no_lse`, without the
/// chain under `no_chain`).
pub(super) fn logit_grad(
    st: &SoftmaxStats,
    (y, q, w): (f64, f64, f64),
    config: &LossConfig,
    (z_loss_no_lse, no_chain): (bool, bool),
) -> f64 {
    let mut dy = st.delta(y, q);
    if config.z_loss != 0.0 {
        let lse = if z_loss_no_lse { 1.0 } else { st.logsumexp() };
        dy += 2.0 * config.z_loss * lse * st.probability(y);
    }
    let dy = w * dy;
    if no_chain {
        dy
    } else {
        softcap::chain(dy, y, config.softcap)
    }
}

/// The reduced loss of `per_token` losses: their (compensated) sum over
/// `denominator` tokens under the mean (0 when there is none).
pub(super) fn reduce(per_token: &[f64], reduction: Reduction, denominator: usize) -> f64 {
    let total = sum::sum(per_token.iter().copied());
    match reduction {
        Reduction::Mean if denominator == 0 => 0.0,
        Reduction::Mean => total / denominator as f64,
        Reduction::Sum | Reduction::None => total,
    }
}

impl LossOp for ChunkedCrossEntropy {
    fn algorithms(&self) -> Vec<ShardedAlgorithm> {
        Vec::new()
    }

    fn options(&self) -> LossSupport {
        LossSupport::ALL
    }
}

impl CrossEntropyOp for ChunkedCrossEntropy {
    fn cross_entropy(&self, c: CeCall<'_>) -> Result<CrossEntropy> {
        let (logits, call) = (c.input, c.call);
        let config = call.config;
        let (n, v) = logits.dim();
        check_shapes(n, v, &call)?;
        check_logits("logits", logits, v, v, 0)?;
        config.validate(v)?;
        let targets = if self.has(LossBug::HardcodedIgnoreIndex) {
            let hardcoded = LossConfig {
                ignore_index: -100,
                ..*config
            };
            hardcoded.targets(call.targets, v)?
        } else {
            config.targets(call.targets, v)?
        };
        let (q_t, q_o) = self.smoothing(config, v);
        let q = |i: usize, j: usize| match targets[i] {
            None => 0.0,
            Some(t) if t == j => q_t,
            Some(_) => q_o,
        };
        // The capped logits, as the kernel reads each chunk.
        let capped = |i: usize, j: usize| match config.softcap {
            Some(cap) => softcap::cap(logits[[i, j]], cap),
            None => logits[[i, j]],
        };
        let scan = self.row();
        let mut stats = Vec::with_capacity(n);
        let mut row = vec![0.0; v];
        for (i, &target) in targets.iter().enumerate() {
            for (j, y) in row.iter_mut().enumerate() {
                *y = capped(i, j);
            }
            let st = scan.summary(&row, |j| q(i, j));
            check_row(i, &st, target)?;
            stats.push(st);
        }
        let per_token_loss: Array1<f64> = (0..n)
            .map(|i| token_loss(&stats[i], targets[i], config.z_loss))
            .collect();
        let count_ignored = self.has(LossBug::IgnoredInDenominator);
        let loss = reduce(
            per_token_loss.as_slice().unwrap_or(&[]),
            config.reduction,
            mean_denominator(&targets, count_ignored),
        );
        let grad_logits = call.want_grad().then(|| {
            let weights = token_weights(&call, &targets, count_ignored, false);
            let flaws = (
                self.has(LossBug::ZLossGradNoLse),
                self.has(LossBug::SoftcapNoChain),
            );
            let mut grad = Array2::zeros((n, v));
            for i in (0..n).filter(|&i| weights[i] != 0.0) {
                for j0 in (0..v).step_by(self.chunk) {
                    for j in j0..(j0 + self.chunk).min(v) {
                        let x = (capped(i, j), q(i, j), weights[i]);
                        grad[[i, j]] = logit_grad(&stats[i], x, config, flaws);
                    }
                }
            }
            grad
        });
        Ok(CrossEntropy {
            loss,
            per_token_loss,
            stats,
            num_tokens: mean_denominator(&targets, false),
            grad_logits,
        })
    }

    fn sharded_cross_entropy(&self, plan: ShardPlan, _c: CeCall<'_>) -> Result<ShardedLoss> {
        check_algorithm(&self.algorithms(), plan.algorithm)?;
        Err(Error::invalid("algorithm", "no sharded algorithm declared"))
    }
}
