//! Scaled dot-product attention, dense with a mask and variable-length
//! (`cu_seqlens_q` / `cu_seqlens_k`), forward and backward, in `f64`: the
//! ground truth of the [`crate::ops::AttentionOp`] family.
//!
//! Shapes: `q: [n_q, h, d]`, `k, v: [n_k, h_kv, d]` (tokens, heads, head dim),
//! output `[n_q, h, d]`, log-sum-exp `lse: [h, n_q]` (natural log), as
//! flash-attention's `flash_attn_varlen_func` lays them out. `h_kv` divides
//! `h`: grouped-query attention (Ainslie et al. 2023, GQA) shares key/value
//! head `a / (h / h_kv)` among query heads `a`, as Hugging Face's `repeat_kv`
//! does; `h_kv == h` is multi-head attention, `h_kv == 1` multi-query.
//!
//! For query `i` and head `a` over its allowed keys `J(i)`:
//! `s_ij = scale * q_i . k_j`, `m_i = max_j s_ij`,
//! `lse_i = m_i + ln sum_j exp(s_ij - m_i)`, `p_ij = exp(s_ij - lse_i)`,
//! `o_i = sum_j p_ij v_j` (Vaswani et al. 2017, eq. 1). Masking follows the
//! additive convention of Hugging Face's `BertModel` taken to its limit: a
//! disallowed key adds `-inf` to its score, so `p_ij = 0` exactly.
//!
//! **Causal masks are bottom-right aligned** (flash-attention >= 2.1): in a
//! segment of `l_q` queries over `l_k` keys, query `r` (0-based) may attend key
//! `c` when `c <= r + l_k - l_q`. With `l_q == l_k` that is the usual lower
//! triangle; a continuation chunk of 2 queries over 5 keys gets rows
//! `[1,1,1,1,0]` and `[1,1,1,1,1]` (docs/FAULTS.md C5).
//!
//! **A query with no allowed key** (a padding row under a block-diagonal mask,
//! every row of an empty sequence under a padding mask, the top `l_q - l_k`
//! rows of a causal segment with more queries than keys) has output 0,
//! `lse = -inf` and zero gradients — never NaN (docs/FAULTS.md P8). In
//! variable-length attention an empty segment has no rows at all.
//!
//! Sums run over keys in increasing index order, so the dense and the
//! variable-length forms of the same problem perform the same operations in
//! the same order.

use ndarray::{Array2, Array3, ArrayView2, ArrayView3, Axis, Slice};

use crate::error::{Error, Result};
use crate::ops::{AttentionOp, AttentionSupport, Varlen};

/// Output of an attention forward pass.
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionOutput {
    /// `[n_q, h, d]`.
    pub output: Array3<f64>,
    /// `[h, n_q]`, natural log; `-inf` for a query with no allowed key.
    pub lse: Array2<f64>,
}

/// Gradients of an attention pass.
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionGrads {
    /// `[n_q, h, d]`.
    pub grad_q: Array3<f64>,
    /// `[n_k, h_kv, d]`: summed over the query heads that share each key head.
    pub grad_k: Array3<f64>,
    /// `[n_k, h_kv, d]`.
    pub grad_v: Array3<f64>,
}

/// `1 / sqrt(d)`, the scale of Vaswani et al. and flash-attention's default.
pub fn default_scale(head_dim: usize) -> f64 {
    1.0 / (head_dim as f64).sqrt()
}

fn check_qkv(q: &ArrayView3<f64>, k: &ArrayView3<f64>, v: &ArrayView3<f64>) -> Result<()> {
    check_qkv_shapes(q.shape(), k.shape(), v.shape())
}

