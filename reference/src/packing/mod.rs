//! Sequence packing without cross-contamination (Krell et al., arXiv:2107.02027).
//!
//! Shapes and units: lengths and `max_seq_len` are in tokens; a *pack* is one
//! row of `max_seq_len` tokens holding one or more sequences; a *strategy* is a
//! multiset of lengths that share a pack, with a *repeat count* (how many packs
//! use it). Every algorithm works on a length [`Histogram`] and returns
//! strategies with exact integer bookkeeping: each sequence of the histogram is
//! in exactly one pack ([`check_strategies`] proves it for any result).
//!
//! | algorithm | what it does | source |
//! |---|---|---|
//! | `none` | one sequence per row: the padding baseline | — |
//! | `spfhp` | shortest-pack-first histogram packing | Krell et al. §3.2, App. Alg. 1 |
//! | `lpfhp` | longest-pack-first (best fit, distributed repeats) | Krell et al. App. Alg. 2 |
//! | `nnlshp` | weighted NNLS over all exact-fill packs of `depth` sequences | Krell et al. §3.3 |
//! | `lphp` | the covering LP over all packs of at most `depth` sequences, by column generation, rounded | Gilmore & Gomory 1961; see [`lphp`] |
//! | `ffd` | first-fit decreasing | Johnson 1973 |
//! | `bfd` | best-fit decreasing | Johnson 1973 |
//!
//! **The bound.** The LP optimum at depth `d` is a lower bound on the packs of
//! any plan with at most `d` sequences per pack ([`lphp::bound`]);
//! `lphp` reports it in its [`PackingMetrics`], [`with_bound`] adds it to any
//! algorithm's.
//!
//! On explicit lengths, [`pack_lengths`] maps every input sequence (or, when
//! split, each piece and its offset) to a pack; [`batch::PackedBatch`] turns
//! token sequences and a plan into model inputs (`input_ids`, `position_ids`,
//! `sequence_ids`, `cu_seqlens`).
//!
//! **Empty sequences** (length 0) are never placed in a pack: they are counted
//! (`empty_sequences`) and skipped, so they cannot create zero-length segments
//! or shift any later index.
//!
//! **Overlong sequences** follow [`Overlong`]: an error by default, naming the
//! sequence and its length; `split` keeps every token; `truncate` and `drop`
//! report the tokens (and sequences) lost.

pub mod batch;
mod heuristics;
pub mod histogram;
pub mod lphp;
mod metrics;
mod nnls;
pub mod nnlshp;
use metrics::metrics;
pub use metrics::{with_bound, PackingMetrics};

use std::fmt;
use std::str::FromStr;
use std::time::Instant;

use serde::{Deserialize, Serialize};

pub use batch::PackedBatch;
pub use histogram::{EmbeddedHistogram, Histogram, EMBEDDED, EMBEDDED_SOURCE};
pub use lphp::PackBound;

use crate::error::{Error, Result};

/// The packing algorithms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Algorithm {
    /// One sequence per row (the padding baseline).
    None,
    /// Shortest-pack-first histogram packing.
    Spfhp,
    /// Longest-pack-first histogram packing.
    Lpfhp,
    /// Non-negative least-squares histogram packing.
    Nnlshp,
    /// First-fit decreasing.
    Ffd,
    /// Best-fit decreasing.
    Bfd,
    /// Linear-programming histogram packing (column generation, rounded).
    Lphp,
}

impl Algorithm {
    /// Every algorithm, in the order reports list them.
    pub const ALL: [Algorithm; 7] = [
        Algorithm::None,
        Algorithm::Spfhp,
        Algorithm::Lpfhp,
        Algorithm::Nnlshp,
        Algorithm::Ffd,
        Algorithm::Bfd,
        Algorithm::Lphp,
    ];

    /// The lowercase name used on the command line and in JSON.
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::None => "none",
            Algorithm::Spfhp => "spfhp",
            Algorithm::Lpfhp => "lpfhp",
            Algorithm::Nnlshp => "nnlshp",
            Algorithm::Ffd => "ffd",
            Algorithm::Bfd => "bfd",
            Algorithm::Lphp => "lphp",
        }
    }

    /// The `max_sequences_per_pack` used when none is given: 3 (the depth) for
    /// NNLSHP and LPHP, unlimited for the others.
    pub fn default_max_sequences_per_pack(self) -> Option<usize> {
        match self {
            Algorithm::Nnlshp | Algorithm::Lphp => Some(3),
            _ => None,
        }
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Algorithm {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Algorithm::ALL
            .into_iter()
            .find(|a| a.name() == s)
            .ok_or_else(|| {
                let names: Vec<_> = Algorithm::ALL.iter().map(|a| a.name()).collect();
                Error::invalid(
                    "algorithm",
                    format!("unknown algorithm {s:?}; known: {}", names.join(", ")),
                )
            })
    }
}

