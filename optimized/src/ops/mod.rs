//! The kernels of this crate as implementations of the op traits of
//! `packshard_reference::ops` (f64 at the boundary, rounded to the kernel's
//! precision on entry, widened on exit). `packshard-oracle`'s registry lists
//! each as a value with its name, precision and judge; nothing else refers
//! to a kernel by name.
//!
//! | type | registry name | precision |
//! |---|---|---|
//! | [`TiledAttention::F32`] | `attention_varlen_tiled` | f32 |
//! | [`TiledAttention::BF16`] | `attention_varlen_tiled_bf16` | bf16 inputs |
//! | [`DenseMaskedAttention`] | `attention_dense_masked` | f32 |
//! | [`ScalarAttention`] | `attention_varlen_scalar` | f32 |
//! | [`CrossEntropyF32`] | `cross_entropy_f32` | f32 |
//! | [`LinearCeMaterialized`] | `linear_ce_materialized` | f32 |
//! | [`LinearCeFused`] | `linear_ce_fused` | f32 |
//! | [`LinearCeTiled`] | `linear_ce_tiled` | f32 |
//! | [`LinearCeTiledFiltered`] | `linear_ce_tiled_filtered` | f32, gradients filtered (reports the error traded) |
//! | [`EncoderLayerF32`] | `encoder_layer` | f32 |

mod attention;
pub mod boundary;
mod layer;
pub(crate) mod scalar_attention;
mod vocab;

pub use attention::{DenseMaskedAttention, TiledAttention, MAX_DENSE_TOKENS};
pub use layer::EncoderLayerF32;
pub use scalar_attention::ScalarAttention;
pub use vocab::{
    CrossEntropyF32, LinearCeFused, LinearCeMaterialized, LinearCeTiled, LinearCeTiledFiltered,
};
