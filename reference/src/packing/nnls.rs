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

use crate::error::{Error, Result};

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

/// The columns of a [`SparseColumns`] padded to one width (the longest
/// column; padding entries are `0.0` at row 0), so the gradient pass
/// `A^T r` runs over fixed-size chunks with no per-column bounds. A padding
/// entry adds `+-0.0` to a finite sum, which leaves it unchanged: the
/// gradients are bit for bit those of [`SparseColumns::dot_dense`].
struct PaddedColumns {
    width: usize,
    rows: Vec<u32>,
    vals: Vec<f64>,
    /// The residual's length (rows rounded up to a power of two) less one: row
    /// indices are masked with it, which lets the compiler drop the bounds
    /// checks of the gather (every row is below it).
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

/// The pricing step of Lawson–Hanson: the column with the largest gradient
/// `a_j^T r` above `tol` among the columns not blocked (passive or
/// rejected), ties to the lowest index.
enum Pricing {
    /// Columns given as weighted multisets of rows (NNLSHP's packing matrix,
    /// [`SparseColumns::weighted`]): the gradient of column `j` is
    /// `sum_k u[rows_jk]` with `u = w * r` formed once per pass, so the pass
    /// reads `width` row indices a column and nothing else. Columns shorter
    /// than `width` are padded with a row whose `u` is 0; a blocked column
    /// has its first index pointed at a row whose `u` is `-inf`.
    Multisets {
        width: usize,
        idx: Vec<u32>,
        first: Vec<u32>,
        weight: Vec<f64>,
        u: Vec<f64>,
        mask: usize,
        neg: u32,
    },
    /// Any sparse matrix: [`PaddedColumns`] and a blocked flag a column.
    Padded {
        cols: PaddedColumns,
        blocked: Vec<bool>,
        grads: Vec<f64>,
    },
}

impl Pricing {
    fn new(a: &SparseColumns) -> Self {
        let Some(m) = &a.multisets else {
            return Pricing::Padded {
                cols: PaddedColumns::new(a),
                blocked: vec![false; a.cols()],
                grads: vec![0.0; a.cols()],
            };
        };
        let n = a.cols();
        let width = m
            .starts
            .windows(2)
            .map(|w| w[1] - w[0])
            .max()
            .unwrap_or(0)
            .max(1);
        // Rows, then the zero row, then the -inf row.
        let (zero, neg) = (a.rows as u32, a.rows as u32 + 1);
        let len = (a.rows + 2).next_power_of_two();
        let mut u = vec![0.0; len];
        u[neg as usize] = f64::NEG_INFINITY;
        let mut idx = vec![zero; n * width];
        for j in 0..n {
            let rows = &m.rows[m.starts[j]..m.starts[j + 1]];
            idx[j * width..j * width + rows.len()].copy_from_slice(rows);
        }
        let first = idx.iter().step_by(width).copied().collect();
        Pricing::Multisets {
            width,
            idx,
            first,
            weight: m.weight.clone(),
            u,
            mask: len - 1,
            neg,
        }
    }

    fn set_blocked(&mut self, j: usize, blocked: bool) {
        match self {
            Pricing::Multisets {
                width,
                idx,
                first,
                neg,
                ..
            } => idx[j * *width] = if blocked { *neg } else { first[j] },
            Pricing::Padded { blocked: b, .. } => b[j] = blocked,
        }
    }