/// What to do with a sequence longer than `max_seq_len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Overlong {
    /// Refuse: [`Error::SequenceTooLong`] names the sequence and its length.
    #[default]
    Error,
    /// Cut into pieces of `max_seq_len` tokens (the last one shorter); no token is lost.
    Split,
    /// Keep the first `max_seq_len` tokens; the rest are counted in `dropped_tokens`.
    Truncate,
    /// Leave the whole sequence out; counted in `dropped_sequences` and `dropped_tokens`.
    Drop,
}

impl FromStr for Overlong {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "error" => Ok(Overlong::Error),
            "split" => Ok(Overlong::Split),
            "truncate" => Ok(Overlong::Truncate),
            "drop" => Ok(Overlong::Drop),
            _ => Err(Error::invalid(
                "overlong",
                format!("unknown policy {s:?}; known: error, split, truncate, drop"),
            )),
        }
    }
}

/// The largest `max_seq_len` accepted (2^24 tokens): far beyond any model,
/// small enough that per-length tables always fit in memory.
pub const MAX_SEQ_LEN_LIMIT: usize = 1 << 24;

/// The longest explicit sequence [`pack_lengths`] accepts (2^40 tokens).
pub const MAX_SEQUENCE_TOKENS: usize = 1 << 40;

/// The most distinct lengths FFD and BFD accept (2^15): they keep runs of
/// identical bins in opening order and scan them for each length, so their
/// time grows with the square of the distinct lengths (~0.3 s at this limit,
/// ~20 s at 250,000). Refused before any work; SPFHP and LPFHP have no such
/// limit (O((R + S) log S)).
pub const MAX_FIT_LENGTHS: usize = 1 << 15;

/// The most entries one explicit plan may hold (2^20): segments, empty and
/// dropped sequences together (a plan lists each one, and `eval` prints it).
/// Pack larger datasets as a histogram.
pub const MAX_PLAN_SEGMENTS: usize = 1 << 20;

/// How to pack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackingConfig {
    /// Tokens per pack (the row length), at least 1.
    pub max_seq_len: usize,
    /// The algorithm.
    pub algorithm: Algorithm,
    /// At most this many sequences in one pack (`None`: unlimited, or the
    /// algorithm's default, see [`Algorithm::default_max_sequences_per_pack`]).
    /// For `nnlshp` and `lphp` this is the depth.
    pub max_sequences_per_pack: Option<usize>,
    /// Policy for sequences longer than `max_seq_len`.
    pub overlong: Overlong,
}

impl PackingConfig {
    /// A config with the algorithm's default limit and overlong = error.
    pub fn new(algorithm: Algorithm, max_seq_len: usize) -> Self {
        PackingConfig {
            max_seq_len,
            algorithm,
            max_sequences_per_pack: None,
            overlong: Overlong::Error,
        }
    }

    /// Sets `max_sequences_per_pack`.
    pub fn with_max_sequences_per_pack(mut self, limit: Option<usize>) -> Self {
        self.max_sequences_per_pack = limit;
        self
    }

    /// Sets the overlong policy.
    pub fn with_overlong(mut self, overlong: Overlong) -> Self {
        self.overlong = overlong;
        self
    }

    /// The effective limit on sequences per pack (`max_seq_len` when unlimited,
    /// since no pack can hold more non-empty sequences than tokens).
    pub fn limit(&self) -> usize {
        let limit = self
            .max_sequences_per_pack
            .or(self.algorithm.default_max_sequences_per_pack());
        match self.algorithm {
            Algorithm::None => 1,
            _ => limit.unwrap_or(self.max_seq_len).min(self.max_seq_len),
        }
    }

