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
//! - [`variants`]: the one list of the variants above, with what changed.
//! - [`matmul`], [`simd`], [`adapt`]: the building blocks and f64 adapters.
//! - [`oracle`]: the kernels behind the op traits of `packshard-equivalence`.

pub mod adapt;
pub mod attention;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod layer;
pub mod matmul;
pub mod oracle;
pub mod simd;
pub mod variants;
pub mod vocab;