/// Checks `q: [n_q, h, d]` against `k, v: [n_k, h_kv, d]`: `k` and `v` of
/// one shape, the head dim of `q`, and `h_kv` dividing `h` (grouped-query
/// attention; `h_kv == h` is the usual case). Shapes as slices, so that kernels
/// of any element type report the same error.
///
/// # Errors
/// [`Error::ShapeMismatch`] naming `k` or `v`.
pub fn check_qkv_shapes(q: &[usize], k: &[usize], v: &[usize]) -> Result<()> {
    let (n, h, d) = (q[0], q[1], q[2]);
    if k == q && v == q {
        return Ok(());
    }
    let groups_ok = k[2] == d && (k[1] == h || (k[1] > 0 && h % k[1] == 0));
    if !groups_ok {
        return Err(Error::ShapeMismatch {
            field: "k".into(),
            expected: format!(
                "[n_k, h_kv, d] with d = {d} and h_kv dividing h = {h} (q is [{n}, {h}, {d}])"
            ),
            actual: k.to_vec(),
        });
    }
    if v != k {
        // k and v disagree: blame the one that differs from q as well (the
        // one the caller changed), v when both differ from q.
        return Err(if v == q {
            Error::ShapeMismatch {
                field: "k".into(),
                expected: format!("[n_k, h_kv, d] = {v:?} (the shape of v)"),
                actual: k.to_vec(),
            }
        } else {
            Error::ShapeMismatch {
                field: "v".into(),
                expected: format!("[n_k, h_kv, d] = {k:?} (the shape of k)"),
                actual: v.to_vec(),
            }
        });
    }
    Ok(())
}

/// Checks that `k` and `v` have the shape `[n_tok, h, d]` of `q`: the strict
/// form for kernels without grouped-query attention or other key lengths.
///
/// # Errors
/// [`Error::ShapeMismatch`] naming `k` or `v`.
pub fn check_qkv_same_shapes(q: &[usize], k: &[usize], v: &[usize]) -> Result<()> {
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
    check_cu_seqlens_named("cu_seqlens", "q", cu_seqlens, n_tok)
}

/// [`check_cu_seqlens`] for a field called `field`, against the tokens of
/// the tensor `of` (`cu_seqlens_k` against `k`).
///
/// # Errors
/// [`Error::InvalidArgument`] naming `field[i]`.
pub fn check_cu_seqlens_named(field: &str, of: &str, cu: &[usize], n_tok: usize) -> Result<()> {
    match cu.first() {
        None => return Err(Error::invalid(field, "must hold at least [0]")),
        Some(&c) if c != 0 => {
            return Err(Error::invalid(
                format!("{field}[0]"),
                format!("is {c}, must be 0"),
            ))
        }
        _ => {}
    }
    for i in 1..cu.len() {
        if cu[i] < cu[i - 1] {
            return Err(Error::invalid(
                format!("{field}[{i}]"),
                format!(
                    "{} is less than {field}[{}] = {} (must not decrease)",
                    cu[i],
                    i - 1,
                    cu[i - 1]
                ),
            ));
        }
    }
    let last = cu[cu.len() - 1];
    if last != n_tok {
        return Err(Error::invalid(
            format!("{field}[{}]", cu.len() - 1),
            format!("is {last}, must equal the {n_tok} tokens of {of}"),
        ));
    }
    Ok(())
}

/// The largest `|scale| * d * max|q| * max|k|` (and `d * max|q| * max|k|`,
/// the unscaled dot product a kernel may form first) attention accepts:
/// 1e30, below f32's 3.4e38 with room for a row's sum, so that every
/// score, `exp(s - m)`, the row sum and `lse = m + ln s` are finite in f64
/// and in every f32 kernel alike.
pub const MAX_SCORE: f64 = 1e30;

/// The most work the f64 reference attention does in one call, in units of
/// one query-key pair of one head per head-dim element plus one
/// (`Σ_segments l_q * l_k * h * (d + 1)`, or `n_q * n_k * h * (d + 1)` for
/// a dense mask): 2^29. The `+ 1` is the per-pair cost besides the dot
/// products (the `exp`, the row bookkeeping), which dominates at small `d`;
/// measured on this project's 2-core machine in a dev build, one unit costs
/// 17-21 ns forward at `d` = 1, 16 and 64 alike, so 2^29 is ~10 s forward
/// (BERT-base's 2 x 512 tokens, 12 heads of 64, are 4.1e8 units; 20,000
/// tokens of one segment at `d` = 1 are 8e8 and refused before any work).
pub const MAX_ATTENTION_WORK: u64 = 1 << 29;

