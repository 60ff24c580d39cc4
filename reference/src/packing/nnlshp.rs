//! Non-negative least-squares histogram packing (NNLSHP, Krell et al., §3.3).
//!
//! 1. List every multiset of at most `depth` lengths that fills `max_seq_len`
//!    exactly (the strategies; 21,846 of them for 512 at depth 3).
//! 2. Packing matrix `A: [max_seq_len, strategies]`, `A[l-1, j]` = how often
//!    length `l` occurs in strategy `j`; solve `min ||W (A x - h)||` with
//!    `x >= 0`, where the weights `W` are 0.09 for lengths 1..=8 and 1 above
//!    (the paper: a residual on short sequences costs little padding).
//! 3. Round `x` half-to-even (numpy's `rint`, as the paper's code does).
//! 4. The paper's residual handling: each sequence the rounded plan does not
//!    cover gets a pack of its own (the reference code adds the depth-2 pack
//!    `[l, max_seq_len - l]` and counts its second slot as padding, which fails
//!    at depth 1 and for `l == max_seq_len`; a single-sequence pack is the same
//!    pack count and never fails).
//! 5. Slots the rounded plan reserves for sequences that do not exist (the
//!    negative residual) are padding: they are taken out of the strategies so
//!    that every sequence is in exactly one pack. A pack left with no sequence
//!    at all is dropped.

use super::nnls::{nnls, SparseColumns};
use super::Strategy;
use crate::error::{Error, Result};

/// The paper's residual weights: lengths up to this get [`SHORT_WEIGHT`].
pub const PENALIZATION_CUTOFF: usize = 8;
/// Weight of the residual of short sequences (lengths `1..=PENALIZATION_CUTOFF`).
pub const SHORT_WEIGHT: f64 = 0.09;
/// The largest strategy set NNLSHP will build (depth 4 at length 512 is ~0.9 M).
pub const MAX_STRATEGIES: usize = 2_000_000;

/// Refuses, in O(1) before any work, a depth and length whose exact-fill
/// strategy set is certainly over [`MAX_STRATEGIES`]: the partitions of `n`
/// into at most `depth` parts are at least `floor(n / 2) + 1` for depth 2 and
/// at least `round((n + 3)^2 / 12)` (the count for 3 parts) for depth 3 or more.
/// Below that [`exact_fill_strategies`] still stops at the cap.
///
/// # Errors
/// [`Error::InvalidArgument`] on `max_sequences_per_pack`.
pub fn check_strategy_count(max_seq_len: usize, depth: usize) -> Result<()> {
    let n = max_seq_len as u128;
    let at_least = match depth {
        0 | 1 => 1,
        2 => n / 2 + 1,
        _ => ((n + 3) * (n + 3) + 6) / 12,
    };
    if at_least > MAX_STRATEGIES as u128 {
        return Err(Error::invalid(
            "max_sequences_per_pack",
            format!("depth {depth} at max_seq_len {max_seq_len} gives over {MAX_STRATEGIES} strategies; use a smaller depth"),
        ));
    }
    Ok(())
}

/// Every multiset of at most `depth` lengths in `1..=max_seq_len` summing to
/// exactly `max_seq_len`, each sorted in descending order.
///
/// # Errors
/// [`Error::InvalidArgument`] on `max_sequences_per_pack` when there would be
/// more than [`MAX_STRATEGIES`].
pub fn exact_fill_strategies(max_seq_len: usize, depth: usize) -> Result<Vec<Vec<usize>>> {
    fn rec(
        remaining: usize,
        max_part: usize,
        depth: usize,
        prefix: &mut Vec<usize>,
        out: &mut Vec<Vec<usize>>,
        cap: usize,
    ) -> bool {
        if remaining == 0 {
            out.push(prefix.clone());
            return out.len() <= cap;
        }
        if depth == 0 {
            return true;
        }
        // The largest part is at most `max_part`; with `depth` parts left the
        // largest must be at least ceil(remaining / depth).
        let lo = remaining.div_ceil(depth);
        for part in (lo..=max_part.min(remaining)).rev() {
            prefix.push(part);
            let ok = rec(remaining - part, part, depth - 1, prefix, out, cap);
            prefix.pop();
            if !ok {
                return false;
            }
        }
        true
    }
    let mut out = Vec::new();
    if !rec(
        max_seq_len,
        max_seq_len,
        depth,
        &mut Vec::new(),
        &mut out,
        MAX_STRATEGIES,
    ) {
        return Err(Error::invalid(
            "max_sequences_per_pack",
            format!("depth {depth} at max_seq_len {max_seq_len} gives over {MAX_STRATEGIES} strategies; use a smaller depth"),
        ));
    }
    Ok(out)
}

/// NNLSHP's weighted least-squares problem: the strategies, the packing
/// matrix `W A: [max_seq_len, strategies]` and `W h: [max_seq_len]`.
fn problem(
    counts: &[u64],
    max_seq_len: usize,
    depth: usize,
) -> Result<(Vec<Vec<usize>>, SparseColumns, Vec<f64>)> {
    let strategies = exact_fill_strategies(max_seq_len, depth)?;
    let weight = |l: usize| {
        if l <= PENALIZATION_CUTOFF {
            SHORT_WEIGHT
        } else {
            1.0
        }
    };

    let mut a = SparseColumns::weighted((1..=max_seq_len).map(weight).collect());
    let mut rows: Vec<usize> = Vec::with_capacity(depth);
    for s in &strategies {
        // Descending lengths: rows (l - 1) ascending means walking the strategy backwards.
        rows.clear();
        rows.extend(s.iter().rev().map(|&l| l - 1));
        a.push_multiset(&rows);
    }
    let b: Vec<f64> = (1..=max_seq_len)
        .map(|l| weight(l) * counts[l] as f64)
        .collect();
    Ok((strategies, a, b))
}

