//! Host side of the vocabulary-shard kernels (`vocab.cu`) and the `alg2`
//! driver over a [`ShardMap`] (Yeung et al., "Vocabulary Parallelism",
//! arXiv:2411.05288, Algorithm 2; the reference's `sharded` module).
//!
//! Shapes: `hidden: [n, hd]` (replicated), `weight: [v, hd]` (the real rows
//! of the whole output weight; shard `r` holds rows `start_r ..
//! start_r + real_r`), `targets: [n]` global ids or `ignore_index`.
//!
//! One shard's work ([`ShardKernels`], run on the GPU by [`Gpu`], on the CPU
//! by [`super::emu::Emulator`]):
//! 1. S pass statistics ([`ShardStats`]): `m_i = max_j z_j`, `s_i - 1`, the
//!    gap `Σ_j (m_i - z_j)` and the target logit where the target is local;
//!    the host forms the reference's [`SoftmaxStats`] from them (target term
//!    `q_other gap + (q_target - q_other) (m_i - z_t)`).
//! 2. S pass partials against the local softmax: `D_i = (softmax'_i - q_i)
//!    W_i`, `B_i = q_i W_i` (and with the z-loss `A_i = D_i + B_i`), into the
//!    reference's record `[stats, s_i D_i, B_i (, s_i A_i)]`.
//! 3. The one barrier: the reference's merge ([`Alg2Record`]) over the
//!    reference's in-process collective, in f64: the global statistics, the
//!    losses and `∂L/∂x`.
//! 4. T pass, no communication: `∂L/∂W_i` from `∂L/∂z_i = w (p - q + 2 c lse
//!    p)` against the global statistics.
//!
//! Every [`LossConfig`](packshard_reference::vocab::LossConfig) option but
//! the softcap is supported: `ignore_index`, label smoothing in either
//! convention, z-loss, every reduction, an upstream gradient (`grad_output`,
//! a per-row scale). Kernel launches stay on the
//! calling thread; only the merge runs on the `p` in-process ranks.

use cudarc::driver::{CudaSlice, LaunchArgs, PushKernelArg};
use ndarray::{s, Array2, ArrayView2};
use packshard_reference::vocab::cross_entropy::{check_row, token_loss, STATS_WIDTH};
use packshard_reference::vocab::sharded::{Alg2Record, RankLoss, ShardedLoss};
use packshard_reference::vocab::{run_ranks, LossCall, ShardMap, SoftmaxStats};
use packshard_reference::Error;

use super::{check_len, driver, to_i32, CudaError, Gpu, Launch, Result};

/// Threads per block of every vocab kernel (a power of two: the tree
/// merge of `lce_stats`).
const THREADS: u32 = 128;
/// Vocabulary rows staged per step of `lce_dx` (`TILE_V`).
const TILE_V: usize = 256;
/// Tokens staged per step of `lce_dw` (`TILE_N`).
const TILE_N: usize = 64;
/// Vocabulary rows per block of `lce_dw` (`DW_ROWS`).
const DW_ROWS: usize = 32;
/// Dynamic shared memory a block may use (the default limit without opt-in).
const MAX_SHARED: usize = 48 * 1024;

/// The S pass statistics of one shard, each `[n]`.
#[derive(Debug, Clone, PartialEq)]
pub struct ShardStats {
    /// `m_i`: the largest local logit (`-inf` for an empty shard).
    pub local_max: Vec<f32>,
    /// `s_i - 1` with `s_i = Σ_j exp(z_j - m_i)` (`-1` for an empty shard).
    pub local_rest: Vec<f32>,
    /// `Σ_j (m_i - z_j) >= 0` (0 for an empty shard).
    pub local_gap: Vec<f32>,
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

/// What the gradient kernels take per token, each `[n]`: the target
/// distribution, the statistics the gradient is formed against, the loss
/// weight and the z-loss factor.
#[derive(Debug, Clone, Copy)]
pub struct RowInputs<'a> {
    /// `q` on the target (0 for an ignored token).
    pub q_target: &'a [f32],
    /// `q` on every other class (label smoothing; 0 without).
    pub q_other: &'a [f32],
    /// The maximum `m` of the statistics.
    pub row_max: &'a [f32],
    /// `s - 1` of the statistics.
    pub row_rest: &'a [f32],
    /// The token's loss weight (1 for the S pass partials).
    pub row_scale: &'a [f32],
    /// `2 c lse` (the z-loss term of the gradient), or 0.
    pub row_zl: &'a [f32],
}

