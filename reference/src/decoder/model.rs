//! The decoder stack (Llama / GPT-NeoX shape), forward and hand-written
//! backward, over a packed (varlen) or padded (dense rows) token layout.
//!
//! ```text
//! x0  = embed[input_ids]                                  [n, hidden]
//! per layer:
//!   h1  = norm1(x)                                        (input_layernorm)
//!   q   = rope(h1 Wq^T, pos)  [n, h, d]; k = rope(h1 Wk^T, pos), v = h1 Wv^T  [n, h_kv, d]
//!   a   = causal attention(q, [past k; k], [past v; v])   (bottom-right, per segment)
//!   x1  = x + a Wo^T
//!   h2  = norm2(x1)                                       (post_attention_layernorm)
//!   out = x1 + Wd (silu(Wg h2) * Wu h2)    or   x1 + Wd gelu(Wu h2)
//! logits = normf(x_L) W^T,  W = lm_head or embed (tied)   [n, v]
//! ```
//!
//! Every projection is bias-free (Llama). The attention is any
//! [`AttentionOp`] (the reference's by default): its varlen form, causal, with
//! `cu_seqlens_k` covering each segment's cached keys followed by its new
//! ones when a [`KvCache`] is given (a continuation chunk, docs/FAULTS.md C5),
//! or its masked form, one dense mask per row (the padded batch, or packed
//! rows with a block-diagonal causal mask). Rotary embeddings use each
//! token's given position (docs/FAULTS.md C6).

use ndarray::{Array2, Array3, ArrayView1, ArrayView2, ArrayViewMut1, Axis, Slice};

use super::ops::{
    linear_nb, linear_nb_backward, rms_norm, rms_norm_backward, rope, rope_backward, rope_inv_freq,
    swiglu, swiglu_backward, RmsNormCache,
};
use super::params::{DecoderConfig, DecoderLayerParams, DecoderParams, Mlp, Norm, MAX_TENSOR};
use crate::attention::{check_cu_seqlens, AttentionLayout, AttentionOutput};
use crate::bert::ops::{gelu_backward, gelu_map, layer_norm, layer_norm_backward, LayerNormCache};
use crate::error::{check_finite, Error, Result};
use crate::ops::{AttentionOp, Varlen};
use crate::vocab::IGNORE_INDEX;

/// How the tokens of one batch attend.
#[derive(Debug, Clone, PartialEq)]
pub enum DecoderAttention {
    /// Back-to-back segments, `cu_seqlens: [b + 1]` (leading 0, last = `n`),
    /// causal within each segment (flash-attention's varlen with
    /// `causal=True`). With a [`KvCache`], segment `s`'s keys are its cached
    /// keys then its new ones, bottom-right aligned.
    Varlen {
        /// `[b + 1]`.
        cu_seqlens: Vec<usize>,
    },
    /// `allowed.len()` rows of `row_len` slots; `allowed[r]: [row_len,
    /// row_len]` says which key each query of row `r` may see (the mask
    /// carries causality: [`DecoderAttention::padded_rows`],
    /// [`DecoderAttention::block_causal`]).
    Dense {
        /// Slots per row.
        row_len: usize,
        /// One mask per row.
        allowed: Vec<Array2<bool>>,
    },
}

impl DecoderAttention {
    /// Right-padded rows, one sequence each (Hugging Face's causal LM with
    /// `attention_mask`): in row `r` of real length `lengths[r]`, query `i`
    /// sees key `j` when `j <= i` and `j < lengths[r]`.
    pub fn padded_rows(lengths: &[usize], row_len: usize) -> Self {
        DecoderAttention::Dense {
            row_len,
            allowed: lengths
                .iter()
                .map(|&l| Array2::from_shape_fn((row_len, row_len), |(i, j)| j <= i && j < l))
                .collect(),
        }
    }

