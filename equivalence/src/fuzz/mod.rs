//! Differential fuzzing: arbitrary cases, derived from bytes with
//! [`arbitrary`], run through an implementation of the op traits and through
//! the f64 reference, compared under a stated tolerance rule.
//!
//! Each op has a *body*: a function `fn(&impl Trait, ..., data: &[u8]) ->
//! Result<(), Failure>` that turns the bytes into a valid case (sizes first,
//! then values), runs it and reports the first mismatch as a [`Failure`]
//! naming the tensor, the index, both values and the tolerance. The same body
//! serves three drivers:
//!
//! - a libFuzzer target (`fuzz/fuzz_targets/*.rs`, `cargo fuzz run`), which
//!   panics with the failure's text;
//! - [`fuzz_random`], a quick driver for `cargo test` (pseudo-random byte
//!   strings, no libFuzzer needed);
//! - [`replay_dirs`], which replays committed inputs (seeds and inputs that
//!   ever failed) so a fixed failure stays fixed;
//! - [`schedule::fuzz_budgeted`], the default checks' driver: small cases
//!   first, then a bounded number of large, tile- and chunk-crossing ones
//!   (the first byte of an input is its [`schedule::SizeClass`]).
//!
//! | op | body | cases | rule |
//! |---|---|---|---|
//! | varlen attention forward and backward (GQA, cross, bottom-right causal) | [`attention::run`] | [`attention::AttentionFuzzCase`] | [`attention::ATTENTION_TERMS`] (caller's [`Tolerance`] x the magnitude of the terms) against `varlen_attention_general`, packed == padded, P2, P8 |
//! | sharded cross-entropy, every algorithm | [`vocab::run_cross_entropy`] | [`vocab::CeFuzzCase`] | [`crate::vocab::TERMS`] |
//! | sharded output layer, every algorithm | [`vocab::run_linear`] | [`vocab::LinearFuzzCase`] | [`crate::vocab::TERMS`] |
//! | sharded embedding | [`vocab::run_embedding`] | [`vocab::EmbeddingFuzzCase`] | exact |
//! | packing and batching | [`packing::run`] | [`packing::PackFuzzCase`] | first principles ([`crate::packing::check_plan`], [`crate::packing::check_batch`]) |
//!
//! Sizes are capped so that one input runs in well under a millisecond to a
//! few milliseconds; bytes that run out read as zeros (the `arbitrary`
//! convention), so every input gives a valid case.
//!
//! Under libFuzzer a panic inside an implementation aborts the process (the
//! hook of `libfuzzer-sys`) and is reported as a crash with its message; under
//! `cargo test` the bodies catch it and return a [`Failure`].

use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

use rand::{Rng, SeedableRng};

use crate::compare::Mismatch;
#[cfg(doc)]
use crate::compare::Tolerance;

pub mod attention;
pub mod packing;
pub mod schedule;
pub mod values;
pub mod vocab;

/// A failed fuzz case: the target, the implementation, the case and the
/// first mismatch (tensor, index, both values, tolerance).
#[derive(Debug, Clone, PartialEq)]
pub struct Failure {
    /// The fuzz target or op, e.g. `attention`.
    pub target: String,
    /// The implementation's name.
    pub implementation: String,
    /// A one-line description of the case (sizes, options, planted values).
    pub case: String,
    /// Where the input came from (a file of a replayed corpus, or the seed
    /// and number of a random input); empty under libFuzzer.
    pub source: String,
    /// The first difference.
    pub mismatch: Mismatch,
}

impl Failure {
    /// A failure of `implementation` on `case`.
    pub fn new(
        target: impl Into<String>,
        implementation: impl Into<String>,
        case: impl Into<String>,
        mismatch: Mismatch,
    ) -> Self {
        Failure {
            target: target.into(),
            implementation: implementation.into(),
            case: case.into(),
            source: String::new(),
            mismatch,
        }
    }

    /// The same failure, saying where its input came from.
    pub fn from_source(mut self, source: impl Into<String>) -> Self {
        self.source = source.into();
        self
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{} fuzz: {} disagrees with the reference",
            self.target, self.implementation
        )?;
        if !self.source.is_empty() {
            writeln!(f, "  input: {}", self.source)?;
        }
        writeln!(f, "  case: {}", self.case)?;
        write!(f, "  {}: {}", self.mismatch.what, self.mismatch.detail)
    }
}

impl std::error::Error for Failure {}

/// What a run of one or more fuzz inputs saw.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Outcome {
    /// Inputs run.
    pub cases: usize,
    /// Cases where both sides returned results, compared value by value.
    pub compared: usize,
    /// Cases where both sides returned the same kind of error (a bad input,
    /// e.g. a malformed `cu_seqlens` or an out-of-range id).
    pub errors_alike: usize,
    /// Output values compared.
    pub values: usize,
    /// The largest share of its tolerance that any compared value used: 0
    /// when every value was bit-for-bit equal, 1 at the limit.
    pub worst: f64,
    /// Cases narrowed to what the implementation declares before they ran
    /// (an attention case without its causal masks, grouped-query heads or
    /// cross segments: [`attention::AttentionFuzzCase::within`]).
    pub narrowed: usize,
}