/// Checks that no score `scale * q_i . k_j` can overflow (bound:
/// `|scale| * d * max|q| * max|k| <= MAX_SCORE`, and the same without the
/// scale), so that `output` and `lse` are finite as the contract says. The
/// reference and every registered kernel call it, so all refuse alike.
///
/// # Errors
/// [`Error::InvalidArgument`] naming `scale` (not finite, or the scaled
/// bound over [`MAX_SCORE`]) or `q` (the unscaled bound over it).
pub fn check_scores(q: &ArrayView3<f64>, k: &ArrayView3<f64>, scale: f64) -> Result<()> {
    if !scale.is_finite() {
        return Err(Error::invalid(
            "scale",
            format!("must be finite, found {scale}"),
        ));
    }
    let amax = |t: &ArrayView3<f64>| {
        t.iter()
            .copied()
            .filter(|x| x.is_finite())
            .fold(0.0f64, |m, x| m.max(x.abs()))
    };
    let d = q.dim().2 as f64;
    let dot = d * amax(q) * amax(k);
    if dot > MAX_SCORE {
        return Err(Error::invalid(
            "q",
            format!("d x max|q| x max|k| = {dot:e} is over {MAX_SCORE:e}: the dot products q . k would overflow"),
        ));
    }
    if scale.abs() * dot > MAX_SCORE {
        return Err(Error::invalid(
            "scale",
            format!(
                "|scale| x d x max|q| x max|k| = {:e} is over {MAX_SCORE:e}: the scores would overflow and output and lse would not be finite",
                scale.abs() * dot
            ),
        ));
    }
    Ok(())
}

/// Checks the reference's work on a varlen problem against
/// [`MAX_ATTENTION_WORK`] before doing it (`h`, `d`: heads, head dim).
///
/// # Errors
/// [`Error::InvalidArgument`] naming `cu_seqlens`.
pub fn check_varlen_work(p: &Varlen<'_>, h: usize, d: usize) -> Result<()> {
    let pairs: u128 = p
        .cu_seqlens_q
        .windows(2)
        .zip(p.cu_seqlens_k.windows(2))
        .map(|(wq, wk)| (wq[1] - wq[0]) as u128 * (wk[1] - wk[0]) as u128)
        .sum();
    check_work("cu_seqlens", pairs * h as u128 * (d as u128 + 1))
}

fn check_work(field: &str, work: u128) -> Result<()> {
    if work > u128::from(MAX_ATTENTION_WORK) {
        return Err(Error::invalid(
            field,
            format!(
                "{work} units of work (query-key pairs x heads x (head dim + 1)) is over the {MAX_ATTENTION_WORK} one reference attention call may do"
            ),
        ));
    }
    Ok(())
}

/// Checks a varlen problem against `q: [n_q, ..]` and `k: [n_k, ..]`: both
/// offset lists valid ([`check_cu_seqlens_named`]) and of one length `b + 1`.
///
/// # Errors
/// [`Error::InvalidArgument`] naming `cu_seqlens`, `cu_seqlens_q` or
/// `cu_seqlens_k` and the index.
pub fn check_varlen(p: &Varlen<'_>, n_q: usize, n_k: usize) -> Result<()> {
    if p.is_self() {
        return check_cu_seqlens(p.cu_seqlens_q, n_q).and_then(|()| {
            if n_k == n_q {
                Ok(())
            } else {
                Err(Error::invalid(
                    "k",
                    format!("has {n_k} tokens; self-attention over cu_seqlens needs the {n_q} of q (give cu_seqlens_k for other keys)"),
                ))
            }
        });
    }
    check_cu_seqlens_named("cu_seqlens_q", "q", p.cu_seqlens_q, n_q)?;
    check_cu_seqlens_named("cu_seqlens_k", "k", p.cu_seqlens_k, n_k)?;
    if p.cu_seqlens_q.len() != p.cu_seqlens_k.len() {
        return Err(Error::invalid(
            "cu_seqlens_k",
            format!(
                "has {} entries, cu_seqlens_q {}: both are [b + 1]",
                p.cu_seqlens_k.len(),
                p.cu_seqlens_q.len()
            ),
        ));
    }
    Ok(())
}

/// Keys of a segment visible to its query `r`: `c < limit(r)` (local indices).
/// Bottom-right causal alignment: `c <= r + l_k - l_q`.
fn causal_limit(r: usize, lq: usize, lk: usize) -> usize {
    // c <= r + lk - lq  <=>  c < r + lk + 1 - lq, clamped to [0, lk].
    (r + lk + 1).saturating_sub(lq).min(lk)
}