    /// Packed rows with document ids (`doc_ids: [rows * row_len]`, 0 =
    /// padding): query `i` sees key `j` when `j <= i` and both are in the
    /// same non-padding document (FlexAttention's document mask). A padding
    /// query sees nothing (output 0, docs/FAULTS.md P8).
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] naming `doc_ids` when its length is not a
    /// multiple of `row_len`.
    pub fn block_causal(doc_ids: &[usize], row_len: usize) -> Result<Self> {
        if row_len == 0 || !doc_ids.len().is_multiple_of(row_len) {
            return Err(Error::ShapeMismatch {
                field: "doc_ids".into(),
                expected: format!("[rows * row_len] with row_len = {row_len}"),
                actual: vec![doc_ids.len()],
            });
        }
        Ok(DecoderAttention::Dense {
            row_len,
            allowed: doc_ids
                .chunks(row_len)
                .map(|row| {
                    Array2::from_shape_fn((row_len, row_len), |(i, j)| {
                        j <= i && row[i] != 0 && row[i] == row[j]
                    })
                })
                .collect(),
        })
    }

    fn check(&self, n: usize) -> Result<()> {
        match self {
            DecoderAttention::Varlen { cu_seqlens } => check_cu_seqlens(cu_seqlens, n),
            DecoderAttention::Dense { row_len, allowed } => {
                if row_len.saturating_mul(allowed.len()) != n {
                    return Err(Error::ShapeMismatch {
                        field: "input_ids".into(),
                        expected: format!(
                            "[rows * row_len] = [{} * {row_len}] (the dense attention's slots)",
                            allowed.len()
                        ),
                        actual: vec![n],
                    });
                }
                for (r, m) in allowed.iter().enumerate() {
                    if m.dim() != (*row_len, *row_len) {
                        return Err(Error::ShapeMismatch {
                            field: format!("allowed[{r}]"),
                            expected: format!("[row_len, row_len] = [{row_len}, {row_len}]"),
                            actual: m.shape().to_vec(),
                        });
                    }
                }
                Ok(())
            }
        }
    }
}

/// Keys and values of earlier tokens (post-rotary), per layer, for a
/// continuation chunk: segment `s` of the chunk continues cached tokens
/// `cu_seqlens[s]..cu_seqlens[s + 1]`.
#[derive(Debug, Clone, PartialEq)]
pub struct KvCache {
    /// `[b + 1]` over the cached tokens, as many segments as the chunk.
    pub cu_seqlens: Vec<usize>,
    /// Per layer `(k, v)`, each `[n_past, h_kv, d]`.
    pub layers: Vec<(Array3<f64>, Array3<f64>)>,
}

/// One batch's inputs: `n` token slots.
#[derive(Debug, Clone, Copy)]
pub struct DecoderInput<'a> {
    /// `[n]` token ids in `0..v` (padding slots hold a valid pad id).
    pub input_ids: &'a [i64],
    /// `[n]` each token's position (rotary angle), as the caller gives it.
    pub position_ids: &'a [usize],
    /// The layout.
    pub attention: &'a DecoderAttention,
    /// Cached keys and values the segments continue (varlen only).
    pub past: Option<&'a KvCache>,
}

/// A norm's intermediates.
#[derive(Debug, Clone)]
pub enum NormCache {
    /// RMSNorm.
    Rms(RmsNormCache),
    /// LayerNorm.
    Layer(LayerNormCache),
}

fn norm_forward(
    kind: Norm,
    x: ArrayView2<f64>,
    g: ArrayView1<f64>,
    b: ArrayView1<f64>,
    eps: f64,
) -> (Array2<f64>, NormCache) {
    match kind {
        Norm::RmsNorm => {
            let (y, c) = rms_norm(x, g, eps);
            (y, NormCache::Rms(c))
        }
        Norm::LayerNorm => {
            let (y, c) = layer_norm(x, g, b, eps);
            (y, NormCache::Layer(c))
        }
    }
}

fn norm_backward(
    cache: &NormCache,
    g: ArrayView1<f64>,
    dy: ArrayView2<f64>,
    gg: ArrayViewMut1<f64>,
    gb: ArrayViewMut1<f64>,
) -> Array2<f64> {
    match cache {
        NormCache::Rms(c) => rms_norm_backward(c, g, dy, gg),
        NormCache::Layer(c) => layer_norm_backward(c, g, dy, gg, gb),
    }
}

