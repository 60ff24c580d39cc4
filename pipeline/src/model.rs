//! The model the pipeline runs, its data, and the single-process reference.
//!
//! A BERT-style encoder built from the reference layers of
//! `packshard-reference` (`bert::layer`, `bert::ops`, `vocab`):
//!
//! ```text
//! e      = word[ids] + position[positions]              [n, hidden]  (input embedding)
//! x_0    = LayerNorm(e)                                 (embedding LayerNorm, BERT)
//! x_l    = encoder layer l (post-LN, varlen attention)  l = 1..L
//! logits = x_L W_out^T                                  [n, v]  (output layer, untied)
//! loss_m = mean over the non-ignored tokens of cross-entropy(logits, targets)
//! loss   = Σ_m (n_m / N) loss_m = (1 / N) Σ_tokens CE   (M microbatches)
//! ```
//!
//! The output layer `W_out: [v, hidden]` is separate from the word embedding
//! (the paper's setting, arXiv:2411.05288 §2: an input layer and an output
//! layer, each `v x hidden`), with no bias. Targets are next-token ids within
//! each sequence, `ignore_index` (-100) at a sequence's last token, so the
//! output layer runs on every token as in language-model training (with
//! MLM-style targets at 15% of the tokens the output layer would cost 7x
//! less and the vocabulary layers would not matter). The reduction over
//! microbatches is the mean over the step's tokens: microbatch `m` predicts
//! `n_m` tokens (its targets other than `ignore_index`), the step `N = Σ_m
//! n_m`, and its mean loss (and so its gradients) is scaled by `n_m / N`
//! ([`microbatch_scales`]). This is Megatron-LM's `calculate_per_token_loss`
//! and Hugging Face's `num_items_in_batch` (transformers PR 34191); the mean
//! of the microbatches' own means, `(1 / M) Σ_m loss_m`, differs from it as
//! soon as the microbatches predict different numbers of tokens
//! (docs/FAULTS.md D1).
//!
//! Shapes: `n` tokens of a microbatch (its sequences packed back to back,
//! `cu_seqlens: [b + 1]`), `hidden`, `v`, `L` layers, `M` microbatches.

use std::ops::Range;

use ndarray::{Array1, Array2, ArrayView2, ArrayViewD, ArrayViewMutD};
use packshard_reference::attention::{AttentionLayout, ReferenceAttention};
use packshard_reference::bert::layer::{layer_backward, layer_forward, LayerCache};
use packshard_reference::bert::ops::{layer_norm, layer_norm_backward, LayerNormCache};
use packshard_reference::bert::{BertConfig, BertParams, LayerParams};
use packshard_reference::vocab::embedding::{check_ids, embedding_forward};
use packshard_reference::vocab::{linear_cross_entropy, LossCall, LossConfig};
use packshard_reference::{Error, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// The ignore index of the targets (PyTorch's default).
pub use packshard_reference::vocab::IGNORE_INDEX;

/// The sizes of the model and of the data of one iteration.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// `v`: vocabulary entries (rows of the word embedding and of `W_out`).
    pub vocab: usize,
    /// `hidden`: width of every token vector.
    pub hidden: usize,
    /// Attention heads (`hidden / heads` is the head dimension).
    pub heads: usize,
    /// `L`: encoder layers.
    pub layers: usize,
    /// Width of the feed-forward layer.
    pub intermediate: usize,
    /// The longest sequence (and rows of the position embedding).
    pub seq_len: usize,
    /// Sequences per microbatch.
    pub sequences: usize,
    /// `M`: microbatches per iteration.
    pub microbatches: usize,
    /// Seed of the parameters and the data.
    pub seed: u64,
}

impl ModelConfig {
    /// The small model of the equivalence tests: `v` 97 (prime, so no shard
    /// count divides it evenly except 1), `hidden` 24, 4 heads, 5 layers (an
    /// uneven split over 2, 3 and 4 stages), feed-forward 40, sequences of
    /// 4..=7 tokens, 2 per microbatch, 5 microbatches (more than the stages,
    /// so 1F1B reaches its steady state at `p = 4`).
    pub fn tiny() -> Self {
        ModelConfig {
            vocab: 97,
            hidden: 24,
            heads: 4,
            layers: 5,
            intermediate: 40,
            seq_len: 7,
            sequences: 2,
            microbatches: 5,
            seed: 5,
        }
    }

