//! The NNLS solver's Cholesky factor of the passive set, kept up to date.

/// `sum_i a[i] * b[i]` over four running sums (so the compiler can use
/// vector lanes; the order of the additions is fixed, so results are
/// deterministic).
pub(super) fn dot(a: &[f64], b: &[f64]) -> f64 {
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
pub(super) enum Push {
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
pub(super) struct GrowingCholesky {
    pub(super) r: Vec<f64>,
    pub(super) stride: usize,
    pub(super) y: Vec<f64>,
    /// Scratch for [`Self::push`]: the new column of `R`.
    pub(super) w: Vec<f64>,
    /// The most columns the factor can hold (`min(rows, columns)`: more are
    /// linearly dependent).
    pub(super) capacity: usize,
    /// The most it may hold ([`MAX_PASSIVE`] outside tests).
    pub(super) max_passive: usize,
    pub(super) k: usize,
}

impl GrowingCholesky {
    pub(super) fn new(capacity: usize, max_passive: usize) -> Self {
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
    pub(super) fn push(&mut self, cross: &[f64], diag: f64, rhs: f64) -> Push {
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
    pub(super) fn remove(&mut self, i: usize) {
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
    pub(super) fn solve(&self, z: &mut Vec<f64>) {
        let (k, n) = (self.k, self.stride);
        z.clear();
        z.resize(k, 0.0);
        for r in (0..k).rev() {
            let row = &self.r[r * n + r + 1..r * n + k];
            z[r] = (self.y[r] - dot(row, &z[r + 1..k])) / self.r[r * n + r];
        }
    }
}
