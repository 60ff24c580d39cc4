//! Non-negative least squares for sparse, small-integer matrices.
//!
//! The Lawson–Hanson active-set method (Lawson & Hanson, *Solving Least Squares
//! Problems*, 1974, ch. 23 — the algorithm behind `scipy.optimize.nnls`), with
//! the passive-set subproblem solved through the normal equations. Their
//! Cholesky factor is kept up to date (O(k^2) per added or removed column:
//! row `axpy`s to add, Givens rotations of adjacent rows to remove, both
//! contiguous) instead of being refactored, and the gradient
//! `A^T (b - A x)` uses the structure of the packing matrix (a column is a
//! multiset of at most `depth` rows under per-row weights, so its gradient is
//! `depth` lookups). That turns the 512 x 21,846 NNLSHP problem on Wikipedia
//! from seconds (dense Householder NNLS) into about 0.1 s.

mod cholesky;
mod pricing;
#[cfg(test)]
mod tests;

use crate::error::{Error, Result};
pub use cholesky::MAX_PASSIVE;
use cholesky::{GrowingCholesky, Push};
use pricing::Pricing;

/// A matrix stored by columns, each column a short list of `(row, value)`
/// entries sorted by row.
#[derive(Debug, Clone, Default)]
pub(crate) struct SparseColumns {
    pub rows: usize,
    starts: Vec<usize>,
    entries: Vec<(usize, f64)>,
    /// Set while every column was pushed by [`Self::push_multiset`]: the
    /// per-row weights `w: [rows]`, and each column as the multiset of its
    /// rows (ascending, a row once per unit of multiplicity), so that
    /// `A[r, j] = w[r] * (how often r is in column j)`.
    multisets: Option<Multisets>,
}

#[derive(Debug, Clone, Default)]
struct Multisets {
    weight: Vec<f64>,
    starts: Vec<usize>,
    rows: Vec<u32>,
}

impl SparseColumns {
    pub fn new(rows: usize) -> Self {
        SparseColumns {
            rows,
            starts: vec![0],
            entries: Vec::new(),
            multisets: None,
        }
    }

    /// A matrix whose columns [`Self::push_multiset`] will give as multisets
    /// of rows under the row weights `weight: [rows]` (NNLSHP's weighted
    /// packing matrix). Row indices must fit in `u32`.
    pub fn weighted(weight: Vec<f64>) -> Self {
        let mut a = SparseColumns::new(weight.len());
        a.multisets = Some(Multisets {
            weight,
            starts: vec![0],
            rows: Vec::new(),
        });
        a
    }

    /// Appends a column; `entries` must be sorted by row, rows unique. The
    /// plain form the tests hold the multiset pricing to (the solver's slow
    /// twin); NNLSHP uses [`Self::push_multiset`].
    #[cfg(test)]
    pub fn push(&mut self, entries: impl IntoIterator<Item = (usize, f64)>) {
        self.entries.extend(entries);
        self.starts.push(self.entries.len());
        self.multisets = None;
    }

    /// Appends the column holding row `r` once for each time it occurs in
    /// `rows` (ascending), with value `weight[r]` per occurrence. On a
    /// matrix not made by [`Self::weighted`] every weight is 1.
    pub fn push_multiset(&mut self, rows: &[usize]) {
        debug_assert!(rows.windows(2).all(|w| w[0] <= w[1]));
        let start = self.entries.len();
        for &r in rows {
            let w = self.multisets.as_ref().map_or(1.0, |m| m.weight[r]);
            match self.entries[start..].last_mut() {
                Some((row, v)) if *row == r => *v += w,
                _ => self.entries.push((r, w)),
            }
        }
        self.starts.push(self.entries.len());
        if let Some(m) = &mut self.multisets {
            m.rows.extend(rows.iter().map(|&r| r as u32));
            m.starts.push(m.rows.len());
        }
    }

    pub fn cols(&self) -> usize {
        self.starts.len() - 1
    }

    pub fn col(&self, j: usize) -> &[(usize, f64)] {
        &self.entries[self.starts[j]..self.starts[j + 1]]
    }

    fn dot_dense(&self, j: usize, v: &[f64]) -> f64 {
        self.col(j).iter().map(|&(r, a)| a * v[r]).sum()
    }

    fn dot_cols(&self, i: usize, j: usize) -> f64 {
        let (a, b) = (self.col(i), self.col(j));
        let (mut p, mut q, mut s) = (0, 0, 0.0);
        while p < a.len() && q < b.len() {
            match a[p].0.cmp(&b[q].0) {
                std::cmp::Ordering::Less => p += 1,
                std::cmp::Ordering::Greater => q += 1,
                std::cmp::Ordering::Equal => {
                    s += a[p].1 * b[q].1;
                    p += 1;
                    q += 1;
                }
            }
        }
        s
    }
}

