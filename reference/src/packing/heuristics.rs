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

/// A pack as a chain: `copies` sequences of `length` added to the pack
/// `parent` (an index into [`OpenPacks::nodes`], or [`ROOT`] for none). Growing
/// a group of packs is one new node, never a copy of its lengths.
#[derive(Clone, Copy)]
struct Node {
    length: usize,
    copies: usize,
    parent: usize,
}

/// The parent of a pack's first node.
const ROOT: usize = usize::MAX;

/// A group of identical open packs: `(repeat count, last node, sequences)`.
type Group = (u64, usize, usize);

/// Up to this `max_seq_len` the free-space keys are a dense array with a
/// bitset of the non-empty ones (a few words to scan); above it, an
/// ordered map holding only the keys in use.
const DENSE_KEYS: usize = 1 << 16;

/// Where the open packs are filed, by free tokens left.
enum Keys {
    Dense {
        stacks: Vec<Vec<Group>>,
        bits: Vec<u64>,
    },
    Sparse(BTreeMap<usize, Vec<Group>>),
}

/// Open packs keyed by the number of free tokens they have left, finding the
/// pack with the most (or least) room that fits without visiting empty keys.
/// Each key holds a stack of groups, as the reference code's lists do.
struct OpenPacks {
    keys: Keys,
    nodes: Vec<Node>,
    done: Vec<(u64, usize)>,
    limit: usize,
}

impl OpenPacks {
    fn new(max_seq_len: usize, limit: usize) -> Self {
        Self::with_keys(max_seq_len, limit, max_seq_len <= DENSE_KEYS)
    }

    fn with_keys(max_seq_len: usize, limit: usize, dense: bool) -> Self {
        let keys = if dense {
            Keys::Dense {
                stacks: vec![Vec::new(); max_seq_len + 1],
                bits: vec![0; (max_seq_len + 1).div_ceil(64)],
            }
        } else {
            Keys::Sparse(BTreeMap::new())
        };
        OpenPacks {
            keys,
            nodes: Vec::new(),
            done: Vec::new(),
            limit,
        }
    }

    /// A new node: `copies` x `length` added to the pack ending at `parent`.
    fn grow(&mut self, parent: usize, length: usize, copies: usize) -> usize {
        self.nodes.push(Node {
            length,
            copies,
            parent,
        });
        self.nodes.len() - 1
    }

    /// Files `count` copies of the pack ending at `node` (`seqs` sequences,
    /// `space` tokens left): packs that are full or at the sequence limit
    /// are final, the rest stay open.
    fn add(&mut self, node: usize, seqs: usize, count: u64, space: usize) {
        if count == 0 {
            return;
        }
        if seqs >= self.limit || space == 0 {
            self.done.push((count, node));
        } else {
            self.push(space, (count, node, seqs));
        }
    }

    fn push(&mut self, space: usize, group: Group) {
        match &mut self.keys {
            Keys::Dense { stacks, bits } => {
                stacks[space].push(group);
                bits[space / 64] |= 1 << (space % 64);
            }
            Keys::Sparse(map) => map.entry(space).or_default().push(group),
        }
    }

    /// The largest key with open packs in `lo..=hi`.
    fn largest_in(&self, lo: usize, hi: usize) -> Option<usize> {
        match &self.keys {
            Keys::Dense { bits, .. } => {
                let hi = clamp_hi(bits, lo, hi)?;
                let mut w = hi / 64;
                // Bits at or below `hi` in its word.
                let mut word = bits[w] & (u64::MAX >> (63 - hi % 64));
                loop {
                    if word != 0 {
                        let key = w * 64 + 63 - word.leading_zeros() as usize;
                        return (key >= lo).then_some(key);
                    }
                    if w == 0 || w * 64 <= lo {
                        return None;
                    }
                    w -= 1;
                    word = bits[w];
                }
            }
            Keys::Sparse(map) => map.range(lo..=hi).next_back().map(|(&k, _)| k),
        }
    }

    /// The smallest key with open packs in `lo..=hi`.
    fn smallest_in(&self, lo: usize, hi: usize) -> Option<usize> {
        match &self.keys {
            Keys::Dense { bits, .. } => {
                let hi = clamp_hi(bits, lo, hi)?;
                let mut w = lo / 64;
                // Bits at or above `lo` in its word.
                let mut word = bits[w] & (u64::MAX << (lo % 64));
                loop {
                    if word != 0 {
                        let key = w * 64 + word.trailing_zeros() as usize;
                        return (key <= hi).then_some(key);
                    }
                    w += 1;
                    if w >= bits.len() || w * 64 > hi {
                        return None;
                    }
                    word = bits[w];
                }
            }
            Keys::Sparse(map) => map.range(lo..=hi).next().map(|(&k, _)| k),
        }
    }

