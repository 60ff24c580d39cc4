//! Cross-entropy and the fused output layer (`logits = hidden @ weight^T`
//! and its cross-entropy) in `f32`, unsharded and as one vocabulary shard of
//! the sharded algorithm `alg2` (Yeung et al., arXiv:2411.05288, Algorithm 2;
//! `packshard_reference::vocab`).
//!
//! Shapes: `hidden: [n, h]`, `weight: [v, h]` (a shard: `[w_r, h]`),
//! `logits: [n, v]`, `targets: [n]`. The options are the reference's
//! [`LossConfig`] (`ignore_index`, label smoothing in PyTorch's or
//! Megatron's convention, z-loss, `mean` / `sum` / `none`).
//!
//! ## What is computed how
//!
//! Per-element work (logits, `exp`, gradients) is `f32` with SIMD
//! ([`crate::simd`]) on rayon row chunks, products through `gemm`
//! ([`crate::matmul`]). Per-row statistics are the reference's
//! [`SoftmaxStats`] (maximum, `s - 1`, target term, target mass): each tile of
//! a row is summarised in f32 and the summaries are merged with the
//! reference's online-softmax merge in f64; the losses, `logsumexp` and the
//! confident-target and tied-maximum gradient entries come from the
//! reference's formulas on those statistics ([`SoftmaxStats::gradient`],
//! [`SoftmaxStats::delta`]).
//!
//! - [`cross_entropy`]: on given logits (`-inf` allowed).
//! - [`linear_cross_entropy_materialized`]: the whole `[n, v]` logits by one
//!   product, then the row pass and two products: the baseline.
//! - [`linear_cross_entropy_fused`]: chunks of [`Chunks::tokens`] tokens;
//!   for each, tiles of [`Chunks::vocab`] entries: the tile's logits, its
//!   statistics merged into the row's while the tile is in cache; then per
//!   tile the gradient in place, `dL/dhidden += G W`, `dL/dW += G^T x`. Only
//!   a `[tokens, v]` buffer exists; the products are the materialized path's
//!   (no recomputation).
//! - [`linear_cross_entropy_tiled`]: tiles of tokens x vocabulary, one
//!   `[tokens, vocab]` tile buffer; pass 1 the row statistics, pass 2 the
//!   gradients from recomputed logits (four products, `tiled`).
//! - [`linear_cross_entropy_tiled_filtered`]: the tiled kernel with Cut
//!   Cross-Entropy's gradient filtering (a tile of `dL/dz` below a threshold
//!   off the targets skips its two products), reporting a bound on the error
//!   it trades.
//! - [`alg2`]: one shard of the sharded algorithm: the S pass (local
//!   statistics and the input-gradient partials `s_i D_i`, `B_i` of the
//!   merged record, chunked) and the T pass (the weight gradient of the
//!   shard, logits recomputed chunk by chunk), with the reference's
//!   collectives and merge functions between them.

use ndarray::{s, Array1, Array2, ArrayView2, ArrayViewMut2};
use packshard_reference::ops::TradedError;
use packshard_reference::vocab::cross_entropy::{check_row, check_shapes, token_loss};
use packshard_reference::vocab::softcap;
use packshard_reference::vocab::{CrossEntropy, LossCall, LossConfig, SoftmaxStats};
use packshard_reference::{Error, Result};
use pulp::{Simd, WithSimd};
use rayon::prelude::*;

use crate::matmul::{matmul, Threads};
use crate::simd::{self, load_tail};

/// The largest `h * max|hidden| * max|weight|` the f32 kernels accept (the
/// reference accepts 1e300): every logit, and every sum of `v` of them, then
/// stays far inside the f32 range (3.4e38).
pub const F32_LOGIT_BOUND: f64 = 1e30;

/// The most logits (`n * v`) the materialized f32 path holds: 2^30 (4 GiB).
pub const MAX_MATERIALIZED_LOGITS: usize = 1 << 30;

/// How the fused kernels chunk the work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunks {
    /// Tokens per chunk (the `[tokens, v]` buffer).
    pub tokens: usize,
    /// Vocabulary entries per tile.
    pub vocab: usize,
}

impl Default for Chunks {
    /// 256 tokens (1/16 of the logits of 4096 tokens) x 4096 entries.
    fn default() -> Self {
        Chunks {
            tokens: 256,
            vocab: 4096,
        }
    }
}

