//! The decoder's configuration and parameters, named as Hugging Face's
//! `LlamaForCausalLM` names them.

use ndarray::{Array1, Array2, ArrayViewD, ArrayViewMutD};
use rand::{Rng, SeedableRng};

use crate::error::{check_len, ensure, ensure_nonzero, Error, Result};

/// The most elements one parameter tensor (or the logits `n * v`) may hold
/// (2^28, 2 GiB of f64): sizes from input are bounded before allocation.
pub const MAX_TENSOR: usize = 1 << 28;

/// The normalization before attention, before the MLP and before the LM head.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Norm {
    /// RMSNorm (Llama, Mistral, Qwen): a gain, no bias.
    RmsNorm,
    /// LayerNorm (GPT-2, GPT-NeoX): a gain and a bias.
    LayerNorm,
}

/// The feed-forward block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mlp {
    /// `down(silu(gate(x)) * up(x))` (Llama).
    SwiGlu,
    /// `down(gelu(up(x)))`, exact erf GELU (GPT-NeoX without biases).
    Gelu,
}

/// The shape of a decoder: sizes, norm, MLP, head tying, rotary base.
#[derive(Debug, Clone, PartialEq)]
pub struct DecoderConfig {
    /// `v`.
    pub vocab_size: usize,
    /// The residual width.
    pub hidden_size: usize,
    /// `h` query heads.
    pub num_heads: usize,
    /// `h_kv` key/value heads, dividing `h` (1: multi-query; `h`: multi-head).
    pub num_kv_heads: usize,
    /// `d`, even (rotary embeddings rotate pairs).
    pub head_dim: usize,
    /// The MLP's inner width.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_layers: usize,
    /// RMSNorm or LayerNorm.
    pub norm: Norm,
    /// SwiGLU or GELU.
    pub mlp: Mlp,
    /// The LM head is the input embedding (`tie_word_embeddings`).
    pub tie_embeddings: bool,
    /// The rotary base (`rope_theta`; 10000 in Llama 1/2).
    pub rope_theta: f64,
    /// The norms' epsilon (`rms_norm_eps`).
    pub norm_eps: f64,
    /// Hugging Face's `sliding_window` (Mistral, Gemma 2/3 local layers;
    /// `None`: full causal attention): a token attends to itself and the
    /// `sliding_window - 1` tokens before it in its document, flash-attention's
    /// `window_size = (sliding_window - 1, 0)`. That is transformers'
    /// convention (`masking_utils.sliding_window_overlay`: key `kv` is kept
    /// for query `q` when `kv > q - sliding_window`; its flash-attention
    /// path passes `window_size = (sliding_window - 1, sliding_window - 1)`
    /// with `causal`, the same mask) and vLLM's (`(sliding_window - 1, 0)`
    /// for a decoder). Every layer uses it. Applied through the attention's
    /// window option, so with packing it never crosses a document.
    pub sliding_window: Option<usize>,
}

impl DecoderConfig {
    /// `(hidden, h * d, h_kv * d, inter)`: the widths of the hidden state,
    /// the queries, the keys and values, and the MLP (the caller bounds the
    /// sizes with [`DecoderConfig::validate`]).
    pub fn widths(&self) -> (usize, usize, usize, usize) {
        (
            self.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
            self.intermediate_size,
        )
    }

