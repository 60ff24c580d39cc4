//! The dense masked form: one work item per (row, head) over a whole
//! padded row with a `[row_len, row_len]` boolean mask (the padded /
//! block-diagonal baseline of the varlen kernel, bitwise equal to it on the
//! real tokens; module docs of [`super`]).

use super::*;

fn dense_items<'a>(
    masks: &'a [ArrayView2<'a, bool>],
    row_len: usize,
    (h, h_kv): (usize, usize),
    opts: ScoreOptions<'a>,
) -> Vec<Item<'a>> {
    let mut items = Vec::with_capacity(masks.len() * h);
    let group = h / h_kv.max(1);
    for (r, mask) in masks.iter().enumerate() {
        if row_len == 0 {
            continue;
        }
        for head in 0..h {
            items.push(Item {
                q_start: r * row_len,
                q_len: row_len,
                k_start: r * row_len,
                k_len: row_len,
                head,
                kv_head: head / group,
                mask: Mask::Dense(mask),
                transform: opts.transform(head),
            });
        }
    }
    items
}

fn check_dense<T: Element>(
    (q, k): (&ArrayView3<T>, &ArrayView3<T>),
    row_len: usize,
    masks: &[ArrayView2<bool>],
) -> Result<()> {
    let n = q.dim().0;
    if row_len * masks.len() != n {
        return Err(Error::ShapeMismatch {
            field: "q".into(),
            expected: format!("[rows * row_len = {}, h, d]", row_len * masks.len()),
            actual: vec![n],
        });
    }
    if k.dim().0 != n {
        return Err(Error::ShapeMismatch {
            field: "k".into(),
            expected: format!("[{n}, h_kv, d]: the rows of q"),
            actual: k.shape().to_vec(),
        });
    }
    for m in masks {
        check_mask_shape(m.shape(), row_len)?;
    }
    Ok(())
}

/// Dense masked attention: `q: [rows * row_len, h, d]` and `k, v: [rows *
/// row_len, h_kv, d]` (`h_kv` dividing `h`, as [`varlen_attention_general`]) hold `rows =
/// masks.len()` rows of `row_len` tokens; token `i` of row `r` may attend to
/// key `j` of the same row where `masks[r][[i, j]]`. The same tiles as
/// [`varlen_attention`] over whole rows: every `[row_len, row_len]` score is
/// computed (the padded, or packed-with-a-block-diagonal-mask, baseline).
///
/// # Errors
/// [`Error::ShapeMismatch`] for `k`/`v`, a mask not `[row_len, row_len]`
/// (field `mask`) or `rows * row_len != n_tok` (field `q`);
/// [`Error::NonFiniteInput`] as [`varlen_attention`].
pub fn dense_masked_attention<T: Element>(
    q: ArrayView3<T>,
    k: ArrayView3<T>,
    v: ArrayView3<T>,
    row_len: usize,
    masks: &[ArrayView2<bool>],
    scale: f32,
) -> Result<AttentionOutput32> {
    let opts = ScoreOptions::default();
    dense_masked_attention_with(q, k, v, (row_len, masks), scale, opts)
}

/// [`dense_masked_attention`] with flash-attention's score options `opts`
/// (softcap, ALiBi on the diagonals `opts.diag_offsets`): the scores of every
/// row changed as the varlen form's ([`varlen_attention_general`]) before
/// the mask.
///
/// # Errors
/// As [`dense_masked_attention`]; [`Error::InvalidArgument`] naming
/// `softcap` (not finite or below 0), `alibi_slopes` (not `[h]`) or
/// `diag_offsets` (not `[row_len]`).
pub fn dense_masked_attention_with<T: Element>(
    q: ArrayView3<T>,
    k: ArrayView3<T>,
    v: ArrayView3<T>,
    (row_len, masks): (usize, &[ArrayView2<bool>]),
    scale: f32,
    opts: ScoreOptions<'_>,
) -> Result<AttentionOutput32> {
    check_inputs(&q, &k, &v)?;
    check_dense((&q, &k), row_len, masks)?;
    check_score_options(&opts, row_len, q.dim().1)?;
    let items = dense_items(masks, row_len, (q.dim().1, k.dim().1), opts);
    Ok(forward((&q, &k, &v), scale, &items))
}

/// `opts` of a dense problem of rows of `row_len` over `h` query heads.
fn check_score_options(opts: &ScoreOptions<'_>, row_len: usize, h: usize) -> Result<()> {
    if !(opts.softcap.is_finite() && opts.softcap >= 0.0) {
        return Err(Error::invalid(
            "softcap",
            format!(
                "{}: the cap is finite and at least 0 (0: none)",
                opts.softcap
            ),
        ));
    }
    if let Some(a) = opts.alibi_slopes.filter(|a| a.len() != h) {
        return Err(Error::invalid(
            "alibi_slopes",
            format!("has {} entries for {h} query heads: it is [h]", a.len()),
        ));
    }
    if let Some(o) = opts.diag_offsets.filter(|o| o.len() != row_len) {
        return Err(Error::invalid(
            "diag_offsets",
            format!(
                "has {} entries for rows of {row_len}: it is [row_len]",
                o.len()
            ),
        ));
    }
    Ok(())
}

/// Backward of [`dense_masked_attention`]. Queries with no allowed key get
/// zero gradients.
///
/// # Errors
/// As [`dense_masked_attention`] and [`varlen_attention_backward`].
#[allow(clippy::too_many_arguments)]
pub fn dense_masked_attention_backward<T: Element>(
    q: ArrayView3<T>,
    k: ArrayView3<T>,
    v: ArrayView3<T>,
    row_len: usize,
    masks: &[ArrayView2<bool>],
    scale: f32,
    fwd: &AttentionOutput32,
    grad_output: ArrayView3<f32>,
) -> Result<AttentionGrads32> {
    let opts = ScoreOptions::default();
    let g = (fwd, grad_output);
    dense_masked_attention_backward_with(q, k, v, (row_len, masks), scale, opts, g)
}

/// Backward of [`dense_masked_attention_with`] (with softcap, its chain
/// factor).
///
/// # Errors
/// As [`dense_masked_attention_with`] and [`varlen_attention_backward`].
pub fn dense_masked_attention_backward_with<T: Element>(
    q: ArrayView3<T>,
    k: ArrayView3<T>,
    v: ArrayView3<T>,
    (row_len, masks): (usize, &[ArrayView2<bool>]),
    scale: f32,
    opts: ScoreOptions<'_>,
    (fwd, grad_output): (&AttentionOutput32, ArrayView3<f32>),
) -> Result<AttentionGrads32> {
    check_backward(&q, &k, &v, fwd, &grad_output)?;
    check_dense((&q, &k), row_len, masks)?;
    check_score_options(&opts, row_len, q.dim().1)?;
    let items = dense_items(masks, row_len, (q.dim().1, k.dim().1), opts);
    Ok(backward((&q, &k, &v), scale, &items, fwd, &grad_output))
}