/// What one layer's backward needs.
#[derive(Debug, Clone)]
pub struct DecoderLayerCache {
    /// The layer input `x: [n, hidden]`.
    pub input: Array2<f64>,
    /// `norm1` intermediates.
    pub norm1: NormCache,
    /// `h1 = norm1(x): [n, hidden]`.
    pub h1: Array2<f64>,
    /// Rotated queries `[n, h, d]`.
    pub q: Array3<f64>,
    /// The new tokens' rotated keys `[n, h_kv, d]` (what a later chunk caches).
    pub k: Array3<f64>,
    /// The new tokens' values `[n, h_kv, d]`.
    pub v: Array3<f64>,
    /// The keys attention saw (cached then new, per segment): `[n_k, h_kv, d]`.
    pub k_all: Array3<f64>,
    /// The values attention saw.
    pub v_all: Array3<f64>,
    /// `cu_seqlens_k` of the attention (varlen).
    pub cu_seqlens_k: Vec<usize>,
    /// The attention output and its log-sum-exp.
    pub attention: AttentionOutput,
    /// `x1 = x + a Wo^T`.
    pub x1: Array2<f64>,
    /// `norm2` intermediates.
    pub norm2: NormCache,
    /// `h2 = norm2(x1)`.
    pub h2: Array2<f64>,
    /// `h2 Wg^T: [n, inter]` (SwiGLU; empty under GELU).
    pub gate: Array2<f64>,
    /// `h2 Wu^T: [n, inter]`.
    pub up: Array2<f64>,
    /// The MLP activation fed to `down_proj`: `[n, inter]`.
    pub act: Array2<f64>,
}

fn split_heads(x: Array2<f64>, heads: usize) -> Array3<f64> {
    let (n, w) = x.dim();
    x.into_shape_with_order((n, heads, w / heads))
        .expect("a standard-layout [n, heads * d] array reshapes")
}

fn join_heads(x: &Array3<f64>) -> Array2<f64> {
    let (n, h, d) = x.dim();
    x.as_standard_layout()
        .to_owned()
        .into_shape_with_order((n, h * d))
        .expect("a standard-layout [n, h, d] array reshapes")
}

/// Segment `s`'s keys are `past[cu_past[s]..]` then `new[cu_q[s]..]`.
fn interleave(
    past: &Array3<f64>,
    new: &Array3<f64>,
    cu_past: &[usize],
    cu_q: &[usize],
) -> Array3<f64> {
    let (np, h, d) = past.dim();
    let mut out = Array3::zeros((np + new.dim().0, h, d));
    let mut at = 0;
    for s in 0..cu_q.len() - 1 {
        for (src, a, b) in [
            (past, cu_past[s], cu_past[s + 1]),
            (new, cu_q[s], cu_q[s + 1]),
        ] {
            out.slice_axis_mut(Axis(0), Slice::from(at..at + b - a))
                .assign(&src.slice_axis(Axis(0), Slice::from(a..b)));
            at += b - a;
        }
    }
    out
}

/// The inverse of [`interleave`]: `(d past, d new)`.
fn split_keys(
    all: &Array3<f64>,
    n_past: usize,
    cu_past: &[usize],
    cu_q: &[usize],
) -> (Array3<f64>, Array3<f64>) {
    let (n, h, d) = all.dim();
    let mut past = Array3::zeros((n_past, h, d));
    let mut new = Array3::zeros((n - n_past, h, d));
    let mut at = 0;
    for s in 0..cu_q.len() - 1 {
        for (dst, a, b) in [
            (&mut past, cu_past[s], cu_past[s + 1]),
            (&mut new, cu_q[s], cu_q[s + 1]),
        ] {
            dst.slice_axis_mut(Axis(0), Slice::from(a..b))
                .assign(&all.slice_axis(Axis(0), Slice::from(at..at + b - a)));
            at += b - a;
        }
    }
    (past, new)
}

