//! Matrix products through the `gemm` crate (the f32 kernels candle-core
//! uses), behind one safe function.

use ndarray::{ArrayView2, ArrayViewMut2};

/// Whether a product may use the rayon thread pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Threads {
    /// Every thread of the current rayon pool.
    All,
    /// The calling thread only (inside work that is already parallel).
    One,
}

/// `dst = lhs @ rhs` (or `dst += lhs @ rhs` with `accumulate`): `lhs: [m,
/// k]`, `rhs: [k, n]`, `dst: [m, n]`, any strides (a transposed view is a
/// free `.t()`).
///
/// # Panics
/// If the shapes do not chain (a bug in the caller: every public kernel
/// checks its inputs' shapes first).
pub fn matmul(
    mut dst: ArrayViewMut2<f32>,
    lhs: ArrayView2<f32>,
    rhs: ArrayView2<f32>,
    accumulate: bool,
    threads: Threads,
) {
    let (m, k) = lhs.dim();
    let (k2, n) = rhs.dim();
    assert!(
        k == k2 && dst.dim() == (m, n),
        "matmul: [{m}, {k}] x [{k2}, {n}] into {:?}",
        dst.shape()
    );
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            dst.fill(0.0);
        }
        return;
    }
    let parallelism = match threads {
        Threads::All => gemm::Parallelism::Rayon(0),
        Threads::One => gemm::Parallelism::None,
    };
    let (ds, ls, rs) = (dst.strides(), lhs.strides(), rhs.strides());
    let (ds, ls, rs) = ([ds[0], ds[1]], [ls[0], ls[1]], [rs[0], rs[1]]);
    // SAFETY: the three pointers and strides come from ndarray views, so every
    // element (i, j) of each matrix within the given dimensions is valid memory
    // for reads (lhs, rhs) or writes (dst); `dst` is a unique borrow, so it
    // cannot alias `lhs` or `rhs`; a mutable view never has a zero stride, so
    // no two elements of `dst` overlap. gemm computes
    // dst := alpha dst + beta lhs rhs, reading dst only when `read_dst`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            ds[1],
            ds[0],
            accumulate,
            lhs.as_ptr(),
            ls[1],
            ls[0],
            rhs.as_ptr(),
            rs[1],
            rs[0],
            1.0f32,
            1.0f32,
            false,
            false,
            false,
            parallelism,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::Array2;

    #[test]
    fn products_and_transposes_match_plain_sums() {
        let a = Array2::from_shape_fn((7, 5), |(i, j)| (i * 5 + j) as f32 * 0.5 - 3.0);
        let b = Array2::from_shape_fn((9, 5), |(i, j)| ((i * 3 + j * 7) % 11) as f32 - 5.0);
        let mut c = Array2::from_elem((7, 9), 2.0f32);
        matmul(c.view_mut(), a.view(), b.t(), true, Threads::All);
        for i in 0..7 {
            for j in 0..9 {
                let want: f32 = 2.0 + (0..5).map(|p| a[[i, p]] * b[[j, p]]).sum::<f32>();
                assert_eq!(c[[i, j]], want, "({i}, {j})");
            }
        }
        matmul(c.view_mut(), a.view(), b.t(), false, Threads::One);
        assert_eq!(c, a.dot(&b.t()));
        let mut z = Array2::from_elem((7, 9), 1.0f32);
        matmul(
            z.view_mut(),
            a.slice(ndarray::s![.., ..0]),
            b.t().slice(ndarray::s![..0, ..]),
            false,
            Threads::All,
        );
        assert!(z.iter().all(|&x| x == 0.0));
    }
}
