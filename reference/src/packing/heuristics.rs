//! Shortest- and longest-pack-first histogram packing (Krell et al., §3.2,
//! Algorithms 1 and 2 of the appendix), and the first/best-fit decreasing
//! baselines, all working on histogram counts rather than on single sequences.
//!
//! The pack-first heuristics follow the published reference code step for step
//! (same traversal of lengths, same choice of pack, same split of repeat
//! counts), so their results equal the paper's; the fit baselines are exact
//! FFD/BFD over the sorted sequence list, computed on runs of identical bins.

use std::collections::BTreeMap;

use super::Strategy;

/// Open packs keyed by the number of free tokens they have left: an ordered
/// map holding only the keys with open packs, so finding the pack with the
/// most (or least) room that fits is O(log keys), whatever `max_seq_len` is.
/// Each key holds a stack of `(repeat count, lengths)`, as the reference
/// code's lists do.
struct OpenPacks {
    by_space: BTreeMap<usize, Vec<(u64, Vec<usize>)>>,
    done: Vec<Strategy>,
    limit: usize,
}

impl OpenPacks {
    fn new(limit: usize) -> Self {
        OpenPacks {
            by_space: BTreeMap::new(),
            done: Vec::new(),
            limit,
        }
    }

    /// Files `count` copies of `pack` with `space` tokens left: packs that are
    /// full or at the sequence limit are final, the rest stay open.
    fn add(&mut self, lengths: Vec<usize>, count: u64, space: usize) {
        if count == 0 {
            return;
        }
        if lengths.len() >= self.limit || space == 0 {
            self.done.push(Strategy { lengths, count });
        } else {
            self.push(space, (count, lengths));
        }
    }

    fn push(&mut self, space: usize, entry: (u64, Vec<usize>)) {
        self.by_space.entry(space).or_default().push(entry);
    }

    /// The largest key with open packs in `lo..=hi`.
    fn largest_in(&self, lo: usize, hi: usize) -> Option<usize> {
        self.by_space.range(lo..=hi).next_back().map(|(&k, _)| k)
    }

    /// The smallest key with open packs in `lo..=hi`.
    fn smallest_in(&self, lo: usize, hi: usize) -> Option<usize> {
        self.by_space.range(lo..=hi).next().map(|(&k, _)| k)
    }

    /// Takes the last-filed group of packs with `space` tokens left (the key
    /// must have one).
    fn pop(&mut self, space: usize) -> (u64, Vec<usize>) {
        let stack = self.by_space.get_mut(&space).expect("key has open packs");
        let entry = stack.pop().expect("keys are never empty");
        if stack.is_empty() {
            self.by_space.remove(&space);
        }
        entry
    }

    fn finish(mut self) -> Vec<Strategy> {
        for (_, group) in std::mem::take(&mut self.by_space) {
            for (count, lengths) in group {
                self.done.push(Strategy { lengths, count });
            }
        }
        self.done
    }
}

/// Shortest-pack-first histogram packing (SPFHP).
///
/// Lengths are visited longest first; the sequences of one length go into the
/// open packs with the *most* free space that can hold them (the shortest
/// packs), splitting a group of identical packs when the counts differ; what
/// fits nowhere opens new packs. `counts[l]` for `l` in `1..=max_seq_len`.
///
/// The reference code scans the free-space keys one by one, downwards from
/// `max_seq_len + 1`, never going back up within one length; here the ordered
/// map jumps to the next key with packs: the same choices in
/// O((R + S) log S) for R distinct lengths and S open keys, not O(R x max_seq_len).
pub(crate) fn spfhp(counts: &[u64], max_seq_len: usize, limit: usize) -> Vec<Strategy> {
    let mut open = OpenPacks::new(limit);
    for length in (1..=max_seq_len).rev() {
        let mut n = counts[length];
        // The scan's position: keys above it were found empty for this length.
        let mut bound = max_seq_len + 1;
        while n > 0 {
            match open.largest_in(length, bound) {
                Some(key) => {
                    bound = key;
                    let (mut m, pack) = open.pop(key);
                    let mut grown = pack.clone();
                    grown.push(length);
                    let count = m.min(n);
                    if m > n {
                        m -= n;
                        open.push(key, (m, pack));
                        n = 0;
                    } else {
                        n -= m;
                    }
                    open.add(grown, count, key - length);
                }
                None => {
                    // Fits nowhere: new packs.
                    open.add(vec![length], n, max_seq_len - length);
                    n = 0;
                }
            }
        }
    }
    open.finish()
}

