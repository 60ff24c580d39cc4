//! The lower bounds LPHP and the table report: the LP bound at a depth (by
//! column generation), the depth-free token bound, and which of them is
//! cheap enough to compute by default.

use serde::{Deserialize, Serialize};

use super::*;

/// A lower bound on the number of packs of any plan, with how it was found.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PackBound {
    /// The bound in packs: the ceiling of [`PackBound::value`] (with a 1e-9
    /// relative margin against round-off), and never below
    /// `ceil(num_sequences / depth)` or `ceil(real_tokens / max_seq_len)`.
    pub packs: u64,
    /// The bound as a real number: the LP optimum (fractional packs) when
    /// converged, otherwise the best proven lower bound on it; or
    /// `real_tokens / max_seq_len` for the depth-free bound.
    pub value: f64,
    /// `Some(d)`: the LP bound, valid for plans with at most `d` sequences per
    /// pack. `None`: `real_tokens / max_seq_len`, valid at any depth.
    pub depth: Option<usize>,
    /// Column-generation rounds (LP solves) it took; 0 for the depth-free bound.
    pub iterations: usize,
    /// Packs (columns) generated.
    pub columns: usize,
    /// Whether column generation proved the LP optimum (no pack with negative
    /// reduced cost left). An unconverged bound is still a valid bound.
    pub converged: bool,
}

/// Refuses a histogram with a sequence longer than `max_seq_len` (the bounds
/// hold for what is packed: apply the overlong policy first).
fn check_counts(counts: &[u64], max_seq_len: usize) -> Result<()> {
    match (max_seq_len + 1..counts.len()).find(|&l| counts[l] > 0) {
        Some(l) => Err(Error::too_long("histogram", l, l, max_seq_len)),
        None => Ok(()),
    }
}

/// The LP lower bound on the packs of any plan for `counts` (`counts[l]`
/// sequences of length `l`, `l` in `1..=max_seq_len`; `counts[0]`, empty
/// sequences, is ignored) with at most `depth` sequences per pack.
///
/// # Errors
/// [`Error::SequenceTooLong`] for a length over `max_seq_len`;
/// [`Error::InvalidArgument`] (field `max_sequences_per_pack` or
/// `max_seq_len`) when pricing would exceed [`MAX_PRICING_CELLS`] or
/// [`MAX_PRICING_WORK`].
pub fn lp_bound(counts: &[u64], max_seq_len: usize, depth: usize) -> Result<PackBound> {
    check_counts(counts, max_seq_len)?;
    let rows = Rows::new(counts, max_seq_len);
    Ok(warm_lp(&rows, max_seq_len, depth.max(1), &[], false)?.bound)
}

/// The depth-free bound `ceil(real_tokens / max_seq_len)`: no plan can put
/// more than `max_seq_len` tokens in a pack.
///
/// # Errors
/// [`Error::SequenceTooLong`] for a length over `max_seq_len`.
pub fn token_bound(counts: &[u64], max_seq_len: usize) -> Result<PackBound> {
    check_counts(counts, max_seq_len)?;
    let rows = Rows::new(counts, max_seq_len);
    let tokens = rows.tokens();
    Ok(PackBound {
        packs: tokens.div_ceil(max_seq_len.max(1) as u64),
        value: tokens as f64 / max_seq_len.max(1) as f64,
        depth: None,
        iterations: 0,
        columns: 0,
        converged: true,
    })
}

/// The bound reported beside a plan with at most `limit` sequences per pack:
/// the LP bound at `limit` ([`lp_bound`]; at depth 1 the sequence count), or
/// [`token_bound`] where the LP is too large to price.
///
/// # Errors
/// [`Error::SequenceTooLong`] for a length over `max_seq_len`.
pub fn bound(counts: &[u64], max_seq_len: usize, limit: usize) -> Result<PackBound> {
    match lp_bound(counts, max_seq_len, limit) {
        Err(Error::InvalidArgument { .. }) => token_bound(counts, max_seq_len),
        other => other,
    }
}

/// Pricing steps of one column-generation round up to which [`bound`] counts
/// as cheap (~1-5 ms a round): small histograms (a few dozen distinct lengths
/// at depth 3). Wikipedia at depth 3 takes ~4e6 steps a round, at depth 12
/// ~1.5e7.
pub const CHEAP_BOUND_STEPS: u64 = 1 << 20;

/// Whether [`bound`] is cheap for this input: the LP is trivial (depth 1, no
/// sequence), too large to price (then the bound is the free token bound), or
/// one pricing round takes at most [`CHEAP_BOUND_STEPS`] steps.
pub fn bound_is_cheap(counts: &[u64], max_seq_len: usize, limit: usize) -> bool {
    let rows = Rows::new(counts, max_seq_len);
    if rows.lengths.is_empty() || limit <= 1 {
        return true;
    }
    let pricer = Pricer {
        lengths: &rows.lengths,
        max_seq_len,
        depth: limit,
    };
    match pricer.check(&rows.counts) {
        Ok(steps) => steps <= CHEAP_BOUND_STEPS,
        Err(_) => true,
    }
}
