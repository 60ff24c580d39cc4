//! The CUDA kernels on the CPU: `emu_shim.cpp` (a thread per CUDA thread, a
//! barrier for `__syncthreads`, one shared-memory buffer per block) with
//! `attention.cu` and `vocab.cu` included unchanged, built by the host C++
//! compiler (`$CXX`, else `g++`) into a shared library at first use and
//! called with cuLaunchKernel's argument layout.
//!
//! [`Emulator`] runs the same [`Launch`]es as [`super::Gpu`] (the host code's
//! [`Plan`] and [`ShardInput`] launch functions) after the same input
//! checks, so the kernels' logic, indexing and launch geometry are checked on
//! machines without a GPU. It does not model warps, concurrent blocks or the
//! GPU's `expf`/`logf` (glibc's are used); it is slow (2 cores: seconds for
//! a few thousand tokens).
//!
//! The library is cached in the temporary directory under a hash of the
//! sources and the compiler's name, so a process builds it at most once.

use std::ffi::{c_char, c_int, c_uint, c_void, CString};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, OnceLock};

use super::attention::{AttentionKernels, AttnForward, AttnGrads, BackwardCall, Call, Form, Plan};
use super::vocab::{RowInputs, ShardInput, ShardKernels, ShardStats};
use super::{CudaError, Launch, Result};

/// The shim: the CUDA execution model in C++.
const SHIM: &str = include_str!("emu_shim.cpp");

/// The files the shim is built from, as `(name, text)`.
const SOURCES: [(&str, &str); 3] = [
    ("emu_shim.cpp", SHIM),
    ("attention.cu", super::ATTENTION.source),
    ("vocab.cu", super::VOCAB.source),
];

/// One kernel argument as cuLaunchKernel takes it: a pointer to the value.
enum Arg {
    P(*const c_void),
    I(i32),
    F(f32),
}

fn p<T>(x: &[T]) -> Arg {
    Arg::P(x.as_ptr() as *const c_void)
}

fn pm<T>(x: &mut [T]) -> Arg {
    Arg::P(x.as_mut_ptr() as *const c_void)
}

fn null() -> Arg {
    Arg::P(std::ptr::null())
}

type LaunchFn = unsafe extern "C" fn(
    *const c_char,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    *mut *mut c_void,
) -> c_int;

/// The kernels built for the CPU (see the module docs).
pub struct Emulator {
    _lib: libloading::Library,
    launch: LaunchFn,
    path: PathBuf,
}

impl std::fmt::Debug for Emulator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Emulator")
            .field("library", &self.path)
            .finish()
    }
}

// SAFETY: the library's only entry point takes everything by argument and
// keeps its state in globals; launches are serialised by `LOCK`.
unsafe impl Sync for Emulator {}
// SAFETY: as above.
unsafe impl Send for Emulator {}

/// One launch at a time: the shim's grid state and shared memory are global.
static LOCK: Mutex<()> = Mutex::new(());

/// The C++ compiler: `$CXX`, else `g++`.
fn compiler() -> String {
    std::env::var("CXX")
        .ok()
        .filter(|c| !c.is_empty())
        .unwrap_or_else(|| "g++".into())
}

