//! Host side of the vocabulary-shard kernels (`vocab.cu`) and the `alg2`
//! driver over a [`ShardMap`] (Yeung et al., "Vocabulary Parallelism",
//! arXiv:2411.05288, Algorithm 2).
//!
//! Shapes: `hidden: [n, hd]` (replicated), `weight: [v, hd]` (the real rows
//! of the whole output weight; shard `r` holds rows `start_r ..
//! start_r + real_r`), `targets: [n]` global ids or `ignore_index`.
//!
//! One shard's work ([`ShardKernels`], run on the GPU by [`Gpu`]):
//! 1. S pass statistics: `m_i = max_j z_j`, `s_i = Σ_j exp(z_j - m_i)`, the
//!    target logit where the target is local ([`ShardStats`]).
//! 2. S pass partials against the local softmax (`lse_i = m_i + ln s_i`):
//!    `D_i = w (softmax'_i - q_i) W_i`, `B_i = w q_i W_i` (`w` the token's
//!    loss weight).
//! 3. The one all-reduce: the merge here in f64, `m = max m_i`, `S = Σ s_i
//!    exp(m_i - m)`, `alpha_i = s_i exp(m_i - m) / S`, `∂L/∂x = Σ alpha_i D_i
//!    + Σ (alpha_i - 1) B_i`.
//! 4. T pass, no communication: `∂L/∂W_i` from `∂L/∂z_i = w (softmax - q)`
//!    with the global `lse`.
//!
//! Supported options: `ignore_index` and the `mean` reduction over the
//! non-ignored tokens (the common training setting); label smoothing and
//! z-loss are not implemented on the GPU.

use cudarc::driver::{CudaSlice, LaunchArgs, PushKernelArg};
use packshard_reference::vocab::ShardMap;
use packshard_reference::Error;

use super::{check_finite32, check_len, driver, to_i32, Gpu, Launch, Result};

/// Threads per block of every vocab kernel (`THREADS` of the source).
const THREADS: u32 = 256;
/// Vocabulary rows staged per step of `lce_dx` (`TILE_V`).
const TILE_V: usize = 256;
/// Tokens staged per step of `lce_dw` (`TILE_N`).
const TILE_N: usize = 256;

/// The S pass statistics of one shard, each `[n]`.
#[derive(Debug, Clone, PartialEq)]
pub struct ShardStats {
    /// `m_i`: the largest local logit (`-inf` for an empty shard).
    pub local_max: Vec<f32>,
    /// `s_i = Σ_j exp(z_j - m_i)` (0 for an empty shard).
    pub local_sum: Vec<f32>,
    /// `z_t` where the target is in this shard, else 0 (unused).
    pub target_logit: Vec<f32>,
}

/// One shard's inputs: `hidden: [n, hd]`, `weight: [w, hd]` (this shard's
/// real rows), `target: [n]` (row in the shard, or -1).
#[derive(Debug, Clone, Copy)]
pub struct ShardInput<'a> {
    /// `[n, hd]`.
    pub hidden: &'a [f32],
    /// `[w, hd]`.
    pub weight: &'a [f32],
    /// `[n]`.
    pub target: &'a [i32],
    /// Tokens.
    pub n: usize,
    /// Hidden size.
    pub hd: usize,
    /// Rows of the shard.
    pub w: usize,
}