    /// The entering column for the residual `r: [rows rounded up to a power
    /// of two]` (zeros past `rows`).
    fn most_positive(&mut self, r: &[f64], tol: f64) -> Option<usize> {
        match self {
            Pricing::Padded {
                cols,
                blocked,
                grads,
            } => cols.most_positive(r, blocked, tol, grads),
            Pricing::Multisets {
                width,
                idx,
                weight,
                u,
                mask,
                ..
            } => {
                for ((u, &w), &r) in u.iter_mut().zip(weight.iter()).zip(r) {
                    *u = w * r;
                }
                match *width {
                    1 => Self::argmax::<1>(idx, u, *mask, tol),
                    2 => Self::argmax::<2>(idx, u, *mask, tol),
                    3 => Self::argmax::<3>(idx, u, *mask, tol),
                    4 => Self::argmax::<4>(idx, u, *mask, tol),
                    w => {
                        let mut best = (tol, None);
                        for (j, c) in idx.chunks_exact(w).enumerate() {
                            let g = c[1..]
                                .iter()
                                .fold(u[c[0] as usize], |g, &i| g + u[i as usize]);
                            if g > best.0 {
                                best = (g, Some(j));
                            }
                        }
                        best.1
                    }
                }
            }
        }
    }

    /// `argmax_j sum_k u[idx[j, k]]` above `tol`, ties to the lowest `j`.
    /// Four running maxima (columns `j mod 4`) so that consecutive compares
    /// do not wait on each other; merged at the end by value, then index.
    fn argmax<const W: usize>(idx: &[u32], u: &[f64], mask: usize, tol: f64) -> Option<usize> {
        const LANES: usize = 4;
        let (cols, _) = idx.as_chunks::<W>();
        let u = &u[..=mask];
        let gradient = |c: &[u32; W]| {
            let mut g = u[c[0] as usize & mask];
            for &i in &c[1..] {
                g += u[i as usize & mask];
            }
            g
        };
        let mut best = [tol; LANES];
        let mut at = [usize::MAX; LANES];
        let (blocks, tail) = cols.as_chunks::<LANES>();
        for (b, block) in blocks.iter().enumerate() {
            for lane in 0..LANES {
                let g = gradient(&block[lane]);
                if g > best[lane] {
                    best[lane] = g;
                    at[lane] = b * LANES + lane;
                }
            }
        }
        let base = blocks.len() * LANES;
        for (lane, c) in tail.iter().enumerate() {
            let g = gradient(c);
            if g > best[lane] {
                best[lane] = g;
                at[lane] = base + lane;
            }
        }
        let mut pick: Option<(f64, usize)> = None;
        for lane in 0..LANES {
            if at[lane] != usize::MAX
                && pick.is_none_or(|(g, j)| best[lane] > g || (best[lane] == g && at[lane] < j))
            {
                pick = Some((best[lane], at[lane]));
            }
        }
        pick.map(|(_, j)| j)
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

/// The most columns the passive set may hold. The factor below is `k x k`
/// (8 MiB at 1,024, 128 MiB here): a larger passive set would need a
/// histogram of thousands of distinct lengths at a `max_seq_len` over 4,096,
/// and is refused with a typed error rather than allocated.
pub const MAX_PASSIVE: usize = 4096;

/// What [`GrowingCholesky::push`] did with a column.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Push {
    Added,
    /// Numerically dependent on the passive set: rejected for good.
    Dependent,
    /// The passive set is at [`MAX_PASSIVE`].
    Full,
}

/// The Cholesky factor of the passive set's normal matrix
/// `A_P^T A_P = R^T R`, `R` upper triangular, stored row-major in a square
/// buffer of stride `stride` (grown by doubling up to [`MAX_PASSIVE`], so
/// memory follows the passive set actually reached, not the problem's size).
/// Row-major `R` makes every loop contiguous: the forward solve runs as
/// row `axpy`s, a column removal as Givens rotations of two adjacent rows
/// (Golub & Van Loan, *Matrix Computations*, §6.5.2: deleting a column leaves
/// `R` upper Hessenberg from that column on), with no dependency between the
/// entries of a row, so they vectorize.
///
/// Beside `R` it keeps `y = R^{-T} c_P`, the forward half of the solve for a
/// right-hand side `c` fixed for the whole run (`A^T b`): each push adds its
/// entry and each removal applies the same rotations to it, so a solve is one
/// back substitution.
struct GrowingCholesky {
    r: Vec<f64>,
    stride: usize,
    y: Vec<f64>,
    /// Scratch for [`Self::push`]: the new column of `R`.
    w: Vec<f64>,
    /// The most columns the factor can hold (`min(rows, columns)`: more are
    /// linearly dependent).
    capacity: usize,
    /// The most it may hold ([`MAX_PASSIVE`] outside tests).
    max_passive: usize,
    k: usize,
}

impl GrowingCholesky {
    fn new(capacity: usize, max_passive: usize) -> Self {
        GrowingCholesky {
            r: Vec::new(),
            stride: 0,
            y: Vec::new(),
            w: Vec::new(),
            capacity,
            max_passive,
            k: 0,
        }
    }

