//! Rounding an LP solution to a plan: whole packs from `x`, their slots
//! filled with actual sequences, and the columns carried to the residual
//! histogram of the next round.

use std::collections::HashSet;

use super::{Column, Rows, ROUND_TOL};
use crate::packing::Strategy;

/// Rounds `x` down and fills the packs' slots with the sequences of `need`
/// (indexed like `rows`), longest first into the smallest slot that holds
/// them. Returns the strategies (actual lengths) and takes the placed
/// sequences out of `need`.
pub(super) fn fill_slots(
    rows: &Rows,
    columns: &[Column],
    x: &[f64],
    need: &mut [u64],
) -> Vec<Strategy> {
    struct Slot {
        column: usize,
        row: usize,
        count: u64,
        used: u64,
        /// (row of the sequences placed, how many), in placement order.
        filled: Vec<(usize, u64)>,
    }
    let mut copies: Vec<u64> = Vec::with_capacity(columns.len());
    let mut slots: Vec<Slot> = Vec::new();
    for (j, (column, &xj)) in columns.iter().zip(x).enumerate() {
        let n = (xj + ROUND_TOL).floor().max(0.0) as u64;
        copies.push(n);
        if n == 0 {
            continue;
        }
        for &(r, t) in column {
            for _ in 0..t {
                slots.push(Slot {
                    column: j,
                    row: r,
                    count: n,
                    used: 0,
                    filled: Vec::new(),
                });
            }
        }
    }
    // Slots by length, ascending; within a length in column order.
    let mut order: Vec<usize> = (0..slots.len()).collect();
    order.sort_by_key(|&s| (slots[s].row, s));
    for r in (0..rows.lengths.len()).rev() {
        let start = order.partition_point(|&s| slots[s].row < r);
        for &s in &order[start..] {
            if need[r] == 0 {
                break;
            }
            let slot = &mut slots[s];
            let take = (slot.count - slot.used).min(need[r]);
            if take > 0 {
                slot.used += take;
                slot.filled.push((r, take));
                need[r] -= take;
            }
        }
    }
    // Each column's copies, cut where any of its slots changes content.
    let mut by_column: Vec<Vec<usize>> = vec![Vec::new(); columns.len()];
    for (s, slot) in slots.iter().enumerate() {
        by_column[slot.column].push(s);
    }
    let mut out = Vec::new();
    for (j, own) in by_column.iter().enumerate() {
        if own.is_empty() {
            continue;
        }
        let n = copies[j];
        // Per slot: the next segment and where the current one ends.
        let mut seg = vec![0usize; own.len()];
        let mut end: Vec<u64> = own
            .iter()
            .map(|&s| slots[s].filled.first().map_or(n, |f| f.1))
            .collect();
        let mut at = 0u64;
        while at < n {
            let next = end.iter().copied().min().unwrap_or(n).min(n);
            let lengths: Vec<usize> = own
                .iter()
                .zip(&seg)
                .filter_map(|(&s, &k)| slots[s].filled.get(k).map(|f| rows.lengths[f.0]))
                .collect();
            if !lengths.is_empty() && next > at {
                out.push(Strategy {
                    lengths,
                    count: next - at,
                });
            }
            at = next;
            for (p, &s) in own.iter().enumerate() {
                if end[p] == at {
                    seg[p] += 1;
                    end[p] = slots[s].filled.get(seg[p]).map_or(n, |f| at + f.1);
                }
            }
        }
    }
    out
}

/// Columns of one histogram's rows carried to a residual histogram's rows:
/// each slot moves to the longest residual length it holds (dropped if none);
/// multiplicities are capped at the residual counts.
pub(super) fn carry(columns: &[Column], from: &Rows, to: &Rows) -> Vec<Column> {
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for column in columns {
        let mut moved: Vec<(usize, u32)> = Vec::new();
        for &(r, t) in column {
            let l = from.lengths[r];
            let k = to.lengths.partition_point(|&x| x <= l);
            if k == 0 {
                continue;
            }
            match moved.iter_mut().find(|e| e.0 == k - 1) {
                Some(e) => e.1 += t,
                None => moved.push((k - 1, t)),
            }
        }
        for e in moved.iter_mut() {
            e.1 = e.1.min(to.counts[e.0].min(u32::MAX as u64) as u32);
        }
        moved.retain(|e| e.1 > 0);
        moved.sort_unstable();
        // Single-sequence packs are always in the primal; no need to carry them.
        let single = moved.len() == 1 && moved[0].1 == 1;
        if !moved.is_empty() && !single && seen.insert(moved.clone()) {
            out.push(moved);
        }
    }
    out
}