/// NNLSHP on `counts[l]`, `l` in `1..=max_seq_len`, at most `depth` sequences per pack.
pub(crate) fn nnlshp(counts: &[u64], max_seq_len: usize, depth: usize) -> Result<Vec<Strategy>> {
    let (strategies, a, b) = problem(counts, max_seq_len, depth)?;
    let x = nnls(&a, &b)?;

    let mut repeat: Vec<u64> = x
        .iter()
        .map(|&v| v.round_ties_even().max(0.0) as u64)
        .collect();
    // Residual h - A x in whole sequences.
    let mut covered = vec![0u64; max_seq_len + 1];
    for (s, &r) in strategies.iter().zip(&repeat) {
        for &l in s {
            covered[l] += r;
        }
    }
    let mut out: Vec<Strategy> = Vec::new();
    for l in 1..=max_seq_len {
        if counts[l] > covered[l] {
            // Uncovered sequences: one pack each (the paper's residual handling).
            out.push(Strategy {
                lengths: vec![l],
                count: counts[l] - covered[l],
            });
        }
    }
    // Take the phantom slots (covered > count) out of the strategies.
    let mut phantom: Vec<u64> = (0..=max_seq_len)
        .map(|l| covered[l].saturating_sub(counts[l]))
        .collect();
    let mut work: Vec<Strategy> = Vec::new();
    for (s, r) in strategies.into_iter().zip(repeat.drain(..)) {
        if r > 0 {
            work.push(Strategy {
                lengths: s,
                count: r,
            });
        }
    }
    while let Some(mut s) = work.pop() {
        let Some(pos) = s.lengths.iter().position(|&l| phantom[l] > 0) else {
            out.push(s);
            continue;
        };
        let l = s.lengths[pos];
        let take = phantom[l].min(s.count);
        phantom[l] -= take;
        let mut reduced = s.lengths.clone();
        reduced.remove(pos);
        if !reduced.is_empty() {
            work.push(Strategy {
                lengths: reduced,
                count: take,
            });
        }
        s.count -= take;
        if s.count > 0 {
            work.push(s);
        }
    }
    debug_assert!(phantom.iter().all(|&p| p == 0));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn squad_depth3_reaches_scipys_objective() {
        // scipy 1.17.1's NNLS on the public reference's own SQuAD problem
        // (scripts/nnls_uniqueness.py, any column order): residual norm
        // 297.6686269654777, 372 columns in use, 38,569.2424 fractional packs,
        // rounded to 40,778 packs. Ours reaches the same objective with the
        // same number of columns and fractional packs but another x (326 of
        // the strategies differ): the optimum is not unique, and rounding
        // the other vertex gives 40,781 (docs/PACKING.md).
        let h = crate::packing::Histogram::embedded("squad-384").unwrap();
        let (_, a, b) = problem(h.counts(), 384, 3).unwrap();
        let x = nnls(&a, &b).unwrap();
        let mut r = b.clone();
        for (j, &xj) in x.iter().enumerate() {
            for &(row, v) in a.col(j) {
                r[row] -= v * xj;
            }
        }
        let rnorm = r.iter().map(|v| v * v).sum::<f64>().sqrt();
        assert!(
            (rnorm - 297.668_626_965_477_7).abs() <= 1e-9 * 297.67,
            "{rnorm}"
        );
        assert_eq!(x.iter().filter(|&&v| v > 0.0).count(), 372);
        let fractional: f64 = x.iter().sum();
        assert!(
            (fractional - 38_569.242_366_551).abs() < 1e-6,
            "{fractional}"
        );
        let packs: u64 = nnlshp(h.counts(), 384, 3)
            .unwrap()
            .iter()
            .map(|s| s.count)
            .sum();
        assert_eq!(packs, 40_781);
    }

    #[test]
    fn strategy_counts_are_the_partition_numbers() {
        // Partitions of 512 into at most 3 parts: 1 + 256 + round(512^2 / 12).
        assert_eq!(exact_fill_strategies(512, 1).unwrap().len(), 1);
        assert_eq!(exact_fill_strategies(512, 2).unwrap().len(), 257);
        assert_eq!(
            exact_fill_strategies(512, 3).unwrap().len(),
            1 + 256 + 21845
        );
        // Partitions of 8 into at most 8 parts = p(8) = 22.
        assert_eq!(exact_fill_strategies(8, 8).unwrap().len(), 22);
        for s in exact_fill_strategies(30, 4).unwrap() {
            assert_eq!(s.iter().sum::<usize>(), 30);
            assert!(s.windows(2).all(|w| w[0] >= w[1]));
        }
    }

    #[test]
    fn too_many_strategies_is_an_error() {
        let err = exact_fill_strategies(512, 6).unwrap_err();
        assert_eq!(err.kind(), "invalid_argument");
    }
}
