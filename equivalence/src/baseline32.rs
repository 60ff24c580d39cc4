//! The reference's math run in `f32`: the yardstick of
//! [`crate::compare::RelativeRule`].
//!
//! Each function here is the f64 reference of `packshard-reference`
//! transcribed to `f32` as a straightforward implementation would write it:
//! the same formulas in the same order, plain sequential `f32` sums (no
//! compensation, no tiling, no SIMD, no threads), `f32::exp`/`ln` and
//! `libm::erff`. A kernel under test is judged by how its error against the
//! f64 reference compares with this baseline's error on the same inputs
//! (rounded to `f32`, or to `bf16`, first).
//!
//! - [`varlen_attention`], [`varlen_attention_backward`]: `reference::bert::attention`;
//!   [`varlen_attention_general`], [`varlen_attention_general_backward`]:
//!   `reference::attention` (grouped-query, `cu_seqlens_k`, bottom-right causal);
//! - [`layer_forward_backward`]: one encoder layer, `reference::bert::layer`;
//! - [`cross_entropy`], [`linear_cross_entropy`]: `reference::vocab::cross_entropy`
//!   (unsharded; the `rest = s - 1`, `ln_1p` and confident-target forms kept).

use ndarray::{Array1, Array2, Array3, ArrayView1, ArrayView2, ArrayView3, Axis};
use packshard_reference::attention::options::{alibi_bias, visible_keys};
use packshard_reference::attention::{
    check_qkv_shapes, check_varlen, AttentionGrads, AttentionOutput,
};
use packshard_reference::bert::attention::AttentionLayout;
use packshard_reference::bert::LayerParams;
use packshard_reference::ops::{AttentionOp, AttentionSupport, Grad, Masked, Qkv, Varlen};
use packshard_reference::vocab::{LossConfig, Reduction};
use packshard_reference::Result;

/// The roundings of the inputs (and of stored results), re-exported from
/// their one home, [`packshard_reference::precision`]: to nearest, ties to
/// even, bf16 and f16 through f32.
pub use packshard_reference::precision::{round_bf16, round_f16, round_f32};

/// An f64 tensor as f32 (callers round first, so this is exact).
pub fn to_f32<D: ndarray::Dimension>(x: &ndarray::ArrayView<f64, D>) -> ndarray::Array<f32, D> {
    x.mapv(|v| v as f32)
}

/// An f32 tensor as f64.
pub fn to_f64<D: ndarray::Dimension>(x: &ndarray::ArrayView<f32, D>) -> ndarray::Array<f64, D> {
    x.mapv(f64::from)
}

// ---- attention ----------------------------------------------------------------

/// `reference::bert::attention::varlen_attention` in f32 (self-attention
/// over one `cu_seqlens`): [`varlen_attention_general`] with `cu_seqlens_k
/// = cu_seqlens_q`.
pub fn varlen_attention(
    q: ArrayView3<f32>,
    k: ArrayView3<f32>,
    v: ArrayView3<f32>,
    cu_seqlens: &[usize],
    causal: bool,
    scale: f32,
) -> (Array3<f32>, Array2<f32>) {
    varlen_attention_general(q, k, v, (cu_seqlens, cu_seqlens), causal, scale)
}

/// One segment's geometry and options, in f32, for query `i` (a global
/// row) of segment `s` (bounds `wq`, `wk`): its visible keys (global
/// indices: bottom-right aligned on the used keys, `causal` and the window,
/// `reference::attention::options::visible_keys`) and its score of a raw
/// `scale * q . k` (the cap, then ALiBi's bias). Segment `s` of `p`.
struct SegmentRule<'a> {
    p: &'a Varlen<'a>,
    wq: [usize; 2],
    k0: usize,
    lk: usize,
}