    /// The shape of all-MiniLM-L6-v2 (`v` 30522, `hidden` 384, 12 heads, 6
    /// layers, feed-forward 1536), where the output layer costs about as
    /// much as the six encoder layers together (`v hidden` = 11.7M
    /// multiply-adds per token against `12 hidden^2` = 1.8M per layer). Short
    /// sequences (2 of at most 16 tokens per microbatch, 8 microbatches) keep
    /// an iteration in f64 on a 2-core machine to seconds.
    pub fn minilm() -> Self {
        ModelConfig {
            vocab: 30522,
            hidden: 384,
            heads: 12,
            layers: 6,
            intermediate: 1536,
            seq_len: 16,
            sequences: 2,
            microbatches: 8,
            seed: 5,
        }
    }

    /// The reference BERT configuration with these sizes (for its limits).
    pub fn bert_config(&self) -> BertConfig {
        BertConfig::tiny(
            self.vocab,
            self.hidden,
            self.heads,
            self.layers,
            self.intermediate,
            self.seq_len,
        )
    }

    /// Checks the sizes for a pipeline of `p` ranks.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the field: the reference BERT's
    /// limits ([`BertConfig::validate`]); fewer layers than stages (every
    /// stage holds at least one layer); fewer vocabulary entries than ranks;
    /// no microbatch, sequence or token; more than [`MAX_MICROBATCHES`]
    /// microbatches or [`MAX_TOKENS`] tokens per microbatch.
    pub fn validate(&self, p: usize) -> Result<()> {
        self.bert_config().validate()?;
        if self.layers < p {
            return Err(Error::invalid(
                "layers",
                format!(
                    "{} layers for {p} pipeline stages: every stage needs one",
                    self.layers
                ),
            ));
        }
        if self.vocab < p {
            return Err(Error::invalid(
                "vocab",
                format!("{} vocabulary entries for {p} shards", self.vocab),
            ));
        }
        for (field, value, max) in [
            ("microbatches", self.microbatches, MAX_MICROBATCHES),
            ("sequences", self.sequences, MAX_TOKENS),
            ("seq_len", self.seq_len, MAX_TOKENS),
        ] {
            if value == 0 || value > max {
                return Err(Error::invalid(
                    field,
                    format!("{value} is outside the supported 1..={max}"),
                ));
            }
        }
        if self.sequences * self.seq_len > MAX_TOKENS {
            return Err(Error::invalid(
                "sequences",
                format!(
                    "{} sequences of {} tokens is over the {MAX_TOKENS} tokens a microbatch may hold",
                    self.sequences, self.seq_len
                ),
            ));
        }
        Ok(())
    }

    /// One line: the sizes.
    pub fn describe(&self) -> String {
        format!(
            "v {}, hidden {}, {} heads, {} layers, feed-forward {}; {} microbatches of {} sequences of <= {} tokens",
            self.vocab,
            self.hidden,
            self.heads,
            self.layers,
            self.intermediate,
            self.microbatches,
            self.sequences,
            self.seq_len
        )
    }

    /// The loss options: mean over a microbatch's non-ignored tokens.
    pub fn loss_config(&self) -> LossConfig {
        LossConfig::default().with_ignore_index(IGNORE_INDEX)
    }

    /// LayerNorm epsilon (BERT's).
    pub fn eps(&self) -> f64 {
        1e-12
    }
}

/// The most microbatches per iteration.
pub const MAX_MICROBATCHES: usize = 1 << 12;
/// The most tokens per microbatch.
pub const MAX_TOKENS: usize = 1 << 14;

/// One microbatch: `b` sequences packed back to back (no padding).
#[derive(Debug, Clone, PartialEq)]
pub struct Microbatch {
    /// `[n]` token ids.
    pub ids: Vec<i64>,
    /// `[n]` position ids, restarting at 0 in every sequence.
    pub positions: Vec<usize>,
    /// `[n]` next-token targets, [`IGNORE_INDEX`] at each sequence's last token.
    pub targets: Vec<i64>,
    /// `cu_seqlens: [b + 1]` of the varlen attention.
    pub layout: AttentionLayout,
}

