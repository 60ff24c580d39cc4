//! The boundary of a kernel, written once per family: a kernel implements
//! only its math and declares its support; a generic adapter (and a
//! one-line macro that makes the kernel the family's op trait of
//! `packshard_reference::ops`) runs the reference's checks in the
//! reference's order, refuses what the declaration does not cover, rounds
//! the inputs to the kernel's precision and widens the results to f64.
//!
//! - Attention ([`attention`]): [`AttentionMath`] or [`F32AttentionMath`],
//!   [`KernelSupport`], [`attention_op!`](crate::attention_op).
//! - The output layer's losses ([`losses`]): [`CrossEntropyMath`],
//!   [`LinearCrossEntropyMath`], [`LossKernelSupport`],
//!   [`cross_entropy_op!`](crate::cross_entropy_op),
//!   [`linear_cross_entropy_op!`](crate::linear_cross_entropy_op).
//! - The f32 encoder layer ([`layer`]): [`EncoderLayerMath`],
//!   [`encoder_layer_op!`](crate::encoder_layer_op).
//!
//! Every item of both is re-exported here (`ops::boundary::<item>`).

pub mod attention;
pub mod in_place;
pub mod layer;
pub mod losses;

pub use attention::*;
pub use in_place::*;
pub use layer::*;
pub use losses::*;

/// The names the boundary's macros expand to, so that a crate using them
/// needs no `use` of its own.
#[doc(hidden)]
pub mod reexport {
    pub use packshard_reference::attention::{AttentionGrads, AttentionOutput};
    pub use packshard_reference::ops::{
        AttentionOp, AttentionSupport, CeCall, CrossEntropyOp, EncoderLayerOp, Grad, Layer,
        LayerInput, LayerPass, LinearCall, LinearCrossEntropyOp, LinearLoss, LossOp, LossSupport,
        Masked, Qkv, Varlen,
    };
    pub use packshard_reference::vocab::cross_entropy::CrossEntropy;
    pub use packshard_reference::vocab::sharded::ShardedLoss;
    pub use packshard_reference::vocab::{ShardPlan, ShardedAlgorithm};
    pub use packshard_reference::Result;
}