/// The three per-shard kernels, so the `alg2` driver runs on the GPU
/// ([`Gpu`]), on the CPU emulator ([`super::emu::Emulator`]) or on a CPU
/// stand-in in tests.
pub trait ShardKernels {
    /// S pass statistics.
    ///
    /// # Errors
    /// Driver errors.
    fn stats(&self, x: &ShardInput<'_>) -> Result<ShardStats>;
    /// S pass partials `(D_i, B_i)`, each `[n, hd]`, against `lse: [n]`
    /// with loss weights `row_scale: [n]`.
    ///
    /// # Errors
    /// Driver errors.
    fn input_partials(
        &self,
        x: &ShardInput<'_>,
        lse: &[f32],
        row_scale: &[f32],
    ) -> Result<(Vec<f32>, Vec<f32>)>;
    /// T pass weight gradient `[w, hd]` against the global `lse: [n]`.
    ///
    /// # Errors
    /// Driver errors.
    fn weight_grad(&self, x: &ShardInput<'_>, lse: &[f32], row_scale: &[f32]) -> Result<Vec<f32>>;
}

impl ShardStats {
    /// The statistics of a shard with no rows: `m_i = -inf`, `s_i = 0`, so it
    /// contributes nothing (docs/FAULTS.md V6).
    pub fn empty(n: usize) -> ShardStats {
        ShardStats {
            local_max: vec![f32::NEG_INFINITY; n],
            local_sum: vec![0.0; n],
            target_logit: vec![0.0; n],
        }
    }
}

impl ShardInput<'_> {
    fn check(&self) -> Result<()> {
        check_len("hidden", self.hidden, &[self.n, self.hd], "[n, hd]")?;
        check_len("weight", self.weight, &[self.w, self.hd], "[w, hd]")?;
        check_len("targets", self.target, &[self.n], "[n]")?;
        to_i32("n", self.n)?;
        to_i32("hd", self.hd)?;
        to_i32("w", self.w)?;
        if self.hd == 0 {
            return Err(Error::invalid("hd", "the hidden size is 0").into());
        }
        if (self.hd + 2 * THREADS as usize) * 4 > 48 * 1024 {
            return Err(
                Error::invalid("hd", "hidden size over 10240 (48 KiB of shared memory)").into(),
            );
        }
        Ok(())
    }

    fn check_rows(&self, lse: &[f32], row_scale: &[f32]) -> Result<()> {
        self.check()?;
        check_len("lse", lse, &[self.n], "[n]")?;
        check_len("row_scale", row_scale, &[self.n], "[n]")
    }

    /// The `(n, hd, w)` arguments of every kernel (checked to fit `int`).
    pub fn dims32(&self) -> (i32, i32, i32) {
        (self.n as i32, self.hd as i32, self.w as i32)
    }

    /// A launch of `THREADS` threads per block over `blocks` blocks with
    /// `hd + extra` floats of shared memory, or `None` when there is nothing
    /// to launch (no tokens or no rows).
    fn launch(&self, entry: &'static str, blocks: usize, extra: usize) -> Option<Launch> {
        (self.n > 0 && self.w > 0).then(|| Launch {
            entry,
            grid: (blocks as u32, 1, 1),
            block: THREADS,
            shared_bytes: ((self.hd + extra) * 4) as u32,
        })
    }

    /// Checks the inputs of [`ShardKernels::stats`]; its `lce_stats` launch
    /// (a block per token), or `None` when there is nothing to launch
    /// ([`ShardStats::empty`]).
    ///
    /// # Errors
    /// Shape errors naming the field.
    pub fn stats_launch(&self) -> Result<Option<Launch>> {
        self.check()?;
        Ok(self.launch("lce_stats", self.n, 2 * THREADS as usize))
    }

    /// Checks the inputs of [`ShardKernels::input_partials`]; its `lce_dx`
    /// launch (a block per token), or `None` (the partials are 0).
    ///
    /// # Errors
    /// Shape errors naming the field.
    pub fn partials_launch(&self, lse: &[f32], row_scale: &[f32]) -> Result<Option<Launch>> {
        self.check_rows(lse, row_scale)?;
        Ok(self.launch("lce_dx", self.n, TILE_V))
    }

    /// Checks the inputs of [`ShardKernels::weight_grad`]; its `lce_dw`
    /// launch (a block per row), or `None` (the gradient is 0).
    ///
    /// # Errors
    /// Shape errors naming the field.
    pub fn weight_grad_launch(&self, lse: &[f32], row_scale: &[f32]) -> Result<Option<Launch>> {
        self.check_rows(lse, row_scale)?;
        Ok(self.launch("lce_dw", self.w, TILE_N))
    }
}

/// One shard's inputs on the device: `hidden, weight, target`, with
/// `lse, row_scale` for the gradient kernels, and the sizes `n, hd, w`.
struct ShardBuffers {
    tensors: [CudaSlice<f32>; 2],
    target: CudaSlice<i32>,
    rows: Option<[CudaSlice<f32>; 2]>,
    dims: [i32; 3],
}

impl ShardBuffers {
    fn upload(gpu: &Gpu, x: &ShardInput<'_>, rows: Option<(&[f32], &[f32])>) -> Result<Self> {
        let s = gpu.stream();
        let (n, hd, w) = x.dims32();
        Ok(ShardBuffers {
            tensors: [
                driver("copy hidden", s.clone_htod(x.hidden))?,
                driver("copy weight", s.clone_htod(x.weight))?,
            ],
            target: driver("copy targets", s.clone_htod(x.target))?,
            rows: match rows {
                Some((lse, row_scale)) => Some([
                    driver("copy lse", s.clone_htod(lse))?,
                    driver("copy row_scale", s.clone_htod(row_scale))?,
                ]),
                None => None,
            },
            dims: [n, hd, w],
        })
    }

