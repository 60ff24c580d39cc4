//! The CUDA kernels as ops: the attention kernels as an [`AttentionOp`],
//! one adapter, [`CudaAttention`], over either backend of
//! [`AttentionKernels`] — the GPU ([`Gpu`], device 0) or the CPU emulator of
//! the same source ([`Emulator`]); `packshard-oracle`'s registry lists both
//! (`attention_varlen_cuda`, `attention_varlen_cuda_emulated`). The
//! vocabulary kernels likewise as a [`LinearCrossEntropyOp`],
//! [`CudaLinearCrossEntropy`] (see its docs).
//!
//! The attention adapter implements only the math, [`AttentionMath`], like
//! every attention kernel, and `attention_op!` gives it the boundary written
//! once (`crate::ops::boundary::attention`): the reference's checks in the
//! reference's order (so bad input gets the reference's error), the refusal
//! of what its declared support does not cover, `q, k, v` (and the saved
//! forward, `grad_output`) rounded to f32 on entry refusing finite values
//! beyond its range, results widened to f64 on exit. The kernels run
//! bidirectional self-attention with `h_kv == h` and `d <= 128`, the masked
//! form on square `[L, L]` masks: causal masks, grouped-query and cross
//! attention, flash-attention's options and larger heads are declared
//! unsupported ([`AttentionOp::support`], [`KernelSupport`]) and refused
//! naming the field. The loss adapter goes through the loss boundary the
//! same way (f32 options of `check_call_f32`; see its docs).

use std::borrow::Cow;
use std::sync::OnceLock;

use ndarray::{Array2, Array3, ArrayView2};
#[cfg(doc)]
use packshard_reference::ops::{AttentionOp, LinearCrossEntropyOp, LossOp};
use packshard_reference::ops::{AttentionSupport, LinearLoss, LossSupport};
use packshard_reference::vocab::cross_entropy::CrossEntropy;
use packshard_reference::vocab::sharded::{check_inputs, ShardedLoss};
use packshard_reference::vocab::{LossCall, ShardLayout, ShardMap, ShardPlan, ShardedAlgorithm};
use packshard_reference::{Error, Result};

use super::attention::{AttentionKernels, AttnForward, AttnShape, BackwardCall, Call, Form};
use super::emu::Emulator;
use super::vocab::{self, ShardKernels};
use super::MAX_HEAD_DIM;
use super::{CudaError, Gpu};
use crate::attention::{AttentionGrads32, AttentionOutput32};
use crate::ops::boundary::{
    AttentionMath, Inputs, KernelSupport, LinearCrossEntropyMath, LossKernelSupport, Problem32,
};
use crate::vocab::{check_linear, check_linear_inputs};

/// The CUDA attention kernels on backend `B` (see the module docs).
pub struct CudaAttention<B: AttentionKernels + 'static> {
    kernels: &'static B,
}

impl<B: AttentionKernels + std::fmt::Debug + 'static> std::fmt::Debug for CudaAttention<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("CudaAttention").field(self.kernels).finish()
    }
}

impl CudaAttention<Gpu> {
    /// On device 0 (opened, and the kernels compiled by NVRTC, once per
    /// process; NVRTC preloaded from [`super::nvrtc_dir`] if need be).
    ///
    /// # Errors
    /// [`CudaError::NoNvrtc`] / [`CudaError::NoDevice`] where there is no
    /// GPU stack ([`CudaError::is_unavailable`]), else compile or driver errors.
    pub fn gpu() -> std::result::Result<Self, CudaError> {
        Ok(CudaAttention {
            kernels: shared_gpu()?,
        })
    }
}

impl CudaAttention<Emulator> {
    /// On the CPU emulator (built once per process, [`Emulator::get`]).
    ///
    /// # Errors
    /// [`CudaError::NoCompiler`] where no C++ compiler can be run
    /// ([`CudaError::is_unavailable`]), [`CudaError::Emulator`] when it
    /// rejects the sources.
    pub fn emulated() -> std::result::Result<Self, CudaError> {
        Ok(CudaAttention {
            kernels: Emulator::get()?,
        })
    }
}

/// Device 0, opened (and every kernel compiled by NVRTC) once per process
/// for every op of this module; NVRTC preloaded from [`super::nvrtc_dir`]
/// if need be.
fn shared_gpu() -> std::result::Result<&'static Gpu, CudaError> {
    static GPU: OnceLock<std::result::Result<Gpu, CudaError>> = OnceLock::new();
    GPU.get_or_init(|| {
        super::nvrtc_ready();
        Gpu::new(0)
    })
    .as_ref()
    .map_err(Clone::clone)
}

