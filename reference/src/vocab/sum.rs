//! Compensated sums for the reductions over the vocabulary.
//!
//! A plain left-to-right sum of `k` terms carries a round-off that grows like
//! `sqrt(k)` ulp (random walk; `k` ulp at worst): over a 250,682-entry
//! vocabulary (docs/FAULTS.md V4) that is hundreds of ulp, and two summation
//! orders (one row vs eight shards) then disagree by as much. Neumaier's
//! compensated sum (Neumaier 1974, the improved Kahan–Babuška sum, with
//! Knuth's error-free TwoSum) keeps the
//! error of each sum near one ulp of the result whatever `k`, so the
//! reference is more precise than what it judges and sharded == unsharded
//! holds to a few ulp for any vocabulary size.

use ndarray::{Array2, ArrayView2};

/// A running compensated sum: each addition's rounding error, found exactly
/// by Knuth's TwoSum, is accumulated apart and added back at the end.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Neumaier {
    sum: f64,
    compensation: f64,
}

/// `(s + x, e)` with `s + x = fl(s + x) + e` exactly (Knuth's TwoSum).
#[inline]
fn two_sum(s: f64, x: f64) -> (f64, f64) {
    let t = s + x;
    let z = t - s;
    (t, (s - (t - z)) + (x - z))
}

impl Neumaier {
    /// Adds `x`.
    pub fn add(&mut self, x: f64) {
        let (t, e) = two_sum(self.sum, x);
        self.sum = t;
        self.compensation += e;
    }

    /// The sum (`+inf` stays `+inf`: the compensation of an infinite sum is
    /// not added, as it would be NaN).
    pub fn value(&self) -> f64 {
        if self.sum.is_finite() {
            self.sum + self.compensation
        } else {
            self.sum
        }
    }
}

/// `Σ_j x_j`, compensated.
pub fn sum(xs: impl IntoIterator<Item = f64>) -> f64 {
    let mut s = Neumaier::default();
    for x in xs {
        s.add(x);
    }
    s.value()
}

/// `a @ b` with every dot product summed compensated: `a: [n, k]`, `b: [k,
/// m]` → `[n, m]`. Used where `k` is the vocabulary (`∂L/∂x = ∂L/∂z @ W`).
pub fn matmul(a: ArrayView2<f64>, b: ArrayView2<f64>) -> Array2<f64> {
    matmul_with(a.nrows(), |i, j| a[[i, j]], b)
}

/// As [`matmul`] with `a` given element-wise by `a(i, j)` (`i < n`, `j <
/// b.nrows()`), so that a row can be formed on the fly; zero entries of `a`
/// are skipped (most of a masked or one-hot row).
pub fn matmul_with(n: usize, a: impl Fn(usize, usize) -> f64, b: ArrayView2<f64>) -> Array2<f64> {
    let (k, m) = b.dim();
    let mut out = Array2::zeros((n, m));
    let mut sums = vec![0.0; m];
    let mut compensations = vec![0.0; m];
    for i in 0..n {
        sums.fill(0.0);
        compensations.fill(0.0);
        for j in 0..k {
            let x = a(i, j);
            if x == 0.0 {
                continue;
            }
            let row = b.row(j);
            let owned;
            let row = match row.as_slice() {
                Some(r) => r,
                None => {
                    owned = row.to_vec();
                    &owned
                }
            };
            for ((s, c), &y) in sums.iter_mut().zip(compensations.iter_mut()).zip(row) {
                let (t, e) = two_sum(*s, x * y);
                *s = t;
                *c += e;
            }
        }
        for ((o, &s), &c) in out.row_mut(i).iter_mut().zip(&sums).zip(&compensations) {
            *o = if s.is_finite() { s + c } else { s };
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compensated_sums_recover_what_plain_sums_lose() {
        // 1 + 1e6 terms of 1e-16: a plain sum stays 1.0.
        let xs = std::iter::once(1.0).chain(std::iter::repeat_n(1e-16, 1_000_000));
        let plain: f64 = xs.clone().sum();
        assert_eq!(plain, 1.0);
        assert!((sum(xs) - (1.0 + 1e-10)).abs() <= 2.0 * f64::EPSILON);
        assert_eq!(sum([1e100, 1.0, -1e100]), 1.0);
        assert_eq!(sum([f64::INFINITY, 1.0]), f64::INFINITY);
    }

    #[test]
    fn matmul_is_the_product() {
        let a = Array2::from_shape_fn((3, 4), |(i, j)| (i * 4 + j) as f64 - 5.0);
        let b = Array2::from_shape_fn((4, 2), |(j, k)| (j + 2 * k) as f64 * 0.5);
        assert_eq!(matmul(a.view(), b.view()), a.dot(&b));
    }
}