    /// Takes the last-filed group of packs with `space` tokens left (the key
    /// must have one).
    fn pop(&mut self, space: usize) -> Group {
        match &mut self.keys {
            Keys::Dense { stacks, bits } => {
                let group = stacks[space].pop().expect("key has open packs");
                if stacks[space].is_empty() {
                    bits[space / 64] &= !(1 << (space % 64));
                }
                group
            }
            Keys::Sparse(map) => {
                let stack = map.get_mut(&space).expect("key has open packs");
                let group = stack.pop().expect("keys are never empty");
                if stack.is_empty() {
                    map.remove(&space);
                }
                group
            }
        }
    }

    /// The lengths of the pack ending at `node`, in the order they were added.
    fn lengths(&self, mut node: usize) -> Vec<usize> {
        let mut out = Vec::new();
        while node != ROOT {
            let n = self.nodes[node];
            out.extend(std::iter::repeat_n(n.length, n.copies));
            node = n.parent;
        }
        out.reverse();
        out
    }

    /// The final packs, then the open ones by increasing free space.
    fn finish(mut self) -> Vec<Strategy> {
        let open: Vec<(u64, usize)> =
            match std::mem::replace(&mut self.keys, Keys::Sparse(BTreeMap::new())) {
                Keys::Dense { stacks, .. } => stacks
                    .into_iter()
                    .flatten()
                    .map(|(count, node, _)| (count, node))
                    .collect(),
                Keys::Sparse(map) => map
                    .into_values()
                    .flatten()
                    .map(|(count, node, _)| (count, node))
                    .collect(),
            };
        let all: Vec<(u64, usize)> = std::mem::take(&mut self.done)
            .into_iter()
            .chain(open)
            .collect();
        all.into_iter()
            .map(|(count, node)| Strategy {
                lengths: self.lengths(node),
                count,
            })
            .collect()
    }
}

/// `hi` clamped to the last key the dense `bits` can hold, or `None` when
/// `lo..=hi` is then empty.
fn clamp_hi(bits: &[u64], lo: usize, hi: usize) -> Option<usize> {
    let hi = hi.min(bits.len() * 64 - 1);
    (lo <= hi).then_some(hi)
}

/// Shortest-pack-first histogram packing (SPFHP).
///
/// Lengths are visited longest first; the sequences of one length go into the
/// open packs with the *most* free space that can hold them (the shortest
/// packs), splitting a group of identical packs when the counts differ; what
/// fits nowhere opens new packs. `counts[l]` for `l` in `1..=max_seq_len`.
///
/// The reference code scans the free-space keys one by one, downwards from
/// `max_seq_len + 1`, never going back up within one length; here the key
/// index jumps to the next key with packs (a bitset scan, or an ordered map
/// for huge `max_seq_len`): the same choices without visiting empty keys,
/// and a grown pack is one new node, not a copy of its lengths.
pub(crate) fn spfhp(counts: &[u64], max_seq_len: usize, limit: usize) -> Vec<Strategy> {
    spfhp_in(OpenPacks::new(max_seq_len, limit), counts, max_seq_len)
}