/// A backend error as the reference's: input errors as they are, the
/// backend's own (driver, emulator) as `InvalidArgument` on `device`.
pub(crate) fn reference_error(e: CudaError) -> Error {
    match e {
        CudaError::Input(e) => e,
        other => Error::invalid("device", other.to_string()),
    }
}

/// `x`'s values in logical (row-major) order: borrowed where `x` is in
/// standard layout, copied where not.
fn flat<D: ndarray::Dimension>(x: &ndarray::Array<f32, D>) -> Cow<'_, [f32]> {
    x.as_slice()
        .map_or_else(|| Cow::Owned(x.iter().copied().collect()), Cow::Borrowed)
}

/// `q`'s `[n_tok, h, d]`.
fn shape(x: &Inputs) -> AttnShape {
    let (n_tok, h, d) = x.q_dim();
    AttnShape { n_tok, h, d }
}

/// `x: [n_tok, h, d]` row-major as an array.
fn shape3(x: Vec<f32>, s: AttnShape) -> Array3<f32> {
    Array3::from_shape_vec((s.n_tok, s.h, s.d), x).expect("[n_tok, h, d]")
}

/// The kernels' [`Call`] of checked f32 inputs `x` (self-attention: all of
/// `q`'s shape) and the problem `p`, handed to `f`.
fn with_call<R>(x: &Inputs, p: Problem32<'_>, f: impl FnOnce(Call<'_>) -> R) -> R {
    let [q, k, v] = x.f32();
    let allowed: Vec<bool>;
    let form = match p {
        Problem32::Varlen(pv) => Form::Packed(pv.cu_seqlens_q),
        Problem32::Masked(m) => {
            allowed = m.allowed.iter().copied().collect();
            Form::Masked(&allowed)
        }
    };
    let (q, k, v) = (flat(q), flat(k), flat(v));
    f(Call {
        q: &q,
        k: &k,
        v: &v,
        shape: shape(x),
        form,
        scale: p.scale() as f32,
    })
}

crate::attention_op!(impl[B: AttentionKernels + 'static] CudaAttention<B>);

/// The math behind the attention boundary (`crate::ops::boundary::attention`:
/// the reference's checks, the support's refusals and the rounding come
/// before it): one launch of the backend's kernels on the f32 inputs.
impl<B: AttentionKernels + 'static> AttentionMath for CudaAttention<B> {
    /// Bidirectional self-attention with `h_kv == h` and `d <=`
    /// [`MAX_HEAD_DIM`], f32 inputs; the masked form takes one padded row,
    /// square `[L, L]` masks; the varlen form scores only within segments.
    fn support(&self) -> KernelSupport {
        KernelSupport {
            masked_cross: false,
            ..KernelSupport::f32(AttentionSupport::BIDIRECTIONAL.with_max_head_dim(MAX_HEAD_DIM))
        }
    }

    fn forward(&self, x: &Inputs, p: Problem32<'_>) -> Result<AttentionOutput32> {
        let f = with_call(x, p, |c| self.kernels.attention_forward(&c)).map_err(reference_error)?;
        let s @ AttnShape { n_tok, h, .. } = shape(x);
        Ok(AttentionOutput32 {
            output: shape3(f.output, s),
            lse: Array2::from_shape_vec((h, n_tok), f.lse).expect("[h, n_tok]"),
        })
    }

    fn backward(
        &self,
        x: &Inputs,
        p: Problem32<'_>,
        fwd: &AttentionOutput32,
        grad_output: &Array3<f32>,
    ) -> Result<AttentionGrads32> {
        let fwd32 = AttnForward {
            output: flat(&fwd.output).into_owned(),
            lse: flat(&fwd.lse).into_owned(),
        };
        let go = flat(grad_output);
        let g = with_call(x, p, |call| {
            self.kernels.attention_backward(&BackwardCall {
                call,
                fwd: &fwd32,
                grad_output: &go,
            })
        })
        .map_err(reference_error)?;
        let s = shape(x);
        Ok(AttentionGrads32 {
            grad_q: shape3(g.grad_q, s),
            grad_k: shape3(g.grad_k, s),
            grad_v: shape3(g.grad_v, s),
        })
    }
}

// ---- the output layer ----------------------------------------------------------

/// The CUDA vocabulary-shard kernels as a [`LinearCrossEntropyOp`]: `alg2`
/// (Yeung et al., arXiv:2411.05288, Algorithm 2) over either backend of
/// [`ShardKernels`] — the GPU ([`Gpu`], device 0) or the CPU emulator
/// ([`Emulator`]); the unsharded form is `alg2` over one shard.
/// `packshard-oracle`'s registry lists both (`linear_cross_entropy_cuda`,
/// `linear_cross_entropy_cuda_emulated`).
///
/// Every [`LossConfig`](packshard_reference::vocab::LossConfig) option but
/// the softcap (`ignore_index`, label smoothing in either convention,
/// z-loss, every reduction; the softcap is declared unsupported,
/// [`LossOp::options`], and refused
/// with an error naming `softcap`); `naive` and `alg1` are declared
/// unsupported ([`LossOp::algorithms`]) and refused, as is a
/// hidden size whose row does not fit the kernels' 48 KiB of shared memory.
/// At the boundary of every f32 loss kernel (`crate::ops::boundary::losses`,
/// in its order: the undeclared refused, the f32 options, inputs rounded to
/// f32 with finite values beyond its range refused), then the reference's
/// checks and errors; `dL/dlogits` is never materialized (`None`).
pub struct CudaLinearCrossEntropy<B: ShardKernels + 'static> {
    kernels: &'static B,
}

