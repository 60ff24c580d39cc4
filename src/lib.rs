//! # packshard
//!
//! A correctness oracle for two exact speed-ups of transformer training:
//! sequence packing without cross-contamination (Krell et al.,
//! arXiv:2107.02027) and vocabulary parallelism (Yeung et al.,
//! arXiv:2411.05288).
//!
//! This crate is the `packshard` command line and a facade over the members:
//!
//! - [`reference`] (`packshard-reference`): the f64 ground truth and the op
//!   traits (`reference::ops`);
//! - [`optimized`] (`packshard-optimized`): the fast kernels;
//! - [`equivalence`] (`packshard-equivalence`): the reusable suites;
//! - [`oracle`] (`packshard-oracle`): the registry of implementations and the
//!   front ends (eval, golden, fuzz targets, bench), re-exported here as
//!   [`registry`], [`eval`], [`golden`], [`fuzzing`], [`bench`], [`text`].
//!
//! What is left here prints: [`report`] (the packing comparison tables),
//! [`vocab_report`] (`packshard vocab`), [`verify`] (`packshard verify`) and
//! [`assets`] (the real model and text fetched by `scripts/fetch_assets.sh`).

pub use packshard_equivalence as equivalence;
pub use packshard_optimized as optimized;
pub use packshard_oracle as oracle;
pub use packshard_oracle::{bench, eval, fuzzing, golden, registry, text};
pub use packshard_reference as reference;

pub mod assets;
pub mod plot;
pub mod report;
pub mod verify;
pub mod vocab_report;
