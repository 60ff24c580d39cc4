//! Scaled dot-product attention, dense with a mask and variable-length
//! (`cu_seqlens`), forward and backward, in `f64`.
//!
//! Shapes: `q, k, v: [n, h, d]` (tokens, heads, head dim), outputs
//! `[n, h, d]`, log-sum-exp `lse: [h, n]` (natural log), as
//! flash-attention's `flash_attn_varlen_func` lays them out.
//!
//! For query `i` and head `a` over its allowed keys `J(i)`:
//! `s_ij = scale * q_i . k_j`, `m_i = max_j s_ij`,
//! `lse_i = m_i + ln sum_j exp(s_ij - m_i)`, `p_ij = exp(s_ij - lse_i)`,
//! `o_i = sum_j p_ij v_j` (Vaswani et al. 2017, eq. 1). Masking follows the
//! additive convention of Hugging Face's `BertModel` taken to its limit: a
//! disallowed key adds `-inf` to its score, so `p_ij = 0` exactly.
//!
//! **A query with no allowed key** (a padding row under a block-diagonal mask,
//! every row of an empty sequence under a padding mask) has output 0,
//! `lse = -inf` and zero gradients — never NaN (FAULTS.md P8). In
//! variable-length attention an empty segment has no rows at all.
//!
//! Sums run over keys in increasing index order, so the dense and the
//! variable-length forms of the same problem perform the same operations in
//! the same order.

use ndarray::{Array2, Array3, ArrayView2, ArrayView3, Axis, Slice};

use crate::error::{Error, Result};

/// Output of an attention forward pass.
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionOutput {
    /// `[n, h, d]`.
    pub output: Array3<f64>,
    /// `[h, n]`, natural log; `-inf` for a query with no allowed key.
    pub lse: Array2<f64>,
}

/// Gradients of an attention pass.
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionGrads {
    /// `[n, h, d]`.
    pub grad_q: Array3<f64>,
    /// `[n, h, d]`.
    pub grad_k: Array3<f64>,
    /// `[n, h, d]`.
    pub grad_v: Array3<f64>,
}

/// `1 / sqrt(d)`, the scale of Vaswani et al. and flash-attention's default.
pub fn default_scale(head_dim: usize) -> f64 {
    1.0 / (head_dim as f64).sqrt()
}

fn check_qkv(q: &ArrayView3<f64>, k: &ArrayView3<f64>, v: &ArrayView3<f64>) -> Result<()> {
    check_qkv_shapes(q.shape(), k.shape(), v.shape())
}

/// Checks that `k` and `v` have the shape `[n_tok, h, d]` of `q` (shapes as
/// slices, so that kernels of any element type report the same error).
///
/// # Errors
/// [`Error::ShapeMismatch`] naming `k` or `v`.
pub fn check_qkv_shapes(q: &[usize], k: &[usize], v: &[usize]) -> Result<()> {
    let (n, h, d) = (q[0], q[1], q[2]);
    for (name, t) in [("k", k), ("v", v)] {
        if t != q {
            return Err(Error::ShapeMismatch {
                field: name.into(),
                expected: format!("[n_tok, h, d] = [{n}, {h}, {d}] (the shape of q)"),
                actual: t.to_vec(),
            });
        }
    }
    Ok(())
}

/// Checks `cu_seqlens: [b + 1]` against `n_tok` tokens: starts at 0, never
/// decreases, ends at `n_tok`.
///
/// # Errors
/// [`Error::InvalidArgument`] naming `cu_seqlens[i]`.
pub fn check_cu_seqlens(cu_seqlens: &[usize], n_tok: usize) -> Result<()> {
    match cu_seqlens.first() {
        None => return Err(Error::invalid("cu_seqlens", "must hold at least [0]")),
        Some(&c) if c != 0 => {
            return Err(Error::invalid(
                "cu_seqlens[0]",
                format!("is {c}, must be 0"),
            ))
        }
        _ => {}
    }
    for i in 1..cu_seqlens.len() {
        if cu_seqlens[i] < cu_seqlens[i - 1] {
            return Err(Error::invalid(
                format!("cu_seqlens[{i}]"),
                format!(
                    "{} is less than cu_seqlens[{}] = {} (must not decrease)",
                    cu_seqlens[i],
                    i - 1,
                    cu_seqlens[i - 1]
                ),
            ));
        }
    }
    let last = cu_seqlens[cu_seqlens.len() - 1];
    if last != n_tok {
        return Err(Error::invalid(
            format!("cu_seqlens[{}]", cu_seqlens.len() - 1),
            format!("is {last}, must equal the {n_tok} tokens of q"),
        ));
    }
    Ok(())
}

