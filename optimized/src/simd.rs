//! SIMD building blocks written once over [`pulp::Simd`] and dispatched at
//! run time ([`pulp::Arch`]: AVX-512 or AVX2+FMA on x86-64, a scalar
//! fallback elsewhere).
//!
//! Everything here is `f32`. Functions taking a `simd: S` are
//! `#[inline(always)]` so that they are compiled inside the caller's
//! dispatched (target-feature) context; the `*_slice` helpers at the bottom
//! dispatch by themselves.
//!
//! - [`exp`]: `exp(x)` for `x <= 88`, Cephes' `expf` (Moshier) reduction and
//!   degree-6 polynomial, about 1 ulp; exactly 0 below -87 (and for `-inf`),
//!   so masked scores give probabilities of exactly 0.
//! - [`erf`]: the rational approximation of XLA's `ErfImpl32` / Eigen's
//!   `generic_fast_erf_float` (odd degree-13 numerator, even degree-8
//!   denominator on `[-4, 4]`), within a few ulp of `erff` (checked in the tests).
//! - [`mm_acc`]: `C += A B` on row-major tiles with register blocking (8 rows
//!   x 2 vectors with AVX-512, 2 rows x 4 vectors narrower), the inner product
//!   of the attention tiles.
//!
//! Each output element of [`mm_acc`] is accumulated over the inner dimension
//! in increasing order with one fused multiply-add per term, whatever the
//! tile's other dimensions: the same inputs give bitwise the same result in a
//! varlen tile and in a dense masked tile.
//!
//! **No SIMD code in closures.** pulp compiles the dispatched `with_simd`
//! with the CPU's target features, and every `#[inline(always)]` function
//! inlined into it gets them; a closure's body does not, unless LLVM chooses
//! to inline it, which it did not for the exact GELU (35 times slower, its
//! intrinsics called as functions; issue 37). Lane-wise maps take a
//! [`LaneFn`]; loops are written out; a thread-local borrow wraps the
//! dispatch, never the reverse (`attention::backward`).

use pulp::{Arch, Simd, WithSimd};

mod mm;
pub use mm::{mm_acc, mm_acc_at, mm_col_multiple, mm_scaled};

/// The best instruction set of this CPU (cheap: feature detection is cached).
#[inline]
pub fn arch() -> Arch {
    Arch::new()
}

/// A name for the instruction set [`arch`] picks: `avx512`, `avx2` or `scalar`.
pub fn arch_name() -> &'static str {
    struct Name;
    impl WithSimd for Name {
        type Output = &'static str;
        #[inline(always)]
        fn with_simd<S: Simd>(self, _simd: S) -> &'static str {
            match S::F32_LANES {
                16 => "avx512",
                8 => "avx2",
                _ => "scalar",
            }
        }
    }
    arch().dispatch(Name)
}

/// Lanes of an `f32` vector on this CPU (16, 8 or 1).
pub fn lanes() -> usize {
    struct Lanes;
    impl WithSimd for Lanes {
        type Output = usize;
        #[inline(always)]
        fn with_simd<S: Simd>(self, _simd: S) -> usize {
            S::F32_LANES
        }
    }
    arch().dispatch(Lanes)
}

const LOG2E: f32 = std::f32::consts::LOG2_E;
/// `ln 2` split so that `n * LN2_HI` is exact for the `n` in range (Cephes).
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// `1.5 * 2^23`: adding it rounds to an integer held in the low mantissa bits.
const ROUND_MAGIC: f32 = 12_582_912.0;
const ROUND_MAGIC_BITS: u32 = 0x4B40_0000;
/// Below this `exp` returns exactly 0 (`exp(-87) = 1.6e-38`, the smallest
/// normal f32 is 1.2e-38; the true values below are subnormal).
const EXP_LOW: f32 = -87.0;
const EXP_HIGH: f32 = 88.0;

/// `exp(x)` lane-wise: `x` clamped to `[-87, 88]`, `n = round(x / ln 2)`,
/// `r = x - n ln 2`, Cephes' polynomial for `e^r`, scaled by `2^n` (through
/// the exponent bits, or `vscalefps` with AVX-512: the same bits); 0 for `x <
/// -87` (including `-inf`). `x` must not be NaN.
#[inline(always)]
pub fn exp<S: Simd>(simd: S, x: S::f32s) -> S::f32s {
    exp_with::<S, true>(simd, x)
}

