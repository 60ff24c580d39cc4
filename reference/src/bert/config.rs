//! The BERT configuration, read from a Hugging Face `config.json`.

use serde::Deserialize;

use crate::error::{ensure, Error, Result};

/// Largest vocabulary accepted (2^22 rows): 100x BERT's, bounds the
/// allocations a `config.json` can ask for.
pub const MAX_VOCAB: usize = 1 << 22;
/// Largest hidden or intermediate size accepted (2^16).
pub const MAX_WIDTH: usize = 1 << 16;
/// Most layers accepted.
pub const MAX_LAYERS: usize = 256;
/// Most positions accepted (2^20).
pub const MAX_POSITIONS: usize = 1 << 20;
/// Most parameters accepted (2^29 = 537M, above BERT-large's 340M): the
/// reference holds them, and their gradients, in f64.
pub const MAX_PARAMETERS: usize = 1 << 29;

/// The hyper-parameters of a BERT model, with the field names of Hugging Face's
/// `BertConfig` (`config.json`).
///
/// Only the exact GELU (`hidden_act = "gelu"`, erf form) and absolute position
/// embeddings are supported, as in Devlin et al. and `BertModel`'s defaults.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct BertConfig {
    /// `v`: rows of the word embedding (and of the tied MLM decoder).
    pub vocab_size: usize,
    /// `hidden`: width of every token vector.
    pub hidden_size: usize,
    /// Encoder layers.
    pub num_hidden_layers: usize,
    /// `h`: attention heads; `d = hidden_size / h`.
    pub num_attention_heads: usize,
    /// Width of the feed-forward layer.
    pub intermediate_size: usize,
    /// Rows of the position embedding: the longest sequence (plus position offset).
    pub max_position_embeddings: usize,
    /// Rows of the token-type (segment) embedding.
    #[serde(default = "default_type_vocab")]
    pub type_vocab_size: usize,
    /// The LayerNorm epsilon (BERT: 1e-12).
    #[serde(default = "default_eps")]
    pub layer_norm_eps: f64,
    /// The padding token id.
    #[serde(default)]
    pub pad_token_id: usize,
    /// Must be `gelu` (exact erf form).
    #[serde(default = "default_act")]
    pub hidden_act: String,
    /// Standard deviation of the seeded initialisation of missing head weights.
    #[serde(default = "default_init")]
    pub initializer_range: f64,
    /// Must be `absolute`.
    #[serde(default = "default_pos")]
    pub position_embedding_type: String,
}

fn default_type_vocab() -> usize {
    2
}
fn default_eps() -> f64 {
    1e-12
}
fn default_act() -> String {
    "gelu".into()
}
fn default_init() -> f64 {
    0.02
}
fn default_pos() -> String {
    "absolute".into()
}

impl BertConfig {
    /// A small configuration for tests: `hidden` wide, `heads` heads, `layers`
    /// layers, vocabulary `vocab`, feed-forward `intermediate`, `positions`
    /// positions, 2 token types, eps 1e-12.
    pub fn tiny(
        vocab: usize,
        hidden: usize,
        heads: usize,
        layers: usize,
        intermediate: usize,
        positions: usize,
    ) -> Self {
        BertConfig {
            vocab_size: vocab,
            hidden_size: hidden,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            intermediate_size: intermediate,
            max_position_embeddings: positions,
            type_vocab_size: 2,
            layer_norm_eps: 1e-12,
            pad_token_id: 0,
            hidden_act: "gelu".into(),
            initializer_range: 0.02,
            position_embedding_type: "absolute".into(),
        }
    }

    /// Parses and validates a `config.json` text.
    ///
    /// # Errors
    /// [`Error::Parse`] for malformed JSON or a missing field; the errors of
    /// [`BertConfig::validate`].
    pub fn from_json(source_name: &str, text: &str) -> Result<Self> {
        let config: BertConfig = serde_json::from_str(text).map_err(|e| Error::Parse {
            source_name: source_name.to_string(),
            line: e.line(),
            message: e.to_string(),
        })?;
        config.validate()?;
        Ok(config)
    }