/// The result of an f32 cross-entropy: the reference's fields (the loss
/// and statistics in f64), `grad_logits: [n, v]` in f32 with gradients
/// ([`cross_entropy`] and [`linear_cross_entropy_materialized`]; the fused
/// kernels never hold it).
pub type CrossEntropy32 = CrossEntropy<f32>;

/// The result of an output layer plus cross-entropy.
#[derive(Debug, Clone, PartialEq)]
pub struct LinearCrossEntropy32 {
    /// Loss, per-token losses, statistics.
    pub ce: CrossEntropy32,
    /// `[n, h]`: `dL/dhidden` with gradients.
    pub grad_hidden: Option<Array2<f32>>,
    /// `[v, h]`: `dL/dweight` with gradients.
    pub grad_weight: Option<Array2<f32>>,
    /// Bytes of the logits buffer the kernel held (`[n, v]` materialized,
    /// `[tokens, v]` fused), f32.
    pub logits_buffer_bytes: usize,
    /// What the kernel traded for speed ([`linear_cross_entropy_tiled_filtered`]
    /// only; `None` for every exact kernel).
    pub traded: Option<TradedError>,
}

// ---- validation (the reference's checks, for f32 inputs) ----------------------

/// NaN and `+inf` logits are errors (`-inf` is a masked entry): as
/// `packshard_reference::vocab::cross_entropy::check_logits`, flat index
/// `i * row_len + offset + j` for the first `columns` columns.
///
/// # Errors
/// [`Error::NonFiniteInput`] naming `field`.
pub fn check_logits(
    field: &str,
    z: ArrayView2<f32>,
    columns: usize,
    row_len: usize,
    offset: usize,
) -> Result<()> {
    for ((i, j), &x) in z.indexed_iter() {
        if j < columns && (x.is_nan() || x == f32::INFINITY) {
            return Err(Error::NonFiniteInput {
                field: field.into(),
                index: i * row_len + offset + j,
                value: x as f64,
            });
        }
    }
    Ok(())
}

fn check_finite2(field: &str, x: ArrayView2<f32>, offset: usize) -> Result<()> {
    match x.iter().position(|v| !v.is_finite()) {
        None => Ok(()),
        Some(i) => Err(Error::NonFiniteInput {
            field: field.into(),
            index: offset + i,
            value: x.iter().nth(i).copied().unwrap_or(f32::NAN) as f64,
        }),
    }
}

/// The reference's `check_linear` for f32: `weight: [k, h]` matching
/// `hidden: [n, h]`, finite values (the first `rows` rows of the weight,
/// global flat indices from row `offset`), and logits that stay within
/// [`F32_LOGIT_BOUND`].
///
/// # Errors
/// [`Error::ShapeMismatch`] (`weight`), [`Error::NonFiniteInput`]
/// (`hidden`, `weight`), [`Error::InvalidArgument`] (`hidden`) as the reference.
pub fn check_linear(
    hidden: ArrayView2<f32>,
    weight: ArrayView2<f32>,
    rows: usize,
    offset: usize,
) -> Result<()> {
    let h = hidden.ncols();
    if weight.ncols() != h {
        return Err(Error::ShapeMismatch {
            field: "weight".into(),
            expected: format!("[v, h] with h = {h} (the columns of hidden)"),
            actual: weight.shape().to_vec(),
        });
    }
    check_finite2("hidden", hidden, 0)?;
    // The reference's work bound, on the real rows (the whole call's `v`,
    // or one shard's, within it).
    packshard_reference::vocab::check_linear_work(hidden.nrows(), rows, h)?;
    let real = weight.slice(s![..rows.min(weight.nrows()), ..]);
    check_finite2("weight", real, offset * h)?;
    let max_abs = |a: ArrayView2<f32>| a.iter().fold(0.0f64, |m, x| m.max(x.abs() as f64));
    let bound = h as f64 * max_abs(hidden) * max_abs(real);
    if bound > F32_LOGIT_BOUND {
        return Err(Error::invalid(
            "hidden",
            format!("h * max|hidden| * max|weight| = {bound:e} is over {F32_LOGIT_BOUND:e}: f32 logits could overflow"),
        ));
    }
    Ok(())
}

