//! # packshard-optimized
//!
//! Fast CPU kernels: SIMD through [`pulp`] with run-time dispatch, threads
//! through [`rayon`], matrix products through [`gemm`]. Each kernel passes the
//! same equivalence suites as the f64 reference (see `optimized/tests/`).
//!
//! - [`attention`]: varlen and dense masked attention, forward and backward.
//! - [`vocab`]: cross-entropy, the materialized and the fused chunked output
//!   layer, and one shard of `alg2` (`vocab::alg2`).
//! - [`layer`]: the BERT encoder layer.
//! - [`ops`]: the kernels above as implementations of the op traits of
//!   `packshard_reference::ops` (the registry of `packshard-oracle` lists them).
//! - [`matmul`], [`simd`], [`convert`]: the building blocks and the f64 boundary.
//! - [`alloc`]: the counting global allocator behind the memory figures.

pub mod alloc;
pub mod attention;
pub mod convert;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod decoder_layer;
pub mod decoder_model;
pub mod layer;
pub mod matmul;
pub mod ops;
pub mod simd;
pub mod vocab;
