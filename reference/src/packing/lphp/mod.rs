//! Linear-programming histogram packing (LPHP): depth-limited packing solved
//! as the covering LP it is, with the LP optimum as a lower bound on packs.
//!
//! Krell et al. (§3.3) pack the histogram by non-negative least squares over
//! the packs that fill `max_seq_len` exactly. The problem is really the
//! cutting-stock LP of Gilmore & Gomory (1961):
//!
//! ```text
//! minimise   sum_j x_j                     (packs)
//! such that  sum_j a_ij x_j >= h_i         (every length i covered h_i times)
//!            x_j >= 0
//! ```
//!
//! over every *pack* `j`: a multiset of at most `depth` lengths (no length more
//! often than it occurs) with total `<= max_seq_len`; `a_ij` is how often
//! length `i` is in pack `j`. Any plan with at most `depth` sequences per pack
//! is a feasible integer point, so the LP optimum is a **lower bound on the
//! pack count of every algorithm at that depth**.
//!
//! 1. **Column generation.** The restricted master LP holds a few packs; its
//!    duals `y` price every pack through an exact dynamic programme over
//!    (length, sequences, tokens) — a bounded-cardinality knapsack,
//!    `O(depth x max_seq_len x distinct lengths)` — and the packs with reduced
//!    cost `1 - a.y < 0` enter the master, until none is left. The master is
//!    solved as its dual (`max h.y` such that `a_j.y <= 1`, `0 <= y <= 1`),
//!    whose solution *is* the duals, with the `microlp` simplex; the
//!    dual-optimal inequalities `y_i <= y_k` for `l_i < l_k` (Ben Amor,
//!    Desrosiers & Valério de Carvalho 2006: a slot may hold a shorter
//!    sequence) are added, which cuts the rounds several-fold. The master
//!    starts from the packs of first-fit decreasing at the same depth and
//!    the best packs at token prices `l / max_seq_len`; duals are smoothed
//!    towards the best dual found so far (Wentges 1997), and each round adds,
//!    for every length, the best pack that holds it. On Wikipedia at depth 3
//!    this converges in about 5 rounds.
//! 2. **The bound.** For *any* `y >= 0`, `h.y / max_j a_j.y` is a lower bound
//!    on the LP (Farley 1990), so the bound stays valid even where the solver
//!    is inexact or the rounds run out; at convergence it is the LP optimum.
//!    [`PackBound::packs`] is its ceiling, taken after subtracting a relative
//!    round-off margin of 1e-9 so that round-off can only weaken it. With the
//!    dual-optimal inequalities the converged value is the optimum of the LP
//!    in which a slot may also hold a shorter sequence; it equals the LP above
//!    unless a length's count caps how often it can repeat in a pack, and is
//!    never above it, so it is a lower bound either way.
//! 3. **The integer plan.** The LP's primal solution (over the binding packs,
//!    single-sequence packs and the slot transfers) is rounded down; each
//!    pack's slots are filled with real sequences, longest first into the
//!    smallest slot that holds them (with slots nested by length this is a
//!    maximum matching); the LP is re-solved on what is left while that still
//!    places packs (at most [`MAX_PLAN_ROUNDS`] times; not at all above depth
//!    4, [`MAX_DEEP_PLAN_ROUNDS`]); the last few sequences get the best of FFD, BFD and LPFHP
//!    at the same depth. Every sequence ends in exactly one pack.
//!
//! Work is bounded before anything is allocated: the pricing table holds at
//! most [`MAX_PRICING_CELLS`] entries and one pricing pass at most
//! [`MAX_PRICING_WORK`] steps (an [`Error::InvalidArgument`] beyond them), the
//! rounds are capped by [`MAX_ROUNDS`], [`MAX_TOTAL_PRICING_WORK`],
//! [`MAX_TOTAL_LP_SIZE`] and [`MAX_PLAN_ROUNDS`] (column generation then
//! stops with a valid, possibly weaker bound).
//!
//! **Deeper LPs are warm-started** ([`warm_lp`]): above depth 4 the LP at
//! depth 4 is solved first and its packs and duals start the deeper one. On
//! Wikipedia at depth 12 that is 1 deep round instead of 22 (the bound in
//! ~0.3 s instead of ~1.1 s).

