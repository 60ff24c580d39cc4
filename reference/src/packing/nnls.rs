//! Non-negative least squares for sparse, small-integer matrices.
//!
//! The Lawson–Hanson active-set method (Lawson & Hanson, *Solving Least Squares
//! Problems*, 1974, ch. 23 — the algorithm behind `scipy.optimize.nnls`), with
//! the passive-set subproblem solved through the normal equations. Their
//! Cholesky factor is kept up to date (O(k^2) per added or removed column,
//! stored as a packed row-major triangle so every loop is contiguous) instead
//! of being refactored, and the gradient
//! `A^T (b - A x)` uses the sparsity of the packing matrix (at most `depth`
//! non-zeros per column). That turns the 512 x 21,846 NNLSHP problem on
//! Wikipedia from seconds (dense Householder NNLS) into well under a second.

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

/// The columns of a [`SparseColumns`] padded to one width (the longest
/// column; padding entries are `0.0` at row 0), so the gradient pass
/// `A^T r` runs over fixed-size chunks with no per-column bounds. A padding
/// entry adds `+-0.0` to a finite sum, which leaves it unchanged: the
/// gradients are bit for bit those of [`SparseColumns::dot_dense`].
struct PaddedColumns {
    width: usize,
    rows: Vec<u32>,
    vals: Vec<f64>,
    /// `residual_len() - 1`: row indices are masked with it, which lets the
    /// compiler drop the bounds checks of the gather (every row is below it).
    mask: usize,
}

impl PaddedColumns {
    fn new(a: &SparseColumns) -> Self {
        let width = (0..a.cols())
            .map(|j| a.col(j).len())
            .max()
            .unwrap_or(0)
            .max(1);
        let mut rows = vec![0u32; a.cols() * width];
        let mut vals = vec![0.0; a.cols() * width];
        for j in 0..a.cols() {
            for (k, &(r, v)) in a.col(j).iter().enumerate() {
                rows[j * width + k] = r as u32;
                vals[j * width + k] = v;
            }
        }
        PaddedColumns {
            width,
            rows,
            vals,
            mask: a.rows.max(1).next_power_of_two() - 1,
        }
    }

    /// The length the residual passed to [`Self::most_positive`] must have:
    /// the rows rounded up to a power of two.
    fn residual_len(&self) -> usize {
        self.mask + 1
    }

    /// The column with the largest gradient `a_j^T r` above `tol` among the
    /// columns not `blocked` (ties to the lowest index), if any.
    /// `grads` (one per column) is the caller's scratch space.
    fn most_positive(
        &self,
        r: &[f64],
        blocked: &[bool],
        tol: f64,
        grads: &mut [f64],
    ) -> Option<usize> {
        match self.width {
            1 => self.most_positive_of::<1>(r, blocked, tol, grads),
            2 => self.most_positive_of::<2>(r, blocked, tol, grads),
            3 => self.most_positive_of::<3>(r, blocked, tol, grads),
            4 => self.most_positive_of::<4>(r, blocked, tol, grads),
            _ => {
                let w = self.width;
                let sums = self.rows.chunks_exact(w).zip(self.vals.chunks_exact(w));
                Self::best(
                    sums.map(|(rows, vals)| {
                        rows.iter()
                            .zip(vals)
                            .fold(0.0, |g, (&i, &v)| g + v * r[i as usize])
                    }),
                    blocked,
                    tol,
                )
            }
        }
    }

    fn most_positive_of<const W: usize>(
        &self,
        r: &[f64],
        blocked: &[bool],
        tol: f64,
        grads: &mut [f64],
    ) -> Option<usize> {
        let (rows, _) = self.rows.as_chunks::<W>();
        let (vals, _) = self.vals.as_chunks::<W>();
        let mask = self.mask;
        let r = &r[..=mask];
        for (g, (rows, vals)) in grads.iter_mut().zip(rows.iter().zip(vals)) {
            let mut s = 0.0;
            for k in 0..W {
                s += vals[k] * r[rows[k] as usize & mask];
            }
            *g = s;
        }
        Self::best(grads.iter().copied(), blocked, tol)
    }

