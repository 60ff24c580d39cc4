//! # packshard-oracle
//!
//! The registry of implementations and the front ends that iterate it, as a
//! library: the `packshard` command line, the fuzz targets and the Python
//! package are thin layers over this crate.
//!
//! - [`registry`]: every implementation of every op family as a value (name,
//!   what changed, constructor, precision, judge, small configuration,
//!   availability).
//! - [`eval`]: the JSON oracle interface (`packshard eval`, contract in
//!   `docs/INTERFACE.md`), every op with every registered `impl`.
//! - [`golden`]: golden test vectors (`packshard golden`) and the check of a
//!   framework's results against them (`packshard check`).
//! - [`fuzzing`]: the fuzz targets, one per op family, each running every
//!   registered implementation of the family on each input.
//! - [`bench`]: `packshard bench`, every registered kernel timed in one run.
//! - [`text`] (feature `text`): real text tokenized with a model's own
//!   `tokenizer.json`.
//! - [`verify`]: `packshard verify causal-lm` (a decoder on real documents,
//!   packed against padded) and the table rows every `verify` prints.
//!
//! Shape legend as in `packshard-reference`: `n_tok` tokens, `b` segments,
//! `h` heads, `d` head dim, `v` vocabulary, `p` shards.

// A fuzz `Failure` is the cold path, returned once per failing run.
#![allow(clippy::result_large_err)]

pub mod bench;
pub mod causal_lm;
pub mod eval;
pub mod fuzzing;
pub mod golden;
pub mod registry;
#[cfg(feature = "text")]
pub mod text;
pub mod verify;