pub mod alg2;
mod rows;
mod tiled;

pub(crate) use rows::z_loss_factor;
use rows::*;
pub use tiled::{linear_cross_entropy_tiled, linear_cross_entropy_tiled_filtered};

// ---- unsharded ------------------------------------------------------------------

/// Cross-entropy of `logits: [n, v]` against `targets: [n]` (f32; `-inf`
/// allowed), with `dL/dlogits` when `want_grad`. The semantics of
/// `packshard_reference::vocab::cross_entropy`.
///
/// # Errors
/// As the reference: [`Error::ShapeMismatch`] (`targets`, `logits`),
/// [`Error::NonFiniteInput`] (`logits`, NaN or `+inf`), the option errors,
/// [`Error::IndexOutOfRange`] (`targets`), [`Error::InvalidArgument`]
/// (`logits[i]` all `-inf` with a target).
pub fn cross_entropy(logits: ArrayView2<f32>, call: &LossCall) -> Result<CrossEntropy32> {
    let config = call.config;
    let (n, v) = logits.dim();
    check_shapes(n, v, call)?;
    check_logits("logits", logits, v, v, 0)?;
    config.validate(v)?;
    let rows = Rows::new(call, v, 0, v)?;
    let mut buf = logits.as_standard_layout().into_owned();
    let flat = buf.as_slice_mut().expect("standard layout");
    let stats = capped_row_stats(flat, (n, v), &rows, config.softcap);
    let (per_token_loss, loss) = rows.losses(&stats)?;
    let grad_logits = if call.want_grad() {
        gradient_tile(
            buf.as_slice_mut().expect("standard layout"),
            v,
            0,
            v,
            &rows,
            0,
            &stats,
        );
        Some(buf)
    } else {
        None
    };
    Ok(CrossEntropy32 {
        loss,
        per_token_loss,
        stats,
        num_tokens: rows.num_tokens(),
        grad_logits,
    })
}

pub(crate) fn check_linear_inputs(
    hidden: ArrayView2<f32>,
    weight: ArrayView2<f32>,
    call: &LossCall,
) -> Result<()> {
    let (n, v) = (hidden.nrows(), weight.nrows());
    check_shapes(n, v, call)?;
    check_linear(hidden, weight, v, 0)?;
    call.config.validate(v)?;
    call.config.targets(call.targets, v)?;
    Ok(())
}

/// The output layer with the whole logits materialized: `logits = hidden
/// @ weight^T` (`[n, v]`, one product), the row statistics and losses, and
/// with `want_grad` the gradient in place and `dL/dhidden = G W`, `dL/dW =
/// G^T hidden`. The baseline of [`linear_cross_entropy_fused`].
///
/// # Errors
/// As `packshard_reference::vocab::linear_cross_entropy` (with
/// [`F32_LOGIT_BOUND`]); [`Error::InvalidArgument`] (`weight`) when `n * v`
/// is over [`MAX_MATERIALIZED_LOGITS`].
pub fn linear_cross_entropy_materialized(
    hidden: ArrayView2<f32>,
    weight: ArrayView2<f32>,
    call: &LossCall,
) -> Result<LinearCrossEntropy32> {
    check_linear_inputs(hidden, weight, call)?;
    let (config, want_grad) = (call.config, call.want_grad());
    let (n, v) = (hidden.nrows(), weight.nrows());
    if n.checked_mul(v).is_none_or(|x| x > MAX_MATERIALIZED_LOGITS) {
        return Err(Error::invalid(
            "weight",
            format!("{n} tokens x {v} vocabulary entries is over the {MAX_MATERIALIZED_LOGITS} logits the materialized path may hold"),
        ));
    }
    let rows = Rows::new(call, v, 0, v)?;
    let mut logits = Array2::zeros((n, v));
    matmul(logits.view_mut(), hidden, weight.t(), false, Threads::All);
    let flat = logits.as_slice_mut().expect("fresh");
    let stats = capped_row_stats(flat, (n, v), &rows, config.softcap);
    let (per_token_loss, loss) = rows.losses(&stats)?;
    let (mut grad_hidden, mut grad_weight) = (None, None);
    if want_grad {
        gradient_tile(
            logits.as_slice_mut().expect("fresh"),
            v,
            0,
            v,
            &rows,
            0,
            &stats,
        );
        let mut gh = Array2::zeros(hidden.dim());
        matmul(gh.view_mut(), logits.view(), weight, false, Threads::All);
        let mut gw = Array2::zeros(weight.dim());
        matmul(gw.view_mut(), logits.t(), hidden, false, Threads::All);
        grad_hidden = Some(gh);
        grad_weight = Some(gw);
    }
    Ok(LinearCrossEntropy32 {
        ce: CrossEntropy32 {
            loss,
            per_token_loss,
            stats,
            num_tokens: rows.num_tokens(),
            // The buffer holds dL/dlogits now: returned, not dropped.
            grad_logits: want_grad.then_some(logits),
        },
        grad_hidden,
        grad_weight,
        logits_buffer_bytes: 4 * n * v,
        traded: None,
    })
}

