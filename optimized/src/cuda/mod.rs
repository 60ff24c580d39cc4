//! GPU kernels (feature `cuda`, issue #7): varlen packed attention and the
//! fused vocabulary-shard linear cross-entropy, in f32, as CUDA C compiled at
//! run time by NVRTC and launched through [`cudarc`]'s driver API.
//!
//! Nothing CUDA is needed to build: `cudarc` loads `libcuda` and `libnvrtc`
//! with `dlopen` when first used. Every entry point checks first
//! ([`nvrtc_present`], [`Gpu::new`]) and turns an absent library or device
//! into a typed [`CudaError::NoNvrtc`] / [`CudaError::NoDevice`] instead of
//! cudarc's panic, so tests can say they skipped.
//!
//! Shape legend (as `packshard-reference`): `n_tok` packed tokens, `b`
//! segments, `h` heads, `d` head dim (`1..=`[`MAX_HEAD_DIM`]), `n` tokens of
//! the output layer, `hd` hidden size, `v` vocabulary, `p` shards, `w` rows
//! of one shard.
//!
//! - [`KERNELS`]: every kernel source, one name and one line each; the CI
//!   check `optimized/tests/cuda.rs::every_kernel_compiles_to_ptx_for_sm_90`
//!   compiles each one with NVRTC for [`CI_ARCH`] (no GPU needed).
//! - [`attention`]: varlen attention forward / backward (FlashAttention-2
//!   online softmax, saves `lse`, no `[n_tok, n_tok]` mask) and the same
//!   kernels over one padded row with a boolean mask.
//! - [`vocab`]: the local statistics, partials and weight gradient of one
//!   vocabulary shard (Yeung et al., arXiv:2411.05288, Algorithm 2), and the
//!   host side of `alg2` over a [`packshard_reference::vocab::ShardMap`]
//!   (every loss option: label smoothing, z-loss, every reduction).
//! - [`emu`]: the same kernel sources built by the host C++ compiler and run
//!   on the CPU ([`emu::Emulator`]), so the kernels' logic is checked on
//!   machines without a GPU.
//! - [`ops`]: the attention kernels behind [`packshard_reference::ops::AttentionOp`]
//!   and the vocabulary kernels behind
//!   [`packshard_reference::ops::LinearCrossEntropyOp`] (`alg2` only), each
//!   one adapter over either backend (the GPU or the emulator); the
//!   registry of `packshard-oracle` lists both backends of both.
//!
//! Both backends run the same launches: the host code computes each
//! [`Launch`] (entry point, grid, threads, shared memory) once
//! ([`attention::Plan`], [`vocab`]'s launch functions) and checks inputs once.

pub mod attention;
pub mod emu;
pub mod ops;
pub mod vocab;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileError, CompileOptions, Ptx};

/// A kernel source: one CUDA C translation unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelSource {
    /// Short name (`attention`, `vocab`).
    pub name: &'static str,
    /// One line on what it computes.
    pub summary: &'static str,
    /// The CUDA C text.
    pub source: &'static str,
    /// Its `extern "C" __global__` functions.
    pub entry_points: &'static [&'static str],
}

/// Varlen attention forward and backward.
pub const ATTENTION: KernelSource = KernelSource {
    name: "attention",
    summary: "varlen attention fwd/bwd, f32: thread per query (per key for dK/dV), \
              online softmax over 32-key shared-memory tiles, saves lse, no mask tensor",
    source: include_str!("attention.cu"),
    entry_points: &["attn_fwd", "attn_bwd_delta", "attn_bwd_dq", "attn_bwd_dkv"],
};

/// Fused linear cross-entropy of one vocabulary shard.
pub const VOCAB: KernelSource = KernelSource {
    name: "vocab",
    summary:
        "fused linear cross-entropy of one vocab shard, f32: alg2 local max / s - 1 / gap / \
              target logit, input-gradient partials D_i and B_i, weight gradient; logits recomputed",
    source: include_str!("vocab.cu"),
    entry_points: &["lce_stats", "lce_dx", "lce_dw"],
};

/// Every kernel source, for the compile check and for [`Gpu::new`].
pub const KERNELS: &[KernelSource] = &[ATTENTION, VOCAB];