/// One query head's attention for queries `queries` over keys `keys` (in key
/// order) of key head `kv`, with `allowed(i, j)` deciding the mask. Writes
/// outputs and `lse` for the rows. Shared by the dense and the varlen forms:
/// same operations, same order.
#[allow(clippy::too_many_arguments)]
fn head_forward(
    q: &ArrayView3<f64>,
    k: &ArrayView3<f64>,
    v: &ArrayView3<f64>,
    (head, kv): (usize, usize),
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
                    dot += q[[i, head, c]] * k[[j, kv, c]];
                }
                let sc = scale * dot;
                m = m.max(sc);
                scores.push((j, sc));
            }
        }
        if scores.is_empty() {
            lse[[head, i]] = f64::NEG_INFINITY;
            continue; // output row stays 0 (P8)
        }
        let sum: f64 = scores.iter().map(|&(_, sc)| (sc - m).exp()).sum();
        let l = m + sum.ln();
        lse[[head, i]] = l;
        for &(j, sc) in &scores {
            let p = (sc - l).exp();
            for c in 0..d {
                output[[i, head, c]] += p * v[[j, kv, c]];
            }
        }
    }
}

/// Backward of one query head, given the forward's `lse` (probabilities are
/// recomputed as `exp(s - lse)`, as flash-attention does). Key and value
/// gradients accumulate into key head `kv`.
#[allow(clippy::too_many_arguments)]
fn head_backward(
    (q, k, v): (&ArrayView3<f64>, &ArrayView3<f64>, &ArrayView3<f64>),
    out: &ArrayView3<f64>,
    dout: &ArrayView3<f64>,
    lse: &ArrayView2<f64>,
    (head, kv): (usize, usize),
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
                dot += q[[i, head, c]] * k[[j, kv, c]];
            }
            let p = (scale * dot - l).exp();
            let mut dp = 0.0;
            for c in 0..d {
                dp += dout[[i, head, c]] * v[[j, kv, c]];
                grads.grad_v[[j, kv, c]] += p * dout[[i, head, c]];
            }
            let ds = p * (dp - delta) * scale;
            for c in 0..d {
                grads.grad_q[[i, head, c]] += ds * k[[j, kv, c]];
                grads.grad_k[[j, kv, c]] += ds * q[[i, head, c]];
            }
        }
    }
}

/// `(query head, key head)` pairs: key head `a / (h / h_kv)` for query head `a`.
fn head_pairs(h: usize, h_kv: usize) -> impl Iterator<Item = (usize, usize)> {
    let group = h.checked_div(h_kv).unwrap_or(1).max(1);
    (0..h).map(move |a| (a, a / group))
}

/// Dense attention with a boolean mask: `q: [n_q, h, d]`, `k, v: [n_k, h_kv,
/// d]`, `allowed: [n_q, n_k]` (`allowed[[i, j]]`: query `i` may attend to key
/// `j`).
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
    let (n_k, h_kv, _) = k.dim();
    check_mask_shape2(allowed.shape(), n, n_k)?;
    check_scores(&q, &k, scale)?;
    check_work(
        "allowed",
        n as u128 * n_k as u128 * h as u128 * (d as u128 + 1),
    )?;
    let mut output = Array3::zeros((n, h, d));
    let mut lse = Array2::zeros((h, n));
    let ok = |i: usize, j: usize| allowed[[i, j]];
    for heads in head_pairs(h, h_kv) {
        head_forward(
            &q,
            &k,
            &v,
            heads,
            0..n,
            0..n_k,
            &ok,
            scale,
            &mut output,
            &mut lse,
        );
    }
    Ok(AttentionOutput { output, lse })
}

/// Checks that a dense mask is `[n, n]`.
///
/// # Errors
/// [`Error::ShapeMismatch`] naming `mask`.
pub fn check_mask_shape(allowed: &[usize], n: usize) -> Result<()> {
    check_mask_shape2(allowed, n, n)
}

/// Checks that a dense mask is `[n_q, n_k]`.
///
/// # Errors
/// [`Error::ShapeMismatch`] naming `mask`.
pub fn check_mask_shape2(allowed: &[usize], n_q: usize, n_k: usize) -> Result<()> {
    if allowed != [n_q, n_k] {
        let expected = if n_q == n_k {
            format!("[n, n] = [{n_q}, {n_q}]")
        } else {
            format!("[n_q, n_k] = [{n_q}, {n_k}]")
        };
        return Err(Error::ShapeMismatch {
            field: "mask".into(),
            expected,
            actual: allowed.to_vec(),
        });
    }
    Ok(())
}