    fn best(grads: impl Iterator<Item = f64>, blocked: &[bool], tol: f64) -> Option<usize> {
        let mut best: Option<(usize, f64)> = None;
        for ((j, g), &b) in grads.enumerate().zip(blocked) {
            if !b && g > tol && best.is_none_or(|(_, bg)| g > bg) {
                best = Some((j, g));
            }
        }
        best.map(|(j, _)| j)
    }
}

/// `sum_i a[i] * b[i]` over four running sums (so the compiler can use
/// vector lanes; the order of the additions is fixed, so results are
/// deterministic).
fn dot(a: &[f64], b: &[f64]) -> f64 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0.0f64; 4];
    let (ca, cb) = (a.chunks_exact(4), b.chunks_exact(4));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for lane in 0..4 {
            acc[lane] += x[lane] * y[lane];
        }
    }
    let tail: f64 = ra.iter().zip(rb).map(|(x, y)| x * y).sum();
    (acc[0] + acc[1]) + (acc[2] + acc[3]) + tail
}

/// The Cholesky factor `L` of the passive set's normal matrix `A_P^T A_P`,
/// stored as a packed row-major lower triangle (row `i` holds `L[i, 0..=i]`
/// at offset `i (i + 1) / 2`) in a buffer of fixed capacity, so that adding
/// a column allocates nothing and every loop below runs over contiguous
/// memory.
///
/// Beside `L` it keeps `y = L^{-1} c_P`, the forward half of the solve for a
/// right-hand side `c` fixed for the whole run (`A^T b`): each push adds its
/// entry and each removal rotates it with `L`, so a solve is one back
/// substitution.
struct GrowingCholesky {
    l: Vec<f64>,
    y: Vec<f64>,
    capacity: usize,
    k: usize,
}

impl GrowingCholesky {
    fn new(capacity: usize) -> Self {
        GrowingCholesky {
            l: vec![0.0; capacity * (capacity + 1) / 2],
            y: Vec::with_capacity(capacity),
            capacity,
            k: 0,
        }
    }

    fn row_start(i: usize) -> usize {
        i * (i + 1) / 2
    }

    /// Appends a column whose inner products with the passive columns are
    /// `cross: [k]`, with itself `diag`, and with `b` `rhs`. Returns false
    /// (and changes nothing) if the column is numerically dependent on the
    /// passive set.
    fn push(&mut self, cross: &[f64], diag: f64, rhs: f64) -> bool {
        let k = self.k;
        if k == self.capacity {
            return false;
        }
        // Forward substitution L row = cross, written straight into row k
        // (scratch until k is advanced).
        let (done, rest) = self.l.split_at_mut(Self::row_start(k));
        let row = &mut rest[..=k];
        for i in 0..k {
            let li = &done[Self::row_start(i)..Self::row_start(i) + i + 1];
            let v = (cross[i] - dot(&li[..i], &row[..i])) / li[i];
            if !v.is_finite() {
                return false;
            }
            row[i] = v;
        }
        let d2 = diag - dot(&row[..k], &row[..k]);
        if !(d2.is_finite() && d2 > 1e-18 * diag) {
            return false;
        }
        row[k] = d2.sqrt();
        self.y.push((rhs - dot(&row[..k], &self.y)) / row[k]);
        self.k += 1;
        true
    }

