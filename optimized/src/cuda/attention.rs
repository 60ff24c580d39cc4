//! Host side of the varlen attention kernels (`attention.cu`).
//!
//! All tensors are row-major f32 slices: `q, k, v, output, grad_*: [n_tok,
//! h, d]`, `lse: [h, n_tok]` (natural log, `-inf` for a query with no allowed
//! key). `cu_seqlens: [b + 1]`, `cu_seqlens[0] == 0`, non-decreasing,
//! `cu_seqlens[b] == n_tok` (empty segments allowed). The masked form takes
//! one padded row (`n_tok = L`) and `allowed: [L, L]`.
//!
//! Forward: FlashAttention-2 (Dao 2023, Algorithm 1) online softmax; the
//! backward recomputes `P` from the saved `lse` (Algorithm 2) in three
//! launches (`delta`, `dQ`, `dK`/`dV`) without atomics, so results are
//! deterministic and a sequence gives bitwise the same values packed or
//! padded.

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::{check_finite32, check_len, driver, to_i32, CudaError, Gpu, Result, MAX_HEAD_DIM};
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

/// Checks `cu_seqlens` as the reference does: `[b + 1]`, leading 0,
/// non-decreasing, last `n_tok`.
///
/// # Errors
/// [`Error::ShapeMismatch`] for an empty list, [`Error::IndexOutOfRange`]
/// naming the first bad index.
pub fn check_cu_seqlens(cu: &[usize], n_tok: usize) -> Result<()> {
    if cu.is_empty() {
        return Err(Error::ShapeMismatch {
            field: "cu_seqlens".into(),
            expected: "[b + 1] with b >= 0".into(),
            actual: vec![0],
        }
        .into());
    }
    let bad = |index: usize, lo: usize, hi: usize| -> CudaError {
        Error::IndexOutOfRange {
            field: "cu_seqlens".into(),
            index,
            value: cu[index] as i64,
            lo: lo as i64,
            hi: hi as i64 + 1,
        }
        .into()
    };
    if cu[0] != 0 {
        return Err(bad(0, 0, 0));
    }
    for i in 1..cu.len() {
        if cu[i] < cu[i - 1] || cu[i] > n_tok {
            return Err(bad(i, cu[i - 1], n_tok));
        }
    }
    let last = cu.len() - 1;
    if cu[last] != n_tok {
        return Err(bad(last, n_tok, n_tok));
    }
    Ok(())
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

/// Launch geometry: grid `(tiles, segments, heads)`, the longest segment.
fn grid(form: Form<'_>, shape: AttnShape) -> Result<(u32, u32, usize)> {
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
    Ok((longest.div_ceil(TILE_Q) as u32, segments as u32, longest))
}

fn check_form(form: Form<'_>, shape: AttnShape) -> Result<()> {
    match form {
        Form::Packed(cu) => check_cu_seqlens(cu, shape.n_tok),
        Form::Masked(allowed) => {
            check_len("allowed", allowed, &[shape.n_tok, shape.n_tok], "[L, L]")
        }
    }
}

impl Gpu {
    /// Attention forward in either [`Form`].
    ///
    /// # Errors
    /// Shape errors naming the field, non-finite `q`/`k`/`v`
    /// ([`Error::NonFiniteInput`] with the flat index), bad `cu_seqlens`,
    /// `d > MAX_HEAD_DIM`, driver errors.
    pub fn attention_forward(
        &self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        shape: AttnShape,
        form: Form<'_>,
        scale: f32,
    ) -> Result<AttnForward> {
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
        let (tiles, segments, _) = grid(form, shape)?;
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
        let (cu_dev, allowed_dev) = upload_form(self, form)?;
        let dev = DeviceForm {
            cu: &cu_dev,
            allowed: &allowed_dev,
            tiles,
            segments,
        };
        self.launch_forward(&dq, &dk, &dv, shape, &dev, scale, &mut out, &mut lse)?;
        Ok(AttnForward {
            output: driver("copy output back", s.clone_dtoh(&out))?,
            lse: driver("copy lse back", s.clone_dtoh(&lse))?,
        })
    }

    /// Attention backward in either [`Form`], from the forward's `output`
    /// and `lse` and `grad_output: [n_tok, h, d]`.
    ///
    /// # Errors
    /// As [`Gpu::attention_forward`], plus shape errors for `output`, `lse`
    /// and `grad_output` and non-finite `grad_output`.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_backward(
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
        check_shape(shape)?;
        let dims = [shape.n_tok, shape.h, shape.d];
        for (f, x) in [("q", q), ("k", k), ("v", v), ("grad_output", grad_output)] {
            check_len(f, x, &dims, "[n_tok, h, d]")?;
            check_finite32(f, x)?;
        }
        check_len("output", &fwd.output, &dims, "[n_tok, h, d]")?;
        check_len("lse", &fwd.lse, &[shape.h, shape.n_tok], "[h, n_tok]")?;
        check_form(form, shape)?;
        let (tiles, segments, _) = grid(form, shape)?;
        let (n, h) = (shape.n_tok, shape.h);
        let zeros = || vec![0.0f32; shape.values()];
        if n == 0 || tiles == 0 || segments == 0 {
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
        let (cu_dev, allowed_dev) = upload_form(self, form)?;
        let dev = DeviceForm {
            cu: &cu_dev,
            allowed: &allowed_dev,
            tiles,
            segments,
        };
        self.launch_backward(&mut bufs, shape, &dev, scale)?;
        let (gq, gk, gv) = (&bufs.gq, &bufs.gk, &bufs.gv);
        Ok(AttnGrads {
            grad_q: driver("copy grad_q back", s.clone_dtoh(gq))?,
            grad_k: driver("copy grad_k back", s.clone_dtoh(gk))?,
            grad_v: driver("copy grad_v back", s.clone_dtoh(gv))?,
        })
    }
}

type DevBuf<T> = Option<cudarc::driver::CudaSlice<T>>;

/// A [`Form`] uploaded, with its launch grid.
struct DeviceForm<'a> {
    cu: &'a DevBuf<i64>,
    allowed: &'a DevBuf<u8>,
    tiles: u32,
    segments: u32,
}

