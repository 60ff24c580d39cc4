//! The output layer tiled over tokens **and** vocabulary (the layout of
//! Apple's Cut Cross-Entropy, Wijmans et al. 2024, and Liger's fused
//! linear cross-entropy taken to vocabulary tiles): its only logits buffer
//! is one `[tokens, vocab]` tile, never a row of `v`.
//!
//! - **Pass 1**, per chunk of tokens and tile of the vocabulary: the tile's
//!   logits `x W_tile^T` (one product), soft-capped where asked, its row
//!   statistics merged into each row's [`SoftmaxStats`] (running maximum,
//!   sum of exponentials, target term, target mass: every option's sums).
//! - The losses from the whole-row statistics (the reference's formulas).
//! - **Pass 2** (gradients), per chunk and tile again: the tile's logits
//!   recomputed, `dL/dz` in place from the row statistics, `dL/dhidden +=
//!   G W_tile`, `dL/dW_tile += G^T x`.
//!
//! Four products instead of the materialized path's three (the logits are
//! computed twice); working memory one tile plus the `[n]` statistics.
//! Sharded, the op runs `alg2`'s shard kernel as
//! [`super::linear_cross_entropy_fused`]'s does ([`super::alg2`]).
//!
//! [`linear_cross_entropy_tiled_filtered`] adds Cut Cross-Entropy's gradient
//! filtering to pass 2 and reports the error it trades ([`TradedError`]).

use super::*;

/// The output layer in tiles of `chunks.tokens x chunks.vocab` (see the
/// module docs): the results of [`linear_cross_entropy_materialized`]
/// (losses, statistics, `dL/dhidden`, `dL/dW`; no `dL/dlogits`) while
/// holding one `[min(n, tokens), min(v, vocab)]` f32 tile.
///
/// # Errors
/// As [`linear_cross_entropy_fused`].
pub fn linear_cross_entropy_tiled(
    hidden: ArrayView2<f32>,
    weight: ArrayView2<f32>,
    call: &LossCall,
    chunks: Chunks,
) -> Result<LinearCrossEntropy32> {
    tiled(hidden, weight, call, chunks, None)
}

/// [`linear_cross_entropy_tiled`] with gradient filtering (Cut
/// Cross-Entropy, Wijmans et al. 2024, §4.3, whose default `threshold` is
/// 2^-12): in pass 2, a tile of `dL/dz` whose every entry satisfies
/// `|dL/dz_ij| <= threshold * |w_i|` (`w_i` the row's weight,
/// [`LossCall::token_weights`]: the test is on the softmax's scale) skips
/// its two products. The losses and statistics are exact as
/// [`linear_cross_entropy_tiled`]'s; the gradients lose the skipped terms,
/// and [`LinearCrossEntropy32::traded`] bounds that loss per element:
/// `dL/dhidden` by `max_i (Σ_{skipped j} |dL/dz_ij|) x max|W|`, `dL/dW` by
/// `max_j (Σ_{skipped i} |dL/dz_ij|) x max|hidden|` (each skipped term
/// `dL/dz_ij W_jk` is at most that in size), with the number of skipped
/// tiles. `threshold = 0` skips only all-zero tiles (ignored rows): the
/// results of [`linear_cross_entropy_tiled`], bound 0.
///
/// # Errors
/// As [`linear_cross_entropy_tiled`]; [`Error::InvalidArgument`]
/// (`threshold`) for a negative or non-finite threshold.
pub fn linear_cross_entropy_tiled_filtered(
    hidden: ArrayView2<f32>,
    weight: ArrayView2<f32>,
    call: &LossCall,
    chunks: Chunks,
    threshold: f32,
) -> Result<LinearCrossEntropy32> {
    if !(threshold.is_finite() && threshold >= 0.0) {
        return Err(Error::invalid(
            "threshold",
            format!("{threshold}: must be finite and at least 0"),
        ));
    }
    tiled(hidden, weight, call, chunks, Some(threshold))
}

/// The gradient mass a filtering kernel skipped: `[n]` row sums and `[v]`
/// column sums of `|dL/dz|` over the skipped tiles, and their count.
struct Skipped {
    rows: Vec<f64>,
    cols: Vec<f64>,
    tiles: usize,
}

impl Skipped {
    /// Whether the gradient tile `g: [m, tile]` of rows `i0..` is below
    /// `threshold` times each row's `|weight|` everywhere.
    fn below(g: ArrayView2<f32>, threshold: f32, weights: &[f64]) -> bool {
        g.outer_iter().zip(weights).all(|(row, w)| {
            let limit = f64::from(threshold) * w.abs();
            row.iter().all(|&x| f64::from(x.abs()) <= limit)
        })
    }