    /// A short human description of the setting, e.g. `max 12/pack` or `depth 3`.
    pub fn setting(&self) -> String {
        match (
            self.algorithm,
            self.max_sequences_per_pack
                .or(self.algorithm.default_max_sequences_per_pack()),
        ) {
            (Algorithm::None, _) => "1/pack".to_string(),
            (Algorithm::Nnlshp | Algorithm::Lphp, Some(d)) => format!("depth {d}"),
            (_, Some(k)) => format!("max {k}/pack"),
            (_, None) => "unlimited".to_string(),
        }
    }

    /// Checks the config before any work: `max_seq_len` in
    /// `1..=MAX_SEQ_LEN_LIMIT`, a limit of at least 1, and for `nnlshp` a
    /// strategy set within [`nnlshp::MAX_STRATEGIES`].
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the field.
    pub fn validate(&self) -> Result<()> {
        if self.max_seq_len == 0 {
            return Err(Error::invalid("max_seq_len", "must be at least 1"));
        }
        if self.max_seq_len > MAX_SEQ_LEN_LIMIT {
            return Err(Error::invalid(
                "max_seq_len",
                format!(
                    "{} is over the supported {MAX_SEQ_LEN_LIMIT} tokens per pack",
                    self.max_seq_len
                ),
            ));
        }
        if self.max_sequences_per_pack == Some(0) {
            return Err(Error::invalid(
                "max_sequences_per_pack",
                "must be at least 1",
            ));
        }
        if self.algorithm == Algorithm::Nnlshp {
            nnlshp::check_strategy_count(self.max_seq_len, self.limit())?;
        }
        Ok(())
    }
}

/// A strategy: the lengths that share one pack (descending) and how many packs use it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Strategy {
    /// Sequence lengths in the pack, in tokens, longest first.
    pub lengths: Vec<usize>,
    /// Repeat count: number of packs with exactly these lengths.
    pub count: u64,
}

impl Strategy {
    /// Tokens used by one pack of this strategy.
    pub fn tokens(&self) -> usize {
        self.lengths.iter().sum()
    }
}

/// Sorts lengths within strategies (descending), merges identical strategies,
/// drops empty ones and orders them by descending lengths: one canonical form
/// for every algorithm, so plans and snapshots are deterministic.
pub fn canonicalize(strategies: Vec<Strategy>) -> Vec<Strategy> {
    let mut out: Vec<Strategy> = strategies
        .into_iter()
        .filter(|s| s.count > 0 && !s.lengths.is_empty())
        .map(|mut s| {
            s.lengths.sort_unstable_by(|a, b| b.cmp(a));
            s
        })
        .collect();
    // Sorted (descending), then equal packs merged: one pass, no map.
    out.sort_unstable_by(|a, b| b.lengths.cmp(&a.lengths));
    out.dedup_by(|later, kept| {
        let same = later.lengths == kept.lengths;
        if same {
            kept.count += later.count;
        }
        same
    });
    out
}

/// Verifies that `strategies` pack `histogram` (lengths `1..`) exactly: every
/// sequence in exactly one pack, no pack over `max_seq_len` tokens or over
/// `limit` sequences, no empty pack.
///
/// # Errors
/// [`Error::InvalidArgument`] on field `strategies` describing the first violation.
pub fn check_strategies(
    histogram: &Histogram,
    strategies: &[Strategy],
    max_seq_len: usize,
    limit: usize,
) -> Result<()> {
    let mut placed = vec![0u64; histogram.max_length().max(max_seq_len) + 1];
    for (i, s) in strategies.iter().enumerate() {
        let bad = |m: String| {
            Err(Error::invalid(
                "strategies",
                format!("strategy {i} {:?}: {m}", s.lengths),
            ))
        };
        if s.lengths.is_empty() {
            return bad("is empty".into());
        }
        if s.tokens() > max_seq_len {
            return bad(format!(
                "holds {} tokens, over max_seq_len {max_seq_len}",
                s.tokens()
            ));
        }
        if s.lengths.len() > limit {
            return bad(format!(
                "holds {} sequences, over the limit {limit}",
                s.lengths.len()
            ));
        }
        for &l in &s.lengths {
            if l == 0 || l >= placed.len() {
                return bad(format!("has a length {l} that is not in the histogram"));
            }
            placed[l] += s.count;
        }
    }
    for (l, &p) in placed.iter().enumerate().skip(1) {
        if p != histogram.count(l) {
            return Err(Error::invalid(
                "strategies",
                format!(
                    "length {l}: {p} sequences placed, histogram has {}",
                    histogram.count(l)
                ),
            ));
        }
    }
    Ok(())
}

