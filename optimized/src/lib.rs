//! # packshard-optimized
//!
//! Fast CPU kernels: SIMD through [`pulp`] with run-time dispatch, threads
//! through [`rayon`], matrix products through [`gemm`]. Each kernel passes the
//! same equivalence suites as the f64 reference (see `optimized/tests/`).

pub mod adapt;
pub mod attention;
pub mod layer;
pub mod matmul;
pub mod simd;
pub mod variants;
pub mod vocab;
