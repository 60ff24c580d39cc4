//! Vocabulary-parallel softmax, cross-entropy and input embedding (Yeung et
//! al., *Balancing Pipeline Parallelism with Vocabulary Parallelism*,
//! arXiv:2411.05288, §4; Megatron-LM's `VocabParallelCrossEntropy` and
//! `VocabParallelEmbedding`).
//!
//! The output layer `logits = hidden @ weight^T` and its softmax /
//! cross-entropy are split by vocabulary over `p` shards (ranks); the result —
//! loss, per-token loss, gradients of the logits, hidden states and weights —
//! is that of the unsharded layer.
//!
//! ## Shapes and notation
//!
//! | name | meaning |
//! |---|---|
//! | `n` | tokens (rows) |
//! | `h` | hidden size |
//! | `v` | vocabulary size (real entries) |
//! | `p` | shards (ranks) |
//! | `w_r` | columns held by shard `r` (real entries plus padding) |
//! | `z_ij` | logit of token `i` for vocabulary entry `j` |
//! | `m_i` (per shard), `m` (global) | maximum logit of a row (paper: local and global max) |
//! | `s_i = Σ_j exp(z_j - m_i)` | local sum of a shard (paper: `s_i`) |
//! | `S = Σ_i s_i exp(m_i - m)` | global sum; `logsumexp = m + ln S` |
//! | `softmax'_i = exp(z - m_i) / s_i` | the local softmax of shard `i` |
//! | `alpha_i = s_i exp(m_i - m) / S` | the factor that turns the local softmax into the global one |
//! | `q_j` | target distribution (one-hot, or label-smoothed) |
//!
//! ## What is where
//!
//! - [`mod@cross_entropy`]: the unsharded reference (logits, log-softmax,
//!   cross-entropy with `ignore_index`, label smoothing in PyTorch's or
//!   Megatron's convention, z-loss, reductions; forward and backward), and the
//!   mergeable per-row [`SoftmaxStats`] every algorithm is built from.
//! - [`collective`]: the [`Collective`] trait (all-reduce max / sum / merge,
//!   broadcast, counted) and the in-process implementation that runs `p`
//!   ranks.
//! - [`sharded`]: the [`ShardMap`] (uneven or padded shards) and the three
//!   algorithms `naive`, `alg1`, `alg2`, written as per-rank (SPMD) code over
//!   `&dyn Collective`.
//! - [`embedding`]: the vocabulary-parallel input embedding.
//! - [`sum`]: compensated sums for the reductions over the vocabulary.

/// Writes, from one table of `Variant => "name"` rows, an enum's `name()`
/// (the name used in JSON and on the command line) and its inverse `FromStr`:
/// any other string is an [`Error::InvalidArgument`] naming `field`, with
/// the message `unknown <what> "<s>"; expected <the names, "a, b or c">`.
/// With `display` first, also `Display` as the name.
macro_rules! named_options {
    (display $ty:ident, $($rest:tt)*) => {
        named_options!($ty, $($rest)*);

        impl std::fmt::Display for $ty {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.name())
            }
        }
    };
    ($ty:ident, field $field:literal, unknown $what:literal, { $($variant:ident => $name:literal),+ $(,)? }) => {
        impl $ty {
            /// The name used in JSON and on the command line.
            pub fn name(self) -> &'static str {
                match self {
                    $($ty::$variant => $name,)+
                }
            }
        }

        impl std::str::FromStr for $ty {
            type Err = crate::error::Error;
            fn from_str(s: &str) -> crate::error::Result<Self> {
                match s {
                    $($name => Ok($ty::$variant),)+
                    _ => Err(crate::error::Error::invalid(
                        $field,
                        format!(
                            "unknown {} {s:?}; expected {}",
                            $what,
                            crate::vocab::or_list(&[$($name),+])
                        ),
                    )),
                }
            }
        }
    };
}

pub mod call;
pub mod collective;
pub mod cross_entropy;
pub mod embedding;
pub mod ops;
pub mod sharded;
pub mod softcap;
pub mod sum;

#[cfg(test)]
mod tests;

pub use call::{GradRequest, LossCall};
pub use collective::{run_ranks, Collective, CollectiveCounts, InProcess, Reduce};
pub use cross_entropy::{cross_entropy, linear_cross_entropy, CrossEntropy, SoftmaxStats};
pub use embedding::{embedding_backward, embedding_forward};
pub use ops::{ReferenceCrossEntropy, ReferenceEmbedding, ReferenceLinearCrossEntropy};
pub use sharded::{ShardLayout, ShardMap, ShardPlan, ShardedAlgorithm};

use crate::error::{Error, Result};

/// A target that is not predicted: PyTorch's and Hugging Face's default
/// `ignore_index` (-100), the one constant every loss of the crate uses.
pub const IGNORE_INDEX: i64 = -100;