/// The virtual architecture of the CI compile check: H100 / H200 (sm_90).
pub const CI_ARCH: &str = "compute_90";

/// The largest head dim the attention kernels take (a per-thread register
/// array of the CUDA source, `MAX_D`).
pub const MAX_HEAD_DIM: usize = 128;

/// One kernel launch: what the GPU ([`Gpu`]) and the emulator
/// ([`emu::Emulator`]) both run, computed once by the host code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Launch {
    /// The `extern "C" __global__` function.
    pub entry: &'static str,
    /// Blocks `(x, y, z)`.
    pub grid: (u32, u32, u32),
    /// Threads per block (`x` only).
    pub block: u32,
    /// Bytes of dynamic shared memory.
    pub shared_bytes: u32,
}

impl Launch {
    fn config(&self) -> cudarc::driver::LaunchConfig {
        cudarc::driver::LaunchConfig {
            grid_dim: self.grid,
            block_dim: (self.block, 1, 1),
            shared_mem_bytes: self.shared_bytes,
        }
    }
}

/// Errors of the GPU path. Input errors are the reference's
/// ([`packshard_reference::Error`], naming the field and the index).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CudaError {
    /// `libnvrtc` could not be loaded.
    #[error(
        "no NVRTC library: libnvrtc.so(.12) is not on the loader path; run scripts/fetch_nvrtc.sh \
         and set LD_LIBRARY_PATH or PACKSHARD_NVRTC_DIR"
    )]
    NoNvrtc,
    /// No driver (`libcuda`) or no device.
    #[error("no CUDA device: {reason}")]
    NoDevice {
        /// What was missing.
        reason: String,
    },
    /// NVRTC rejected a kernel source.
    #[error("NVRTC could not compile kernel {kernel} for {arch}: {log}")]
    Compile {
        /// [`KernelSource::name`].
        kernel: String,
        /// The `--gpu-architecture`.
        arch: String,
        /// NVRTC's log (or the error when there is none).
        log: String,
    },
    /// No C++ compiler to build the emulator ([`emu::Emulator`]).
    #[error("no C++ compiler for the CUDA emulator: {reason}")]
    NoCompiler {
        /// What was missing.
        reason: String,
    },
    /// The C++ compiler is there but rejected the emulator or the kernels,
    /// or the emulator refused a launch.
    #[error("CUDA emulator: {message}")]
    Emulator {
        /// The compiler's output or the launch's error.
        message: String,
    },
    /// A CUDA driver call failed.
    #[error("CUDA driver error in {call}: {message}")]
    Driver {
        /// The operation (`alloc q`, `launch attn_fwd`, ...).
        call: String,
        /// The driver's error.
        message: String,
    },
    /// Bad input, as the reference reports it.
    #[error(transparent)]
    Input(#[from] packshard_reference::Error),
}

/// Result alias of this module.
pub type Result<T, E = CudaError> = std::result::Result<T, E>;

impl CudaError {
    /// Whether the error only says that no GPU stack (or, for the
    /// emulator, no C++ compiler) is here: a test skips.
    pub fn is_unavailable(&self) -> bool {
        matches!(
            self,
            CudaError::NoNvrtc | CudaError::NoDevice { .. } | CudaError::NoCompiler { .. }
        )
    }
}

pub(crate) fn driver<T, E: std::fmt::Debug>(call: &str, r: std::result::Result<T, E>) -> Result<T> {
    r.map_err(|e| CudaError::Driver {
        call: call.to_string(),
        message: format!("{e:?}"),
    })
}

