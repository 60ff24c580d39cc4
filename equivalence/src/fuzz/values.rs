//! Values for fuzz cases: sizes and options come from the fuzzer's bytes;
//! the bulk of the values from a generator seeded by them (so a short input
//! still gives a non-degenerate case), in a *style* the bytes choose; and a
//! few extreme values planted where the bytes say (so the fuzzer can steer
//! outliers onto the element that breaks a kernel).

use arbitrary::{Result, Unstructured};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// How the bulk values are drawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Style {
    /// Continuous, uniform in `[-r, r]`.
    Uniform,
    /// Multiples of `r / 8` in `[-r, r]`: exact in bf16, many exact ties.
    Grid,
    /// One value repeated: every score ties, every softmax is uniform.
    Constant,
}

/// A seeded value generator (ChaCha8) with a style, a magnitude and a rate
/// of planted outliers, all chosen by the fuzzer's bytes.
#[derive(Debug, Clone)]
pub struct Gen {
    rng: ChaCha8Rng,
    /// The style of the bulk values.
    pub style: Style,
    /// Multiplier of every value: `10^e`, `e` in `-3..=1` (mostly 0).
    pub magnitude: f64,
    /// One value in this many is an outlier (x 8, as in the suites' seeded
    /// cases); 0 for none.
    pub outlier_one_in: u32,
    constant: f64,
}

impl Gen {
    /// Reads a seed, a style, a magnitude and an outlier rate (12 bytes).
    ///
    /// # Errors
    /// Never in practice: bytes that run out read as zeros.
    pub fn arbitrary(u: &mut Unstructured<'_>) -> Result<Self> {
        let seed: u64 = u.arbitrary()?;
        let style = match u.arbitrary::<u8>()? % 8 {
            0..=4 => Style::Uniform,
            5 | 6 => Style::Grid,
            _ => Style::Constant,
        };
        let magnitude = match u.arbitrary::<u8>()? % 16 {
            0 => 1e-3,
            1 => 1e-1,
            2 => 10.0,
            _ => 1.0,
        };
        let outlier_one_in = match u.arbitrary::<u8>()? % 4 {
            0 => 0,
            1 => 3,
            _ => 7,
        };
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let constant = (rng.random_range(-16i32..=16) as f64) / 8.0;
        Ok(Gen {
            rng,
            style,
            magnitude,
            outlier_one_in,
            constant,
        })
    }

    /// A generator from a seed alone (uniform, no outliers), for tests.
    pub fn seeded(seed: u64) -> Self {
        Gen {
            rng: ChaCha8Rng::seed_from_u64(seed),
            style: Style::Uniform,
            magnitude: 1.0,
            outlier_one_in: 0,
            constant: 0.5,
        }
    }

    /// A value of magnitude about `r` in this generator's style, with
    /// outliers x 8 at its rate.
    pub fn value(&mut self, r: f64) -> f64 {
        let x = match self.style {
            Style::Uniform => r * (2.0 * self.rng.random::<f64>() - 1.0),
            Style::Grid => r * self.rng.random_range(-8i32..=8) as f64 / 8.0,
            Style::Constant => r * self.constant,
        };
        let x = x * self.magnitude;
        if self.outlier_one_in > 0 && self.rng.random_range(0..self.outlier_one_in) == 0 {
            8.0 * x
        } else {
            x
        }
    }

    /// Uniform in `lo..hi` (continuous), whatever the style.
    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.rng.random::<f64>()
    }

    /// True with probability `1 / one_in` (never when `one_in` is 0).
    pub fn one_in(&mut self, one_in: u32) -> bool {
        one_in > 0 && self.rng.random_range(0..one_in) == 0
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        self.rng.random_range(0..n)
    }

    /// A short description for failure reports.
    pub fn describe(&self) -> String {
        let outliers = if self.outlier_one_in == 0 {
            "no outliers".to_string()
        } else {
            format!("1 in {} x 8", self.outlier_one_in)
        };
        format!("{:?} values x {:e}, {outliers}", self.style, self.magnitude)
    }
}

/// Up to `max` planted values: `(flat index, choice byte)` pairs read from the
/// bytes; the caller maps the index into its tensor and the byte onto its
/// extreme values.
///
/// # Errors
/// Never in practice: bytes that run out read as zeros.
pub fn plants(u: &mut Unstructured<'_>, max: usize) -> Result<Vec<(usize, u8)>> {
    let count = u.int_in_range(0..=max)?;
    (0..count)
        .map(|_| Ok((u.arbitrary::<u16>()? as usize, u.arbitrary::<u8>()?)))
        .collect()
}