/// One head's attention for queries `qs` over keys `ks` (in key order), with
/// `allowed(i, j)` deciding the mask. Writes outputs and `lse` for the rows.
/// Shared by the dense and the varlen forms: same operations, same order.
#[allow(clippy::too_many_arguments)]
fn head_forward(
    q: &ArrayView3<f64>,
    k: &ArrayView3<f64>,
    v: &ArrayView3<f64>,
    head: usize,
    queries: std::ops::Range<usize>,
    keys: std::ops::Range<usize>,
    allowed: &dyn Fn(usize, usize) -> bool,
    scale: f64,
    output: &mut Array3<f64>,
    lse: &mut Array2<f64>,
) {
    let d = q.dim().2;
    let mut scores = Vec::with_capacity(keys.len());
    for i in queries {
        scores.clear();
        let mut m = f64::NEG_INFINITY;
        for j in keys.clone() {
            if allowed(i, j) {
                let mut dot = 0.0;
                for c in 0..d {
                    dot += q[[i, head, c]] * k[[j, head, c]];
                }
                let sc = scale * dot;
                m = m.max(sc);
                scores.push((j, sc));
            }
        }
        let row = i;
        if scores.is_empty() {
            lse[[head, row]] = f64::NEG_INFINITY;
            continue; // output row stays 0 (P8)
        }
        let sum: f64 = scores.iter().map(|&(_, sc)| (sc - m).exp()).sum();
        let l = m + sum.ln();
        lse[[head, row]] = l;
        for &(j, sc) in &scores {
            let p = (sc - l).exp();
            for c in 0..d {
                output[[row, head, c]] += p * v[[j, head, c]];
            }
        }
    }
}

/// Backward of one head, given the forward's `lse` (probabilities are
/// recomputed as `exp(s - lse)`, as flash-attention does).
#[allow(clippy::too_many_arguments)]
fn head_backward(
    q: &ArrayView3<f64>,
    k: &ArrayView3<f64>,
    v: &ArrayView3<f64>,
    out: &ArrayView3<f64>,
    dout: &ArrayView3<f64>,
    lse: &ArrayView2<f64>,
    head: usize,
    queries: std::ops::Range<usize>,
    keys: std::ops::Range<usize>,
    allowed: &dyn Fn(usize, usize) -> bool,
    scale: f64,
    grads: &mut AttentionGrads,
) {
    let d = q.dim().2;
    for i in queries {
        let l = lse[[head, i]];
        if l == f64::NEG_INFINITY {
            continue; // no allowed key: no gradient (P8)
        }
        // delta_i = sum_c dO_ic O_ic = sum_j p_ij dP_ij
        let mut delta = 0.0;
        for c in 0..d {
            delta += dout[[i, head, c]] * out[[i, head, c]];
        }
        for j in keys.clone() {
            if !allowed(i, j) {
                continue;
            }
            let mut dot = 0.0;
            for c in 0..d {
                dot += q[[i, head, c]] * k[[j, head, c]];
            }
            let p = (scale * dot - l).exp();
            let mut dp = 0.0;
            for c in 0..d {
                dp += dout[[i, head, c]] * v[[j, head, c]];
                grads.grad_v[[j, head, c]] += p * dout[[i, head, c]];
            }
            let ds = p * (dp - delta) * scale;
            for c in 0..d {
                grads.grad_q[[i, head, c]] += ds * k[[j, head, c]];
                grads.grad_k[[j, head, c]] += ds * q[[i, head, c]];
            }
        }
    }
}

