//! `packshard bench`: the optimized kernels timed against their baselines
//! in one run, so that ratios are measured under the same machine load.
//!
//! Three measurements (issue #6):
//!
//! - [`layer`]: the f32 encoder layer, forward + backward, on sequences whose
//!   lengths are drawn from the embedded `wikipedia-512` histogram: packed
//!   (SPFHP packs of `max_len` slots, varlen attention over `cu_seqlens`, the
//!   pack's trailing padding one more segment) against padded (one row of
//!   `max_len` per sequence, the dense masked kernel with the key padding
//!   mask), the same kernels; the f64 reference layer on the first few
//!   sequences; achieved GFLOP/s ([`layer_flops`]) against the `gemm`
//!   matmul rate measured in the same run.
//! - [`attention`]: varlen attention forward alone over the same packs,
//!   against the dense masked kernel over the same packs (block-diagonal
//!   mask, every `max_len^2` score computed) and, with the `candle` feature,
//!   `candle_nn::attention::flash_attn_varlen_cpu` on the same inputs;
//!   throughput in (query, key) pairs per second, pairs = `sum len^2`.
//! - [`cross_entropy`]: the fused chunked output layer + cross-entropy
//!   against the materialized-logits path, forward + backward: time and
//!   peak heap bytes (through [`CountingAlloc`], when the binary installs it).
//!
//! Every pair is checked to agree before it is timed. Times are the minimum
//! over `reps` runs after one warm-up run (the check run is the warm-up).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use ndarray::{Array2, Array3};
use packshard_optimized::attention::{dense_masked_attention, varlen_attention, varlen_pairs};
use packshard_optimized::layer::{layer_backward, layer_flops, layer_forward, LayerParams32};
use packshard_optimized::matmul::{matmul, Threads};
use packshard_optimized::vocab::{
    linear_cross_entropy_fused, linear_cross_entropy_materialized, Chunks, MAX_MATERIALIZED_LOGITS,
};
use packshard_reference::bert::attention::{AttentionLayout, ReferenceAttention};
use packshard_reference::bert::{BertConfig, BertParams};
use packshard_reference::packing::{pack_lengths, Algorithm, Histogram, PackingConfig};
use packshard_reference::vocab::LossConfig;
use packshard_reference::{Error, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

// ---- counting allocator ----------------------------------------------------------

static CURRENT: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
static ACTIVE: AtomicUsize = AtomicUsize::new(0);

/// The system allocator, counting the bytes live and their peak. The
/// `packshard` binary installs it as the global allocator; elsewhere
/// [`peak_since`] reports `None`.
#[derive(Debug, Default, Clone, Copy)]
pub struct CountingAlloc;

// SAFETY: forwards every call to `System` unchanged; only counts sizes.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ACTIVE.store(1, Ordering::Relaxed);
        // SAFETY: the caller's contract is `System`'s.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let now = CURRENT.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        CURRENT.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ACTIVE.store(1, Ordering::Relaxed);
        // SAFETY: as above.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            let now = CURRENT.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as above.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            if new_size >= layout.size() {
                let now = CURRENT.fetch_add(new_size - layout.size(), Ordering::Relaxed)
                    + (new_size - layout.size());
                PEAK.fetch_max(now, Ordering::Relaxed);
            } else {
                CURRENT.fetch_sub(layout.size() - new_size, Ordering::Relaxed);
            }
        }
        p
    }
}

/// Runs `f` and returns its result with the peak heap bytes allocated
/// during it above what was live before (`None` without [`CountingAlloc`]).
pub fn peak_since<T>(f: impl FnOnce() -> T) -> (T, Option<usize>) {
    let base = CURRENT.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let out = f();
    let peak = PEAK.load(Ordering::Relaxed).saturating_sub(base);
    (out, (ACTIVE.load(Ordering::Relaxed) == 1).then_some(peak))
}

// ---- configuration -----------------------------------------------------------------