    /// Number of scalar parameters of BERT with its pre-training heads
    /// (saturating, so it can be checked against [`MAX_PARAMETERS`] before
    /// anything is allocated).
    pub fn num_parameters(&self) -> usize {
        let h = self.hidden_size;
        let i = self.intermediate_size;
        let layer = (4 * h * h + 4 * h)
            .saturating_add(i.saturating_mul(h).saturating_mul(2))
            .saturating_add(i + 5 * h);
        self.vocab_size
            .saturating_mul(h + 1)
            .saturating_add(self.max_position_embeddings.saturating_mul(h))
            .saturating_add(self.type_vocab_size.saturating_mul(h))
            .saturating_add(layer.saturating_mul(self.num_hidden_layers))
            .saturating_add(2 * h * h + 8 * h + 2)
    }

    /// Bytes one run ([`crate::bert::BertModel::run_with`]) holds for
    /// `slots` token slots, the parameters aside: per slot and layer the
    /// cache of the backward (the input, `q`, `k`, `v`, the attention output,
    /// both LayerNorms' normalized rows and the residual sums: ~12 `hidden`;
    /// the GELU's input and output and the MLP's product: ~3
    /// `intermediate_size`; the `lse` of each head), and ~8 `hidden` besides
    /// (embeddings, the running gradient), all f64. `None` on overflow.
    pub fn activation_bytes(&self, slots: usize) -> Option<u64> {
        let (h, i) = (self.hidden_size as u64, self.intermediate_size as u64);
        let heads = self.num_attention_heads as u64;
        let layer = h
            .checked_mul(12)?
            .checked_add(i.checked_mul(3)?)?
            .checked_add(heads)?;
        let per_slot = layer
            .checked_mul(self.num_hidden_layers as u64)?
            .checked_add(h.checked_mul(8)?)?;
        per_slot.checked_mul(slots as u64)?.checked_mul(8)
    }

    /// `d`: the head dimension, `hidden_size / num_attention_heads`.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads.max(1)
    }

    /// Checks that every size is non-zero and within the crate's limits, that
    /// the heads divide the hidden size, and that the activation and position
    /// embedding are the supported ones.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the field.
    pub fn validate(&self) -> Result<()> {
        let limits = [
            ("vocab_size", self.vocab_size, MAX_VOCAB),
            ("hidden_size", self.hidden_size, MAX_WIDTH),
            ("num_hidden_layers", self.num_hidden_layers, MAX_LAYERS),
            ("num_attention_heads", self.num_attention_heads, MAX_WIDTH),
            ("intermediate_size", self.intermediate_size, MAX_WIDTH),
            (
                "max_position_embeddings",
                self.max_position_embeddings,
                MAX_POSITIONS,
            ),
            ("type_vocab_size", self.type_vocab_size, MAX_WIDTH),
        ];
        for (field, value, max) in limits {
            if value == 0 || value > max {
                return Err(Error::invalid(
                    field,
                    format!("{value} is outside the supported 1..={max}"),
                ));
            }
        }
        ensure(
            self.num_parameters() <= MAX_PARAMETERS,
            "vocab_size",
            || {
                format!(
                    "the configuration has {} parameters, over the supported {MAX_PARAMETERS}",
                    self.num_parameters()
                )
            },
        )?;
        ensure(
            self.hidden_size.is_multiple_of(self.num_attention_heads),
            "num_attention_heads",
            || {
                format!(
                    "{} heads do not divide hidden_size {}",
                    self.num_attention_heads, self.hidden_size
                )
            },
        )?;
        ensure(self.pad_token_id < self.vocab_size, "pad_token_id", || {
            format!(
                "{} is not below vocab_size {}",
                self.pad_token_id, self.vocab_size
            )
        })?;
        let eps = self.layer_norm_eps;
        ensure(eps.is_finite() && eps > 0.0, "layer_norm_eps", || {
            format!("{eps} must be positive and finite")
        })?;
        ensure(self.hidden_act == "gelu", "hidden_act", || {
            format!(
                "{:?} is not supported; the reference implements the exact erf GELU (\"gelu\")",
                self.hidden_act
            )
        })?;
        let position = &self.position_embedding_type;
        ensure(position == "absolute", "position_embedding_type", || {
            format!("{position:?} is not supported (only \"absolute\")")
        })?;
        Ok(())
    }
}
