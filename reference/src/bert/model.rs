//! The whole model: embeddings, encoder, pooler, MLM and NSP heads, losses,
//! and the backward pass of all of it, on a padded or a packed batch.
//!
//! A [`TokenBatch`] is the layout-independent description of one batch: a
//! flat list of `n` token slots (ids, positions, token types), the attention
//! layout over them, and for every input sequence the slots of its tokens.
//! [`TokenBatch::padded`] lays sequences out one per row with a key padding
//! mask (Hugging Face `BertModel` with `attention_mask`);
//! [`TokenBatch::packed`] takes a packed batch of [`crate::packing`] either
//! unpadded with `cu_seqlens` (flash-attention varlen) or as rows with a
//! block-diagonal mask. Everything after the layout is one code path, so the
//! padded and the packed model compute the same per-token arithmetic.

use std::path::Path;

use ndarray::{Array1, Array2, ArrayView2};

use super::config::BertConfig;
use super::layer::{layer_backward, layer_forward, LayerCache};
use super::loss::{
    cross_entropy, cross_entropy_backward, reduction_weights, Reduction, IGNORE_INDEX,
};
use super::ops::{
    gelu_backward, gelu_map, layer_norm, layer_norm_backward, linear, linear_backward,
};
use super::weights::BertParams;
use crate::attention::ReferenceAttention;
use crate::error::{Error, Result};
use crate::ops::AttentionOp;

/// The most MLM logits (`predicted tokens * v`) one run may hold (2^30, 8 GB
/// in f64): bounds the decoder's allocation before it is made.
pub const MAX_MLM_LOGITS: usize = 1 << 30;

use super::batch::to_index;
pub use super::batch::{LossWeights, PackedAttention, Targets, TokenBatch, MAX_MASK_ENTRIES};

/// What the model gives for one input sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct SequenceOutput {
    /// Last hidden state, `[len, hidden]`.
    pub hidden: Array2<f64>,
    /// `tanh(W_p h_CLS + b_p)`, `[hidden]`; `None` for an empty sequence.
    pub pooled: Option<Array1<f64>>,
    /// NSP logits `[2]`; `None` for an empty sequence.
    pub nsp_logits: Option<Array1<f64>>,
    /// The MLM cross-entropy of each predicted token, in token order.
    pub mlm_losses: Vec<f64>,
    /// d loss / d inputs_embeds (the word-embedding rows looked up for the
    /// sequence), `[len, hidden]`, when gradients were asked for.
    pub grad_inputs_embeds: Option<Array2<f64>>,
}

/// The result of [`BertModel::run`].
#[derive(Debug, Clone, PartialEq)]
pub struct BertOutput {
    /// One entry per input sequence, in input order.
    pub sequences: Vec<SequenceOutput>,
    /// `sum mlm weight * token loss`.
    pub mlm_loss: f64,
    /// `sum nsp weight * sequence loss`.
    pub nsp_loss: f64,
    /// `mlm_loss + nsp_loss`.
    pub loss: f64,
    /// Gradients of `loss` for every parameter (decoder contributions added
    /// to the tied word embeddings), when asked for.
    pub grads: Option<BertParams>,
}

impl BertOutput {
    /// The MLM loss under `reduction`, from the per-token losses (so both
    /// reductions can be reported from one run).
    pub fn mlm_loss_under(&self, reduction: Reduction) -> f64 {
        let counts: Vec<usize> = self.sequences.iter().map(|s| s.mlm_losses.len()).collect();
        let w = reduction_weights(&counts, reduction);
        self.sequences
            .iter()
            .zip(w)
            .map(|(s, w)| s.mlm_losses.iter().map(|l| w * l).sum::<f64>())
            .sum()
    }
}

/// A BERT model: configuration and parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct BertModel {
    /// Hyper-parameters.
    pub config: BertConfig,
    /// Parameters.
    pub params: BertParams,
}

/// The seed of the heads [`BertModel::load`] initialises when a checkpoint lacks them.
pub const HEAD_INIT_SEED: u64 = 0x5eed_0003;

impl BertModel {
    /// Random parameters ([`BertParams::random`]) for `config`.
    ///
    /// # Errors
    /// The errors of [`BertConfig::validate`].
    pub fn random(config: BertConfig, seed: u64) -> Result<Self> {
        config.validate()?;
        let params = BertParams::random(&config, seed);
        Ok(BertModel { config, params })
    }