impl Gpu {
    #[allow(clippy::too_many_arguments)]
    fn launch_forward(
        &self,
        dq: &CudaSlice<f32>,
        dk: &CudaSlice<f32>,
        dv: &CudaSlice<f32>,
        shape: AttnShape,
        form: &DeviceForm<'_>,
        scale: f32,
        out: &mut CudaSlice<f32>,
        lse: &mut CudaSlice<f32>,
    ) -> Result<()> {
        if form.tiles == 0 || form.segments == 0 || shape.n_tok == 0 {
            return Ok(());
        }
        let f = self.function("attention", "attn_fwd")?;
        let (ni, hi, di) = (
            to_i32("n_tok", shape.n_tok)?,
            shape.h as i32,
            shape.d as i32,
        );
        let row_len = ni;
        let null: u64 = 0;
        let cfg = LaunchConfig {
            grid_dim: (form.tiles, form.segments, shape.h as u32),
            block_dim: (TILE_Q as u32, 1, 1),
            shared_mem_bytes: (2 * TILE_K * shape.d * 4) as u32,
        };
        let mut b = self.stream().launch_builder(&f);
        b.arg(dq).arg(dk).arg(dv);
        push_form(&mut b, form.cu, form.allowed, &null);
        b.arg(&row_len).arg(&ni).arg(&hi).arg(&di).arg(&scale);
        b.arg(out).arg(lse);
        // SAFETY: argument list matches `attn_fwd` in attention.cu; every
        // buffer has the length its legend says (checked by the callers).
        driver("launch attn_fwd", unsafe { b.launch(cfg) })?;
        Ok(())
    }

