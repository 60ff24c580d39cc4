//! The value checks of the attention inputs as a pass of their own, one
//! pass over each tensor.
//!
//! Every entry point refuses a non-finite `q`, `k`, `v` (and `grad_output`)
//! naming the first flat index, and the boundary bounds the scores by
//! `d max|q| max|k|` (`packshard_reference::attention::check_score_bound`).
//! [`finite_amax`] finds both in one pass split over the threads (issue 37:
//! through the Python package, a 16,000-token forward read `q`, `k` and `v`
//! three times for finiteness and `q` and `k` once more for the bound, in
//! f64 on one thread, about a third of its time). The varlen kernels need
//! it only as a fallback: their gathers see the values they read
//! ([`super::Seen`]), and this pass runs where those did not read every
//! element or some check refused the call.

use ndarray::ArrayView3;
use packshard_reference::{Error, Result};
use pulp::{Simd, WithSimd};
use rayon::prelude::*;

use super::{Element, Item};

/// Elements per parallel piece of [`finite_amax`]: 256 KiB of `f32`, small
/// enough to balance two threads on one head's tensor, large enough that
/// the split costs nothing next to the pass.
const PIECE: usize = 1 << 16;

/// `max |x|` over `x` and whether every element is finite, one lane-wise
/// pass: `z = fma(x, 0, z)` stays 0 unless some `x` is infinite or NaN (then
/// `z` is NaN from then on), and the maximum of `|x|` is exact (no rounding
/// in `abs` or `max`).
struct Piece<'a>(&'a [f32]);

impl WithSimd for Piece<'_> {
    type Output = (bool, f32);
    #[inline(always)]
    fn with_simd<S: Simd>(self, simd: S) -> (bool, f32) {
        let (head, tail) = S::as_simd_f32s(self.0);
        let zero = simd.splat_f32s(0.0);
        let (mut z, mut m) = (zero, zero);
        for &x in head {
            z = simd.mul_add_f32s(x, zero, z);
            m = simd.max_f32s(m, simd.abs_f32s(x));
        }
        let (mut zt, mut mt) = (simd.reduce_sum_f32s(z), simd.reduce_max_f32s(m));
        for &x in tail {
            zt += x * 0.0;
            mt = mt.max(x.abs());
        }
        (zt == 0.0, mt)
    }
}

/// `max |x|` over the elements of `x` (0 when empty), after refusing a
/// non-finite one: one pass, split over rayon's threads, lane-wise where `x`
/// is `f32` in standard layout.
///
/// # Errors
/// [`Error::NonFiniteInput`] naming `field` and the first non-finite
/// element's flat (row-major) index, as [`check_finite`].
pub fn finite_amax<T: Element>(field: &str, x: &ArrayView3<T>) -> Result<f32> {
    let pieces = match (x.as_slice(), x.as_slice().and_then(|s| T::as_f32(s))) {
        (_, Some(flat)) => {
            let arch = pulp::Arch::new();
            flat.par_chunks(PIECE)
                .map(|p| arch.dispatch(Piece(p)))
                .reduce(|| (true, 0.0), |a, b| (a.0 && b.0, a.1.max(b.1)))
        }
        (Some(flat), None) => flat
            .par_chunks(PIECE)
            .map(|p| {
                p.iter().fold((true, 0.0f32), |(ok, m), v| {
                    let v = v.to_f32();
                    (ok & v.is_finite(), m.max(v.abs()))
                })
            })
            .reduce(|| (true, 0.0), |a, b| (a.0 && b.0, a.1.max(b.1))),
        (None, _) => x.iter().fold((true, 0.0f32), |(ok, m), v| {
            let v = v.to_f32();
            (ok & v.is_finite(), m.max(v.abs()))
        }),
    };
    match pieces {
        (true, m) => Ok(m),
        (false, _) => Err(first_non_finite(field, x)),
    }
}

/// Checks that every element is finite ([`finite_amax`] without the
/// maximum).
///
/// # Errors
/// [`Error::NonFiniteInput`] naming `field` with the flat index.
pub fn check_finite<T: Element>(field: &str, x: &ArrayView3<T>) -> Result<()> {
    finite_amax(field, x).map(|_| ())
}

/// The error for the first non-finite element of `x` in row-major order
/// (`x` has one: [`finite_amax`] found it).
fn first_non_finite<T: Element>(field: &str, x: &ArrayView3<T>) -> Error {
    let found = x.iter().enumerate().find(|(_, v)| !v.to_f32().is_finite());
    let (index, v) = found.expect("a tensor that is not all finite has a non-finite value");
    Error::NonFiniteInput {
        field: field.into(),
        index,
        value: v.to_f32() as f64,
    }
}

/// The bits of `|x|` (the sign cleared): their maximum over a tensor is the
/// bits of its largest magnitude, and at least [`NON_FINITE_BITS`] when
/// some element is infinite or NaN. What the gathers see of their rows
/// ([`Seen`]), at the cost of an integer maximum per element read.
#[inline(always)]
pub(super) fn magnitude_bits(x: f32) -> u32 {
    x.to_bits() & 0x7fff_ffff
}