    /// Notes the skipped tile `g` at rows `i0..`, columns `j0..`.
    fn note(&mut self, g: ArrayView2<f32>, (i0, j0): (usize, usize)) {
        for (r, row) in g.outer_iter().enumerate() {
            for (c, &x) in row.iter().enumerate() {
                let a = f64::from(x.abs());
                self.rows[i0 + r] += a;
                self.cols[j0 + c] += a;
            }
        }
        self.tiles += 1;
    }

    /// The bound on each gradient's per-element error (see
    /// [`linear_cross_entropy_tiled_filtered`]).
    fn bound(&self, hidden: ArrayView2<f32>, weight: ArrayView2<f32>) -> TradedError {
        let max_abs = |a: ArrayView2<f32>| a.iter().fold(0.0f64, |m, &x| m.max(f64::from(x.abs())));
        let largest = |xs: &[f64]| xs.iter().copied().fold(0.0, f64::max);
        if self.tiles == 0 {
            return TradedError {
                grad_hidden: 0.0,
                grad_weight: 0.0,
                skipped_tiles: 0,
            };
        }
        TradedError {
            grad_hidden: largest(&self.rows) * max_abs(weight),
            grad_weight: largest(&self.cols) * max_abs(hidden),
            skipped_tiles: self.tiles,
        }
    }
}

/// The tiled kernel, filtering its gradient tiles below `filter` when given.
fn tiled(
    hidden: ArrayView2<f32>,
    weight: ArrayView2<f32>,
    call: &LossCall,
    chunks: Chunks,
    filter: Option<f32>,
) -> Result<LinearCrossEntropy32> {
    check_linear_inputs(hidden, weight, call)?;
    let (config, want_grad) = (call.config, call.want_grad());
    check_chunks(chunks)?;
    let (n, v) = (hidden.nrows(), weight.nrows());
    let rows = Rows::new(call, v, 0, v)?;
    let (tn, tv) = (chunks.tokens.min(n).max(1), chunks.vocab.min(v));
    let mut buf = Array2::<f32>::zeros((tn, tv));
    let mut stats = vec![SoftmaxStats::EMPTY; n];
    // The tile's logits into the first `tile` columns of `buf`'s first `m` rows.
    let logits = |buf: &mut Array2<f32>, (i0, m): (usize, usize), (j0, tile): (usize, usize)| {
        matmul(
            buf.slice_mut(s![..m, ..tile]),
            hidden.slice(s![i0..i0 + m, ..]),
            weight.slice(s![j0..j0 + tile, ..]).t(),
            false,
            Threads::All,
        );
        let flat = &mut buf.as_slice_mut().expect("standard")[..m * tv];
        cap_tile(flat, tv, 0, tile, config.softcap);
    };
    // Pass 1: the row statistics.
    for (i0, m) in spans(n, tn) {
        for (j0, tile) in spans(v, tv) {
            logits(&mut buf, (i0, m), (j0, tile));
            let flat = &buf.as_slice().expect("standard")[..m * tv];
            merge_stats_at(flat, tv, (0, j0, tile), &rows, i0, &mut stats[i0..i0 + m]);
        }
    }
    let forward = rows.losses(&stats)?;
    // Pass 2: the gradients, from recomputed logits.
    let mut grads = want_grad.then(|| {
        let zeros = |a: ArrayView2<f32>| Array2::<f32>::zeros(a.dim());
        (zeros(hidden), zeros(weight))
    });
    let mut skipped = Skipped {
        rows: vec![0.0; if filter.is_some() { n } else { 0 }],
        cols: vec![0.0; if filter.is_some() { v } else { 0 }],
        tiles: 0,
    };
    if let Some(grads) = grads.as_mut() {
        for (i0, m) in spans(n, tn) {
            let x = hidden.slice(s![i0..i0 + m, ..]);
            for (j0, tile) in spans(v, tv) {
                logits(&mut buf, (i0, m), (j0, tile));
                let flat = &mut buf.as_slice_mut().expect("standard")[..m * tv];
                gradient_at(flat, tv, (0, j0, tile), &rows, i0, &stats[i0..i0 + m]);
                let g = buf.slice(s![..m, ..tile]);
                if let Some(threshold) = filter {
                    if Skipped::below(g, threshold, &rows.weights[i0..i0 + m]) {
                        skipped.note(g, (i0, j0));
                        continue;
                    }
                }
                accumulate_tile_grads(g, (x, weight), (i0, j0), grads);
            }
        }
    }
    let mut out = fused_result(&rows, stats, forward, grads, 4 * tn * tv);
    out.traded = filter.map(|_| skipped.bound(hidden, weight));
    Ok(out)
}