/// Dense attention with a boolean mask: `q, k, v: [n, h, d]`,
/// `allowed: [n, n]` (`allowed[[i, j]]`: query `i` may attend to key `j`).
///
/// This is the padded (and packed-with-a-block-diagonal-mask) form: Hugging
/// Face's additive mask `0 / -inf` expressed as booleans.
///
/// # Errors
/// [`Error::ShapeMismatch`] if `k`, `v` or `allowed` do not fit `q`.
pub fn masked_attention(
    q: ArrayView3<f64>,
    k: ArrayView3<f64>,
    v: ArrayView3<f64>,
    allowed: ArrayView2<bool>,
    scale: f64,
) -> Result<AttentionOutput> {
    check_qkv(&q, &k, &v)?;
    let (n, h, d) = q.dim();
    check_mask(&allowed, n)?;
    let mut output = Array3::zeros((n, h, d));
    let mut lse = Array2::zeros((h, n));
    let ok = |i: usize, j: usize| allowed[[i, j]];
    for head in 0..h {
        head_forward(
            &q,
            &k,
            &v,
            head,
            0..n,
            0..n,
            &ok,
            scale,
            &mut output,
            &mut lse,
        );
    }
    Ok(AttentionOutput { output, lse })
}

fn check_mask(allowed: &ArrayView2<bool>, n: usize) -> Result<()> {
    check_mask_shape(allowed.shape(), n)
}

/// Checks that a dense mask is `[n, n]`.
///
/// # Errors
/// [`Error::ShapeMismatch`] naming `mask`.
pub fn check_mask_shape(allowed: &[usize], n: usize) -> Result<()> {
    if allowed != [n, n] {
        return Err(Error::ShapeMismatch {
            field: "mask".into(),
            expected: format!("[n, n] = [{n}, {n}]"),
            actual: allowed.to_vec(),
        });
    }
    Ok(())
}

/// Backward of [`masked_attention`]: `grad_output: [n, h, d]`, `fwd` the
/// forward's result. Rows with no allowed key get zero gradients.
///
/// # Errors
/// [`Error::ShapeMismatch`] if the tensors do not fit `q`.
pub fn masked_attention_backward(
    q: ArrayView3<f64>,
    k: ArrayView3<f64>,
    v: ArrayView3<f64>,
    allowed: ArrayView2<bool>,
    scale: f64,
    fwd: &AttentionOutput,
    grad_output: ArrayView3<f64>,
) -> Result<AttentionGrads> {
    check_qkv(&q, &k, &v)?;
    let (n, h, d) = q.dim();
    check_mask(&allowed, n)?;
    check_grad(&grad_output, fwd, (n, h, d))?;
    let mut grads = zero_grads((n, h, d));
    let ok = |i: usize, j: usize| allowed[[i, j]];
    for head in 0..h {
        head_backward(
            &q,
            &k,
            &v,
            &fwd.output.view(),
            &grad_output,
            &fwd.lse.view(),
            head,
            0..n,
            0..n,
            &ok,
            scale,
            &mut grads,
        );
    }
    Ok(grads)
}

fn zero_grads(dim: (usize, usize, usize)) -> AttentionGrads {
    AttentionGrads {
        grad_q: Array3::zeros(dim),
        grad_k: Array3::zeros(dim),
        grad_v: Array3::zeros(dim),
    }
}

fn check_grad(
    grad_output: &ArrayView3<f64>,
    fwd: &AttentionOutput,
    dim: (usize, usize, usize),
) -> Result<()> {
    check_grad_shapes(
        grad_output.shape(),
        fwd.output.shape(),
        fwd.lse.shape(),
        dim,
    )
}

