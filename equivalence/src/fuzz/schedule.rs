//! How generated cases are sized: the way kernels break.
//!
//! Kernels break at tile and chunk boundaries (a last partial key tile, a
//! last partial vocabulary chunk, a segment of exactly one tile), at sizes
//! the fuzz cases of earlier rounds never reached (segments of at most 12
//! tokens, vocabularies of at most 41 entries). Flash-attention's own tests
//! use query/key lengths such as `(113, 203)`, `(239, 1)`, `(1023, 1024)` and
//! head dims from 32 to 256 for that reason. This module is the one place
//! the generators of every family read their size schedule from:
//!
//! - **the size class** of an input is its first byte ([`SizeClass::of`]):
//!   `0x00..=0xDF` small, `0xE0..=0xFF` large, so under libFuzzer about one
//!   input in 8 is large, and a committed input keeps its class;
//! - **[`Budget`]**: how many cases a default check runs and how many of
//!   them are large (small cases first, then the large ones);
//! - **[`fuzz_budgeted`]**: the deterministic driver that `cargo test`, the
//!   default `check_*` calls and the Python package's `testing` share: input
//!   `i` of seed `s` is the ChaCha8 byte string [`super::fuzz_random`] would
//!   draw, its first byte set to the class the budget gives index `i` (and,
//!   for a large input, its [`slot`]: the `j`-th large case gets slot `j`);
//! - **[`slot`]**: the low five bits of a large input's first byte, which the
//!   families read to place the shapes a default check must reach in fixed
//!   large cases (attention: every head-dim class and the forward-only path;
//!   the losses: a vocabulary past 16,384, a token count past 1,024), so
//!   every seed's default check reaches them, not one seed in a few;
//! - **[`boundary_len`]**: a length at a power-of-two boundary, `k * 2^j - 1`,
//!   `k * 2^j` or `k * 2^j + 1` for `2^j` in a family's grains
//!   ([`TILE_GRAINS`], [`VOCAB_GRAINS`]), within a bound.

use arbitrary::{Result, Unstructured};
use rand::{Rng, SeedableRng};

use super::{Failure, Outcome, MAX_RANDOM_INPUT};

/// The tile sizes attention kernels use along queries and keys (flash-attention
/// 2's `kBlockM`/`kBlockN` are 64 or 128; CPU kernels and older GPU ones
/// 16 and 32): segment lengths are drawn around their multiples.
pub const TILE_GRAINS: [usize; 4] = [16, 32, 64, 128];

/// The chunk sizes of vocabulary-chunked losses (Liger's and Apple's
/// cut-cross-entropy kernels chunk the vocabulary by 256 to 4096 entries;
/// the padded vocabularies of Megatron are multiples of 128 x TP):
/// vocabulary widths are drawn around their multiples.
pub const VOCAB_GRAINS: [usize; 3] = [256, 1024, 4096];

/// The first byte at and above which an input is large.
pub const LARGE_FROM: u8 = 0xE0;

/// Small cases run in well under a millisecond; large ones cross tiles and
/// chunks and take milliseconds to a fraction of a second each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SizeClass {
    /// The sizes of the earlier generators: a few tokens, a few heads.
    Small,
    /// Tile- and chunk-crossing sizes, long segments beside short ones.
    Large,
}

impl SizeClass {
    /// The class of an input: its first byte (an empty input is small).
    pub fn of(data: &[u8]) -> SizeClass {
        match data.first() {
            Some(&b) if b >= LARGE_FROM => SizeClass::Large,
            _ => SizeClass::Small,
        }
    }

    /// Reads the class byte from `u` (the first byte of the input).
    ///
    /// # Errors
    /// Never in practice: bytes that run out read as zeros (small).
    pub fn read(u: &mut Unstructured<'_>) -> Result<SizeClass> {
        Ok(if u.arbitrary::<u8>()? >= LARGE_FROM {
            SizeClass::Large
        } else {
            SizeClass::Small
        })
    }
}

/// How many cases a check runs: `cases` in all, the last `large` of them
/// large. The default is what the default `check_*` calls run (Rust and
/// Python): 100 cases, 12 of them large, which reaches segments of 1,000
/// tokens and more, every GQA ratio and partial vocabulary chunks within a
/// few seconds (the measured times are in docs/FAULTS.md, "How results are
/// judged").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    /// Cases in all.
    pub cases: usize,
    /// Of which large (the last ones; at most `cases`).
    pub large: usize,
}

