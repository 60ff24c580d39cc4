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
    fn values(&self) -> usize {
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
    pub fn forward_call(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        shape: AttnShape,
        form: Form<'_>,
        scale: f32,
    ) -> Result<Plan> {
        check_shape(shape)?;
        let dims = [shape.n_tok, shape.h, shape.d];
        for (f, x) in [("q", q), ("k", k), ("v", v)] {
            check_len(f, x, &dims, "[n_tok, h, d]")?;
            check_finite32(f, x)?;
        }
        check_form(form, shape)?;
        if !scale.is_finite() {
            return Err(Error::invalid("scale", format!("{scale} is not finite")).into());
        }
        Plan::new(form, shape)
    }

    /// Checks a backward call: as [`Plan::forward_call`], plus the saved
    /// forward and `grad_output`.
    ///
    /// # Errors
    /// As [`Plan::forward_call`].
    #[allow(clippy::too_many_arguments)]
    pub fn backward_call(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        shape: AttnShape,
        form: Form<'_>,
        scale: f32,
        fwd: &AttnForward,
        grad_output: &[f32],
    ) -> Result<Plan> {
        let plan = Plan::forward_call(q, k, v, shape, form, scale)?;
        let dims = [shape.n_tok, shape.h, shape.d];
        check_len("grad_output", grad_output, &dims, "[n_tok, h, d]")?;
        check_finite32("grad_output", grad_output)?;
        check_len("output", &fwd.output, &dims, "[n_tok, h, d]")?;
        check_len("lse", &fwd.lse, &[shape.h, shape.n_tok], "[h, n_tok]")?;
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
    fn attention_forward(
        &self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        shape: AttnShape,
        form: Form<'_>,
        scale: f32,
    ) -> Result<AttnForward>;

    /// Attention backward in either [`Form`], from the forward's `output`
    /// and `lse` and `grad_output: [n_tok, h, d]`.
    ///
    /// # Errors
    /// See the trait docs.
    #[allow(clippy::too_many_arguments)]
    fn attention_backward(
        &self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        shape: AttnShape,
        form: Form<'_>,
        scale: f32,
        fwd: &AttnForward,
        grad_output: &[f32],
    ) -> Result<AttnGrads>;
}

impl AttentionKernels for Gpu {
    fn attention_forward(
        &self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        shape: AttnShape,
        form: Form<'_>,
        scale: f32,
    ) -> Result<AttnForward> {
        let plan = Plan::forward_call(q, k, v, shape, form, scale)?;
        let (n, h) = (shape.n_tok, shape.h);
        if n == 0 {
            return Ok(AttnForward {
                output: vec![],
                lse: vec![],
            });
        }
        let s = self.stream();
        let dq = driver("copy q", s.clone_htod(q))?;
        let dk = driver("copy k", s.clone_htod(k))?;
        let dv = driver("copy v", s.clone_htod(v))?;
        let mut out = driver("alloc output", s.alloc_zeros::<f32>(shape.values()))?;
        // Rows of empty segments are never visited: their lse stays -inf.
        let mut lse = driver("copy lse", s.clone_htod(&vec![f32::NEG_INFINITY; h * n]))?;
        let form_dev = upload_form(self, form)?;
        self.launch_forward(&dq, &dk, &dv, &plan, &form_dev, scale, &mut out, &mut lse)?;
        Ok(AttnForward {
            output: driver("copy output back", s.clone_dtoh(&out))?,
            lse: driver("copy lse back", s.clone_dtoh(&lse))?,
        })
    }

    fn attention_backward(
        &self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        shape: AttnShape,
        form: Form<'_>,
        scale: f32,
        fwd: &AttnForward,
        grad_output: &[f32],
    ) -> Result<AttnGrads> {
        let plan = Plan::backward_call(q, k, v, shape, form, scale, fwd, grad_output)?;
        let (n, h) = (shape.n_tok, shape.h);
        let zeros = || vec![0.0f32; shape.values()];
        if plan.is_empty() {
            return Ok(AttnGrads {
                grad_q: zeros(),
                grad_k: zeros(),
                grad_v: zeros(),
            });
        }
        let s = self.stream();
        let mut bufs = BwdBuffers {
            q: driver("copy q", s.clone_htod(q))?,
            k: driver("copy k", s.clone_htod(k))?,
            v: driver("copy v", s.clone_htod(v))?,
            out: driver("copy output", s.clone_htod(&fwd.output))?,
            grad_out: driver("copy grad_output", s.clone_htod(grad_output))?,
            lse: driver("copy lse", s.clone_htod(&fwd.lse))?,
            delta: driver("alloc delta", s.alloc_zeros::<f32>(h * n))?,
            gq: driver("alloc grad_q", s.alloc_zeros::<f32>(shape.values()))?,
            gk: driver("alloc grad_k", s.alloc_zeros::<f32>(shape.values()))?,
            gv: driver("alloc grad_v", s.alloc_zeros::<f32>(shape.values()))?,
        };
        let form_dev = upload_form(self, form)?;
        self.launch_backward(&mut bufs, &plan, &form_dev, scale)?;
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

/// The kernels' `int` sizes `(n_tok, h, d)` (checked by [`Plan`]).
fn dims32(shape: AttnShape) -> (i32, i32, i32) {
    (shape.n_tok as i32, shape.h as i32, shape.d as i32)
}

impl Gpu {
    #[allow(clippy::too_many_arguments)]
    fn launch_forward(
        &self,
        dq: &CudaSlice<f32>,
        dk: &CudaSlice<f32>,
        dv: &CudaSlice<f32>,
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
        let (ni, hi, di) = dims32(plan.shape);
        let null: u64 = 0;
        let mut b = self.stream().launch_builder(&f);
        b.arg(dq).arg(dk).arg(dv);
        push_form(&mut b, form, &null);
        b.arg(&ni).arg(&ni).arg(&hi).arg(&di).arg(&scale);
        b.arg(out).arg(lse);
        // SAFETY: argument list matches `attn_fwd` in attention.cu; every
        // buffer has the length its legend says (checked by `Plan`).
        driver("launch attn_fwd", unsafe { b.launch(l.config()) })?;
        Ok(())
    }

    /// Times the packed forward on device-resident inputs: uploads once,
    /// launches `reps` times after one warm-up, and returns seconds per
    /// launch (kernel time, no copies). For the GPU bench.
    ///
    /// # Errors
    /// As [`AttentionKernels::attention_forward`].
    #[allow(clippy::too_many_arguments)]
    pub fn time_varlen_forward(
        &self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        shape: AttnShape,
        cu_seqlens: &[usize],
        scale: f32,
        reps: usize,
    ) -> Result<f64> {
        let form = Form::Packed(cu_seqlens);
        let plan = Plan::forward_call(q, k, v, shape, form, scale)?;
        let s = self.stream();
        let dq = driver("copy q", s.clone_htod(q))?;
        let dk = driver("copy k", s.clone_htod(k))?;
        let dv = driver("copy v", s.clone_htod(v))?;
        let mut out = driver("alloc output", s.alloc_zeros::<f32>(shape.values().max(1)))?;
        let mut lse = driver(
            "alloc lse",
            s.alloc_zeros::<f32>((shape.h * shape.n_tok).max(1)),
        )?;
        let dev = upload_form(self, form)?;
        self.launch_forward(&dq, &dk, &dv, &plan, &dev, scale, &mut out, &mut lse)?;
        driver("synchronize", s.synchronize())?;
        let t0 = std::time::Instant::now();
        for _ in 0..reps.max(1) {
            self.launch_forward(&dq, &dk, &dv, &plan, &dev, scale, &mut out, &mut lse)?;
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
        let (ni, hi, di) = dims32(plan.shape);
        let null: u64 = 0;

        let l = plan.delta();
        let f = self.function("attention", l.entry)?;
        let mut b = s.launch_builder(&f);
        b.arg(&bufs.out).arg(&bufs.grad_out);
        b.arg(&ni).arg(&hi).arg(&di).arg(&mut bufs.delta);
        // SAFETY: matches `attn_bwd_delta`; buffers sized [n, h, d] and [h, n].
        driver("launch attn_bwd_delta", unsafe { b.launch(l.config()) })?;

        let l = plan.dq();
        let f = self.function("attention", l.entry)?;
        let mut b = s.launch_builder(&f);
        b.arg(&bufs.q).arg(&bufs.k).arg(&bufs.v);
        push_form(&mut b, form, &null);
        b.arg(&ni).arg(&ni).arg(&hi).arg(&di).arg(&scale);
        b.arg(&bufs.lse).arg(&bufs.delta).arg(&bufs.grad_out);
        b.arg(&mut bufs.gq);
        // SAFETY: matches `attn_bwd_dq`.
        driver("launch attn_bwd_dq", unsafe { b.launch(l.config()) })?;

        let l = plan.dkv();
        let f = self.function("attention", l.entry)?;
        let mut b = s.launch_builder(&f);
        b.arg(&bufs.q).arg(&bufs.k).arg(&bufs.v);
        push_form(&mut b, form, &null);
        b.arg(&ni).arg(&ni).arg(&hi).arg(&di).arg(&scale);
        b.arg(&bufs.lse).arg(&bufs.delta).arg(&bufs.grad_out);
        b.arg(&mut bufs.gk).arg(&mut bufs.gv);
        // SAFETY: matches `attn_bwd_dkv`.
        driver("launch attn_bwd_dkv", unsafe { b.launch(l.config()) })?;
        Ok(())
    }

    /// Times the packed forward plus backward on device-resident inputs
    /// (`grad_output = v`): one warm-up, then `reps` passes; seconds per
    /// pass (kernel time, no copies). For the GPU bench.
    ///
    /// # Errors
    /// As [`AttentionKernels::attention_forward`].
    #[allow(clippy::too_many_arguments)]
    pub fn time_varlen_forward_backward(
        &self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        shape: AttnShape,
        cu_seqlens: &[usize],
        scale: f32,
        reps: usize,
    ) -> Result<f64> {
        let form = Form::Packed(cu_seqlens);
        let plan = Plan::forward_call(q, k, v, shape, form, scale)?;
        let s = self.stream();
        let vals = shape.values().max(1);
        let rows = (shape.h * shape.n_tok).max(1);
        let mut bufs = BwdBuffers {
            q: driver("copy q", s.clone_htod(q))?,
            k: driver("copy k", s.clone_htod(k))?,
            v: driver("copy v", s.clone_htod(v))?,
            out: driver("alloc output", s.alloc_zeros::<f32>(vals))?,
            grad_out: driver("copy grad_output", s.clone_htod(v))?,
            lse: driver("alloc lse", s.alloc_zeros::<f32>(rows))?,
            delta: driver("alloc delta", s.alloc_zeros::<f32>(rows))?,
            gq: driver("alloc grad_q", s.alloc_zeros::<f32>(vals))?,
            gk: driver("alloc grad_k", s.alloc_zeros::<f32>(vals))?,
            gv: driver("alloc grad_v", s.alloc_zeros::<f32>(vals))?,
        };
        let dev = upload_form(self, form)?;
        let pass = |bufs: &mut BwdBuffers| -> Result<()> {
            let (q, k, v) = (&bufs.q, &bufs.k, &bufs.v);
            self.launch_forward(q, k, v, &plan, &dev, scale, &mut bufs.out, &mut bufs.lse)?;
            self.launch_backward(bufs, &plan, &dev, scale)
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

/// Pushes `cu_seqlens` and `allowed`, a null pointer for the absent one.
fn push_form<'a>(b: &mut cudarc::driver::LaunchArgs<'a>, form: &'a DeviceForm, null: &'a u64) {
    match &form.0 {
        Some(c) => b.arg(c),
        None => b.arg(null),
    };
    match &form.1 {
        Some(a) => b.arg(a),
        None => b.arg(null),
    };
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