/// Longest-pack-first histogram packing (LPFHP).
///
/// Lengths are visited longest first; the sequences of one length go into the
/// open packs with the *least* free space that can hold them (best fit), as
/// many copies per pack as fit ("distribute"), and what fits nowhere opens new
/// packs holding as many copies as fit. `counts[l]` for `l` in `1..=max_seq_len`.
/// As in [`spfhp`], the ordered map finds the reference code's key directly.
pub(crate) fn lpfhp(counts: &[u64], max_seq_len: usize, limit: usize) -> Vec<Strategy> {
    let mut open = OpenPacks::new(limit);
    for length in (1..=max_seq_len).rev() {
        let mut n = counts[length];
        while n > 0 {
            if let Some(key) = open.smallest_in(length, max_seq_len) {
                let offset = key - length;
                let (mut m, pack) = open.pop(key);
                let mut repeat = (1 + offset / length).min(limit - pack.len()) as u64;
                while n / repeat == 0 {
                    repeat -= 1;
                }
                let mut grown = pack.clone();
                grown.extend(std::iter::repeat_n(length, repeat as usize));
                let count = m.min(n / repeat);
                if m > count {
                    m -= count;
                    open.push(key, (m, pack));
                    n -= count * repeat;
                } else {
                    n -= m * repeat;
                }
                open.add(grown, count, offset - (repeat as usize - 1) * length);
            } else {
                let mut repeat = (max_seq_len / length).min(limit) as u64;
                while n / repeat == 0 {
                    repeat -= 1;
                }
                let packs = n / repeat;
                open.add(
                    vec![length; repeat as usize],
                    packs,
                    max_seq_len - length * repeat as usize,
                );
                n -= packs * repeat;
            }
        }
    }
    open.finish()
}

/// A run of identical bins in opening order: `bins` bins that each hold `lengths`.
struct Run {
    space: usize,
    lengths: Vec<usize>,
    bins: u64,
}

/// Which bin the fit baselines choose for the next sequence.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fit {
    /// The first open bin (in opening order) that has room.
    First,
    /// The open bin with the least room that is still enough; ties go to the first opened.
    Best,
}

/// First-fit decreasing or best-fit decreasing over the sorted sequence list.
///
/// Bins with identical contents are kept as runs, so the cost is
/// O(distinct lengths x runs) rather than O(sequences x bins), and the result
/// is exactly that of the per-sequence algorithm with sequences of equal
/// length in any order.
pub(crate) fn fit_decreasing(
    counts: &[u64],
    max_seq_len: usize,
    limit: usize,
    fit: Fit,
) -> Vec<Strategy> {
    let mut runs: Vec<Run> = Vec::new();
    for length in (1..=max_seq_len).rev() {
        let mut n = counts[length];
        while n > 0 {
            let fits = |r: &Run| r.space >= length && r.lengths.len() < limit;
            let chosen = match fit {
                Fit::First => runs.iter().position(fits),
                Fit::Best => runs
                    .iter()
                    .enumerate()
                    .filter(|(_, r)| fits(r))
                    .min_by_key(|(i, r)| (r.space, *i))
                    .map(|(i, _)| i),
            };
            match chosen {
                Some(i) => {
                    // Every bin of the run takes as many copies as fit, in order.
                    let per_bin =
                        (runs[i].space / length).min(limit - runs[i].lengths.len()) as u64;
                    let full = runs[i].bins.min(n / per_bin);
                    let mut inserted = Vec::new();
                    if full > 0 {
                        inserted.push(grown(&runs[i], length, per_bin, full));
                        n -= full * per_bin;
                    }
                    let left = runs[i].bins - full;
                    if n > 0 && n < per_bin && left > 0 {
                        inserted.push(grown(&runs[i], length, n, 1));
                        n = 0;
                        runs[i].bins = left - 1;
                    } else {
                        runs[i].bins = left;
                    }
                    // The filled bins come first in opening order, then the untouched rest.
                    if runs[i].bins == 0 {
                        runs.remove(i);
                    }
                    for (k, run) in inserted.into_iter().enumerate() {
                        runs.insert(i + k, run);
                    }
                }
                None => {
                    let per_bin = (max_seq_len / length).min(limit) as u64;
                    let full = n / per_bin;
                    if full > 0 {
                        runs.push(Run {
                            space: max_seq_len - per_bin as usize * length,
                            lengths: vec![length; per_bin as usize],
                            bins: full,
                        });
                    }
                    let rest = n - full * per_bin;
                    if rest > 0 {
                        runs.push(Run {
                            space: max_seq_len - rest as usize * length,
                            lengths: vec![length; rest as usize],
                            bins: 1,
                        });
                    }
                    n = 0;
                }
            }
        }
    }
    runs.into_iter()
        .map(|r| Strategy {
            lengths: r.lengths,
            count: r.bins,
        })
        .collect()
}

fn grown(run: &Run, length: usize, copies: u64, bins: u64) -> Run {
    let mut lengths = run.lengths.clone();
    lengths.extend(std::iter::repeat_n(length, copies as usize));
    Run {
        space: run.space - copies as usize * length,
        lengths,
        bins,
    }
}
