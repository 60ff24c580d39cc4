//! The checks of an attention call: shapes of `q, k, v`, `cu_seqlens`, masks,
//! the backward's inputs and layouts; the limits on scores and on work.

use ndarray::ArrayView3;

use super::{AttentionLayout, AttentionOutput};
use crate::error::{Error, Result};
use crate::ops::Varlen;

pub(super) fn check_qkv(
    q: &ArrayView3<f64>,
    k: &ArrayView3<f64>,
    v: &ArrayView3<f64>,
) -> Result<()> {
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
pub fn check_scores<T: Copy + Into<f64>>(
    q: &ArrayView3<T>,
    k: &ArrayView3<T>,
    scale: f64,
) -> Result<()> {
    check_score_bound(q.dim().2, [finite_amax(q), finite_amax(k)], scale)
}

/// The largest magnitude of the finite elements of `t` (0 if none): what
/// [`check_scores`] and [`check_grad_values`] bound.
fn finite_amax<T: Copy + Into<f64>>(t: &ArrayView3<T>) -> f64 {
    t.iter()
        .map(|&x| x.into())
        .filter(|x: &f64| x.is_finite())
        .fold(0.0f64, |m, x| m.max(x.abs()))
}

/// [`check_scores`] given `d` and the largest magnitudes `[max|q|,
/// max|k|]` of finite inputs (a kernel that has read them already, as
/// `packshard_optimized::attention::finite_amax` does, passes them here
/// rather than reading the tensors again).
///
/// # Errors
/// As [`check_scores`].
pub fn check_score_bound(d: usize, [amax_q, amax_k]: [f64; 2], scale: f64) -> Result<()> {
    if !scale.is_finite() {
        return Err(Error::invalid(
            "scale",
            format!("must be finite, found {scale}"),
        ));
    }
    let dot = d as f64 * amax_q * amax_k;
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

/// Checks that the backward's products `grad_output . v` stay finite (bound:
/// `d * max|grad_output| * max|v| <= MAX_SCORE`, as the scores): past it,
/// `dP = dO . v` and `delta = dO . O` overflow and `dP - delta` is
/// `inf - inf`, NaN where the true gradient is 0 (a row with one key). The
/// reference and every registered kernel call it, so all refuse alike.
///
/// # Errors
/// [`Error::InvalidArgument`] naming `grad_output`.
pub fn check_grad_values<G: Copy + Into<f64>, V: Copy + Into<f64>>(
    grad_output: &ArrayView3<G>,
    v: &ArrayView3<V>,
) -> Result<()> {
    check_grad_bound(v.dim().2, [finite_amax(grad_output), finite_amax(v)])
}

/// [`check_grad_values`] given `d` and the largest magnitudes
/// `[max|grad_output|, max|v|]` of finite inputs (as [`check_score_bound`]).
///
/// # Errors
/// As [`check_grad_values`].
pub fn check_grad_bound(d: usize, [amax_go, amax_v]: [f64; 2]) -> Result<()> {
    let dot = d as f64 * amax_go * amax_v;
    if dot > MAX_SCORE {
        return Err(Error::invalid(
            "grad_output",
            format!("d x max|grad_output| x max|v| = {dot:e} is over {MAX_SCORE:e}: the products grad_output . v of the backward would overflow"),
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

/// Checks a dense (masked) problem's work, `n_q * n_k * h * (d + 1)`,
/// against [`MAX_ATTENTION_WORK`] before doing it: the bound of
/// [`check_varlen_work`] for the masked form, which every masked kernel
/// computes in full whatever the mask allows.
///
/// # Errors
/// [`Error::InvalidArgument`] naming `allowed`.
pub fn check_masked_work(n_q: usize, n_k: usize, h: usize, d: usize) -> Result<()> {
    check_work(
        "allowed",
        n_q as u128 * n_k as u128 * h as u128 * (d as u128 + 1),
    )
}

/// Checks the work of a whole [`AttentionLayout`] (`h`, `d`: heads, head
/// dim) against [`MAX_ATTENTION_WORK`]: a varlen layout as its one call, a
/// dense layout as the sum over its rows (`rows * row_len^2 * h * (d + 1)`),
/// so that a padded batch, run one masked call per row, is held to the bound
/// the same batch packed into one varlen call is.
///
/// # Errors
/// [`Error::InvalidArgument`] naming `cu_seqlens` or `allowed`.
pub fn check_layout_work(layout: &AttentionLayout, h: usize, d: usize) -> Result<()> {
    match layout {
        AttentionLayout::Varlen { cu_seqlens } => {
            check_varlen_work(&Varlen::new(cu_seqlens, false, 1.0), h, d)
        }
        AttentionLayout::Dense { row_len, allowed } => check_work(
            "allowed",
            allowed.len() as u128
                * *row_len as u128
                * *row_len as u128
                * h as u128
                * (d as u128 + 1),
        ),
    }
}

pub(super) fn check_work(field: &str, work: u128) -> Result<()> {
    if work > u128::from(MAX_ATTENTION_WORK) {
        return Err(Error::invalid(
            field,
            format!(
                "{work} units of work (query-key pairs x heads x (head dim + 1)) is over the {MAX_ATTENTION_WORK} one attention call may do (the reference's and every kernel's bound)"
            ),
        ));
    }
    Ok(())
}

/// Checks a varlen problem against `q: [n_q, ..]` and `k: [n_k, ..]`: both
/// offset lists valid ([`check_cu_seqlens_named`]) and of one length `b + 1`;
/// `seqused_k: [b]` with each at most its segment's `l_k`; `softcap` finite
/// and at least 0.
///
/// # Errors
/// [`Error::InvalidArgument`] naming `cu_seqlens`, `cu_seqlens_q`,
/// `cu_seqlens_k`, `seqused_k` (and the index) or `softcap`.
pub fn check_varlen(p: &Varlen<'_>, n_q: usize, n_k: usize) -> Result<()> {
    check_varlen_offsets(p, n_q, n_k)?;
    check_seqused_k(p)?;
    if !(p.softcap.is_finite() && p.softcap >= 0.0) {
        return Err(Error::invalid(
            "softcap",
            format!("{}: the cap is finite and at least 0 (0: none)", p.softcap),
        ));
    }
    Ok(())
}

/// `seqused_k: [b]`, each at most its segment's `l_k`.
fn check_seqused_k(p: &Varlen<'_>) -> Result<()> {
    let Some(used) = p.seqused_k else {
        return Ok(());
    };
    let b = p.cu_seqlens_k.len().saturating_sub(1);
    if used.len() != b {
        return Err(Error::invalid(
            "seqused_k",
            format!("has {} entries for {b} segments: it is [b]", used.len()),
        ));
    }
    for (s, (&u, w)) in used.iter().zip(p.cu_seqlens_k.windows(2)).enumerate() {
        if u > w[1] - w[0] {
            return Err(Error::invalid(
                format!("seqused_k[{s}]"),
                format!("{u} keys used of a segment of {} keys", w[1] - w[0]),
            ));
        }
    }
    Ok(())
}

/// The options that need the head count: `alibi_slopes: [h]`, finite, with
/// `|slope| * n_k <= MAX_SCORE` (the bias bounded as the scores are).
///
/// # Errors
/// [`Error::InvalidArgument`] naming `alibi_slopes` or `alibi_slopes[a]`.
pub fn check_varlen_options(p: &Varlen<'_>, h: usize) -> Result<()> {
    let Some(slopes) = p.alibi_slopes else {
        return Ok(());
    };
    if slopes.len() != h {
        return Err(Error::invalid(
            "alibi_slopes",
            format!(
                "has {} entries for {h} query heads: it is [h]",
                slopes.len()
            ),
        ));
    }
    let n_k = p.cu_seqlens_k.last().copied().unwrap_or(0) as f64;
    for (a, &x) in slopes.iter().enumerate() {
        if !x.is_finite() || x.abs() * n_k > MAX_SCORE {
            return Err(Error::invalid(
                format!("alibi_slopes[{a}]"),
                format!("{x}: a slope is finite, with |slope| * n_k at most {MAX_SCORE:e}"),
            ));
        }
    }
    Ok(())
}

/// The offsets of [`check_varlen`].
fn check_varlen_offsets(p: &Varlen<'_>, n_q: usize, n_k: usize) -> Result<()> {
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

pub(super) fn check_grad(
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