fn spfhp_in(mut open: OpenPacks, counts: &[u64], max_seq_len: usize) -> Vec<Strategy> {
    for length in (1..=max_seq_len).rev() {
        let mut n = counts[length];
        // The scan's position: keys above it were found empty for this length.
        let mut bound = max_seq_len + 1;
        while n > 0 {
            match open.largest_in(length, bound) {
                Some(key) => {
                    bound = key;
                    let (mut m, pack, seqs) = open.pop(key);
                    let grown = open.grow(pack, length, 1);
                    let count = m.min(n);
                    if m > n {
                        m -= n;
                        open.push(key, (m, pack, seqs));
                        n = 0;
                    } else {
                        n -= m;
                    }
                    open.add(grown, seqs + 1, count, key - length);
                }
                None => {
                    // Fits nowhere: new packs.
                    let node = open.grow(ROOT, length, 1);
                    open.add(node, 1, n, max_seq_len - length);
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
/// As in [`spfhp`], the key index finds the reference code's key directly.
pub(crate) fn lpfhp(counts: &[u64], max_seq_len: usize, limit: usize) -> Vec<Strategy> {
    lpfhp_in(
        OpenPacks::new(max_seq_len, limit),
        counts,
        max_seq_len,
        limit,
    )
}

fn lpfhp_in(
    mut open: OpenPacks,
    counts: &[u64],
    max_seq_len: usize,
    limit: usize,
) -> Vec<Strategy> {
    for length in (1..=max_seq_len).rev() {
        let mut n = counts[length];
        while n > 0 {
            if let Some(key) = open.smallest_in(length, max_seq_len) {
                let offset = key - length;
                let (mut m, pack, seqs) = open.pop(key);
                let mut repeat = (1 + offset / length).min(limit - seqs) as u64;
                while n / repeat == 0 {
                    repeat -= 1;
                }
                let grown = open.grow(pack, length, repeat as usize);
                let count = m.min(n / repeat);
                if m > count {
                    m -= count;
                    open.push(key, (m, pack, seqs));
                    n -= count * repeat;
                } else {
                    n -= m * repeat;
                }
                open.add(
                    grown,
                    seqs + repeat as usize,
                    count,
                    offset - (repeat as usize - 1) * length,
                );
            } else {
                let mut repeat = (max_seq_len / length).min(limit) as u64;
                while n / repeat == 0 {
                    repeat -= 1;
                }
                let packs = n / repeat;
                let node = open.grow(ROOT, length, repeat as usize);
                open.add(
                    node,
                    repeat as usize,
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

#[cfg(test)]
mod key_index_tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// `smallest_in` and `largest_in` of both key indexes against a scan of
    /// the keys filed, for every range `lo..=hi` around the edges of 64-bit
    /// words (a key at `hi` itself, at `lo` itself, at bit 63 and 64, and
    /// ranges past the last key the bitset holds).
    #[test]
    fn key_queries_find_the_edge_keys_of_every_range() {
        for msl in [63usize, 64, 65, 127, 128, 129] {
            let keys: Vec<usize> = [1, 2, 62, 63, 64, 65, 100, 126, 127, 128, 129]
                .into_iter()
                .filter(|&k| k <= msl)
                .step_by(2)
                .chain([msl])
                .collect();
            for dense in [true, false] {
                let mut packs = OpenPacks::with_keys(msl, 4, dense);
                for &k in &keys {
                    packs.push(k, (1, 0, 1));
                }
                for lo in 0..=msl + 2 {
                    for hi in lo..=msl + 70 {
                        let inside = keys.iter().copied().filter(|k| (lo..=hi).contains(k));
                        let (want_lo, want_hi) = (inside.clone().min(), inside.max());
                        assert_eq!(
                            packs.smallest_in(lo, hi),
                            want_lo,
                            "smallest_in({lo}, {hi}), msl {msl}, dense {dense}, keys {keys:?}"
                        );
                        assert_eq!(
                            packs.largest_in(lo, hi),
                            want_hi,
                            "largest_in({lo}, {hi}), msl {msl}, dense {dense}, keys {keys:?}"
                        );
                    }
                }
            }
        }
    }

    /// The dense key index (bitset) and the ordered map give the same packs,
    /// in the same order, on random histograms, including keys at the edges
    /// of 64-bit words (max_seq_len around 64 and 128).
    #[test]
    fn dense_and_sparse_keys_pack_alike() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        for trial in 0..300 {
            let msl = [7, 63, 64, 65, 127, 128, 129, 300, 512][trial % 9];
            let counts: Vec<u64> = (0..=msl)
                .map(|l| {
                    if l > 0 && rng.random_range(0..3) == 0 {
                        rng.random_range(0..40)
                    } else {
                        0
                    }
                })
                .collect();
            let limit = rng.random_range(1..=12);
            for (name, dense, sparse) in [
                (
                    "spfhp",
                    spfhp_in(OpenPacks::with_keys(msl, limit, true), &counts, msl),
                    spfhp_in(OpenPacks::with_keys(msl, limit, false), &counts, msl),
                ),
                (
                    "lpfhp",
                    lpfhp_in(OpenPacks::with_keys(msl, limit, true), &counts, msl, limit),
                    lpfhp_in(OpenPacks::with_keys(msl, limit, false), &counts, msl, limit),
                ),
            ] {
                assert_eq!(
                    dense, sparse,
                    "{name} trial {trial}: msl {msl}, limit {limit}"
                );
                // Every sequence placed once, within the limits.
                let mut placed = vec![0u64; msl + 1];
                for s in &dense {
                    assert!(
                        s.lengths.len() <= limit && s.tokens() <= msl,
                        "{name}: {s:?}"
                    );
                    for &l in &s.lengths {
                        placed[l] += s.count;
                    }
                }
                assert_eq!(placed, counts, "{name} trial {trial}");
            }
        }
    }
}