impl SegmentRule<'_> {
    fn keys(&self, i: usize) -> std::ops::Range<usize> {
        let lq = self.wq[1] - self.wq[0];
        let r = visible_keys(i - self.wq[0], lq, self.lk, self.p.causal, self.p.window);
        self.k0 + r.start..self.k0 + r.end
    }

    /// `cap(raw) + bias` and `d cap / d raw` for query head `a`.
    fn score(&self, a: usize, i: usize, j: usize, raw: f32) -> (f32, f32) {
        let c = self.p.softcap as f32;
        let (mut s, chain) = if c > 0.0 {
            let t = (raw / c).tanh();
            (c * t, 1.0 - t * t)
        } else {
            (raw, 1.0)
        };
        if let Some(slopes) = self.p.alibi_slopes {
            let lq = self.wq[1] - self.wq[0];
            let bias = alibi_bias(slopes[a], i - self.wq[0], j - self.k0, lq, self.lk);
            s += bias as f32;
        }
        (s, chain)
    }
}

/// The segments of `p` as [`SegmentRule`]s.
fn segments<'a>(p: &'a Varlen<'a>) -> impl Iterator<Item = SegmentRule<'a>> + 'a {
    let cu_q = p.cu_seqlens_q;
    let cu_k = p.cu_seqlens_k;
    (0..cu_q.len().saturating_sub(1)).map(move |s| SegmentRule {
        p,
        wq: [cu_q[s], cu_q[s + 1]],
        k0: cu_k[s],
        lk: p.used_keys(s),
    })
}

/// `reference::attention::varlen_attention_general` in f32: `q: [n_q, h,
/// d]`, `k, v: [n_k, h_kv, d]` (query head `a` reads key head `a / (h /
/// h_kv)`), `(cu_seqlens_q, cu_seqlens_k)`, bottom-right causal masks;
/// returns `output: [n_q, h, d]` and `lse: [h, n_q]`. Inputs are assumed valid.
pub fn varlen_attention_general(
    q: ArrayView3<f32>,
    k: ArrayView3<f32>,
    v: ArrayView3<f32>,
    (cu_q, cu_k): (&[usize], &[usize]),
    causal: bool,
    scale: f32,
) -> (Array3<f32>, Array2<f32>) {
    let p = Varlen::cross(cu_q, cu_k, causal, f64::from(scale));
    varlen_attention_options(q, k, v, &p)
}

/// [`varlen_attention_general`] with flash-attention's options of `p`
/// (`window_size`, `softcap`, `alibi_slopes`, `seqused_k`:
/// `reference::attention::options`), the scores in f32; `p.scale` is
/// rounded to f32. Inputs are assumed valid (checked by the reference).
pub fn varlen_attention_options(
    q: ArrayView3<f32>,
    k: ArrayView3<f32>,
    v: ArrayView3<f32>,
    p: &Varlen<'_>,
) -> (Array3<f32>, Array2<f32>) {
    let (n, h, d) = q.dim();
    let group = h / k.dim().1;
    let scale = p.scale as f32;
    let mut output = Array3::zeros((n, h, d));
    let mut lse = Array2::from_elem((h, n), f32::NEG_INFINITY);
    for seg in segments(p) {
        for a in 0..h {
            let kv = a / group;
            for i in seg.wq[0]..seg.wq[1] {
                let keys = seg.keys(i);
                let mut scores = Vec::with_capacity(keys.len());
                let mut m = f32::NEG_INFINITY;
                for j in keys {
                    let mut dot = 0.0f32;
                    for c in 0..d {
                        dot += q[[i, a, c]] * k[[j, kv, c]];
                    }
                    let (s, _) = seg.score(a, i, j, scale * dot);
                    m = m.max(s);
                    scores.push((j, s));
                }
                if scores.is_empty() {
                    continue;
                }
                let sum: f32 = scores.iter().map(|&(_, s)| (s - m).exp()).sum();
                let l = m + sum.ln();
                lse[[a, i]] = l;
                for &(j, s) in &scores {
                    let p = (s - l).exp();
                    for c in 0..d {
                        output[[i, a, c]] += p * v[[j, kv, c]];
                    }
                }
            }
        }
    }
    (output, lse)
}

