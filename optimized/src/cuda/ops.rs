//! The CUDA kernels as ops: the attention kernels as an [`AttentionOp`],
//! one adapter, [`CudaAttention`], over either backend of
//! [`AttentionKernels`] — the GPU ([`Gpu`], device 0) or the CPU emulator of
//! the same source ([`Emulator`]); `packshard-oracle`'s registry lists both
//! (`attention_varlen_cuda`, `attention_varlen_cuda_emulated`). The
//! vocabulary kernels likewise as a [`LinearCrossEntropyOp`],
//! [`CudaLinearCrossEntropy`] (see its docs).
//!
//! At the boundary as every f32 kernel: `q, k, v` (and the saved forward,
//! `grad_output`) rounded to f32 on entry, refusing finite values beyond
//! its range, results widened to f64 on exit; bad input gets the
//! reference's error (`check_varlen`, `check_mask_shape`,
//! `check_grad_shapes`, `check_scores`, `check_grad_values`, the shared work
//! bound; the f32 loss options of `check_call_f32`). The kernels run bidirectional self-attention with
//! `h_kv == h` and `d <= 128`: causal masks, grouped-query and cross
//! attention are declared unsupported ([`AttentionOp::support`]) and
//! refused.

use std::sync::OnceLock;

use ndarray::{Array2, Array3, ArrayView2};
use packshard_reference::attention::{
    check_grad_values, check_mask_shape, check_masked_work, check_scores, check_varlen,
    check_varlen_work, AttentionGrads, AttentionOutput,
};
use packshard_reference::ops::{AttentionOp, AttentionSupport, LinearLoss, LossSupport, Varlen};
#[cfg(doc)]
use packshard_reference::ops::{LinearCrossEntropyOp, LossOp};
use packshard_reference::vocab::cross_entropy::CrossEntropy;
use packshard_reference::vocab::sharded::{check_inputs, ShardedLoss};
use packshard_reference::vocab::{LossCall, ShardLayout, ShardMap, ShardPlan, ShardedAlgorithm};
use packshard_reference::{Error, Result};

use super::attention::{AttentionKernels, AttnForward, AttnShape, BackwardCall, Call, Form};
use super::emu::Emulator;
use super::vocab::{self, ShardKernels};
use super::MAX_HEAD_DIM;
use super::{CudaError, Gpu};
use crate::ops::boundary::{
    inputs, saved, widen, widen_grads, LinearCrossEntropyMath, LossKernelSupport,
};
use crate::vocab::{check_linear, check_linear_inputs};
use packshard_reference::ops::{Grad, Masked, Qkv};

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

/// A standard-layout f32 tensor's values.
fn flat<D: ndarray::Dimension>(x: &ndarray::Array<f32, D>) -> &[f32] {
    x.as_slice()
        .expect("converted tensors are in standard layout")
}

fn call<'a>(
    [q, k, v]: [&'a Array3<f32>; 3],
    shape: AttnShape,
    form: Form<'a>,
    scale: f64,
) -> Call<'a> {
    Call {
        q: flat(q),
        k: flat(k),
        v: flat(v),
        shape,
        form,
        scale: scale as f32,
    }
}

fn shape3(x: &[f32], s: AttnShape) -> Array3<f32> {
    Array3::from_shape_vec((s.n_tok, s.h, s.d), x.to_vec()).expect("[n_tok, h, d]")
}

/// `q, k, v` in f32 (shapes checked, finite values beyond f32 refused,
/// non-finite ones reported) and their [`AttnShape`].
type Inputs = ([Array3<f32>; 3], AttnShape);

fn checked(x: &Qkv<'_>) -> Result<Inputs> {
    let x32 = inputs(x)?;
    let (n_tok, h, d) = x.q.dim();
    Ok((x32, AttnShape { n_tok, h, d }))
}