/// Checks the backward's inputs against `dim = (n_tok, h, d)`:
/// `grad_output: [n_tok, h, d]`, the forward's `output: [n_tok, h, d]` and
/// `lse: [h, n_tok]`.
///
/// # Errors
/// [`Error::ShapeMismatch`] naming `grad_output` or `lse`.
pub fn check_grad_shapes(
    grad_output: &[usize],
    output: &[usize],
    lse: &[usize],
    dim: (usize, usize, usize),
) -> Result<()> {
    let (n, h, d) = dim;
    if grad_output != [n, h, d] {
        return Err(Error::ShapeMismatch {
            field: "grad_output".into(),
            expected: format!("[n_tok, h, d] = [{n}, {h}, {d}]"),
            actual: grad_output.to_vec(),
        });
    }
    if output != [n, h, d] || lse != [h, n] {
        return Err(Error::ShapeMismatch {
            field: "lse".into(),
            expected: format!("[h, n_tok] = [{h}, {n}] with output [{n}, {h}, {d}]"),
            actual: lse.to_vec(),
        });
    }
    Ok(())
}

/// Variable-length attention, the form of flash-attention's
/// `flash_attn_varlen_func`: `q, k, v: [n_tok, h, d]` hold the tokens of `b`
/// segments back to back, segment `s` being tokens
/// `cu_seqlens[s]..cu_seqlens[s + 1]` (`cu_seqlens: [b + 1]`, leading 0).
/// Queries attend only to keys of their own segment (and, if `causal`, only to
/// keys at or before their own position). Empty segments are allowed and have
/// no rows.
///
/// Returns `output: [n_tok, h, d]` and `lse: [h, n_tok]`.
///
/// # Errors
/// [`Error::ShapeMismatch`] for `k`/`v` not shaped like `q`; the errors of
/// [`check_cu_seqlens`].
pub fn varlen_attention(
    q: ArrayView3<f64>,
    k: ArrayView3<f64>,
    v: ArrayView3<f64>,
    cu_seqlens: &[usize],
    causal: bool,
    scale: f64,
) -> Result<AttentionOutput> {
    check_qkv(&q, &k, &v)?;
    let (n, h, d) = q.dim();
    check_cu_seqlens(cu_seqlens, n)?;
    let mut output = Array3::zeros((n, h, d));
    let mut lse = Array2::zeros((h, n));
    let ok = |i: usize, j: usize| !causal || j <= i;
    for w in cu_seqlens.windows(2) {
        for head in 0..h {
            head_forward(
                &q,
                &k,
                &v,
                head,
                w[0]..w[1],
                w[0]..w[1],
                &ok,
                scale,
                &mut output,
                &mut lse,
            );
        }
    }
    Ok(AttentionOutput { output, lse })
}

/// Backward of [`varlen_attention`]: `grad_output: [n_tok, h, d]`; returns
/// `grad_q`, `grad_k`, `grad_v`, each `[n_tok, h, d]`.
///
/// # Errors
/// As [`varlen_attention`], and [`Error::ShapeMismatch`] for `grad_output`.
#[allow(clippy::too_many_arguments)] // the argument list of flash-attention's varlen backward
pub fn varlen_attention_backward(
    q: ArrayView3<f64>,
    k: ArrayView3<f64>,
    v: ArrayView3<f64>,
    cu_seqlens: &[usize],
    causal: bool,
    scale: f64,
    fwd: &AttentionOutput,
    grad_output: ArrayView3<f64>,
) -> Result<AttentionGrads> {
    check_qkv(&q, &k, &v)?;
    let (n, h, d) = q.dim();
    check_cu_seqlens(cu_seqlens, n)?;
    check_grad(&grad_output, fwd, (n, h, d))?;
    let mut grads = zero_grads((n, h, d));
    let ok = |i: usize, j: usize| !causal || j <= i;
    for w in cu_seqlens.windows(2) {
        for head in 0..h {
            head_backward(
                &q,
                &k,
                &v,
                &fwd.output.view(),
                &grad_output,
                &fwd.lse.view(),
                head,
                w[0]..w[1],
                w[0]..w[1],
                &ok,
                scale,
                &mut grads,
            );
        }
    }
    Ok(grads)
}