/// Forward of one layer: `x: [n, hidden]`, `positions: [n]`; `past:
/// (cu_seqlens, k, v)` of this layer's cache. Returns `[n, hidden]` and the
/// cache. The layer's parameters are taken as [`DecoderParams::check`]
/// passed them ([`DecoderModel::forward`] checks them).
///
/// # Errors
/// [`Error::ShapeMismatch`] naming `x`; the attention op's errors; [`Error::InvalidArgument`] naming `past` for a
/// cache under a dense layout.
#[allow(clippy::too_many_arguments)]
pub fn decoder_layer_forward(
    config: &DecoderConfig,
    p: &DecoderLayerParams,
    op: &dyn AttentionOp,
    x: ArrayView2<f64>,
    positions: &[usize],
    attention: &DecoderAttention,
    past: Option<(&[usize], &Array3<f64>, &Array3<f64>)>,
) -> Result<(Array2<f64>, DecoderLayerCache)> {
    let c = config;
    if x.ncols() != c.hidden_size || positions.len() != x.nrows() {
        return Err(Error::ShapeMismatch {
            field: "x".into(),
            expected: format!(
                "[n, hidden] = [{}, {}] (n: one row per position)",
                positions.len(),
                c.hidden_size
            ),
            actual: x.shape().to_vec(),
        });
    }
    let inv_freq = rope_inv_freq(c.head_dim, c.rope_theta)?;
    let scale = crate::attention::default_scale(c.head_dim);
    let (h1, norm1) = norm_forward(
        c.norm,
        x,
        p.attn_norm_g.view(),
        p.attn_norm_b.view(),
        c.norm_eps,
    );
    let q = rope(
        split_heads(linear_nb(h1.view(), p.wq.view()), c.num_heads).view(),
        positions,
        &inv_freq,
    )?;
    let k = rope(
        split_heads(linear_nb(h1.view(), p.wk.view()), c.num_kv_heads).view(),
        positions,
        &inv_freq,
    )?;
    let v = split_heads(linear_nb(h1.view(), p.wv.view()), c.num_kv_heads);
    let (k_all, v_all, cu_k, out) = match attention {
        DecoderAttention::Varlen { cu_seqlens } => {
            let (k_all, v_all, cu_k) = match past {
                None => (k.clone(), v.clone(), cu_seqlens.clone()),
                Some((cu_past, kp, vp)) => {
                    let cu_k: Vec<usize> =
                        cu_past.iter().zip(cu_seqlens).map(|(a, b)| a + b).collect();
                    (
                        interleave(kp, &k, cu_past, cu_seqlens),
                        interleave(vp, &v, cu_past, cu_seqlens),
                        cu_k,
                    )
                }
            };
            let out = op.varlen_forward(
                q.view(),
                k_all.view(),
                v_all.view(),
                &Varlen::cross(cu_seqlens, &cu_k, true, scale),
            )?;
            (k_all, v_all, cu_k, out)
        }
        DecoderAttention::Dense { row_len, allowed } => {
            if past.is_some() {
                return Err(Error::invalid(
                    "past",
                    "a key/value cache needs the varlen layout",
                ));
            }
            let layout = AttentionLayout::Dense {
                row_len: *row_len,
                allowed: allowed.clone(),
            };
            let out = op.forward(q.view(), k.view(), v.view(), &layout, scale)?;
            (k.clone(), v.clone(), Vec::new(), out)
        }
    };
    let mut x1 = linear_nb(join_heads(&out.output).view(), p.wo.view());
    x1 += &x;
    let (h2, norm2) = norm_forward(
        c.norm,
        x1.view(),
        p.mlp_norm_g.view(),
        p.mlp_norm_b.view(),
        c.norm_eps,
    );
    let up = linear_nb(h2.view(), p.w_up.view());
    let (gate, act) = match c.mlp {
        Mlp::SwiGlu => {
            let gate = linear_nb(h2.view(), p.w_gate.view());
            let act = swiglu(gate.view(), up.view());
            (gate, act)
        }
        Mlp::Gelu => (Array2::zeros((0, 0)), gelu_map(up.view())),
    };
    let mut y = linear_nb(act.view(), p.w_down.view());
    y += &x1;
    Ok((
        y,
        DecoderLayerCache {
            input: x.to_owned(),
            norm1,
            h1,
            q,
            k,
            v,
            k_all,
            v_all,
            cu_seqlens_k: cu_k,
            attention: out,
            x1,
            norm2,
            h2,
            gate,
            up,
            act,
        },
    ))
}