/// `names` as a message lists them: `"a, b or c"` (`"a or b"`, `"a"`).
fn or_list(names: &[&str]) -> String {
    match names {
        [] => String::new(),
        [only] => (*only).to_string(),
        [init @ .., last] => format!("{} or {last}", init.join(", ")),
    }
}

/// How per-token losses become the loss (PyTorch's `reduction`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Reduction {
    /// Mean over the tokens whose target is not `ignore_index`. With no such
    /// token the loss is 0 and every gradient is 0 (PyTorch returns NaN; a
    /// micro-batch of padding must not poison a sum of losses).
    #[default]
    Mean,
    /// Sum over all tokens (ignored ones contribute 0).
    Sum,
    /// No reduction: `per_token_loss` is the result; the scalar `loss`
    /// reported beside it is their sum, and gradients are those of that sum
    /// (an upstream gradient of 1 for every token).
    None,
}

named_options!(display Reduction, field "reduction", unknown "reduction", {
    Mean => "mean",
    Sum => "sum",
    None => "none",
});

/// Where label smoothing puts the mass `a` it takes from the target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum SmoothingConvention {
    /// PyTorch `CrossEntropyLoss(label_smoothing=a)`: target distribution
    /// `(1 - a) * onehot + a / v`, so the target keeps `1 - a + a / v`.
    #[default]
    PyTorch,
    /// Megatron-LM `VocabParallelCrossEntropy`: the target keeps `1 - a` and
    /// the other `v - 1` classes get `a / (v - 1)` each (with the *global* `v`;
    /// using the shard's size instead is docs/FAULTS.md V1).
    Megatron,
}

named_options!(SmoothingConvention, field "smoothing", unknown "label-smoothing convention", {
    PyTorch => "pytorch",
    Megatron => "megatron",
});

/// The options of the cross-entropy loss, shared by every implementation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossConfig {
    /// Targets equal to this are ignored: loss 0, gradient 0, not counted by
    /// the mean (PyTorch's default -100).
    pub ignore_index: i64,
    /// Label smoothing `a` in `[0, 1]`.
    pub label_smoothing: f64,
    /// Where the smoothing mass goes.
    pub smoothing: SmoothingConvention,
    /// z-loss coefficient `c >= 0`: each non-ignored token adds
    /// `c * logsumexp^2` (PaLM, Chowdhery et al. 2022, §5; 1e-4 there).
    pub z_loss: f64,
    /// How per-token losses are reduced.
    pub reduction: Reduction,
    /// Logit soft-capping `c`: every logit `z` becomes `c * tanh(z / c)`
    /// before anything else ([`softcap`]; Gemma 2's
    /// `final_logit_softcapping`, flash-attention's `softcap`). `None`: off.
    pub softcap: Option<f64>,
}

impl Default for LossConfig {
    fn default() -> Self {
        LossConfig {
            ignore_index: IGNORE_INDEX,
            label_smoothing: 0.0,
            smoothing: SmoothingConvention::PyTorch,
            z_loss: 0.0,
            reduction: Reduction::Mean,
            softcap: None,
        }
    }
}

impl LossConfig {
    /// Builder: label smoothing `a` in `convention`.
    pub fn with_smoothing(mut self, a: f64, convention: SmoothingConvention) -> Self {
        self.label_smoothing = a;
        self.smoothing = convention;
        self
    }

    /// Builder: z-loss coefficient.
    pub fn with_z_loss(mut self, c: f64) -> Self {
        self.z_loss = c;
        self
    }

    /// Builder: reduction.
    pub fn with_reduction(mut self, r: Reduction) -> Self {
        self.reduction = r;
        self
    }

    /// Builder: logit soft-capping `c` ([`LossConfig::softcap`]).
    pub fn with_softcap(mut self, c: f64) -> Self {
        self.softcap = Some(c);
        self
    }

    /// Builder: ignore index.
    pub fn with_ignore_index(mut self, i: i64) -> Self {
        self.ignore_index = i;
        self
    }

    /// Checks the options for a vocabulary of `v` entries.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for smoothing outside `[0, 1]`, a negative or
    /// non-finite z-loss, a softcap that is not finite and `> 0` (field
    /// `softcap`), or Megatron smoothing with `v = 1` (no other class to
    /// spread the mass over).
    pub fn validate(&self, v: usize) -> Result<()> {
        let a = self.label_smoothing;
        if !(0.0..=1.0).contains(&a) {
            return Err(Error::invalid(
                "label_smoothing",
                format!("{a:?} is outside [0, 1]"),
            ));
        }
        if !(self.z_loss.is_finite() && self.z_loss >= 0.0) {
            return Err(Error::invalid(
                "z_loss",
                format!("{:?} must be finite and >= 0", self.z_loss),
            ));
        }
        if let Some(c) = self.softcap {
            if !(c.is_finite() && c > 0.0) {
                return Err(Error::invalid(
                    "softcap",
                    format!("{c:?} must be finite and > 0 (logits become c * tanh(z / c))"),
                ));
            }
        }
        if a > 0.0 && self.smoothing == SmoothingConvention::Megatron && v < 2 {
            return Err(Error::invalid(
                "label_smoothing",
                "Megatron's convention spreads the mass over v - 1 other classes; v = 1 has none",
            ));
        }
        Ok(())
    }