/// The attention probabilities `p: [h, n, n]` of a dense masked problem (an
/// intermediate exposed for comparison; 0 where masked, a zero row for a
/// query with no allowed key).
///
/// # Errors
/// As [`masked_attention`].
pub fn masked_attention_probs(
    q: ArrayView3<f64>,
    k: ArrayView3<f64>,
    allowed: ArrayView2<bool>,
    scale: f64,
) -> Result<Array3<f64>> {
    check_qkv(&q, &k, &k)?;
    let (n, h, d) = q.dim();
    check_mask(&allowed, n)?;
    let fwd = masked_attention(q, k, k, allowed, scale)?;
    let mut p = Array3::zeros((h, n, n));
    for head in 0..h {
        for i in 0..n {
            let l = fwd.lse[[head, i]];
            if l == f64::NEG_INFINITY {
                continue;
            }
            for j in 0..n {
                if allowed[[i, j]] {
                    let mut dot = 0.0;
                    for c in 0..d {
                        dot += q[[i, head, c]] * k[[j, head, c]];
                    }
                    p[[head, i, j]] = (scale * dot - l).exp();
                }
            }
        }
    }
    Ok(p)
}

/// Where the model's attention runs: the token layout of one batch.
#[derive(Debug, Clone, PartialEq)]
pub enum AttentionLayout {
    /// `allowed.len()` rows of `row_len` tokens each (`n = rows * row_len`),
    /// row `r` being tokens `r * row_len..(r + 1) * row_len`, with a dense mask
    /// `allowed[r]: [row_len, row_len]` per row. The padded batch (key padding
    /// mask) and the packed batch with a block-diagonal mask use this form.
    Dense {
        /// Tokens per row.
        row_len: usize,
        /// Per row, `[row_len, row_len]`: query `i` may attend to key `j`.
        allowed: Vec<Array2<bool>>,
    },
    /// Unpadded tokens of back-to-back segments, `cu_seqlens: [b + 1]`
    /// (flash-attention's varlen form), bidirectional.
    Varlen {
        /// `[b + 1]`, leading 0, last = `n_tok`.
        cu_seqlens: Vec<usize>,
    },
}

impl AttentionLayout {
    /// Tokens covered by the layout.
    pub fn num_tokens(&self) -> usize {
        match self {
            AttentionLayout::Dense { row_len, allowed } => row_len * allowed.len(),
            AttentionLayout::Varlen { cu_seqlens } => cu_seqlens.last().copied().unwrap_or(0),
        }
    }
}

/// The attention the model runs: replaceable, so that a kernel under test can
/// be checked inside the whole model (forward, backward, losses).
pub trait AttentionKernel {
    /// A short name for reports.
    fn name(&self) -> String;
    /// Forward over a layout: `q, k, v: [n, h, d]`; returns `[n, h, d]` and `lse: [h, n]`.
    ///
    /// # Errors
    /// Shape or layout errors.
    fn forward(
        &self,
        q: ArrayView3<f64>,
        k: ArrayView3<f64>,
        v: ArrayView3<f64>,
        layout: &AttentionLayout,
        scale: f64,
    ) -> Result<AttentionOutput>;
    /// Backward over a layout.
    ///
    /// # Errors
    /// Shape or layout errors.
    #[allow(clippy::too_many_arguments)]
    fn backward(
        &self,
        q: ArrayView3<f64>,
        k: ArrayView3<f64>,
        v: ArrayView3<f64>,
        layout: &AttentionLayout,
        scale: f64,
        fwd: &AttentionOutput,
        grad_output: ArrayView3<f64>,
    ) -> Result<AttentionGrads>;
}

/// The reference kernel: [`masked_attention`] row by row for
/// [`AttentionLayout::Dense`], [`varlen_attention`] for [`AttentionLayout::Varlen`].
#[derive(Debug, Clone, Copy, Default)]
pub struct ReferenceAttention;