/// Backward of one layer: `dy: [n, hidden]`; adds parameter gradients to
/// `g`, returns `dx: [n, hidden]` and, with a cache, the gradients of the
/// cached `(k, v)`.
///
/// # Errors
/// The attention op's errors.
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
pub fn decoder_layer_backward(
    config: &DecoderConfig,
    p: &DecoderLayerParams,
    g: &mut DecoderLayerParams,
    op: &dyn AttentionOp,
    cache: &DecoderLayerCache,
    positions: &[usize],
    attention: &DecoderAttention,
    past_cu: Option<&[usize]>,
    dy: ArrayView2<f64>,
) -> Result<(Array2<f64>, Option<(Array3<f64>, Array3<f64>)>)> {
    let c = config;
    let inv_freq = rope_inv_freq(c.head_dim, c.rope_theta)?;
    let scale = crate::attention::default_scale(c.head_dim);
    // y = x1 + act Wd^T
    let dact = linear_nb_backward(cache.act.view(), p.w_down.view(), dy, g.w_down.view_mut());
    let dh2 = match c.mlp {
        Mlp::SwiGlu => {
            let (dgate, dup) = swiglu_backward(cache.gate.view(), cache.up.view(), dact.view());
            let mut d = linear_nb_backward(
                cache.h2.view(),
                p.w_gate.view(),
                dgate.view(),
                g.w_gate.view_mut(),
            );
            d += &linear_nb_backward(
                cache.h2.view(),
                p.w_up.view(),
                dup.view(),
                g.w_up.view_mut(),
            );
            d
        }
        Mlp::Gelu => {
            let dup = gelu_backward(cache.up.view(), dact.view());
            linear_nb_backward(
                cache.h2.view(),
                p.w_up.view(),
                dup.view(),
                g.w_up.view_mut(),
            )
        }
    };
    let mut dx1 = norm_backward(
        &cache.norm2,
        p.mlp_norm_g.view(),
        dh2.view(),
        g.mlp_norm_g.view_mut(),
        g.mlp_norm_b.view_mut(),
    );
    dx1 += &dy;
    // x1 = x + a Wo^T
    let a = join_heads(&cache.attention.output);
    let da = split_heads(
        linear_nb_backward(a.view(), p.wo.view(), dx1.view(), g.wo.view_mut()),
        c.num_heads,
    );
    let (dq, dk_all, dv_all) = match attention {
        DecoderAttention::Varlen { cu_seqlens } => {
            let ag = op.varlen_backward(
                cache.q.view(),
                cache.k_all.view(),
                cache.v_all.view(),
                &Varlen::cross(cu_seqlens, &cache.cu_seqlens_k, true, scale),
                &cache.attention,
                da.view(),
            )?;
            (ag.grad_q, ag.grad_k, ag.grad_v)
        }
        DecoderAttention::Dense { row_len, allowed } => {
            let layout = AttentionLayout::Dense {
                row_len: *row_len,
                allowed: allowed.clone(),
            };
            let ag = op.backward(
                cache.q.view(),
                cache.k.view(),
                cache.v.view(),
                &layout,
                scale,
                &cache.attention,
                da.view(),
            )?;
            (ag.grad_q, ag.grad_k, ag.grad_v)
        }
    };
    let (past_grads, dk, dv) = match (attention, past_cu) {
        (DecoderAttention::Varlen { cu_seqlens }, Some(cu_past)) => {
            let n_past = *cu_past.last().unwrap_or(&0);
            let (dkp, dk) = split_keys(&dk_all, n_past, cu_past, cu_seqlens);
            let (dvp, dv) = split_keys(&dv_all, n_past, cu_past, cu_seqlens);
            (Some((dkp, dvp)), dk, dv)
        }
        _ => (None, dk_all, dv_all),
    };
    let dq = join_heads(&rope_backward(dq.view(), positions, &inv_freq)?);
    let dk = join_heads(&rope_backward(dk.view(), positions, &inv_freq)?);
    let dv = join_heads(&dv);
    let h1 = cache.h1.view();
    let mut dh1 = linear_nb_backward(h1, p.wq.view(), dq.view(), g.wq.view_mut());
    dh1 += &linear_nb_backward(h1, p.wk.view(), dk.view(), g.wk.view_mut());
    dh1 += &linear_nb_backward(h1, p.wv.view(), dv.view(), g.wv.view_mut());
    let mut dx = norm_backward(
        &cache.norm1,
        p.attn_norm_g.view(),
        dh1.view(),
        g.attn_norm_g.view_mut(),
        g.attn_norm_b.view_mut(),
    );
    dx += &dx1;
    Ok((dx, past_grads))
}

