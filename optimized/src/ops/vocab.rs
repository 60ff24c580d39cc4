//! The f32 output-layer kernels as [`CrossEntropyOp`] and
//! [`LinearCrossEntropyOp`]: unsharded, and sharded with `alg2` (the only
//! algorithm they implement; the others are refused, never handed to the
//! reference).

use ndarray::{ArrayView2, Axis};
use packshard_reference::ops::{
    check_algorithm, CeCall, CrossEntropyOp, LinearCall, LinearCrossEntropyOp, LinearInput,
    LinearLoss, LossOp, LossSupport,
};
use packshard_reference::vocab::cross_entropy::CrossEntropy;
use packshard_reference::vocab::sharded::ShardedLoss;
use packshard_reference::vocab::{LossCall, ShardPlan, ShardedAlgorithm};
use packshard_reference::{Error, Result};

use crate::convert::{check_call_f32, to_f32, to_f32_real, to_f64};
use crate::vocab::{
    alg2, cross_entropy, linear_cross_entropy_fused, linear_cross_entropy_materialized,
    linear_cross_entropy_tiled, linear_cross_entropy_tiled_filtered, Chunks, CrossEntropy32,
    LinearCrossEntropy32,
};

/// The results of an f32 cross-entropy, widened (exactly) to the reference's type.
fn widen_ce(ce: CrossEntropy32) -> CrossEntropy {
    CrossEntropy {
        loss: ce.loss,
        per_token_loss: ce.per_token_loss,
        stats: ce.stats,
        num_tokens: ce.num_tokens,
        grad_logits: ce.grad_logits.map(|g| to_f64(g.view())),
    }
}

/// An unsharded f32 output-layer `kernel` on `input` (`hidden: [n, h]`,
/// `weight: [v, h]`) narrowed to f32, its results widened (exactly) to the
/// reference's type: `dL/dlogits` where the kernel holds it (materialized);
/// the fused ones never do (`LinearLoss::ce`).
fn unsharded_f32(
    input: LinearInput<'_>,
    kernel: impl FnOnce(ArrayView2<f32>, ArrayView2<f32>) -> Result<LinearCrossEntropy32>,
) -> Result<LinearLoss> {
    let x = to_f32("hidden", input.hidden)?;
    let w = to_f32("weight", input.weight)?;
    let l = kernel(x.view(), w.view())?;
    Ok(LinearLoss {
        ce: widen_ce(l.ce),
        grad_hidden: l.grad_hidden.map(|g| to_f64(g.view())),
        grad_weight: l.grad_weight.map(|g| to_f64(g.view())),
        logits_buffer_bytes: Some(l.logits_buffer_bytes),
        traded: l.traded,
    })
}

/// The sharded form of a kernel `name` that declares no algorithm: refuses
/// every one.
fn unsharded_only(name: &str, algorithm: ShardedAlgorithm) -> Result<ShardedLoss> {
    check_algorithm(&[], algorithm)?;
    Err(Error::invalid(
        "algorithm",
        format!("{name} is unsharded only"),
    ))
}

/// `alg2`'s shard kernel in `chunks` on `input` (`hidden: [n, h]`, `weight:
/// [w, h]`), the sharded form of both fused ops (an undeclared algorithm
/// refused).
fn sharded_alg2(
    plan: ShardPlan,
    input: LinearInput<'_>,
    call: &LossCall,
    chunks: Chunks,
) -> Result<ShardedLoss> {
    check_algorithm(&[alg2::ALGORITHM], plan.algorithm)?;
    check_call_f32(call)?;
    let x = to_f32("hidden", input.hidden)?;
    let w = to_f32_real("weight", input.weight, Axis(0), plan.map.vocab_size())?;
    alg2::sharded_linear_cross_entropy(&plan.map, x.view(), w.view(), call, (chunks, false))
}

/// `cross_entropy_f32`: the f32 SIMD row pass over the logits, tile
/// statistics merged in f64; sharded, `alg2` per rank over the reference's
/// in-process collective.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CrossEntropyF32;

impl LossOp for CrossEntropyF32 {
    fn algorithms(&self) -> Vec<ShardedAlgorithm> {
        vec![alg2::ALGORITHM]
    }

    /// Soft-capping and an upstream gradient, in f32 (`check_call_f32`).
    fn options(&self) -> LossSupport {
        LossSupport::ALL
    }
}

impl CrossEntropyOp for CrossEntropyF32 {
    fn cross_entropy(&self, c: CeCall<'_>) -> Result<CrossEntropy> {
        check_call_f32(&c.call)?;
        let z = to_f32("logits", c.input)?;
        Ok(widen_ce(cross_entropy(z.view(), &c.call)?))
    }

    fn sharded_cross_entropy(&self, plan: ShardPlan, c: CeCall<'_>) -> Result<ShardedLoss> {
        check_algorithm(&self.algorithms(), plan.algorithm)?;
        check_call_f32(&c.call)?;
        let z = to_f32_real("logits", c.input, Axis(1), plan.map.vocab_size())?;
        alg2::sharded_cross_entropy(&plan.map, z.view(), &c.call)
    }
}

