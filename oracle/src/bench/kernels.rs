//! The experiments the optimized kernels were built for: the encoder layer
//! packed against padded, varlen attention against the dense masked kernel
//! (and candle's), the fused output layer's time and memory against the
//! materialized one (see the module docs of [`super`]).

use ndarray::{s, Array2, Array3, ArrayView2};
use packshard_optimized::attention::{dense_masked_attention, varlen_attention, varlen_pairs};
use packshard_optimized::layer::{layer_backward, layer_flops, layer_forward, layer_params_f32};
use packshard_optimized::ops::{LinearCeTiled, LinearCeTiledFiltered};
use packshard_optimized::vocab::{
    linear_cross_entropy_fused, linear_cross_entropy_materialized, linear_cross_entropy_tiled,
    linear_cross_entropy_tiled_filtered, MAX_MATERIALIZED_LOGITS,
};
use packshard_reference::attention::{AttentionLayout, ReferenceAttention};
use packshard_reference::bert::{BertConfig, BertParams};
use packshard_reference::vocab::{LossCall, LossConfig};
use packshard_reference::{Error, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::{
    gemm_rate, peak_since, time, time_warm, uniform2, wikipedia_lengths, Batch, BenchConfig,
};

/// The layer measurement.
#[derive(Debug, Clone)]
pub struct LayerReport {
    /// Sequences, real tokens, packs.
    pub sequences: usize,
    /// Real tokens.
    pub real_tokens: usize,
    /// Packs (rows of `max_len`).
    pub num_packs: usize,
    /// Seconds of forward + backward, packed.
    pub packed_s: f64,
    /// Seconds of forward + backward, padded.
    pub padded_s: f64,
    /// `padded_slots / packed_slots`: the token-count limit of the speed-up.
    pub slot_ratio: f64,
    /// GFLOP (matrix products and attention) of the packed run.
    pub packed_gflop: f64,
    /// The gemm rate measured in the same run, GFLOP/s.
    pub gemm_gflops: f64,
    /// Sequences the reference ran on (packed).
    pub reference_sequences: usize,
    /// Seconds of the f64 reference layer on them.
    pub reference_s: f64,
    /// Seconds of the optimized layer on the same.
    pub optimized_small_s: f64,
    /// Largest relative difference of the packed and padded outputs on real
    /// tokens (checked before timing).
    pub packed_vs_padded_rel: f64,
}

impl LayerReport {
    /// Packed speed-up over padded.
    pub fn speedup(&self) -> f64 {
        self.padded_s / self.packed_s
    }
    /// Achieved GFLOP/s of the packed run.
    pub fn achieved_gflops(&self) -> f64 {
        self.packed_gflop / self.packed_s
    }
}

fn layout_pairs(layout: &AttentionLayout) -> u64 {
    match layout {
        AttentionLayout::Varlen { cu_seqlens } => varlen_pairs(cu_seqlens, false),
        AttentionLayout::Dense { row_len, allowed } => (allowed.len() * row_len * row_len) as u64,
    }
}

/// Timed products behind the layer's gemm rate, at least.
const GEMM_REPS: usize = 10;

/// Runs the layer measurement.
///
/// # Errors
/// Invalid configuration, and the kernels' errors (none expected).
pub fn layer(cfg: &BenchConfig) -> Result<LayerReport> {
    cfg.validate()?;
    let (hd, heads, inter, msl) = (cfg.hidden, cfg.heads, cfg.intermediate, cfg.max_len);
    let batch = Batch::new(wikipedia_lengths(cfg.sequences, msl, cfg.seed)?, msl)?;
    let config = BertConfig::tiny(8, hd, heads, 1, inter, msl);
    let p64 = BertParams::random(&config, cfg.seed)
        .layers
        .into_iter()
        .next()
        .expect("one layer");
    let p = layer_params_f32(&p64)?;
    let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed + 1);
    // Real tokens' inputs, placed in packed and padded rows.
    let real_x: Vec<Array2<f32>> = batch
        .lengths
        .iter()
        .map(|&l| uniform2(&mut rng, (l, hd), 1.0))
        .collect();
    let real_g: Vec<Array2<f32>> = batch
        .lengths
        .iter()
        .map(|&l| uniform2(&mut rng, (l, hd), 1.0))
        .collect();
    let (xp, gp) = (batch.place_packed(&real_x), batch.place_packed(&real_g));
    let (xd, gd) = (batch.place_padded(&real_x), batch.place_padded(&real_g));
    let packed = AttentionLayout::Varlen {
        cu_seqlens: batch.cu_seqlens.clone(),
    };
    let padded = batch.padded_layout();
    let eps = 1e-12;
    let run = |x: &Array2<f32>, g: &Array2<f32>, layout: &AttentionLayout| -> Result<_> {
        let (out, cache) = layer_forward(&p, heads, eps, x.view(), layout)?;
        let (dx, _) = layer_backward(&p, heads, &cache, layout, g.view())?;
        Ok((out, dx))
    };
    // Check: packed == padded on the real tokens.
    let (op, _) = run(&xp, &gp, &packed)?;
    let (od, _) = run(&xd, &gd, &padded)?;
    let worst = batch.packed_vs_padded(&op, &od);
    if worst > 1e-4 {
        return Err(Error::invalid(
            "layer",
            format!("packed and padded outputs differ by {worst:e} (relative): not timing"),
        ));
    }
    let packed_s = time_warm(cfg.reps, || run(&xp, &gp, &packed));
    let padded_s = time_warm(cfg.reps, || run(&xd, &gd, &padded));
    let (f, b) = layer_flops(batch.packed_slots(), hd, inter, layout_pairs(&packed));
    // At least 10 timed products (about 0.1 s each at 200 GFLOP/s): the
    // minimum of one is a single short window on a shared machine, and a
    // low gemm rate would flatter the layer's fraction of it.
    let gemm_gflops = gemm_rate(
        batch.packed_slots().min(4096),
        hd,
        inter,
        cfg.reps.max(GEMM_REPS),
        cfg.seed,
    );
    // The reference on the first sequences, packed.
    let k = cfg.reference_sequences.clamp(1, cfg.sequences);
    let small = Batch::new(batch.lengths[..k].to_vec(), msl)?;
    let n_small = small.real_tokens();
    let small_layout = AttentionLayout::Varlen {
        cu_seqlens: {
            let mut cu = vec![0];
            for &l in &small.lengths {
                cu.push(cu.last().expect("non-empty") + l);
            }
            cu
        },
    };
    let xs = uniform2(&mut rng, (n_small, hd), 1.0);
    let gs = uniform2(&mut rng, (n_small, hd), 1.0);
    let (xs64, gs64) = (xs.mapv(f64::from), gs.mapv(f64::from));
    let reference_s = time(1, || -> Result<()> {
        use packshard_reference::bert::layer as rl;
        let (_, cache) = rl::layer_forward(
            &p64,
            heads,
            eps as f64,
            &ReferenceAttention,
            xs64.view(),
            &small_layout,
        )?;
        let mut g = BertParams::zeros(&config).layers.remove(0);
        rl::layer_backward(
            &p64,
            &mut g,
            heads,
            &ReferenceAttention,
            &cache,
            &small_layout,
            gs64.view(),
        )?;
        Ok(())
    });
    let optimized_small_s = time(cfg.reps, || run(&xs, &gs, &small_layout));
    Ok(LayerReport {
        sequences: cfg.sequences,
        real_tokens: batch.real_tokens(),
        num_packs: batch.num_packs,
        packed_s,
        padded_s,
        slot_ratio: batch.padded_slots() as f64 / batch.packed_slots() as f64,
        packed_gflop: (f + b) / 1e9,
        gemm_gflops,
        reference_sequences: k,
        reference_s,
        optimized_small_s,
        packed_vs_padded_rel: worst,
    })
}