/// The checks every chunked unsharded kernel starts with — the inputs
/// ([`check_linear_inputs`]), then the chunk sizes — and its rows' targets
/// (`hidden: [n, h]`, `weight: [v, h]`).
///
/// # Errors
/// As [`check_linear_inputs`]; [`Error::InvalidArgument`] (`chunks`) for a
/// zero chunk size.
fn chunked_rows<'a>(
    hidden: ArrayView2<f32>,
    weight: ArrayView2<f32>,
    call: &LossCall<'a>,
    chunks: Chunks,
) -> Result<Rows<'a>> {
    check_linear_inputs(hidden, weight, call)?;
    check_chunks(chunks)?;
    let v = weight.nrows();
    Rows::new(call, v, 0, v)
}

fn check_chunks(chunks: Chunks) -> Result<()> {
    if chunks.tokens == 0 || chunks.vocab == 0 {
        return Err(Error::invalid(
            "chunks",
            format!("{chunks:?}: tokens and vocab must be at least 1"),
        ));
    }
    Ok(())
}

/// The output layer and its cross-entropy, fused and chunked (see the module
/// docs): the same results as [`linear_cross_entropy_materialized`] while
/// holding a `[min(n, chunks.tokens), v]` buffer instead of `[n, v]`.
///
/// # Errors
/// As `packshard_reference::vocab::linear_cross_entropy` (with
/// [`F32_LOGIT_BOUND`], and no bound on `n * v`: nothing of that size
/// exists); [`Error::InvalidArgument`] (`chunks`) for a zero chunk size.
pub fn linear_cross_entropy_fused(
    hidden: ArrayView2<f32>,
    weight: ArrayView2<f32>,
    call: &LossCall,
    chunks: Chunks,
) -> Result<LinearCrossEntropy32> {
    let rows = chunked_rows(hidden, weight, call, chunks)?;
    let (config, want_grad) = (call.config, call.want_grad());
    let (n, v) = (hidden.nrows(), weight.nrows());
    let tn = chunks.tokens.min(n).max(1);
    let mut buf = Array2::<f32>::zeros((tn, v));
    let mut stats = vec![SoftmaxStats::EMPTY; n];
    let mut grads = want_grad.then(|| {
        (
            Array2::<f32>::zeros(hidden.dim()),
            Array2::<f32>::zeros(weight.dim()),
        )
    });
    for (i0, m) in spans(n, tn) {
        let x = hidden.slice(s![i0..i0 + m, ..]);
        let mut b = buf.slice_mut(s![..m, ..]);
        for (j0, tile) in spans(v, chunks.vocab) {
            capped_logits_tile(&mut b, x, weight, (j0, tile), config.softcap);
            merge_tile_stats(
                b.as_slice().expect("rows of a standard buffer"),
                v,
                j0,
                tile,
                &rows,
                i0,
                &mut stats[i0..i0 + m],
            );
        }
        // The whole row's statistics exist now: losses are checked at the
        // end, gradients can be formed tile by tile.
        if let Some(grads) = grads.as_mut() {
            for j0 in (0..v).step_by(chunks.vocab) {
                let tile = (v - j0).min(chunks.vocab);
                gradient_tile(
                    b.as_slice_mut().expect("rows of a standard buffer"),
                    v,
                    j0,
                    tile,
                    &rows,
                    i0,
                    &stats[i0..i0 + m],
                );
                let g = b.slice(s![.., j0..j0 + tile]);
                accumulate_tile_grads(g, (x, weight), (i0, j0), grads);
            }
        }
    }
    let forward = rows.losses(&stats)?;
    Ok(fused_result(&rows, stats, forward, grads, 4 * tn * v))
}