/// Whether `libnvrtc` can be loaded (cudarc's `is_culib_present`).
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries `dlopen` on cudarc's candidate names.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Whether the driver library `libcuda` can be loaded.
pub fn driver_present() -> bool {
    // SAFETY: only tries `dlopen` on cudarc's candidate names.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Loads `libnvrtc-builtins.so.*` and `libnvrtc.so.12` from `dir` (the
/// `nvidia/cuda_nvrtc/lib` folder of the PyPI wheel `nvidia-cuda-nvrtc-cu12`)
/// by full path and keeps them loaded, so that cudarc's later `dlopen` by
/// name finds them without `LD_LIBRARY_PATH`. Returns whether `libnvrtc`
/// was found there; a folder without it is not an error.
///
/// # Errors
/// [`CudaError::NoNvrtc`] when the file exists but cannot be loaded.
pub fn preload_nvrtc(dir: &Path) -> Result<bool> {
    let lib = dir.join("libnvrtc.so.12");
    if !lib.exists() {
        return Ok(false);
    }
    let mut names: Vec<_> = std::fs::read_dir(dir)
        .map(|rd| rd.filter_map(|e| e.ok()).map(|e| e.path()).collect())
        .unwrap_or_default();
    names.sort();
    // Builtins first: libnvrtc opens them by name at compile time.
    for p in names.iter().filter(|p| {
        p.file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("libnvrtc-builtins.so"))
    }) {
        // SAFETY: NVIDIA's library; its initialisers have no preconditions.
        if let Ok(l) = unsafe { libloading::Library::new(p) } {
            std::mem::forget(l);
        }
    }
    // SAFETY: as above.
    let l = unsafe { libloading::Library::new(&lib) }.map_err(|_| CudaError::NoNvrtc)?;
    std::mem::forget(l);
    Ok(true)
}

/// The NVRTC folder: `PACKSHARD_NVRTC_DIR`, else the one
/// `scripts/fetch_nvrtc.sh` fills in this repository (`.cache/nvrtc/...`).
pub fn nvrtc_dir() -> PathBuf {
    match std::env::var_os("PACKSHARD_NVRTC_DIR") {
        Some(d) if !d.is_empty() => PathBuf::from(d),
        _ => {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.cache/nvrtc/nvidia/cuda_nvrtc/lib")
        }
    }
}

/// Makes NVRTC loadable, preloading it from [`nvrtc_dir`] when it is not on
/// the loader path already; whether it is.
pub fn nvrtc_ready() -> bool {
    if nvrtc_present() {
        return true;
    }
    matches!(preload_nvrtc(&nvrtc_dir()), Ok(true)) && nvrtc_present()
}

/// Compiles `kernel` to PTX for `arch` (e.g. [`CI_ARCH`]) with NVRTC.
///
/// # Errors
/// [`CudaError::NoNvrtc`] when NVRTC is absent, [`CudaError::Compile`] with
/// NVRTC's log when the source does not compile.
pub fn compile(kernel: &KernelSource, arch: &'static str) -> Result<Ptx> {
    if !nvrtc_present() {
        return Err(CudaError::NoNvrtc);
    }
    let opts = CompileOptions {
        arch: Some(arch),
        // IEEE division and square root, no flush-to-zero: the kernels are
        // checked against an f64 reference.
        ftz: Some(false),
        prec_div: Some(true),
        prec_sqrt: Some(true),
        name: Some(format!("{}.cu", kernel.name)),
        options: vec!["--std=c++17".into()],
        ..Default::default()
    };
    compile_ptx_with_opts(kernel.source, opts).map_err(|e| CudaError::Compile {
        kernel: kernel.name.to_string(),
        arch: arch.to_string(),
        log: match e {
            CompileError::CompileError { log, .. } => log.to_string_lossy().into_owned(),
            other => format!("{other:?}"),
        },
    })
}

/// The PTX text of a compiled kernel (for checks on the entry points).
pub fn ptx_text(ptx: &Ptx) -> String {
    ptx.to_src()
}

/// NVRTC's version `(major, minor)`.
///
/// # Errors
/// [`CudaError::NoNvrtc`].
pub fn nvrtc_version() -> Result<(i32, i32)> {
    if !nvrtc_present() {
        return Err(CudaError::NoNvrtc);
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two out-pointers to live locals.
    let r = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    driver("nvrtcVersion", r.result())?;
    Ok((major, minor))
}

/// One device with every kernel compiled for it and loaded.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    modules: Vec<(&'static str, Arc<CudaModule>)>,
    name: String,
    arch: &'static str,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu")
            .field("name", &self.name)
            .field("arch", &self.arch)
            .finish()
    }
}