/// What the overlong policy did to a histogram.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct OverlongReport {
    dropped_tokens: u64,
    dropped_sequences: u64,
    truncated_sequences: u64,
    split_sequences: u64,
}

/// Applies the overlong policy to a histogram: returns the histogram of what
/// is packed (lengths `0..=max_seq_len`) and what was lost.
fn fit_histogram(
    histogram: &Histogram,
    config: &PackingConfig,
) -> Result<(Histogram, OverlongReport)> {
    let msl = config.max_seq_len;
    let mut counts = vec![0u64; msl + 1];
    let mut report = OverlongReport::default();
    let too_large = || {
        Error::invalid(
            "histogram",
            format!(
                "too large: the padded baseline would need over 2^63 token slots of {msl} tokens"
            ),
        )
    };
    // Every product below is bounded by `segments * max_seq_len`; keep it in u64.
    let mut slots: u64 = 0;
    let mut add = |counts: &mut Vec<u64>, length: usize, count: u64| -> Result<()> {
        counts[length] = counts[length].checked_add(count).ok_or_else(too_large)?;
        slots = count
            .checked_mul(msl as u64)
            .and_then(|s| slots.checked_add(s))
            .filter(|&s| s <= i64::MAX as u64)
            .ok_or_else(too_large)?;
        Ok(())
    };
    for (l, &c) in histogram.counts().iter().enumerate() {
        if c == 0 {
            continue;
        }
        if l <= msl {
            add(&mut counts, l, c)?;
            continue;
        }
        match config.overlong {
            Overlong::Error => return Err(Error::too_long("histogram", l, l, msl)),
            Overlong::Split => {
                add(
                    &mut counts,
                    msl,
                    c.checked_mul((l / msl) as u64).ok_or_else(too_large)?,
                )?;
                if l % msl > 0 {
                    add(&mut counts, l % msl, c)?;
                }
                report.split_sequences = report.split_sequences.saturating_add(c);
            }
            Overlong::Truncate => {
                add(&mut counts, msl, c)?;
                report.truncated_sequences = report.truncated_sequences.saturating_add(c);
                report.dropped_tokens = c
                    .checked_mul((l - msl) as u64)
                    .and_then(|d| report.dropped_tokens.checked_add(d))
                    .ok_or_else(too_large)?;
            }
            Overlong::Drop => {
                report.dropped_sequences = report.dropped_sequences.saturating_add(c);
                report.dropped_tokens = c
                    .checked_mul(l as u64)
                    .and_then(|d| report.dropped_tokens.checked_add(d))
                    .ok_or_else(too_large)?;
            }
        }
    }
    Ok((Histogram::from_counts(counts), report))
}

/// The result of packing a histogram.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HistogramPacking {
    /// Canonical strategies (see [`canonicalize`]) with repeat counts.
    pub strategies: Vec<Strategy>,
    /// Figures of the packing.
    pub metrics: PackingMetrics,
}

/// Packs a histogram.
///
/// `histogram` may hold lengths over `config.max_seq_len`; they follow
/// `config.overlong`. Empty sequences are counted and skipped.
///
/// # Errors
/// [`Error::SequenceTooLong`] (field `histogram`, index = the length) under
/// `overlong = error`; [`Error::InvalidArgument`] for `max_seq_len == 0`,
/// `max_sequences_per_pack == 0`, or an NNLSHP depth with too many strategies.
pub fn pack_histogram(histogram: &Histogram, config: &PackingConfig) -> Result<HistogramPacking> {
    config.validate()?;
    let (fitted, report) = fit_histogram(histogram, config)?;
    check_fitted(&fitted, config)?;
    let msl = config.max_seq_len;
    let limit = config.limit();
    let counts = fitted.counts();
    let start = Instant::now();
    let mut bound = None;
    let strategies = match config.algorithm {
        Algorithm::None => (1..=msl)
            .map(|l| Strategy {
                lengths: vec![l],
                count: counts[l],
            })
            .collect(),
        Algorithm::Spfhp => heuristics::spfhp(counts, msl, limit),
        Algorithm::Lpfhp => heuristics::lpfhp(counts, msl, limit),
        Algorithm::Nnlshp => nnlshp::nnlshp(counts, msl, limit)?,
        Algorithm::Ffd => heuristics::fit_decreasing(counts, msl, limit, heuristics::Fit::First),
        Algorithm::Bfd => heuristics::fit_decreasing(counts, msl, limit, heuristics::Fit::Best),
        Algorithm::Lphp => {
            let (strategies, report) = lphp::lphp(counts, msl, limit)?;
            bound = Some(report.bound);
            strategies
        }
    };
    let strategies = canonicalize(strategies);
    let seconds = start.elapsed().as_secs_f64();
    debug_assert_eq!(check_strategies(&fitted, &strategies, msl, limit), Ok(()));
    let mut metrics = metrics(config, histogram, &strategies, report, seconds);
    if let Some(bound) = &bound {
        metrics.set_bound(bound);
    }
    Ok(HistogramPacking {
        strategies,
        metrics,
    })
}

