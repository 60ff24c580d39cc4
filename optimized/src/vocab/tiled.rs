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
/// 2^-12): in pass 2, a tile of `dL/dz` whose every entry off the rows'
/// targets satisfies `|dL/dz_ij| <= threshold * |w_i|` (`w_i` the row's
/// weight, [`LossCall::token_weights`]: the test is on the softmax's scale)
/// skips its two products; the target entries in it (`w_i (p_t - q_t)`,
/// CCE's separate indexed term) are still applied, one row each. The
/// losses and statistics are exact as [`linear_cross_entropy_tiled`]'s; the
/// gradients lose the skipped terms, and [`LinearCrossEntropy32::traded`]
/// bounds that loss per element: `dL/dhidden` by `max_i (Σ_{skipped j}
/// |dL/dz_ij|) x max|W|`, `dL/dW` by `max_j (Σ_{skipped i} |dL/dz_ij|) x
/// max|hidden|` (each skipped term `dL/dz_ij W_jk` is at most that in
/// size), with the number of skipped tiles. `threshold = 0` skips only
/// tiles that are zero off the targets (chunks of ignored tokens): the
/// results of [`linear_cross_entropy_tiled`] up to rounding, bound 0.
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
/// column sums of `|dL/dz|` over the skipped entries, and the tiles.
struct Skipped {
    rows: Vec<f64>,
    cols: Vec<f64>,
    tiles: usize,
}

/// A gradient tile `g: [m, tile]` of rows `i0..`, columns `j0..`, with each
/// row's target column in the tile, if there.
struct GradTile<'a> {
    g: ArrayView2<'a, f32>,
    at: (usize, usize),
    targets: Vec<Option<usize>>,
}

impl<'a> GradTile<'a> {
    fn new(g: ArrayView2<'a, f32>, (i0, j0): (usize, usize), rows: &Rows) -> Self {
        let tile = g.ncols();
        let targets = (i0..i0 + g.nrows())
            .map(|i| {
                let t = rows.q[i].target.filter(|&t| t >= j0 && t < j0 + tile);
                t.map(|t| t - j0)
            })
            .collect();
        GradTile {
            g,
            at: (i0, j0),
            targets,
        }
    }

    /// `f(r, c, |g_rc|)` on every entry off the targets, in order, while
    /// `f` answers `true`; whether it always did.
    fn off_target(&self, mut f: impl FnMut(usize, usize, f64) -> bool) -> bool {
        for (r, row) in self.g.outer_iter().enumerate() {
            let t = self.targets[r];
            for (c, &x) in row.iter().enumerate() {
                if Some(c) != t && !f(r, c, f64::from(x.abs())) {
                    return false;
                }
            }
        }
        true
    }

    /// Whether every entry off the targets is at most `threshold` times
    /// its row's `|weight|` (`weights`: rows `i0..`).
    fn below(&self, threshold: f32, weights: &[f64]) -> bool {
        let t = f64::from(threshold);
        self.off_target(|r, _, a| a <= t * weights[r].abs())
    }

    /// The target entries' terms, exactly: `dL/dhidden_i += g_it W_t`,
    /// `dL/dW_t += g_it x_i` (`x`: rows `i0..` of the hidden states).
    fn apply_targets(
        &self,
        (x, weight): (ArrayView2<f32>, ArrayView2<f32>),
        (gh, gw): &mut (Array2<f32>, Array2<f32>),
    ) {
        let (i0, j0) = self.at;
        for (r, c) in self.targets.iter().enumerate() {
            let Some(c) = *c else { continue };
            let a = self.g[[r, c]];
            gh.row_mut(i0 + r).scaled_add(a, &weight.row(j0 + c));
            gw.row_mut(j0 + c).scaled_add(a, &x.row(r));
        }
    }
}

impl Skipped {
    /// Notes the skipped entries of `tile` (those off the targets).
    fn note(&mut self, tile: &GradTile) {
        let (i0, j0) = tile.at;
        tile.off_target(|r, c, a| {
            self.rows[i0 + r] += a;
            self.cols[j0 + c] += a;
            true
        });
        self.tiles += 1;
    }

    /// The bound on each gradient's per-element error (see
    /// [`linear_cross_entropy_tiled_filtered`]).
    fn bound(&self, hidden: ArrayView2<f32>, weight: ArrayView2<f32>) -> TradedError {
        let max_abs = |a: ArrayView2<f32>| a.iter().fold(0.0f64, |m, &x| m.max(f64::from(x.abs())));
        let largest = |xs: &[f64]| xs.iter().copied().fold(0.0, f64::max);
        let (h, w) = (largest(&self.rows), largest(&self.cols));
        TradedError {
            grad_hidden: if h > 0.0 { h * max_abs(weight) } else { 0.0 },
            grad_weight: if w > 0.0 { w * max_abs(hidden) } else { 0.0 },
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
    let rows = chunked_rows(hidden, weight, call, chunks)?;
    let (config, want_grad) = (call.config, call.want_grad());
    let (n, v) = (hidden.nrows(), weight.nrows());
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
                    let t = GradTile::new(g, (i0, j0), &rows);
                    if t.below(threshold, &rows.weights[i0..i0 + m]) {
                        t.apply_targets((x, weight), grads);
                        skipped.note(&t);
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
