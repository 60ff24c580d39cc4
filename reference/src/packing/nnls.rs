//! Non-negative least squares for sparse, small-integer matrices.
//!
//! The Lawson–Hanson active-set method (Lawson & Hanson, *Solving Least Squares
//! Problems*, 1974, ch. 23 — the algorithm behind `scipy.optimize.nnls`), with
//! the passive-set subproblem solved through the normal equations. Their
//! Cholesky factor is kept up to date (O(k^2) per added or removed column,
//! with nalgebra's triangular solves) instead of
//! being refactored, and the gradient
//! `A^T (b - A x)` uses the sparsity of the packing matrix (at most `depth`
//! non-zeros per column). That turns the 512 x 21,846 NNLSHP problem on
//! Wikipedia from seconds (dense Householder NNLS) into well under a second.

use nalgebra::{DMatrix, DVector};

/// A matrix stored by columns, each column a short list of `(row, value)`
/// entries sorted by row.
#[derive(Debug, Clone, Default)]
pub(crate) struct SparseColumns {
    pub rows: usize,
    starts: Vec<usize>,
    entries: Vec<(usize, f64)>,
}

impl SparseColumns {
    pub fn new(rows: usize) -> Self {
        SparseColumns {
            rows,
            starts: vec![0],
            entries: Vec::new(),
        }
    }

    /// Appends a column; `entries` must be sorted by row, rows unique.
    pub fn push(&mut self, entries: impl IntoIterator<Item = (usize, f64)>) {
        self.entries.extend(entries);
        self.starts.push(self.entries.len());
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

/// The Cholesky factor `L` of the passive set's normal matrix `A_P^T A_P`,
/// held in a buffer of fixed capacity so that adding a column allocates nothing.
struct GrowingCholesky {
    l: DMatrix<f64>,
    k: usize,
}

impl GrowingCholesky {
    fn new(capacity: usize) -> Self {
        GrowingCholesky {
            l: DMatrix::zeros(capacity, capacity),
            k: 0,
        }
    }

    /// Appends a column whose inner products with the passive columns are
    /// `cross: [k]` and with itself `diag`. Returns false (and changes nothing)
    /// if the column is numerically dependent on the passive set.
    fn push(&mut self, cross: &DVector<f64>, diag: f64) -> bool {
        let k = self.k;
        if k == self.l.nrows() {
            return false;
        }
        let mut row = cross.clone();
        if k > 0
            && !self
                .l
                .view((0, 0), (k, k))
                .solve_lower_triangular_mut(&mut row)
        {
            return false;
        }
        let d2 = diag - row.norm_squared();
        if !(d2.is_finite() && d2 > 1e-18 * diag) {
            return false;
        }
        for (j, v) in row.iter().enumerate() {
            self.l[(k, j)] = *v;
        }
        self.l[(k, k)] = d2.sqrt();
        self.k += 1;
        true
    }

    /// Removes passive column `i`: drop row and column `i` of `L`, then
    /// restore the trailing block with the rank-one update
    /// `L22' L22'^T = L22 L22^T + x x^T`, `x = L[i+1.., i]` (Golub & Van Loan,
    /// *Matrix Computations*, §6.5.4).
    fn remove(&mut self, i: usize) {
        let k = self.k;
        let mut x: Vec<f64> = (i + 1..k).map(|r| self.l[(r, i)]).collect();
        for r in i + 1..k {
            for c in 0..r {
                let src = if c < i { c } else { c + 1 };
                self.l[(r - 1, c)] = self.l[(r, src)];
            }
        }
        for c in 0..k {
            self.l[(k - 1, c)] = 0.0;
        }
        for (j, xj) in (i..k - 1).zip(0..) {
            let d = self.l[(j, j)];
            let r = d.hypot(x[xj]);
            let (c, s) = (r / d, x[xj] / d);
            self.l[(j, j)] = r;
            for (row, xr) in (j + 1..k - 1).zip(xj + 1..) {
                let v = (self.l[(row, j)] + s * x[xr]) / c;
                x[xr] = c * x[xr] - s * v;
                self.l[(row, j)] = v;
            }
        }
        self.k -= 1;
    }

    /// Solves `L L^T z = rhs` for `rhs: [k]`.
    fn solve(&self, rhs: &mut DVector<f64>) {
        let l = self.l.view((0, 0), (self.k, self.k));
        l.solve_lower_triangular_unchecked_mut(rhs);
        l.tr_solve_lower_triangular_unchecked_mut(rhs);
    }
}

/// Solves `min ||A x - b||_2` subject to `x >= 0`.
///
/// `a: [m, n]` sparse by columns, `b: [m]`. Returns `x: [n]`. Deterministic:
/// ties in the most-positive gradient go to the lowest column index, as in the
/// Fortran original. A column that would make the passive set numerically
/// dependent, or that cannot enter with a positive coefficient, is rejected
/// for good, as the original does.
pub(crate) fn nnls(a: &SparseColumns, b: &[f64]) -> Vec<f64> {
    let n = a.cols();
    let mut x = vec![0.0; n];
    if n == 0 {
        return x;
    }
    let atb: Vec<f64> = (0..n).map(|j| a.dot_dense(j, b)).collect();
    let scale = atb.iter().fold(0.0f64, |m, v| m.max(v.abs())).max(1.0);
    let tol = 1e-12 * scale;

    let mut passive: Vec<usize> = Vec::new();
    let mut in_passive = vec![false; n];
    let mut rejected = vec![false; n];
    let mut chol = GrowingCholesky::new(a.rows.min(n));
    let mut residual = b.to_vec();

    // Lawson–Hanson terminates in theory; the cap (10x scipy's default) only
    // guards against round-off cycling.
    let mut budget = 30 * n.max(a.rows);
    while budget > 0 {
        budget -= 1;
        // Gradient of the objective on the zero set: w = A^T (b - A x).
        let mut best: Option<(usize, f64)> = None;
        for j in 0..n {
            if in_passive[j] || rejected[j] {
                continue;
            }
            let g = a.dot_dense(j, &residual);
            if g > tol && best.is_none_or(|(_, bg)| g > bg) {
                best = Some((j, g));
            }
        }
        let Some((jstar, _)) = best else { break };

        let cross =
            DVector::from_iterator(passive.len(), passive.iter().map(|&p| a.dot_cols(p, jstar)));
        if !chol.push(&cross, a.dot_cols(jstar, jstar)) {
            rejected[jstar] = true;
            continue;
        }
        passive.push(jstar);
        in_passive[jstar] = true;

        // Inner loop: solve the unconstrained problem on P, step back to the
        // feasible region while some passive coefficient would turn negative.
        let mut first = true;
        while budget > 0 {
            budget -= 1;
            let mut z = DVector::from_iterator(passive.len(), passive.iter().map(|&p| atb[p]));
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
                    passive.remove(i);
                    chol.remove(i);
                }
            }
            if passive.is_empty() {
                break;
            }
        }

        residual.copy_from_slice(b);
        for &p in &passive {
            for &(r, v) in a.col(p) {
                residual[r] -= v * x[p];
            }
        }
    }
    x
}