impl Outcome {
    /// One case compared value by value (`values` of them, `worst` share used).
    pub fn compared(values: usize, worst: f64) -> Self {
        Outcome {
            cases: 1,
            compared: 1,
            errors_alike: 0,
            values,
            worst,
            narrowed: 0,
        }
    }

    /// One case where both sides failed alike.
    pub fn errors_alike() -> Self {
        Outcome {
            cases: 1,
            errors_alike: 1,
            ..Outcome::default()
        }
    }

    /// Adds another run's counts.
    pub fn merge(&mut self, other: Outcome) {
        self.cases += other.cases;
        self.compared += other.compared;
        self.errors_alike += other.errors_alike;
        self.values += other.values;
        self.worst = self.worst.max(other.worst);
        self.narrowed += other.narrowed;
    }
}

/// Runs `f`, turning a panic into a [`Mismatch`] named `what` that quotes
/// the panic message (an implementation must return typed errors, never
/// panic).
///
/// # Errors
/// The panic, as a [`Mismatch`].
pub fn catch_panic<T>(what: &str, f: impl FnOnce() -> T) -> Result<T, Mismatch> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|payload| {
        let msg = payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "(no message)".into());
        Mismatch::new(what, format!("panicked: {msg}"))
    })
}

/// The longest random input [`fuzz_random`] makes: enough bytes for the
/// largest case of every body (sizes and option bytes; the bulk values come
/// from a seeded generator).
pub const MAX_RANDOM_INPUT: usize = 256;

/// Runs `body` on `inputs` pseudo-random byte strings (ChaCha8 from `seed`,
/// lengths `0..=MAX_RANDOM_INPUT`): differential fuzzing without libFuzzer,
/// deterministic, for `cargo test`. Returns what the inputs exercised.
///
/// # Errors
/// The first [`Failure`], with its source set to the seed and input number
/// (`random input i of seed s`); the bytes are reproduced by calling this
/// again with the same seed.
pub fn fuzz_random(
    inputs: usize,
    seed: u64,
    mut body: impl FnMut(&[u8]) -> Result<Outcome, Failure>,
) -> Result<Outcome, Failure> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut buf = Vec::with_capacity(MAX_RANDOM_INPUT);
    let mut seen = Outcome::default();
    for i in 0..inputs {
        let len = rng.random_range(0..=MAX_RANDOM_INPUT);
        buf.clear();
        buf.extend((0..len).map(|_| rng.random::<u8>()));
        let o =
            body(&buf).map_err(|f| f.from_source(format!("random input {i} of seed {seed}")))?;
        seen.merge(o);
    }
    Ok(seen)
}

/// An input of a replayed corpus that failed, or a corpus that cannot be read.
#[derive(Debug)]
pub enum ReplayError {
    /// A file or directory could not be read.
    Io(PathBuf, std::io::Error),
    /// The body failed on a file.
    Failed(Box<Failure>),
}

impl fmt::Display for ReplayError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReplayError::Io(p, e) => write!(f, "{}: {e}", p.display()),
            ReplayError::Failed(failure) => failure.fmt(f),
        }
    }
}

impl std::error::Error for ReplayError {}

/// Runs `body` on every file of each directory in `dirs` (in name order; a
/// directory that does not exist is skipped, so a target without
/// regressions yet needs none). Returns what the files exercised
/// (`cases` is the number of files run).
///
/// This is how committed fuzz inputs (`fuzz/seeds/<target>/` and the inputs
/// that ever failed, `fuzz/regressions/<target>/`) run as regression tests
/// under `cargo test`.
///
/// # Errors
/// [`ReplayError::Failed`] for the first file whose case fails (the failure's
/// source is the file's path); [`ReplayError::Io`] for an unreadable file or
/// directory.
pub fn replay_dirs(
    dirs: &[&Path],
    mut body: impl FnMut(&[u8]) -> Result<Outcome, Failure>,
) -> Result<Outcome, ReplayError> {
    let mut seen = Outcome::default();
    for dir in dirs {
        if !dir.exists() {
            continue;
        }
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| ReplayError::Io(dir.to_path_buf(), e))?
            .map(|entry| entry.map(|e| e.path()))
            .collect::<Result<_, _>>()
            .map_err(|e| ReplayError::Io(dir.to_path_buf(), e))?;
        files.retain(|p| p.is_file() && !is_hidden(p));
        files.sort();
        for path in files {
            let data = std::fs::read(&path).map_err(|e| ReplayError::Io(path.clone(), e))?;
            let o = body(&data).map_err(|f| {
                ReplayError::Failed(Box::new(f.from_source(path.display().to_string())))
            })?;
            seen.merge(o);
        }
    }
    Ok(seen)
}

fn is_hidden(path: &Path) -> bool {
    path.file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.starts_with('.') || n.eq_ignore_ascii_case("README.md"))
}

/// A short list of numbers for case descriptions: all of them up to 12,
/// else the first 10 and a count.
pub(crate) fn brief<T: fmt::Debug>(xs: &[T]) -> String {
    if xs.len() <= 12 {
        format!("{xs:?}")
    } else {
        let head: Vec<String> = xs[..10].iter().map(|x| format!("{x:?}")).collect();
        format!("[{}, ... ({} in all)]", head.join(", "), xs.len())
    }
}