/// Checks that a layout covers `n` token slots (dense rows: `rows * row_len
/// == n`; varlen layouts are checked by [`check_cu_seqlens`]).
///
/// # Errors
/// [`Error::ShapeMismatch`] naming `q`.
pub fn check_layout(layout: &AttentionLayout, n: usize) -> Result<()> {
    if let AttentionLayout::Dense { row_len, allowed } = layout {
        if row_len * allowed.len() != n {
            return Err(Error::ShapeMismatch {
                field: "q".into(),
                expected: format!("[rows * row_len = {}, h, d]", row_len * allowed.len()),
                actual: vec![n],
            });
        }
    }
    Ok(())
}

impl AttentionKernel for ReferenceAttention {
    fn name(&self) -> String {
        "reference".into()
    }

    fn forward(
        &self,
        q: ArrayView3<f64>,
        k: ArrayView3<f64>,
        v: ArrayView3<f64>,
        layout: &AttentionLayout,
        scale: f64,
    ) -> Result<AttentionOutput> {
        check_qkv(&q, &k, &v)?;
        let (n, h, d) = q.dim();
        check_layout(layout, n)?;
        match layout {
            AttentionLayout::Varlen { cu_seqlens } => {
                varlen_attention(q, k, v, cu_seqlens, false, scale)
            }
            AttentionLayout::Dense { row_len, allowed } => {
                let mut output = Array3::zeros((n, h, d));
                let mut lse = Array2::zeros((h, n));
                for (r, mask) in allowed.iter().enumerate() {
                    let rows = r * row_len..(r + 1) * row_len;
                    let f = masked_attention(
                        q.slice_axis(Axis(0), Slice::from(rows.clone())),
                        k.slice_axis(Axis(0), Slice::from(rows.clone())),
                        v.slice_axis(Axis(0), Slice::from(rows.clone())),
                        mask.view(),
                        scale,
                    )?;
                    output
                        .slice_axis_mut(Axis(0), Slice::from(rows.clone()))
                        .assign(&f.output);
                    lse.slice_axis_mut(Axis(1), Slice::from(rows))
                        .assign(&f.lse);
                }
                Ok(AttentionOutput { output, lse })
            }
        }
    }

    fn backward(
        &self,
        q: ArrayView3<f64>,
        k: ArrayView3<f64>,
        v: ArrayView3<f64>,
        layout: &AttentionLayout,
        scale: f64,
        fwd: &AttentionOutput,
        grad_output: ArrayView3<f64>,
    ) -> Result<AttentionGrads> {
        check_qkv(&q, &k, &v)?;
        let (n, h, d) = q.dim();
        check_layout(layout, n)?;
        match layout {
            AttentionLayout::Varlen { cu_seqlens } => {
                varlen_attention_backward(q, k, v, cu_seqlens, false, scale, fwd, grad_output)
            }
            AttentionLayout::Dense { row_len, allowed } => {
                check_grad(&grad_output, fwd, (n, h, d))?;
                let mut grads = zero_grads((n, h, d));
                for (r, mask) in allowed.iter().enumerate() {
                    let rows = r * row_len..(r + 1) * row_len;
                    let sub = AttentionOutput {
                        output: fwd
                            .output
                            .slice_axis(Axis(0), Slice::from(rows.clone()))
                            .to_owned(),
                        lse: fwd
                            .lse
                            .slice_axis(Axis(1), Slice::from(rows.clone()))
                            .to_owned(),
                    };
                    let g = masked_attention_backward(
                        q.slice_axis(Axis(0), Slice::from(rows.clone())),
                        k.slice_axis(Axis(0), Slice::from(rows.clone())),
                        v.slice_axis(Axis(0), Slice::from(rows.clone())),
                        mask.view(),
                        scale,
                        &sub,
                        grad_output.slice_axis(Axis(0), Slice::from(rows.clone())),
                    )?;
                    grads
                        .grad_q
                        .slice_axis_mut(Axis(0), Slice::from(rows.clone()))
                        .assign(&g.grad_q);
                    grads
                        .grad_k
                        .slice_axis_mut(Axis(0), Slice::from(rows.clone()))
                        .assign(&g.grad_k);
                    grads
                        .grad_v
                        .slice_axis_mut(Axis(0), Slice::from(rows))
                        .assign(&g.grad_v);
                }
                Ok(grads)
            }
        }
    }
}
