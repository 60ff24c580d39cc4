//! Implementations with a fault planted, for negative controls: a value that
//! implements [`AttentionHooks`] or [`VocabHooks`] states only the calls it
//! breaks, and [`Planted`] makes it an op ([`AttentionOp`], [`CrossEntropyOp`],
//! [`LinearCrossEntropyOp`], [`EmbeddingOp`]) whose every other call is the
//! f64 reference's. The call's inputs travel as one value (the op's own
//! [`Qkv`], [`Varlen`], [`Masked`], [`Grad`] for attention; [`CeCall`],
//! [`LinearCall`], [`EmbeddingCall`], re-exported here, for the vocabulary
//! ops) that can run the same call on any implementation, so a hook reads as
//! "the reference (or a kernel) on these inputs, then the fault".

use ndarray::ArrayView3;
use packshard_reference::attention::ReferenceAttention;
use packshard_reference::bert::{AttentionGrads, AttentionOutput};
use packshard_reference::ops::{
    AttentionOp, AttentionSupport, CrossEntropyOp, Embedding, EmbeddingOp, LinearCrossEntropyOp,
    LinearInput, LinearLoss, LossOp, LossSupport, Varlen,
};
pub use packshard_reference::ops::{CeCall, EmbeddingCall, LinearCall};
use packshard_reference::ops::{Grad, Masked, Qkv};
use packshard_reference::vocab::cross_entropy::CrossEntropy;
use packshard_reference::vocab::embedding::ShardedEmbedding;
use packshard_reference::vocab::sharded::ShardedLoss;
use packshard_reference::vocab::{
    GradRequest, LossCall, ReferenceCrossEntropy, ReferenceEmbedding, ReferenceLinearCrossEntropy,
    ShardMap, ShardPlan, ShardedAlgorithm,
};
use packshard_reference::Result;

/// An op built from hooks: [`AttentionOp`] for `F: AttentionHooks`, the three
/// vocabulary ops for `F: VocabHooks`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Planted<F>(pub F);

// ---- attention --------------------------------------------------------------

/// The calls of an [`AttentionOp`], each the reference's unless overridden.
pub trait AttentionHooks: Send + Sync {
    /// As [`AttentionOp::support`] (its default).
    fn support(&self) -> AttentionSupport {
        AttentionSupport::SELF_MHA
    }

    /// As [`AttentionOp::varlen_forward`].
    ///
    /// # Errors
    /// The reference's, or the planted fault's.
    fn varlen_forward(&self, x: Qkv<'_>, p: &Varlen<'_>) -> Result<AttentionOutput> {
        ReferenceAttention.varlen_forward(x, p)
    }

    /// As [`AttentionOp::varlen_backward`].
    ///
    /// # Errors
    /// The reference's, or the planted fault's.
    fn varlen_backward(&self, x: Qkv<'_>, p: &Varlen<'_>, g: Grad<'_>) -> Result<AttentionGrads> {
        ReferenceAttention.varlen_backward(x, p, g)
    }

    /// As [`AttentionOp::masked_forward`].
    ///
    /// # Errors
    /// The reference's, or the planted fault's.
    fn masked_forward(&self, x: Qkv<'_>, m: Masked<'_>) -> Result<AttentionOutput> {
        ReferenceAttention.masked_forward(x, m)
    }

    /// As [`AttentionOp::masked_backward`].
    ///
    /// # Errors
    /// The reference's, or the planted fault's.
    fn masked_backward(&self, x: Qkv<'_>, m: Masked<'_>, g: Grad<'_>) -> Result<AttentionGrads> {
        ReferenceAttention.masked_backward(x, m, g)
    }
}

impl<F: AttentionHooks> AttentionOp for Planted<F> {
    fn support(&self) -> AttentionSupport {
        self.0.support()
    }

    fn varlen_forward(&self, x: Qkv<'_>, p: &Varlen<'_>) -> Result<AttentionOutput> {
        self.0.varlen_forward(x, p)
    }

    fn varlen_backward(&self, x: Qkv<'_>, p: &Varlen<'_>, g: Grad<'_>) -> Result<AttentionGrads> {
        self.0.varlen_backward(x, p, g)
    }

    fn masked_forward(&self, x: Qkv<'_>, m: Masked<'_>) -> Result<AttentionOutput> {
        self.0.masked_forward(x, m)
    }

