//! Host side of the varlen attention kernels (`attention.cu`).
//!
//! All tensors are row-major f32 slices: `q, k, v, output, grad_*: [n_tok,
//! h, d]`, `lse: [h, n_tok]` (natural log, `-inf` for a query with no allowed
//! key). `cu_seqlens: [b + 1]`, `cu_seqlens[0] == 0`, non-decreasing,
//! `cu_seqlens[b] == n_tok` (empty segments allowed; checked by the
//! reference's `check_cu_seqlens`, with its errors). The masked form takes
//! one padded row (`n_tok = L`) and `allowed: [L, L]`.
//!
//! Forward: FlashAttention-2 (Dao 2023, Algorithm 1) online softmax; the
//! backward recomputes `P` from the saved `lse` (Algorithm 2) in three
//! launches (`delta`, `dQ`, `dK`/`dV`) without atomics, so results are
//! deterministic and a sequence gives bitwise the same values packed or
//! padded.

use cudarc::driver::{CudaSlice, PushKernelArg};

use super::{check_finite32, check_len, driver, to_i32, Gpu, Launch, Result, MAX_HEAD_DIM};
use packshard_reference::attention::check_cu_seqlens;
use packshard_reference::Error;

/// Queries (forward, dQ) or keys (dK/dV) per block: `TILE_Q` of the source.
const TILE_Q: usize = 64;
/// Keys (or queries) staged in shared memory per step: `TILE_K` of the source.
const TILE_K: usize = 32;

/// `[n_tok, h, d]` of an attention call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttnShape {
    /// Tokens (packed) or the padded row length `L`.
    pub n_tok: usize,
    /// Heads.
    pub h: usize,
    /// Head dim, `1..=MAX_HEAD_DIM`.
    pub d: usize,
}

impl AttnShape {
    /// `n_tok h d`.
    pub fn values(&self) -> usize {
        self.n_tok * self.h * self.d
    }
}

/// Forward result: `output: [n_tok, h, d]`, `lse: [h, n_tok]`.
#[derive(Debug, Clone, PartialEq)]
pub struct AttnForward {
    /// `[n_tok, h, d]`.
    pub output: Vec<f32>,
    /// `[h, n_tok]`.
    pub lse: Vec<f32>,
}

/// Backward result, each `[n_tok, h, d]`.
#[derive(Debug, Clone, PartialEq)]
pub struct AttnGrads {
    /// `∂L/∂q`.
    pub grad_q: Vec<f32>,
    /// `∂L/∂k`.
    pub grad_k: Vec<f32>,
    /// `∂L/∂v`.
    pub grad_v: Vec<f32>,
}

/// Which form a launch computes.
#[derive(Debug, Clone, Copy)]
pub enum Form<'a> {
    /// Packed segments of `cu_seqlens: [b + 1]`.
    Packed(&'a [usize]),
    /// One padded row, `allowed: [L, L]` row-major.
    Masked(&'a [bool]),
}

/// One attention call: `q, k, v: [n_tok, h, d]` in f32, the form and the
/// scale on `q . k`.
#[derive(Debug, Clone, Copy)]
pub struct Call<'a> {
    /// `[n_tok, h, d]`.
    pub q: &'a [f32],
    /// `[n_tok, h, d]`.
    pub k: &'a [f32],
    /// `[n_tok, h, d]`.
    pub v: &'a [f32],
    /// Its shape.
    pub shape: AttnShape,
    /// Packed or masked.
    pub form: Form<'a>,
    /// Multiplies `q . k`.
    pub scale: f32,
}

/// One attention backward call: the forward call's inputs, the forward's
/// results and `grad_output: [n_tok, h, d]`.
#[derive(Debug, Clone, Copy)]
pub struct BackwardCall<'a> {
    /// The inputs, as the forward took them.
    pub call: Call<'a>,
    /// The forward's `output` and `lse`.
    pub fwd: &'a AttnForward,
    /// `[n_tok, h, d]`.
    pub grad_output: &'a [f32],
}

