use half::{bf16, f16};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::*;

const LOW: [Precision; 3] = [Precision::F32, Precision::Bf16, Precision::F16];

/// `2^e`, exact.
fn pow2(e: i32) -> f64 {
    2f64.powi(e)
}

/// Bits of an f64 for comparisons that tell `-0` from `0` and NaN from NaN.
fn same(a: f64, b: f64) -> bool {
    (a.is_nan() && b.is_nan()) || a.to_bits() == b.to_bits()
}

#[test]
fn names_round_trip_and_unknown_names_are_none() {
    for p in Precision::ALL {
        assert_eq!(Precision::from_name(p.name()), Some(p));
    }
    assert_eq!(Precision::from_name("fp16"), None);
    assert_eq!(Precision::from_name("BF16"), None);
}

/// `u = 2^-p` against each format's own epsilon (the gap after 1, `2u`), as
/// the standard library and `half` state it.
#[test]
fn unit_roundoff_is_half_the_epsilon_of_each_format() {
    assert_eq!(Precision::F64.unit_roundoff(), f64::EPSILON / 2.0);
    assert_eq!(
        Precision::F32.unit_roundoff(),
        f64::from(f32::EPSILON) / 2.0
    );
    assert_eq!(
        Precision::Bf16.unit_roundoff(),
        bf16::EPSILON.to_f64() / 2.0
    );
    assert_eq!(Precision::F16.unit_roundoff(), f16::EPSILON.to_f64() / 2.0);
    // The numbers themselves (issue 31: bf16's was once stated as 2^-9).
    let want = [pow2(-53), pow2(-24), pow2(-8), pow2(-11)];
    for (p, u) in Precision::ALL.into_iter().zip(want) {
        assert_eq!(p.unit_roundoff(), u, "{}", p.name());
    }
}

/// The unit roundoff is the largest relative error the rounding makes, in
/// the normal range: over random values `|round(x) - x| / |x|` stays below
/// `u` and comes within 1% of it (drawn from the bottom 1/64 of each
/// binade, where an ulp is largest relative to the value); on a grid of quarter-`u` steps (which
/// holds the ties `2^e (1 + u)`, rounded down to `2^e` by ties-to-even)
/// `|round(x) - x| / |round(x)|` reaches `u` exactly and never exceeds it.
/// A unit roundoff off by a factor of 2 either way fails one of the two.
#[test]
fn unit_roundoff_is_the_largest_rounding_error_seen() {
    let mut rng = ChaCha8Rng::seed_from_u64(31);
    for p in LOW {
        let u = p.unit_roundoff();
        // Exponents well inside the normal range of every format (f16's
        // is 2^-14 ..= 2^15).
        let mut worst_random = 0.0f64;
        for _ in 0..100_000 {
            let x = (1.0 + rng.random_range(0.0..pow2(-6))) * pow2(rng.random_range(-12..=14));
            let x = if rng.random_bool(0.5) { -x } else { x };
            worst_random = worst_random.max(((p.round(x) - x) / x).abs());
        }
        assert!(
            worst_random < u && worst_random > 0.99 * u,
            "{}: worst random {worst_random:e}, u {u:e}",
            p.name()
        );
        let mut worst_grid = 0.0f64;
        for e in [-12, -1, 0, 3, 14] {
            for i in 0..4096 {
                let x = pow2(e) * (1.0 + f64::from(i) * u / 4.0);
                let r = p.round(x);
                worst_grid = worst_grid.max((r - x).abs() / r.abs());
            }
        }
        assert_eq!(worst_grid, u, "{}", p.name());
    }
}

/// An independent round-to-nearest-even f32 -> bf16 on the bits: add
/// `0x7FFF` plus the kept part's lowest bit, drop the low 16 bits.
fn bf16_by_bits(f: f32) -> f32 {
    let b = f.to_bits();
    f32::from_bits(b.wrapping_add(0x7FFF + ((b >> 16) & 1)) & 0xFFFF_0000)
}

/// Over f32 bit patterns across every exponent (finite ones), the one
/// rounding is `half`'s `from_f32` and the bit-level rounding above.
#[test]
fn bf16_rounding_is_round_to_nearest_even_on_every_f32() {
    let mut checked = 0;
    for b in (0..u32::MAX).step_by(9_973) {
        let f = f32::from_bits(b);
        if !f.is_finite() {
            continue;
        }
        let r = round_bf16(f64::from(f));
        assert!(same(r, bf16::from_f32(f).to_f64()), "{f:e}");
        assert!(same(r, f64::from(bf16_by_bits(f))), "{f:e}");
        checked += 1;
    }
    assert!(checked > 400_000, "{checked}");
}