    /// The six model dimensions by their field names, in declaration order:
    /// `vocab_size`, `hidden_size`, `num_heads`, `num_kv_heads`, `head_dim`,
    /// `intermediate_size` (each must be non-zero, [`DecoderConfig::validate`];
    /// `num_layers`, which may be 0, is not among them).
    pub fn dims(&self) -> [(&'static str, usize); 6] {
        // Each name is its field's own (`stringify!`): they cannot drift apart.
        macro_rules! named {
            ($($field:ident),*) => { [$((stringify!($field), self.$field)),*] };
        }
        named!(
            vocab_size,
            hidden_size,
            num_heads,
            num_kv_heads,
            head_dim,
            intermediate_size
        )
    }

    /// A small Llama-shaped config: RMSNorm, SwiGLU, untied head, theta 10000,
    /// eps 1e-6.
    pub fn tiny(
        vocab_size: usize,
        num_heads: usize,
        num_kv_heads: usize,
        head_dim: usize,
        intermediate_size: usize,
        num_layers: usize,
    ) -> Self {
        DecoderConfig {
            vocab_size,
            hidden_size: num_heads * head_dim,
            num_heads,
            num_kv_heads,
            head_dim,
            intermediate_size,
            num_layers,
            norm: Norm::RmsNorm,
            mlp: Mlp::SwiGlu,
            tie_embeddings: false,
            rope_theta: 10_000.0,
            norm_eps: 1e-6,
            sliding_window: None,
        }
    }

    /// The attention window of [`DecoderConfig::sliding_window`]:
    /// `(sliding_window - 1, 0)`, unbounded without one.
    pub fn window(&self) -> crate::attention::Window {
        match self.sliding_window {
            Some(w) => crate::attention::Window {
                left: Some(w.saturating_sub(1)),
                right: Some(0),
            },
            None => crate::attention::Window::UNBOUNDED,
        }
    }

    /// Checks sizes: all non-zero, `h_kv` dividing `h`, `d` even, every
    /// tensor within [`MAX_TENSOR`], `rope_theta > 1`, `norm_eps > 0`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the field.
    pub fn validate(&self) -> Result<()> {
        ensure_nonzero(&self.dims())?;
        let (h, h_kv, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        ensure(h.is_multiple_of(h_kv), "num_kv_heads", || {
            format!(
                "{h_kv} does not divide num_heads = {h} (grouped-query attention shares each key/value head among h / h_kv query heads)"
            )
        })?;
        ensure(d.is_multiple_of(2), "head_dim", || {
            format!("is {d}: rotary embeddings need an even head dim")
        })?;
        ensure(self.sliding_window != Some(0), "sliding_window", || {
            "is 0: a token attends at least to itself (None: no window)".to_string()
        })?;
        ensure(self.num_layers <= 1 << 10, "num_layers", || {
            format!("is {}, over the 1024 layers supported", self.num_layers)
        })?;
        // The widest matrix names the field that made it wide (the user's,
        // not always hidden_size).
        let (field, width, what) = [
            ("vocab_size", self.vocab_size, "vocab_size"),
            ("num_heads", h.saturating_mul(d), "num_heads x head_dim"),
            (
                "intermediate_size",
                self.intermediate_size,
                "intermediate_size",
            ),
        ]
        .into_iter()
        .max_by_key(|&(_, w, _)| w)
        .expect("three widths");
        let hidden = self.hidden_size;
        ensure(width.saturating_mul(hidden) <= MAX_TENSOR, field, || {
            format!(
                "{what} x hidden_size = {width} x {hidden} is over the {MAX_TENSOR} values one tensor may have"
            )
        })?;
        let (theta, eps) = (self.rope_theta, self.norm_eps);
        ensure(theta.is_finite() && theta > 1.0, "rope_theta", || {
            "must be finite and above 1".into()
        })?;
        // 0 is refused: a row of zeros would divide 0 by 0 (NaN), as
        // BERT's layer_norm_eps > 0.
        ensure(eps.is_finite() && eps > 0.0, "norm_eps", || {
            format!(
                "is {eps:e}: must be finite and above 0 (a row of zeros would normalize to NaN)"
            )
        })?;
        Ok(())
    }
}

layer_params! {
    /// One decoder layer's parameters (HF `LlamaDecoderLayer`), in f64 (the
    /// reference) or another element type `A` (an f32 kernel's copy). Tensors a
    /// configuration does not use are empty (`[0]` biases under RMSNorm, a
    /// `[0, hidden]` gate under GELU).
    #[derive(Debug, Clone, PartialEq)]
    pub struct DecoderLayerParams {
        /// `input_layernorm.weight: [hidden]`.
        attn_norm_g: Array1 "input_layernorm.weight",
        /// `input_layernorm.bias: [hidden]` (LayerNorm) or `[0]`.
        attn_norm_b: Array1 "input_layernorm.bias",
        /// `self_attn.q_proj.weight: [h * d, hidden]`.
        wq: Array2 "self_attn.q_proj.weight",
        /// `self_attn.k_proj.weight: [h_kv * d, hidden]`.
        wk: Array2 "self_attn.k_proj.weight",
        /// `self_attn.v_proj.weight: [h_kv * d, hidden]`.
        wv: Array2 "self_attn.v_proj.weight",
        /// `self_attn.o_proj.weight: [hidden, h * d]`.
        wo: Array2 "self_attn.o_proj.weight",
        /// `post_attention_layernorm.weight: [hidden]`.
        mlp_norm_g: Array1 "post_attention_layernorm.weight",
        /// `post_attention_layernorm.bias: [hidden]` (LayerNorm) or `[0]`.
        mlp_norm_b: Array1 "post_attention_layernorm.bias",
        /// `mlp.gate_proj.weight: [inter, hidden]` (SwiGLU) or `[0, hidden]`.
        w_gate: Array2 "mlp.gate_proj.weight",
        /// `mlp.up_proj.weight: [inter, hidden]`.
        w_up: Array2 "mlp.up_proj.weight",
        /// `mlp.down_proj.weight: [hidden, inter]`.
        w_down: Array2 "mlp.down_proj.weight",
    }
}

model_params! {
    /// Every parameter of a decoder (HF `LlamaForCausalLM`).
    #[derive(Debug, Clone, PartialEq)]
    pub struct DecoderParams {
        head {
            /// `model.embed_tokens.weight: [v, hidden]`.
            embed: Array2 "model.embed_tokens.weight",
        }
        /// `model.layers`.
        layers: Vec<DecoderLayerParams> "model.layers.",
        tail {
            /// `model.norm.weight: [hidden]`.
            final_norm_g: Array1 "model.norm.weight",
            /// `model.norm.bias: [hidden]` (LayerNorm) or `[0]`.
            final_norm_b: Array1 "model.norm.bias",
            /// `lm_head.weight: [v, hidden]`, or `[0, hidden]` when tied to `embed`.
            lm_head: Array2 "lm_head.weight",
        }
    }
}

impl DecoderParams {
    /// Seeded random parameters for `config` (ChaCha8): projections uniform
    /// in `±1/sqrt(fan_in)` (the order of PyTorch's default init), embedding
    /// and head uniform in `±1`, norm gains `1 ± 0.25`, biases `±0.1`, so
    /// every term of the backward is exercised with values of order 1.
    ///
    /// # Errors
    /// [`DecoderConfig::validate`]'s.
    pub fn random(config: &DecoderConfig, seed: u64) -> Result<Self> {
        config.validate()?;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let c = config;
        let (hid, qd, kvd, inter) = c.widths();
        let mut mat = |rows: usize, cols: usize, scale: f64| {
            Array2::from_shape_fn((rows, cols), |_| scale * (2.0 * rng.random::<f64>() - 1.0))
        };
        let fan = |n: usize| 1.0 / (n as f64).sqrt();
        let ln = c.norm == Norm::LayerNorm;
        let gate_rows = if c.mlp == Mlp::SwiGlu { inter } else { 0 };
        let mut layers = Vec::with_capacity(c.num_layers);
        for _ in 0..c.num_layers {
            let attn_norm_g = mat(1, hid, 0.25).row(0).mapv(|x| 1.0 + x);
            let attn_norm_b = mat(1, if ln { hid } else { 0 }, 0.1).row(0).to_owned();
            let wq = mat(qd, hid, fan(hid));
            let wk = mat(kvd, hid, fan(hid));
            let wv = mat(kvd, hid, fan(hid));
            let wo = mat(hid, qd, fan(qd));
            let mlp_norm_g = mat(1, hid, 0.25).row(0).mapv(|x| 1.0 + x);
            let mlp_norm_b = mat(1, if ln { hid } else { 0 }, 0.1).row(0).to_owned();
            let w_gate = mat(gate_rows, hid, fan(hid));
            let w_up = mat(inter, hid, fan(hid));
            let w_down = mat(hid, inter, fan(inter));
            layers.push(DecoderLayerParams {
                attn_norm_g,
                attn_norm_b,
                wq,
                wk,
                wv,
                wo,
                mlp_norm_g,
                mlp_norm_b,
                w_gate,
                w_up,
                w_down,
            });
        }
        let embed = mat(c.vocab_size, hid, 1.0);
        let final_norm_g = mat(1, hid, 0.25).row(0).mapv(|x| 1.0 + x);
        let final_norm_b = mat(1, if ln { hid } else { 0 }, 0.1).row(0).to_owned();
        let lm_head = mat(if c.tie_embeddings { 0 } else { c.vocab_size }, hid, 1.0);
        Ok(DecoderParams {
            embed,
            layers,
            final_norm_g,
            final_norm_b,
            lm_head,
        })
    }

    /// The same shapes, all zero (the gradient accumulator).
    pub fn zeros_like(&self) -> Self {
        let z1 = |a: &Array1<f64>| Array1::zeros(a.raw_dim());
        let z2 = |a: &Array2<f64>| Array2::zeros(a.raw_dim());
        DecoderParams {
            embed: z2(&self.embed),
            layers: self.layers.iter().map(|l| l.zeros_like()).collect(),
            final_norm_g: z1(&self.final_norm_g),
            final_norm_b: z1(&self.final_norm_b),
            lm_head: z2(&self.lm_head),
        }
    }

    /// Every non-empty tensor with its Hugging Face name, in a fixed order.
    pub fn named(&self) -> Vec<(String, ArrayViewD<'_, f64>)> {
        let mut out = self.named_all();
        out.retain(|(_, t)| !t.is_empty());
        out
    }

    /// The shape every tensor of [`DecoderParams::named`] has under `config`
    /// (empty ones included), in the same order.
    pub fn shapes(config: &DecoderConfig) -> Vec<(String, Vec<usize>)> {
        let c = config;
        let (hid, qd, kvd, inter) = c.widths();
        let b = if c.norm == Norm::LayerNorm { hid } else { 0 };
        let gate = if c.mlp == Mlp::SwiGlu { inter } else { 0 };
        let mut out = vec![(
            "model.embed_tokens.weight".to_string(),
            vec![c.vocab_size, hid],
        )];
        for i in 0..c.num_layers {
            let p = |s: &str| format!("model.layers.{i}.{s}");
            out.extend([
                (p("input_layernorm.weight"), vec![hid]),
                (p("input_layernorm.bias"), vec![b]),
                (p("self_attn.q_proj.weight"), vec![qd, hid]),
                (p("self_attn.k_proj.weight"), vec![kvd, hid]),
                (p("self_attn.v_proj.weight"), vec![kvd, hid]),
                (p("self_attn.o_proj.weight"), vec![hid, qd]),
                (p("post_attention_layernorm.weight"), vec![hid]),
                (p("post_attention_layernorm.bias"), vec![b]),
                (p("mlp.gate_proj.weight"), vec![gate, hid]),
                (p("mlp.up_proj.weight"), vec![inter, hid]),
                (p("mlp.down_proj.weight"), vec![hid, inter]),
            ]);
        }
        out.push(("model.norm.weight".into(), vec![hid]));
        out.push(("model.norm.bias".into(), vec![b]));
        let head = if c.tie_embeddings { 0 } else { c.vocab_size };
        out.push(("lm_head.weight".into(), vec![head, hid]));
        out
    }

    /// Checks every tensor's shape against `config` ([`DecoderParams::shapes`])
    /// and every value finite.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] naming the tensor (`model.layers.0.self_attn.k_proj.weight`,
    /// `model.layers` for a wrong layer count); [`Error::NonFiniteInput`].
    pub fn check(&self, config: &DecoderConfig) -> Result<()> {
        check_len(
            "model.layers",
            self.layers.len(),
            "num_layers",
            config.num_layers,
            "",
        )?;
        for ((name, t), (_, want)) in self.named_all().iter().zip(Self::shapes(config)) {
            if t.shape() != want.as_slice() {
                return Err(Error::ShapeMismatch {
                    field: name.clone(),
                    expected: format!("{want:?}"),
                    actual: t.shape().to_vec(),
                });
            }
            crate::error::check_finite(name, t.iter())?;
        }
        Ok(())
    }

    /// As [`DecoderParams::named`], mutable.
    pub fn named_mut(&mut self) -> Vec<(String, ArrayViewMutD<'_, f64>)> {
        let mut out = self.named_all_mut();
        out.retain(|(_, t)| !t.is_empty());
        out
    }
}