    fn masked_backward(&self, x: Qkv<'_>, m: Masked<'_>, g: Grad<'_>) -> Result<AttentionGrads> {
        self.0.masked_backward(x, m, g)
    }
}

// ---- planted attention faults ---------------------------------------------------

/// The reference with causal masks aligned top-left (`c <= r`) when queries
/// and keys differ in length, instead of bottom-right (`c <= r + l_k -
/// l_q`): docs/FAULTS.md C5. Agrees with the reference on self-attention.
#[derive(Debug, Clone, Copy, Default)]
pub struct TopLeftCausal;

/// `[n_q, n_k]`: key `c` of a segment visible to its query `r` when `c <= r`
/// (or always, when not causal).
fn top_left_mask(p: &Varlen<'_>, n_q: usize, n_k: usize) -> ndarray::Array2<bool> {
    let mut m = ndarray::Array2::from_elem((n_q, n_k), false);
    for (wq, wk) in p.cu_seqlens_q.windows(2).zip(p.cu_seqlens_k.windows(2)) {
        let lk = wk[1] - wk[0];
        for r in 0..wq[1] - wq[0] {
            let end = if p.causal { lk.min(r + 1) } else { lk };
            for c in 0..end {
                m[[wq[0] + r, wk[0] + c]] = true;
            }
        }
    }
    m
}

impl AttentionHooks for TopLeftCausal {
    fn support(&self) -> AttentionSupport {
        AttentionSupport::CAUSAL_GQA_CROSS
    }
    fn varlen_forward(&self, x: Qkv<'_>, p: &Varlen<'_>) -> Result<AttentionOutput> {
        let mask = top_left_mask(p, x.q.dim().0, x.k.dim().0);
        ReferenceAttention.masked_forward(x, Masked::new(mask.view(), p.scale))
    }
    fn varlen_backward(&self, x: Qkv<'_>, p: &Varlen<'_>, g: Grad<'_>) -> Result<AttentionGrads> {
        let mask = top_left_mask(p, x.q.dim().0, x.k.dim().0);
        ReferenceAttention.masked_backward(x, Masked::new(mask.view(), p.scale), g)
    }
}

/// The reference with grouped-query heads mapped as `a % h_kv` (tiling the
/// key heads, `repeat` instead of `repeat_interleave`) instead of `a / (h /
/// h_kv)`: agrees with the reference when `h_kv` is 1 or `h`.
#[derive(Debug, Clone, Copy, Default)]
pub struct ModuloKvHeads;

impl ModuloKvHeads {
    /// `[n_k, h, d]`: key head `a % h_kv` at head `a`.
    fn spread(x: ArrayView3<f64>, h: usize) -> ndarray::Array3<f64> {
        let (n, h_kv, d) = x.dim();
        ndarray::Array3::from_shape_fn((n, h, d), |(j, a, c)| x[[j, a % h_kv, c]])
    }

    /// `k` and `v` of `x` spread over the `h` query heads.
    fn spread_kv(x: &Qkv<'_>) -> (ndarray::Array3<f64>, ndarray::Array3<f64>) {
        let h = x.q.dim().1;
        (Self::spread(x.k, h), Self::spread(x.v, h))
    }

    /// `[n_k, h_kv, d]`: the gradient of head `a` added into `a % h_kv`.
    fn fold(g: &ndarray::Array3<f64>, h_kv: usize) -> ndarray::Array3<f64> {
        let (n, h, d) = g.dim();
        let mut out = ndarray::Array3::zeros((n, h_kv, d));
        for j in 0..n {
            for a in 0..h {
                for c in 0..d {
                    out[[j, a % h_kv, c]] += g[[j, a, c]];
                }
            }
        }
        out
    }
}

impl AttentionHooks for ModuloKvHeads {
    fn support(&self) -> AttentionSupport {
        AttentionSupport::CAUSAL_GQA_CROSS
    }
    fn varlen_forward(&self, x: Qkv<'_>, p: &Varlen<'_>) -> Result<AttentionOutput> {
        let (k, v) = Self::spread_kv(&x);
        ReferenceAttention.varlen_forward(Qkv::new(x.q, k.view(), v.view()), p)
    }
    fn varlen_backward(&self, x: Qkv<'_>, p: &Varlen<'_>, g: Grad<'_>) -> Result<AttentionGrads> {
        let h_kv = x.k.dim().1;
        let (k, v) = Self::spread_kv(&x);
        let gr = ReferenceAttention.varlen_backward(Qkv::new(x.q, k.view(), v.view()), p, g)?;
        Ok(AttentionGrads {
            grad_q: gr.grad_q,
            grad_k: Self::fold(&gr.grad_k, h_kv),
            grad_v: Self::fold(&gr.grad_v, h_kv),
        })
    }
}