    /// Times the packed forward on device-resident inputs: uploads once,
    /// launches `reps` times after one warm-up, and returns seconds per
    /// launch (kernel time, no copies). For the GPU bench.
    ///
    /// # Errors
    /// As [`Gpu::attention_forward`].
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
        check_shape(shape)?;
        let dims = [shape.n_tok, shape.h, shape.d];
        for (f, x) in [("q", q), ("k", k), ("v", v)] {
            check_len(f, x, &dims, "[n_tok, h, d]")?;
        }
        let form = Form::Packed(cu_seqlens);
        check_form(form, shape)?;
        let (tiles, segments, _) = grid(form, shape)?;
        let s = self.stream();
        let dq = driver("copy q", s.clone_htod(q))?;
        let dk = driver("copy k", s.clone_htod(k))?;
        let dv = driver("copy v", s.clone_htod(v))?;
        let mut out = driver("alloc output", s.alloc_zeros::<f32>(shape.values().max(1)))?;
        let mut lse = driver(
            "alloc lse",
            s.alloc_zeros::<f32>((shape.h * shape.n_tok).max(1)),
        )?;
        let (cu_dev, allowed_dev) = upload_form(self, form)?;
        let dev = DeviceForm {
            cu: &cu_dev,
            allowed: &allowed_dev,
            tiles,
            segments,
        };
        self.launch_forward(&dq, &dk, &dv, shape, &dev, scale, &mut out, &mut lse)?;
        driver("synchronize", s.synchronize())?;
        let t0 = std::time::Instant::now();
        for _ in 0..reps.max(1) {
            self.launch_forward(&dq, &dk, &dv, shape, &dev, scale, &mut out, &mut lse)?;
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
        shape: AttnShape,
        form: &DeviceForm<'_>,
        scale: f32,
    ) -> Result<()> {
        if form.tiles == 0 || form.segments == 0 || shape.n_tok == 0 {
            return Ok(());
        }
        let s = self.stream();
        let (n, h, d) = (shape.n_tok, shape.h, shape.d);
        let (ni, hi, di) = (to_i32("n_tok", n)?, h as i32, d as i32);
        let row_len = ni;
        let null: u64 = 0;

        let f = self.function("attention", "attn_bwd_delta")?;
        let rows = (n * h) as u32;
        let cfg = LaunchConfig {
            grid_dim: (rows.div_ceil(256), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = s.launch_builder(&f);
        b.arg(&bufs.out).arg(&bufs.grad_out);
        b.arg(&ni).arg(&hi).arg(&di).arg(&mut bufs.delta);
        // SAFETY: matches `attn_bwd_delta`; buffers sized [n, h, d] and [h, n].
        driver("launch attn_bwd_delta", unsafe { b.launch(cfg) })?;

        let tiled = LaunchConfig {
            grid_dim: (form.tiles, form.segments, h as u32),
            block_dim: (TILE_Q as u32, 1, 1),
            shared_mem_bytes: (2 * TILE_K * d * 4) as u32,
        };
        let f = self.function("attention", "attn_bwd_dq")?;
        let mut b = s.launch_builder(&f);
        b.arg(&bufs.q).arg(&bufs.k).arg(&bufs.v);
        push_form(&mut b, form.cu, form.allowed, &null);
        b.arg(&row_len).arg(&ni).arg(&hi).arg(&di).arg(&scale);
        b.arg(&bufs.lse).arg(&bufs.delta).arg(&bufs.grad_out);
        b.arg(&mut bufs.gq);
        // SAFETY: matches `attn_bwd_dq`.
        driver("launch attn_bwd_dq", unsafe { b.launch(tiled) })?;

        let f = self.function("attention", "attn_bwd_dkv")?;
        let mut b = s.launch_builder(&f);
        b.arg(&bufs.q).arg(&bufs.k).arg(&bufs.v);
        push_form(&mut b, form.cu, form.allowed, &null);
        b.arg(&row_len).arg(&ni).arg(&hi).arg(&di).arg(&scale);
        b.arg(&bufs.lse).arg(&bufs.delta).arg(&bufs.grad_out);
        b.arg(&mut bufs.gk).arg(&mut bufs.gv);
        let cfg = LaunchConfig {
            shared_mem_bytes: ((2 * TILE_K * d + 2 * TILE_K) * 4) as u32,
            ..tiled
        };
        // SAFETY: matches `attn_bwd_dkv`.
        driver("launch attn_bwd_dkv", unsafe { b.launch(cfg) })?;
        Ok(())
    }

    /// Times the packed forward plus backward on device-resident inputs
    /// (`grad_output = v`): one warm-up, then `reps` passes; seconds per
    /// pass (kernel time, no copies). For the GPU bench.
    ///
    /// # Errors
    /// As [`Gpu::attention_forward`].
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
        check_shape(shape)?;
        let dims = [shape.n_tok, shape.h, shape.d];
        for (f, x) in [("q", q), ("k", k), ("v", v)] {
            check_len(f, x, &dims, "[n_tok, h, d]")?;
        }
        let form = Form::Packed(cu_seqlens);
        check_form(form, shape)?;
        let (tiles, segments, _) = grid(form, shape)?;
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
        let (cu_dev, allowed_dev) = upload_form(self, form)?;
        let dev = DeviceForm {
            cu: &cu_dev,
            allowed: &allowed_dev,
            tiles,
            segments,
        };
        let pass = |bufs: &mut BwdBuffers| -> Result<()> {
            let (q, k, v) = (&bufs.q, &bufs.k, &bufs.v);
            self.launch_forward(q, k, v, shape, &dev, scale, &mut bufs.out, &mut bufs.lse)?;
            self.launch_backward(bufs, shape, &dev, scale)
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

fn upload_form(gpu: &Gpu, form: Form<'_>) -> Result<(DevBuf<i64>, DevBuf<u8>)> {
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
fn push_form<'a>(
    b: &mut cudarc::driver::LaunchArgs<'a>,
    cu: &'a DevBuf<i64>,
    allowed: &'a DevBuf<u8>,
    null: &'a u64,
) {
    match cu {
        Some(c) => b.arg(c),
        None => b.arg(null),
    };
    match allowed {
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