// ---- attention ----------------------------------------------------------------------

/// The attention measurement (forward, f32).
#[derive(Debug, Clone)]
pub struct AttentionReport {
    /// Segments (sequences plus padding segments) and packs.
    pub segments: usize,
    /// Packs.
    pub num_packs: usize,
    /// `sum len^2` over the segments: the (query, key) pairs varlen scores.
    pub varlen_pairs: u64,
    /// `packs * max_len^2`: the pairs the dense masked kernel scores.
    pub dense_pairs: u64,
    /// Seconds, ours (varlen).
    pub varlen_s: f64,
    /// Seconds, dense masked over the same packs.
    pub dense_s: f64,
    /// Seconds, candle-nn's `flash_attn_varlen_cpu` (`None` without the
    /// `candle` feature).
    pub candle_s: Option<f64>,
    /// Largest absolute difference of candle's output from ours.
    pub candle_max_abs: Option<f64>,
}

/// Runs the attention measurement over the packs of the layer batch.
///
/// # Errors
/// Invalid configuration, the kernels' errors (none expected), and
/// disagreements over 1e-4 between the kernels (not timed then).
pub fn attention(cfg: &BenchConfig) -> Result<AttentionReport> {
    cfg.validate()?;
    let msl = cfg.max_len;
    let batch = Batch::new(wikipedia_lengths(cfg.sequences, msl, cfg.seed)?, msl)?;
    let (h, d) = (cfg.heads, cfg.hidden / cfg.heads);
    let n = batch.packed_slots();
    let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed + 2);
    let mut t3 = || Array3::from_shape_fn((n, h, d), |_| rng.random_range(-2.0f32..2.0));
    let (q, k, v) = (t3(), t3(), t3());
    let scale = 1.0 / (d as f32).sqrt();
    let cu = &batch.cu_seqlens;
    let masks = batch.block_diagonal_masks();
    let mviews: Vec<_> = masks.iter().map(|m| m.view()).collect();
    let ours = varlen_attention(q.view(), k.view(), v.view(), cu, false, scale)?;
    let dense = dense_masked_attention(q.view(), k.view(), v.view(), msl, &mviews, scale)?;
    let diff = ours
        .output
        .iter()
        .zip(&dense.output)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    if diff > 1e-4 {
        return Err(Error::invalid(
            "attention",
            format!("varlen and dense masked differ by {diff}: not timing"),
        ));
    }
    let varlen_s = time_warm(cfg.reps, || {
        varlen_attention(q.view(), k.view(), v.view(), cu, false, scale)
    });
    let dense_s = time_warm(cfg.reps, || {
        dense_masked_attention(q.view(), k.view(), v.view(), msl, &mviews, scale)
    });
    let peer = PeerInput {
        qkv: [&q, &k, &v],
        cu,
        max_len: msl,
        scale,
        ours: &ours.output,
        reps: cfg.reps,
    };
    let (candle_s, candle_max_abs) = candle_peer(&peer)?;
    Ok(AttentionReport {
        segments: cu.len() - 1,
        num_packs: batch.num_packs,
        varlen_pairs: varlen_pairs(cu, false),
        dense_pairs: (batch.num_packs * msl * msl) as u64,
        varlen_s,
        dense_s,
        candle_s,
        candle_max_abs,
    })
}