/// What to run, and at which sizes.
#[derive(Debug, Clone, PartialEq)]
pub struct BenchConfig {
    /// Sequences in the layer and attention batches.
    pub sequences: usize,
    /// Layer width (BERT-base: 768).
    pub hidden: usize,
    /// Attention heads (BERT-base: 12).
    pub heads: usize,
    /// Feed-forward width (BERT-base: 3072).
    pub intermediate: usize,
    /// Slots per row (BERT-base: 512); `wikipedia-512` lengths are scaled to it.
    pub max_len: usize,
    /// Sequences (the first ones) the f64 reference layer runs on.
    pub reference_sequences: usize,
    /// `(v, h)` of the cross-entropy runs.
    pub ce_sizes: Vec<(usize, usize)>,
    /// Tokens of the cross-entropy runs.
    pub ce_tokens: usize,
    /// Chunks of the fused cross-entropy.
    pub ce_chunks: Chunks,
    /// Timed runs per measurement (after one warm-up).
    pub reps: usize,
    /// Seed of every random input.
    pub seed: u64,
}

impl BenchConfig {
    /// The sizes: BERT-base (768, 12 heads, 3072, 512), 16
    /// sequences, the reference on 2; cross-entropy 30522 x 384 and
    /// 256000 x 1024 on 4096 tokens.
    pub fn full() -> Self {
        BenchConfig {
            sequences: 16,
            hidden: 768,
            heads: 12,
            intermediate: 3072,
            max_len: 512,
            reference_sequences: 2,
            ce_sizes: vec![(30522, 384), (256_000, 1024)],
            ce_tokens: 4096,
            ce_chunks: Chunks::default(),
            reps: 3,
            seed: 0,
        }
    }

    /// Seconds-scale sizes for CI: hidden 64, 4 heads, 256, rows of 128;
    /// cross-entropy 3001 x 64 on 512 tokens.
    pub fn quick() -> Self {
        BenchConfig {
            sequences: 12,
            hidden: 64,
            heads: 4,
            intermediate: 256,
            max_len: 128,
            reference_sequences: 2,
            ce_sizes: vec![(3001, 64)],
            ce_tokens: 512,
            ce_chunks: Chunks::default(),
            reps: 2,
            seed: 0,
        }
    }

    /// # Errors
    /// [`Error::InvalidArgument`] naming the field for a zero size, heads
    /// not dividing `hidden`, or `reps` 0.
    pub fn validate(&self) -> Result<()> {
        for (field, x) in [
            ("sequences", self.sequences),
            ("hidden", self.hidden),
            ("heads", self.heads),
            ("intermediate", self.intermediate),
            ("max_len", self.max_len),
            ("ce_tokens", self.ce_tokens),
            ("ce_chunk_tokens", self.ce_chunks.tokens),
            ("ce_chunk_vocab", self.ce_chunks.vocab),
            ("reps", self.reps),
        ] {
            if x == 0 {
                return Err(Error::invalid(field, "must be at least 1"));
            }
        }
        if !self.hidden.is_multiple_of(self.heads) {
            return Err(Error::invalid(
                "heads",
                format!("{} heads do not divide hidden {}", self.heads, self.hidden),
            ));
        }
        for (i, &(v, h)) in self.ce_sizes.iter().enumerate() {
            if v == 0 || h == 0 {
                return Err(Error::invalid(
                    format!("ce_sizes[{i}]"),
                    "vocabulary and hidden must be at least 1",
                ));
            }
        }
        Ok(())
    }
}

fn time<T>(reps: usize, mut f: impl FnMut() -> T) -> f64 {
    std::hint::black_box(f());
    time_warm(reps, f)
}

