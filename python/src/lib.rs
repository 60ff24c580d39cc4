//! # packshard-python
//!
//! The Python package `packshard` (PyO3 + maturin, one abi3 wheel for
//! CPython >= 3.9): every op of the registry as a numpy function, packing
//! and batching, and `packshard.testing`, which holds a user's kernel to the
//! rule the Rust suites hold ours to. The pure-Rust parts ([`core`],
//! [`cases`]) build and test without Python; the extension module
//! (`packshard._native`) is behind the `python` feature, which maturin
//! turns on (`pyproject.toml`), so `cargo build` and `cargo test
//! --workspace` compile no PyO3 and link no libpython.
//!
//! Shape legend as in `packshard-reference`: `n_tok` tokens, `b` segments,
//! `h` heads, `d` head dim, `n` rows, `v` vocabulary, `p` shards.

/// The extension keeps the large blocks it frees for its next call of the
/// same shape ([`packshard_optimized::alloc::KeptBlocks`]: at most 8 blocks,
/// `PACKSHARD_KEPT_BYTES`, default 512 MiB): numpy arrays the package
/// returns own Rust memory, so an attention output freed by Python comes
/// back for the next call without the kernel's page faults and clearing
/// (issue 37). Only under `python`: `cargo test` keeps the system allocator.
#[cfg(feature = "python")]
#[global_allocator]
static ALLOC: packshard_optimized::alloc::KeptBlocks = packshard_optimized::alloc::KeptBlocks;

pub mod cases;
pub mod collator;
pub mod core;
pub mod judge;
#[cfg(feature = "python")]
mod py;
pub mod segments;