/// What the candle peer is timed on: the inputs, our output to check it
/// against, and how many repetitions.
#[cfg_attr(not(feature = "candle"), allow(dead_code))]
struct PeerInput<'a> {
    /// `q, k, v: [n, h, d]`.
    qkv: [&'a Array3<f32>; 3],
    /// The packs' `cu_seqlens` over all rows.
    cu: &'a [usize],
    /// The longest segment (`max_seqlen`).
    max_len: usize,
    /// The softmax scale.
    scale: f32,
    /// Our varlen output.
    ours: &'a Array3<f32>,
    /// Timed repetitions.
    reps: usize,
}

#[cfg(feature = "candle")]
fn candle_peer(x: &PeerInput<'_>) -> Result<(Option<f64>, Option<f64>)> {
    use candle_core::{Device, Tensor};
    let err = |e: candle_core::Error| Error::invalid("candle", e.to_string());
    let dev = Device::Cpu;
    let t = |x: &Array3<f32>| {
        Tensor::from_slice(
            x.as_standard_layout().as_slice().expect("standard"),
            x.dim(),
            &dev,
        )
        .map_err(err)
    };
    let [q, k, v] = x.qkv;
    let (tq, tk, tv) = (t(q)?, t(k)?, t(v)?);
    let (max_len, scale) = (x.max_len, x.scale);
    let lens: Vec<u32> = x.cu.windows(2).map(|w| (w[1] - w[0]) as u32).collect();
    let sl = Tensor::from_slice(&lens, lens.len(), &dev).map_err(err)?;
    let call = || {
        candle_nn::attention::flash_attn_varlen_cpu(
            &tq, &tk, &tv, None, &sl, &sl, max_len, max_len, scale, false, None, None,
        )
    };
    let out = call().map_err(err)?;
    let flat: Vec<f32> = out.flatten_all().map_err(err)?.to_vec1().map_err(err)?;
    let max_abs = flat
        .iter()
        .zip(x.ours.iter())
        .map(|(a, b)| f64::from((a - b).abs()))
        .fold(0.0, f64::max);
    if max_abs > 1e-3 {
        return Err(Error::invalid(
            "candle",
            format!("flash_attn_varlen_cpu differs from ours by {max_abs}: not timing"),
        ));
    }
    let s = time_warm(x.reps, || call().map(|_| ()));
    Ok((Some(s), Some(max_abs)))
}