    /// Loads `dir/config.json` and `dir/model.safetensors` (a Hugging Face
    /// BERT checkpoint); missing pre-training heads are initialised with
    /// [`HEAD_INIT_SEED`] (see [`BertParams::from_safetensors`]). Returns the
    /// model and the names of the initialised tensors.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] (field `model`) for unreadable files; the
    /// errors of [`BertConfig::from_json`] and [`BertParams::from_safetensors`].
    pub fn load(dir: &Path) -> Result<(Self, Vec<String>)> {
        let read = |name: &str| {
            let path = dir.join(name);
            std::fs::read(&path)
                .map_err(|e| Error::invalid("model", format!("{}: {e}", path.display())))
        };
        let config_text = read("config.json")?;
        let config = BertConfig::from_json("config.json", &String::from_utf8_lossy(&config_text))?;
        let bytes = read("model.safetensors")?;
        let (params, initialised) = BertParams::from_safetensors(&config, &bytes, HEAD_INIT_SEED)?;
        Ok((BertModel { config, params }, initialised))
    }

    /// Checks targets against the batch: one label per token, labels in the
    /// vocabulary or -100, NSP labels 0/1/-100, none for an empty sequence.
    fn check_targets(&self, batch: &TokenBatch, targets: &Targets, w: &LossWeights) -> Result<()> {
        let b = batch.sequences.len();
        for (field, len) in [
            ("mlm_labels", targets.mlm_labels.len()),
            ("nsp_labels", targets.nsp_labels.len()),
            ("loss_weights.mlm", w.mlm.len()),
            ("loss_weights.nsp", w.nsp.len()),
        ] {
            if len != b {
                return Err(Error::ShapeMismatch {
                    field: field.into(),
                    expected: format!("[b] = [{b}] (one per sequence)"),
                    actual: vec![len],
                });
            }
        }
        for (s, slots) in batch.sequences.iter().enumerate() {
            let labels = &targets.mlm_labels[s];
            if labels.len() != slots.len() || w.mlm[s].len() != slots.len() {
                return Err(Error::ShapeMismatch {
                    field: format!("mlm_labels[{s}]"),
                    expected: format!("[{}] (one per token of the sequence)", slots.len()),
                    actual: vec![labels.len()],
                });
            }
            for (t, &l) in labels.iter().enumerate() {
                if l != IGNORE_INDEX {
                    to_index(l, &format!("mlm_labels[{s}]"), t, self.config.vocab_size)?;
                }
            }
            let nsp = targets.nsp_labels[s];
            if nsp != IGNORE_INDEX {
                to_index(nsp, "nsp_labels", s, 2)?;
                if slots.is_empty() {
                    return Err(Error::invalid(
                        format!("nsp_labels[{s}]"),
                        "sequence is empty: it has no CLS token to classify (use -100)",
                    ));
                }
            }
        }
        Ok(())
    }

    /// Runs the model with the reference attention; see [`BertModel::run_with`].
    ///
    /// # Errors
    /// As [`BertModel::run_with`].
    pub fn run(
        &self,
        batch: &TokenBatch,
        targets: &Targets,
        weights: &LossWeights,
        want_grad: bool,
    ) -> Result<BertOutput> {
        self.run_with(
            &ReferenceAttention,
            batch,
            targets,
            weights,
            want_grad,
            None,
        )
    }