/// `reference::bert::attention::varlen_attention_backward` in f32: returns
/// `(grad_q, grad_k, grad_v)`, each `[n_tok, h, d]`.
#[allow(clippy::too_many_arguments)]
pub fn varlen_attention_backward(
    q: ArrayView3<f32>,
    k: ArrayView3<f32>,
    v: ArrayView3<f32>,
    cu_seqlens: &[usize],
    causal: bool,
    scale: f32,
    output: ArrayView3<f32>,
    lse: ArrayView2<f32>,
    grad_output: ArrayView3<f32>,
) -> [Array3<f32>; 3] {
    varlen_attention_general_backward(
        (q, k, v),
        (cu_seqlens, cu_seqlens),
        causal,
        scale,
        (output, lse),
        grad_output,
    )
}

/// `reference::attention::varlen_attention_general_backward` in f32:
/// returns `grad_q: [n_q, h, d]` and `grad_k, grad_v: [n_k, h_kv, d]`
/// (summed over the query heads of a group).
pub fn varlen_attention_general_backward(
    qkv: (ArrayView3<f32>, ArrayView3<f32>, ArrayView3<f32>),
    (cu_q, cu_k): (&[usize], &[usize]),
    causal: bool,
    scale: f32,
    fwd: (ArrayView3<f32>, ArrayView2<f32>),
    grad_output: ArrayView3<f32>,
) -> [Array3<f32>; 3] {
    let p = Varlen::cross(cu_q, cu_k, causal, f64::from(scale));
    varlen_attention_options_backward(qkv, &p, fwd, grad_output)
}

/// The backward of [`varlen_attention_options`]: the softcap's chain factor
/// `1 - tanh^2(raw / softcap)` times `scale` on each score's gradient
/// (ALiBi's bias has no gradient into `q` or `k`); keys past `seqused_k`
/// and outside the window get none.
pub fn varlen_attention_options_backward(
    (q, k, v): (ArrayView3<f32>, ArrayView3<f32>, ArrayView3<f32>),
    p: &Varlen<'_>,
    (output, lse): (ArrayView3<f32>, ArrayView2<f32>),
    grad_output: ArrayView3<f32>,
) -> [Array3<f32>; 3] {
    let (n, h, d) = q.dim();
    let group = h / k.dim().1;
    let scale = p.scale as f32;
    let mut g = [
        Array3::zeros((n, h, d)),
        Array3::zeros(k.dim()),
        Array3::zeros(k.dim()),
    ];
    for seg in segments(p) {
        for a in 0..h {
            let kv = a / group;
            for i in seg.wq[0]..seg.wq[1] {
                let l = lse[[a, i]];
                if l == f32::NEG_INFINITY {
                    continue;
                }
                let mut delta = 0.0f32;
                for c in 0..d {
                    delta += grad_output[[i, a, c]] * output[[i, a, c]];
                }
                for j in seg.keys(i) {
                    let mut dot = 0.0f32;
                    for c in 0..d {
                        dot += q[[i, a, c]] * k[[j, kv, c]];
                    }
                    let (s, chain) = seg.score(a, i, j, scale * dot);
                    let p = (s - l).exp();
                    let mut dp = 0.0f32;
                    for c in 0..d {
                        dp += grad_output[[i, a, c]] * v[[j, kv, c]];
                        g[2][[j, kv, c]] += p * grad_output[[i, a, c]];
                    }
                    let ds = p * (dp - delta) * chain * scale;
                    for c in 0..d {
                        g[0][[i, a, c]] += ds * k[[j, kv, c]];
                        g[1][[j, kv, c]] += ds * q[[i, a, c]];
                    }
                }
            }
        }
    }
    g
}

/// [`varlen_attention_general`] and its backward as an [`AttentionOp`]
/// (inputs rounded to f32, results widened): the f32 yardstick of a pipeline
/// whose attention is an f32 kernel (`causal::CausalLmImpl::baseline32`).
/// Varlen form only: the masked form is refused.
#[derive(Debug, Clone, Copy, Default)]
pub struct Baseline32Attention;