/// [`exp`] for `x <= 88` (not checked): the same bits there without the
/// clamp at 88 (one instruction of about twenty). For a softmax's shifted
/// scores, which its maximum bounds: the attention forward's are at most
/// its lazy-rescaling margin, 8.
#[inline(always)]
pub fn exp_at_most_88<S: Simd>(simd: S, x: S::f32s) -> S::f32s {
    exp_with::<S, false>(simd, x)
}

/// [`exp`], clamping `x` at 88 where `HIGH`.
#[inline(always)]
fn exp_with<S: Simd, const HIGH: bool>(simd: S, x: S::f32s) -> S::f32s {
    let low = simd.splat_f32s(EXP_LOW);
    let mut xc = simd.max_f32s(x, low);
    if HIGH {
        xc = simd.min_f32s(xc, simd.splat_f32s(EXP_HIGH));
    }
    let magic = simd.splat_f32s(ROUND_MAGIC);
    let t = simd.mul_add_f32s(xc, simd.splat_f32s(LOG2E), magic);
    let n = simd.sub_f32s(t, magic);
    let r = simd.mul_add_f32s(n, simd.splat_f32s(-LN2_HI), xc);
    let r = simd.mul_add_f32s(n, simd.splat_f32s(-LN2_LO), r);
    let mut p = simd.splat_f32s(1.987_569_1e-4);
    p = simd.mul_add_f32s(p, r, simd.splat_f32s(1.398_199_9e-3));
    p = simd.mul_add_f32s(p, r, simd.splat_f32s(8.333_452e-3));
    p = simd.mul_add_f32s(p, r, simd.splat_f32s(4.166_579_6e-2));
    p = simd.mul_add_f32s(p, r, simd.splat_f32s(1.666_666_5e-1));
    p = simd.mul_add_f32s(p, r, simd.splat_f32s(5e-1));
    let r2 = simd.mul_f32s(r, r);
    let y = simd.mul_add_f32s(p, r2, simd.add_f32s(r, simd.splat_f32s(1.0)));
    #[cfg(target_arch = "x86_64")]
    if let Some(y) = scaled_v4(simd, y, n, simd.greater_than_or_equal_f32s(x, low)) {
        return y;
    }
    let too_small = simd.less_than_f32s(x, low);
    // 2^n from the integer in t's low bits: ((n + 127) << 23) as f32 bits.
    let n_bits = simd.sub_u32s(
        simd.transmute_u32s_f32s(t),
        simd.splat_u32s(ROUND_MAGIC_BITS),
    );
    let e = simd.wrapping_dyn_shl_u32s(
        simd.add_u32s(n_bits, simd.splat_u32s(127)),
        simd.splat_u32s(23),
    );
    let y = simd.mul_f32s(y, simd.transmute_f32s_u32s(e));
    simd.select_f32s(too_small, simd.splat_f32s(0.0), y)
}

/// With AVX-512 (`S` is pulp's `V4`), [`exp`]'s last step in one
/// instruction: `y 2^n` where `keep`, 0 elsewhere, by `vscalefps` (with a zeroing
/// mask) in place of building `2^n` from exponent bits and multiplying
/// (four instructions of about twenty replaced by one; the attention forward's softmax is
/// mostly `exp`, issue 37). The same bits: both multiply `y` by the same
/// power of two, exactly or correctly rounded where the result is
/// subnormal. `None` for other `S`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn scaled_v4<S: Simd>(simd: S, y: S::f32s, n: S::f32s, keep: S::m32s) -> Option<S::f32s> {
    use core::any::TypeId;
    use core::arch::x86_64::{__m512, __mmask16};
    use core::mem::{size_of, transmute_copy};
    if TypeId::of::<S>() != TypeId::of::<pulp::x86::V4>()
        || size_of::<S::f32s>() != size_of::<__m512>()
        || size_of::<S::m32s>() != size_of::<__mmask16>()
    {
        return None;
    }
    // SAFETY: `S` is `V4` (its f32 vector is `__m512`'s 64 bytes, its mask
    // `__mmask16`'s 2: checked above), so each copy reads a value of the
    // same size and layout as it writes.
    unsafe {
        let v4: pulp::x86::V4 = transmute_copy(&simd);
        let keep = transmute_copy::<S::m32s, __mmask16>(&keep);
        let (y, n) = (
            transmute_copy::<S::f32s, __m512>(&y),
            transmute_copy::<S::f32s, __m512>(&n),
        );
        let r = v4.avx512f._mm512_maskz_scalef_ps(keep, y, n);
        Some(transmute_copy::<__m512, S::f32s>(&r))
    }
}