/// Backward of [`masked_attention`]: `grad_output: [n_q, h, d]`, `fwd` the
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
    let (n_k, h_kv, _) = k.dim();
    check_mask_shape2(allowed.shape(), n, n_k)?;
    check_grad(&grad_output, fwd, (n, h, d))?;
    check_scores(&q, &k, scale)?;
    check_work(
        "allowed",
        n as u128 * n_k as u128 * h as u128 * (d as u128 + 1),
    )?;
    let mut grads = zero_grads((n, h, d), (n_k, h_kv, d));
    let ok = |i: usize, j: usize| allowed[[i, j]];
    for heads in head_pairs(h, h_kv) {
        head_backward(
            (&q, &k, &v),
            &fwd.output.view(),
            &grad_output,
            &fwd.lse.view(),
            heads,
            0..n,
            0..n_k,
            &ok,
            scale,
            &mut grads,
        );
    }
    Ok(grads)
}

fn zero_grads(qdim: (usize, usize, usize), kdim: (usize, usize, usize)) -> AttentionGrads {
    AttentionGrads {
        grad_q: Array3::zeros(qdim),
        grad_k: Array3::zeros(kdim),
        grad_v: Array3::zeros(kdim),
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

/// Checks the backward's inputs against `dim = (n_q, h, d)`:
/// `grad_output: [n_q, h, d]`, the forward's `output: [n_q, h, d]` and
/// `lse: [h, n_q]`.
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
/// `flash_attn_varlen_func`: `q: [n_q, h, d]` and `k, v: [n_k, h_kv, d]` hold
/// the tokens of `b` segments back to back, segment `s` being queries
/// `cu_seqlens_q[s]..cu_seqlens_q[s + 1]` over keys
/// `cu_seqlens_k[s]..cu_seqlens_k[s + 1]` (both `[b + 1]`, leading 0).
/// Queries attend only to keys of their own segment (and, if `p.causal`, only
/// to keys at or before their own position, bottom-right aligned). Empty
/// segments are allowed and have no rows.
///
/// Returns `output: [n_q, h, d]` and `lse: [h, n_q]`.
///
/// # Errors
/// [`Error::ShapeMismatch`] for `k`/`v` that do not fit `q`; the errors of
/// [`check_varlen`].
pub fn varlen_attention_general(
    q: ArrayView3<f64>,
    k: ArrayView3<f64>,
    v: ArrayView3<f64>,
    p: &Varlen<'_>,
) -> Result<AttentionOutput> {
    check_qkv(&q, &k, &v)?;
    let (n, h, d) = q.dim();
    let (n_k, h_kv, _) = k.dim();
    check_varlen(p, n, n_k)?;
    check_scores(&q, &k, p.scale)?;
    check_varlen_work(p, h, d)?;
    let mut output = Array3::zeros((n, h, d));
    let mut lse = Array2::zeros((h, n));
    for (wq, wk) in p.cu_seqlens_q.windows(2).zip(p.cu_seqlens_k.windows(2)) {
        let (q0, lq, k0, lk) = (wq[0], wq[1] - wq[0], wk[0], wk[1] - wk[0]);
        let ok = |i: usize, j: usize| !p.causal || j - k0 < causal_limit(i - q0, lq, lk);
        for heads in head_pairs(h, h_kv) {
            head_forward(
                &q,
                &k,
                &v,
                heads,
                wq[0]..wq[1],
                wk[0]..wk[1],
                &ok,
                p.scale,
                &mut output,
                &mut lse,
            );
        }
    }
    Ok(AttentionOutput { output, lse })
}

/// Backward of [`varlen_attention_general`]: `grad_output: [n_q, h, d]`;
/// returns `grad_q: [n_q, h, d]` and `grad_k`, `grad_v: [n_k, h_kv, d]`.
///
/// # Errors
/// As [`varlen_attention_general`], and [`Error::ShapeMismatch`] for
/// `grad_output`.
pub fn varlen_attention_general_backward(
    q: ArrayView3<f64>,
    k: ArrayView3<f64>,
    v: ArrayView3<f64>,
    p: &Varlen<'_>,
    fwd: &AttentionOutput,
    grad_output: ArrayView3<f64>,
) -> Result<AttentionGrads> {
    check_qkv(&q, &k, &v)?;
    let (n, h, d) = q.dim();
    let (n_k, h_kv, _) = k.dim();
    check_varlen(p, n, n_k)?;
    check_grad(&grad_output, fwd, (n, h, d))?;
    check_scores(&q, &k, p.scale)?;
    check_varlen_work(p, h, d)?;
    let mut grads = zero_grads((n, h, d), (n_k, h_kv, d));
    for (wq, wk) in p.cu_seqlens_q.windows(2).zip(p.cu_seqlens_k.windows(2)) {
        let (q0, lq, k0, lk) = (wq[0], wq[1] - wq[0], wk[0], wk[1] - wk[0]);
        let ok = |i: usize, j: usize| !p.causal || j - k0 < causal_limit(i - q0, lq, lk);
        for heads in head_pairs(h, h_kv) {
            head_backward(
                (&q, &k, &v),
                &fwd.output.view(),
                &grad_output,
                &fwd.lse.view(),
                heads,
                wq[0]..wq[1],
                wk[0]..wk[1],
                &ok,
                p.scale,
                &mut grads,
            );
        }
    }
    Ok(grads)
}

/// Self-attention over one `cu_seqlens` (queries and keys the same tokens):
/// [`varlen_attention_general`] with `cu_seqlens_q == cu_seqlens_k`.
///
/// # Errors
/// As [`varlen_attention_general`].
pub fn varlen_attention(
    q: ArrayView3<f64>,
    k: ArrayView3<f64>,
    v: ArrayView3<f64>,
    cu_seqlens: &[usize],
    causal: bool,
    scale: f64,
) -> Result<AttentionOutput> {
    varlen_attention_general(q, k, v, &Varlen::new(cu_seqlens, causal, scale))
}

/// Backward of [`varlen_attention`].
///
/// # Errors
/// As [`varlen_attention_general_backward`].
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
    varlen_attention_general_backward(
        q,
        k,
        v,
        &Varlen::new(cu_seqlens, causal, scale),
        fwd,
        grad_output,
    )
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
    let (n_k, h_kv, _) = k.dim();
    check_mask_shape2(allowed.shape(), n, n_k)?;
    let fwd = masked_attention(q, k, k, allowed, scale)?;
    let mut p = Array3::zeros((h, n, n_k));
    for (head, kv) in head_pairs(h, h_kv) {
        for i in 0..n {
            let l = fwd.lse[[head, i]];
            if l == f64::NEG_INFINITY {
                continue;
            }
            for j in 0..n_k {
                if allowed[[i, j]] {
                    let mut dot = 0.0;
                    for c in 0..d {
                        dot += q[[i, head, c]] * k[[j, kv, c]];
                    }
                    p[[head, i, j]] = (scale * dot - l).exp();
                }
            }
        }
    }
    Ok(p)
}

/// The `[n_q, n_k]` mask of a varlen problem: key `j` allowed for query `i`
/// when both are in the same segment (and, if causal, `j` is visible to `i`,
/// bottom-right aligned). The dense twin of [`varlen_attention_general`].
///
/// # Errors
/// As [`check_varlen`].
pub fn varlen_mask(p: &Varlen<'_>, n_q: usize, n_k: usize) -> Result<Array2<bool>> {
    check_varlen(p, n_q, n_k)?;
    let mut mask = Array2::from_elem((n_q, n_k), false);
    for (wq, wk) in p.cu_seqlens_q.windows(2).zip(p.cu_seqlens_k.windows(2)) {
        let (lq, lk) = (wq[1] - wq[0], wk[1] - wk[0]);
        for r in 0..lq {
            let limit = if p.causal {
                causal_limit(r, lq, lk)
            } else {
                lk
            };
            for c in 0..limit {
                mask[[wq[0] + r, wk[0] + c]] = true;
            }
        }
    }
    Ok(mask)
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

/// The forward over a [`AttentionLayout`] through any [`AttentionOp`]: a
/// varlen layout is one varlen call (bidirectional), a dense layout one
/// masked call per row. The model (and [`AttentionOp::forward`]) uses it.
///
/// # Errors
/// Those of the op, and [`check_layout`]'s.
pub fn layout_forward<A: AttentionOp + ?Sized>(
    op: &A,
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
            op.varlen_forward(q, k, v, &Varlen::new(cu_seqlens, false, scale))
        }
        AttentionLayout::Dense { row_len, allowed } => {
            let mut output = Array3::zeros((n, h, d));
            let mut lse = Array2::zeros((h, n));
            for (r, mask) in allowed.iter().enumerate() {
                let rows = Slice::from(r * row_len..(r + 1) * row_len);
                let f = op.masked_forward(
                    q.slice_axis(Axis(0), rows),
                    k.slice_axis(Axis(0), rows),
                    v.slice_axis(Axis(0), rows),
                    mask.view(),
                    scale,
                )?;
                output.slice_axis_mut(Axis(0), rows).assign(&f.output);
                lse.slice_axis_mut(Axis(1), rows).assign(&f.lse);
            }
            Ok(AttentionOutput { output, lse })
        }
    }
}

