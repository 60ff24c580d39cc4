//! # packshard
//!
//! A correctness oracle for two exact speed-ups of transformer training:
//! sequence packing without cross-contamination (Krell et al.,
//! arXiv:2107.02027) and vocabulary parallelism (Yeung et al.,
//! arXiv:2411.05288).
//!
//! This crate is the facade and the `packshard` command line; the work is in
//! the members:
//!
//! - [`reference`] (`packshard-reference`): the f64 ground truth;
//! - [`optimized`] (`packshard-optimized`): the fast kernels;
//! - [`equivalence`] (`packshard-equivalence`): the reusable suites.
//!
//! [`eval`] is the JSON oracle interface (`packshard eval`) and [`report`]
//! the comparison tables the CLI prints; [`vocab_report`] measures the
//! vocabulary-parallel algorithms for `packshard vocab`.
//! the comparison tables the CLI prints; [`realtext`] reads and tokenizes real
//! text and [`verify`] runs the reference BERT packed against padded on it.
//! [`fuzzing`] names the fuzz targets and their bodies; [`golden`] writes
//! and checks the golden test vectors.

// A fuzz `Failure` is the cold path, returned once per failing run.
#![allow(clippy::result_large_err)]

pub use packshard_equivalence as equivalence;
pub use packshard_optimized as optimized;
pub use packshard_reference as reference;

pub mod assets;
pub mod bench;
pub mod eval;
pub mod fuzzing;
pub mod golden;
pub mod realtext;
pub mod report;
pub mod verify;
pub mod vocab_report;