    /// The target distribution of a non-ignored token over `v` classes:
    /// `(q_target, q_other)`, the mass on the target and on each other class.
    /// They sum to 1: `q_target + (v - 1) * q_other == 1` (up to rounding).
    pub fn target_distribution(&self, v: usize) -> (f64, f64) {
        let a = self.label_smoothing;
        if a == 0.0 {
            return (1.0, 0.0);
        }
        match self.smoothing {
            SmoothingConvention::PyTorch => (1.0 - a + a / v as f64, a / v as f64),
            SmoothingConvention::Megatron => (1.0 - a, a / (v as f64 - 1.0)),
        }
    }

    /// The target of token `index`: `None` if ignored, else the class.
    ///
    /// # Errors
    /// [`Error::IndexOutOfRange`] (field `targets`) for a target that is
    /// neither `ignore_index` nor in `0..v`.
    pub fn target(&self, targets: &[i64], index: usize, v: usize) -> Result<Option<usize>> {
        let t = targets[index];
        if t == self.ignore_index {
            return Ok(None);
        }
        if t < 0 || t >= v as i64 {
            return Err(Error::IndexOutOfRange {
                field: "targets".into(),
                index,
                value: t,
                lo: 0,
                hi: v as i64,
            });
        }
        Ok(Some(t as usize))
    }

    /// Every target checked against `v` (see [`LossConfig::target`]).
    ///
    /// # Errors
    /// The first bad target.
    pub fn targets(&self, targets: &[i64], v: usize) -> Result<Vec<Option<usize>>> {
        (0..targets.len())
            .map(|i| self.target(targets, i, v))
            .collect()
    }

    /// Reduces per-token losses (ignored tokens hold 0) as configured.
    pub fn reduce(&self, per_token: &[f64], targets: &[Option<usize>]) -> f64 {
        let sum = sum::sum(per_token.iter().copied());
        match self.reduction {
            Reduction::Mean => {
                let valid = targets.iter().filter(|t| t.is_some()).count();
                if valid == 0 {
                    0.0
                } else if sum.is_infinite() && per_token.iter().all(|x| x.is_finite()) {
                    // Finite losses whose sum is beyond f64 (two of 1.5e308):
                    // the mean is within it, summed from each over `valid`
                    // (issue #32: inf answered for a finite true mean). In
                    // range the sum is divided once, bit for bit as before.
                    sum::sum(per_token.iter().map(|x| x / valid as f64))
                } else {
                    sum / valid as f64
                }
            }
            Reduction::Sum | Reduction::None => sum,
        }
    }
}

/// The most multiply-adds of `hidden @ weight^T` (`n * v * h`) one output
/// layer call may do: 2^31. Measured on this project's 2-core machine in a
/// dev build with `want_grad` (three products of this size): 4.0 s of CPU
/// for the reference unsharded at `n = v = 1024, h = 2048`, 3.6-4.1 s for
/// `naive`, `alg1` and `alg2` over 4 shards, 1.1-1.2 s for the f32 kernels,
/// so a call within every stated limit stays under 10 s (issue #32: 55 s
/// before, at `n * v = 2^26` with `h` as large as the case size allowed).
pub const MAX_LINEAR_WORK: u64 = 1 << 31;

/// Checks `n * v * h` multiply-adds of the output layer against
/// [`MAX_LINEAR_WORK`] before any is done.
///
/// # Errors
/// [`Error::InvalidArgument`] naming `weight`.
pub fn check_linear_work(n: usize, v: usize, h: usize) -> Result<()> {
    let work = n as u128 * v as u128 * h as u128;
    if work > u128::from(MAX_LINEAR_WORK) {
        return Err(Error::invalid(
            "weight",
            format!("{n} tokens x {v} vocabulary entries x {h} hidden = {work} multiply-adds of hidden @ weight^T is over the {MAX_LINEAR_WORK} one call may do"),
        ));
    }
    Ok(())
}

/// The most logits (`n * v`) one call may materialise: 2^26 f64 (512 MiB).
pub const MAX_LOGITS: usize = 1 << 26;

/// Checks that `n * v` logits fit under [`MAX_LOGITS`] before allocating them.
///
/// # Errors
/// [`Error::InvalidArgument`] naming `field`.
pub fn check_logits_size(field: &str, n: usize, v: usize) -> Result<()> {
    match n.checked_mul(v) {
        Some(x) if x <= MAX_LOGITS => Ok(()),
        _ => Err(Error::invalid(
            field,
            format!("{n} tokens x {v} vocabulary entries is over the {MAX_LOGITS} logits one call may hold"),
        )),
    }
}