use std::collections::HashSet;

use serde::{Deserialize, Serialize};

use super::heuristics::{self, Fit};
use super::Strategy;
use crate::error::{Error, Result};

/// The most entries of the pricing table: (lengths with a positive dual) x
/// (depth + 1) x (max_seq_len + 1). 2^24 `u16` choices are 32 MiB.
pub const MAX_PRICING_CELLS: u64 = 1 << 24;
/// The most inner steps of one pricing pass (about 0.1-0.3 s).
pub const MAX_PRICING_WORK: u64 = 1 << 28;
/// Column-generation rounds of one LP before it stops unconverged (its bound
/// is still valid, see [`PackBound::converged`]).
pub const MAX_ROUNDS: usize = 100;
/// Pricing steps of one LP, all rounds together, before it stops unconverged
/// (Wikipedia at depth 3 takes ~3e7).
pub const MAX_TOTAL_PRICING_WORK: u64 = 1 << 31;
/// Re-solves of the LP on the residual histogram before the greedy repair.
pub const MAX_PLAN_ROUNDS: usize = 8;

/// Re-solves at depths above the warm-start depth (4): none. Each costs a
/// shallow and a deep LP on the residual (~0.3 s a round on Wikipedia at
/// depth 12) and they buy little there: on Wikipedia at 12 the plan is 2
/// packs over the bound with or without them (0.7 s instead of 3.7 s), on
/// SQuAD at 12 one pack over instead of none.
pub const MAX_DEEP_PLAN_ROUNDS: usize = 0;
/// Simplex size of one LP, all rounds together: the sum over master solves of
/// (columns + rows) x rows (Wikipedia at depth 3 takes a few million, at
/// depth 12 some tens of millions).
pub const MAX_TOTAL_LP_SIZE: u64 = 1 << 27;

/// A pack enters the master when its dual value exceeds 1 by more than this:
/// `microlp` holds each constraint to 1e-7 (its default feasibility tolerance),
/// so a smaller threshold would re-price packs already in the master.
const PRICING_TOL: f64 = 1e-7;
/// Relative gap between master and bound at which column generation stops.
const GAP_TOL: f64 = 1e-9;
/// Weight of the stability centre in the smoothed duals (Wentges 1997).
const SMOOTHING: f64 = 0.5;
/// A column stays in the master this many rounds after it was last binding.
const KEEP_ROUNDS: usize = 0;
/// An LP value this close above an integer counts as that integer when rounding down.
const ROUND_TOL: f64 = 1e-6;

mod bound;
mod lp;
pub use bound::{bound, bound_is_cheap, lp_bound, token_bound, PackBound, CHEAP_BOUND_STEPS};
use lp::{dot, solve_master, solve_primal};

/// A column: (row, multiplicity) pairs, rows ascending.
type Column = Vec<(usize, u32)>;

/// Distinct lengths (rows, ascending) of a histogram and their counts.
struct Rows {
    lengths: Vec<usize>,
    counts: Vec<u64>,
}

impl Rows {
    fn new(counts: &[u64], max_seq_len: usize) -> Self {
        let lengths: Vec<usize> = (1..=max_seq_len.min(counts.len().saturating_sub(1)))
            .filter(|&l| counts[l] > 0)
            .collect();
        let counts = lengths.iter().map(|&l| counts[l]).collect();
        Rows { lengths, counts }
    }

    fn sequences(&self) -> u64 {
        self.counts.iter().sum()
    }

    fn tokens(&self) -> u64 {
        self.lengths
            .iter()
            .zip(&self.counts)
            .map(|(&l, &c)| l as u64 * c)
            .sum()
    }
}

/// The pricing problem: the best pack for duals `y`.
struct Pricer<'a> {
    lengths: &'a [usize],
    max_seq_len: usize,
    depth: usize,
}

