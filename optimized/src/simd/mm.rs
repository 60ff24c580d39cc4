//! The register-blocked `f32` matrix products of the tile kernels (the
//! attention tiles, the loss kernels' row blocks): `C += A B`, `C += A^T B`,
//! `C = alpha (A B)`, each element's terms summed in one fixed order.

use pulp::Simd;

/// Rows of the register block of [`mm_acc`] for this vector width.
#[inline(always)]
fn block_rows<S: Simd>() -> usize {
    if S::F32_LANES >= 16 {
        4
    } else {
        2
    }
}

/// The multiple that the columns `n` of [`mm_acc`] must be: 4 vectors.
#[inline(always)]
pub fn mm_col_multiple<S: Simd>() -> usize {
    4 * S::F32_LANES
}

/// `C[m, n] += A[m, k] B[k, n]`, all row-major with leading dimensions
/// `lda`, `ldb`, `ldc`. `m` must be a multiple of 4 and `n` of the vector
/// width (callers pad their tiles with zeros); columns past the last multiple
/// of [`mm_col_multiple`] go one vector at a time.
///
/// Each `C[i, j]` gets `A[i, p] B[p, j]` added for `p = 0, 1, ..., k - 1` in
/// that order, one fused multiply-add each.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub fn mm_acc<S: Simd>(
    simd: S,
    m: usize,
    n: usize,
    k: usize,
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
    c: &mut [f32],
    ldc: usize,
) {
    debug_assert!(m.is_multiple_of(4) && n.is_multiple_of(S::F32_LANES));
    if block_rows::<S>() == 4 {
        mm_block::<S, 4, false>(simd, (m, n, k), (a, lda), (b, ldb), (c, ldc), None);
    } else {
        mm_block::<S, 2, false>(simd, (m, n, k), (a, lda), (b, ldb), (c, ldc), None);
    }
}

/// `C[m, n] = alpha (A[m, k] B[k, n])`, shapes and leading dimensions as
/// [`mm_acc`] (`C`'s previous values are not read): each product summed
/// from 0 in [`mm_acc`]'s order, then multiplied by `alpha`, the bits of
/// zeroing `C`, [`mm_acc`] and [`scale`]. The attention forward's scaled
/// scores `S^T = scale K Q^T`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub fn mm_scaled<S: Simd>(
    simd: S,
    (m, n, k): (usize, usize, usize),
    (a, lda): (&[f32], usize),
    (b, ldb): (&[f32], usize),
    (c, ldc): (&mut [f32], usize),
    alpha: f32,
) {
    debug_assert!(m.is_multiple_of(4) && n.is_multiple_of(S::F32_LANES));
    if block_rows::<S>() == 4 {
        mm_block::<S, 4, false>(simd, (m, n, k), (a, lda), (b, ldb), (c, ldc), Some(alpha));
    } else {
        mm_block::<S, 2, false>(simd, (m, n, k), (a, lda), (b, ldb), (c, ldc), Some(alpha));
    }
}

/// [`mm_acc`] with `A` stored transposed: `C[m, n] += A^T[m, k] B[k, n]`
/// for `a: [k, m]` row-major with leading dimension `lda` (`A^T[i, p] =
/// a[p * lda + i]`), the same order of terms. The attention forward's `O +=
/// P V` reads `P` from the transposed tile `P^T: [keys, queries]` this
/// way, in place.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub fn mm_acc_at<S: Simd>(
    simd: S,
    m: usize,
    n: usize,
    k: usize,
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
    c: &mut [f32],
    ldc: usize,
) {
    debug_assert!(m.is_multiple_of(4) && n.is_multiple_of(S::F32_LANES));
    if block_rows::<S>() == 4 {
        mm_block::<S, 4, true>(simd, (m, n, k), (a, lda), (b, ldb), (c, ldc), None);
    } else {
        mm_block::<S, 2, true>(simd, (m, n, k), (a, lda), (b, ldb), (c, ldc), None);
    }
}

/// `A[i, p]` of [`mm_acc`] (`AT`: of [`mm_acc_at`]).
#[inline(always)]
fn a_at<const AT: bool>(a: &[f32], lda: usize, i: usize, p: usize) -> f32 {
    if AT {
        a[p * lda + i]
    } else {
        a[i * lda + p]
    }
}

#[inline(always)]
fn mm_block<S: Simd, const MR: usize, const AT: bool>(
    simd: S,
    (m, n, k): (usize, usize, usize),
    (a, lda): (&[f32], usize),
    (b, ldb): (&[f32], usize),
    (c, ldc): (&mut [f32], usize),
    set: Option<f32>,
) {
    let w = mm_col_multiple::<S>();
    for i0 in (0..m).step_by(MR) {
        for j0 in (0..n / w * w).step_by(w) {
            let mut acc = [[simd.splat_f32s(0.0); 4]; MR];
            if set.is_none() {
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    let row = &c[(i0 + r) * ldc + j0..(i0 + r) * ldc + j0 + w];
                    let (v, _) = S::as_simd_f32s(row);
                    acc_r.copy_from_slice(&v[..4]);
                }
            }
            for p in 0..k {
                let (bv, _) = S::as_simd_f32s(&b[p * ldb + j0..p * ldb + j0 + w]);
                let (b0, b1, b2, b3) = (bv[0], bv[1], bv[2], bv[3]);
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    let av = simd.splat_f32s(a_at::<AT>(a, lda, i0 + r, p));
                    acc_r[0] = simd.mul_add_f32s(av, b0, acc_r[0]);
                    acc_r[1] = simd.mul_add_f32s(av, b1, acc_r[1]);
                    acc_r[2] = simd.mul_add_f32s(av, b2, acc_r[2]);
                    acc_r[3] = simd.mul_add_f32s(av, b3, acc_r[3]);
                }
            }
            if let Some(alpha) = set {
                let alpha = simd.splat_f32s(alpha);
                for acc_r in &mut acc {
                    for x in acc_r.iter_mut() {
                        *x = simd.mul_f32s(*x, alpha);
                    }
                }
            }
            for (r, acc_r) in acc.iter().enumerate() {
                let row = &mut c[(i0 + r) * ldc + j0..(i0 + r) * ldc + j0 + w];
                let (v, _) = S::as_mut_simd_f32s(row);
                v[..4].copy_from_slice(acc_r);
            }
        }
        let lanes = S::F32_LANES;
        for j0 in (n / w * w..n).step_by(lanes) {
            mm_column::<S, MR, AT>(simd, (i0, j0), k, (a, lda), (b, ldb), (&mut *c, ldc), set);
        }
    }
}