/// The forward's results.
#[derive(Debug, Clone)]
pub struct DecoderForward {
    /// `[n, v]`.
    pub logits: Array2<f64>,
    /// Per layer.
    pub layers: Vec<DecoderLayerCache>,
    /// The last layer's output `[n, hidden]` (before the final norm).
    pub last: Array2<f64>,
    /// Final norm intermediates.
    pub final_norm: NormCache,
    /// `normf(last): [n, hidden]`, the LM head's input.
    pub hidden: Array2<f64>,
}

impl DecoderForward {
    /// This batch's keys and values (post-rotary), per layer, as a cache a
    /// continuation chunk of the same segments can attend to.
    pub fn present(&self, cu_seqlens: &[usize]) -> KvCache {
        KvCache {
            cu_seqlens: cu_seqlens.to_vec(),
            layers: self
                .layers
                .iter()
                .map(|l| (l.k.clone(), l.v.clone()))
                .collect(),
        }
    }
}

/// Gradients of a backward pass.
#[derive(Debug, Clone, PartialEq)]
pub struct DecoderGrads {
    /// Every parameter's gradient (the tied head's gradient in `embed`).
    pub params: DecoderParams,
    /// `[n, hidden]`: the gradient of the input embeddings.
    pub grad_inputs_embeds: Array2<f64>,
    /// With a cache: per layer, the gradients of the cached `(k, v)`.
    pub past: Option<Vec<(Array3<f64>, Array3<f64>)>>,
}

/// Forward, loss and backward of one batch.
#[derive(Debug, Clone, PartialEq)]
pub struct DecoderRun {
    /// `[n, v]`.
    pub logits: Array2<f64>,
    /// `[n]`: each slot's cross-entropy (0 for an ignored label).
    pub token_losses: Vec<f64>,
    /// `sum_i weights[i] * token_losses[i]`.
    pub loss: f64,
    /// The gradients of `loss`.
    pub grads: DecoderGrads,
}

/// A decoder: configuration and parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct DecoderModel {
    /// Sizes and options.
    pub config: DecoderConfig,
    /// Weights.
    pub params: DecoderParams,
}

impl DecoderModel {
    /// Seeded random weights ([`DecoderParams::random`]).
    ///
    /// # Errors
    /// [`DecoderConfig::validate`]'s.
    pub fn random(config: DecoderConfig, seed: u64) -> Result<Self> {
        let params = DecoderParams::random(&config, seed)?;
        Ok(DecoderModel { config, params })
    }