impl Default for Budget {
    fn default() -> Self {
        Budget::DEFAULT
    }
}

impl Budget {
    /// 100 cases, 12 large.
    pub const DEFAULT: Budget = Budget {
        cases: 100,
        large: 12,
    };

    /// Only small cases.
    pub fn small(cases: usize) -> Budget {
        Budget { cases, large: 0 }
    }

    /// The class of case `i`: the last `large` of `cases` are large.
    pub fn class_of(&self, i: usize) -> SizeClass {
        if i >= self.cases.saturating_sub(self.large.min(self.cases)) {
            SizeClass::Large
        } else {
            SizeClass::Small
        }
    }
}

/// How many [`slot`]s there are: the low five bits of the first byte.
pub const SLOTS: usize = 32;

/// The slot of a large input: the low five bits of its first byte (0 for an
/// empty input). [`budgeted_input`] gives the `j`-th large case of a budget
/// slot `j % SLOTS`, so a family that keys a shape to slot `s` (`s <
/// Budget::DEFAULT.large`) meets it in every seed's default check; a
/// libFuzzer input's slot is one of its bytes, uniform over `0..SLOTS`.
pub fn slot(data: &[u8]) -> usize {
    usize::from(data.first().copied().unwrap_or(0) & 0x1F)
}

/// The bytes of input `i` of `seed` under `budget`: a ChaCha8 stream keyed
/// by `(seed, i)` of `MAX_RANDOM_INPUT` bytes (at least 1), its first byte
/// set to the class [`Budget::class_of`] gives `i`: a small one the stream's
/// byte modulo [`LARGE_FROM`], a large one `LARGE_FROM | j % SLOTS` for the
/// `j`-th large case ([`slot`]).
pub fn budgeted_input(budget: &Budget, seed: u64, i: usize) -> Vec<u8> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(i as u64);
    let mut buf: Vec<u8> = (0..MAX_RANDOM_INPUT.max(1))
        .map(|_| rng.random::<u8>())
        .collect();
    buf[0] = match budget.class_of(i) {
        SizeClass::Small => buf[0] % LARGE_FROM,
        SizeClass::Large => {
            let first_large = budget.cases - budget.large.min(budget.cases);
            LARGE_FROM | ((i - first_large) % SLOTS) as u8
        }
    };
    buf
}

/// Runs `body` on the `budget.cases` inputs of `seed` ([`budgeted_input`]),
/// small ones first. Deterministic: the failing input is reproduced by
/// [`budgeted_input`] with the same budget, seed and index.
///
/// # Errors
/// The first [`Failure`], its source set to `budgeted input i of seed s`.
pub fn fuzz_budgeted(
    budget: Budget,
    seed: u64,
    mut body: impl FnMut(&[u8]) -> std::result::Result<Outcome, Failure>,
) -> std::result::Result<Outcome, Failure> {
    let mut seen = Outcome::default();
    for i in 0..budget.cases {
        let data = budgeted_input(&budget, seed, i);
        let o =
            body(&data).map_err(|f| f.from_source(format!("budgeted input {i} of seed {seed}")))?;
        seen.merge(o);
    }
    Ok(seen)
}