/// `erf(x)` lane-wise: XLA's `ErfImpl32` rational approximation on `x`
/// clamped to `[-4, 4]` (outside, `erf` is `±1` in f32).
#[inline(always)]
pub fn erf<S: Simd>(simd: S, x: S::f32s) -> S::f32s {
    let x = simd.min_f32s(
        simd.max_f32s(x, simd.splat_f32s(-4.0)),
        simd.splat_f32s(4.0),
    );
    let x2 = simd.mul_f32s(x, x);
    let mut p = simd.splat_f32s(-2.726_142_3e-10);
    for c in [
        2.770_681_4e-8,
        -2.101_024e-6,
        -5.692_506_4e-5,
        -7.349_906_3e-4,
        -2.954_6e-3,
        -1.609_603_3e-2,
    ] {
        p = simd.mul_add_f32s(x2, p, simd.splat_f32s(c));
    }
    let p = simd.mul_f32s(x, p);
    let mut q = simd.splat_f32s(-1.456_607_2e-5);
    for c in [-2.133_740_6e-4, -1.682_827e-3, -7.373_329e-3, -1.426_474e-2] {
        q = simd.mul_add_f32s(x2, q, simd.splat_f32s(c));
    }
    simd.div_f32s(p, q)
}

const FRAC_1_SQRT_2: f32 = std::f32::consts::FRAC_1_SQRT_2;
/// `1 / sqrt(2 pi)`.
const FRAC_1_SQRT_2PI: f32 = 0.398_942_3;

/// The exact GELU `0.5 x (1 + erf(x / sqrt 2))` lane-wise (BERT's `gelu`).
#[inline(always)]
pub fn gelu<S: Simd>(simd: S, x: S::f32s) -> S::f32s {
    let e = erf(simd, simd.mul_f32s(x, simd.splat_f32s(FRAC_1_SQRT_2)));
    let half_x = simd.mul_f32s(x, simd.splat_f32s(0.5));
    simd.mul_add_f32s(half_x, e, half_x)
}

/// `gelu'(x) = Phi(x) + x phi(x)` lane-wise.
#[inline(always)]
pub fn gelu_grad<S: Simd>(simd: S, x: S::f32s) -> S::f32s {
    let e = erf(simd, simd.mul_f32s(x, simd.splat_f32s(FRAC_1_SQRT_2)));
    let cdf = simd.mul_add_f32s(e, simd.splat_f32s(0.5), simd.splat_f32s(0.5));
    let arg = simd.mul_f32s(simd.mul_f32s(x, x), simd.splat_f32s(-0.5));
    let pdf = simd.mul_f32s(exp(simd, arg), simd.splat_f32s(FRAC_1_SQRT_2PI));
    simd.mul_add_f32s(x, pdf, cdf)
}

/// Loads `xs` (at most one vector's worth) into a vector, the missing lanes
/// set to `fill`.
#[inline(always)]
pub fn load_tail<S: Simd>(simd: S, xs: &[f32], fill: f32) -> S::f32s {
    let mut buf = [fill; 16];
    buf[..xs.len()].copy_from_slice(xs);
    simd.partial_load_f32s(&buf[..S::F32_LANES])
}

/// Stores the first `out.len()` lanes of `v`.
#[inline(always)]
pub fn store_tail<S: Simd>(simd: S, out: &mut [f32], v: S::f32s) {
    let mut buf = [0.0f32; 16];
    simd.partial_store_f32s(&mut buf[..S::F32_LANES], v);
    let n = out.len();
    out.copy_from_slice(&buf[..n]);
}