/// The rows `i0..i0 + MR` of one vector of columns `j0..j0 + lanes` of
/// [`mm_acc`] (the columns past its 4-vector blocks), in the same order of
/// terms.
#[inline(always)]
fn mm_column<S: Simd, const MR: usize, const AT: bool>(
    simd: S,
    (i0, j0): (usize, usize),
    k: usize,
    (a, lda): (&[f32], usize),
    (b, ldb): (&[f32], usize),
    (c, ldc): (&mut [f32], usize),
    set: Option<f32>,
) {
    let lanes = S::F32_LANES;
    let mut acc = [simd.splat_f32s(0.0); MR];
    if set.is_none() {
        for (r, acc_r) in acc.iter_mut().enumerate() {
            let (v, _) = S::as_simd_f32s(&c[(i0 + r) * ldc + j0..(i0 + r) * ldc + j0 + lanes]);
            *acc_r = v[0];
        }
    }
    for p in 0..k {
        let (bv, _) = S::as_simd_f32s(&b[p * ldb + j0..p * ldb + j0 + lanes]);
        for (r, acc_r) in acc.iter_mut().enumerate() {
            let av = simd.splat_f32s(a_at::<AT>(a, lda, i0 + r, p));
            *acc_r = simd.mul_add_f32s(av, bv[0], *acc_r);
        }
    }
    for (r, acc_r) in acc.iter().enumerate() {
        let (v, _) = S::as_mut_simd_f32s(&mut c[(i0 + r) * ldc + j0..(i0 + r) * ldc + j0 + lanes]);
        v[0] = match set {
            Some(alpha) => simd.mul_f32s(*acc_r, simd.splat_f32s(alpha)),
            None => *acc_r,
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simd::{arch, lanes};
    use pulp::WithSimd;

    #[test]
    fn mm_acc_matches_plain_sums_bit_for_bit_whatever_the_tile_width() {
        /// Which product: `mm_acc`, `mm_acc_at` (A passed transposed) or
        /// `mm_scaled` by 0.375.
        #[derive(Clone, Copy, Debug, PartialEq)]
        enum Kind {
            Acc,
            TransposedA,
            Scaled,
        }
        struct Op<'a> {
            kind: Kind,
            m: usize,
            n: usize,
            k: usize,
            a: &'a [f32],
            c: &'a mut [f32],
            b: &'a [f32],
        }
        impl WithSimd for Op<'_> {
            type Output = ();
            #[inline(always)]
            fn with_simd<S: Simd>(self, simd: S) {
                let (m, n, k) = (self.m, self.n, self.k);
                match self.kind {
                    Kind::Acc => mm_acc(simd, m, n, k, self.a, k, self.b, n, self.c, n),
                    Kind::TransposedA => mm_acc_at(simd, m, n, k, self.a, m, self.b, n, self.c, n),
                    Kind::Scaled => mm_scaled(
                        simd,
                        (m, n, k),
                        (self.a, k),
                        (self.b, n),
                        (self.c, n),
                        0.375,
                    ),
                }
            }
        }
        let w = 4 * lanes();
        let l = lanes();
        // Whole 4-vector blocks, then single vectors past them (n = l, w + l, 3 l).
        for kind in [Kind::Acc, Kind::TransposedA, Kind::Scaled] {
            for (m, n, k) in [
                (4, w, 3),
                (8, 2 * w, 17),
                (12, w, 64),
                (4, l, 5),
                (8, w + l, 9),
                (4, 3 * l, 64),
            ] {
                let a: Vec<f32> = (0..m * k)
                    .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
                    .collect();
                let b: Vec<f32> = (0..k * n)
                    .map(|i| ((i * 53 % 89) as f32 - 44.0) / 3.0)
                    .collect();
                let c0: Vec<f32> = (0..m * n).map(|i| i as f32 * 0.25).collect();
                let want: Vec<f32> = (0..m * n)
                    .map(|idx| {
                        let (i, j) = (idx / n, idx % n);
                        let start = if kind == Kind::Scaled { 0.0 } else { c0[idx] };
                        let sum =
                            (0..k).fold(start, |acc, p| a[i * k + p].mul_add(b[p * n + j], acc));
                        if kind == Kind::Scaled {
                            sum * 0.375
                        } else {
                            sum
                        }
                    })
                    .collect();
                // `mm_acc_at` reads A^T: a `[k, m]` array.
                let at: Vec<f32> = (0..k * m).map(|idx| a[(idx % m) * k + idx / m]).collect();
                let mut c = c0.clone();
                arch().dispatch(Op {
                    kind,
                    m,
                    n,
                    k,
                    a: if kind == Kind::TransposedA { &at } else { &a },
                    b: &b,
                    c: &mut c,
                });
                assert_eq!(c, want, "{kind:?} m {m} n {n} k {k}");
            }
        }
    }
}
