//! The register-blocked `f32` matrix products of the tile kernels (the
//! attention tiles, the loss kernels' row blocks): `C += A B`, `C += A^T B`,
//! `C = alpha (A B)`, each element's terms summed in one fixed order.

use pulp::Simd;

/// The multiple that the columns `n` of [`mm_acc`] must be: 4 vectors.
#[inline(always)]
pub fn mm_col_multiple<S: Simd>() -> usize {
    4 * S::F32_LANES
}

/// `C[m, n] += A[m, k] B[k, n]`, all row-major with leading dimensions
/// `lda`, `ldb`, `ldc`. `m` must be a multiple of 4 and `n` of the vector
/// width (callers pad their tiles with zeros). Register blocks: with
/// AVX-512, 8 rows by 2 vectors (the last rows 4, the last columns one
/// vector); narrower vectors 2 rows by 4 vectors.
///
/// # Panics
/// If `m` is not a multiple of 4 or `n` of the vector width, or `A` or `B`
/// is shorter than its leading dimension and shape say (the products read
/// them unchecked after one overflow-checked test per block).
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
    assert!(m.is_multiple_of(4) && n.is_multiple_of(S::F32_LANES));
    mm_block::<S, false>(simd, (m, n, k), (a, lda), (b, ldb), (c, ldc), None);
}

/// `C[m, n] = alpha (A[m, k] B[k, n])`, shapes and leading dimensions as
/// [`mm_acc`] (`C`'s previous values are not read): each product summed
/// from 0 in [`mm_acc`]'s order, then multiplied by `alpha`, the bits of
/// zeroing `C`, [`mm_acc`] and [`scale`](crate::simd::scale). The attention forward's scaled
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
    assert!(m.is_multiple_of(4) && n.is_multiple_of(S::F32_LANES));
    mm_block::<S, false>(simd, (m, n, k), (a, lda), (b, ldb), (c, ldc), Some(alpha));
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
    assert!(m.is_multiple_of(4) && n.is_multiple_of(S::F32_LANES));
    mm_block::<S, true>(simd, (m, n, k), (a, lda), (b, ldb), (c, ldc), None);
}

/// The products of [`mm_acc`], [`mm_acc_at`] and [`mm_scaled`], in register
/// blocks of at most 16 accumulators (AVX-512 has 32 registers, AVX2 16).
///
/// With AVX-512, 8 rows at a time (the last 4, [`mm_rows`]), their columns
/// 2 vectors at a time, then the vector past them: on one core of issue 37's
/// Intel VM, 64-cubed products ran at 153-157 GFLOP/s in 8 x 2 blocks
/// against 146-150 in 4 x 4 blocks (operands in L1; 148-152 against 132-138
/// from L2), and a block of 16 to 48 columns (a segment's last query block)
/// at 122-158 where 4 x 4 blocks left it one vector at a time (102-104).
/// Narrower vectors: 2 rows by 4 vectors, then the columns past them
/// ([`mm_narrow`]).
#[inline(always)]
fn mm_block<S: Simd, const AT: bool>(
    simd: S,
    (m, n, k): (usize, usize, usize),
    (a, lda): (&[f32], usize),
    (b, ldb): (&[f32], usize),
    (c, ldc): (&mut [f32], usize),
    set: Option<f32>,
) {
    if S::F32_LANES >= 16 {
        let mut i0 = 0;
        while i0 + 8 <= m {
            mm_rows::<S, 8, AT>(simd, (i0, n, k), (a, lda), (b, ldb), (&mut *c, ldc), set);
            i0 += 8;
        }
        if i0 < m {
            mm_rows::<S, 4, AT>(simd, (i0, n, k), (a, lda), (b, ldb), (c, ldc), set);
        }
        return;
    }
    let w = mm_col_multiple::<S>();
    let full = n / w * w;
    for i0 in (0..m).step_by(2) {
        for j0 in (0..full).step_by(w) {
            mm_tile::<S, 2, 4, AT>(simd, (i0, j0), k, (a, lda), (b, ldb), (&mut *c, ldc), set);
        }
    }
    let (mn, rest, cc) = ((m, full, k), (a, lda, b, ldb), (c, ldc));
    match (n - full) / S::F32_LANES {
        0 => {}
        1 => mm_narrow::<S, 4, 2, 1, AT>(simd, mn, rest, cc, set),
        2 => mm_narrow::<S, 4, 2, 2, AT>(simd, mn, rest, cc, set),
        _ => mm_narrow::<S, 2, 2, 3, AT>(simd, mn, rest, cc, set),
    }
}