/// The pricing table: `value[k][c]` is the best dual value of a pack of
/// exactly `k` sequences (or any number when the depth cannot bind) and
/// exactly `c` tokens; `choice[n][k][c]` how many copies of item `n` it took.
/// The items are the rows of positive dual and positive cap: a row of dual 0
/// adds nothing to a pack (of two packs of one value, the one without it is
/// offered) and a row of cap 0 cannot be in one.
struct Table {
    items: Vec<usize>,
    kdim: usize,
    width: usize,
    counted: bool,
    value: Vec<f64>,
    choice: Vec<u16>,
}

/// What one pricing pass found.
struct Priced {
    /// The largest dual value of any pack (0 when all duals are 0).
    best: f64,
    /// Candidate packs: the best pack overall and, for each length, the best
    /// pack that holds it.
    candidates: Vec<Column>,
}

impl Pricer<'_> {
    /// The size of the table for `caps` (all rows), checked against the caps;
    /// returns the steps of one pricing pass (an upper bound).
    fn check(&self, caps: &[u64]) -> Result<u64> {
        let min_len = self.lengths.first().copied().unwrap_or(1);
        let counted = self.depth < self.max_seq_len / min_len;
        let kdim = if counted { self.depth as u64 + 1 } else { 1 };
        let width = self.max_seq_len as u64 + 1;
        let cells = (self.lengths.len() as u64)
            .saturating_mul(kdim)
            .saturating_mul(width);
        let steps: u64 = self
            .lengths
            .iter()
            .zip(caps)
            .map(|(&l, &cap)| self.tmax(l, cap) as u64 + 1)
            .fold(0u64, |a, b| a.saturating_add(b))
            .saturating_mul(kdim)
            .saturating_mul(width);
        if cells > MAX_PRICING_CELLS || steps > MAX_PRICING_WORK {
            let field = if counted {
                "max_sequences_per_pack"
            } else {
                "max_seq_len"
            };
            return Err(Error::invalid(
                field,
                format!(
                    "lphp: pricing {} distinct lengths at depth {} and max_seq_len {} needs {cells} table cells and {steps} steps per round, over the supported {MAX_PRICING_CELLS} and {MAX_PRICING_WORK}; use a smaller depth or max_seq_len, or lpfhp",
                    self.lengths.len(),
                    self.depth,
                    self.max_seq_len
                ),
            ));
        }
        Ok(steps.max(1))
    }

    /// Most copies of a length-`l` sequence in one pack.
    fn tmax(&self, l: usize, cap: u64) -> usize {
        (cap.min(u16::MAX as u64) as usize)
            .min(self.max_seq_len / l)
            .min(self.depth)
    }

    fn table(&self, y: &[f64], caps: &[u64]) -> Table {
        let width = self.max_seq_len + 1;
        let items: Vec<usize> = (0..self.lengths.len())
            .filter(|&i| y[i] > 0.0 && caps[i] > 0)
            .collect();
        let min_len = items.first().map_or(self.max_seq_len, |&i| self.lengths[i]);
        let counted = self.depth < self.max_seq_len / min_len;
        let kdim = if counted { self.depth + 1 } else { 1 };
        let mut value = vec![f64::NEG_INFINITY; kdim * width];
        value[0] = 0.0;
        let mut choice = vec![0u16; items.len() * kdim * width];
        for (n, &i) in items.iter().enumerate() {
            let l = self.lengths[i];
            let tmax = self.tmax(l, caps[i]);
            let chosen = &mut choice[n * kdim * width..(n + 1) * kdim * width];
            let unbounded = (self.max_seq_len / l).min(self.depth);
            if tmax == unbounded {
                // The count does not bind (the depth and max_seq_len do): the
                // unbounded recurrence, one step a state. Ascending k and c:
                // the state read, one copy fewer, already holds item n, and
                // `chosen` counts its copies.
                for k in 0..kdim {
                    let from_k = if counted { k.wrapping_sub(1) } else { 0 };
                    if counted && k == 0 {
                        continue;
                    }
                    for c in l..width {
                        let from = from_k * width + c - l;
                        let v = value[from] + y[i];
                        if v > value[k * width + c] {
                            value[k * width + c] = v;
                            chosen[k * width + c] = chosen[from] + 1;
                        }
                    }
                }
                continue;
            }
            // Descending k and c: the states read (fewer items, fewer tokens)
            // still hold the values before item n, so each copy count is one choice.
            for k in (0..kdim).rev() {
                let tk = if counted { tmax.min(k) } else { tmax };
                for c in (l..width).rev() {
                    let mut best = value[k * width + c];
                    let mut best_t = 0;
                    for t in 1..=tk.min(c / l) {
                        let from = if counted { k - t } else { 0 };
                        let v = value[from * width + c - t * l] + t as f64 * y[i];
                        if v > best {
                            best = v;
                            best_t = t;
                        }
                    }
                    value[k * width + c] = best;
                    chosen[k * width + c] = best_t as u16;
                }
            }
        }
        Table {
            items,
            kdim,
            width,
            counted,
            value,
            choice,
        }
    }

    /// The pack that reaches state `(k, c)`.
    fn backtrack(&self, t: &Table, mut k: usize, mut c: usize) -> Column {
        let mut column = Column::new();
        for n in (0..t.items.len()).rev() {
            let copies = t.choice[(n * t.kdim + k) * t.width + c] as usize;
            if copies > 0 {
                column.push((t.items[n], copies as u32));
                if t.counted {
                    k -= copies;
                }
                c -= copies * self.lengths[t.items[n]];
            }
        }
        debug_assert_eq!(c, 0, "backtracking ends at the empty pack");
        column.reverse();
        column
    }

    /// Prices `y`; candidates are packs of value above `threshold`.
    fn price(&self, y: &[f64], caps: &[u64], threshold: f64) -> Priced {
        let t = self.table(y, caps);
        let (kdim, width) = (t.kdim, t.width);
        // Best state with at most k sequences and at most c tokens.
        let mut upto = vec![(f64::NEG_INFINITY, 0usize, 0usize); kdim * width];
        for k in 0..kdim {
            for c in 0..width {
                let mut b = (t.value[k * width + c], k, c);
                if c > 0 && upto[k * width + c - 1].0 > b.0 {
                    b = upto[k * width + c - 1];
                }
                if k > 0 && upto[(k - 1) * width + c].0 > b.0 {
                    b = upto[(k - 1) * width + c];
                }
                upto[k * width + c] = b;
            }
        }
        let (best, bk, bc) = upto[kdim * width - 1];
        let mut candidates = vec![self.backtrack(&t, bk, bc)];
        candidates.retain(|c| !c.is_empty());
        let mut seen: HashSet<Column> = candidates.iter().cloned().collect();
        for &i in &t.items {
            let l = self.lengths[i];
            let k = if t.counted { kdim - 2 } else { 0 };
            let (v, ck, cc) = upto[k * width + self.max_seq_len - l];
            if v + y[i] <= threshold {
                continue;
            }
            let mut column = self.backtrack(&t, ck, cc);
            match column.iter_mut().find(|e| e.0 == i) {
                Some(e) if (e.1 as u64) < caps[i] && (e.1 as usize) < self.tmax(l, caps[i]) => {
                    e.1 += 1
                }
                Some(_) => continue,
                None => {
                    column.push((i, 1));
                    column.sort_unstable();
                }
            }
            if seen.insert(column.clone()) {
                candidates.push(column);
            }
        }
        Priced {
            best: best.max(0.0),
            candidates,
        }
    }
}