impl Microbatch {
    /// `n`: tokens.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Whether it holds no token.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }
}

/// The microbatches of one iteration, deterministic in `config.seed`
/// (ChaCha8): sequence lengths uniform in `ceil(seq_len / 2)..=seq_len` (the
/// first sequence of microbatch 0 is `seq_len` long, so every position row is
/// used), ids uniform in `0..v`.
pub fn microbatches(config: &ModelConfig) -> Vec<Microbatch> {
    let mut rng = ChaCha8Rng::seed_from_u64(config.seed ^ 0xda7a);
    let lo = config.seq_len.div_ceil(2);
    (0..config.microbatches)
        .map(|m| {
            let mut mb = Microbatch {
                ids: Vec::new(),
                positions: Vec::new(),
                targets: Vec::new(),
                layout: AttentionLayout::Varlen {
                    cu_seqlens: vec![0],
                },
            };
            for s in 0..config.sequences {
                let len = if m == 0 && s == 0 {
                    config.seq_len
                } else {
                    rng.random_range(lo..=config.seq_len)
                };
                let ids: Vec<i64> = (0..len)
                    .map(|_| rng.random_range(0..config.vocab as i64))
                    .collect();
                for t in 0..len {
                    mb.ids.push(ids[t]);
                    mb.positions.push(t);
                    mb.targets
                        .push(ids.get(t + 1).copied().unwrap_or(IGNORE_INDEX));
                }
                if let AttentionLayout::Varlen { cu_seqlens } = &mut mb.layout {
                    cu_seqlens.push(mb.ids.len());
                }
            }
            mb
        })
        .collect()
}

/// All parameters of the model (also used for their gradients).
#[derive(Debug, Clone, PartialEq)]
pub struct Params {
    /// `embeddings.word_embeddings.weight: [v, hidden]`.
    pub word: Array2<f64>,
    /// `embeddings.position_embeddings.weight: [seq_len, hidden]`.
    pub position: Array2<f64>,
    /// `embeddings.LayerNorm.weight: [hidden]`.
    pub ln_g: Array1<f64>,
    /// `embeddings.LayerNorm.bias: [hidden]`.
    pub ln_b: Array1<f64>,
    /// `encoder.layer.{l}.*`.
    pub layers: Vec<LayerParams>,
    /// `output.weight: [v, hidden]` (untied from `word`).
    pub output: Array2<f64>,
}

impl Params {
    /// Seeded parameters: the embeddings, LayerNorm and layers of
    /// [`BertParams::random`] (uniform, every tensor non-zero); `W_out`
    /// uniform with variance `1 / hidden` from its own ChaCha8 stream.
    pub fn random(config: &ModelConfig) -> Self {
        let bert = BertParams::random(&config.bert_config(), config.seed);
        let mut rng = ChaCha8Rng::seed_from_u64(config.seed ^ 0x0077);
        let a = (3.0 / config.hidden as f64).sqrt();
        let output =
            Array2::from_shape_simple_fn((config.vocab, config.hidden), || rng.random_range(-a..a));
        Params {
            word: bert.word_embeddings,
            position: bert.position_embeddings,
            ln_g: bert.emb_ln_g,
            ln_b: bert.emb_ln_b,
            layers: bert.layers,
            output,
        }
    }

    /// Zeros of the same shapes (a gradient).
    pub fn zeros_like(&self) -> Self {
        Params {
            word: Array2::zeros(self.word.dim()),
            position: Array2::zeros(self.position.dim()),
            ln_g: Array1::zeros(self.ln_g.len()),
            ln_b: Array1::zeros(self.ln_b.len()),
            layers: self.layers.iter().map(LayerParams::zeros_like).collect(),
            output: Array2::zeros(self.output.dim()),
        }
    }