/// `dL/dhidden[i0..] += G W[j0..]` and `dL/dW[j0..] += G^T x` for the
/// gradient tile `g: [m, tile]` of the tokens `x: [m, h]` (rows `i0..` of
/// the hidden states) and the vocabulary rows `j0..j0 + tile`.
fn accumulate_tile_grads(
    g: ArrayView2<f32>,
    (x, weight): (ArrayView2<f32>, ArrayView2<f32>),
    (i0, j0): (usize, usize),
    (gh, gw): &mut (Array2<f32>, Array2<f32>),
) {
    let (m, tile) = g.dim();
    let w_tile = weight.slice(s![j0..j0 + tile, ..]);
    matmul(
        gh.slice_mut(s![i0..i0 + m, ..]),
        g,
        w_tile,
        true,
        Threads::All,
    );
    matmul(
        gw.slice_mut(s![j0..j0 + tile, ..]),
        g.t(),
        x,
        true,
        Threads::All,
    );
}

/// The result of a fused kernel (no `dL/dlogits`): the row statistics, the
/// losses `forward`, the gradients `(dL/dhidden, dL/dW)` and the bytes of
/// its logits buffer.
fn fused_result(
    rows: &Rows,
    stats: Vec<SoftmaxStats>,
    (per_token_loss, loss): (Array1<f64>, f64),
    grads: Option<(Array2<f32>, Array2<f32>)>,
    logits_buffer_bytes: usize,
) -> LinearCrossEntropy32 {
    let (grad_hidden, grad_weight) = grads.unzip();
    LinearCrossEntropy32 {
        ce: CrossEntropy32 {
            loss,
            per_token_loss,
            stats,
            num_tokens: rows.num_tokens(),
            grad_logits: None,
        },
        grad_hidden,
        grad_weight,
        logits_buffer_bytes,
        traded: None,
    }
}

/// `(start, len)` of the consecutive chunks of `0..n` of at most `size`.
fn spans(n: usize, size: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..n).step_by(size).map(move |s| (s, (n - s).min(size)))
}

/// The logits of the tokens `x: [m, h]` against vocabulary rows `j0..j0 +
/// tile` of `weight`, into those columns of `b: [m, ..]`.
fn logits_tile(
    b: &mut ArrayViewMut2<f32>,
    x: ArrayView2<f32>,
    weight: ArrayView2<f32>,
    (j0, tile): (usize, usize),
) {
    matmul(
        b.slice_mut(s![.., j0..j0 + tile]),
        x,
        weight.slice(s![j0..j0 + tile, ..]).t(),
        false,
        Threads::All,
    );
}

/// [`logits_tile`], then the softcap on those columns ([`cap_tile`]; `b`
/// whole rows of a standard buffer): the logits every tiled pass
/// (re)computes.
fn capped_logits_tile(
    b: &mut ArrayViewMut2<f32>,
    x: ArrayView2<f32>,
    weight: ArrayView2<f32>,
    (j0, tile): (usize, usize),
    cap: Option<f64>,
) {
    logits_tile(b, x, weight, (j0, tile));
    let width = b.ncols();
    let flat = b.as_slice_mut().expect("rows of a standard buffer");
    cap_tile(flat, width, j0, tile, cap);
}

/// Each row's softmax statistics over the whole of `flat` (`[n, v]`, standard
/// layout) after capping it in place: the one pass over materialized logits
/// of the unsharded kernels and of alg2's per-rank cross-entropy (`v` then
/// the shard's real width).
fn capped_row_stats(
    flat: &mut [f32],
    (n, v): (usize, usize),
    rows: &Rows,
    cap: Option<f64>,
) -> Vec<SoftmaxStats> {
    cap_tile(flat, v, 0, v, cap);
    let mut stats = vec![SoftmaxStats::EMPTY; n];
    merge_tile_stats(flat, v, 0, v, rows, 0, &mut stats);
    stats
}

/// `[rows, cols]` mutable view helper for the shard passes.
fn rows_view(buf: &mut Array2<f32>, m: usize) -> ArrayViewMut2<'_, f32> {
    buf.slice_mut(s![..m, ..])
}