/// The LP on one histogram, solved by column generation.
struct LpSolution {
    bound: PackBound,
    /// The final master's binding columns (with the single-sequence packs
    /// after them, row by row) and their pack counts; empty if the primal failed.
    columns: Vec<Column>,
    x: Vec<f64>,
    /// The final master's columns and duals: a warm start for a deeper LP.
    active: Vec<Column>,
    duals: Vec<f64>,
}

/// The depth solved first when a deeper LP is asked for ([`warm_lp`]).
const WARM_DEPTH: usize = 4;

/// Column generation at `depth`, warm-started where `depth > WARM_DEPTH`:
/// the LP at [`WARM_DEPTH`] first (its packs are packs at any deeper limit,
/// and its duals are a dual point there too, so its Farley bound holds), then
/// the deeper LP from its columns and duals. On Wikipedia the depth-12 LP has
/// the optimum of the depth-4 one, so it converges in a round or two instead
/// of ~22.
fn warm_lp(
    rows: &Rows,
    max_seq_len: usize,
    depth: usize,
    pool: &[Column],
    with_primal: bool,
) -> Result<LpSolution> {
    if depth <= WARM_DEPTH || rows.lengths.is_empty() {
        return column_generation(rows, max_seq_len, depth, pool, with_primal, None);
    }
    let shallow = column_generation(rows, max_seq_len, WARM_DEPTH, pool, false, None)?;
    let mut start: Vec<Column> = pool.to_vec();
    start.extend(shallow.active);
    column_generation(
        rows,
        max_seq_len,
        depth,
        &start,
        with_primal,
        Some(&shallow.duals),
    )
}