    /// Pushes `hidden, weight, target[, lse, row_scale], n, hd, w`.
    fn push<'a>(&'a self, b: &mut LaunchArgs<'a>) {
        b.arg(&self.tensors[0])
            .arg(&self.tensors[1])
            .arg(&self.target);
        for r in self.rows.iter().flatten() {
            b.arg(r);
        }
        for d in &self.dims {
            b.arg(d);
        }
    }
}

impl ShardKernels for Gpu {
    fn stats(&self, x: &ShardInput<'_>) -> Result<ShardStats> {
        let Some(l) = x.stats_launch()? else {
            // No launch: the driver refuses zero-byte buffers.
            return Ok(ShardStats::empty(x.n));
        };
        let n = x.n;
        let s = self.stream();
        let inputs = ShardBuffers::upload(self, x, None)?;
        let mut m = driver("alloc local_max", s.alloc_zeros::<f32>(n))?;
        let mut l_sum = driver("alloc local_sum", s.alloc_zeros::<f32>(n))?;
        let mut z = driver("alloc target_logit", s.alloc_zeros::<f32>(n))?;
        let f = self.function("vocab", l.entry)?;
        let mut b = s.launch_builder(&f);
        inputs.push(&mut b);
        b.arg(&mut m).arg(&mut l_sum).arg(&mut z);
        // SAFETY: matches `lce_stats`; sizes checked by `stats_launch`.
        driver("launch lce_stats", unsafe { b.launch(l.config()) })?;
        Ok(ShardStats {
            local_max: driver("copy local_max back", s.clone_dtoh(&m))?,
            local_sum: driver("copy local_sum back", s.clone_dtoh(&l_sum))?,
            target_logit: driver("copy target_logit back", s.clone_dtoh(&z))?,
        })
    }

    fn input_partials(
        &self,
        x: &ShardInput<'_>,
        lse: &[f32],
        row_scale: &[f32],
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let Some(l) = x.partials_launch(lse, row_scale)? else {
            return Ok((vec![0.0; x.n * x.hd], vec![0.0; x.n * x.hd]));
        };
        let s = self.stream();
        let inputs = ShardBuffers::upload(self, x, Some((lse, row_scale)))?;
        let mut dp = driver("alloc dpart", s.alloc_zeros::<f32>(x.n * x.hd))?;
        let mut bp = driver("alloc bpart", s.alloc_zeros::<f32>(x.n * x.hd))?;
        let f = self.function("vocab", l.entry)?;
        let mut b = s.launch_builder(&f);
        inputs.push(&mut b);
        b.arg(&mut dp).arg(&mut bp);
        // SAFETY: matches `lce_dx`.
        driver("launch lce_dx", unsafe { b.launch(l.config()) })?;
        Ok((
            driver("copy dpart back", s.clone_dtoh(&dp))?,
            driver("copy bpart back", s.clone_dtoh(&bp))?,
        ))
    }

