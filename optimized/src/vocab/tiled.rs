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
    if let Some(grads) = grads.as_mut() {
        for (i0, m) in spans(n, tn) {
            let x = hidden.slice(s![i0..i0 + m, ..]);
            for (j0, tile) in spans(v, tv) {
                logits(&mut buf, (i0, m), (j0, tile));
                let flat = &mut buf.as_slice_mut().expect("standard")[..m * tv];
                gradient_at(flat, tv, (0, j0, tile), &rows, i0, &stats[i0..i0 + m]);
                let g = buf.slice(s![..m, ..tile]);
                accumulate_tile_grads(g, (x, weight), (i0, j0), grads);
            }
        }
    }
    Ok(fused_result(&rows, stats, forward, grads, 4 * tn * tv))
}
