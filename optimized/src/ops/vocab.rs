//! The f32 output-layer kernels: their math and what they declare
//! (unsharded, and sharded with `alg2`, the only algorithm they implement;
//! every loss option), made `CrossEntropyOp` and `LinearCrossEntropyOp` by
//! the boundary of [`super::boundary::losses`], which refuses the rest.

use ndarray::ArrayView2;
use packshard_reference::ops::LossSupport;
use packshard_reference::vocab::sharded::ShardedLoss;
use packshard_reference::vocab::{LossCall, ShardPlan};
use packshard_reference::Result;

#[cfg(doc)]
use packshard_reference::ops::LinearLoss;

use super::boundary::{CrossEntropyMath, LinearCrossEntropyMath, LossKernelSupport};
use crate::vocab::{
    alg2, cross_entropy, linear_cross_entropy_fused, linear_cross_entropy_materialized,
    linear_cross_entropy_tiled, linear_cross_entropy_tiled_filtered, Chunks, CrossEntropy32,
    LinearCrossEntropy32,
};

/// Every loss option (soft-capping and an upstream gradient, in f32) and
/// `alg2`'s shard kernel: what `cross_entropy_f32` and the chunked output
/// layers implement.
const ALG2_ALL_OPTIONS: LossKernelSupport = LossKernelSupport {
    algorithms: &[alg2::ALGORITHM],
    options: LossSupport::ALL,
};

/// Every loss option, unsharded only.
const UNSHARDED_ALL_OPTIONS: LossKernelSupport = LossKernelSupport {
    algorithms: &[],
    options: LossSupport::ALL,
};

/// `cross_entropy_f32`: the f32 SIMD row pass over the logits, tile
/// statistics merged in f64; sharded, `alg2` per rank over the reference's
/// in-process collective.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CrossEntropyF32;

impl CrossEntropyMath for CrossEntropyF32 {
    fn support(&self) -> LossKernelSupport {
        ALG2_ALL_OPTIONS
    }

    fn unsharded(&self, logits: ArrayView2<f32>, call: &LossCall) -> Result<CrossEntropy32> {
        cross_entropy(logits, call)
    }

    fn sharded(
        &self,
        plan: ShardPlan,
        logits: ArrayView2<f32>,
        call: &LossCall,
    ) -> Result<ShardedLoss> {
        alg2::sharded_cross_entropy(&plan.map, logits, call)
    }
}

crate::cross_entropy_op!(CrossEntropyF32);

/// `alg2`'s shard kernel in `chunks`: the sharded form of the chunked
/// output layers.
fn sharded_alg2(
    plan: ShardPlan,
    [x, w]: [ArrayView2<f32>; 2],
    call: &LossCall,
    chunks: Chunks,
) -> Result<ShardedLoss> {
    alg2::sharded_linear_cross_entropy(&plan.map, x, w, call, (chunks, false))
}

/// `linear_ce_materialized`: f32; one gemm to the whole `[n, v]` logits, the
/// SIMD row pass, two gemms for the gradients; returns `dL/dlogits` `[n, v]`
/// when gradients are asked for (the buffer it holds anyway). Unsharded
/// only: the baseline of [`LinearCeFused`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LinearCeMaterialized;

impl LinearCrossEntropyMath for LinearCeMaterialized {
    type Output = LinearCrossEntropy32;

    fn support(&self) -> LossKernelSupport {
        UNSHARDED_ALL_OPTIONS
    }

    fn unsharded(
        &self,
        hidden: ArrayView2<f32>,
        weight: ArrayView2<f32>,
        call: &LossCall,
    ) -> Result<LinearCrossEntropy32> {
        linear_cross_entropy_materialized(hidden, weight, call)
    }
}

crate::linear_cross_entropy_op!(LinearCeMaterialized);

/// `linear_ce_fused`: f32; chunks of `chunks.tokens` tokens x `chunks.vocab`
/// entries — logits, statistics and gradients per tile while in cache —
/// holding `[tokens, v]`, never `[n, v]`; sharded, `alg2`'s S and T passes
/// with the logits recomputed in T. Returns no `dL/dlogits`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LinearCeFused {
    /// The tile sizes.
    pub chunks: Chunks,
}

