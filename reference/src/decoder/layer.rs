//! One decoder layer, forward and hand-written backward (the per-layer half
//! of [`super::model`]): pre-norm attention with rotary embeddings and
//! grouped-query heads, then the MLP, as the diagram in [`super::model`]
//! shows.

use ndarray::{Array1, Array2, Array3, ArrayView2, Axis, Slice};

use super::ops::{
    linear_nb, linear_nb_backward, rms_norm, rms_norm_backward, rope, rope_backward, rope_inv_freq,
    swiglu, swiglu_backward, RmsNormCache,
};
use super::params::{DecoderConfig, DecoderLayerParams, Mlp, Norm};
use crate::attention::{check_cu_seqlens, AttentionLayout, AttentionOutput};
use crate::bert::ops::{gelu_backward, gelu_map, layer_norm, layer_norm_backward, LayerNormCache};
use crate::error::{Error, Result};
use crate::ops::{AttentionOp, Grad, Qkv, Varlen};

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

    pub(super) fn check(&self, n: usize) -> Result<()> {
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

/// A norm's intermediates.
#[derive(Debug, Clone)]
pub enum NormCache {
    /// RMSNorm.
    Rms(RmsNormCache),
    /// LayerNorm.
    Layer(LayerNormCache),
}

/// The norm of `c` (`c.norm`, epsilon `c.norm_eps`) of `x: [n, hidden]`
/// with the gain `g` and bias `b: [hidden]` (the bias is `[0]` and unused
/// under RMSNorm).
pub fn norm_forward(
    c: &DecoderConfig,
    x: ArrayView2<f64>,
    g: &Array1<f64>,
    b: &Array1<f64>,
) -> (Array2<f64>, NormCache) {
    match c.norm {
        Norm::RmsNorm => {
            let (y, cache) = rms_norm(x, g.view(), c.norm_eps);
            (y, NormCache::Rms(cache))
        }
        Norm::LayerNorm => {
            let (y, cache) = layer_norm(x, g.view(), b.view(), c.norm_eps);
            (y, NormCache::Layer(cache))
        }
    }
}

/// Backward of [`norm_forward`] with the gain `g`: returns `dx` and adds to
/// the gain's and the bias's gradients `(gg, gb)` (the bias's untouched under
/// RMSNorm).
pub fn norm_backward(
    cache: &NormCache,
    g: &Array1<f64>,
    dy: ArrayView2<f64>,
    (gg, gb): (&mut Array1<f64>, &mut Array1<f64>),
) -> Array2<f64> {
    match cache {
        NormCache::Rms(c) => rms_norm_backward(c, g.view(), dy, gg.view_mut()),
        NormCache::Layer(c) => layer_norm_backward(c, g.view(), dy, gg.view_mut(), gb.view_mut()),
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
    let (h1, norm1) = norm_forward(c, x, &p.attn_norm_g, &p.attn_norm_b);
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
                Qkv::new(q.view(), k_all.view(), v_all.view()),
                &Varlen::cross(cu_seqlens, &cu_k, true, scale).with_window(c.window()),
            )?;
            (k_all, v_all, cu_k, out)
        }
        DecoderAttention::Dense { row_len, allowed } => {
            if c.sliding_window.is_some() {
                return Err(Error::invalid(
                    "sliding_window",
                    "the dense layout takes no window here: use the varlen layout",
                ));
            }
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
            let out = crate::attention::layout_forward(
                op,
                Qkv::new(q.view(), k.view(), v.view()),
                &layout,
                scale,
            )?;
            (k.clone(), v.clone(), Vec::new(), out)
        }
    };
    let mut x1 = linear_nb(join_heads(&out.output).view(), p.wo.view());
    x1 += &x;
    let (h2, norm2) = norm_forward(c, x1.view(), &p.mlp_norm_g, &p.mlp_norm_b);
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
        &p.mlp_norm_g,
        dh2.view(),
        (&mut g.mlp_norm_g, &mut g.mlp_norm_b),
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
                Qkv::new(cache.q.view(), cache.k_all.view(), cache.v_all.view()),
                &Varlen::cross(cu_seqlens, &cache.cu_seqlens_k, true, scale)
                    .with_window(c.window()),
                Grad::new(&cache.attention, da.view()),
            )?;
            (ag.grad_q, ag.grad_k, ag.grad_v)
        }
        DecoderAttention::Dense { row_len, allowed } => {
            let layout = AttentionLayout::Dense {
                row_len: *row_len,
                allowed: allowed.clone(),
            };
            let ag = crate::attention::layout_backward(
                op,
                Qkv::new(cache.q.view(), cache.k.view(), cache.v.view()),
                &layout,
                scale,
                Grad::new(&cache.attention, da.view()),
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
        &p.attn_norm_g,
        dh1.view(),
        (&mut g.attn_norm_g, &mut g.attn_norm_b),
    );
    dx += &dx1;
    Ok((dx, past_grads))
}