/// The limits that depend on the input, checked before any packing work:
/// [`MAX_FIT_LENGTHS`] for `ffd` and `bfd`.
fn check_fitted(fitted: &Histogram, config: &PackingConfig) -> Result<()> {
    if matches!(config.algorithm, Algorithm::Ffd | Algorithm::Bfd) {
        let distinct = fitted.counts().iter().skip(1).filter(|&&c| c > 0).count();
        if distinct > MAX_FIT_LENGTHS {
            return Err(Error::invalid(
                "histogram",
                format!(
                    "{}: {distinct} distinct lengths is over the {MAX_FIT_LENGTHS} it packs in reasonable time (its time grows with their square); use spfhp or lpfhp",
                    config.algorithm
                ),
            ));
        }
    }
    Ok(())
}

/// Checks `config` on `histogram` without packing: the config
/// ([`PackingConfig::validate`]), the overlong policy and the input limits of
/// the algorithm. A table checks every row with this before running any.
///
/// # Errors
/// Those of [`pack_histogram`] that come before any packing work.
pub fn check_input(histogram: &Histogram, config: &PackingConfig) -> Result<()> {
    config.validate()?;
    let (fitted, _) = fit_histogram(histogram, config)?;
    check_fitted(&fitted, config)
}

/// The lower bound on packs for `config`'s limit ([`lphp::bound`]) on
/// `histogram` after the overlong policy: what [`with_bound`] adds.
///
/// # Errors
/// As [`with_bound`].
pub fn bound_for(histogram: &Histogram, config: &PackingConfig) -> Result<PackBound> {
    config.validate()?;
    let (fitted, _) = fit_histogram(histogram, config)?;
    lphp::bound(fitted.counts(), config.max_seq_len, config.limit())
}

/// Whether [`bound_for`] is cheap for `config` on `histogram`
/// ([`lphp::bound_is_cheap`], after the overlong policy); `false` where the
/// config or histogram is invalid.
pub fn bound_is_cheap(histogram: &Histogram, config: &PackingConfig) -> bool {
    config.validate().is_ok()
        && fit_histogram(histogram, config).is_ok_and(|(fitted, _)| {
            lphp::bound_is_cheap(fitted.counts(), config.max_seq_len, config.limit())
        })
}

/// One segment of a pack: tokens `offset..offset + length` of input `sequence`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Segment {
    /// Index of the input sequence.
    pub sequence: usize,
    /// First token of the segment within that sequence (non-zero only for
    /// later pieces of a split sequence).
    pub offset: usize,
    /// Tokens in the segment (1..=max_seq_len).
    pub length: usize,
}

/// A packing of explicit sequences: which segments go in which pack.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PackingPlan {
    /// `packs[p]` lists the segments of pack `p` in order.
    pub packs: Vec<Vec<Segment>>,
    /// The strategies the packs were drawn from.
    pub strategies: Vec<Strategy>,
    /// Indices of the empty input sequences (never packed).
    pub empty_sequences: Vec<usize>,
    /// Indices of sequences left out by `overlong = drop`.
    pub dropped_sequences: Vec<usize>,
    /// Figures of the packing.
    pub metrics: PackingMetrics,
}

