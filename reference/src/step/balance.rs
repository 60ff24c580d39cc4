//! How evenly context parallelism spreads causal attention work: each
//! rank's **allowed query-key pairs** (a real query at position `p` of its
//! document sees `p + 1` keys), under the load-balanced split (chunks `r`
//! and `2 cp - 1 - r` of every document, [`super::cp_partition`]) and under
//! a contiguous split (the pack cut into `cp` equal runs of slots, a query
//! late in a long document on the last rank: causal work grows with the
//! position, so the last rank gets the most).

use rand::distr::weighted::WeightedIndex;
use rand::distr::Distribution;
use rand::SeedableRng;

use super::partition::cp_partition;
use crate::error::{Error, Result};
use crate::packing::Histogram;

/// Per-rank work of one pack under both splits.
#[derive(Debug, Clone, PartialEq)]
pub struct Balance {
    /// Documents in the pack.
    pub documents: usize,
    /// Real tokens in the pack.
    pub tokens: usize,
    /// Per rank, the load-balanced split's allowed pairs.
    pub balanced: Vec<u64>,
    /// Per rank, the contiguous split's allowed pairs.
    pub contiguous: Vec<u64>,
}

/// `max / min` of per-rank work (`inf` when a rank has none).
pub fn max_over_min(work: &[u64]) -> f64 {
    let max = work.iter().copied().max().unwrap_or(0) as f64;
    let min = work.iter().copied().min().unwrap_or(0) as f64;
    max / min
}

/// Each rank's allowed pairs for documents of `lengths` packed back to back,
/// split over `cp` ranks both ways.
///
/// # Errors
/// [`cp_partition`]'s.
pub fn balance(lengths: &[usize], cp: usize) -> Result<Balance> {
    let docs: Vec<Vec<i64>> = lengths.iter().map(|&l| vec![0; l]).collect();
    let part = cp_partition(&docs, cp, None, None)?;
    let balanced = part
        .ranks
        .iter()
        .map(|s| {
            s.position_ids
                .iter()
                .zip(&s.real)
                .filter(|(_, &r)| r)
                .map(|(&p, _)| p as u64 + 1)
                .sum()
        })
        .collect();
    let n: usize = lengths.iter().sum();
    let per = n.div_ceil(cp);
    let mut contiguous = vec![0u64; cp];
    let mut t = 0;
    for &l in lengths {
        for p in 0..l {
            contiguous[t / per.max(1)] += p as u64 + 1;
            t += 1;
        }
    }
    Ok(Balance {
        documents: lengths.len(),
        tokens: n,
        balanced,
        contiguous,
    })
}

/// Lengths drawn from the embedded histogram `dataset` (e.g.
/// `wikipedia-512`) with `seed` until they hold at least `min_tokens`
/// tokens (empty documents skipped).
///
/// # Errors
/// [`Histogram::embedded`]'s; [`Error::InvalidArgument`] naming `dataset`
/// when it has no non-empty document.
pub fn draw_pack(dataset: &str, min_tokens: usize, seed: u64) -> Result<Vec<usize>> {
    let h = Histogram::embedded(dataset)?;
    let mut weights = h.counts().to_vec();
    if let Some(w) = weights.first_mut() {
        *w = 0;
    }
    let dist = WeightedIndex::new(&weights)
        .map_err(|e| Error::invalid("dataset", format!("{dataset}: {e}")))?;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut out = Vec::new();
    let mut total = 0;
    while total < min_tokens {
        let l = dist.sample(&mut rng);
        out.push(l);
        total += l;
    }
    Ok(out)
}