#[cfg(test)]
mod tests {
    use super::*;
    use approx::assert_relative_eq;

    #[allow(clippy::needless_range_loop)]
    fn dense(a: &[&[f64]]) -> SparseColumns {
        let rows = a.len();
        let mut s = SparseColumns::new(rows);
        for j in 0..a[0].len() {
            s.push((0..rows).filter(|&i| a[i][j] != 0.0).map(|i| (i, a[i][j])));
        }
        s
    }

    #[test]
    fn matches_the_textbook_examples() {
        // The same small problems scipy and the Fortran original are tested on.
        let a = dense(&[&[1.0, 0.0], &[1.0, 0.0], &[0.0, 1.0]]);
        let x = nnls(&a, &[2.0, 1.0, 1.0]);
        assert_relative_eq!(x[0], 1.5, epsilon = 1e-12);
        assert_relative_eq!(x[1], 1.0, epsilon = 1e-12);

        let a = dense(&[
            &[1.0, 0.5, 0.0],
            &[1.0, 0.6, 0.0],
            &[0.9, 0.5, 0.1],
            &[0.0, 0.0, 1.0],
        ]);
        let x = nnls(&a, &[2.0, 1.0, 1.0, 0.5]);
        assert_relative_eq!(x[0], 1.37279152, epsilon = 1e-7);
        assert_relative_eq!(x[1], 0.0, epsilon = 1e-12);
        assert_relative_eq!(x[2], 0.47173145, epsilon = 1e-7);
    }

    #[test]
    fn clamps_at_zero_when_the_free_solution_is_negative() {
        // b = [1, 1] is met exactly at x = [1, 0].
        let a = dense(&[&[1.0, 1.0], &[1.0, 2.0]]);
        let x = nnls(&a, &[1.0, 1.0]);
        assert_relative_eq!(x[0], 1.0, epsilon = 1e-12);
        assert_relative_eq!(x[1], 0.0, epsilon = 1e-12);
        let x = nnls(&a, &[3.0, 2.0]);
        // Free optimum [4, -1] is infeasible; best with x1 = 0 is x0 = 2.5.
        assert_relative_eq!(x[0], 2.5, epsilon = 1e-12);
        assert_eq!(x[1], 0.0);
    }
}