fn check_shape(shape: AttnShape) -> Result<()> {
    if shape.d == 0 || shape.d > MAX_HEAD_DIM {
        return Err(Error::invalid(
            "d",
            format!("head dim {} outside 1..={MAX_HEAD_DIM}", shape.d),
        )
        .into());
    }
    if shape.h == 0 {
        return Err(Error::invalid("h", "at least one head").into());
    }
    if shape.h > 65_535 {
        return Err(Error::invalid("h", "at most 65535 heads (grid z)").into());
    }
    to_i32("n_tok", shape.n_tok)?;
    Ok(())
}

fn check_form(form: Form<'_>, shape: AttnShape) -> Result<()> {
    match form {
        // The reference's own check: the same error for the same offsets.
        Form::Packed(cu) => Ok(check_cu_seqlens(cu, shape.n_tok)?),
        Form::Masked(allowed) => {
            check_len("allowed", allowed, &[shape.n_tok, shape.n_tok], "[L, L]")
        }
    }
}

/// A checked attention call: its shape and launch grid. Every backend runs
/// the launches it gives ([`Plan::forward`], then for the backward
/// [`Plan::delta`], [`Plan::dq`], [`Plan::dkv`]), so the GPU and the
/// emulator share one geometry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    /// The call's shape.
    pub shape: AttnShape,
    /// Query blocks per segment (over the longest segment).
    pub tiles: u32,
    /// Segments (1 for the masked form).
    pub segments: u32,
}

impl Plan {
    fn new(form: Form<'_>, shape: AttnShape) -> Result<Plan> {
        let (segments, longest) = match form {
            Form::Packed(cu) => (
                cu.len() - 1,
                cu.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0),
            ),
            Form::Masked(_) => (1, shape.n_tok),
        };
        if segments > 65_535 {
            return Err(Error::invalid(
                "cu_seqlens",
                format!("{segments} segments, the kernels take at most 65535 per call (grid y)"),
            )
            .into());
        }
        Ok(Plan {
            shape,
            tiles: longest.div_ceil(TILE_Q) as u32,
            segments: segments as u32,
        })
    }

    /// Checks a forward call: shapes, finite `q`/`k`/`v`, the form, the scale.
    ///
    /// # Errors
    /// The reference's errors naming the field (see [`AttentionKernels`]).
    pub fn forward_call(c: &Call<'_>) -> Result<Plan> {
        check_shape(c.shape)?;
        let dims = [c.shape.n_tok, c.shape.h, c.shape.d];
        for (f, x) in [("q", c.q), ("k", c.k), ("v", c.v)] {
            check_len(f, x, &dims, "[n_tok, h, d]")?;
            check_finite32(f, x)?;
        }
        check_form(c.form, c.shape)?;
        if !c.scale.is_finite() {
            let scale = c.scale;
            return Err(Error::invalid("scale", format!("{scale} is not finite")).into());
        }
        Plan::new(c.form, c.shape)
    }

    /// Checks a backward call: as [`Plan::forward_call`], plus the saved
    /// forward and `grad_output`.
    ///
    /// # Errors
    /// As [`Plan::forward_call`].
    pub fn backward_call(b: &BackwardCall<'_>) -> Result<Plan> {
        let plan = Plan::forward_call(&b.call)?;
        let s = b.call.shape;
        let dims = [s.n_tok, s.h, s.d];
        check_len("grad_output", b.grad_output, &dims, "[n_tok, h, d]")?;
        check_finite32("grad_output", b.grad_output)?;
        check_len("output", &b.fwd.output, &dims, "[n_tok, h, d]")?;
        check_len("lse", &b.fwd.lse, &[s.h, s.n_tok], "[h, n_tok]")?;
        Ok(plan)
    }

    /// Whether there is nothing to launch (no tokens, or only empty segments).
    pub fn is_empty(&self) -> bool {
        self.tiles == 0 || self.segments == 0 || self.shape.n_tok == 0
    }

    fn tiled(&self, entry: &'static str, shared_floats: usize) -> Launch {
        Launch {
            entry,
            grid: (self.tiles, self.segments, self.shape.h as u32),
            block: TILE_Q as u32,
            shared_bytes: (shared_floats * 4) as u32,
        }
    }

    /// `attn_fwd`: a block per (query tile, segment, head).
    pub fn forward(&self) -> Launch {
        self.tiled("attn_fwd", 2 * TILE_K * self.shape.d)
    }

    /// `attn_bwd_delta`: a thread per (token, head).
    pub fn delta(&self) -> Launch {
        let rows = (self.shape.n_tok * self.shape.h) as u32;
        Launch {
            entry: "attn_bwd_delta",
            grid: (rows.div_ceil(256), 1, 1),
            block: 256,
            shared_bytes: 0,
        }
    }

    /// `attn_bwd_dq`: as the forward.
    pub fn dq(&self) -> Launch {
        self.tiled("attn_bwd_dq", 2 * TILE_K * self.shape.d)
    }

    /// `attn_bwd_dkv`: a block per (key tile, segment, head).
    pub fn dkv(&self) -> Launch {
        self.tiled("attn_bwd_dkv", 2 * TILE_K * self.shape.d + 2 * TILE_K)
    }
}