impl<B: AttentionKernels + 'static> CudaAttention<B> {
    /// Checks a varlen problem as the reference does, then the support.
    fn varlen(&self, x: &Qkv<'_>, p: &Varlen<'_>) -> Result<Inputs> {
        let x32 = checked(x)?;
        check_varlen(p, x.q.dim().0, x.k.dim().0)?;
        self.support().check(p, x.q.dim().1, x.k.dim().1)?;
        check_scores(&x.q, &x.k, p.scale)?;
        Ok(x32)
    }

    /// Checks a masked problem as the reference does.
    fn masked(x: &Qkv<'_>, m: &Masked<'_>) -> Result<(Inputs, Vec<bool>)> {
        let x32 = checked(x)?;
        check_mask_shape(m.allowed.shape(), x.q.dim().0)?;
        check_scores(&x.q, &x.k, m.scale)?;
        Ok((x32, m.allowed.iter().copied().collect()))
    }

    fn forward(
        &self,
        ([q, k, v], s): Inputs,
        form: Form<'_>,
        scale: f64,
    ) -> Result<AttentionOutput> {
        let c = call([&q, &k, &v], s, form, scale);
        let f = self
            .kernels
            .attention_forward(&c)
            .map_err(reference_error)?;
        let lse = Array2::from_shape_vec((s.h, s.n_tok), f.lse).expect("[h, n_tok]");
        Ok(widen((shape3(&f.output, s), lse)))
    }

    fn backward(
        &self,
        ([q, k, v], s): Inputs,
        form: Form<'_>,
        scale: f64,
        g: Grad<'_>,
    ) -> Result<AttentionGrads> {
        let (out, lse, go) = saved(g, q.dim())?;
        let fwd32 = AttnForward {
            output: flat(&out).to_vec(),
            lse: flat(&lse).to_vec(),
        };
        let b = BackwardCall {
            call: call([&q, &k, &v], s, form, scale),
            fwd: &fwd32,
            grad_output: flat(&go),
        };
        let g = self
            .kernels
            .attention_backward(&b)
            .map_err(reference_error)?;
        Ok(widen_grads([
            shape3(&g.grad_q, s),
            shape3(&g.grad_k, s),
            shape3(&g.grad_v, s),
        ]))
    }
}

impl<B: AttentionKernels + 'static> AttentionOp for CudaAttention<B> {
    /// Bidirectional self-attention with `h_kv == h` only.
    fn support(&self) -> AttentionSupport {
        AttentionSupport::BIDIRECTIONAL.with_max_head_dim(MAX_HEAD_DIM)
    }

    // Each call checks, in the reference's order, the shapes and mask, the
    // scores, the backward's `grad_output . v`, then the work every impl
    // shares (`check_varlen_work`, `check_masked_work`), before any launch.

    fn varlen_forward(&self, x: Qkv<'_>, p: &Varlen<'_>) -> Result<AttentionOutput> {
        let (x32, s) = self.varlen(&x, p)?;
        check_varlen_work(p, s.h, s.d)?;
        self.forward((x32, s), Form::Packed(p.cu_seqlens_q), p.scale)
    }

    fn varlen_backward(&self, x: Qkv<'_>, p: &Varlen<'_>, g: Grad<'_>) -> Result<AttentionGrads> {
        let (x32, s) = self.varlen(&x, p)?;
        check_grad_values(&g.grad_output, &x.v)?;
        check_varlen_work(p, s.h, s.d)?;
        self.backward((x32, s), Form::Packed(p.cu_seqlens_q), p.scale, g)
    }

    fn masked_forward(&self, x: Qkv<'_>, m: Masked<'_>) -> Result<AttentionOutput> {
        let ((x32, s), a) = Self::masked(&x, &m)?;
        check_masked_work(s.n_tok, s.n_tok, s.h, s.d)?;
        self.forward((x32, s), Form::Masked(&a), m.scale)
    }

    fn masked_backward(&self, x: Qkv<'_>, m: Masked<'_>, g: Grad<'_>) -> Result<AttentionGrads> {
        let ((x32, s), a) = Self::masked(&x, &m)?;
        check_grad_values(&g.grad_output, &x.v)?;
        check_masked_work(s.n_tok, s.n_tok, s.h, s.d)?;
        self.backward((x32, s), Form::Masked(&a), m.scale, g)
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