impl LinearCrossEntropyMath for LinearCeFused {
    type Output = LinearCrossEntropy32;

    fn support(&self) -> LossKernelSupport {
        ALG2_ALL_OPTIONS
    }

    fn unsharded(
        &self,
        hidden: ArrayView2<f32>,
        weight: ArrayView2<f32>,
        call: &LossCall,
    ) -> Result<LinearCrossEntropy32> {
        linear_cross_entropy_fused(hidden, weight, call, self.chunks)
    }

    fn sharded(
        &self,
        plan: ShardPlan,
        hidden: ArrayView2<f32>,
        weight: ArrayView2<f32>,
        call: &LossCall,
    ) -> Result<ShardedLoss> {
        sharded_alg2(plan, [hidden, weight], call, self.chunks)
    }
}

crate::linear_cross_entropy_op!(LinearCeFused);

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

impl LinearCrossEntropyMath for LinearCeTiled {
    type Output = LinearCrossEntropy32;

    fn support(&self) -> LossKernelSupport {
        ALG2_ALL_OPTIONS
    }

    fn unsharded(
        &self,
        hidden: ArrayView2<f32>,
        weight: ArrayView2<f32>,
        call: &LossCall,
    ) -> Result<LinearCrossEntropy32> {
        linear_cross_entropy_tiled(hidden, weight, call, self.chunks)
    }

    fn sharded(
        &self,
        plan: ShardPlan,
        hidden: ArrayView2<f32>,
        weight: ArrayView2<f32>,
        call: &LossCall,
    ) -> Result<ShardedLoss> {
        sharded_alg2(plan, [hidden, weight], call, self.chunks)
    }
}

crate::linear_cross_entropy_op!(LinearCeTiled);

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

impl LinearCrossEntropyMath for LinearCeTiledFiltered {
    type Output = LinearCrossEntropy32;

    fn support(&self) -> LossKernelSupport {
        UNSHARDED_ALL_OPTIONS
    }

    fn unsharded(
        &self,
        hidden: ArrayView2<f32>,
        weight: ArrayView2<f32>,
        call: &LossCall,
    ) -> Result<LinearCrossEntropy32> {
        linear_cross_entropy_tiled_filtered(hidden, weight, call, self.chunks, self.threshold)
    }
}

crate::linear_cross_entropy_op!(LinearCeTiledFiltered);

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::Array2;
    use packshard_reference::vocab::LossConfig;

    /// The default filter is Cut Cross-Entropy's 2^-12 (Wijmans et al.
    /// 2024, §4.3), seen through what it skips: one token, `v = 1024` (two
    /// of the default 512-entry tiles), every logit 0 but the target's
    /// (column 0). With `e^t = 1477` each other `dL/dz_j = p_j = 1/2500 =
    /// 4e-4`, above 2^-12 (2.44e-4): nothing skipped. With `e^t = 1e5`,
    /// `p_j` is about 1e-5, below it: both tiles skipped. A threshold of 1
    /// or 4096 would skip both in the first case, one of 0 neither in the
    /// second.
    #[test]
    fn the_default_threshold_skips_tiles_below_two_to_the_minus_12_only() {
        let skipped = |t: f32| {
            let hidden = Array2::from_elem((1, 1), 1.0f32);
            let weight = Array2::from_shape_fn((1024, 1), |(j, _)| if j == 0 { t } else { 0.0 });
            let (targets, cfg) = ([0i64], LossConfig::default());
            let call = LossCall::with_flag(&targets, &cfg, true);
            let r = LinearCeTiledFiltered::default()
                .unsharded(hidden.view(), weight.view(), &call)
                .unwrap();
            r.traded.expect("the filtered kernel reports").skipped_tiles
        };
        assert_eq!(skipped(1477f32.ln()), 0);
        assert_eq!(skipped(1e5f32.ln()), 2);
    }
}