/// A lane-wise function for [`map_in_place`].
///
/// A trait, not a closure: a closure's body is compiled outside pulp's
/// target-feature context unless LLVM chooses to inline it, and for a large
/// body it does not — the exact GELU (erf's rational function) ran 35 times
/// slower as a closure, its intrinsics called as functions (issue 37). An
/// `#[inline(always)]` method is always inlined into the dispatched code.
pub trait LaneFn<S: Simd> {
    /// `f(x)` lane-wise.
    fn apply(&self, simd: S, x: S::f32s) -> S::f32s;
}

/// `x * a` lane-wise.
pub struct Mul<S: Simd>(pub S::f32s);

impl<S: Simd> LaneFn<S> for Mul<S> {
    #[inline(always)]
    fn apply(&self, simd: S, x: S::f32s) -> S::f32s {
        simd.mul_f32s(x, self.0)
    }
}

/// `exp(x - shift)` lane-wise.
pub struct ExpShift<S: Simd>(pub S::f32s);

impl<S: Simd> LaneFn<S> for ExpShift<S> {
    #[inline(always)]
    fn apply(&self, simd: S, x: S::f32s) -> S::f32s {
        exp(simd, simd.sub_f32s(x, self.0))
    }
}

/// Applies `f` to every vector of `xs` in place (the tail padded with `fill`).
#[inline(always)]
pub fn map_in_place<S: Simd>(simd: S, xs: &mut [f32], fill: f32, f: &impl LaneFn<S>) {
    let (head, tail) = S::as_mut_simd_f32s(xs);
    for x in head {
        *x = f.apply(simd, *x);
    }
    if !tail.is_empty() {
        let v = f.apply(simd, load_tail(simd, tail, fill));
        store_tail(simd, tail, v);
    }
}

/// `sum_i xs[i]` (lane-wise partial sums, then the lanes).
#[inline(always)]
pub fn sum<S: Simd>(simd: S, xs: &[f32]) -> f32 {
    let (head, tail) = S::as_simd_f32s(xs);
    let mut acc = simd.splat_f32s(0.0);
    for &x in head {
        acc = simd.add_f32s(acc, x);
    }
    if !tail.is_empty() {
        acc = simd.add_f32s(acc, load_tail(simd, tail, 0.0));
    }
    simd.reduce_sum_f32s(acc)
}

/// `max_i xs[i]` (`-inf` for an empty slice). No NaN.
#[inline(always)]
pub fn max<S: Simd>(simd: S, xs: &[f32]) -> f32 {
    let (head, tail) = S::as_simd_f32s(xs);
    let mut acc = simd.splat_f32s(f32::NEG_INFINITY);
    for &x in head {
        acc = simd.max_f32s(acc, x);
    }
    if !tail.is_empty() {
        acc = simd.max_f32s(acc, load_tail(simd, tail, f32::NEG_INFINITY));
    }
    simd.reduce_max_f32s(acc)
}

/// `sum_i a[i] b[i]` (equal lengths).
#[inline(always)]
pub fn dot<S: Simd>(simd: S, a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let (ha, ta) = S::as_simd_f32s(a);
    let (hb, tb) = S::as_simd_f32s(b);
    let mut acc = simd.splat_f32s(0.0);
    for (&x, &y) in ha.iter().zip(hb) {
        acc = simd.mul_add_f32s(x, y, acc);
    }
    if !ta.is_empty() {
        acc = simd.mul_add_f32s(load_tail(simd, ta, 0.0), load_tail(simd, tb, 0.0), acc);
    }
    simd.reduce_sum_f32s(acc)
}

/// `y += alpha x` (equal lengths).
#[inline(always)]
pub fn axpy<S: Simd>(simd: S, alpha: f32, x: &[f32], y: &mut [f32]) {
    debug_assert_eq!(x.len(), y.len());
    let a = simd.splat_f32s(alpha);
    let (hx, tx) = S::as_simd_f32s(x);
    let (hy, ty) = S::as_mut_simd_f32s(y);
    for (yv, &xv) in hy.iter_mut().zip(hx) {
        *yv = simd.mul_add_f32s(a, xv, *yv);
    }
    for (yv, &xv) in ty.iter_mut().zip(tx) {
        *yv = alpha.mul_add(xv, *yv);
    }
}