/// The backward over a [`AttentionLayout`] through any [`AttentionOp`], as
/// [`layout_forward`].
///
/// # Errors
/// Those of the op, [`check_layout`]'s and [`check_grad_shapes`]'.
#[allow(clippy::too_many_arguments)]
pub fn layout_backward<A: AttentionOp + ?Sized>(
    op: &A,
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
        AttentionLayout::Varlen { cu_seqlens } => op.varlen_backward(
            q,
            k,
            v,
            &Varlen::new(cu_seqlens, false, scale),
            fwd,
            grad_output,
        ),
        AttentionLayout::Dense { row_len, allowed } => {
            check_grad(&grad_output, fwd, (n, h, d))?;
            let mut grads = zero_grads((n, h, d), k.dim());
            for (r, mask) in allowed.iter().enumerate() {
                let rows = Slice::from(r * row_len..(r + 1) * row_len);
                let sub = AttentionOutput {
                    output: fwd.output.slice_axis(Axis(0), rows).to_owned(),
                    lse: fwd.lse.slice_axis(Axis(1), rows).to_owned(),
                };
                let g = op.masked_backward(
                    q.slice_axis(Axis(0), rows),
                    k.slice_axis(Axis(0), rows),
                    v.slice_axis(Axis(0), rows),
                    mask.view(),
                    scale,
                    &sub,
                    grad_output.slice_axis(Axis(0), rows),
                )?;
                grads.grad_q.slice_axis_mut(Axis(0), rows).assign(&g.grad_q);
                grads.grad_k.slice_axis_mut(Axis(0), rows).assign(&g.grad_k);
                grads.grad_v.slice_axis_mut(Axis(0), rows).assign(&g.grad_v);
            }
            Ok(grads)
        }
    }
}