/// The rows `i0..i0 + MR` of every column, 2 vectors at a time, then the
/// vector past them (if any): [`mm_block`] with AVX-512, a block of `A`'s
/// rows used for every column while it is in the cache.
#[inline(always)]
fn mm_rows<S: Simd, const MR: usize, const AT: bool>(
    simd: S,
    (i0, n, k): (usize, usize, usize),
    (a, lda): (&[f32], usize),
    (b, ldb): (&[f32], usize),
    (c, ldc): (&mut [f32], usize),
    set: Option<f32>,
) {
    let pair = 2 * S::F32_LANES;
    let paired = n / pair * pair;
    for j0 in (0..paired).step_by(pair) {
        mm_tile::<S, MR, 2, AT>(simd, (i0, j0), k, (a, lda), (b, ldb), (&mut *c, ldc), set);
    }
    if n > paired {
        mm_tile::<S, MR, 1, AT>(simd, (i0, paired), k, (a, lda), (b, ldb), (c, ldc), set);
    }
}

/// The `NV` vectors of columns from `j0` (past the 4-vector blocks of
/// narrower vectors) of every row, `MR` rows at a time and the last rows
/// `MT` at a time: more rows than the 4-vector blocks' 2, so that one load
/// of `B` serves more multiply-adds.
#[inline(always)]
fn mm_narrow<S: Simd, const MR: usize, const MT: usize, const NV: usize, const AT: bool>(
    simd: S,
    (m, j0, k): (usize, usize, usize),
    (a, lda, b, ldb): (&[f32], usize, &[f32], usize),
    (c, ldc): (&mut [f32], usize),
    set: Option<f32>,
) {
    let mut i0 = 0;
    while i0 + MR <= m {
        mm_tile::<S, MR, NV, AT>(simd, (i0, j0), k, (a, lda), (b, ldb), (&mut *c, ldc), set);
        i0 += MR;
    }
    while i0 < m {
        mm_tile::<S, MT, NV, AT>(simd, (i0, j0), k, (a, lda), (b, ldb), (&mut *c, ldc), set);
        i0 += MT;
    }
}

