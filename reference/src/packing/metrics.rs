//! The figures of a packing (efficiency, speed-up, padding, the bound) and
//! how they are computed from its strategies.

use super::*;

/// Figures that describe a packing. Token counts are exact integers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PackingMetrics {
    /// Algorithm name.
    pub algorithm: String,
    /// Human description of the setting (`max 12/pack`, `depth 3`).
    pub setting: String,
    /// The limit on sequences per pack in force (`None`: unlimited).
    pub max_sequences_per_pack: Option<usize>,
    /// Tokens per pack.
    pub max_seq_len: usize,
    /// Packs (rows) used.
    pub num_packs: u64,
    /// Non-empty input sequences.
    pub num_sequences: u64,
    /// Segments placed in packs (sequences, or pieces of split sequences).
    pub num_segments: u64,
    /// Tokens placed in packs.
    pub real_tokens: u64,
    /// Padding tokens: `num_packs * max_seq_len - real_tokens`.
    pub padding_tokens: u64,
    /// Packing efficiency: `real_tokens / (num_packs * max_seq_len)` (0 with no packs).
    pub efficiency: f64,
    /// Speed-up over one segment per row: `num_segments / num_packs` (1 with no packs).
    pub speedup: f64,
    /// The speed-up with zero padding: `num_segments * max_seq_len / real_tokens`.
    pub speedup_limit: f64,
    /// Mean segments per pack.
    pub sequences_per_pack: f64,
    /// Tokens lost by `truncate` or `drop`.
    pub dropped_tokens: u64,
    /// Sequences left out by `drop`.
    pub dropped_sequences: u64,
    /// Sequences shortened by `truncate`.
    pub truncated_sequences: u64,
    /// Sequences cut into pieces by `split`.
    pub split_sequences: u64,
    /// Empty input sequences (counted, never packed).
    pub empty_sequences: u64,
    /// Wall time of the packing algorithm, in seconds.
    pub seconds: f64,
    /// A lower bound on the packs of any plan for this input within the
    /// limit: the ceiling of the LP optimum at depth `bound_depth` (see
    /// [`lphp::bound`]); `None` where none was computed (only `lphp` computes
    /// it itself; [`with_bound`] adds it). Where column generation stopped
    /// at its caps before converging, a smaller but still valid bound.
    #[serde(default)]
    pub bound_packs: Option<u64>,
    /// `real_tokens / (bound_packs * max_seq_len)`: the efficiency no plan
    /// within the limit can beat.
    #[serde(default)]
    pub bound_efficiency: Option<f64>,
    /// The depth the bound holds at: `Some(d)` for the LP at depth `d` (it
    /// bounds plans with at most `d` sequences per pack); `None` with a bound
    /// present means `ceil(real_tokens / max_seq_len)`, valid at any depth.
    #[serde(default)]
    pub bound_depth: Option<usize>,
    /// `num_packs - bound_packs`: how far the plan is from the bound, in packs
    /// (for `lphp`, the rounding slack).
    #[serde(default)]
    pub gap_packs: Option<u64>,
    /// The LP optimum in fractional packs (or the best proven lower bound on
    /// it, if column generation did not converge), where the bound is an LP bound.
    #[serde(default)]
    pub lp_value: Option<f64>,
    /// Column-generation rounds (LP solves) of that LP.
    #[serde(default)]
    pub lp_iterations: Option<usize>,
}

impl PackingMetrics {
    /// Adds `bound` (computed on the same packed histogram) to the metrics.
    pub fn set_bound(&mut self, bound: &PackBound) {
        let slots = bound.packs.saturating_mul(self.max_seq_len as u64);
        self.bound_packs = Some(bound.packs);
        self.bound_efficiency = Some(if slots > 0 {
            self.real_tokens as f64 / slots as f64
        } else {
            0.0
        });
        self.bound_depth = bound.depth;
        self.gap_packs = Some(self.num_packs.saturating_sub(bound.packs));
        self.lp_value = bound.depth.map(|_| bound.value);
        self.lp_iterations = bound.depth.map(|_| bound.iterations);
    }
}

pub(super) fn metrics(
    config: &PackingConfig,
    input: &Histogram,
    strategies: &[Strategy],
    report: OverlongReport,
    seconds: f64,
) -> PackingMetrics {
    let msl = config.max_seq_len as u64;
    let num_packs: u64 = strategies.iter().map(|s| s.count).sum();
    let num_segments: u64 = strategies
        .iter()
        .map(|s| s.count * s.lengths.len() as u64)
        .sum();
    let real_tokens: u64 = strategies.iter().map(|s| s.count * s.tokens() as u64).sum();
    let ratio = |a: f64, b: f64, empty: f64| if b > 0.0 { a / b } else { empty };
    PackingMetrics {
        algorithm: config.algorithm.name().to_string(),
        setting: config.setting(),
        max_sequences_per_pack: match config.algorithm {
            Algorithm::None => Some(1),
            a => config
                .max_sequences_per_pack
                .or(a.default_max_sequences_per_pack()),
        },
        max_seq_len: config.max_seq_len,
        num_packs,
        num_sequences: input.num_sequences(),
        num_segments,
        real_tokens,
        padding_tokens: num_packs * msl - real_tokens,
        efficiency: ratio(real_tokens as f64, (num_packs * msl) as f64, 0.0),
        speedup: ratio(num_segments as f64, num_packs as f64, 1.0),
        speedup_limit: ratio((num_segments * msl) as f64, real_tokens as f64, 1.0),
        sequences_per_pack: ratio(num_segments as f64, num_packs as f64, 0.0),
        dropped_tokens: report.dropped_tokens,
        dropped_sequences: report.dropped_sequences,
        truncated_sequences: report.truncated_sequences,
        split_sequences: report.split_sequences,
        empty_sequences: input.empty_sequences(),
        seconds,
        bound_packs: None,
        bound_efficiency: None,
        bound_depth: None,
        gap_packs: None,
        lp_value: None,
        lp_iterations: None,
    }
}

/// Adds the lower bound for `config`'s limit ([`lphp::bound`]: the LP at
/// that depth, or the token bound where the LP is too large to price) to
/// `metrics`, computed on `histogram` after the overlong policy. Metrics that
/// already carry a bound (those of `lphp`) are left as they are.
///
/// # Errors
/// The config and histogram errors of [`pack_histogram`].
pub fn with_bound(
    mut metrics: PackingMetrics,
    histogram: &Histogram,
    config: &PackingConfig,
) -> Result<PackingMetrics> {
    if metrics.bound_packs.is_none() {
        metrics.set_bound(&bound_for(histogram, config)?);
    }
    Ok(metrics)
}