    fn weight_grad(&self, x: &ShardInput<'_>, lse: &[f32], row_scale: &[f32]) -> Result<Vec<f32>> {
        let Some(l) = x.weight_grad_launch(lse, row_scale)? else {
            return Ok(vec![0.0; x.w * x.hd]);
        };
        let s = self.stream();
        let inputs = ShardBuffers::upload(self, x, Some((lse, row_scale)))?;
        let mut gw = driver("alloc grad_weight", s.alloc_zeros::<f32>(x.w * x.hd))?;
        let f = self.function("vocab", l.entry)?;
        let mut b = s.launch_builder(&f);
        inputs.push(&mut b);
        b.arg(&mut gw);
        // SAFETY: matches `lce_dw`.
        driver("launch lce_dw", unsafe { b.launch(l.config()) })?;
        driver("copy grad_weight back", s.clone_dtoh(&gw))
    }
}

/// What `alg2` returns; `f64` after the f64 merge.
#[derive(Debug, Clone, PartialEq)]
pub struct Alg2Output {
    /// Mean loss over the non-ignored tokens (0 when there are none).
    pub loss: f64,
    /// `[n]`: per-token loss `lse - z_t` (0 for ignored tokens).
    pub per_token_loss: Vec<f64>,
    /// `[n]`: global `logsumexp`.
    pub logsumexp: Vec<f64>,
    /// `[p][n]`: each shard's `(m_i, s_i)` as it entered the all-reduce.
    pub local: Vec<Vec<(f64, f64)>>,
    /// `[n, hd]`: `∂L/∂hidden`.
    pub grad_hidden: Vec<f64>,
    /// `[v, hd]`: `∂L/∂W`, the shards' rows in vocabulary order.
    pub grad_weight: Vec<f64>,
    /// Tokens counted by the mean.
    pub num_tokens: usize,
}

