//! What an implementation stores its tensors in, and the one rounding to
//! each format. Every precision of the workspace is this type: the
//! registry's [`crate::ops`] entries, the golden vectors' `--dtype`
//! (`packshard_oracle::golden::Dtype`) and the Python package's
//! `precision=` (`KernelPrecision`) are names for it, and every rounding of
//! an f64 value to f32, bf16 or f16 in the workspace calls
//! [`Precision::round`] or one of the functions below.
//!
//! ## Unit roundoff
//!
//! A binary format with `p` significand bits (the implicit leading bit
//! included) rounds to nearest with relative error at most the unit
//! roundoff `u = 2^-p` (Higham, *Accuracy and Stability of Numerical
//! Algorithms*, 2nd ed., §2.1: `u = (1/2) β^(1-t)`, `β = 2`, `t = p`): for
//! every `x` in the normal range, `round(x) = x (1 + δ)`, `|δ| < u`. It is
//! half the gap between 1 and the next value (half an ulp of 1, half Rust's
//! `f32::EPSILON`).
//!
//! | precision | `p` | `u` | ulp of 1 (`2u`) |
//! |---|---|---|---|
//! | f64 | 53 | `2^-53` | `2^-52` |
//! | f32 | 24 | `2^-24` | `2^-23` |
//! | bf16 | 8 (7 stored) | `2^-8` | `2^-7` |
//! | f16 | 11 (10 stored) | `2^-11` | `2^-10` |
//!
//! ## The rounding
//!
//! To nearest, ties to even, **through f32** for bf16 and f16: `x as f32`,
//! then [`half`]'s `from_f32`. This is what the kernels receive (they take
//! f32 and round that, `packshard_optimized::convert`) and what PyTorch's
//! `Tensor.to(torch.bfloat16)` does to a float64 tensor, so the reference
//! judges exactly the values a kernel sees. Going through f32 is a double
//! rounding: for an `x` within `2^-24` relative of a bf16 or f16 tie it can
//! land on the other neighbour than rounding `x` directly would. (`half`'s
//! own `bf16::from_f64` is not correctly rounded either: it ignores the low
//! 32 bits of the f64 significand, so `1 + 2^-8 + 2^-23`, above a tie, goes
//! down to 1; the tests show both.)
//!
//! Out of range and non-finite: a finite value beyond the largest finite
//! value of the format by half an ulp or more becomes `±inf` (bf16 has
//! f32's exponent range; f16's largest is 65504); values below the smallest
//! subnormal round to `±0`, those between it and the smallest normal to
//! the nearest subnormal; `±inf` stay; NaN stays NaN (its payload is not
//! kept). Implementations that must refuse out-of-range values do so before
//! rounding (`packshard_optimized::convert::to_f32`).

/// What an implementation computes in. Inputs are rounded to it on entry
/// and results widened to f64 on exit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Precision {
    /// f64 throughout (the reference, exact rewrites of it).
    F64,
    /// f32 storage and arithmetic.
    F32,
    /// bf16 storage (8 significant bits), f32 accumulation.
    Bf16,
    /// IEEE binary16 storage (11 significant bits), f32 accumulation.
    F16,
}

impl Precision {
    /// Every precision, most precise first.
    pub const ALL: [Precision; 4] = [
        Precision::F64,
        Precision::F32,
        Precision::Bf16,
        Precision::F16,
    ];

    /// The name used in JSON, on the command line and in Python:
    /// `f64`, `f32`, `bf16`, `f16`.
    pub const fn name(self) -> &'static str {
        match self {
            Precision::F64 => "f64",
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
            Precision::F16 => "f16",
        }
    }

    /// The precision called `name` ([`Precision::name`]), if any.
    pub fn from_name(name: &str) -> Option<Precision> {
        Precision::ALL.into_iter().find(|p| p.name() == name)
    }

    /// `p`, the significand bits including the implicit leading one:
    /// 53, 24, 8, 11.
    pub const fn significand_bits(self) -> u32 {
        match self {
            Precision::F64 => f64::MANTISSA_DIGITS,
            Precision::F32 => f32::MANTISSA_DIGITS,
            Precision::Bf16 => half::bf16::MANTISSA_DIGITS,
            Precision::F16 => half::f16::MANTISSA_DIGITS,
        }
    }

    /// The unit roundoff `u = 2^-p` (see the module docs): `2^-53`,
    /// `2^-24`, `2^-8`, `2^-11`. The largest relative error of
    /// [`Precision::round`] in the normal range; every tolerance stated in
    /// unit roundoffs or ulps (`2u`) of a precision is a multiple of it.
    pub const fn unit_roundoff(self) -> f64 {
        // 2^-p exactly: biased exponent 1023 - p, zero significand.
        f64::from_bits(((1023 - self.significand_bits()) as u64) << 52)
    }

    /// `x` rounded to this precision (to nearest, ties to even; through f32
    /// for bf16 and f16), as f64. See the module docs for ties near the
    /// f32 step, overflow and non-finite values.
    pub fn round(self, x: f64) -> f64 {
        (self.rounding())(x)
    }

    /// [`Precision::round`] as a function pointer: the identity for f64,
    /// [`round_f32`], [`round_bf16`], [`round_f16`].
    pub fn rounding(self) -> fn(f64) -> f64 {
        match self {
            Precision::F64 => |x| x,
            Precision::F32 => round_f32,
            Precision::Bf16 => round_bf16,
            Precision::F16 => round_f16,
        }
    }
}

/// `x` rounded to the nearest f32 (ties to even; `±inf` from half an ulp
/// beyond `f32::MAX`).
pub fn round_f32(x: f64) -> f64 {
    f64::from(x as f32)
}

/// `x` as bf16: to nearest f32, then to nearest bf16 (ties to even both
/// times), the one f64 -> bf16 rounding of the workspace.
pub fn to_bf16(x: f64) -> half::bf16 {
    half::bf16::from_f32(x as f32)
}

/// `x` as IEEE f16: to nearest f32, then to nearest f16 (ties to even both
/// times), the one f64 -> f16 rounding of the workspace.
pub fn to_f16(x: f64) -> half::f16 {
    half::f16::from_f32(x as f32)
}

/// `x` rounded to bf16 ([`to_bf16`]), as f64 (exact).
pub fn round_bf16(x: f64) -> f64 {
    to_bf16(x).to_f64()
}

/// `x` rounded to f16 ([`to_f16`]), as f64 (exact).
pub fn round_f16(x: f64) -> f64 {
    to_f16(x).to_f64()
}

#[cfg(test)]
#[path = "precision_tests.rs"]
mod tests;