impl Baseline32Attention {
    fn inputs(Qkv { q, k, v }: &Qkv<'_>, p: &Varlen<'_>) -> Result<[Array3<f32>; 3]> {
        check_qkv_shapes(q.shape(), k.shape(), v.shape())?;
        check_varlen(p, q.dim().0, k.dim().0)?;
        Ok([to_f32(q), to_f32(k), to_f32(v)])
    }
}

impl AttentionOp for Baseline32Attention {
    fn support(&self) -> AttentionSupport {
        AttentionSupport::CAUSAL_GQA_CROSS
    }

    fn varlen_forward(&self, x: Qkv<'_>, p: &Varlen<'_>) -> Result<AttentionOutput> {
        let [q, k, v] = Self::inputs(&x, p)?;
        let cu = (p.cu_seqlens_q, p.cu_seqlens_k);
        let (o, l) =
            varlen_attention_general(q.view(), k.view(), v.view(), cu, p.causal, p.scale as f32);
        Ok(AttentionOutput {
            output: to_f64(&o.view()),
            lse: to_f64(&l.view()),
        })
    }

    fn varlen_backward(&self, x: Qkv<'_>, p: &Varlen<'_>, g: Grad<'_>) -> Result<AttentionGrads> {
        let [q, k, v] = Self::inputs(&x, p)?;
        let (o, l, go) = (
            to_f32(&g.fwd.output.view()),
            to_f32(&g.fwd.lse.view()),
            to_f32(&g.grad_output),
        );
        let [gq, gk, gv] = varlen_attention_general_backward(
            (q.view(), k.view(), v.view()),
            (p.cu_seqlens_q, p.cu_seqlens_k),
            p.causal,
            p.scale as f32,
            (o.view(), l.view()),
            go.view(),
        );
        Ok(AttentionGrads {
            grad_q: to_f64(&gq.view()),
            grad_k: to_f64(&gk.view()),
            grad_v: to_f64(&gv.view()),
        })
    }

    fn masked_forward(&self, _: Qkv<'_>, _: Masked<'_>) -> Result<AttentionOutput> {
        Err(masked_refused())
    }

    fn masked_backward(&self, _: Qkv<'_>, _: Masked<'_>, _: Grad<'_>) -> Result<AttentionGrads> {
        Err(masked_refused())
    }
}

fn masked_refused() -> packshard_reference::Error {
    packshard_reference::Error::invalid(
        "allowed",
        "the f32 baseline attention runs the varlen form only",
    )
}

// ---- encoder layer ------------------------------------------------------------

fn linear(x: ArrayView2<f32>, w: &Array2<f32>, b: &Array1<f32>) -> Array2<f32> {
    let mut y = x.dot(&w.t());
    y += b;
    y
}

fn linear_backward(
    x: ArrayView2<f32>,
    w: &Array2<f32>,
    dy: ArrayView2<f32>,
    gw: &mut Array2<f64>,
    gb: &mut Array1<f64>,
) -> Array2<f32> {
    *gw += &dy.t().dot(&x).mapv(f64::from);
    *gb += &dy.sum_axis(Axis(0)).mapv(f64::from);
    dy.dot(w)
}

fn layer_norm(
    x: ArrayView2<f32>,
    g: &Array1<f32>,
    b: &Array1<f32>,
    eps: f32,
) -> (Array2<f32>, Array2<f32>, Array1<f32>) {
    let (n, width) = x.dim();
    let mut x_hat = Array2::zeros((n, width));
    let mut inv_std = Array1::zeros(n);
    for (i, row) in x.rows().into_iter().enumerate() {
        let mean = row.sum() / width as f32;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / width as f32;
        let s = 1.0 / (var + eps).sqrt();
        inv_std[i] = s;
        for (h, &v) in x_hat.row_mut(i).iter_mut().zip(row) {
            *h = (v - mean) * s;
        }
    }
    let mut y = &x_hat * g;
    y += b;
    (y, x_hat, inv_std)
}