    /// Forward (and, if `want_grad`, backward) of embeddings, encoder, pooler,
    /// MLM head (decoder tied to the word embeddings) and NSP head, with the
    /// losses weighted by `weights`, on any layout. `inputs_embeds: [n,
    /// hidden]` replaces the word-embedding lookup (HF's `inputs_embeds`; the
    /// word-embedding gradient then holds only the decoder's part).
    ///
    /// The MLM head is evaluated at predicted positions only (the same values
    /// as evaluating it everywhere and selecting).
    ///
    /// # Errors
    /// The errors of [`TokenBatch::validate`] and of the target checks
    /// (shapes, label ranges), naming the field and index.
    pub fn run_with(
        &self,
        kernel: &dyn AttentionOp,
        batch: &TokenBatch,
        targets: &Targets,
        weights: &LossWeights,
        want_grad: bool,
        inputs_embeds: Option<&Array2<f64>>,
    ) -> Result<BertOutput> {
        let c = &self.config;
        let p = &self.params;
        batch.validate(c)?;
        self.check_targets(batch, targets, weights)?;
        let n = batch.num_tokens();
        crate::limits::check_estimate(
            "sequences",
            c.activation_bytes(n),
            &format!("the activations of {n} token slots through the model"),
        )?;
        let width = c.hidden_size;
        let eps = c.layer_norm_eps;

        // Embeddings: word (or inputs_embeds) + position + token type, LayerNorm.
        let mut e = match inputs_embeds {
            Some(x) => {
                if x.dim() != (n, width) {
                    return Err(Error::ShapeMismatch {
                        field: "inputs_embeds".into(),
                        expected: format!("[n, hidden] = [{n}, {width}]"),
                        actual: x.shape().to_vec(),
                    });
                }
                x.clone()
            }
            None => Array2::from_shape_fn((n, width), |(i, j)| {
                p.word_embeddings[[batch.input_ids[i], j]]
            }),
        };
        for i in 0..n {
            let mut row = e.row_mut(i);
            row += &p.position_embeddings.row(batch.position_ids[i]);
            row += &p.token_type_embeddings.row(batch.token_type_ids[i]);
        }
        let (mut x, emb_ln) = layer_norm(e.view(), p.emb_ln_g.view(), p.emb_ln_b.view(), eps);

        // Encoder.
        let mut caches: Vec<LayerCache> = Vec::with_capacity(p.layers.len());
        for lp in &p.layers {
            let (y, cache) = layer_forward(
                lp,
                c.num_attention_heads,
                eps,
                kernel,
                x.view(),
                &batch.layout,
            )?;
            caches.push(cache);
            x = y;
        }
        let hidden = x;

        // Pooler and NSP over non-empty sequences.
        let nonempty: Vec<usize> = (0..batch.sequences.len())
            .filter(|&s| !batch.sequences[s].is_empty())
            .collect();
        let cls = Array2::from_shape_fn((nonempty.len(), width), |(r, j)| {
            hidden[[batch.sequences[nonempty[r]][0], j]]
        });
        let pooled = linear(cls.view(), p.pooler_w.view(), p.pooler_b.view()).mapv(f64::tanh);
        let nsp_logits = linear(pooled.view(), p.nsp_w.view(), p.nsp_b.view());
        let nsp_targets: Vec<usize> = nonempty
            .iter()
            .map(|&s| targets.nsp_labels[s].max(0) as usize)
            .collect();
        let nsp_w: Vec<f64> = nonempty.iter().map(|&s| weights.nsp[s]).collect();
        let (nsp_ce, nsp_lse) = cross_entropy(nsp_logits.view(), &nsp_targets)?;
        let nsp_loss: f64 = nsp_ce.iter().zip(&nsp_w).map(|(l, w)| l * w).sum();

        // MLM head at predicted positions: (sequence, token, slot, label, weight).
        let mut picks = Vec::new();
        for (s, slots) in batch.sequences.iter().enumerate() {
            for (t, &slot) in slots.iter().enumerate() {
                let l = targets.mlm_labels[s][t];
                if l != IGNORE_INDEX {
                    picks.push((s, slot, l as usize, weights.mlm[s][t]));
                }
            }
        }
        if picks.len().saturating_mul(c.vocab_size) > MAX_MLM_LOGITS {
            return Err(Error::invalid(
                "mlm_labels",
                format!(
                    "{} predicted tokens x {} vocabulary entries is over the {MAX_MLM_LOGITS} logits one run may hold",
                    picks.len(),
                    c.vocab_size
                ),
            ));
        }
        let sel = Array2::from_shape_fn((picks.len(), width), |(r, j)| hidden[[picks[r].1, j]]);
        let t_pre = linear(sel.view(), p.mlm_dense_w.view(), p.mlm_dense_b.view());
        let t_act = gelu_map(t_pre.view());
        let (t, t_ln) = layer_norm(t_act.view(), p.mlm_ln_g.view(), p.mlm_ln_b.view(), eps);
        let logits = linear(t.view(), p.word_embeddings.view(), p.mlm_bias.view());
        let mlm_targets: Vec<usize> = picks.iter().map(|k| k.2).collect();
        let mlm_w: Vec<f64> = picks.iter().map(|k| k.3).collect();
        let (mlm_ce, mlm_lse) = cross_entropy(logits.view(), &mlm_targets)?;
        let mlm_loss: f64 = mlm_ce.iter().zip(&mlm_w).map(|(l, w)| l * w).sum();

        let mut sequences: Vec<SequenceOutput> = batch
            .sequences
            .iter()
            .map(|slots| SequenceOutput {
                hidden: Array2::from_shape_fn((slots.len(), width), |(t, j)| hidden[[slots[t], j]]),
                pooled: None,
                nsp_logits: None,
                mlm_losses: Vec::new(),
                grad_inputs_embeds: None,
            })
            .collect();
        for (r, &s) in nonempty.iter().enumerate() {
            sequences[s].pooled = Some(pooled.row(r).to_owned());
            sequences[s].nsp_logits = Some(nsp_logits.row(r).to_owned());
        }
        for (r, pick) in picks.iter().enumerate() {
            sequences[pick.0].mlm_losses.push(mlm_ce[r]);
        }

        let grads = if want_grad {
            let mut g = BertParams::zeros(c);
            let mut dh = Array2::<f64>::zeros((n, width));
            // MLM: decoder (tied), transform LayerNorm, GELU, dense.
            let dlogits = cross_entropy_backward(logits.view(), &mlm_targets, &mlm_lse, &mlm_w);
            let dt = param_backward!(
                linear_backward(t.view(), dlogits.view()), p => g, word_embeddings, mlm_bias
            );
            let dt_act =
                param_backward!(layer_norm_backward(&t_ln, dt.view()), p => g, mlm_ln_g, mlm_ln_b);
            let dt_pre = gelu_backward(t_pre.view(), dt_act.view());
            let dsel = param_backward!(
                linear_backward(sel.view(), dt_pre.view()), p => g, mlm_dense_w, mlm_dense_b
            );
            for (r, pick) in picks.iter().enumerate() {
                let mut row = dh.row_mut(pick.1);
                row += &dsel.row(r);
            }
            // NSP head and pooler.
            let dnsp = cross_entropy_backward(nsp_logits.view(), &nsp_targets, &nsp_lse, &nsp_w);
            let dpooled =
                param_backward!(linear_backward(pooled.view(), dnsp.view()), p => g, nsp_w, nsp_b);
            let dz = &dpooled * &pooled.mapv(|y| 1.0 - y * y);
            let dcls =
                param_backward!(linear_backward(cls.view(), dz.view()), p => g, pooler_w, pooler_b);
            for (r, &s) in nonempty.iter().enumerate() {
                let mut row = dh.row_mut(batch.sequences[s][0]);
                row += &dcls.row(r);
            }
            // Encoder, last layer first.
            for (l, cache) in caches.iter().enumerate().rev() {
                dh = layer_backward(
                    &p.layers[l],
                    &mut g.layers[l],
                    c.num_attention_heads,
                    kernel,
                    cache,
                    &batch.layout,
                    dh.view(),
                )?;
            }
            // Embedding LayerNorm, then the three lookups.
            let de = param_backward!(
                layer_norm_backward(&emb_ln, dh.view()), p => g, emb_ln_g, emb_ln_b
            );
            for i in 0..n {
                let row = de.row(i);
                if inputs_embeds.is_none() {
                    let mut w = g.word_embeddings.row_mut(batch.input_ids[i]);
                    w += &row;
                }
                let mut pe = g.position_embeddings.row_mut(batch.position_ids[i]);
                pe += &row;
                let mut te = g.token_type_embeddings.row_mut(batch.token_type_ids[i]);
                te += &row;
            }
            for (s, slots) in batch.sequences.iter().enumerate() {
                sequences[s].grad_inputs_embeds = Some(gather(de.view(), slots));
            }
            Some(g)
        } else {
            None
        };
        Ok(BertOutput {
            sequences,
            mlm_loss,
            nsp_loss,
            loss: mlm_loss + nsp_loss,
            grads,
        })
    }

    /// The encoder alone (no heads, no gradients): the last hidden state of
    /// each sequence, `[len, hidden]`, and its pooled output.
    ///
    /// # Errors
    /// As [`BertModel::run_with`].
    pub fn encode(&self, batch: &TokenBatch) -> Result<BertOutput> {
        let b = batch.sequences.len();
        let targets = Targets {
            mlm_labels: batch
                .sequences
                .iter()
                .map(|s| vec![IGNORE_INDEX; s.len()])
                .collect(),
            nsp_labels: vec![IGNORE_INDEX; b],
        };
        let weights = LossWeights::new(&targets, Reduction::PerToken);
        self.run(batch, &targets, &weights, false)
    }
}

fn gather(x: ArrayView2<f64>, slots: &[usize]) -> Array2<f64> {
    let mut out = Array2::zeros((slots.len(), x.ncols()));
    for (t, &i) in slots.iter().enumerate() {
        out.row_mut(t).assign(&x.row(i));
    }
    out
}