    /// Removes passive column `i`: drop row and column `i` of `L`, then
    /// restore the trailing block with the rank-one update
    /// `L22' L22'^T = L22 L22^T + x x^T`, `x = L[i+1.., i]` (Golub & Van Loan,
    /// *Matrix Computations*, §6.5.4), one row at a time: row `q` takes the
    /// rotations of the diagonals above it in order, then defines its own.
    fn remove(&mut self, i: usize) {
        let k = self.k;
        // (c, s) of the rotation at each new diagonal i..k-1.
        let mut rot: Vec<(f64, f64)> = Vec::with_capacity(k - i);
        // The forward vector takes the same rotations: its entry i plays x.
        let mut t = self.y.remove(i);
        for old in i + 1..k {
            let q = old - 1; // the row's new index
            let src = Self::row_start(old);
            let dst = Self::row_start(q);
            let mut x = self.l[src + i];
            // New row q: old columns 0..i, then old columns i+1..=old. The
            // destination slot (old row q's) has exactly old entries.
            self.l.copy_within(src..src + i, dst);
            self.l.copy_within(src + i + 1..src + old + 1, dst + i);
            let row = &mut self.l[dst..dst + q + 1];
            for (j, &(c, s)) in (i..q).zip(&rot) {
                let v = (row[j] + s * x) / c;
                x = c * x - s * v;
                row[j] = v;
            }
            let d = row[q];
            let r = d.hypot(x);
            let (c, s) = (r / d, x / d);
            rot.push((c, s));
            row[q] = r;
            let v = (self.y[q] + s * t) / c;
            t = c * t - s * v;
            self.y[q] = v;
        }
        self.k -= 1;
    }