    /// Every tensor, mutable, in the order of [`Params::named`].
    pub fn tensors_mut(&mut self) -> Vec<ArrayViewMutD<'_, f64>> {
        let mut out = vec![
            self.word.view_mut().into_dyn(),
            self.position.view_mut().into_dyn(),
            self.ln_g.view_mut().into_dyn(),
            self.ln_b.view_mut().into_dyn(),
        ];
        for p in &mut self.layers {
            out.extend(layer_tensors_mut(p));
        }
        out.push(self.output.view_mut().into_dyn());
        out
    }

    /// Every tensor with its name, in a fixed order.
    pub fn named(&self) -> Vec<(String, ArrayViewD<'_, f64>)> {
        let mut out = vec![
            (
                "embeddings.word_embeddings.weight".to_string(),
                self.word.view().into_dyn(),
            ),
            (
                "embeddings.position_embeddings.weight".to_string(),
                self.position.view().into_dyn(),
            ),
            (
                "embeddings.LayerNorm.weight".to_string(),
                self.ln_g.view().into_dyn(),
            ),
            (
                "embeddings.LayerNorm.bias".to_string(),
                self.ln_b.view().into_dyn(),
            ),
        ];
        for (l, p) in self.layers.iter().enumerate() {
            out.extend(layer_named(l, p));
        }
        out.push(("output.weight".to_string(), self.output.view().into_dyn()));
        out
    }
}

/// A layer's tensors, mutable, in the order of [`layer_named`]
/// ([`LayerParams::named_mut`]).
pub fn layer_tensors_mut(p: &mut LayerParams) -> Vec<ArrayViewMutD<'_, f64>> {
    p.named_mut().into_iter().map(|(_, t)| t).collect()
}

/// The tensors of layer `l` with their Hugging Face names
/// ([`LayerParams::named`] under `encoder.layer.{l}.`).
pub fn layer_named(l: usize, p: &LayerParams) -> Vec<(String, ArrayViewD<'_, f64>)> {
    (p.named().into_iter())
        .map(|(s, t)| (format!("encoder.layer.{l}.{s}"), t))
        .collect()
}

/// Values in a layer.
pub fn layer_values(p: &LayerParams) -> usize {
    layer_named(0, p).iter().map(|(_, t)| t.len()).sum()
}

// ---- the pieces every placement runs ------------------------------------------

/// What stage 0 keeps of the embedding for its backward.
#[derive(Debug, Clone)]
pub struct EmbeddingCache {
    /// The embedding LayerNorm's intermediates.
    pub ln: LayerNormCache,
}

/// The end of the input embedding: `word_rows: [n, hidden]` (the looked-up
/// word rows, from a local lookup or the vocabulary-parallel all-reduce)
/// plus the position rows, then the embedding LayerNorm. Returns `x_0: [n,
/// hidden]`.
///
/// # Errors
/// [`Error::IndexOutOfRange`] (field `positions`) for a position past the
/// table; [`Error::ShapeMismatch`] for rows of the wrong shape.
pub fn embedding_finish(
    mut word_rows: Array2<f64>,
    positions: &[usize],
    position: ArrayView2<f64>,
    ln_g: &Array1<f64>,
    ln_b: &Array1<f64>,
    eps: f64,
) -> Result<(Array2<f64>, EmbeddingCache)> {
    if word_rows.dim() != (positions.len(), position.ncols()) {
        return Err(Error::ShapeMismatch {
            field: "word_rows".into(),
            expected: format!("[n, hidden] = [{}, {}]", positions.len(), position.ncols()),
            actual: word_rows.shape().to_vec(),
        });
    }
    for (i, &pos) in positions.iter().enumerate() {
        if pos >= position.nrows() {
            return Err(Error::out_of_range(
                "positions",
                i,
                pos as i64,
                position.nrows(),
            ));
        }
        let mut row = word_rows.row_mut(i);
        row += &position.row(pos);
    }
    let (x, ln) = layer_norm(word_rows.view(), ln_g.view(), ln_b.view(), eps);
    Ok((x, EmbeddingCache { ln }))
}