#[cfg(not(feature = "candle"))]
fn candle_peer(_: &PeerInput<'_>) -> Result<(Option<f64>, Option<f64>)> {
    Ok((None, None))
}

// ---- cross-entropy ------------------------------------------------------------------

/// One cross-entropy size.
#[derive(Debug, Clone)]
pub struct CeReport {
    /// Vocabulary.
    pub vocab: usize,
    /// Hidden.
    pub hidden: usize,
    /// Tokens.
    pub tokens: usize,
    /// Seconds, materialized (`None` over [`MAX_MATERIALIZED_LOGITS`] or
    /// the memory budget).
    pub materialized_s: Option<f64>,
    /// Peak heap bytes of the materialized path.
    pub materialized_peak: Option<usize>,
    /// Seconds, fused.
    pub fused_s: f64,
    /// Peak heap bytes of the fused path.
    pub fused_peak: Option<usize>,
    /// Seconds, tiled over tokens and vocabulary (`linear_ce_tiled`).
    pub tiled_s: f64,
    /// Peak heap bytes of the tiled path.
    pub tiled_peak: Option<usize>,
    /// The filtered path on these inputs (its `tiled_s` is [`Self::tiled_s`]).
    pub filtered: FilterReport,
    /// Both tiled paths on a peaked softmax: the weight's first 512 rows
    /// (one vocabulary tile: the frequent tokens of a frequency-sorted
    /// vocabulary, as Cut Cross-Entropy sorts it) 15 x larger.
    pub filtered_peaked: FilterReport,
    /// Bytes of the gradients both return (`[n, h] + [v, h]` f32).
    pub output_bytes: usize,
    /// Bytes of the `[n, v]` f32 logits.
    pub logits_bytes: usize,
}

/// The tiled kernel with gradient filtering (`linear_ce_tiled_filtered`,
/// threshold 2^-12) against the tiled one, on one input.
#[derive(Debug, Clone, Copy)]
pub struct FilterReport {
    /// Seconds, tiled.
    pub tiled_s: f64,
    /// Seconds, filtered.
    pub filtered_s: f64,
    /// The tiles whose products it skipped, of `tiles`.
    pub skipped: usize,
    /// The gradient tiles.
    pub tiles: usize,
    /// The bounds it reported on `(dL/dhidden, dL/dW)`.
    pub bounds: (f64, f64),
}