    /// Makes room for `k + 1` columns (the stride at least doubled).
    fn reserve_one(&mut self) {
        if self.k < self.stride {
            return;
        }
        let stride = (2 * self.stride)
            .max(16)
            .min(self.capacity.min(self.max_passive));
        let mut r = vec![0.0; stride * stride];
        for i in 0..self.k {
            r[i * stride + i..i * stride + self.k]
                .copy_from_slice(&self.r[i * self.stride + i..i * self.stride + self.k]);
        }
        self.r = r;
        self.stride = stride;
    }

    /// Appends a column whose inner products with the passive columns are
    /// `cross: [k]`, with itself `diag`, and with `b` `rhs`. A column that is
    /// numerically dependent on the passive set (or one past `capacity`,
    /// which must be) changes nothing and is [`Push::Dependent`].
    fn push(&mut self, cross: &[f64], diag: f64, rhs: f64) -> Push {
        let k = self.k;
        if k == self.capacity {
            return Push::Dependent;
        }
        if k == self.max_passive {
            return Push::Full;
        }
        self.reserve_one();
        let n = self.stride;
        // Forward substitution R^T w = cross, one row axpy per entry.
        self.w.clear();
        self.w.extend_from_slice(&cross[..k]);
        for p in 0..k {
            let wp = self.w[p] / self.r[p * n + p];
            if !wp.is_finite() {
                return Push::Dependent;
            }
            self.w[p] = wp;
            let row = &self.r[p * n + p + 1..p * n + k];
            for (t, &v) in self.w[p + 1..k].iter_mut().zip(row) {
                *t -= v * wp;
            }
        }
        let d2 = diag - dot(&self.w, &self.w);
        if !(d2.is_finite() && d2 > 1e-18 * diag) {
            return Push::Dependent;
        }
        let d = d2.sqrt();
        for (p, &wp) in self.w.iter().enumerate() {
            self.r[p * n + k] = wp;
        }
        self.r[k * n + k] = d;
        self.y.push((rhs - dot(&self.w, &self.y)) / d);
        self.k += 1;
        Push::Added
    }

    /// Removes passive column `i`: the columns after it move one to the left,
    /// which leaves `R` upper Hessenberg from column `i` on; a Givens rotation
    /// of rows `j, j + 1` for each `j` in `i..k-1` restores the triangle, and
    /// `y` takes the same rotations (its last entry, the part of `c` no longer
    /// in the span, is dropped).
    fn remove(&mut self, i: usize) {
        let (k, n) = (self.k, self.stride);
        for row in 0..k {
            // Row `row` holds columns row..k; below the diagonal is never read.
            let from = (i + 1).max(row);
            let base = row * n;
            self.r.copy_within(base + from..base + k, base + from - 1);
        }
        for j in i..k - 1 {
            let (top, bottom) = self.r.split_at_mut((j + 1) * n);
            let upper = &mut top[j * n + j..j * n + k - 1];
            let lower = &mut bottom[j..k - 1];
            let (a, b) = (upper[0], lower[0]);
            let h = a.hypot(b);
            let (c, s) = (a / h, b / h);
            upper[0] = h;
            for (u, l) in upper[1..].iter_mut().zip(&mut lower[1..]) {
                let (t1, t2) = (*u, *l);
                *u = c * t1 + s * t2;
                *l = c * t2 - s * t1;
            }
            let (t1, t2) = (self.y[j], self.y[j + 1]);
            self.y[j] = c * t1 + s * t2;
            self.y[j + 1] = c * t2 - s * t1;
        }
        self.y.pop();
        self.k -= 1;
    }