/// Backward of [`embedding_finish`]: adds the LayerNorm and position
/// gradients and returns `∂L/∂word_rows: [n, hidden]`.
pub fn embedding_finish_backward(
    cache: &EmbeddingCache,
    positions: &[usize],
    ln_g: &Array1<f64>,
    dx: ArrayView2<f64>,
    grad_position: &mut Array2<f64>,
    grad_ln_g: &mut Array1<f64>,
    grad_ln_b: &mut Array1<f64>,
) -> Array2<f64> {
    let de = layer_norm_backward(
        &cache.ln,
        ln_g.view(),
        dx,
        grad_ln_g.view_mut(),
        grad_ln_b.view_mut(),
    );
    for (i, &pos) in positions.iter().enumerate() {
        let mut row = grad_position.row_mut(pos);
        row += &de.row(i);
    }
    de
}

/// The backward of the word lookup, accumulated in place: `grad[id - start]
/// += d_word_rows[i]` for the ids in `start..start + rows` (a shard's rows;
/// the whole table with `start = 0`). Token by token, as
/// `vocab::embedding::embedding_backward` sums, but into the running
/// gradient (no `[v, hidden]` buffer per microbatch).
///
/// # Errors
/// [`Error::IndexOutOfRange`] (field `ids`) for an id outside `0..v`.
pub fn word_grad_accumulate(
    ids: &[i64],
    v: usize,
    d_word_rows: ArrayView2<f64>,
    grad: &mut Array2<f64>,
    start: usize,
) -> Result<()> {
    let ids = check_ids(ids, v)?;
    let rows = grad.nrows();
    for (i, &id) in ids.iter().enumerate() {
        if id >= start && id < start + rows {
            let mut row = grad.row_mut(id - start);
            row += &d_word_rows.row(i);
        }
    }
    Ok(())
}

/// Forward of `layers` (a stage's contiguous encoder layers): `x: [n,
/// hidden]` → `[n, hidden]` and the caches their backward needs.
///
/// # Errors
/// Layout errors of the attention (a bad `cu_seqlens`).
pub fn layers_forward(
    layers: &[LayerParams],
    heads: usize,
    eps: f64,
    mut x: Array2<f64>,
    layout: &AttentionLayout,
) -> Result<(Array2<f64>, Vec<LayerCache>)> {
    let mut caches = Vec::with_capacity(layers.len());
    for lp in layers {
        let (y, cache) = layer_forward(lp, heads, eps, &ReferenceAttention, x.view(), layout)?;
        caches.push(cache);
        x = y;
    }
    Ok((x, caches))
}

/// Backward of [`layers_forward`]: `dy: [n, hidden]` → `∂L/∂x`, adding the
/// parameter gradients to `grads` (one per layer).
///
/// # Errors
/// As [`layers_forward`].
pub fn layers_backward(
    layers: &[LayerParams],
    grads: &mut [LayerParams],
    heads: usize,
    caches: &[LayerCache],
    layout: &AttentionLayout,
    mut dy: Array2<f64>,
) -> Result<Array2<f64>> {
    for l in (0..layers.len()).rev() {
        dy = layer_backward(
            &layers[l],
            &mut grads[l],
            heads,
            &ReferenceAttention,
            &caches[l],
            layout,
            dy.view(),
        )?;
    }
    Ok(dy)
}

/// The weight of each microbatch's mean loss in the step's loss: `n_m / N`,
/// `n_m` the targets of microbatch `m` other than [`IGNORE_INDEX`] and `N`
/// their sum over the step (the mean over the step's tokens). A microbatch
/// that predicts nothing weighs 0 (its mean loss is 0 by the loss's
/// convention); `[M]`.
///
/// # Errors
/// [`Error::InvalidArgument`] (field `targets`) when no microbatch predicts
/// any token (the step's mean would divide by 0).
pub fn microbatch_scales(microbatches: &[Microbatch]) -> Result<Vec<f64>> {
    let counts: Vec<usize> = microbatches
        .iter()
        .map(|mb| mb.targets.iter().filter(|&&t| t != IGNORE_INDEX).count())
        .collect();
    let total: usize = counts.iter().sum();
    if total == 0 {
        return Err(Error::invalid(
            "targets",
            "no microbatch of the step predicts a token: the mean over its tokens is undefined",
        ));
    }
    Ok(counts.iter().map(|&n| n as f64 / total as f64).collect())
}