/// Whether column generation may start another round after `rounds` rounds,
/// `work` pricing steps and `lp_size` simplex size: each of [`MAX_ROUNDS`],
/// [`MAX_TOTAL_PRICING_WORK`] and [`MAX_TOTAL_LP_SIZE`] caps what is done, so
/// reaching one stops it.
fn within_budget(rounds: usize, work: u64, lp_size: u64) -> bool {
    rounds < MAX_ROUNDS && work < MAX_TOTAL_PRICING_WORK && lp_size < MAX_TOTAL_LP_SIZE
}

/// Column generation on `rows` (lengths ascending, counts `rows.counts`),
/// starting from the packs of `pool`.
fn column_generation(
    rows: &Rows,
    max_seq_len: usize,
    depth: usize,
    pool: &[Column],
    with_primal: bool,
    warm_duals: Option<&[f64]>,
) -> Result<LpSolution> {
    let m = rows.lengths.len();
    let h = &rows.counts;
    let pricer = Pricer {
        lengths: &rows.lengths,
        max_seq_len,
        depth,
    };
    let pass_work = pricer.check(h)?;
    let sequences = rows.sequences();
    let tokens = rows.tokens();
    let trivial = sequences
        .div_ceil(depth as u64)
        .max(tokens.div_ceil(max_seq_len as u64));
    if m == 0 {
        return Ok(LpSolution {
            bound: PackBound {
                packs: 0,
                value: 0.0,
                depth: Some(depth),
                iterations: 0,
                columns: 0,
                converged: true,
            },
            columns: Vec::new(),
            x: Vec::new(),
            active: Vec::new(),
            duals: Vec::new(),
        });
    }
    if depth == 1 {
        // One sequence per pack: the LP is integral, one pack per sequence.
        return Ok(LpSolution {
            bound: PackBound {
                packs: sequences,
                value: sequences as f64,
                depth: Some(1),
                iterations: 0,
                columns: 0,
                converged: true,
            },
            columns: (0..m).map(|i| vec![(i, 1)]).collect(),
            x: h.iter().map(|&c| c as f64).collect(),
            active: Vec::new(),
            duals: vec![1.0; m],
        });
    }
    let scale = h.iter().copied().max().unwrap_or(1) as f64;
    let hs: Vec<f64> = h.iter().map(|&c| c as f64 / scale).collect();
    let farley = |y: &[f64], best: f64| -> f64 {
        if best <= 0.0 {
            return 0.0;
        }
        y.iter().zip(h).map(|(a, &b)| a * b as f64).sum::<f64>() / best
    };

    // Stability centre: token prices l / max_seq_len, scaled to be dual feasible.
    let mut centre: Vec<f64> = rows
        .lengths
        .iter()
        .map(|&l| l as f64 / max_seq_len as f64)
        .collect();
    let priced = pricer.price(&centre, h, f64::NEG_INFINITY);
    let mut lower = farley(&centre, priced.best);
    if priced.best > 0.0 {
        centre.iter_mut().for_each(|v| *v /= priced.best);
    }
    // A warm start's duals (a shallower LP's) are a dual point here too: keep
    // them as the centre where their bound is better.
    let mut warm_candidates = Vec::new();
    if let Some(w) = warm_duals.filter(|w| w.len() == m) {
        let priced = pricer.price(w, h, f64::NEG_INFINITY);
        let f = farley(w, priced.best);
        if f > lower && priced.best > 0.0 {
            lower = f;
            centre = w.iter().map(|v| v / priced.best).collect();
        }
        warm_candidates = priced.candidates;
    }
    // Active columns and the round they were last binding in.
    let mut active: Vec<(Column, usize)> = Vec::new();
    let mut in_active: HashSet<Column> = HashSet::new();
    // A first feasible plan's packs: first-fit decreasing at this depth.
    let mut full = vec![0u64; max_seq_len + 1];
    for (&l, &c) in rows.lengths.iter().zip(h) {
        full[l] = c;
    }
    let ffd: Vec<Column> = heuristics::fit_decreasing(&full, max_seq_len, depth, Fit::First)
        .into_iter()
        .map(|s| {
            let mut column: Column = Vec::new();
            for l in s.lengths {
                let r = rows.lengths.partition_point(|&x| x < l);
                match column.iter_mut().find(|e| e.0 == r) {
                    Some(e) => e.1 += 1,
                    None => column.push((r, 1)),
                }
            }
            column.sort_unstable();
            column
        })
        .filter(|c| !(c.len() == 1 && c[0].1 == 1))
        .collect();
    for column in pool
        .iter()
        .chain(&priced.candidates)
        .chain(&warm_candidates)
        .chain(&ffd)
    {
        if in_active.insert(column.clone()) {
            active.push((column.clone(), 0));
        }
    }
    let mut generated = active.len();
    let mut rounds = 0;
    let mut converged = false;
    let mut duals: Vec<f64> = vec![0.0; m];
    let mut misprices = 0;
    let mut upper = f64::INFINITY;
    let mut work = pass_work;
    let mut lp_size = 0u64;
    while within_budget(rounds, work, lp_size) {
        rounds += 1;
        let columns: Vec<Column> = active.iter().map(|c| c.0.clone()).collect();
        lp_size = lp_size.saturating_add(((columns.len() + m) as u64).saturating_mul(m as u64));
        let Some((y, objective)) = solve_master(&hs, &columns) else {
            break; // numerical trouble: keep the bound proven so far
        };
        upper = objective * scale;
        duals = y;
        for (column, last) in active.iter_mut() {
            if dot(column, &duals) >= 1.0 - PRICING_TOL {
                *last = rounds;
            }
        }
        if upper - lower <= GAP_TOL * upper.max(1.0) {
            converged = true;
            break;
        }
        // Price at the smoothed duals; a pack that does not improve the
        // master at its own duals is a mis-price: smooth less and retry.
        let mut alpha = if misprices >= 3 { 0.0 } else { SMOOTHING };
        let mut added = 0;
        loop {
            let ys: Vec<f64> = duals
                .iter()
                .zip(&centre)
                .map(|(r, c)| alpha * c + (1.0 - alpha) * r)
                .collect();
            let priced = pricer.price(&ys, h, 1.0 + PRICING_TOL);
            work = work.saturating_add(pass_work);
            let f = farley(&ys, priced.best);
            if f > lower {
                lower = f;
                centre = ys.iter().map(|v| v / priced.best).collect();
            }
            for column in priced.candidates {
                if dot(&column, &duals) > 1.0 + PRICING_TOL && in_active.insert(column.clone()) {
                    active.push((column, rounds));
                    added += 1;
                }
            }
            if added > 0 || alpha == 0.0 {
                if added == 0 {
                    converged = priced.best <= 1.0 + PRICING_TOL;
                }
                break;
            }
            misprices += 1;
            alpha = if misprices >= 3 { 0.0 } else { alpha / 2.0 };
        }
        if added == 0 {
            break;
        }
        generated += added;
        active.retain(|(_, last)| last + KEEP_ROUNDS >= rounds);
        in_active = active.iter().map(|c| c.0.clone()).collect();
    }
    let margin = GAP_TOL * lower.max(1.0);
    let packs = ((lower - margin).ceil().max(0.0) as u64).max(trivial);
    let bound = PackBound {
        packs,
        value: lower,
        depth: Some(depth),
        iterations: rounds,
        columns: generated,
        converged,
    };
    let mut columns: Vec<Column> = if with_primal {
        active
            .iter()
            .map(|c| c.0.clone())
            .filter(|c| dot(c, &duals) >= 1.0 - PRICING_TOL)
            .collect()
    } else {
        Vec::new()
    };
    let x = if with_primal {
        solve_primal(h, &columns, Some(&duals))
            .filter(|x| x.iter().sum::<f64>() <= upper + 1e-6 * upper.max(1.0))
            .or_else(|| solve_primal(h, &columns, None))
            .unwrap_or_default()
    } else {
        Vec::new()
    };
    columns.extend((0..m).map(|i| vec![(i, 1)]));
    if x.len() != columns.len() {
        columns.clear();
    }
    Ok(LpSolution {
        bound,
        columns,
        x,
        active: active.into_iter().map(|c| c.0).collect(),
        duals,
    })
}

