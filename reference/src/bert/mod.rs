//! A plain f64 BERT with hand-written gradients: the reference that packed
//! and padded implementations are checked against.
//!
//! BERT as in Devlin et al. (2019) with the conventions of Hugging Face's
//! `BertModel` / `BertForPreTraining`: word + position + token-type
//! embeddings and LayerNorm; post-LayerNorm encoder layers of multi-head
//! scaled dot-product attention and an exact (erf) GELU feed-forward; a tanh
//! pooler over the first token; the MLM head (dense, GELU, LayerNorm, decoder
//! tied to the word embeddings, bias) and the NSP head; cross-entropy losses
//! with per-token or per-sequence reduction (Krell et al., arXiv:2107.02027).
//! Dropout is off.
//!
//! | module | what |
//! |---|---|
//! | [`config`] | `config.json` fields and limits |
//! | [`weights`] | parameters, HF names, `model.safetensors` loading, seeded init |
//! | [`ops`] | linear, LayerNorm, GELU, forward and backward |
//! | [`attention`] | (re-exported from [`crate::attention`]) dense masked and varlen attention with `lse`, forward and backward |
//! | [`layer`] | one encoder layer |
//! | [`loss`] | cross-entropy and the two reductions |
//! | [`model`] | embeddings to losses on padded and packed batches, and the full backward |
//!
//! Shapes: `n` token slots, `hidden` = `hidden_size`, `h` heads, `d` head dim,
//! `v` vocabulary, `b` sequences. Every backward pass is checked against
//! central finite differences in this module's tests.

pub use crate::attention;

/// `param_backward!(backward(input, dy), p => g, w, b)` is
/// `backward(input, p.w, dy, g.w, g.b)`: the backward pass
/// ([`ops::linear_backward`] or [`ops::layer_norm_backward`]) of the layer
/// whose parameters are the fields `w` (weight or gamma) and `b` (bias or
/// beta) of `p`, accumulating their gradients into the same fields of `g`;
/// the gradient of its input.
macro_rules! param_backward {
    ($backward:ident($input:expr, $dy:expr), $p:ident => $g:ident, $w:ident, $b:ident) => {
        $backward(
            $input,
            $p.$w.view(),
            $dy,
            $g.$w.view_mut(),
            $g.$b.view_mut(),
        )
    };
}

pub mod batch;
pub mod config;
pub mod layer;
pub mod loss;
pub mod model;
pub mod ops;
pub mod weights;

pub use crate::attention::{
    masked_attention, masked_attention_backward, varlen_attention, varlen_attention_backward,
    AttentionGrads, AttentionLayout, AttentionOutput, ReferenceAttention,
};
pub use config::BertConfig;
pub use loss::{Reduction, IGNORE_INDEX};
pub use model::{
    BertModel, BertOutput, LossWeights, PackedAttention, SequenceOutput, Targets, TokenBatch,
};
pub use weights::{BertParams, LayerParams};

#[cfg(test)]
mod tests;