/// `f32::INFINITY`'s bits: a [`magnitude_bits`] at or over it is a
/// non-finite value.
pub(super) const NON_FINITE_BITS: u32 = 0x7f80_0000;

/// What the gathers of one call read of `q`, `k`, `v` (and, in a backward,
/// `grad_output`): the largest [`magnitude_bits`] of each, and whether they
/// read every element of each (every row of every head belongs to some
/// item; segments without queries or keys, and keys past `seqused_k`, are
/// read by none). The varlen kernels' value checks (f32 and bf16, in place
/// or through the boundary), made by the pass that reads the values anyway
/// (issue 37: a separate pass over `q`, `k`, `v` cost 6 % of the forward).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Seen {
    pub(crate) bits: [u32; 4],
    pub(crate) every_element: bool,
}

impl Seen {
    /// `max |x|` of `q`, `k`, `v`, `grad_output` (0 where not read) when
    /// every element was read and each is finite; `None` otherwise (then
    /// only a full pass can say which value is bad, or whether one is).
    pub(crate) fn amax(&self) -> Option<[f32; 4]> {
        (self.every_element && self.bits.iter().all(|&b| b < NON_FINITE_BITS))
            .then(|| self.bits.map(f32::from_bits))
    }

    pub(super) fn of(
        bits: [u32; 4],
        items: &[Item],
        (n_q, n_k): (usize, usize),
        (h, h_kv): (usize, usize),
    ) -> Self {
        // Items own disjoint (query rows, head) pairs; a group's query
        // heads share its key rows, counted once (its first head's item).
        let group = h / h_kv.max(1);
        let q_rows: usize = items.iter().map(|it| it.q_len).sum();
        let k_rows: usize = items
            .iter()
            .filter(|it| it.head % group.max(1) == 0)
            .map(|it| it.k_len)
            .sum();
        Seen {
            bits,
            every_element: q_rows == n_q * h && k_rows == n_k * h_kv,
        }
    }
}