/// `xs *= alpha`.
#[inline(always)]
pub fn scale<S: Simd>(simd: S, alpha: f32, xs: &mut [f32]) {
    map_in_place(simd, xs, 0.0, &Mul(simd.splat_f32s(alpha)));
}

// ---- dispatched slice helpers ------------------------------------------------

/// An element-wise SIMD function, for [`map_slice`].
trait ElementWise {
    fn apply<S: Simd>(simd: S, x: S::f32s) -> S::f32s;
}

struct Exp;
struct Erf;
struct Gelu;

impl ElementWise for Exp {
    #[inline(always)]
    fn apply<S: Simd>(simd: S, x: S::f32s) -> S::f32s {
        exp(simd, x)
    }
}

impl ElementWise for Erf {
    #[inline(always)]
    fn apply<S: Simd>(simd: S, x: S::f32s) -> S::f32s {
        erf(simd, x)
    }
}

impl ElementWise for Gelu {
    #[inline(always)]
    fn apply<S: Simd>(simd: S, x: S::f32s) -> S::f32s {
        gelu(simd, x)
    }
}

/// An [`ElementWise`] function as a [`LaneFn`].
struct Apply<F>(std::marker::PhantomData<F>);

impl<S: Simd, F: ElementWise> LaneFn<S> for Apply<F> {
    #[inline(always)]
    fn apply(&self, simd: S, x: S::f32s) -> S::f32s {
        F::apply(simd, x)
    }
}

/// `F` of every element, in place (dispatched; the tail padded with 0).
fn map_slice<F: ElementWise>(xs: &mut [f32]) {
    struct Op<'a, F>(&'a mut [f32], std::marker::PhantomData<F>);
    impl<F: ElementWise> WithSimd for Op<'_, F> {
        type Output = ();
        #[inline(always)]
        fn with_simd<S: Simd>(self, simd: S) {
            map_in_place(simd, self.0, 0.0, &Apply::<F>(std::marker::PhantomData));
        }
    }
    arch().dispatch(Op::<F>(xs, std::marker::PhantomData));
}

/// `exp` of every element, in place (dispatched).
pub fn exp_slice(xs: &mut [f32]) {
    map_slice::<Exp>(xs);
}

/// `erf` of every element, in place (dispatched).
pub fn erf_slice(xs: &mut [f32]) {
    map_slice::<Erf>(xs);
}

/// GELU of every element, in place (dispatched).
pub fn gelu_slice(xs: &mut [f32]) {
    map_slice::<Gelu>(xs);
}

/// `y = gelu(x)` element-wise (equal lengths; dispatched): the forward's
/// activation without a copy of `x` first.
pub fn gelu_into(x: &[f32], y: &mut [f32]) {
    struct Op<'a>(&'a [f32], &'a mut [f32]);
    impl WithSimd for Op<'_> {
        type Output = ();
        #[inline(always)]
        fn with_simd<S: Simd>(self, simd: S) {
            let (hx, tx) = S::as_simd_f32s(self.0);
            let (hy, ty) = S::as_mut_simd_f32s(self.1);
            for (y, &x) in hy.iter_mut().zip(hx) {
                *y = gelu(simd, x);
            }
            if !ty.is_empty() {
                store_tail(simd, ty, gelu(simd, load_tail(simd, tx, 0.0)));
            }
        }
    }
    assert_eq!(x.len(), y.len(), "gelu_into: lengths differ");
    arch().dispatch(Op(x, y));
}

/// `dy *= gelu'(x)` element-wise (equal lengths; dispatched).
pub fn gelu_backward_slice(x: &[f32], dy: &mut [f32]) {
    struct Op<'a>(&'a [f32], &'a mut [f32]);
    impl WithSimd for Op<'_> {
        type Output = ();
        #[inline(always)]
        fn with_simd<S: Simd>(self, simd: S) {
            let (hx, tx) = S::as_simd_f32s(self.0);
            let (hy, ty) = S::as_mut_simd_f32s(self.1);
            for (y, &x) in hy.iter_mut().zip(hx) {
                *y = simd.mul_f32s(*y, gelu_grad(simd, x));
            }
            if !ty.is_empty() {
                let g = gelu_grad(simd, load_tail(simd, tx, 0.0));
                let v = simd.mul_f32s(load_tail(simd, ty, 0.0), g);
                store_tail(simd, ty, v);
            }
        }
    }
    assert_eq!(x.len(), dy.len(), "gelu_backward_slice: lengths differ");
    arch().dispatch(Op(x, dy));
}