fn layer_norm_backward(
    x_hat: &Array2<f32>,
    inv_std: &Array1<f32>,
    gamma: &Array1<f32>,
    dy: ArrayView2<f32>,
    gg: &mut Array1<f64>,
    gb: &mut Array1<f64>,
) -> Array2<f32> {
    *gg += &(&dy * x_hat).sum_axis(Axis(0)).mapv(f64::from);
    *gb += &dy.sum_axis(Axis(0)).mapv(f64::from);
    let (n, width) = dy.dim();
    let mut dx = Array2::zeros((n, width));
    for i in 0..n {
        let g: Array1<f32> = &dy.row(i) * gamma;
        let xh = x_hat.row(i);
        let mean_g = g.sum() / width as f32;
        let mean_gx = g.iter().zip(xh).map(|(a, b)| a * b).sum::<f32>() / width as f32;
        let s = inv_std[i];
        for ((d, &gv), &x) in dx.row_mut(i).iter_mut().zip(&g).zip(xh) {
            *d = s * (gv - mean_g - x * mean_gx);
        }
    }
    dx
}

fn gelu(x: f32) -> f32 {
    0.5 * x * (1.0 + libm::erff(x * std::f32::consts::FRAC_1_SQRT_2))
}

fn gelu_grad(x: f32) -> f32 {
    let cdf = 0.5 * (1.0 + libm::erff(x * std::f32::consts::FRAC_1_SQRT_2));
    let pdf = (-0.5 * x * x).exp() / (2.0 * std::f32::consts::PI).sqrt();
    cdf + x * pdf
}

/// One encoder layer (`reference::bert::layer`) forward and backward in f32
/// over a varlen layout `cu_seqlens`: `x, grad_output: [n, hidden]`,
/// parameters rounded to f32. Returns `(output, grad_x)` and the parameter
/// gradients (f32 values held in f64).
///
/// # Panics
/// On inconsistent shapes (a test helper; inputs come from the suites).
pub fn layer_forward_backward(
    params: &LayerParams,
    num_heads: usize,
    eps: f64,
    x: ArrayView2<f32>,
    cu_seqlens: &[usize],
    grad_output: ArrayView2<f32>,
) -> (Array2<f32>, Array2<f32>, LayerParams) {
    let p = params.map(|a| a.mapv(|v| v as f32), |a| a.mapv(|v| v as f32));
    let eps = eps as f32;
    let (n, width) = x.dim();
    let d = width / num_heads;
    let scale = 1.0 / (d as f32).sqrt();
    let heads = |a: Array2<f32>| {
        a.into_shape_with_order((n, num_heads, d))
            .expect("[n, h, d]")
    };
    let q = heads(linear(x, &p.query_w, &p.query_b));
    let k = heads(linear(x, &p.key_w, &p.key_b));
    let v = heads(linear(x, &p.value_w, &p.value_b));
    let (att, lse) = varlen_attention(q.view(), k.view(), v.view(), cu_seqlens, false, scale);
    let a = att
        .clone()
        .into_shape_with_order((n, width))
        .expect("[n, hidden]");
    let mut r1 = linear(a.view(), &p.attn_out_w, &p.attn_out_b);
    r1 += &x;
    let (h1, xh1, is1) = layer_norm(r1.view(), &p.attn_ln_g, &p.attn_ln_b, eps);
    let pre = linear(h1.view(), &p.inter_w, &p.inter_b);
    let act = pre.mapv(gelu);
    let mut r2 = linear(act.view(), &p.out_w, &p.out_b);
    r2 += &h1;
    let (out, xh2, is2) = layer_norm(r2.view(), &p.out_ln_g, &p.out_ln_b, eps);

    let mut g = params.zeros_like();
    let dr2 = layer_norm_backward(
        &xh2,
        &is2,
        &p.out_ln_g,
        grad_output,
        &mut g.out_ln_g,
        &mut g.out_ln_b,
    );
    let dact = linear_backward(act.view(), &p.out_w, dr2.view(), &mut g.out_w, &mut g.out_b);
    let mut dpre = dact;
    dpre.zip_mut_with(&pre, |d, &x| *d *= gelu_grad(x));
    let mut dh1 = linear_backward(
        h1.view(),
        &p.inter_w,
        dpre.view(),
        &mut g.inter_w,
        &mut g.inter_b,
    );
    dh1 += &dr2;
    let dr1 = layer_norm_backward(
        &xh1,
        &is1,
        &p.attn_ln_g,
        dh1.view(),
        &mut g.attn_ln_g,
        &mut g.attn_ln_b,
    );
    let da = linear_backward(
        a.view(),
        &p.attn_out_w,
        dr1.view(),
        &mut g.attn_out_w,
        &mut g.attn_out_b,
    );
    let da = heads(da);
    let [dq, dk, dv] = varlen_attention_backward(
        q.view(),
        k.view(),
        v.view(),
        cu_seqlens,
        false,
        scale,
        att.view(),
        lse.view(),
        da.view(),
    );
    let flat = |t: Array3<f32>| t.into_shape_with_order((n, width)).expect("[n, hidden]");
    let mut dx = dr1;
    dx += &linear_backward(
        x,
        &p.query_w,
        flat(dq).view(),
        &mut g.query_w,
        &mut g.query_b,
    );
    dx += &linear_backward(x, &p.key_w, flat(dk).view(), &mut g.key_w, &mut g.key_b);
    dx += &linear_backward(
        x,
        &p.value_w,
        flat(dv).view(),
        &mut g.value_w,
        &mut g.value_b,
    );
    (out, dx, g)
}