    fn head(&self) -> ArrayView2<'_, f64> {
        if self.config.tie_embeddings {
            self.params.embed.view()
        } else {
            self.params.lm_head.view()
        }
    }

    fn check_input(&self, input: &DecoderInput<'_>) -> Result<()> {
        let c = &self.config;
        c.validate()?;
        self.params.check(c)?;
        let n = input.input_ids.len();
        if n.saturating_mul(c.vocab_size.max(c.hidden_size).max(c.intermediate_size)) > MAX_TENSOR {
            return Err(Error::invalid(
                "input_ids",
                format!("{n} tokens is over the supported batch size"),
            ));
        }
        if input.position_ids.len() != n {
            return Err(Error::ShapeMismatch {
                field: "position_ids".into(),
                expected: format!("[n] = [{n}] (one per input id)"),
                actual: vec![input.position_ids.len()],
            });
        }
        for (i, &id) in input.input_ids.iter().enumerate() {
            if id < 0 || id as u64 >= c.vocab_size as u64 {
                return Err(Error::IndexOutOfRange {
                    field: "input_ids".into(),
                    index: i,
                    value: id,
                    lo: 0,
                    hi: c.vocab_size as i64,
                });
            }
        }
        input.attention.check(n)?;
        if let Some(past) = input.past {
            let DecoderAttention::Varlen { cu_seqlens } = input.attention else {
                return Err(Error::invalid(
                    "past",
                    "a key/value cache needs the varlen layout",
                ));
            };
            let n_past = *past.cu_seqlens.last().unwrap_or(&0);
            crate::attention::check_cu_seqlens_named(
                "past.cu_seqlens",
                "past.k",
                &past.cu_seqlens,
                n_past,
            )?;
            if past.cu_seqlens.len() != cu_seqlens.len() {
                return Err(Error::ShapeMismatch {
                    field: "past.cu_seqlens".into(),
                    expected: format!(
                        "[b + 1] = [{}] (one entry per segment of cu_seqlens)",
                        cu_seqlens.len()
                    ),
                    actual: vec![past.cu_seqlens.len()],
                });
            }
            if past.layers.len() != c.num_layers {
                return Err(Error::ShapeMismatch {
                    field: "past.layers".into(),
                    expected: format!("[num_layers] = [{}]", c.num_layers),
                    actual: vec![past.layers.len()],
                });
            }
            let want = [n_past, c.num_kv_heads, c.head_dim];
            for (l, (k, v)) in past.layers.iter().enumerate() {
                for (name, t) in [("k", k), ("v", v)] {
                    if t.shape() != want {
                        return Err(Error::ShapeMismatch {
                            field: format!("past.layers[{l}].{name}"),
                            expected: format!("[n_past, h_kv, d] = {want:?}"),
                            actual: t.shape().to_vec(),
                        });
                    }
                    check_finite(&format!("past.layers[{l}].{name}"), t.iter())?;
                }
            }
        }
        Ok(())
    }

    /// The forward pass: logits `[n, v]` and every intermediate.
    ///
    /// # Errors
    /// The config's and the parameters' ([`DecoderConfig::validate`],
    /// [`DecoderParams::check`]); [`Error::IndexOutOfRange`] (`input_ids`), [`Error::ShapeMismatch`]
    /// (`position_ids`, `allowed[r]`, `past.*`), the layout's
    /// [`Error::InvalidArgument`] (`cu_seqlens[i]`), the attention op's.
    pub fn forward(
        &self,
        op: &dyn AttentionOp,
        input: &DecoderInput<'_>,
    ) -> Result<DecoderForward> {
        self.check_input(input)?;
        let c = &self.config;
        let p = &self.params;
        let n = input.input_ids.len();
        let mut x = Array2::zeros((n, c.hidden_size));
        for (i, &id) in input.input_ids.iter().enumerate() {
            x.row_mut(i).assign(&p.embed.row(id as usize));
        }
        let mut layers = Vec::with_capacity(c.num_layers);
        for (l, lp) in p.layers.iter().enumerate() {
            let past = input
                .past
                .map(|kv| (kv.cu_seqlens.as_slice(), &kv.layers[l].0, &kv.layers[l].1));
            let (y, cache) = decoder_layer_forward(
                c,
                lp,
                op,
                x.view(),
                input.position_ids,
                input.attention,
                past,
            )?;
            layers.push(cache);
            x = y;
        }
        let (hidden, final_norm) = norm_forward(
            c.norm,
            x.view(),
            p.final_norm_g.view(),
            p.final_norm_b.view(),
            c.norm_eps,
        );
        let logits = linear_nb(hidden.view(), self.head());
        Ok(DecoderForward {
            logits,
            layers,
            last: x,
            final_norm,
            hidden,
        })
    }

    /// The backward pass from `grad_logits: [n, v]`.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] naming `grad_logits`; the attention op's.
    pub fn backward(
        &self,
        op: &dyn AttentionOp,
        input: &DecoderInput<'_>,
        fwd: &DecoderForward,
        grad_logits: ArrayView2<f64>,
    ) -> Result<DecoderGrads> {
        let c = &self.config;
        let p = &self.params;
        if grad_logits.dim() != fwd.logits.dim() {
            return Err(Error::ShapeMismatch {
                field: "grad_logits".into(),
                expected: format!("[n, v] = {:?}", fwd.logits.shape()),
                actual: grad_logits.shape().to_vec(),
            });
        }
        let mut g = p.zeros_like();
        let head_grad = if c.tie_embeddings {
            &mut g.embed
        } else {
            &mut g.lm_head
        };
        let dhidden = linear_nb_backward(
            fwd.hidden.view(),
            self.head(),
            grad_logits,
            head_grad.view_mut(),
        );
        let mut dx = norm_backward(
            &fwd.final_norm,
            p.final_norm_g.view(),
            dhidden.view(),
            g.final_norm_g.view_mut(),
            g.final_norm_b.view_mut(),
        );
        let past_cu = input.past.map(|kv| kv.cu_seqlens.as_slice());
        let mut past_grads = input.past.map(|_| Vec::with_capacity(c.num_layers));
        for l in (0..c.num_layers).rev() {
            let (d, pg) = decoder_layer_backward(
                c,
                &p.layers[l],
                &mut g.layers[l],
                op,
                &fwd.layers[l],
                input.position_ids,
                input.attention,
                past_cu,
                dx.view(),
            )?;
            if let (Some(all), Some(pg)) = (past_grads.as_mut(), pg) {
                all.push(pg);
            }
            dx = d;
        }
        if let Some(all) = past_grads.as_mut() {
            all.reverse();
        }
        for (i, &id) in input.input_ids.iter().enumerate() {
            let mut row = g.embed.row_mut(id as usize);
            row += &dx.row(i);
        }
        Ok(DecoderGrads {
            params: g,
            grad_inputs_embeds: dx,
            past: past_grads,
        })
    }

    /// Forward, the weighted next-token loss
    /// `sum_i weights[i] * CE(logits_i, labels[i])` ([`token_cross_entropy`];
    /// `labels[i] == -100` predicts nothing), and the backward of it.
    ///
    /// # Errors
    /// Those of [`DecoderModel::forward`] and [`token_cross_entropy`];
    /// [`Error::ShapeMismatch`] naming `weights`; [`Error::NonFiniteInput`]
    /// for a non-finite weight.
    pub fn run(
        &self,
        op: &dyn AttentionOp,
        input: &DecoderInput<'_>,
        labels: &[i64],
        weights: &[f64],
    ) -> Result<DecoderRun> {
        let n = input.input_ids.len();
        if weights.len() != n {
            return Err(Error::ShapeMismatch {
                field: "weights".into(),
                expected: format!("[n] = [{n}]"),
                actual: vec![weights.len()],
            });
        }
        check_finite("weights", weights)?;
        let fwd = self.forward(op, input)?;
        let (token_losses, grad) = token_cross_entropy(fwd.logits.view(), labels, weights)?;
        let loss = token_losses.iter().zip(weights).map(|(l, w)| l * w).sum();
        let grads = self.backward(op, input, &fwd, grad.view())?;
        Ok(DecoderRun {
            logits: fwd.logits,
            token_losses,
            loss,
            grads,
        })
    }
}