/// Runs `alg2` over the shards of `map` with `kernels` for each shard's
/// work and the merge (the one all-reduce) in f64 on the host.
///
/// `hidden: [n, hd]`, `weight: [v, hd]`, `targets: [n]`.
///
/// # Errors
/// Shape errors naming the field, [`Error::IndexOutOfRange`] for a target
/// outside `0..v` that is not `ignore_index`, non-finite inputs
/// ([`Error::NonFiniteInput`]), a target whose logit is not finite in f32,
/// and the kernels' errors.
#[allow(clippy::too_many_arguments)]
pub fn alg2_linear_cross_entropy(
    kernels: &dyn ShardKernels,
    map: &ShardMap,
    hidden: &[f32],
    n: usize,
    hd: usize,
    weight: &[f32],
    targets: &[i64],
    ignore_index: i64,
) -> Result<Alg2Output> {
    let v = map.vocab_size();
    check_len("hidden", hidden, &[n, hd], "[n, hd]")?;
    check_len("weight", weight, &[v, hd], "[v, hd]")?;
    check_len("targets", targets, &[n], "[n]")?;
    if hd == 0 {
        return Err(Error::invalid("hd", "the hidden size is 0").into());
    }
    check_finite32("hidden", hidden)?;
    check_finite32("weight", weight)?;
    for (index, &t) in targets.iter().enumerate() {
        if t != ignore_index && !(0..v as i64).contains(&t) {
            return Err(Error::IndexOutOfRange {
                field: "targets".into(),
                index,
                value: t,
                lo: 0,
                hi: v as i64,
            }
            .into());
        }
    }
    let count = targets.iter().filter(|&&t| t != ignore_index).count();
    let scale = if count > 0 { 1.0 / count as f64 } else { 0.0 };
    let row_scale: Vec<f32> = targets
        .iter()
        .map(|&t| if t == ignore_index { 0.0 } else { scale as f32 })
        .collect();
    let shards = map.shards();
    let p = shards.len();

    // S pass on every shard.
    let mut inputs = Vec::with_capacity(p);
    for sh in &shards {
        let rows = &weight[sh.start.min(v) * hd..(sh.start + sh.real).min(v) * hd];
        let target: Vec<i32> = targets
            .iter()
            .map(|&t| {
                let t = t as i128 - sh.start as i128;
                if t >= 0 && (t as usize) < sh.real {
                    t as i32
                } else {
                    -1
                }
            })
            .collect();
        inputs.push((rows, target, sh.real));
    }
    // Ignored targets must never match a row: `ignore_index` may lie in 0..v
    // only if the caller chose so, and then it is still ignored.
    for (_, target, _) in inputs.iter_mut() {
        for (i, &t) in targets.iter().enumerate() {
            if t == ignore_index {
                target[i] = -1;
            }
        }
    }
    let inp = |r: usize| ShardInput {
        hidden,
        weight: inputs[r].0,
        target: &inputs[r].1,
        n,
        hd,
        w: inputs[r].2,
    };
    let mut stats = Vec::with_capacity(p);
    let mut partials = Vec::with_capacity(p);
    for r in 0..p {
        let st = kernels.stats(&inp(r))?;
        let lse_local: Vec<f32> = st
            .local_max
            .iter()
            .zip(&st.local_sum)
            .map(|(&m, &s)| {
                if s > 0.0 {
                    m + s.ln()
                } else {
                    f32::NEG_INFINITY
                }
            })
            .collect();
        partials.push(kernels.input_partials(&inp(r), &lse_local, &row_scale)?);
        stats.push(st);
    }

    // The all-reduce of (m_i, s_i, z_t, D_i, B_i), merged in f64.
    let mut lse = vec![0.0f64; n];
    let mut per_token_loss = vec![0.0f64; n];
    let mut grad_hidden = vec![0.0f64; n * hd];
    for i in 0..n {
        let m = stats
            .iter()
            .map(|s| s.local_max[i] as f64)
            .fold(f64::NEG_INFINITY, f64::max);
        let big_s: f64 = stats
            .iter()
            .filter(|s| s.local_sum[i] > 0.0)
            .map(|s| s.local_sum[i] as f64 * (s.local_max[i] as f64 - m).exp())
            .sum();
        lse[i] = m + big_s.ln();
        let t = targets[i];
        if t != ignore_index {
            let owner = shards
                .iter()
                .position(|sh| (sh.start as i64..(sh.start + sh.real) as i64).contains(&t))
                .ok_or_else(|| Error::IndexOutOfRange {
                    field: "targets".into(),
                    index: i,
                    value: t,
                    lo: 0,
                    hi: v as i64,
                })?;
            let zt = stats[owner].target_logit[i] as f64;
            if !zt.is_finite() || !lse[i].is_finite() {
                return Err(Error::NonFiniteInput {
                    field: "logits".into(),
                    index: i,
                    value: zt,
                }
                .into());
            }
            per_token_loss[i] = lse[i] - zt;
        }
        for (r, st) in stats.iter().enumerate() {
            let alpha = if st.local_sum[i] > 0.0 {
                st.local_sum[i] as f64 * (st.local_max[i] as f64 - m).exp() / big_s
            } else {
                0.0
            };
            let (dp, bp) = &partials[r];
            for c in 0..hd {
                grad_hidden[i * hd + c] +=
                    alpha * dp[i * hd + c] as f64 + (alpha - 1.0) * bp[i * hd + c] as f64;
            }
        }
    }
    let loss = per_token_loss.iter().sum::<f64>() * scale;

    // T pass: each shard's weight gradient against the global lse.
    let lse32: Vec<f32> = lse.iter().map(|&x| x as f32).collect();
    let mut grad_weight = vec![0.0f64; v * hd];
    for (r, sh) in shards.iter().enumerate() {
        let g = kernels.weight_grad(&inp(r), &lse32, &row_scale)?;
        for (k, &x) in g.iter().enumerate() {
            grad_weight[sh.start * hd + k] = x as f64;
        }
    }
    let local = stats
        .iter()
        .map(|s| {
            s.local_max
                .iter()
                .zip(&s.local_sum)
                .map(|(&m, &l)| (m as f64, l as f64))
                .collect()
        })
        .collect();
    Ok(Alg2Output {
        loss,
        per_token_loss,
        logsumexp: lse,
        local,
        grad_hidden,
        grad_weight,
        num_tokens: count,
    })
}
