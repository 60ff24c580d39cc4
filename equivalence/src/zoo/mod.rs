//! The bug zoo: realistic kernels, each with one mistake kernel authors
//! have shipped, as negative controls for the default checks
//! ([`crate::fuzz::schedule::fuzz_budgeted`] with [`crate::fuzz::schedule::Budget::DEFAULT`]
//! over the family's fuzz body). Each kernel is written as a kernel (tiles,
//! chunks, online softmax), correct by default; a `Bug` value switches one
//! mistake in. The correct kernels pass the same checks, so a bug the check
//! catches is the bug, not the kernel's baseline. Nothing here is registered
//! in the oracle's registry: these are controls, not implementations to use.
//!
//! | kernel | family | what it is |
//! |---|---|---|
//! | [`TiledAttention`] | [`AttentionOp`](packshard_reference::ops::AttentionOp) | flash-attention-2 style, f64: query tiles of `br`, key tiles of `bc`, online softmax, `lse`; backward from `lse` with `D = rowsum(dO * O)`; GQA, cross, bottom-right causal |
//! | [`ChunkedCrossEntropy`] | [`CrossEntropyOp`](packshard_reference::ops::CrossEntropyOp) | vocabulary chunks of `chunk` entries, online logsumexp over chunks, every loss option |
//! | [`TokenChunkedLinearCrossEntropy`] | [`LinearCrossEntropyOp`](packshard_reference::ops::LinearCrossEntropyOp) | fused output layer: token chunks of `chunk` rows, never all logits at once |
//!
//! The table of bugs, with what each changes and where such a bug was seen,
//! is docs/FAULTS.md, "The bug zoo"; `equivalence/tests/zoo.rs` runs every
//! (kernel, bug) through the default check and fails when one passes.

mod attention;
mod attention_backward;
mod linear;
mod loss;

pub use attention::{AttentionBug, TiledAttention};
pub use linear::{LinearBug, TokenChunkedLinearCrossEntropy};
pub use loss::{ChunkedCrossEntropy, LossBug};
