//! The library of `packshard verify`: a model run on real text packed and
//! padded, every output, loss and gradient compared.
//!
//! - [`RunFigures`]: the sample, the packing and the time of a run;
//! - [`Diff`]: one row of the table the command prints (values compared,
//!   max abs and max relative difference);
//! - [`causal`]: `packshard verify causal-lm`, the f64 reference decoder
//!   (issue #15) on documents packed by a packing algorithm against one
//!   document per padded row.
//!
//! `packshard verify bert` lives in the `packshard` crate (`src/verify.rs`)
//! and shares [`RunFigures`] and [`Diff`].

use packshard_equivalence::compare::error_stats;
use packshard_reference::packing::PackingMetrics;

pub mod causal;

/// The difference of one kind of output, packed against padded.
#[derive(Debug, Clone, PartialEq)]
pub struct Diff {
    /// What was compared.
    pub name: String,
    /// Values compared.
    pub values: usize,
    /// `max |packed - padded|`.
    pub max_abs: f64,
    /// `max |packed - padded| / max |padded|` (the absolute difference when
    /// every padded value is 0).
    pub max_rel: f64,
}

impl Diff {
    /// Compares `actual` (packed) with `expected` (padded), element by
    /// element; slices of different lengths compare their common prefix (the
    /// verdict, not the table, judges shapes).
    pub fn new(name: &str, expected: &[f64], actual: &[f64]) -> Diff {
        let s = error_stats(expected, actual);
        let scale = expected.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        Diff {
            name: name.to_string(),
            values: expected.len(),
            max_abs: s.max_abs,
            max_rel: if scale > 0.0 {
                s.max_abs / scale
            } else {
                s.max_abs
            },
        }
    }
}

/// What a verification ran: the sample, the packing, the time.
#[derive(Debug, Clone)]
pub struct RunFigures {
    /// Sequences (documents) run.
    pub sequences: usize,
    /// Real tokens.
    pub real_tokens: usize,
    /// Tokens with a target.
    pub predicted_tokens: usize,
    /// The packing's figures.
    pub metrics: PackingMetrics,
    /// Token slots of the padded batch (`sequences x max_seq_len`).
    pub padded_slots: usize,
    /// Token slots of the packed batch (`packs x max_seq_len`).
    pub packed_slots: usize,
    /// Seconds of the padded forward + backward passes.
    pub padded_seconds: f64,
    /// Seconds of the packed forward + backward passes.
    pub packed_seconds: f64,
}