/// What LPHP did besides the plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LphpReport {
    /// The LP bound on the whole histogram at the plan's depth.
    pub bound: PackBound,
    /// LP solves on the residual histogram after the first (rounding rounds).
    pub plan_rounds: usize,
    /// Sequences left to the greedy repair.
    pub repaired_sequences: u64,
}

mod round;
use round::{carry, fill_slots};
#[cfg(test)]
mod tests;

/// LPHP on `counts[l]`, `l` in `1..=max_seq_len`, at most `depth` sequences per pack.
pub(crate) fn lphp(
    counts: &[u64],
    max_seq_len: usize,
    depth: usize,
) -> Result<(Vec<Strategy>, LphpReport)> {
    let depth = depth.max(1);
    let mut rows = Rows::new(counts, max_seq_len);
    let first = warm_lp(&rows, max_seq_len, depth, &[], true)?;
    let bound = first.bound.clone();
    let mut strategies = Vec::new();
    let mut solution = first;
    let mut plan_rounds = 0;
    loop {
        let mut need = rows.counts.clone();
        let placed = fill_slots(&rows, &solution.columns, &solution.x, &mut need);
        let progress = !placed.is_empty();
        strategies.extend(placed);
        let residual = Rows {
            lengths: rows
                .lengths
                .iter()
                .zip(&need)
                .filter(|(_, &c)| c > 0)
                .map(|(&l, _)| l)
                .collect(),
            counts: need.iter().copied().filter(|&c| c > 0).collect(),
        };
        let pool: Vec<Column> = solution
            .columns
            .iter()
            .zip(&solution.x)
            .filter(|(_, &x)| x > 0.0)
            .map(|(c, _)| c.clone())
            .collect();
        let pool = carry(&pool, &rows, &residual);
        rows = residual;
        let max_rounds = if depth > WARM_DEPTH {
            MAX_DEEP_PLAN_ROUNDS
        } else {
            MAX_PLAN_ROUNDS
        };
        if rows.lengths.is_empty() || !progress || plan_rounds >= max_rounds {
            break;
        }
        plan_rounds += 1;
        solution = warm_lp(&rows, max_seq_len, depth, &pool, true)?;
    }
    // Greedy repair of what the rounded LPs left: the best of FFD, BFD, LPFHP.
    let repaired_sequences = rows.sequences();
    if repaired_sequences > 0 {
        let mut rest = vec![0u64; max_seq_len + 1];
        for (&l, &c) in rows.lengths.iter().zip(&rows.counts) {
            rest[l] = c;
        }
        let packs = |s: &[Strategy]| s.iter().map(|s| s.count).sum::<u64>();
        let greedy = [
            heuristics::fit_decreasing(&rest, max_seq_len, depth, Fit::First),
            heuristics::fit_decreasing(&rest, max_seq_len, depth, Fit::Best),
            heuristics::lpfhp(&rest, max_seq_len, depth),
        ]
        .into_iter()
        .min_by_key(|s| packs(s))
        .expect("three candidates");
        strategies.extend(greedy);
    }
    Ok((
        strategies,
        LphpReport {
            bound,
            plan_rounds,
            repaired_sequences,
        },
    ))
}
