//! Sliding-window attention (flash-attention's `window_size = (left, 0)`,
//! Mistral's `sliding_window`) in the tiled kernel against the same kernel
//! without a window, in one run (issue 33): causal rows of `max_len` tokens,
//! `left = max_len / 4` (128 at the 512). The window's saving is the
//! key tiles it skips ([`varlen_scored_pairs`]): the time ratio is set
//! against that work ratio.

use ndarray::Array3;
use packshard_optimized::attention::{
    dense_masked_attention, varlen_attention_general, varlen_attention_general_backward,
    varlen_scored_pairs, AttentionOutput32,
};
use packshard_reference::attention::options::visible_keys;
use packshard_reference::attention::Window;
use packshard_reference::ops::Varlen;
use packshard_reference::{Error, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::{time_warm, BenchConfig};

/// The window measurement: forward and backward, f32, with and without the
/// window, over the same inputs.
#[derive(Debug, Clone)]
pub struct WindowReport {
    /// Rows (one causal segment each) of `row_len` tokens.
    pub rows: usize,
    /// Tokens per row.
    pub row_len: usize,
    /// `window_size = (left, 0)`.
    pub left: usize,
    /// The (query, key) scores the kernel computes, one head: with the
    /// window, without.
    pub scored_pairs: (u64, u64),
    /// The pairs the masks allow, one head: with the window, without.
    pub allowed_pairs: (u64, u64),
    /// Seconds of the forward: with the window, without.
    pub forward_s: (f64, f64),
    /// Seconds of the backward: with the window, without.
    pub backward_s: (f64, f64),
}

impl WindowReport {
    /// Scored pairs with the window / without.
    pub fn work_ratio(&self) -> f64 {
        self.scored_pairs.0 as f64 / self.scored_pairs.1 as f64
    }
}

/// The pairs the window and causal masks allow in one head of `p`.
fn allowed_pairs(p: &Varlen<'_>) -> u64 {
    p.cu_seqlens_q
        .windows(2)
        .map(|w| {
            let l = w[1] - w[0];
            (0..l)
                .map(|r| visible_keys(r, l, l, p.causal, p.window).len() as u64)
                .sum::<u64>()
        })
        .sum()
}

/// Runs the window measurement on `cfg.sequences` rows of `cfg.max_len`
/// tokens, `cfg.heads` heads of `hidden / heads`.
///
/// # Errors
/// Invalid configuration, the kernel's errors (none expected), and a
/// windowed output that differs from the dense masked kernel's with the
/// window as its mask (they are equal to the bit: the tiles the window skips
/// hold only masked scores; not timed then).
pub fn window(cfg: &BenchConfig) -> Result<WindowReport> {
    cfg.validate()?;
    let (rows, len, h) = (cfg.sequences, cfg.max_len, cfg.heads);
    let d = cfg.hidden / h;
    let n = rows * len;
    let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed + 3);
    let mut t3 = || Array3::from_shape_fn((n, h, d), |_| rng.random_range(-2.0f32..2.0));
    let (q, k, v, go) = (t3(), t3(), t3(), t3());
    let scale = 1.0 / (d as f64).sqrt();
    let cu: Vec<usize> = (0..=rows).map(|r| r * len).collect();
    let left = len / 4;
    let full = Varlen::new(&cu, true, scale);
    let windowed = full.with_window(Window {
        left: Some(left),
        right: Some(0),
    });
    let fwd = |p: &Varlen<'_>| varlen_attention_general(q.view(), k.view(), v.view(), p);
    let bwd = |p: &Varlen<'_>, f: &AttentionOutput32| {
        varlen_attention_general_backward(q.view(), k.view(), v.view(), p, f, go.view())
    };
    let (fw, ff) = (fwd(&windowed)?, fwd(&full)?);
    check_against_dense(&windowed, (&q, &k, &v), len, &fw)?;
    bwd(&windowed, &fw)?;
    bwd(&full, &ff)?;
    let forward_s = (
        time_warm(cfg.reps, || fwd(&windowed)),
        time_warm(cfg.reps, || fwd(&full)),
    );
    let backward_s = (
        time_warm(cfg.reps, || bwd(&windowed, &fw)),
        time_warm(cfg.reps, || bwd(&full, &ff)),
    );
    Ok(WindowReport {
        rows,
        row_len: len,
        left,
        scored_pairs: (varlen_scored_pairs(&windowed), varlen_scored_pairs(&full)),
        allowed_pairs: (allowed_pairs(&windowed), allowed_pairs(&full)),
        forward_s,
        backward_s,
    })
}

/// The windowed output against the dense masked kernel with the window's
/// `[len, len]` mask in every row (which computes every tile).
fn check_against_dense(
    p: &Varlen<'_>,
    (q, k, v): (&Array3<f32>, &Array3<f32>, &Array3<f32>),
    len: usize,
    ours: &AttentionOutput32,
) -> Result<()> {
    let rows = p.cu_seqlens_q.len() - 1;
    let mask = ndarray::Array2::from_shape_fn((len, len), |(r, c)| {
        visible_keys(r, len, len, p.causal, p.window).contains(&c)
    });
    let masks = vec![mask.view(); rows];
    let dense = dense_masked_attention(q.view(), k.view(), v.view(), len, &masks, p.scale as f32)?;
    if dense.output != ours.output {
        return Err(Error::invalid(
            "window",
            "the windowed varlen output differs from the dense masked kernel's: not timing",
        ));
    }
    Ok(())
}