impl Gpu {
    /// Opens device `ordinal`, compiles [`KERNELS`] for its compute
    /// capability and loads them.
    ///
    /// # Errors
    /// [`CudaError::NoNvrtc`], [`CudaError::NoDevice`] (no `libcuda`, driver
    /// init failed, no device, or `ordinal` out of range), then compile and
    /// driver errors.
    pub fn new(ordinal: usize) -> Result<Gpu> {
        if !nvrtc_present() {
            return Err(CudaError::NoNvrtc);
        }
        if !driver_present() {
            return Err(CudaError::NoDevice {
                reason: "libcuda.so (the NVIDIA driver) is not on the loader path".into(),
            });
        }
        // cudarc panics when a driver symbol is missing (a driver older than
        // the bindings): report that as "no usable device" too.
        let count = std::panic::catch_unwind(CudaContext::device_count).map_err(|_| {
            CudaError::NoDevice {
                reason: "the driver library lacks a symbol cudarc needs (driver too old?)".into(),
            }
        })?;
        let count = count.map_err(|e| CudaError::NoDevice {
            reason: format!("cuInit / cuDeviceGetCount failed: {e:?}"),
        })?;
        if count <= 0 || ordinal >= count as usize {
            return Err(CudaError::NoDevice {
                reason: format!("device {ordinal} asked for, {count} present"),
            });
        }
        // As above: a missing symbol is cudarc's panic; make it an error.
        let ctx = std::panic::catch_unwind(|| CudaContext::new(ordinal)).map_err(|_| {
            CudaError::NoDevice {
                reason: "creating the context hit a symbol the driver lacks (driver too old?)"
                    .into(),
            }
        })?;
        let ctx = driver("cuCtx (primary context)", ctx)?;
        let (major, minor) = driver("compute capability", ctx.compute_capability())?;
        let name = ctx.name().unwrap_or_else(|_| "unknown".into());
        // NVRTC takes the virtual architecture as a static string; leaking
        // one short string per opened device is harmless.
        let arch: &'static str = Box::leak(format!("compute_{major}{minor}").into_boxed_str());
        let mut modules = Vec::new();
        for k in KERNELS {
            let ptx = compile(k, arch)?;
            let m = driver(&format!("load module {}", k.name), ctx.load_module(ptx))?;
            modules.push((k.name, m));
        }
        let stream = ctx.default_stream();
        Ok(Gpu {
            ctx,
            stream,
            modules,
            name,
            arch,
        })
    }

    /// The device's name, e.g. `NVIDIA H200`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The architecture the kernels were compiled for, e.g. `compute_90`.
    pub fn arch(&self) -> &str {
        self.arch
    }

    /// The stream every launch goes to.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    pub(crate) fn function(&self, module: &str, entry: &str) -> Result<CudaFunction> {
        let m = self
            .modules
            .iter()
            .find(|(n, _)| *n == module)
            .map(|(_, m)| m)
            .ok_or_else(|| CudaError::Driver {
                call: format!("module {module}"),
                message: "not loaded".into(),
            })?;
        driver(&format!("load function {entry}"), m.load_function(entry))
    }
}

/// The first non-finite value of an f32 input as the reference's error.
pub(crate) fn check_finite32(field: &str, x: &[f32]) -> Result<()> {
    if let Some((index, &value)) = x.iter().enumerate().find(|(_, v)| !v.is_finite()) {
        return Err(packshard_reference::Error::NonFiniteInput {
            field: field.into(),
            index,
            value: value as f64,
        }
        .into());
    }
    Ok(())
}

/// Checks that `x.len()` is the product of `shape`.
pub(crate) fn check_len<T>(field: &str, x: &[T], shape: &[usize], legend: &str) -> Result<()> {
    let want = shape.iter().try_fold(1usize, |a, &s| a.checked_mul(s));
    if want != Some(x.len()) {
        return Err(packshard_reference::Error::ShapeMismatch {
            field: field.into(),
            expected: format!("{legend} = {shape:?} ({want:?} values)"),
            actual: vec![x.len()],
        }
        .into());
    }
    Ok(())
}

/// Checks that a size fits the kernels' `int` arguments.
pub(crate) fn to_i32(field: &str, x: usize) -> Result<i32> {
    i32::try_from(x).map_err(|_| {
        packshard_reference::Error::invalid(field, format!("{x} does not fit the kernels' i32"))
            .into()
    })
}