/// Cross-entropy of each row of `logits: [n, v]` against `labels: [n]`
/// (`-100` = no target: loss 0, no gradient), and the gradient of
/// `sum_i weights[i] * loss_i`: `weights[i] * (softmax(z_i) - onehot)`.
/// Returns `(loss: [n], grad_logits: [n, v])`, natural log.
///
/// # Errors
/// [`Error::ShapeMismatch`] naming `labels`; [`Error::IndexOutOfRange`]
/// naming `labels` and the index for a label outside `0..v` other than -100.
pub fn token_cross_entropy(
    logits: ArrayView2<f64>,
    labels: &[i64],
    weights: &[f64],
) -> Result<(Vec<f64>, Array2<f64>)> {
    let (n, v) = logits.dim();
    if labels.len() != n {
        return Err(Error::ShapeMismatch {
            field: "labels".into(),
            expected: format!("[n] = [{n}] (rows of logits)"),
            actual: vec![labels.len()],
        });
    }
    let mut loss = vec![0.0; n];
    let mut grad = Array2::zeros((n, v));
    for (i, &t) in labels.iter().enumerate() {
        if t == IGNORE_INDEX {
            continue;
        }
        if t < 0 || t as u64 >= v as u64 {
            return Err(Error::IndexOutOfRange {
                field: "labels".into(),
                index: i,
                value: t,
                lo: 0,
                hi: v as i64,
            });
        }
        let row = logits.row(i);
        let m = row.fold(f64::NEG_INFINITY, |a, &b| a.max(b));
        let lse = m + row.iter().map(|&z| (z - m).exp()).sum::<f64>().ln();
        loss[i] = lse - row[t as usize];
        let w = weights.get(i).copied().unwrap_or(0.0);
        let mut gr = grad.row_mut(i);
        for (j, &z) in row.iter().enumerate() {
            gr[j] = w * (z - lse).exp();
        }
        gr[t as usize] -= w;
    }
    Ok((loss, grad))
}