/// Solves `min ||A x - b||_2` subject to `x >= 0`.
///
/// `a: [m, n]` sparse by columns, `b: [m]`. Returns `x: [n]`. Deterministic:
/// ties in the most-positive gradient go to the lowest column index, as in the
/// Fortran original. A column that would make the passive set numerically
/// dependent, or that cannot enter with a positive coefficient, is rejected
/// for good, as the original does.
///
/// # Errors
/// [`Error::InvalidArgument`] on `max_seq_len` when the passive set would
/// pass [`MAX_PASSIVE`] columns (memory and time grow with its square).
pub(crate) fn nnls(a: &SparseColumns, b: &[f64]) -> Result<Vec<f64>> {
    nnls_capped(a, b, MAX_PASSIVE)
}

/// [`nnls`] with the passive set capped at `max_passive` columns.
fn nnls_capped(a: &SparseColumns, b: &[f64], max_passive: usize) -> Result<Vec<f64>> {
    let n = a.cols();
    let mut x = vec![0.0; n];
    if n == 0 {
        return Ok(x);
    }
    let atb: Vec<f64> = (0..n).map(|j| a.dot_dense(j, b)).collect();
    let scale = atb.iter().fold(0.0f64, |m, v| m.max(v.abs())).max(1.0);
    let tol = 1e-12 * scale;

    let mut passive: Vec<usize> = Vec::new();
    let mut in_passive = vec![false; n];
    let mut rejected = vec![false; n];
    // The gradient's search skips passive and rejected columns.
    let mut pricing = Pricing::new(a);
    let padded_len = a.rows.max(1).next_power_of_two();
    let mut chol = GrowingCholesky::new(a.rows.min(n), max_passive);
    // Padded to the gradient pass's power-of-two length (zeros past `b`).
    let mut residual = vec![0.0; padded_len];
    residual[..b.len()].copy_from_slice(b);
    let (mut cross, mut z): (Vec<f64>, Vec<f64>) = (Vec::new(), Vec::new());

    // Lawson–Hanson terminates in theory; the cap (10x scipy's default) only
    // guards against round-off cycling.
    let mut budget = 30 * n.max(a.rows);
    while budget > 0 {
        budget -= 1;
        // Gradient of the objective on the zero set: w = A^T (b - A x).
        let Some(jstar) = pricing.most_positive(&residual, tol) else {
            break;
        };

        cross.clear();
        cross.extend(passive.iter().map(|&p| a.dot_cols(p, jstar)));
        match chol.push(&cross, a.dot_cols(jstar, jstar), atb[jstar]) {
            Push::Added => {}
            Push::Dependent => {
                rejected[jstar] = true;
                pricing.set_blocked(jstar, true);
                continue;
            }
            Push::Full => {
                return Err(Error::invalid(
                    "max_seq_len",
                    format!(
                        "NNLSHP's least-squares solve needs over {max_passive} packs in its active set (a histogram with many distinct lengths at a large max_seq_len); use a smaller depth or another algorithm"
                    ),
                ))
            }
        }
        passive.push(jstar);
        in_passive[jstar] = true;
        pricing.set_blocked(jstar, true);

        // Inner loop: solve the unconstrained problem on P, step back to the
        // feasible region while some passive coefficient would turn negative.
        let mut first = true;
        while budget > 0 {
            budget -= 1;
            chol.solve(&mut z);
            if first {
                first = false;
                if z[passive.len() - 1] <= 0.0 {
                    // The new column cannot enter with a positive coefficient
                    // (round-off): reject it, as Lawson–Hanson does.
                    chol.remove(passive.len() - 1);
                    passive.pop();
                    in_passive[jstar] = false;
                    rejected[jstar] = true;
                    pricing.set_blocked(jstar, true);
                    break;
                }
            }
            if z.iter().all(|&v| v > 0.0) {
                for (i, &p) in passive.iter().enumerate() {
                    x[p] = z[i];
                }
                break;
            }
            let mut alpha = f64::INFINITY;
            for (i, &p) in passive.iter().enumerate() {
                if z[i] <= 0.0 {
                    alpha = alpha.min(x[p] / (x[p] - z[i]));
                }
            }
            for (i, &p) in passive.iter().enumerate() {
                x[p] += alpha * (z[i] - x[p]);
            }
            // Drop the coefficients that reached zero (highest position first
            // so the positions of the remaining ones stay valid).
            for i in (0..passive.len()).rev() {
                let p = passive[i];
                if x[p] <= 1e-12 * scale.sqrt() {
                    x[p] = 0.0;
                    in_passive[p] = false;
                    pricing.set_blocked(p, rejected[p]);
                    passive.remove(i);
                    chol.remove(i);
                }
            }
            if passive.is_empty() {
                break;
            }
        }

        residual[..b.len()].copy_from_slice(b);
        for &p in &passive {
            for &(r, v) in a.col(p) {
                residual[r] -= v * x[p];
            }
        }
    }
    Ok(x)
}