/// The edge cases, against `half::bf16::from_f64` and `from_f32`: ties to
/// even, subnormals (bf16's smallest is `2^-133`), overflow to infinity
/// (bf16's largest is `(2 - 2^-7) 2^127`; the tie above it, `2^128 (1 -
/// 2^-9)`, goes to even, which is `2^128`: infinity), signed zeros,
/// infinities and NaN.
#[test]
fn bf16_edge_cases_agree_with_half() {
    let max = bf16::MAX.to_f64();
    assert_eq!(max, (2.0 - pow2(-7)) * pow2(127));
    let cases = [
        (1.0, 1.0),
        (1.0 + pow2(-8), 1.0),                         // tie, to even (down)
        (1.0 + 3.0 * pow2(-8), 1.0 + pow2(-6)),        // tie, to even (up)
        (1.0 + pow2(-8) + pow2(-20), 1.0 + pow2(-7)),  // just above the tie
        (-(1.0 + 3.0 * pow2(-8)), -(1.0 + pow2(-6))),  // sign kept
        (pow2(-133), pow2(-133)),                      // smallest subnormal
        (pow2(-134), 0.0),                             // half of it: tie to 0
        (3.0 * pow2(-134), pow2(-132)),                // tie, to even (up)
        (1.5 * pow2(-134), pow2(-133)),                // above the tie
        (-pow2(-140), -0.0),                           // underflow keeps the sign
        (pow2(-126) * (1.0 - pow2(-9)), pow2(-126)),   // subnormal rounds up to normal
        (max, max),                                    // the largest
        (pow2(128) * (1.0 - pow2(-9)), f64::INFINITY), // tie above it: to even, inf
        (pow2(128) * (1.0 - pow2(-8)), max),           // below the tie
        (-pow2(128) * (1.0 - pow2(-9)), f64::NEG_INFINITY),
        (f64::INFINITY, f64::INFINITY),
        (f64::NEG_INFINITY, f64::NEG_INFINITY),
        (-0.0, -0.0),
        (f64::NAN, f64::NAN),
    ];
    for (x, want) in cases {
        let got = round_bf16(x);
        assert!(
            same(got, want),
            "round_bf16({x:e}) = {got:e}, want {want:e}"
        );
        assert!(same(got, bf16::from_f64(x).to_f64()), "from_f64({x:e})");
        assert!(
            same(got, bf16::from_f32(x as f32).to_f64()),
            "from_f32({x:e})"
        );
        assert!(same(Precision::Bf16.round(x), got));
        assert_eq!(to_bf16(x).to_f64().to_bits(), got.to_bits());
    }
    assert!(Precision::Bf16.round(f64::NAN).is_nan());
}

/// Where the one rounding and `half::bf16::from_f64` part, and why the one
/// goes through f32. `half`'s f64 path reads only the top 20 significand
/// bits, so `1 + 2^-8 + 2^-23` (an f32 value above a tie) goes down to 1;
/// the one rounding (like PyTorch's) rounds it up, correctly. The price of
/// the f32 step is a double rounding next to a tie: `1 + 2^-7 + 2^-8 -
/// 2^-30` is below the tie between `1 + 2^-7` and `1 + 2^-6`, becomes the
/// tie in f32 and goes to even, `1 + 2^-6`, as it does for a kernel that
/// takes f32 inputs and for PyTorch.
#[test]
fn bf16_goes_through_f32_where_half_from_f64_differs() {
    let above_tie = 1.0 + pow2(-8) + pow2(-23);
    assert_eq!(round_bf16(above_tie), 1.0 + pow2(-7));
    assert_eq!(bf16::from_f64(above_tie).to_f64(), 1.0);
    let below_tie = 1.0 + pow2(-7) + pow2(-8) - pow2(-30);
    assert_eq!(round_bf16(below_tie), 1.0 + pow2(-6));
    assert_eq!(bf16::from_f64(below_tie).to_f64(), 1.0 + pow2(-7));
}

/// f16's edge cases against `half::f16::from_f64` and `from_f32`: ties to
/// even, subnormals (the smallest is `2^-24`), the largest 65504 and the
/// tie above it (65520) to infinity, NaN.
#[test]
fn f16_edge_cases_agree_with_half() {
    let ulp = pow2(-10);
    let cases = [
        (1.0 + ulp / 2.0, 1.0),             // tie, to even
        (1.0 + 1.5 * ulp, 1.0 + 2.0 * ulp), // tie, to even (up)
        (1.0 + 0.75 * ulp, 1.0 + ulp),      // above the tie
        (pow2(-24), pow2(-24)),             // smallest subnormal
        (pow2(-25), 0.0),                   // tie to 0
        (3.0 * pow2(-25), pow2(-23)),       // tie, to even (up)
        (65504.0, 65504.0),                 // the largest
        (65519.0, 65504.0),                 // below the tie
        (65520.0, f64::INFINITY),           // the tie: to even, inf
        (-1e5, f64::NEG_INFINITY),
        (f64::INFINITY, f64::INFINITY),
        (-0.0, -0.0),
        (f64::NAN, f64::NAN),
    ];
    for (x, want) in cases {
        let got = round_f16(x);
        assert!(same(got, want), "round_f16({x:e}) = {got:e}, want {want:e}");
        assert!(same(got, f16::from_f64(x).to_f64()), "from_f64({x:e})");
        assert!(
            same(got, f16::from_f32(x as f32).to_f64()),
            "from_f32({x:e})"
        );
        assert!(same(Precision::F16.round(x), got));
    }
}

/// f32: Rust's `as` (to nearest, ties to even), infinity from half an ulp
/// beyond `f32::MAX`; f64 is the identity.
#[test]
fn f32_and_f64_roundings() {
    let u = Precision::F32.unit_roundoff();
    assert_eq!(round_f32(1.0 + u), 1.0);
    assert_eq!(round_f32(1.0 + 3.0 * u), 1.0 + 4.0 * u);
    let max = f64::from(f32::MAX);
    assert_eq!(round_f32(max), max);
    assert_eq!(round_f32(max * (1.0 + u / 2.0)), max);
    assert_eq!(round_f32(pow2(128) * (1.0 - u / 2.0)), f64::INFINITY); // the tie above it
    assert!(round_f32(f64::NAN).is_nan());
    assert_eq!(Precision::F64.round(0.1), 0.1);
    assert_eq!(Precision::F32.round(0.1), f64::from(0.1f32));
}