/// The attention kernels on one backend: the GPU ([`Gpu`]) or the CPU
/// emulator ([`super::emu::Emulator`]). f32 slices in the legend of the
/// module docs; inputs are checked by [`Plan::forward_call`] /
/// [`Plan::backward_call`] before any launch.
///
/// Errors: shapes ([`Error::ShapeMismatch`] naming the field), non-finite
/// `q`/`k`/`v`/`grad_output` ([`Error::NonFiniteInput`] with the flat
/// index), bad `cu_seqlens` (the reference's [`check_cu_seqlens`]),
/// `d > MAX_HEAD_DIM`, then the backend's own (driver, emulator).
pub trait AttentionKernels: Send + Sync {
    /// Attention forward in either [`Form`].
    ///
    /// # Errors
    /// See the trait docs.
    fn attention_forward(&self, c: &Call<'_>) -> Result<AttnForward>;

    /// Attention backward in either [`Form`], from the forward's `output`
    /// and `lse` and `grad_output: [n_tok, h, d]`.
    ///
    /// # Errors
    /// See the trait docs.
    fn attention_backward(&self, b: &BackwardCall<'_>) -> Result<AttnGrads>;
}

impl AttentionKernels for Gpu {
    fn attention_forward(&self, c: &Call<'_>) -> Result<AttnForward> {
        let plan = Plan::forward_call(c)?;
        let (n, h) = (c.shape.n_tok, c.shape.h);
        if n == 0 {
            return Ok(AttnForward {
                output: vec![],
                lse: vec![],
            });
        }
        let s = self.stream();
        let [dq, dk, dv] = self.upload_qkv(c)?;
        let mut out = driver("alloc output", s.alloc_zeros::<f32>(c.shape.values()))?;
        // Rows of empty segments are never visited: their lse stays -inf.
        let mut lse = driver("copy lse", s.clone_htod(&vec![f32::NEG_INFINITY; h * n]))?;
        let form_dev = upload_form(self, c.form)?;
        self.launch_forward(
            [&dq, &dk, &dv],
            &plan,
            &form_dev,
            c.scale,
            &mut out,
            &mut lse,
        )?;
        Ok(AttnForward {
            output: driver("copy output back", s.clone_dtoh(&out))?,
            lse: driver("copy lse back", s.clone_dtoh(&lse))?,
        })
    }

    fn attention_backward(&self, b: &BackwardCall<'_>) -> Result<AttnGrads> {
        let plan = Plan::backward_call(b)?;
        let c = &b.call;
        let zeros = || vec![0.0f32; c.shape.values()];
        if plan.is_empty() {
            return Ok(AttnGrads {
                grad_q: zeros(),
                grad_k: zeros(),
                grad_v: zeros(),
            });
        }
        let s = self.stream();
        let mut bufs = BwdBuffers::new(self, c)?;
        driver("copy output", s.memcpy_htod(&b.fwd.output, &mut bufs.out))?;
        driver(
            "copy grad_output",
            s.memcpy_htod(b.grad_output, &mut bufs.grad_out),
        )?;
        driver("copy lse", s.memcpy_htod(&b.fwd.lse, &mut bufs.lse))?;
        let form_dev = upload_form(self, c.form)?;
        self.launch_backward(&mut bufs, &plan, &form_dev, c.scale)?;
        let (gq, gk, gv) = (&bufs.gq, &bufs.gk, &bufs.gv);
        Ok(AttnGrads {
            grad_q: driver("copy grad_q back", s.clone_dtoh(gq))?,
            grad_k: driver("copy grad_k back", s.clone_dtoh(gk))?,
            grad_v: driver("copy grad_v back", s.clone_dtoh(gv))?,
        })
    }
}

type DevBuf<T> = Option<cudarc::driver::CudaSlice<T>>;

/// A [`Form`] on the device: `cu_seqlens` or `allowed`, the other absent.
type DeviceForm = (DevBuf<i64>, DevBuf<u8>);

/// The scalar parameters of the tiled kernels, held for the launch.
struct Scalars {
    /// `row_len, n_tok, h, d` (checked to fit `int` by [`Plan`]).
    dims: [i32; 4],
    scale: f32,
    /// The absent one of `cu_seqlens` / `allowed`.
    null: u64,
}

impl Scalars {
    fn new(shape: AttnShape, scale: f32) -> Scalars {
        let n = shape.n_tok as i32;
        Scalars {
            dims: [n, n, shape.h as i32, shape.d as i32],
            scale,
            null: 0,
        }
    }
}

/// Pushes the parameters every tiled kernel starts with: `q, k, v,
/// cu_seqlens, allowed, row_len, n_tok, h, d, scale`.
fn push_tiled<'a>(
    b: &mut cudarc::driver::LaunchArgs<'a>,
    [q, k, v]: [&'a CudaSlice<f32>; 3],
    form: &'a DeviceForm,
    scalars: &'a Scalars,
) {
    b.arg(q).arg(k).arg(v);
    match &form.0 {
        Some(c) => b.arg(c),
        None => b.arg(&scalars.null),
    };
    match &form.1 {
        Some(a) => b.arg(a),
        None => b.arg(&scalars.null),
    };
    for x in &scalars.dims {
        b.arg(x);
    }
    b.arg(&scalars.scale);
}

impl Gpu {
    /// `q, k, v` on the device.
    fn upload_qkv(&self, c: &Call<'_>) -> Result<[CudaSlice<f32>; 3]> {
        let s = self.stream();
        Ok([
            driver("copy q", s.clone_htod(c.q))?,
            driver("copy k", s.clone_htod(c.k))?,
            driver("copy v", s.clone_htod(c.v))?,
        ])
    }

    fn launch_forward(
        &self,
        [dq, dk, dv]: [&CudaSlice<f32>; 3],
        plan: &Plan,
        form: &DeviceForm,
        scale: f32,
        out: &mut CudaSlice<f32>,
        lse: &mut CudaSlice<f32>,
    ) -> Result<()> {
        if plan.is_empty() {
            return Ok(());
        }
        let l = plan.forward();
        let f = self.function("attention", l.entry)?;
        let scalars = Scalars::new(plan.shape, scale);
        let mut b = self.stream().launch_builder(&f);
        push_tiled(&mut b, [dq, dk, dv], form, &scalars);
        b.arg(out).arg(lse);
        // SAFETY: argument list matches `attn_fwd` in attention.cu; every
        // buffer has the length its legend says (checked by `Plan`).
        driver("launch attn_fwd", unsafe { b.launch(l.config()) })?;
        Ok(())
    }

    /// Times the forward (`backward: false`) or the forward plus backward
    /// (`grad_output = v`) on device-resident inputs: uploads once, runs one
    /// warm-up pass, then `reps`; seconds per pass (kernel time, no copies).
    /// For the GPU bench; [`attention_device_bytes`] gives the memory the
    /// pass holds.
    ///
    /// # Errors
    /// As [`AttentionKernels::attention_forward`].
    pub fn time_attention(&self, c: &Call<'_>, backward: bool, reps: usize) -> Result<f64> {
        let plan = Plan::forward_call(c)?;
        let s = self.stream();
        let mut bufs = BwdBuffers::new(self, c)?;
        driver("copy grad_output", s.memcpy_htod(c.v, &mut bufs.grad_out))?;
        let dev = upload_form(self, c.form)?;
        let pass = |bufs: &mut BwdBuffers| -> Result<()> {
            let qkv = [&bufs.q, &bufs.k, &bufs.v];
            self.launch_forward(qkv, &plan, &dev, c.scale, &mut bufs.out, &mut bufs.lse)?;
            if backward {
                self.launch_backward(bufs, &plan, &dev, c.scale)?;
            }
            Ok(())
        };
        pass(&mut bufs)?;
        driver("synchronize", s.synchronize())?;
        let t0 = std::time::Instant::now();
        for _ in 0..reps.max(1) {
            pass(&mut bufs)?;
        }
        driver("synchronize", s.synchronize())?;
        Ok(t0.elapsed().as_secs_f64() / reps.max(1) as f64)
    }
}

/// Device buffers of a backward pass (each `[n_tok, h, d]`, `lse` and
/// `delta` `[h, n_tok]`).
struct BwdBuffers {
    q: CudaSlice<f32>,
    k: CudaSlice<f32>,
    v: CudaSlice<f32>,
    out: CudaSlice<f32>,
    grad_out: CudaSlice<f32>,
    lse: CudaSlice<f32>,
    delta: CudaSlice<f32>,
    gq: CudaSlice<f32>,
    gk: CudaSlice<f32>,
    gv: CudaSlice<f32>,
}

impl BwdBuffers {
    /// `q, k, v` uploaded, every other buffer zeroed (at least one value:
    /// the driver refuses empty buffers).
    fn new(gpu: &Gpu, c: &Call<'_>) -> Result<BwdBuffers> {
        let s = gpu.stream();
        let vals = c.shape.values().max(1);
        let rows = (c.shape.h * c.shape.n_tok).max(1);
        let zeros = |what: &str, len: usize| driver(what, s.alloc_zeros::<f32>(len));
        let [q, k, v] = gpu.upload_qkv(c)?;
        Ok(BwdBuffers {
            q,
            k,
            v,
            out: zeros("alloc output", vals)?,
            grad_out: zeros("alloc grad_output", vals)?,
            lse: zeros("alloc lse", rows)?,
            delta: zeros("alloc delta", rows)?,
            gq: zeros("alloc grad_q", vals)?,
            gk: zeros("alloc grad_k", vals)?,
            gv: zeros("alloc grad_v", vals)?,
        })
    }
}

impl Gpu {
    /// The three backward launches (`delta`, `dQ`, `dK`/`dV`).
    fn launch_backward(
        &self,
        bufs: &mut BwdBuffers,
        plan: &Plan,
        form: &DeviceForm,
        scale: f32,
    ) -> Result<()> {
        if plan.is_empty() {
            return Ok(());
        }
        let s = self.stream();
        let scalars = Scalars::new(plan.shape, scale);
        let [_, ni, hi, di] = &scalars.dims;

        let l = plan.delta();
        let f = self.function("attention", l.entry)?;
        let mut b = s.launch_builder(&f);
        b.arg(&bufs.out).arg(&bufs.grad_out);
        b.arg(ni).arg(hi).arg(di).arg(&mut bufs.delta);
        // SAFETY: matches `attn_bwd_delta`; buffers sized [n, h, d] and [h, n].
        driver("launch attn_bwd_delta", unsafe { b.launch(l.config()) })?;

        self.launch_tiled_backward(TiledBackward::Dq, plan, bufs, form, &scalars)?;
        self.launch_tiled_backward(TiledBackward::Dkv, plan, bufs, form, &scalars)
    }

    /// One of the tiled backward launches, `attn_bwd_dq` (writes `gq`) or
    /// `attn_bwd_dkv` (writes `gk, gv`): the parameters every tiled kernel
    /// starts with ([`push_tiled`]), then `lse, delta, grad_output`, then
    /// the gradients it writes, each `[n_tok, h, d]`. `which` chooses the
    /// kernel and the buffers it writes together.
    fn launch_tiled_backward(
        &self,
        which: TiledBackward,
        plan: &Plan,
        bufs: &mut BwdBuffers,
        form: &DeviceForm,
        scalars: &Scalars,
    ) -> Result<()> {
        let BwdBuffers {
            q,
            k,
            v,
            grad_out,
            lse,
            delta,
            gq,
            gk,
            gv,
            ..
        } = bufs;
        let (l, what) = match which {
            TiledBackward::Dq => (plan.dq(), "launch attn_bwd_dq"),
            TiledBackward::Dkv => (plan.dkv(), "launch attn_bwd_dkv"),
        };
        let f = self.function("attention", l.entry)?;
        let mut b = self.stream().launch_builder(&f);
        push_tiled(&mut b, [&*q, &*k, &*v], form, scalars);
        b.arg(&*lse).arg(&*delta).arg(&*grad_out);
        match which {
            TiledBackward::Dq => b.arg(gq),
            TiledBackward::Dkv => b.arg(gk).arg(gv),
        };
        // SAFETY: matches `attn_bwd_dq` (`which` Dq) or `attn_bwd_dkv`
        // (`which` Dkv) in attention.cu, whose parameter lists differ only
        // in the gradients at the end; every buffer is one of `BwdBuffers`,
        // sized [n, h, d] or [h, n] for `plan`'s shape.
        driver(what, unsafe { b.launch(l.config()) })?;
        Ok(())
    }
}

/// Which tiled backward kernel [`Gpu::launch_tiled_backward`] launches.
#[derive(Debug, Clone, Copy)]
enum TiledBackward {
    /// `attn_bwd_dq`: writes `grad_q`.
    Dq,
    /// `attn_bwd_dkv`: writes `grad_k` and `grad_v`.
    Dkv,
}

fn upload_form(gpu: &Gpu, form: Form<'_>) -> Result<DeviceForm> {
    let s = gpu.stream();
    Ok(match form {
        Form::Packed(cu) => {
            let cu: Vec<i64> = cu.iter().map(|&c| c as i64).collect();
            (Some(driver("copy cu_seqlens", s.clone_htod(&cu))?), None)
        }
        Form::Masked(allowed) => {
            let a: Vec<u8> = allowed.iter().map(|&x| x as u8).collect();
            (None, Some(driver("copy allowed", s.clone_htod(&a))?))
        }
    })
}

/// Floating-point operations of attention over `cu_seqlens` (forward:
/// `4 d` per allowed pair and head, `QK^T` and `PV`; backward: `10 d`,
/// recomputing `QK^T` plus four products), the unit of the GPU bench.
pub fn attention_flops(cu_seqlens: &[usize], h: usize, d: usize, backward: bool) -> f64 {
    let pairs: f64 = cu_seqlens
        .windows(2)
        .map(|w| ((w[1] - w[0]) as f64).powi(2))
        .sum();
    let per = if backward { 10.0 } else { 4.0 };
    per * d as f64 * h as f64 * pairs
}

/// Bytes of the device buffers an attention pass holds: `q, k, v, out`
/// (`[n_tok, h, d]` f32 each), `lse` (`[h, n_tok]`) and `cu_seqlens` for the
/// forward; with the backward also `grad_output, grad_q, grad_k, grad_v` and
/// `delta`. What PyTorch's `max_memory_allocated` counts for the same call
/// (the GPU bench puts them side by side). [`Gpu::time_attention`]
/// allocates the backward's buffers for either pass.
pub fn attention_device_bytes(shape: AttnShape, segments: usize, backward: bool) -> usize {
    let vals = shape.values();
    let rows = shape.h * shape.n_tok;
    let cu = 4 * (segments + 1);
    if backward {
        4 * (8 * vals + 2 * rows) + cu
    } else {
        4 * (4 * vals + rows) + cu
    }
}