impl RowInputs<'_> {
    /// In the kernels' parameter order.
    pub fn all(&self) -> [&[f32]; 6] {
        [
            self.q_target,
            self.q_other,
            self.row_max,
            self.row_rest,
            self.row_scale,
            self.row_zl,
        ]
    }
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
    /// S pass partials `(dpart, bpart)`, each `[n, hd]`: `dpart = Σ_j g_j
    /// W_j` with `g = row_scale (p - q + row_zl p)` against the statistics
    /// of `rows`, `bpart = Σ_j q_j W_j`.
    ///
    /// # Errors
    /// Driver errors.
    fn input_partials(
        &self,
        x: &ShardInput<'_>,
        rows: &RowInputs<'_>,
    ) -> Result<(Vec<f32>, Vec<f32>)>;
    /// T pass weight gradient `[w, hd]`: `Σ_n g_nj hidden[n]`, `g` as in
    /// [`ShardKernels::input_partials`].
    ///
    /// # Errors
    /// Driver errors.
    fn weight_grad(&self, x: &ShardInput<'_>, rows: &RowInputs<'_>) -> Result<Vec<f32>>;
}

impl ShardStats {
    /// The statistics of a shard with no rows: `m_i = -inf`, `s_i = 0`, so it
    /// contributes nothing (docs/FAULTS.md V6).
    pub fn empty(n: usize) -> ShardStats {
        ShardStats {
            local_max: vec![f32::NEG_INFINITY; n],
            local_rest: vec![-1.0; n],
            local_gap: vec![0.0; n],
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
        if (self.hd + 4 * THREADS as usize) * 4 > MAX_SHARED {
            return Err(Error::invalid(
                "hidden",
                format!(
                    "hidden size {} over {} (48 KiB of shared memory)",
                    self.hd,
                    MAX_SHARED / 4 - 4 * THREADS as usize
                ),
            )
            .into());
        }
        Ok(())
    }

    fn check_rows(&self, rows: &RowInputs<'_>) -> Result<()> {
        self.check()?;
        for (name, r) in [
            "q_target",
            "q_other",
            "row_max",
            "row_rest",
            "row_scale",
            "row_zl",
        ]
        .into_iter()
        .zip(rows.all())
        {
            check_len(name, r, &[self.n], "[n]")?;
        }
        Ok(())
    }

    /// The `(n, hd, w)` arguments of every kernel (checked to fit `int`).
    pub fn dims32(&self) -> (i32, i32, i32) {
        (self.n as i32, self.hd as i32, self.w as i32)
    }

    /// A launch of `THREADS` threads per block over `blocks` blocks with
    /// `floats` floats of shared memory, or `None` when there is nothing to
    /// launch (no tokens or no rows).
    fn launch(&self, entry: &'static str, blocks: usize, floats: usize) -> Option<Launch> {
        (self.n > 0 && self.w > 0).then(|| Launch {
            entry,
            grid: (blocks as u32, 1, 1),
            block: THREADS,
            shared_bytes: (floats * 4) as u32,
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
        Ok(self.launch("lce_stats", self.n, self.hd + 4 * THREADS as usize))
    }

    /// Checks the inputs of [`ShardKernels::input_partials`]; its `lce_dx`
    /// launch (a block per token), or `None` (the partials are 0).
    ///
    /// # Errors
    /// Shape errors naming the field.
    pub fn partials_launch(&self, rows: &RowInputs<'_>) -> Result<Option<Launch>> {
        self.check_rows(rows)?;
        Ok(self.launch("lce_dx", self.n, self.hd + 2 * TILE_V))
    }

    /// Checks the inputs of [`ShardKernels::weight_grad`]; its `lce_dw`
    /// launch (a block per `DW_ROWS` rows), or `None` (the gradient is 0).
    ///
    /// # Errors
    /// Shape errors naming the field.
    pub fn weight_grad_launch(&self, rows: &RowInputs<'_>) -> Result<Option<Launch>> {
        self.check_rows(rows)?;
        Ok(self.launch("lce_dw", self.w.div_ceil(DW_ROWS), DW_ROWS * TILE_N))
    }
}

/// Copies `x` to the device (one element for an empty slice: the driver
/// refuses zero-byte buffers; the kernels never read it).
fn upload<T: cudarc::driver::DeviceRepr + Default + Clone>(
    gpu: &Gpu,
    what: &str,
    x: &[T],
) -> Result<CudaSlice<T>> {
    let s = gpu.stream();
    if x.is_empty() {
        driver(what, s.clone_htod(&[T::default()]))
    } else {
        driver(what, s.clone_htod(x))
    }
}

/// One shard's inputs on the device: `hidden, weight, target`, with the
/// [`RowInputs`] for the gradient kernels, and the sizes `n, hd, w`.
struct ShardBuffers {
    tensors: [CudaSlice<f32>; 2],
    target: CudaSlice<i32>,
    rows: Vec<CudaSlice<f32>>,
    dims: [i32; 3],
}

impl ShardBuffers {
    fn upload(gpu: &Gpu, x: &ShardInput<'_>, rows: Option<&RowInputs<'_>>) -> Result<Self> {
        let (n, hd, w) = x.dims32();
        let rows = match rows {
            Some(r) => r
                .all()
                .iter()
                .map(|r| upload(gpu, "copy row inputs", r))
                .collect::<Result<_>>()?,
            None => Vec::new(),
        };
        Ok(ShardBuffers {
            tensors: [
                upload(gpu, "copy hidden", x.hidden)?,
                upload(gpu, "copy weight", x.weight)?,
            ],
            target: upload(gpu, "copy targets", x.target)?,
            rows,
            dims: [n, hd, w],
        })
    }

    /// Pushes `hidden, weight, target[, rows...], n, hd, w`.
    fn push<'a>(&'a self, b: &mut LaunchArgs<'a>) {
        b.arg(&self.tensors[0])
            .arg(&self.tensors[1])
            .arg(&self.target);
        for r in &self.rows {
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
        let mut out = Vec::with_capacity(4);
        for what in ["local_max", "local_rest", "local_gap", "target_logit"] {
            out.push(driver(what, s.alloc_zeros::<f32>(n))?);
        }
        let f = self.function("vocab", l.entry)?;
        let mut b = s.launch_builder(&f);
        inputs.push(&mut b);
        for o in out.iter_mut() {
            b.arg(o);
        }
        // SAFETY: matches `lce_stats`; sizes checked by `stats_launch`.
        driver("launch lce_stats", unsafe { b.launch(l.config()) })?;
        let mut back = out
            .iter()
            .map(|o| driver("copy statistics back", s.clone_dtoh(o)));
        let mut next = || back.next().expect("four outputs");
        Ok(ShardStats {
            local_max: next()?,
            local_rest: next()?,
            local_gap: next()?,
            target_logit: next()?,
        })
    }

    fn input_partials(
        &self,
        x: &ShardInput<'_>,
        rows: &RowInputs<'_>,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let Some(l) = x.partials_launch(rows)?.filter(|_| x.hd > 0) else {
            return Ok((vec![0.0; x.n * x.hd], vec![0.0; x.n * x.hd]));
        };
        let s = self.stream();
        let inputs = ShardBuffers::upload(self, x, Some(rows))?;
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

    fn weight_grad(&self, x: &ShardInput<'_>, rows: &RowInputs<'_>) -> Result<Vec<f32>> {
        let Some(l) = x.weight_grad_launch(rows)?.filter(|_| x.hd > 0) else {
            return Ok(vec![0.0; x.w * x.hd]);
        };
        let s = self.stream();
        let inputs = ShardBuffers::upload(self, x, Some(rows))?;
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

impl Gpu {
    /// Times one shard's three kernels as one forward + backward pass of the
    /// fused output layer (`lce_stats`, `lce_dx`, `lce_dw`) on
    /// device-resident inputs: uploads once, one warm-up pass, then `reps`.
    /// Returns seconds per pass (kernel time, no copies) and the bytes of
    /// every device buffer the pass holds (inputs, row inputs, statistics,
    /// both partials and the weight gradient: the kernels allocate nothing
    /// else; PyTorch's `max_memory_allocated` counts the same). For the GPU
    /// bench (`gpu_output_layer_bench`).
    ///
    /// # Errors
    /// Shape errors naming the field; driver errors.
    pub fn time_output_layer(
        &self,
        x: &ShardInput<'_>,
        rows: &RowInputs<'_>,
        reps: usize,
    ) -> Result<(f64, usize)> {
        let (Some(ls), Some(ld), Some(lw)) = (
            x.stats_launch()?,
            x.partials_launch(rows)?,
            x.weight_grad_launch(rows)?,
        ) else {
            return Ok((0.0, 0));
        };
        let s = self.stream();
        let inputs = ShardBuffers::upload(self, x, Some(rows))?;
        let stats_in = ShardBuffers::upload(self, x, None)?;
        let mut stats = Vec::with_capacity(4);
        for what in ["local_max", "local_rest", "local_gap", "target_logit"] {
            stats.push(driver(what, s.alloc_zeros::<f32>(x.n))?);
        }
        let mut dp = driver("alloc dpart", s.alloc_zeros::<f32>(x.n * x.hd))?;
        let mut bp = driver("alloc bpart", s.alloc_zeros::<f32>(x.n * x.hd))?;
        let mut gw = driver("alloc grad_weight", s.alloc_zeros::<f32>(x.w * x.hd))?;
        // hidden, weight and targets (twice: the statistics launch takes
        // no row inputs), 6 row inputs, 4 statistics, 2 partials, grad W.
        let bytes =
            4 * (2 * (x.n * x.hd + x.w * x.hd + x.n) + 10 * x.n + 2 * x.n * x.hd + x.w * x.hd);
        let (fs, fd, fw) = (
            self.function("vocab", ls.entry)?,
            self.function("vocab", ld.entry)?,
            self.function("vocab", lw.entry)?,
        );
        let mut pass = || -> Result<()> {
            let mut b = s.launch_builder(&fs);
            stats_in.push(&mut b);
            for o in stats.iter_mut() {
                b.arg(o);
            }
            // SAFETY: as in `ShardKernels::stats`.
            driver("launch lce_stats", unsafe { b.launch(ls.config()) })?;
            let mut b = s.launch_builder(&fd);
            inputs.push(&mut b);
            b.arg(&mut dp).arg(&mut bp);
            // SAFETY: as in `ShardKernels::input_partials`.
            driver("launch lce_dx", unsafe { b.launch(ld.config()) })?;
            let mut b = s.launch_builder(&fw);
            inputs.push(&mut b);
            b.arg(&mut gw);
            // SAFETY: as in `ShardKernels::weight_grad`.
            driver("launch lce_dw", unsafe { b.launch(lw.config()) })?;
            Ok(())
        };
        pass()?;
        driver("synchronize", s.synchronize())?;
        let t0 = std::time::Instant::now();
        for _ in 0..reps.max(1) {
            pass()?;
        }
        driver("synchronize", s.synchronize())?;
        Ok((t0.elapsed().as_secs_f64() / reps.max(1) as f64, bytes))
    }
}

// ---- the alg2 driver ---------------------------------------------------------

/// The reference's [`SoftmaxStats`] of token `i` of a shard of `real` rows
/// from the kernel's statistics: target term `q_other gap + (q_target -
/// q_other) (m - z_t)`, mass `q_other real + (q_target - q_other)` (the
/// second terms only where the target is local), in f64.
fn local_stats(
    st: &ShardStats,
    i: usize,
    q: Option<(f64, f64)>,
    local: bool,
    real: usize,
) -> SoftmaxStats {
    if real == 0 {
        return SoftmaxStats::EMPTY;
    }
    let max = f64::from(st.local_max[i]);
    let (target, mass) = match q {
        None => (0.0, 0.0),
        Some((qt, qo)) => {
            let mut target = qo * f64::from(st.local_gap[i]);
            let mut mass = qo * real as f64;
            if local {
                target += (qt - qo) * (max - f64::from(st.target_logit[i]));
                mass += qt - qo;
            }
            (target, mass)
        }
    };
    SoftmaxStats {
        max,
        rest: f64::from(st.local_rest[i]),
        target,
        mass,
    }
}

/// `alg2` over the shards of `map` with `kernels` for each shard's work:
/// `hidden: [n, hd]`, `weight: [k, hd]` (`k >= v`; only the real rows `..v`
/// are read), `call.targets: [n]`; every rank's results as the reference's
/// `sharded_linear_cross_entropy` gives them (no `∂L/∂z`: the kernels never
/// hold the logits).
///
/// The caller has validated the inputs as the reference does (shapes,
/// finite values, targets, `config`); this checks the targets again.
///
/// # Errors
/// Target errors as the reference, the kernels' errors.
pub fn sharded_linear_cross_entropy(
    kernels: &dyn ShardKernels,
    map: &ShardMap,
    hidden: ArrayView2<f32>,
    weight: ArrayView2<f32>,
    call: &LossCall,
) -> Result<ShardedLoss> {
    let (config, want_grad) = (call.config, call.want_grad());
    let (n, hd) = hidden.dim();
    let v = map.vocab_size();
    let hidden = hidden.as_standard_layout();
    let hidden = hidden.as_slice().expect("standard layout");
    let weight = weight.slice(s![..v, ..]);
    let weight = weight.as_standard_layout();
    let weight = weight.as_slice().expect("standard layout");
    let parsed = config.targets(call.targets, v)?;
    let (qt, qo) = config.target_distribution(v);
    let token_weights = call.token_weights(&parsed);
    let q = |i: usize| parsed[i].map(|_| (qt, qo));
    let q_target: Vec<f32> = parsed
        .iter()
        .map(|t| if t.is_some() { qt as f32 } else { 0.0 })
        .collect();
    let q_other: Vec<f32> = parsed
        .iter()
        .map(|t| if t.is_some() { qo as f32 } else { 0.0 })
        .collect();
    let c = config.z_loss;
    let layout = Alg2Record::new(hd, want_grad, c);
    let width = layout.width();
    let shards = map.shards();
    // Each shard's targets (its row, or -1) and real rows (a padding shard
    // may start past v; it has none).
    let inputs: Vec<(Vec<i32>, &[f32])> = shards
        .iter()
        .map(|sh| {
            let target = parsed
                .iter()
                .map(|t| match *t {
                    Some(t) if t >= sh.start && t < sh.start + sh.real => (t - sh.start) as i32,
                    _ => -1,
                })
                .collect();
            let start = sh.start.min(v);
            (target, &weight[start * hd..(start + sh.real) * hd])
        })
        .collect();
    let input = |r: usize| ShardInput {
        hidden,
        weight: inputs[r].1,
        target: &inputs[r].0,
        n,
        hd,
        w: shards[r].real,
    };
    let ones = vec![1.0f32; n];
    let zeros = vec![0.0f32; n];

    // S pass on every shard: the records each rank brings to the barrier.
    let mut records = Vec::with_capacity(shards.len());
    let mut locals = Vec::with_capacity(shards.len());
    for (r, sh) in shards.iter().enumerate() {
        let x = input(r);
        let st = kernels.stats(&x)?;
        let local: Vec<SoftmaxStats> = (0..n)
            .map(|i| local_stats(&st, i, q(i), x.target[i] >= 0, sh.real))
            .collect();
        let mut record = vec![0.0f64; width * n];
        if layout.blocks > 0 {
            let rows = RowInputs {
                q_target: &q_target,
                q_other: &q_other,
                row_max: &st.local_max,
                row_rest: &st.local_rest,
                row_scale: &ones,
                row_zl: &zeros,
            };
            let (d, b) = kernels.input_partials(&x, &rows)?;
            for (i, l) in local.iter().enumerate() {
                let d_ik = |k: usize| f64::from(d[i * hd + k]);
                let b_ik = |k: usize| f64::from(b[i * hd + k]);
                let a_ik = |k: usize| d_ik(k) + b_ik(k);
                layout.write_partials(&mut record, i, l.sum_exp(), d_ik, b_ik, a_ik);
            }
        }
        for (i, l) in local.iter().enumerate() {
            record[i * width..i * width + STATS_WIDTH].copy_from_slice(&l.to_record());
        }
        records.push(record);
        locals.push(local);
    }

    // The one barrier, on p in-process ranks; each rank's losses and dL/dx.
    let ranks = run_ranks(shards.len(), |comm| {
        let r = comm.rank();
        let mut record = records[r].clone();
        let global = layout.all_reduce(comm, &mut record)?;
        for (i, g) in global.iter().enumerate() {
            check_row(i, g, parsed[i])?;
        }
        let per_token_loss: ndarray::Array1<f64> = global
            .iter()
            .zip(&parsed)
            .map(|(g, &t)| token_loss(g, t, config))
            .collect();
        let loss = config.reduce(per_token_loss.as_slice().expect("contiguous"), &parsed);
        // Stored in f32, as the device holds the gradient.
        let grad_hidden = want_grad.then(|| {
            layout
                .input_grad(&record, &global, &token_weights, c)
                .mapv(|x| f64::from(x as f32))
        });
        Ok(RankLoss {
            rank: r,
            loss,
            per_token_loss,
            local: locals[r].clone(),
            global,
            grad_logits: None,
            grad_hidden,
            grad_weight: None,
            counts: comm.counts(),
            peak_bytes: 8 * width * n,
        })
    })
    .map_err(CudaError::Input)?;
    let mut ranks: Vec<RankLoss> = ranks.into_iter().map(|r| r.output).collect();

    // T pass: each shard's weight gradient against the global statistics.
    if want_grad {
        let global = ranks[0].global.clone();
        let row_max: Vec<f32> = global.iter().map(|g| g.max as f32).collect();
        let row_rest: Vec<f32> = global.iter().map(|g| g.rest as f32).collect();
        let row_scale: Vec<f32> = token_weights.iter().map(|&w| w as f32).collect();
        let row_zl: Vec<f32> = (global.iter())
            .map(|g| crate::vocab::z_loss_factor(c, g) as f32)
            .collect();
        let rows = RowInputs {
            q_target: &q_target,
            q_other: &q_other,
            row_max: &row_max,
            row_rest: &row_rest,
            row_scale: &row_scale,
            row_zl: &row_zl,
        };
        for (r, (sh, rank)) in shards.iter().zip(ranks.iter_mut()).enumerate() {
            let g = kernels.weight_grad(&input(r), &rows)?;
            let mut gw = Array2::<f64>::zeros((sh.width, hd));
            for (dst, &src) in gw.iter_mut().zip(&g) {
                *dst = f64::from(src);
            }
            rank.grad_weight = Some(gw);
        }
    }
    Ok(ShardedLoss { map: *map, ranks })
}