pub(super) fn max_bits<const N: usize>(a: [u32; N], b: [u32; N]) -> [u32; N] {
    std::array::from_fn(|i| a[i].max(b[i]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;
    use ndarray::Array3;

    /// The pass reads every element of every piece: a bad value anywhere in
    /// a tensor of several pieces and a tail past the last whole vector (the
    /// first, a middle one, the last) is found and named by its flat index
    /// (the first of two), in standard and permuted layouts, f32 and bf16.
    #[test]
    fn every_element_is_checked_and_the_first_bad_one_named() {
        let (n, h, d) = (PIECE / 24 + 37, 3, 8); // 2 pieces, the last ending in 8 past its vectors
        let len = n * h * d;
        let base = Array3::from_shape_fn((n, h, d), |(i, a, c)| {
            ((i * 7 + a * 3 + c) % 23) as f32 * 0.25 - 2.5
        });
        let m = base.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        assert_eq!(finite_amax("q", &base.view()).unwrap(), m);
        for at in [0, PIECE - 1, PIECE, len / 2, len - 5, len - 1] {
            for bad in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
                let mut x = base.clone();
                x.as_slice_mut().unwrap()[at] = bad;
                if at > 0 {
                    x.as_slice_mut().unwrap()[len - 1] = f32::NAN;
                }
                for e in [
                    finite_amax("k", &x.view()).unwrap_err(),
                    finite_amax("k", &x.mapv(bf16::from_f32).view()).unwrap_err(),
                ] {
                    match e {
                        Error::NonFiniteInput { field, index, .. } => {
                            assert_eq!((field.as_str(), index), ("k", at), "at {at}, {bad}")
                        }
                        other => panic!("{other}"),
                    }
                }
                // A permuted view is scanned in its logical order.
                let t = x.view().reversed_axes();
                let logical = t.iter().position(|v| !v.is_finite()).unwrap();
                match finite_amax("v", &t).unwrap_err() {
                    Error::NonFiniteInput { index, .. } => assert_eq!(index, logical),
                    other => panic!("{other}"),
                }
            }
        }
    }

    /// The maximum is exact and its sign ignored wherever it sits (a piece's
    /// vectors, its tail, the bf16 path), and 0 for an empty tensor.
    #[test]
    fn the_maximum_magnitude_is_exact_wherever_it_sits() {
        let (n, h, d) = (PIECE / 7 + 5, 1, 7); // 2 pieces, the last 2 vectors and 1
        let len = n * h * d;
        for at in [3, PIECE + 17, len - 1] {
            let mut x = Array3::from_elem((n, h, d), 0.5f32);
            x.as_slice_mut().unwrap()[at] = -3.0e30;
            assert_eq!(finite_amax("q", &x.view()).unwrap(), 3.0e30);
            let b = x.mapv(bf16::from_f32);
            assert_eq!(
                finite_amax("q", &b.view()).unwrap(),
                bf16::from_f32(3.0e30).to_f32()
            );
        }
        let empty = Array3::<f32>::zeros((0, 2, 8));
        assert_eq!(finite_amax("q", &empty.view()).unwrap(), 0.0);
    }

    /// The forward's and the backward's gathers see every element of `q`,
    /// `k`, `v` (and `grad_output`) where the items cover them, with the
    /// largest magnitude the full pass finds (GQA: a key head read by each
    /// query head of its group, counted once), and say so; where they do not
    /// (`seqused_k` below a segment's keys, a segment without keys), `Seen`
    /// says so and gives no maximum.
    #[test]
    fn the_kernels_reads_see_every_element_or_say_they_did_not() {
        use super::super::{varlen_backward_seen, varlen_forward_seen};
        use packshard_reference::ops::Varlen;
        let (n, d) = (70, 8);
        let t = |h: usize, o: usize| {
            Array3::from_shape_fn((n, h, d), |(i, a, c)| {
                ((i * 13 + a * 5 + c * 3 + o) % 29) as f32 * 0.125 - 1.75
            })
        };
        let cu = [0, 3, 3, 70];
        for (h, h_kv) in [(2, 2), (4, 2), (4, 1)] {
            let (q, k, v, go) = (t(h, 0), t(h_kv, 1), t(h_kv, 2), t(h, 3));
            let mut k = k;
            k[[60, h_kv - 1, 7]] = -9.5; // the largest |k|, in the last key head
            let want = [&q, &k, &v, &go].map(|x| finite_amax("x", &x.view()).unwrap());
            let p = Varlen::new(&cu, true, 0.3);
            let x = (&q.view(), &k.view(), &v.view());
            let (fwd, seen) = varlen_forward_seen(x, &p).unwrap();
            assert_eq!(
                seen.amax(),
                Some([want[0], want[1], want[2], 0.0]),
                "h {h} h_kv {h_kv}"
            );
            let (_, seen) = varlen_backward_seen(x, &p, &fwd, &go.view()).unwrap();
            assert_eq!(seen.amax(), Some(want), "h {h} h_kv {h_kv}");
            // A non-finite value is seen as one.
            let mut bad = v.clone();
            bad[[40, 0, 2]] = f32::NAN;
            let (_, seen) = varlen_forward_seen((&q.view(), &k.view(), &bad.view()), &p).unwrap();
            assert!(seen.every_element && seen.bits[2] >= NON_FINITE_BITS && seen.amax().is_none());
            // Keys past seqused_k are not read: no maximum claimed.
            let used = [3, 0, 60];
            let p = Varlen {
                seqused_k: Some(&used),
                ..Varlen::new(&cu, false, 0.3)
            };
            let (_, seen) = varlen_forward_seen(x, &p).unwrap();
            assert!(
                !seen.every_element && seen.amax().is_none(),
                "h {h} h_kv {h_kv}"
            );
        }
    }

    /// Where the kernel reads only part of the keys (`seqused_k`), a bad
    /// value in a key it never reads is still refused by the kernels'
    /// entry points, forward and backward, f32 and bf16, named as the full
    /// pass names it (the fallback of `Seen`).
    #[test]
    fn a_bad_value_the_kernel_never_reads_is_still_refused() {
        use super::super::{varlen_attention_general, varlen_attention_general_backward};
        use packshard_reference::ops::Varlen;
        let t = |o: usize| {
            Array3::from_shape_fn((10, 2, 4), |(i, a, c)| {
                ((i + a * 3 + c * 5 + o) % 9) as f32 * 0.25 - 1.0
            })
        };
        let (q, mut k, v) = (t(0), t(1), t(2));
        let cu = [0, 4, 10];
        let used = [4, 3];
        let p = Varlen {
            seqused_k: Some(&used),
            ..Varlen::new(&cu, true, 0.5)
        };
        let fwd = varlen_attention_general(q.view(), k.view(), v.view(), &p).unwrap();
        k[[8, 1, 2]] = f32::INFINITY; // key 4 of segment 1: past its 3 used keys
        let want = (String::from("k"), (8 * 2 + 1) * 4 + 2);
        let named = |e: Error| match e {
            Error::NonFiniteInput { field, index, .. } => (field, index),
            other => panic!("{other}"),
        };
        let e = varlen_attention_general(q.view(), k.view(), v.view(), &p).unwrap_err();
        assert_eq!(named(e), want);
        let e = varlen_attention_general_backward(q.view(), k.view(), v.view(), &p, &fwd, q.view())
            .unwrap_err();
        assert_eq!(named(e), want);
        let b = |x: &Array3<f32>| x.mapv(bf16::from_f32);
        let e = varlen_attention_general(b(&q).view(), b(&k).view(), b(&v).view(), &p).unwrap_err();
        assert_eq!(named(e), want);
    }
}