/// Whether `layout` is varlen (the only layout [`layer_forward_backward`] takes).
pub fn varlen_cu_seqlens(layout: &AttentionLayout) -> Option<&[usize]> {
    match layout {
        AttentionLayout::Varlen { cu_seqlens } => Some(cu_seqlens),
        AttentionLayout::Dense { .. } => None,
    }
}

// ---- cross-entropy -------------------------------------------------------------

/// The unsharded cross-entropy in f32 (`reference::vocab::cross_entropy`).
#[derive(Debug, Clone, PartialEq)]
pub struct CrossEntropy32 {
    /// The reduced loss.
    pub loss: f32,
    /// `[n]`.
    pub per_token_loss: Vec<f32>,
    /// `[n]`, natural log.
    pub logsumexp: Vec<f32>,
    /// `[n, v]` with gradients.
    pub grad_logits: Option<Array2<f32>>,
}

/// Per-row summary, as `SoftmaxStats` (`rest = s - 1`).
#[derive(Debug, Clone, Copy)]
struct Stats {
    max: f32,
    rest: f32,
    target: f32,
}

fn row_stats(z: ArrayView1<f32>, q: impl Fn(usize) -> f32) -> Stats {
    let max = z.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let mut target = 0.0f32;
    for (j, &zj) in z.iter().enumerate() {
        let qj = q(j);
        if qj > 0.0 {
            target += if zj == f32::NEG_INFINITY {
                f32::INFINITY
            } else {
                qj * (max - zj)
            };
        }
    }
    if max == f32::NEG_INFINITY {
        return Stats {
            max,
            rest: -1.0,
            target,
        };
    }
    let (mut at_max, mut below) = (0.0f32, 0.0f32);
    for &zj in z {
        if zj == max {
            at_max += 1.0;
        } else {
            below += (zj - max).exp();
        }
    }
    Stats {
        max,
        rest: (at_max - 1.0) + below,
        target,
    }
}

