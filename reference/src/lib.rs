//! # packshard-reference
//!
//! The ground truth of packshard: plain, readable CPU code in `f64` (no
//! threads, no `unsafe`, no cleverness) that every optimized kernel, and every
//! framework author's kernel, is checked against.
//!
//! ## Shape legend
//!
//! | name | meaning |
//! |---|---|
//! | `n` | sequences (or tokens, for token-level ops) |
//! | `n_tok` | total tokens of a packed batch |
//! | `b` | segments (sequences) in a packed batch |
//! | `max_seq_len` | tokens per pack (row) |
//! | `h` | attention heads, or the hidden size where noted |
//! | `d` | head dimension |
//! | `v` | vocabulary size |
//! | `p` | vocabulary shards (ranks) |
//!
//! `cu_seqlens: [b + 1]` always starts at 0 and excludes padding.
//!
//! ## Modules
//!
//! - [`packing`]: length histograms, SPFHP / LPFHP / NNLSHP (Krell et al.,
//!   arXiv:2107.02027), FFD / BFD, plans on explicit lengths, packed batches.
//! - [`bert`]: a plain f64 BERT with hand-written backward passes, dense and
//!   varlen attention, padded and packed batches, MLM/NSP losses.
//! - [`error`]: the one typed error, mapped onto the `eval` error kinds.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod bert;
pub mod error;
pub mod packing;

pub use error::{Error, Result};