// ---- vocabulary parallelism ---------------------------------------------------

/// The calls of the three vocabulary ops, each the reference's unless
/// overridden.
pub trait VocabHooks: Send + Sync {
    /// The sharded algorithms it declares (both op families; all by default).
    fn algorithms(&self) -> Vec<ShardedAlgorithm> {
        ShardedAlgorithm::ALL.to_vec()
    }

    /// The loss options it declares (both op families; all by default).
    fn options(&self) -> LossSupport {
        LossSupport::ALL
    }

    /// The upstream gradient the four loss calls see in place of
    /// `grad_output` (a fault in how it is read); `None` keeps it.
    fn upstream(&self, _grad_output: &[f64]) -> Option<Vec<f64>> {
        None
    }

    /// As [`CrossEntropyOp::cross_entropy`].
    ///
    /// # Errors
    /// The reference's, or the planted fault's.
    fn cross_entropy(&self, c: CeCall<'_>) -> Result<CrossEntropy> {
        c.unsharded(&ReferenceCrossEntropy)
    }

    /// As [`CrossEntropyOp::sharded_cross_entropy`].
    ///
    /// # Errors
    /// The reference's, or the planted fault's.
    fn sharded_cross_entropy(&self, plan: ShardPlan, c: CeCall<'_>) -> Result<ShardedLoss> {
        c.sharded(&ReferenceCrossEntropy, plan)
    }

    /// As [`LinearCrossEntropyOp::linear_cross_entropy`].
    ///
    /// # Errors
    /// The reference's, or the planted fault's.
    fn linear_cross_entropy(&self, c: LinearCall<'_>) -> Result<LinearLoss> {
        c.unsharded(&ReferenceLinearCrossEntropy)
    }

    /// As [`LinearCrossEntropyOp::sharded_linear_cross_entropy`].
    ///
    /// # Errors
    /// The reference's, or the planted fault's.
    fn sharded_linear_cross_entropy(
        &self,
        plan: ShardPlan,
        c: LinearCall<'_>,
    ) -> Result<ShardedLoss> {
        c.sharded(&ReferenceLinearCrossEntropy, plan)
    }

    /// As [`EmbeddingOp::embedding`].
    ///
    /// # Errors
    /// The reference's, or the planted fault's.
    fn embedding(&self, c: EmbeddingCall<'_>) -> Result<Embedding> {
        c.unsharded(&ReferenceEmbedding)
    }

    /// As [`EmbeddingOp::sharded_embedding`].
    ///
    /// # Errors
    /// The reference's, or the planted fault's.
    fn sharded_embedding(&self, map: &ShardMap, c: EmbeddingCall<'_>) -> Result<ShardedEmbedding> {
        c.sharded(&ReferenceEmbedding, map)
    }
}

impl<F: VocabHooks> LossOp for Planted<F> {
    fn algorithms(&self) -> Vec<ShardedAlgorithm> {
        self.0.algorithms()
    }

    fn options(&self) -> LossSupport {
        self.0.options()
    }
}

impl<F: VocabHooks> CrossEntropyOp for Planted<F> {
    fn cross_entropy(&self, c: CeCall<'_>) -> Result<CrossEntropy> {
        with_upstream(&self.0, &c.call, |call| {
            self.0.cross_entropy(c.with_call(call))
        })
    }

    fn sharded_cross_entropy(&self, plan: ShardPlan, c: CeCall<'_>) -> Result<ShardedLoss> {
        with_upstream(&self.0, &c.call, |call| {
            self.0.sharded_cross_entropy(plan, c.with_call(call))
        })
    }
}

