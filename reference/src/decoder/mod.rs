//! A plain f64 causal decoder in the Llama / GPT-NeoX shape with
//! hand-written gradients: the reference that packed and unpacked causal-LM
//! training is checked against (issue #15).
//!
//! Pre-norm RMSNorm (or LayerNorm), rotary position embeddings at each
//! token's own position (Su et al. 2021, RoFormer; GPT-NeoX's `rotate_half`
//! layout), grouped-query attention (Ainslie et al. 2023; `h_kv` dividing
//! `h`, multi-query and multi-head as its ends) through any
//! [`crate::ops::AttentionOp`], causal and bottom-right aligned over
//! `cu_seqlens_q` / `cu_seqlens_k` (flash-attention >= 2.1), SwiGLU
//! (Shazeer 2020) or exact-GELU MLP, bias-free projections, tied or untied LM
//! head; conventions of Hugging Face's `LlamaForCausalLM`. Dropout is off.
//!
//! | module | what |
//! |---|---|
//! | [`ops`] | bias-free linear, RMSNorm, rotary embeddings, SiLU / SwiGLU, forward and backward |
//! | [`params`] | [`DecoderConfig`], [`DecoderParams`] with HF names, seeded init |
//! | [`packing`] | next-token labels per document, the loss reductions, document ids / `cu_seqlens` / `position_ids` / `seq_idx` conversions |
//! | [`model`] | layers and the whole model over varlen or dense layouts, key/value caches, the weighted next-token loss |
//!
//! Shapes: `n` token slots, `hidden` the residual width, `h` / `h_kv` query /
//! key-value heads, `d` head dim, `v` vocabulary, `b` segments. Every backward
//! is checked against central finite differences in this module's tests.

pub mod layer;
pub mod model;
pub mod ops;
pub mod packing;
pub mod params;

pub use model::{
    token_cross_entropy, DecoderAttention, DecoderForward, DecoderGrads, DecoderInput,
    DecoderModel, DecoderRun, KvCache,
};
pub use packing::{
    cu_seqlens_from_position_ids, cu_seqlens_from_seq_idx, doc_ids_from_varlen, loss_weights,
    next_token_labels, position_ids_from_cu_seqlens, seq_idx_from_cu_seqlens, varlen_from_doc_ids,
    CausalReduction,
};
pub use params::{DecoderConfig, DecoderLayerParams, DecoderParams, Mlp, Norm};

/// Asserts that the error `$e` is an `Error::$variant` whose `field` is
/// `$field` (the test modules' check of a typed error).
#[cfg(test)]
macro_rules! assert_error_field {
    ($e:expr, $variant:ident, $field:expr) => {{
        let e = &$e;
        assert!(
            matches!(e, crate::error::Error::$variant { field, .. } if field == $field),
            "{e}"
        );
    }};
}

#[cfg(test)]
mod packing_tests;
#[cfg(test)]
mod tests;