/// A length at a boundary of one of `grains`: `k * g + e` for `g` in
/// `grains`, `k >= 1`, `e` in `{-1, 0, +1}`, at most `max` (and at least 1);
/// `max` itself when no boundary fits.
///
/// # Errors
/// Never in practice: bytes that run out read as zeros (`1 * grains[0] - 1`).
pub fn boundary_len(u: &mut Unstructured<'_>, grains: &[usize], max: usize) -> Result<usize> {
    let g = grains[u.choose_index(grains.len())?];
    let e = [-1i64, 0, 1][u.choose_index(3)?];
    let most_k = (max as i64 - e) / g as i64;
    if most_k < 1 {
        return Ok(max.max(1));
    }
    let k = u.int_in_range(1..=most_k)?;
    Ok(((k * g as i64 + e) as usize).clamp(1, max.max(1)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boundary_lengths_sit_at_a_boundary_within_the_bound() {
        let mut seen_minus = false;
        let mut seen_plus = false;
        for s in 0..500u64 {
            let data = budgeted_input(&Budget::DEFAULT, s, 99);
            let mut u = Unstructured::new(&data[1..]);
            let l = boundary_len(&mut u, &TILE_GRAINS, 1100).unwrap();
            assert!((1..=1100).contains(&l), "{l}");
            let near = TILE_GRAINS
                .iter()
                .any(|&g| [l.wrapping_sub(1), l, l + 1].iter().any(|&x| x % g == 0));
            assert!(near, "{l} is at no boundary of {TILE_GRAINS:?}");
            seen_minus |= l % 16 == 15;
            seen_plus |= l % 16 == 1;
        }
        assert!(seen_minus && seen_plus, "both sides of a boundary drawn");
    }

    #[test]
    fn the_budget_puts_the_large_cases_last() {
        let b = Budget {
            cases: 10,
            large: 3,
        };
        let classes: Vec<SizeClass> = (0..10)
            .map(|i| SizeClass::of(&budgeted_input(&b, 7, i)))
            .collect();
        assert_eq!(
            classes.iter().filter(|&&c| c == SizeClass::Large).count(),
            3
        );
        assert!(classes[7..].iter().all(|&c| c == SizeClass::Large));
        // Reproducible, and inputs differ from one another.
        assert_eq!(budgeted_input(&b, 7, 4), budgeted_input(&b, 7, 4));
        assert_ne!(budgeted_input(&b, 7, 4), budgeted_input(&b, 7, 5));
        assert_eq!(Budget::small(5).class_of(4), SizeClass::Small);
    }

    /// The lengths `boundary_len` draws are exactly the boundaries `k g - 1`,
    /// `k g`, `k g + 1` (`k >= 1`) within the bound: the one just under a
    /// bound that is itself a boundary included, nothing past it, and one
    /// boundary (`k = 1`) when only one fits.
    #[test]
    fn boundary_lengths_are_every_boundary_within_the_bound_and_no_other() {
        let drawn = |max: usize| {
            let mut seen = std::collections::BTreeSet::new();
            for s in 0..400u64 {
                let data = budgeted_input(&Budget::small(1), s, 0);
                let mut u = Unstructured::new(&data[1..]);
                seen.insert(boundary_len(&mut u, &[16], max).unwrap());
            }
            seen.into_iter().collect::<Vec<_>>()
        };
        assert_eq!(drawn(64), [15, 16, 17, 31, 32, 33, 47, 48, 49, 63, 64]);
        assert_eq!(drawn(20), [15, 16, 17]);
        // No boundary fits: the bound itself.
        assert_eq!(drawn(14), [14]);
    }

    /// A small input is the ChaCha8 stream with its first byte taken modulo
    /// [`LARGE_FROM`] (so it is the stream itself whenever that byte is
    /// already small): the class byte keeps the stream's spread, not one or
    /// two values. A large one's first byte is its slot: the `j`-th large
    /// case's is `j` (modulo [`SLOTS`]), the rest of the stream untouched.
    #[test]
    fn the_class_byte_keeps_the_streams_byte() {
        let (small, large) = (
            Budget::small(64),
            Budget {
                cases: 64,
                large: 64,
            },
        );
        for i in 0..64 {
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
            rng.set_stream(i as u64);
            let raw: u8 = rng.random();
            assert_eq!(budgeted_input(&small, 3, i)[0], raw % LARGE_FROM);
            let big = budgeted_input(&large, 3, i);
            assert_eq!(big[0], LARGE_FROM | (i % SLOTS) as u8);
            assert_eq!(slot(&big), i % SLOTS);
            assert_eq!(big[1..], budgeted_input(&small, 3, i)[1..]);
        }
        // The slots count from the first large case, not from input 0.
        let b = Budget::DEFAULT;
        let slots: Vec<usize> = (0..b.cases)
            .filter(|&i| b.class_of(i) == SizeClass::Large)
            .map(|i| slot(&budgeted_input(&b, 0, i)))
            .collect();
        assert_eq!(slots, (0..b.large).collect::<Vec<_>>());
    }
}