/// The rows `i0..i0 + MR` and the `NV` vectors of columns from `j0` of the
/// product, in registers: `C[i, j] (+)= A[i, p] B[p, j]` for `p = 0, 1, ...,
/// k - 1` in that order, one fused multiply-add each (then times `alpha`
/// where `set` is `Some(alpha)`, `C`'s old values unread).
#[inline(always)]
fn mm_tile<S: Simd, const MR: usize, const NV: usize, const AT: bool>(
    simd: S,
    (i0, j0): (usize, usize),
    k: usize,
    (a, lda): (&[f32], usize),
    (b, ldb): (&[f32], usize),
    (c, ldc): (&mut [f32], usize),
    set: Option<f32>,
) {
    let width = NV * S::F32_LANES;
    let mut acc = [[simd.splat_f32s(0.0); NV]; MR];
    if set.is_none() {
        for (r, acc_r) in acc.iter_mut().enumerate() {
            let row = &c[(i0 + r) * ldc + j0..(i0 + r) * ldc + j0 + width];
            let (v, _) = S::as_simd_f32s(row);
            acc_r.copy_from_slice(&v[..NV]);
        }
    }
    // The loop reads unchecked (index checks and their registers were half
    // its instructions once inlined into the attention forward, issue 37):
    // its last index into `A` and into `B` checked here once, without
    // overflow (every other index it reads is smaller).
    if k > 0 {
        let a_last = if AT {
            (k - 1)
                .checked_mul(lda)
                .and_then(|x| x.checked_add(i0 + MR - 1))
        } else {
            (i0 + MR - 1)
                .checked_mul(lda)
                .and_then(|x| x.checked_add(k - 1))
        };
        let b_end = (k - 1)
            .checked_mul(ldb)
            .and_then(|x| x.checked_add(j0 + width));
        assert!(
            a_last.is_some_and(|i| i < a.len()) && b_end.is_some_and(|e| e <= b.len()),
            "a product's operands are shorter than their shape and leading dimensions say"
        );
    }
    let (ap, bp) = (a.as_ptr(), b.as_ptr());
    for p in 0..k {
        let mut bs = [simd.splat_f32s(0.0); NV];
        for (v, bv) in bs.iter_mut().enumerate() {
            // SAFETY: p < k, so the vector's last element is at most
            // (k - 1) ldb + j0 + width - 1, within `b` (checked above);
            // `f32s` is plain data, read unaligned.
            *bv = unsafe {
                bp.add(p * ldb + j0 + v * S::F32_LANES)
                    .cast::<S::f32s>()
                    .read_unaligned()
            };
        }
        for (r, acc_r) in acc.iter_mut().enumerate() {
            let at = if AT {
                p * lda + i0 + r
            } else {
                (i0 + r) * lda + p
            };
            // SAFETY: r < MR and p < k: at most `a_last`, within `a`.
            let av = simd.splat_f32s(unsafe { *ap.add(at) });
            for (x, &bj) in acc_r.iter_mut().zip(&bs) {
                *x = simd.mul_add_f32s(av, bj, *x);
            }
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
        let row = &mut c[(i0 + r) * ldc + j0..(i0 + r) * ldc + j0 + width];
        let (v, _) = S::as_mut_simd_f32s(row);
        v[..NV].copy_from_slice(acc_r);
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
        // Whole 4-vector blocks (2-vector pairs with AVX-512), then single
        // vectors past them (n = l, w + l, 3 l).
        for kind in [Kind::Acc, Kind::TransposedA, Kind::Scaled] {
            for (m, n, k) in [
                (4, w, 3),
                (8, 2 * w, 17),
                (12, w, 64),
                (4, l, 5),
                (8, w + l, 9),
                (4, 3 * l, 64),
                // 8-row blocks then 4 (AVX-512), one vector or pairs past w.
                (16, l, 33),
                (20, w + 2 * l, 5),
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
                // This CPU's widest instruction set, then AVX2 (where it
                // runs) and pulp's scalar one: every register block and
                // leftover-column path, each held to the same sums.
                let a_in = if kind == Kind::TransposedA { &at } else { &a };
                let mut runs: Vec<(&str, Vec<f32>)> = Vec::new();
                let mut c = c0.clone();
                arch().dispatch(Op {
                    kind,
                    m,
                    n,
                    k,
                    a: a_in,
                    b: &b,
                    c: &mut c,
                });
                runs.push(("dispatched", c));
                #[cfg(target_arch = "x86_64")]
                if let Some(v3) = pulp::x86::V3::try_new() {
                    let mut c = c0.clone();
                    Simd::vectorize(
                        v3,
                        Op {
                            kind,
                            m,
                            n,
                            k,
                            a: a_in,
                            b: &b,
                            c: &mut c,
                        },
                    );
                    runs.push(("avx2", c));
                }
                let mut c = c0.clone();
                pulp::Scalar::new().vectorize(Op {
                    kind,
                    m,
                    n,
                    k,
                    a: a_in,
                    b: &b,
                    c: &mut c,
                });
                runs.push(("scalar", c));
                for (isa, c) in runs {
                    assert_eq!(c, want, "{isa}: {kind:?} m {m} n {n} k {k}");
                }
            }
        }
    }

    /// A leading dimension whose last index overflows `usize` is refused
    /// (the bound is checked without wrapping; wrapped, 2^62 rows apart
    /// would pass as a small index and the loop read far outside `a`).
    #[test]
    #[should_panic(expected = "shorter than their shape")]
    fn a_leading_dimension_that_overflows_is_refused() {
        struct Huge<'a>(&'a [f32], &'a [f32], &'a mut [f32]);
        impl WithSimd for Huge<'_> {
            type Output = ();
            #[inline(always)]
            fn with_simd<S: Simd>(self, simd: S) {
                let n = S::F32_LANES;
                mm_acc_at(simd, 4, n, 5, self.0, 1 << 62, self.1, n, self.2, n);
            }
        }
        let (a, b) = (vec![1.0f32; 8], vec![1.0f32; 5 * lanes()]);
        let mut c = vec![0.0f32; 4 * lanes()];
        arch().dispatch(Huge(&a, &b, &mut c));
    }
}