/// Cross-entropy of `logits: [n, v]` (finite or `-inf`) against `targets:
/// [n]` under `config` (`call`), in f32, with `grad_logits` when `call`
/// asks for it (each row scaled by
/// [`packshard_reference::vocab::LossCall::token_weights`], the upstream
/// gradient multiplied in). Targets are assumed valid (in range or
/// `ignore_index`), rows of `-inf` only where ignored: run it after the
/// reference accepted the input.
pub fn cross_entropy(
    logits: ArrayView2<f32>,
    call: &packshard_reference::vocab::LossCall,
) -> CrossEntropy32 {
    let (targets, config): (&[i64], &LossConfig) = (call.targets, call.config);
    let (n, v) = logits.dim();
    // The softcap first (docs/FAULTS.md O1), `-inf` kept.
    let cap = config.softcap.map(|c| c as f32);
    let capped = cap.map(|c| {
        logits.mapv(|z| {
            if z == f32::NEG_INFINITY {
                z
            } else {
                c * (z / c).tanh()
            }
        })
    });
    let logits = capped.as_ref().map_or(logits, |z| z.view());
    let parsed: Vec<Option<usize>> = targets
        .iter()
        .map(|&t| (t != config.ignore_index).then_some(t as usize))
        .collect();
    let (qt, qo) = config.target_distribution(v);
    let (qt, qo) = (qt as f32, qo as f32);
    let q = |i: usize, j: usize| match parsed[i] {
        None => 0.0,
        Some(t) if t == j => qt,
        Some(_) => qo,
    };
    let c = config.z_loss as f32;
    let stats: Vec<Stats> = (0..n)
        .map(|i| row_stats(logits.row(i), |j| q(i, j)))
        .collect();
    let lse: Vec<f32> = stats.iter().map(|s| s.max + s.rest.ln_1p()).collect();
    let per_token_loss: Vec<f32> = (0..n)
        .map(|i| {
            if parsed[i].is_none() {
                return 0.0;
            }
            let ce = stats[i].target + stats[i].rest.ln_1p();
            if c == 0.0 {
                ce
            } else {
                ce + c * lse[i] * lse[i]
            }
        })
        .collect();
    let valid = parsed.iter().filter(|t| t.is_some()).count();
    let sum: f32 = per_token_loss.iter().sum();
    let loss = match config.reduction {
        Reduction::Mean if valid > 0 => sum / valid as f32,
        Reduction::Mean => 0.0,
        Reduction::Sum | Reduction::None => sum,
    };
    let weights: Vec<f32> = call
        .token_weights(&parsed)
        .iter()
        .map(|&w| w as f32)
        .collect();
    let grad_logits = call.want_grad().then(|| {
        Array2::from_shape_fn((n, v), |(i, j)| {
            let w = weights[i];
            if parsed[i].is_none() || w == 0.0 {
                return 0.0;
            }
            let s = &stats[i];
            let z = logits[[i, j]];
            let qij = q(i, j);
            let sum_exp = 1.0 + s.rest;
            let p = if z == f32::NEG_INFINITY {
                0.0
            } else if z == s.max {
                1.0 / sum_exp
            } else {
                (z - s.max).exp() / sum_exp
            };
            let delta = if z == s.max && qij > 0.5 {
                (1.0 - qij) - s.rest / sum_exp
            } else {
                p - qij
            };
            let g = if c == 0.0 {
                delta
            } else {
                delta + 2.0 * c * lse[i] * p
            };
            match cap {
                Some(cap) if z != f32::NEG_INFINITY => {
                    let t = z / cap;
                    w * g * ((1.0 - t) * (1.0 + t))
                }
                _ => w * g,
            }
        })
    });
    CrossEntropy32 {
        loss,
        per_token_loss,
        logsumexp: lse,
        grad_logits,
    }
}

/// `(grad_hidden [n, h], grad_weight [v, h])` in f32.
pub type LinearGrads32 = (Array2<f32>, Array2<f32>);

/// The output layer in f32: `logits = hidden @ weight^T` (`hidden: [n, h]`,
/// `weight: [v, h]`), [`cross_entropy`], and when `call` asks for
/// gradients `(grad_hidden [n, h], grad_weight [v, h])`.
pub fn linear_cross_entropy(
    hidden: ArrayView2<f32>,
    weight: ArrayView2<f32>,
    call: &packshard_reference::vocab::LossCall,
) -> (CrossEntropy32, Option<LinearGrads32>) {
    let logits = hidden.dot(&weight.t());
    let ce = cross_entropy(logits.view(), call);
    let grads = ce
        .grad_logits
        .as_ref()
        .map(|g| (g.dot(&weight), g.t().dot(&hidden)));
    (ce, grads)
}