impl<B: ShardKernels + std::fmt::Debug + 'static> std::fmt::Debug for CudaLinearCrossEntropy<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("CudaLinearCrossEntropy")
            .field(self.kernels)
            .finish()
    }
}

impl<B: ShardKernels + 'static> CudaLinearCrossEntropy<B> {
    /// Over any implementation of the shard kernels (the tests' CPU stand-in).
    pub fn new(kernels: &'static B) -> Self {
        CudaLinearCrossEntropy { kernels }
    }
}

impl CudaLinearCrossEntropy<Gpu> {
    /// On device 0 (shared with [`CudaAttention::gpu`]).
    ///
    /// # Errors
    /// As [`CudaAttention::gpu`].
    pub fn gpu() -> std::result::Result<Self, CudaError> {
        Ok(Self::new(shared_gpu()?))
    }
}

impl CudaLinearCrossEntropy<Emulator> {
    /// On the CPU emulator.
    ///
    /// # Errors
    /// As [`CudaAttention::emulated`].
    pub fn emulated() -> std::result::Result<Self, CudaError> {
        Ok(Self::new(Emulator::get()?))
    }
}

/// `alg2` only; every loss option but the softcap. No logit soft-capping
/// (the kernels of `vocab.cu` do not cap): refused. An upstream gradient is
/// a per-row scale of the gradient kernels (`row_scale`, from
/// [`packshard_reference::vocab::LossCall::token_weights`]): taken.
const CUDA_LOSS_SUPPORT: LossKernelSupport = LossKernelSupport {
    algorithms: &[ShardedAlgorithm::Alg2],
    options: LossSupport {
        softcap: false,
        grad_output: true,
    },
};

/// The math behind the loss boundary (`crate::ops::boundary::losses`: the
/// refusals, the f32 option checks and the rounding come before it): the
/// reference's checks on the f32 inputs, then `alg2` on the backend; the
/// unsharded form is one shard, its results already f64 (the host merge).
impl<B: ShardKernels + Sync + 'static> LinearCrossEntropyMath for CudaLinearCrossEntropy<B> {
    type Output = LinearLoss;

    fn support(&self) -> LossKernelSupport {
        CUDA_LOSS_SUPPORT
    }

    fn unsharded(
        &self,
        x: ArrayView2<f32>,
        w: ArrayView2<f32>,
        call: &LossCall,
    ) -> Result<LinearLoss> {
        check_linear_inputs(x, w, call)?;
        let map = ShardMap::new(w.nrows(), 1, ShardLayout::Uneven)?;
        let mut l = vocab::sharded_linear_cross_entropy(self.kernels, &map, x, w, call)
            .map_err(reference_error)?;
        let r = l.ranks.swap_remove(0);
        let num_tokens = call
            .config
            .targets(call.targets, map.vocab_size())?
            .iter()
            .flatten()
            .count();
        let ce = CrossEntropy {
            loss: r.loss,
            per_token_loss: r.per_token_loss,
            stats: r.global,
            num_tokens,
            grad_logits: None,
        };
        Ok(LinearLoss::new(ce, r.grad_hidden, r.grad_weight))
    }

    fn sharded(
        &self,
        plan: ShardPlan,
        x: ArrayView2<f32>,
        w: ArrayView2<f32>,
        call: &LossCall,
    ) -> Result<ShardedLoss> {
        let map = &plan.map;
        let v = map.vocab_size();
        map.check_width("weight", w.nrows(), w.shape(), "[v, h]")?;
        check_inputs(x.nrows(), call, v)?;
        check_linear(x, w, v, 0)?;
        vocab::sharded_linear_cross_entropy(self.kernels, map, x, w, call).map_err(reference_error)
    }
}

crate::linear_cross_entropy_op!(impl[B: ShardKernels + Sync + 'static] CudaLinearCrossEntropy<B>);
