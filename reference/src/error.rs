//! The one error type of the reference crate.
//!
//! Every variant names the offending field (as the JSON interface spells it,
//! e.g. `lengths`, `cu_seqlens`, `targets`) and, where there is one, the index,
//! so that a caller can find the bad value without a debugger. The variants map
//! one-to-one onto the `kind` strings of the `packshard eval` error contract
//! (`docs/INTERFACE.md`) through [`Error::kind`].

use thiserror::Error;

/// Result alias used throughout the reference crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A typed error: bad input never panics and never loses data silently.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum Error {
    /// A sequence is longer than the pack and the overlong policy is `error`.
    #[error(
        "{field}[{index}]: sequence of length {length} is longer than max_seq_len {max_seq_len}"
    )]
    SequenceTooLong {
        /// The input field (`lengths`, `sequences`, `histogram`).
        field: String,
        /// Index of the sequence (for a histogram: its length).
        index: usize,
        /// Its length in tokens.
        length: usize,
        /// The pack length it does not fit.
        max_seq_len: usize,
    },
    /// An index (token id, target, offset) outside its valid range.
    #[error("{field}[{index}] = {value} is out of range {lo}..{hi}")]
    IndexOutOfRange {
        /// The input field.
        field: String,
        /// Position of the bad value.
        index: usize,
        /// The bad value.
        value: i64,
        /// Inclusive lower end of the valid range.
        lo: i64,
        /// Exclusive upper end of the valid range.
        hi: i64,
    },
    /// A tensor whose shape does not match what the operation needs.
    #[error("{field}: shape {actual:?} does not match the expected {expected}")]
    ShapeMismatch {
        /// The input field.
        field: String,
        /// The expected shape, in the crate's shape legend (e.g. `[n_tok, h, d]`).
        expected: String,
        /// The shape that was given.
        actual: Vec<usize>,
    },
    /// A NaN or infinity where only finite values are allowed.
    #[error("{field}[{index}] is not finite ({value})")]
    NonFiniteInput {
        /// The input field.
        field: String,
        /// Flat (row-major) index of the first non-finite value.
        index: usize,
        /// The value itself.
        value: f64,
    },
    /// Any other argument outside its domain.
    #[error("{field}: {message}")]
    InvalidArgument {
        /// The input field or option.
        field: String,
        /// What is wrong with it.
        message: String,
    },
    /// A malformed line in a text input (CSV histograms, length lists).
    #[error("{source_name} line {line}: {message}")]
    Parse {
        /// File name or `<inline>`.
        source_name: String,
        /// 1-based line number.
        line: usize,
        /// What is wrong with it.
        message: String,
    },
}

impl Error {
    /// The snake_case kind string of the `packshard eval` error contract.
    pub fn kind(&self) -> &'static str {
        match self {
            Error::SequenceTooLong { .. } => "sequence_too_long",
            Error::IndexOutOfRange { .. } => "index_out_of_range",
            Error::ShapeMismatch { .. } => "shape_mismatch",
            Error::NonFiniteInput { .. } => "non_finite_input",
            Error::InvalidArgument { .. } => "invalid_argument",
            Error::Parse { .. } => "invalid_argument",
        }
    }

    /// Shorthand for [`Error::SequenceTooLong`]: `field[index]` is `length`
    /// tokens, over `max_seq_len`.
    pub fn too_long(
        field: impl Into<String>,
        index: usize,
        length: usize,
        max_seq_len: usize,
    ) -> Self {
        Error::SequenceTooLong {
            field: field.into(),
            index,
            length,
            max_seq_len,
        }
    }

    /// Shorthand for [`Error::IndexOutOfRange`] with the range `0..hi`:
    /// `field[index]` holds `value`.
    pub fn out_of_range(field: impl Into<String>, index: usize, value: i64, hi: usize) -> Self {
        Error::IndexOutOfRange {
            field: field.into(),
            index,
            value,
            lo: 0,
            hi: i64::try_from(hi).unwrap_or(i64::MAX),
        }
    }

    /// Shorthand for [`Error::InvalidArgument`].
    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        Error::InvalidArgument {
            field: field.into(),
            message: message.into(),
        }
    }
}

/// `Ok(())` when `ok`, else an [`Error::InvalidArgument`] naming `field` with
/// the message `message()` (built only on failure): one rule of a
/// validation chain.
pub fn ensure(ok: bool, field: &str, message: impl FnOnce() -> String) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(Error::invalid(field, message()))
    }
}

/// `Ok(())` when every size in `sizes` (`(field, value)` pairs) is at least
/// 1, else an [`Error::InvalidArgument`] naming the first that is 0.
pub fn ensure_nonzero(sizes: &[(&str, usize)]) -> Result<()> {
    match sizes.iter().find(|&&(_, v)| v == 0) {
        Some(&(field, _)) => Err(Error::invalid(field, "must be at least 1")),
        None => Ok(()),
    }
}

/// `Ok(())` when the length `len` of the list `field` is `want`, else an
/// [`Error::ShapeMismatch`] naming `field` that expects `[dim] = [want]`,
/// followed by ` (why)` unless `why` is empty.
pub fn check_len(field: &str, len: usize, dim: &str, want: usize, why: &str) -> Result<()> {
    if len == want {
        return Ok(());
    }
    let why = if why.is_empty() {
        String::new()
    } else {
        format!(" ({why})")
    };
    Err(Error::ShapeMismatch {
        field: field.into(),
        expected: format!("[{dim}] = [{want}]{why}"),
        actual: vec![len],
    })
}

/// Returns the first non-finite value of `values` as an [`Error::NonFiniteInput`].
///
/// `field` names the tensor; the index in the error is the flat row-major index.
pub fn check_finite<'a>(field: &str, values: impl IntoIterator<Item = &'a f64>) -> Result<()> {
    for (index, &value) in values.into_iter().enumerate() {
        if !value.is_finite() {
            return Err(Error::NonFiniteInput {
                field: field.to_string(),
                index,
                value,
            });
        }
    }
    Ok(())
}

/// The most characters of an input value an error message quotes.
pub const ECHO_CHARS: usize = 100;

/// `text` cut to [`ECHO_CHARS`] characters for an error message, with the
/// full length said when it was cut (a 50 MB bad value is never echoed
/// whole).
pub fn brief(text: &str) -> String {
    brief_to(text, ECHO_CHARS)
}

/// `text` cut to `chars` characters, as [`brief`].
pub fn brief_to(text: &str, chars: usize) -> String {
    match text.char_indices().nth(chars) {
        None => text.to_string(),
        Some((at, _)) => format!("{}... ({} bytes)", &text[..at], text.len()),
    }
}