/// The step's loss from each microbatch's mean loss: `Σ_m scales[m]
/// loss_m` ([`microbatch_scales`]), summed in microbatch order.
pub fn step_loss(losses: &[f64], scales: &[f64]) -> f64 {
    losses.iter().zip(scales).map(|(l, s)| l * s).sum()
}

/// The result of one iteration: the loss and every parameter gradient.
#[derive(Debug, Clone, PartialEq)]
pub struct StepResult {
    /// The mean over the step's predicted tokens: `Σ_m (n_m / N) loss_m`
    /// ([`step_loss`]), summed in microbatch order.
    pub loss: f64,
    /// `[M]`: each microbatch's mean loss.
    pub microbatch_losses: Vec<f64>,
    /// The gradients of `loss`.
    pub grads: Params,
}

/// The single-process reference: the same math on the same microbatches in
/// one process, no pipeline, no sharding — the unsharded reference ops
/// (`vocab::embedding_forward`, `bert::layer`, `vocab::linear_cross_entropy`)
/// one microbatch after the other, gradients accumulated in microbatch
/// order.
///
/// # Errors
/// Bad ids, targets or layouts, as the reference ops name them.
pub fn reference_step(
    config: &ModelConfig,
    params: &Params,
    microbatches: &[Microbatch],
) -> Result<StepResult> {
    let mut grads = params.zeros_like();
    let scales = microbatch_scales(microbatches)?;
    let loss_config = config.loss_config();
    let mut losses = Vec::with_capacity(microbatches.len());
    for (mb, &scale) in microbatches.iter().zip(&scales) {
        let rows = embedding_forward(&mb.ids, params.word.view())?;
        let (x, emb) = embedding_finish(
            rows,
            &mb.positions,
            params.position.view(),
            &params.ln_g,
            &params.ln_b,
            config.eps(),
        )?;
        let (hidden, caches) =
            layers_forward(&params.layers, config.heads, config.eps(), x, &mb.layout)?;
        let out = linear_cross_entropy(
            hidden.view(),
            params.output.view(),
            &LossCall::with_flag(&mb.targets, &loss_config, true),
        )?;
        losses.push(out.ce.loss);
        let (gx, gw) = scaled_output_grads(out.grad_hidden, out.grad_weight, scale)?;
        grads.output += &gw;
        let dx = layers_backward(
            &params.layers,
            &mut grads.layers,
            config.heads,
            &caches,
            &mb.layout,
            gx,
        )?;
        let d_rows = embedding_finish_backward(
            &emb,
            &mb.positions,
            &params.ln_g,
            dx.view(),
            &mut grads.position,
            &mut grads.ln_g,
            &mut grads.ln_b,
        );
        word_grad_accumulate(&mb.ids, config.vocab, d_rows.view(), &mut grads.word, 0)?;
    }
    Ok(StepResult {
        loss: step_loss(&losses, &scales),
        microbatch_losses: losses,
        grads,
    })
}

/// The output layer's gradients of one microbatch scaled by its weight in
/// the step, `n_m / N` ([`microbatch_scales`]), as every placement applies
/// them.
///
/// # Errors
/// [`Error::InvalidArgument`] when a gradient is missing.
pub fn scaled_output_grads(
    grad_hidden: Option<Array2<f64>>,
    grad_weight: Option<Array2<f64>>,
    scale: f64,
) -> Result<(Array2<f64>, Array2<f64>)> {
    let missing = || Error::invalid("output", "the output layer returned no gradient");
    let mut gx = grad_hidden.ok_or_else(missing)?;
    let mut gw = grad_weight.ok_or_else(missing)?;
    gx.mapv_inplace(|x| x * scale);
    gw.mapv_inplace(|x| x * scale);
    Ok((gx, gw))
}

/// The contiguous layers of each of `p` stages: `L / p` each, the first
/// `L % p` stages one more.
pub fn stage_layers(layers: usize, p: usize) -> Vec<Range<usize>> {
    let (base, extra) = (layers / p, layers % p);
    let mut start = 0;
    (0..p)
        .map(|s| {
            let len = base + usize::from(s < extra);
            let r = start..start + len;
            start += len;
            r
        })
        .collect()
}

#[cfg(test)]
mod tests;