/// The [`LinearCrossEntropyOp`] of an f32 kernel, in one of two forms:
///
/// - `f32_linear_op!(Op, "name", kernel)`: unsharded only, `kernel(op, x, w,
///   call)` on the f32 inputs; every sharded algorithm refused
///   ([`unsharded_only`]).
/// - `f32_linear_op!(Op, chunked kernel)`: a chunked kernel (`fn(hidden,
///   weight, call, chunks)`) in the op's `chunks`; sharded, `alg2`'s shard
///   kernel in the same chunks ([`sharded_alg2`]).
macro_rules! f32_linear_op {
    ($op:ty, $name:literal, $kernel:expr) => {
        f32_linear_op!(@impl $op, [], $kernel, |_: &$op, plan: ShardPlan, _, _| {
            unsharded_only($name, plan.algorithm)
        });
    };
    ($op:ty, chunked $kernel:path) => {
        f32_linear_op!(
            @impl $op,
            [alg2::ALGORITHM],
            |op: &$op, x, w, call| $kernel(x, w, call, op.chunks),
            |op: &$op, plan, input, call| sharded_alg2(plan, input, call, op.chunks)
        );
    };
    (@impl $op:ty, $algorithms:expr, $kernel:expr, $sharded:expr) => {
        impl LossOp for $op {
            fn algorithms(&self) -> Vec<ShardedAlgorithm> {
                $algorithms.to_vec()
            }

            /// Soft-capping and an upstream gradient, in f32 (`check_call_f32`).
            fn options(&self) -> LossSupport {
                LossSupport::ALL
            }
        }

        impl LinearCrossEntropyOp for $op {
            fn linear_cross_entropy(&self, c: LinearCall<'_>) -> Result<LinearLoss> {
                check_call_f32(&c.call)?;
                unsharded_f32(c.input, |x, w| $kernel(self, x, w, &c.call))
            }

            fn sharded_linear_cross_entropy(
                &self,
                plan: ShardPlan,
                c: LinearCall<'_>,
            ) -> Result<ShardedLoss> {
                $sharded(self, plan, c.input, &c.call)
            }
        }
    };
}

/// `linear_ce_materialized`: f32; one gemm to the whole `[n, v]` logits, the
/// SIMD row pass, two gemms for the gradients; returns `dL/dlogits` `[n, v]`
/// when gradients are asked for (the buffer it holds anyway). Unsharded
/// only: the baseline of [`LinearCeFused`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LinearCeMaterialized;

f32_linear_op!(
    LinearCeMaterialized,
    "linear_ce_materialized",
    |_: &LinearCeMaterialized, x, w, call| linear_cross_entropy_materialized(x, w, call)
);

/// `linear_ce_fused`: f32; chunks of `chunks.tokens` tokens x `chunks.vocab`
/// entries — logits, statistics and gradients per tile while in cache —
/// holding `[tokens, v]`, never `[n, v]`; sharded, `alg2`'s S and T passes
/// with the logits recomputed in T. Returns no `dL/dlogits`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LinearCeFused {
    /// The tile sizes.
    pub chunks: Chunks,
}

f32_linear_op!(LinearCeFused, chunked linear_cross_entropy_fused);

/// `linear_ce_tiled`: f32; tiles of `chunks.tokens` tokens x `chunks.vocab`
/// entries — pass 1 the row statistics, pass 2 the gradients from
/// recomputed logits — holding one `[tokens, vocab]` tile, never a row of
/// `v` ([`crate::vocab::linear_cross_entropy_tiled`]); sharded, `alg2` as
/// [`LinearCeFused`]. Returns no `dL/dlogits`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinearCeTiled {
    /// The tile sizes.
    pub chunks: Chunks,
}

impl Default for LinearCeTiled {
    /// 1024 tokens x 512 entries (2 MiB of f32).
    fn default() -> Self {
        LinearCeTiled {
            chunks: Chunks {
                tokens: 1024,
                vocab: 512,
            },
        }
    }
}

f32_linear_op!(LinearCeTiled, chunked linear_cross_entropy_tiled);

/// `linear_ce_tiled_filtered`: [`LinearCeTiled`] with Cut Cross-Entropy's
/// gradient filtering (Wijmans et al. 2024, §4.3): a gradient tile whose
/// every `|dL/dz_ij|` off the targets is at most `threshold x |w_i|` skips
/// its two products (the target entries applied alone)
/// ([`crate::vocab::linear_cross_entropy_tiled_filtered`]); the result's
/// [`LinearLoss::traded`] bounds the error that costs `dL/dhidden` and
/// `dL/dW`. Unsharded only (the filter is the tiled kernel's; `alg2`'s
/// shard kernel has none).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinearCeTiledFiltered {
    /// The tile sizes.
    pub chunks: Chunks,
    /// The filter's threshold on the softmax's scale (finite, `>= 0`).
    pub threshold: f32,
}

impl LinearCeTiledFiltered {
    /// Cut Cross-Entropy's default threshold, 2^-12 (Wijmans et al. 2024,
    /// §4.3).
    pub const CCE_THRESHOLD: f32 = 1.0 / 4096.0;
}

impl Default for LinearCeTiledFiltered {
    /// [`LinearCeTiled`]'s tiles, [`Self::CCE_THRESHOLD`].
    fn default() -> Self {
        LinearCeTiledFiltered {
            chunks: LinearCeTiled::default().chunks,
            threshold: Self::CCE_THRESHOLD,
        }
    }
}

f32_linear_op!(
    LinearCeTiledFiltered,
    "linear_ce_tiled_filtered",
    |op: &LinearCeTiledFiltered, x, w, call| {
        linear_cross_entropy_tiled_filtered(x, w, call, op.chunks, op.threshold)
    }
);