    /// `z = (A_P^T A_P)^{-1} c_P` into `z` (resized to `k`): the back
    /// substitution `R z = y`.
    fn solve(&self, z: &mut Vec<f64>) {
        let (k, n) = (self.k, self.stride);
        z.clear();
        z.resize(k, 0.0);
        for r in (0..k).rev() {
            let row = &self.r[r * n + r + 1..r * n + k];
            z[r] = (self.y[r] - dot(row, &z[r + 1..k])) / self.r[r * n + r];
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
        let x = nnls(&a, &[2.0, 1.0, 1.0]).unwrap();
        assert_relative_eq!(x[0], 1.5, epsilon = 1e-12);
        assert_relative_eq!(x[1], 1.0, epsilon = 1e-12);

        let a = dense(&[
            &[1.0, 0.5, 0.0],
            &[1.0, 0.6, 0.0],
            &[0.9, 0.5, 0.1],
            &[0.0, 0.0, 1.0],
        ]);
        let x = nnls(&a, &[2.0, 1.0, 1.0, 0.5]).unwrap();
        assert_relative_eq!(x[0], 1.37279152, epsilon = 1e-7);
        assert_relative_eq!(x[1], 0.0, epsilon = 1e-12);
        assert_relative_eq!(x[2], 0.47173145, epsilon = 1e-7);
    }

    #[test]
    fn clamps_at_zero_when_the_free_solution_is_negative() {
        // b = [1, 1] is met exactly at x = [1, 0].
        let a = dense(&[&[1.0, 1.0], &[1.0, 2.0]]);
        let x = nnls(&a, &[1.0, 1.0]).unwrap();
        assert_relative_eq!(x[0], 1.0, epsilon = 1e-12);
        assert_relative_eq!(x[1], 0.0, epsilon = 1e-12);
        let x = nnls(&a, &[3.0, 2.0]).unwrap();
        // Free optimum [4, -1] is infeasible; best with x1 = 0 is x0 = 2.5.
        assert_relative_eq!(x[0], 2.5, epsilon = 1e-12);
        assert_eq!(x[1], 0.0);
    }

    /// `R^T R` of the factor, dense.
    fn product(c: &GrowingCholesky) -> Vec<Vec<f64>> {
        let n = c.stride;
        let entry = |i: usize, j: usize| if i <= j { c.r[i * n + j] } else { 0.0 };
        (0..c.k)
            .map(|i| {
                (0..c.k)
                    .map(|j| (0..=i.min(j)).map(|p| entry(p, i) * entry(p, j)).sum())
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
            let mut chol = GrowingCholesky::new(k, MAX_PASSIVE);
            for j in 0..k {
                let cross: Vec<f64> = (0..j).map(|p| dot(&cols[p], &cols[j])).collect();
                let pushed = chol.push(&cross, dot(&cols[j], &cols[j]), dot(&cols[j], &b));
                assert_eq!(pushed, Push::Added, "trial {trial}: column {j}");
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
            let x = nnls(&a, &b).unwrap();
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

    /// A random NNLSHP-shaped problem twice: as weighted multisets (the fast
    /// pricing) and as plain sparse columns with the same values.
    fn weighted_pair(
        rng: &mut impl rand::Rng,
        m: usize,
        n: usize,
    ) -> (SparseColumns, SparseColumns) {
        let weight: Vec<f64> = (0..m)
            .map(|r| {
                if r < 3 {
                    0.09
                } else {
                    rng.random_range(0.5..2.0)
                }
            })
            .collect();
        let mut fast = SparseColumns::weighted(weight.clone());
        let mut plain = SparseColumns::new(m);
        for _ in 0..n {
            let mut rows: Vec<usize> = (0..rng.random_range(1..=3))
                .map(|_| rng.random_range(0..m))
                .collect();
            rows.sort_unstable();
            fast.push_multiset(&rows);
            let mut entries: Vec<(usize, f64)> = Vec::new();
            for &r in &rows {
                match entries.last_mut() {
                    Some((row, v)) if *row == r => *v += weight[r],
                    _ => entries.push((r, weight[r])),
                }
            }
            plain.push(entries);
        }
        assert!(fast.multisets.is_some() && plain.multisets.is_none());
        (fast, plain)
    }

    #[test]
    fn multiset_pricing_picks_the_column_the_plain_pricing_picks() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        for trial in 0..50 {
            let m = 5 + trial % 30;
            let (fast, plain) = weighted_pair(&mut rng, m, 4 * m);
            for j in 0..fast.cols() {
                assert_eq!(fast.col(j), plain.col(j), "trial {trial}: column {j}");
            }
            let mut r = vec![0.0; m.next_power_of_two()];
            for v in &mut r[..m] {
                *v = rng.random_range(-5.0..5.0);
            }
            let (mut pf, mut pp) = (Pricing::new(&fast), Pricing::new(&plain));
            assert!(matches!(pf, Pricing::Multisets { .. }));
            assert!(matches!(pp, Pricing::Padded { .. }));
            // Block the winners one after another: both forms follow the
            // same order until no column has a positive gradient.
            let mut order = Vec::new();
            while let Some(j) = pf.most_positive(&r, 1e-12) {
                assert_eq!(pp.most_positive(&r, 1e-12), Some(j), "trial {trial}");
                assert!(plain.dot_dense(j, &r) > 0.0);
                pf.set_blocked(j, true);
                pp.set_blocked(j, true);
                order.push(j);
            }
            assert_eq!(pp.most_positive(&r, 1e-12), None, "trial {trial}");
            // Unblocked, the first winner wins again.
            if let Some(&j) = order.first() {
                for &k in &order {
                    pf.set_blocked(k, false);
                }
                assert_eq!(pf.most_positive(&r, 1e-12), Some(j), "trial {trial}");
            }
        }
    }

    #[test]
    fn multiset_and_plain_problems_reach_the_same_optimum() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(13);
        for trial in 0..40 {
            let m = 4 + trial % 25;
            let (fast, plain) = weighted_pair(&mut rng, m, 3 * m);
            let b: Vec<f64> = (0..m)
                .map(|_| f64::from(rng.random_range(0..60u8)))
                .collect();
            let objective = |x: &[f64]| {
                let mut r = b.clone();
                for (j, &xj) in x.iter().enumerate() {
                    for &(row, v) in plain.col(j) {
                        r[row] -= v * xj;
                    }
                }
                r.iter().map(|v| v * v).sum::<f64>()
            };
            let (xf, xp) = (nnls(&fast, &b).unwrap(), nnls(&plain, &b).unwrap());
            assert!(xf.iter().all(|&v| v >= 0.0));
            let (of, op) = (objective(&xf), objective(&xp));
            assert!(
                (of - op).abs() <= 1e-9 * (1.0 + op),
                "trial {trial}: {of} vs {op}"
            );
        }
    }

    #[test]
    fn a_passive_set_past_its_cap_is_a_typed_error() {
        // Identity columns and b = 1: the optimum uses every column, so the
        // passive set grows to the number of rows.
        let mut a = SparseColumns::new(10);
        for r in 0..10 {
            a.push_multiset(&[r]);
        }
        let b = vec![1.0; 10];
        let x = nnls_capped(&a, &b, 10).unwrap();
        assert!(x.iter().all(|&v| (v - 1.0).abs() < 1e-12), "{x:?}");
        let err = nnls_capped(&a, &b, 9).unwrap_err();
        assert_eq!(err.kind(), "invalid_argument");
        assert!(err.to_string().contains("max_seq_len"), "{err}");
    }
}