/// FNV-1a over the sources and the compiler: the cache folder's name.
fn fingerprint(cxx: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for (name, text) in SOURCES {
        for b in name.bytes().chain(text.bytes()).chain(cxx.bytes()) {
            h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

impl Emulator {
    /// The emulator, built and loaded once per process.
    ///
    /// # Errors
    /// [`CudaError::NoCompiler`] when the C++ compiler cannot be run,
    /// [`CudaError::Emulator`] when it rejects the sources (its output) or
    /// the library cannot be loaded.
    pub fn get() -> Result<&'static Emulator> {
        static EMU: OnceLock<Result<Emulator>> = OnceLock::new();
        EMU.get_or_init(Emulator::build)
            .as_ref()
            .map_err(Clone::clone)
    }

    /// The shared library it runs.
    pub fn library(&self) -> &Path {
        &self.path
    }

    fn build() -> Result<Emulator> {
        let cxx = compiler();
        let dir =
            std::env::temp_dir().join(format!("packshard-cuda-emu-{:016x}", fingerprint(&cxx)));
        let lib = dir.join("libpackshard_cuda_emu.so");
        let failed = |what: &str, e: std::io::Error| CudaError::Emulator {
            message: format!("{what} {}: {e}", dir.display()),
        };
        if !lib.exists() {
            // Sources and library under names of this process, the library
            // renamed at the end: processes building at once never read
            // each other's half-written files.
            let src = dir.join(format!("src-{}", std::process::id()));
            std::fs::create_dir_all(&src).map_err(|e| failed("creating", e))?;
            for (name, text) in SOURCES {
                std::fs::write(src.join(name), text).map_err(|e| failed("writing into", e))?;
            }
            let tmp = src.join("libpackshard_cuda_emu.so");
            let out = Command::new(&cxx)
                .args(["-std=c++20", "-O2", "-shared", "-fPIC", "-pthread", "-I"])
                .arg(&src)
                .arg(src.join("emu_shim.cpp"))
                .arg("-o")
                .arg(&tmp)
                .output()
                .map_err(|e| CudaError::NoCompiler {
                    reason: format!("{cxx} cannot be run: {e}"),
                });
            let out = out.inspect_err(|_| {
                let _ = std::fs::remove_dir_all(&src);
            })?;
            if !out.status.success() {
                let _ = std::fs::remove_dir_all(&src);
                return Err(CudaError::Emulator {
                    message: format!(
                        "{cxx} failed on the kernel sources ({}):\n{}",
                        out.status,
                        String::from_utf8_lossy(&out.stderr)
                    ),
                });
            }
            std::fs::rename(&tmp, &lib).map_err(|e| failed("renaming in", e))?;
            let _ = std::fs::remove_dir_all(&src);
        }
        let err = |e: libloading::Error| CudaError::Emulator {
            message: format!("loading {}: {e}", lib.display()),
        };
        // SAFETY: our own library, built from the sources above; its
        // initialisers only set up the shim's globals.
        let library = unsafe { libloading::Library::new(&lib) }.map_err(err)?;
        // SAFETY: the signature of `emu_launch` in emu_shim.cpp.
        let launch = unsafe { *library.get::<LaunchFn>(b"emu_launch\0").map_err(err)? };
        Ok(Emulator {
            _lib: library,
            launch,
            path: lib,
        })
    }

    /// Runs `l` with `args` in the kernel's parameter order.
    ///
    /// # Safety
    /// `args` must match the parameter list of `l.entry`, and every pointer
    /// must be to a live buffer of the size the kernel indexes.
    unsafe fn run(&self, l: &Launch, args: &mut [Arg]) -> Result<()> {
        let mut ptrs: Vec<*mut c_void> = args
            .iter_mut()
            .map(|a| match a {
                Arg::P(p) => p as *mut *const c_void as *mut c_void,
                Arg::I(i) => i as *mut i32 as *mut c_void,
                Arg::F(f) => f as *mut f32 as *mut c_void,
            })
            .collect();
        let name = CString::new(l.entry).expect("entry names have no NUL");
        let _guard = LOCK.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: the caller's contract; `ptrs` outlives the call.
        let rc = unsafe {
            (self.launch)(
                name.as_ptr(),
                l.grid.0,
                l.grid.1,
                l.grid.2,
                l.block,
                l.shared_bytes,
                ptrs.as_mut_ptr(),
            )
        };
        match rc {
            0 => Ok(()),
            1 => Err(CudaError::Emulator {
                message: format!("no kernel {} in the shim", l.entry),
            }),
            2 => Err(CudaError::Emulator {
                message: format!(
                    "{}: {} bytes of shared memory, more than the shim has",
                    l.entry, l.shared_bytes
                ),
            }),
            rc => Err(CudaError::Emulator {
                message: format!("{}: emu_launch returned {rc}", l.entry),
            }),
        }
    }
}

/// `cu_seqlens` or `allowed` as the kernels read them (the other empty).
fn host_form(form: Form<'_>) -> (Vec<i64>, Vec<u8>) {
    match form {
        Form::Packed(cu) => (cu.iter().map(|&c| c as i64).collect(), vec![]),
        Form::Masked(a) => (vec![], a.iter().map(|&x| x as u8).collect()),
    }
}

/// `q, k, v, cu_seqlens, allowed, row_len, n_tok, h, d, scale`: the
/// parameters every tiled attention kernel starts with.
fn tiled_args(c: &Call<'_>, cu: &[i64], allowed: &[u8]) -> Vec<Arg> {
    let mut args = vec![p(c.q), p(c.k), p(c.v)];
    args.extend(match c.form {
        Form::Packed(_) => [p(cu), null()],
        Form::Masked(_) => [null(), p(allowed)],
    });
    let (n, h, d) = (c.shape.n_tok as i32, c.shape.h as i32, c.shape.d as i32);
    args.extend([Arg::I(n), Arg::I(n), Arg::I(h), Arg::I(d), Arg::F(c.scale)]);
    args
}

impl AttentionKernels for Emulator {
    fn attention_forward(&self, c: &Call<'_>) -> Result<AttnForward> {
        let plan = Plan::forward_call(c)?;
        let mut output = vec![0.0f32; c.shape.values()];
        // Rows of empty segments are never visited: their lse stays -inf.
        let mut lse = vec![f32::NEG_INFINITY; c.shape.h * c.shape.n_tok];
        if !plan.is_empty() {
            let (cu, allowed) = host_form(c.form);
            let mut args = tiled_args(c, &cu, &allowed);
            args.extend([pm(&mut output), pm(&mut lse)]);
            // SAFETY: the parameter list of `attn_fwd`; sizes checked by `Plan`.
            unsafe { self.run(&plan.forward(), &mut args)? };
        }
        Ok(AttnForward { output, lse })
    }

    fn attention_backward(&self, b: &BackwardCall<'_>) -> Result<AttnGrads> {
        let plan = Plan::backward_call(b)?;
        let (c, fwd, grad_output) = (&b.call, b.fwd, b.grad_output);
        let zeros = || vec![0.0f32; c.shape.values()];
        let mut g = AttnGrads {
            grad_q: zeros(),
            grad_k: zeros(),
            grad_v: zeros(),
        };
        if plan.is_empty() {
            return Ok(g);
        }
        let mut delta = vec![0.0f32; c.shape.h * c.shape.n_tok];
        let (n, h, d) = (c.shape.n_tok as i32, c.shape.h as i32, c.shape.d as i32);
        let mut args = vec![
            p(&fwd.output),
            p(grad_output),
            Arg::I(n),
            Arg::I(h),
            Arg::I(d),
        ];
        args.push(pm(&mut delta));
        // SAFETY: the parameter list of `attn_bwd_delta`.
        unsafe { self.run(&plan.delta(), &mut args)? };

        let (cu, allowed) = host_form(c.form);
        let saved = [p(&fwd.lse), p(&delta), p(grad_output)];
        let mut args = tiled_args(c, &cu, &allowed);
        args.extend(saved);
        args.push(pm(&mut g.grad_q));
        // SAFETY: the parameter list of `attn_bwd_dq`.
        unsafe { self.run(&plan.dq(), &mut args)? };
        let saved = [p(&fwd.lse), p(&delta), p(grad_output)];
        let mut args = tiled_args(c, &cu, &allowed);
        args.extend(saved);
        args.extend([pm(&mut g.grad_k), pm(&mut g.grad_v)]);
        // SAFETY: the parameter list of `attn_bwd_dkv`.
        unsafe { self.run(&plan.dkv(), &mut args)? };
        Ok(g)
    }
}

/// `hidden, weight, target` and, with `rows`, the [`RowInputs`]; then `n, hd, w`.
fn shard_args(x: &ShardInput<'_>, rows: Option<&RowInputs<'_>>) -> Vec<Arg> {
    let mut args = vec![p(x.hidden), p(x.weight), p(x.target)];
    if let Some(rows) = rows {
        args.extend(rows.all().map(p));
    }
    let (n, hd, w) = x.dims32();
    args.extend([Arg::I(n), Arg::I(hd), Arg::I(w)]);
    args
}

impl ShardKernels for Emulator {
    fn stats(&self, x: &ShardInput<'_>) -> Result<ShardStats> {
        let mut st = ShardStats::empty(x.n);
        if let Some(l) = x.stats_launch()? {
            let mut args = shard_args(x, None);
            args.extend([
                pm(&mut st.local_max),
                pm(&mut st.local_rest),
                pm(&mut st.local_gap),
                pm(&mut st.target_logit),
            ]);
            // SAFETY: the parameter list of `lce_stats`; sizes checked.
            unsafe { self.run(&l, &mut args)? };
        }
        Ok(st)
    }

    fn input_partials(
        &self,
        x: &ShardInput<'_>,
        rows: &RowInputs<'_>,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let mut d = vec![0.0f32; x.n * x.hd];
        let mut b = vec![0.0f32; x.n * x.hd];
        if let Some(l) = x.partials_launch(rows)? {
            let mut args = shard_args(x, Some(rows));
            args.extend([pm(&mut d), pm(&mut b)]);
            // SAFETY: the parameter list of `lce_dx`; sizes checked.
            unsafe { self.run(&l, &mut args)? };
        }
        Ok((d, b))
    }

    fn weight_grad(&self, x: &ShardInput<'_>, rows: &RowInputs<'_>) -> Result<Vec<f32>> {
        let mut g = vec![0.0f32; x.w * x.hd];
        if let Some(l) = x.weight_grad_launch(rows)? {
            let mut args = shard_args(x, Some(rows));
            args.push(pm(&mut g));
            // SAFETY: the parameter list of `lce_dw`; sizes checked.
            unsafe { self.run(&l, &mut args)? };
        }
        Ok(g)
    }
}