/// [`FilterReport`] of `x: [n, h]` and `w: [v, h]` in the tiled kernel's
/// tiles (`tiled_s` measured here unless given).
fn time_filtered(
    reps: usize,
    (x, w): (ArrayView2<f32>, ArrayView2<f32>),
    call: &LossCall,
    tiled_s: Option<f64>,
) -> Result<FilterReport> {
    let tiles = LinearCeTiled::default().chunks;
    let threshold = LinearCeTiledFiltered::default().threshold;
    let filtered = || linear_cross_entropy_tiled_filtered(x, w, call, tiles, threshold);
    let traded = filtered()?
        .traded
        .ok_or_else(|| Error::invalid("cross_entropy", "the filtered kernel reported no trade"))?;
    let filtered_s = time_warm(reps, filtered);
    let tiled_s = match tiled_s {
        Some(s) => s,
        None => time_warm(reps, || linear_cross_entropy_tiled(x, w, call, tiles)),
    };
    Ok(FilterReport {
        tiled_s,
        filtered_s,
        skipped: traded.skipped_tiles,
        tiles: x.nrows().div_ceil(tiles.tokens) * w.nrows().div_ceil(tiles.vocab),
        bounds: (traded.grad_hidden, traded.grad_weight),
    })
}

/// Runs the cross-entropy measurement for each of `cfg.ce_sizes`.
///
/// # Errors
/// Invalid configuration, the kernels' errors, and a disagreement of the
/// losses over 1e-4 (relative).
pub fn cross_entropy(cfg: &BenchConfig) -> Result<Vec<CeReport>> {
    cfg.validate()?;
    let n = cfg.ce_tokens;
    let mut out = Vec::new();
    for &(v, hd) in &cfg.ce_sizes {
        let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed + 3);
        let x = uniform2(&mut rng, (n, hd), 1.0);
        let w = uniform2(&mut rng, (v, hd), 0.1);
        let t: Vec<i64> = (0..n).map(|_| rng.random_range(0..v as i64)).collect();
        let config = LossConfig::default();
        let call = LossCall::with_flag(&t, &config, true);
        let chunks = cfg.ce_chunks;
        let fused = || linear_cross_entropy_fused(x.view(), w.view(), &call, chunks);
        let (f, fused_peak) = peak_since(fused);
        let f = f?;
        let fused_s = time_warm(cfg.reps, fused);
        let tiles = LinearCeTiled::default().chunks;
        let tiled = || linear_cross_entropy_tiled(x.view(), w.view(), &call, tiles);
        let (tl, tiled_peak) = peak_since(tiled);
        let rel = (tl?.ce.loss - f.ce.loss).abs() / f.ce.loss.abs();
        if rel > 1e-4 {
            return Err(Error::invalid(
                "cross_entropy",
                format!("tiled and fused losses differ by {rel:e}: not timing"),
            ));
        }
        let tiled_s = time_warm(cfg.reps, tiled);
        let filtered = time_filtered(cfg.reps, (x.view(), w.view()), &call, Some(tiled_s))?;
        let mut peaked = w.clone();
        let frequent = v.min(512);
        peaked
            .slice_mut(s![..frequent, ..])
            .mapv_inplace(|a| 15.0 * a);
        let filtered_peaked = time_filtered(cfg.reps, (x.view(), peaked.view()), &call, None)?;
        drop(peaked);
        let (mut materialized_s, mut materialized_peak) = (None, None);
        if n * v <= MAX_MATERIALIZED_LOGITS && cfg.materialized_fits(v) {
            let mat = || linear_cross_entropy_materialized(x.view(), w.view(), &call);
            let (m, peak) = peak_since(mat);
            let m = m?;
            let rel = (m.ce.loss - f.ce.loss).abs() / m.ce.loss.abs();
            if rel > 1e-4 {
                return Err(Error::invalid(
                    "cross_entropy",
                    format!("fused and materialized losses differ by {rel:e}: not timing"),
                ));
            }
            drop(m);
            materialized_peak = peak;
            materialized_s = Some(time_warm(cfg.reps, mat));
        }
        out.push(CeReport {
            vocab: v,
            hidden: hd,
            tokens: n,
            materialized_s,
            materialized_peak,
            fused_s,
            fused_peak,
            tiled_s,
            tiled_peak,
            filtered,
            filtered_peaked,
            output_bytes: 4 * (n * hd + v * hd),
            logits_bytes: 4 * n * v,
        });
    }
    Ok(out)
}