    /// `z = (A_P^T A_P)^{-1} c_P` into `z` (resized to `k`): the back
    /// substitution `L^T z = y`.
    fn solve(&self, z: &mut Vec<f64>) {
        let k = self.k;
        z.clear();
        z.extend_from_slice(&self.y);
        for r in (0..k).rev() {
            let lr = &self.l[Self::row_start(r)..Self::row_start(r) + r + 1];
            z[r] /= lr[r];
            let zr = z[r];
            for (v, &l) in z[..r].iter_mut().zip(&lr[..r]) {
                *v -= zr * l;
            }
        }
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
    // Columns out of the gradient's search: passive or rejected.
    let mut blocked = vec![false; n];
    let padded = PaddedColumns::new(a);
    let mut grads = vec![0.0; n];
    let mut chol = GrowingCholesky::new(a.rows.min(n));
    // Padded to the gradient pass's power-of-two length (zeros past `b`).
    let mut residual = vec![0.0; padded.residual_len()];
    residual[..b.len()].copy_from_slice(b);
    let (mut cross, mut z): (Vec<f64>, Vec<f64>) = (Vec::new(), Vec::new());

    // Lawson–Hanson terminates in theory; the cap (10x scipy's default) only
    // guards against round-off cycling.
    let mut budget = 30 * n.max(a.rows);
    while budget > 0 {
        budget -= 1;
        // Gradient of the objective on the zero set: w = A^T (b - A x).
        let Some(jstar) = padded.most_positive(&residual, &blocked, tol, &mut grads) else {
            break;
        };

        cross.clear();
        cross.extend(passive.iter().map(|&p| a.dot_cols(p, jstar)));
        if !chol.push(&cross, a.dot_cols(jstar, jstar), atb[jstar]) {
            rejected[jstar] = true;
            blocked[jstar] = true;
            continue;
        }
        passive.push(jstar);
        in_passive[jstar] = true;
        blocked[jstar] = true;

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
                    blocked[jstar] = true;
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
                    blocked[p] = rejected[p];
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

    /// `L L^T` of the first `k` rows of the factor, dense.
    fn product(c: &GrowingCholesky) -> Vec<Vec<f64>> {
        let row =
            |i: usize| &c.l[GrowingCholesky::row_start(i)..GrowingCholesky::row_start(i) + i + 1];
        (0..c.k)
            .map(|i| {
                (0..c.k)
                    .map(|j| dot(&row(i)[..=i.min(j)], &row(j)[..=i.min(j)]))
                    .collect()
            })
            .collect()
    }

    #[test]
    fn removing_a_column_keeps_the_factor_of_the_remaining_gram_matrix() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        for trial in 0..40 {
            let (m, k) = (12, 2 + trial % 9);
            let cols: Vec<Vec<f64>> = (0..k)
                .map(|_| (0..m).map(|_| rng.random_range(-1.0..1.0)).collect())
                .collect();
            let b: Vec<f64> = (0..m).map(|_| rng.random_range(-1.0..1.0)).collect();
            let mut chol = GrowingCholesky::new(k);
            for j in 0..k {
                let cross: Vec<f64> = (0..j).map(|p| dot(&cols[p], &cols[j])).collect();
                let pushed = chol.push(&cross, dot(&cols[j], &cols[j]), dot(&cols[j], &b));
                assert!(pushed, "trial {trial}: column {j}");
            }
            let mut kept: Vec<usize> = (0..k).collect();
            // Remove two columns at random positions, one after the other.
            for _ in 0..2.min(k - 1) {
                let i = rng.random_range(0..kept.len());
                chol.remove(i);
                kept.remove(i);
                let got = product(&chol);
                for (a, &p) in kept.iter().enumerate() {
                    for (b, &q) in kept.iter().enumerate() {
                        let want = dot(&cols[p], &cols[q]);
                        assert!(
                            (got[a][b] - want).abs() <= 1e-12 * (1.0 + want.abs()),
                            "trial {trial}: entry ({a}, {b}) {} vs {want}",
                            got[a][b]
                        );
                    }
                }
                // The solve after the removal: (A_P^T A_P) z = A_P^T b.
                let mut z = Vec::new();
                chol.solve(&mut z);
                for (a, &p) in kept.iter().enumerate() {
                    let lhs: f64 = kept
                        .iter()
                        .zip(&z)
                        .map(|(&q, zq)| dot(&cols[p], &cols[q]) * zq)
                        .sum();
                    let rhs = dot(&cols[p], &b);
                    assert!(
                        (lhs - rhs).abs() <= 1e-9 * (1.0 + rhs.abs()),
                        "trial {trial}: row {a}: {lhs} vs {rhs}"
                    );
                }
            }
        }
    }

    #[test]
    fn random_packing_shaped_problems_meet_the_kkt_conditions() {
        // Columns of at most 3 small-integer entries, more columns than rows
        // (so columns leave the passive set), b >= 0 as in NNLSHP.
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        for trial in 0..60 {
            let m = 4 + trial % 20;
            let n = 3 * m;
            let mut a = SparseColumns::new(m);
            for _ in 0..n {
                let mut rows: Vec<usize> = (0..rng.random_range(1..=3))
                    .map(|_| rng.random_range(0..m))
                    .collect();
                rows.sort_unstable();
                rows.dedup();
                a.push(
                    rows.into_iter()
                        .map(|r| (r, f64::from(rng.random_range(1..=3u8)))),
                );
            }
            let b: Vec<f64> = (0..m)
                .map(|_| f64::from(rng.random_range(0..50u8)))
                .collect();
            let x = nnls(&a, &b);
            let mut r = b.clone();
            for (j, &xj) in x.iter().enumerate() {
                assert!(xj >= 0.0, "trial {trial}: x[{j}] = {xj}");
                for &(row, v) in a.col(j) {
                    r[row] -= v * xj;
                }
            }
            let scale = 1e-9 * (1.0 + b.iter().sum::<f64>());
            for (j, &xj) in x.iter().enumerate() {
                let w = a.dot_dense(j, &r);
                // Stationarity: no improving direction on the zero set, and a
                // zero gradient where the coefficient is positive.
                assert!(
                    w <= scale,
                    "trial {trial}: gradient {w} > 0 at x[{j}] = {xj}"
                );
                if xj > 0.0 {
                    assert!(
                        w.abs() <= scale,
                        "trial {trial}: gradient {w} at positive x[{j}]"
                    );
                }
            }
        }
    }
}