/// Packs explicit sequence lengths (`lengths: [n]`, tokens each).
///
/// The histogram of the (fitted) lengths is packed with `config.algorithm`,
/// then the strategies' slots are filled with the input segments of matching
/// length in input order, so the plan is deterministic. A split sequence's
/// pieces are separate segments with increasing `offset`.
///
/// # Errors
/// [`Error::SequenceTooLong`] (field `lengths`, the index and length of the
/// first overlong sequence) under `overlong = error`; [`Error::InvalidArgument`]
/// for a sequence over [`MAX_SEQUENCE_TOKENS`] or a plan over
/// [`MAX_PLAN_SEGMENTS`]; the config errors of [`pack_histogram`].
pub fn pack_lengths(lengths: &[usize], config: &PackingConfig) -> Result<PackingPlan> {
    config.validate()?;
    let msl = config.max_seq_len;
    let mut segments: Vec<Segment> = Vec::with_capacity(lengths.len());
    let mut empty = Vec::new();
    let mut dropped = Vec::new();
    let mut report = OverlongReport::default();
    let too_many = || {
        Error::invalid(
            "lengths",
            format!(
                "the plan would list over {MAX_PLAN_SEGMENTS} segments and empty or dropped sequences; pack the histogram instead, or in smaller batches"
            ),
        )
    };
    for (i, &l) in lengths.iter().enumerate() {
        if l > MAX_SEQUENCE_TOKENS {
            return Err(Error::invalid(
                format!("lengths[{i}]"),
                format!("{l} tokens is over the supported {MAX_SEQUENCE_TOKENS}"),
            ));
        }
        if l == 0 {
            empty.push(i);
        } else if l <= msl {
            segments.push(Segment {
                sequence: i,
                offset: 0,
                length: l,
            });
        } else {
            match config.overlong {
                Overlong::Error => return Err(Error::too_long("lengths", i, l, msl)),
                Overlong::Split => {
                    if segments.len() + empty.len() + dropped.len() + l.div_ceil(msl)
                        > MAX_PLAN_SEGMENTS
                    {
                        return Err(too_many());
                    }
                    for offset in (0..l).step_by(msl) {
                        segments.push(Segment {
                            sequence: i,
                            offset,
                            length: msl.min(l - offset),
                        });
                    }
                    report.split_sequences += 1;
                }
                Overlong::Truncate => {
                    segments.push(Segment {
                        sequence: i,
                        offset: 0,
                        length: msl,
                    });
                    report.truncated_sequences += 1;
                    report.dropped_tokens += (l - msl) as u64;
                }
                Overlong::Drop => {
                    dropped.push(i);
                    report.dropped_sequences += 1;
                    report.dropped_tokens += l as u64;
                }
            }
        }
        // Empty and dropped sequences are listed in the plan too: they count.
        if segments.len() + empty.len() + dropped.len() > MAX_PLAN_SEGMENTS {
            return Err(too_many());
        }
    }
    // Every segment fits now: pack their histogram.
    let mut counts = vec![0u64; msl + 1];
    for s in &segments {
        counts[s.length] += 1;
    }
    let fitted = Histogram::from_counts(counts);
    let mut packing = pack_histogram(&fitted, config)?;
    let m = &mut packing.metrics;
    m.num_sequences = (lengths.len() - empty.len()) as u64;
    m.empty_sequences = empty.len() as u64;
    m.dropped_tokens = report.dropped_tokens;
    m.dropped_sequences = report.dropped_sequences;
    m.truncated_sequences = report.truncated_sequences;
    m.split_sequences = report.split_sequences;

    // Queues of segments by length, in input order.
    let mut by_length: Vec<std::collections::VecDeque<Segment>> = vec![Default::default(); msl + 1];
    for s in segments {
        by_length[s.length].push_back(s);
    }
    let mut packs = Vec::with_capacity(packing.metrics.num_packs as usize);
    for strategy in &packing.strategies {
        for _ in 0..strategy.count {
            let pack: Vec<Segment> = strategy
                .lengths
                .iter()
                .map(|&l| {
                    by_length[l]
                        .pop_front()
                        .expect("strategies place exactly the fitted segments")
                })
                .collect();
            packs.push(pack);
        }
    }
    debug_assert!(by_length.iter().all(|q| q.is_empty()));
    Ok(PackingPlan {
        packs,
        strategies: packing.strategies,
        empty_sequences: empty,
        dropped_sequences: dropped,
        metrics: packing.metrics,
    })
}

#[cfg(test)]
mod tests;