/// The reference attention: [`varlen_attention_general`] and
/// [`masked_attention`], everything the op family allows (causal, GQA,
/// `cu_seqlens_q != cu_seqlens_k`).
#[derive(Debug, Clone, Copy, Default)]
pub struct ReferenceAttention;

impl AttentionOp for ReferenceAttention {
    fn support(&self) -> AttentionSupport {
        AttentionSupport::ALL
    }

    fn varlen_forward(
        &self,
        q: ArrayView3<f64>,
        k: ArrayView3<f64>,
        v: ArrayView3<f64>,
        p: &Varlen<'_>,
    ) -> Result<AttentionOutput> {
        varlen_attention_general(q, k, v, p)
    }

    fn varlen_backward(
        &self,
        q: ArrayView3<f64>,
        k: ArrayView3<f64>,
        v: ArrayView3<f64>,
        p: &Varlen<'_>,
        fwd: &AttentionOutput,
        grad_output: ArrayView3<f64>,
    ) -> Result<AttentionGrads> {
        varlen_attention_general_backward(q, k, v, p, fwd, grad_output)
    }

    fn masked_forward(
        &self,
        q: ArrayView3<f64>,
        k: ArrayView3<f64>,
        v: ArrayView3<f64>,
        allowed: ArrayView2<bool>,
        scale: f64,
    ) -> Result<AttentionOutput> {
        masked_attention(q, k, v, allowed, scale)
    }

    fn masked_backward(
        &self,
        q: ArrayView3<f64>,
        k: ArrayView3<f64>,
        v: ArrayView3<f64>,
        allowed: ArrayView2<bool>,
        scale: f64,
        fwd: &AttentionOutput,
        grad_output: ArrayView3<f64>,
    ) -> Result<AttentionGrads> {
        masked_attention_backward(q, k, v, allowed, scale, fwd, grad_output)
    }
}

#[cfg(test)]
mod tests;