/// As [`time`] where the check before it already ran `f` once (the warm-up).
fn time_warm<T>(reps: usize, mut f: impl FnMut() -> T) -> f64 {
    (0..reps.max(1))
        .map(|_| {
            let t = Instant::now();
            std::hint::black_box(f());
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

/// `n` lengths drawn (seeded) from the embedded `wikipedia-512` histogram,
/// scaled to `max_len` (`ceil(len * max_len / 512)`, at least 1).
///
/// # Errors
/// If the embedded histogram cannot be read.
pub fn wikipedia_lengths(n: usize, max_len: usize, seed: u64) -> Result<Vec<usize>> {
    let h = Histogram::embedded("wikipedia-512")?;
    let counts = h.counts();
    let total: u64 = counts.iter().sum();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    Ok((0..n)
        .map(|_| {
            let mut r = rng.random_range(0..total);
            let mut len = 0;
            for (l, &c) in counts.iter().enumerate() {
                if r < c {
                    len = l;
                    break;
                }
                r -= c;
            }
            (len * max_len).div_ceil(512).clamp(1, max_len)
        })
        .collect())
}

/// The batch of the layer and attention runs.
#[derive(Debug, Clone)]
pub struct Batch {
    /// Sequence lengths.
    pub lengths: Vec<usize>,
    /// Slots per row.
    pub max_len: usize,
    /// `[num_packs * max_len + 1]`-ish: the segments of the packed rows, each
    /// pack's trailing padding as one more segment.
    pub cu_seqlens: Vec<usize>,
    /// Packs.
    pub num_packs: usize,
}

impl Batch {
    /// Packs `lengths` with SPFHP into rows of `max_len`.
    ///
    /// # Errors
    /// The packing's errors.
    pub fn new(lengths: Vec<usize>, max_len: usize) -> Result<Self> {
        let plan = pack_lengths(&lengths, &PackingConfig::new(Algorithm::Spfhp, max_len))?;
        let mut cu = vec![0usize];
        for pack in &plan.packs {
            let start = *cu.last().expect("non-empty");
            for s in pack {
                cu.push(cu.last().expect("non-empty") + s.length);
            }
            let end = start + max_len;
            if *cu.last().expect("non-empty") < end {
                cu.push(end);
            }
        }
        Ok(Batch {
            lengths,
            max_len,
            cu_seqlens: cu,
            num_packs: plan.packs.len(),
        })
    }

    /// Token slots of the packed rows.
    pub fn packed_slots(&self) -> usize {
        self.num_packs * self.max_len
    }

    /// Token slots of the padded rows.
    pub fn padded_slots(&self) -> usize {
        self.lengths.len() * self.max_len
    }

    /// Real tokens.
    pub fn real_tokens(&self) -> usize {
        self.lengths.iter().sum()
    }

    /// The padded layout: one row per sequence, keys past its length masked.
    pub fn padded_layout(&self) -> AttentionLayout {
        AttentionLayout::Dense {
            row_len: self.max_len,
            allowed: self
                .lengths
                .iter()
                .map(|&l| Array2::from_shape_fn((self.max_len, self.max_len), |(_, j)| j < l))
                .collect(),
        }
    }

    /// The packs as dense rows with block-diagonal masks (the same segments as
    /// [`Batch::cu_seqlens`]).
    pub fn block_diagonal_masks(&self) -> Vec<Array2<bool>> {
        let cu = &self.cu_seqlens;
        let seg = |i: usize| cu.partition_point(|&c| c <= i);
        (0..self.num_packs)
            .map(|p| {
                let o = p * self.max_len;
                Array2::from_shape_fn((self.max_len, self.max_len), |(i, j)| {
                    seg(o + i) == seg(o + j)
                })
            })
            .collect()
    }
}

fn uniform2(rng: &mut ChaCha8Rng, shape: (usize, usize), a: f32) -> Array2<f32> {
    Array2::from_shape_fn(shape, |_| rng.random_range(-a..a))
}

// ---- matmul rate --------------------------------------------------------------------

/// The `gemm` f32 rate in GFLOP/s on `[m, k] x [k, n]` (all threads).
pub fn gemm_rate(m: usize, k: usize, n: usize, reps: usize, seed: u64) -> f64 {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let a = uniform2(&mut rng, (m, k), 1.0);
    let b = uniform2(&mut rng, (k, n), 1.0);
    let mut c = Array2::<f32>::zeros((m, n));
    let t = time(reps, || {
        matmul(c.view_mut(), a.view(), b.view(), false, Threads::All);
    });
    2.0 * (m * k * n) as f64 / t / 1e9
}

// ---- layer --------------------------------------------------------------------------

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
    let p = LayerParams32::from_reference(&p64)?;
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
    let plan = pack_lengths(&batch.lengths, &PackingConfig::new(Algorithm::Spfhp, msl))?;
    let place_packed = |src: &[Array2<f32>]| {
        let mut out = Array2::<f32>::zeros((batch.packed_slots(), hd));
        for (pi, pack) in plan.packs.iter().enumerate() {
            let mut o = pi * msl;
            for s in pack {
                out.slice_mut(ndarray::s![o..o + s.length, ..])
                    .assign(&src[s.sequence]);
                o += s.length;
            }
        }
        out
    };
    let place_padded = |src: &[Array2<f32>]| {
        let mut out = Array2::<f32>::zeros((batch.padded_slots(), hd));
        for (i, x) in src.iter().enumerate() {
            out.slice_mut(ndarray::s![i * msl..i * msl + x.nrows(), ..])
                .assign(x);
        }
        out
    };
    let (xp, gp) = (place_packed(&real_x), place_packed(&real_g));
    let (xd, gd) = (place_padded(&real_x), place_padded(&real_g));
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
    let mut worst = 0.0f64;
    let scale = od.iter().fold(0.0f32, |m, x| m.max(x.abs())) as f64;
    for (pi, pack) in plan.packs.iter().enumerate() {
        let mut o = pi * msl;
        for s in pack {
            for r in 0..s.length {
                for c in 0..hd {
                    let a = op[[o + r, c]] as f64;
                    let b = od[[s.sequence * msl + r, c]] as f64;
                    worst = worst.max((a - b).abs() / scale);
                }
            }
            o += s.length;
        }
    }
    if worst > 1e-4 {
        return Err(Error::invalid(
            "layer",
            format!("packed and padded outputs differ by {worst:e} (relative): not timing"),
        ));
    }
    let packed_s = time_warm(cfg.reps, || run(&xp, &gp, &packed));
    let padded_s = time_warm(cfg.reps, || run(&xd, &gd, &padded));
    let (f, b) = layer_flops(batch.packed_slots(), hd, inter, layout_pairs(&packed));
    let gemm_gflops = gemm_rate(
        batch.packed_slots().min(4096),
        hd,
        inter,
        cfg.reps,
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
    let (candle_s, candle_max_abs) =
        candle_peer(&q, &k, &v, cu, msl, scale, &ours.output, cfg.reps)?;
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

#[cfg(feature = "candle")]
#[allow(clippy::too_many_arguments)]
fn candle_peer(
    q: &Array3<f32>,
    k: &Array3<f32>,
    v: &Array3<f32>,
    cu: &[usize],
    max_len: usize,
    scale: f32,
    ours: &Array3<f32>,
    reps: usize,
) -> Result<(Option<f64>, Option<f64>)> {
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
    let (tq, tk, tv) = (t(q)?, t(k)?, t(v)?);
    let lens: Vec<u32> = cu.windows(2).map(|w| (w[1] - w[0]) as u32).collect();
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
        .zip(ours.iter())
        .map(|(a, b)| f64::from((a - b).abs()))
        .fold(0.0, f64::max);
    if max_abs > 1e-3 {
        return Err(Error::invalid(
            "candle",
            format!("flash_attn_varlen_cpu differs from ours by {max_abs}: not timing"),
        ));
    }
    let s = time_warm(reps, || call().map(|_| ()));
    Ok((Some(s), Some(max_abs)))
}

#[cfg(not(feature = "candle"))]
#[allow(clippy::too_many_arguments)]
fn candle_peer(
    _: &Array3<f32>,
    _: &Array3<f32>,
    _: &Array3<f32>,
    _: &[usize],
    _: usize,
    _: f32,
    _: &Array3<f32>,
    _: usize,
) -> Result<(Option<f64>, Option<f64>)> {
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
    /// Seconds, materialized (`None` over [`MAX_MATERIALIZED_LOGITS`]).
    pub materialized_s: Option<f64>,
    /// Peak heap bytes of the materialized path.
    pub materialized_peak: Option<usize>,
    /// Seconds, fused.
    pub fused_s: f64,
    /// Peak heap bytes of the fused path.
    pub fused_peak: Option<usize>,
    /// Bytes of the gradients both return (`[n, h] + [v, h]` f32).
    pub output_bytes: usize,
    /// Bytes of the `[n, v]` f32 logits.
    pub logits_bytes: usize,
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
        let chunks = cfg.ce_chunks;
        let fused = || linear_cross_entropy_fused(x.view(), w.view(), &t, &config, true, chunks);
        let (f, fused_peak) = peak_since(fused);
        let f = f?;
        let fused_s = time_warm(cfg.reps, fused);
        let (mut materialized_s, mut materialized_peak) = (None, None);
        if n * v <= MAX_MATERIALIZED_LOGITS {
            let mat = || linear_cross_entropy_materialized(x.view(), w.view(), &t, &config, true);
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
            output_bytes: 4 * (n * hd + v * hd),
            logits_bytes: 4 * n * v,
        });
    }
    Ok(out)
}