impl<F: VocabHooks> LinearCrossEntropyOp for Planted<F> {
    fn linear_cross_entropy(&self, c: LinearCall<'_>) -> Result<LinearLoss> {
        // Rebuilt from its views, which shorten to the rewritten call's
        // lifetime (a `LinearInput` as a whole does not).
        let LinearInput { hidden, weight } = c.input;
        with_upstream(&self.0, &c.call, |call| {
            let x = LinearInput::new(hidden, weight);
            self.0.linear_cross_entropy(LinearCall::new(x, call))
        })
    }

    fn sharded_linear_cross_entropy(
        &self,
        plan: ShardPlan,
        c: LinearCall<'_>,
    ) -> Result<ShardedLoss> {
        let LinearInput { hidden, weight } = c.input;
        with_upstream(&self.0, &c.call, |call| {
            let x = LinearInput::new(hidden, weight);
            self.0
                .sharded_linear_cross_entropy(plan, LinearCall::new(x, call))
        })
    }
}

/// docs/FAULTS.md O2's fault (Liger-Kernel PR 1298): the backward scales
/// every row by `grad_output[0]`, a per-token upstream gradient read as a
/// scalar; everything else is the reference's (a scalar upstream gradient,
/// under `sum` and `mean`, is then right).
#[derive(Debug, Clone, Copy, Default)]
pub struct FirstUpstreamOnly;

impl VocabHooks for FirstUpstreamOnly {
    fn upstream(&self, grad_output: &[f64]) -> Option<Vec<f64>> {
        let first = grad_output.first().copied().unwrap_or(f64::NAN);
        Some(vec![first; grad_output.len()])
    }
}

/// An output-layer kernel `K`, then a fault planted in what it returns:
/// `unsharded` edits each [`LinearLoss`] of its unsharded call, `sharded` each
/// [`ShardedLoss`] of its sharded call. It declares the kernel's sharded
/// algorithms (and every loss option, as [`VocabHooks`] does by default);
/// its other calls are the reference's.
#[derive(Debug, Clone, Copy)]
pub struct KernelThenEdit<K, U, S> {
    kernel: K,
    unsharded: U,
    sharded: S,
}

impl<K, U, S> KernelThenEdit<K, U, S>
where
    K: LinearCrossEntropyOp,
    U: Fn(&mut LinearLoss) + Send + Sync,
    S: Fn(&mut ShardedLoss) + Send + Sync,
{
    /// `kernel` with the edits `unsharded` and `sharded` on its outputs.
    pub fn new(kernel: K, unsharded: U, sharded: S) -> Self {
        Self {
            kernel,
            unsharded,
            sharded,
        }
    }
}

impl<K, U, S> VocabHooks for KernelThenEdit<K, U, S>
where
    K: LinearCrossEntropyOp,
    U: Fn(&mut LinearLoss) + Send + Sync,
    S: Fn(&mut ShardedLoss) + Send + Sync,
{
    fn algorithms(&self) -> Vec<ShardedAlgorithm> {
        self.kernel.algorithms()
    }

    fn linear_cross_entropy(&self, c: LinearCall<'_>) -> Result<LinearLoss> {
        let mut out = c.unsharded(&self.kernel)?;
        (self.unsharded)(&mut out);
        Ok(out)
    }

    fn sharded_linear_cross_entropy(
        &self,
        plan: ShardPlan,
        c: LinearCall<'_>,
    ) -> Result<ShardedLoss> {
        let mut out = c.sharded(&self.kernel, plan)?;
        (self.sharded)(&mut out);
        Ok(out)
    }
}

/// `run` on `call`, its upstream gradient as `hooks` rewrite it
/// ([`VocabHooks::upstream`]).
fn with_upstream<T>(
    hooks: &impl VocabHooks,
    call: &LossCall,
    run: impl FnOnce(LossCall<'_>) -> Result<T>,
) -> Result<T> {
    match call.grad.upstream().and_then(|g| hooks.upstream(g)) {
        Some(g) => run(LossCall {
            grad: GradRequest::Upstream(&g),
            ..*call
        }),
        None => run(*call),
    }
}

impl<F: VocabHooks> EmbeddingOp for Planted<F> {
    fn embedding(&self, c: EmbeddingCall<'_>) -> Result<Embedding> {
        self.0.embedding(c)
    }

    fn sharded_embedding(&self, map: &ShardMap, c: EmbeddingCall<'_>) -> Result<ShardedEmbedding> {
        self.0.sharded_embedding(map, c)
    }
}