/// `sum_i a[i] b[i]` (dispatched).
pub fn dot_slice(a: &[f32], b: &[f32]) -> f32 {
    struct Op<'a>(&'a [f32], &'a [f32]);
    impl WithSimd for Op<'_> {
        type Output = f32;
        #[inline(always)]
        fn with_simd<S: Simd>(self, simd: S) -> f32 {
            dot(simd, self.0, self.1)
        }
    }
    assert_eq!(a.len(), b.len(), "dot_slice: lengths differ");
    arch().dispatch(Op(a, b))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ulps(a: f32, b: f32) -> f32 {
        let d = (a as f64 - b as f64).abs();
        let u = f32::EPSILON as f64 * (b.abs() as f64).max(f32::MIN_POSITIVE as f64);
        (d / u) as f32
    }

    /// `dot_slice` against an f64 sum, on lengths below, at and past the
    /// SIMD width (so the tail path runs with and without whole lanes).
    #[test]
    fn dot_is_the_sum_of_products_with_and_without_a_tail() {
        for n in [0usize, 1, 3, 7, 8, 9, 16, 17, 33, 100] {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin() + 0.5).collect();
            let b: Vec<f32> = (0..n).map(|i| 1.5 - (i % 5) as f32 * 0.25).collect();
            let want: f64 = a.iter().zip(&b).map(|(&x, &y)| x as f64 * y as f64).sum();
            let got = dot_slice(&a, &b) as f64;
            let scale: f64 = a
                .iter()
                .zip(&b)
                .map(|(&x, &y)| (x as f64 * y as f64).abs())
                .sum();
            assert!(
                (got - want).abs() <= 4.0 * f32::EPSILON as f64 * scale.max(1e-30) + 1e-30,
                "n = {n}: dot {got}, sum {want}"
            );
        }
    }

    #[test]
    fn exp_is_within_two_ulp_of_libm_and_zero_below_the_cut() {
        let mut xs: Vec<f32> = (0..200_001)
            .map(|i| -87.0 + 175.0 * i as f32 / 200_000.0)
            .collect();
        xs.extend([0.0, -0.0, 1e-30, -1e-30, 88.0]);
        let mut ys = xs.clone();
        exp_slice(&mut ys);
        let mut worst = 0.0f32;
        for (&x, &y) in xs.iter().zip(&ys) {
            let want = libm::expf(x);
            if want >= f32::MIN_POSITIVE {
                worst = worst.max(ulps(y, want));
            }
        }
        assert!(worst <= 2.0, "worst exp error {worst} ulp");
        assert!(
            worst > 0.0,
            "a polynomial exp that matches libm everywhere is suspicious"
        );
        let mut low = vec![-87.5f32, -100.0, -1e30, f32::NEG_INFINITY, -87.000_01];
        exp_slice(&mut low);
        assert_eq!(low, vec![0.0; 5]);
        let mut one = [0.0f32; 3];
        exp_slice(&mut one);
        assert_eq!(one, [1.0; 3]);
    }

    /// [`exp`] gives the same bits whichever instruction set runs it: with
    /// AVX-512 its last step is `vscalefps` ([`scaled_v4`]), elsewhere a
    /// multiply by `2^n` built from exponent bits; pulp's scalar `Simd` runs
    /// the latter here, one lane at a time, on the same `x`.
    #[test]
    fn exp_has_the_same_bits_on_every_instruction_set() {
        let mut xs: Vec<f32> = (0..400_001)
            .map(|i| -90.0 + 180.0 * i as f32 / 400_000.0)
            .collect();
        // Around the cut at -87, 2^n's smallest normal and the top.
        xs.extend([-87.0, -86.999_99, -87.000_01, -86.5, -0.0, 0.0, 88.0, 87.9]);
        xs.extend([f32::NEG_INFINITY, -1e30, 1e-40, -1e-40]);
        let mut dispatched = xs.clone();
        exp_slice(&mut dispatched);
        struct Scalar<'a>(&'a mut [f32]);
        impl WithSimd for Scalar<'_> {
            type Output = ();
            #[inline(always)]
            fn with_simd<S: Simd>(self, simd: S) {
                for x in self.0.iter_mut() {
                    let mut v = [*x; 16];
                    let (h, _) = S::as_mut_simd_f32s(&mut v[..S::F32_LANES]);
                    h[0] = exp(simd, h[0]);
                    *x = v[0];
                }
            }
        }
        let mut scalar = xs.clone();
        pulp::Scalar::new().vectorize(Scalar(&mut scalar));
        // exp_at_most_88 (no clamp at 88), dispatched, on the x <= 88.
        struct AtMost88<'a>(&'a mut [f32]);
        impl WithSimd for AtMost88<'_> {
            type Output = ();
            #[inline(always)]
            fn with_simd<S: Simd>(self, simd: S) {
                let (head, tail) = S::as_mut_simd_f32s(self.0);
                for x in head {
                    *x = exp_at_most_88(simd, *x);
                }
                for x in tail {
                    let mut v = [*x; 16];
                    let (h, _) = S::as_mut_simd_f32s(&mut v[..S::F32_LANES]);
                    h[0] = exp_at_most_88(simd, h[0]);
                    *x = v[0];
                }
            }
        }
        let at: Vec<usize> = (0..xs.len()).filter(|&i| xs[i] <= 88.0).collect();
        let mut capped: Vec<f32> = at.iter().map(|&i| xs[i]).collect();
        arch().dispatch(AtMost88(&mut capped));
        for (&i, y) in at.iter().zip(&capped) {
            assert_eq!(
                y.to_bits(),
                scalar[i].to_bits(),
                "exp_at_most_88({})",
                xs[i]
            );
        }
        let differ: Vec<(f32, f32, f32)> = xs
            .iter()
            .zip(dispatched.iter().zip(&scalar))
            .filter(|(_, (a, b))| a.to_bits() != b.to_bits())
            .map(|(&x, (&a, &b))| (x, a, b))
            .take(5)
            .collect();
        assert!(
            differ.is_empty(),
            "(x, {}, scalar): {differ:?}",
            arch_name()
        );
    }

    #[test]
    fn erf_and_gelu_are_close_to_libm() {
        let xs: Vec<f32> = (0..80_001)
            .map(|i| -8.0 + 16.0 * i as f32 / 80_000.0)
            .collect();
        let mut e = xs.clone();
        erf_slice(&mut e);
        let mut g = vec![f32::NAN; xs.len()];
        gelu_into(&xs, &mut g);
        let mut in_place = xs.clone();
        gelu_slice(&mut in_place);
        assert_eq!(g, in_place, "gelu_into and gelu_slice differ");
        let (mut worst_erf, mut worst_gelu) = (0.0f64, 0.0f64);
        for ((&x, &ev), &gv) in xs.iter().zip(&e).zip(&g) {
            let want = libm::erf(x as f64);
            worst_erf = worst_erf.max((ev as f64 - want).abs());
            let gw = 0.5 * x as f64 * (1.0 + libm::erf(x as f64 / std::f64::consts::SQRT_2));
            // GELU's error relative to max(|x|, 1): 1 + erf cancels for x << 0
            // in any f32 evaluation, so the absolute error is what is bounded.
            worst_gelu = worst_gelu.max((gv as f64 - gw).abs() / (x.abs() as f64).max(1.0));
        }
        let eps = f32::EPSILON as f64;
        assert!(worst_erf <= 4.0 * eps, "erf abs error {worst_erf:e}");
        assert!(worst_gelu <= 4.0 * eps, "gelu error {worst_gelu:e}");
        // gelu' against central differences of the f64 GELU.
        let mut dy = vec![1.0f32; xs.len()];
        gelu_backward_slice(&xs, &mut dy);
        for (&x, &d) in xs.iter().zip(&dy).step_by(97) {
            let x = x as f64;
            let f = |t: f64| 0.5 * t * (1.0 + libm::erf(t / std::f64::consts::SQRT_2));
            let h = 1e-5;
            let want = (f(x + h) - f(x - h)) / (2.0 * h);
            assert!(
                (d as f64 - want).abs() <= 1e-6 * want.abs().max(1.0),
                "gelu'({x}) = {d}, want {want}"
            );
        }
    }
}
