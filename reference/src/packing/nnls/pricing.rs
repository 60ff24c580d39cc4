//! The pricing step of the NNLS solver: the entering column.

use super::SparseColumns;

/// The columns of a [`SparseColumns`] padded to one width (the longest
/// column; padding entries are `0.0` at row 0), so the gradient pass
/// `A^T r` runs over fixed-size chunks with no per-column bounds. A padding
/// entry adds `+-0.0` to a finite sum, which leaves it unchanged: the
/// gradients are bit for bit those of [`SparseColumns::dot_dense`].
pub(super) struct PaddedColumns {
    width: usize,
    rows: Vec<u32>,
    vals: Vec<f64>,
    /// The residual's length (rows rounded up to a power of two) less one: row
    /// indices are masked with it, which lets the compiler drop the bounds
    /// checks of the gather (every row is below it).
    mask: usize,
}

impl PaddedColumns {
    pub(super) fn new(a: &SparseColumns) -> Self {
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
    pub(super) fn most_positive(
        &self,
        r: &[f64],
        blocked: &[bool],
        tol: f64,
        grads: &mut [f64],
    ) -> Option<usize> {
        match self.width {
            1 => self.gradients_of::<1>(r, grads),
            2 => self.gradients_of::<2>(r, grads),
            3 => self.gradients_of::<3>(r, grads),
            4 => self.gradients_of::<4>(r, grads),
            _ => {
                let w = self.width;
                let sums = self.rows.chunks_exact(w).zip(self.vals.chunks_exact(w));
                return Self::best(
                    sums.map(|(rows, vals)| {
                        rows.iter()
                            .zip(vals)
                            .fold(0.0, |g, (&i, &v)| g + v * r[i as usize])
                    }),
                    blocked,
                    tol,
                );
            }
        }
        Self::best(grads.iter().copied(), blocked, tol)
    }

    /// Every column's gradient `a_j^T r` into `grads`, the columns `W` wide.
    fn gradients_of<const W: usize>(&self, r: &[f64], grads: &mut [f64]) {
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
pub(super) enum Pricing<'a> {
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
        /// The matrix's row weights.
        weight: &'a [f64],
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

impl<'a> Pricing<'a> {
    pub(super) fn new(a: &'a SparseColumns) -> Self {
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
            weight: &m.weight,
            u,
            mask: len - 1,
            neg,
        }
    }

    pub(super) fn set_blocked(&mut self, j: usize, blocked: bool) {
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
    pub(super) fn most_positive(&mut self, r: &[f64], tol: f64) -> Option<usize> {
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
