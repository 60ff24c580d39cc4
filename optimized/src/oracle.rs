//! The optimized kernels behind the op traits of `packshard-equivalence`
//! (f64 in and out, rounded to the kernel's precision at the boundary), so
//! that the equivalence suites, the differential fuzz harness and its
//! `cargo fuzz` targets (`packshard::fuzzing`) run the very same adapters.

use ndarray::{Array2, ArrayView2, ArrayView3};
use packshard_equivalence::attention::VarlenAttention;
use packshard_equivalence::vocab::VocabParallel;
use packshard_reference::bert::attention::{check_cu_seqlens, AttentionGrads, AttentionOutput};
use packshard_reference::vocab::embedding::{sharded_embedding, ShardedEmbedding};
use packshard_reference::vocab::sharded::ShardedLoss;
use packshard_reference::vocab::{LossConfig, ShardMap, ShardedAlgorithm};
use packshard_reference::Error;

use crate::adapt::OptimizedAttention;
use crate::vocab::{alg2, Chunks};

/// An optimized attention variant (and its name) as the suites''s `VarlenAttention`: the varlen form
/// through the varlen kernel, the padded form through the dense masked kernel.
pub struct Suite(pub OptimizedAttention, pub &'static str);

impl VarlenAttention for Suite {
    fn name(&self) -> String {
        self.1.into()
    }
    fn varlen_forward(
        &self,
        q: ArrayView3<f64>,
        k: ArrayView3<f64>,
        v: ArrayView3<f64>,
        cu_seqlens: &[usize],
        scale: f64,
    ) -> Result<AttentionOutput, Error> {
        self.0.varlen_forward(q, k, v, cu_seqlens, false, scale)
    }
    fn varlen_backward(
        &self,
        q: ArrayView3<f64>,
        k: ArrayView3<f64>,
        v: ArrayView3<f64>,
        cu_seqlens: &[usize],
        scale: f64,
        fwd: &AttentionOutput,
        grad_output: ArrayView3<f64>,
    ) -> Result<AttentionGrads, Error> {
        self.0
            .varlen_backward(q, k, v, cu_seqlens, false, scale, fwd, grad_output)
    }
    fn masked_forward(
        &self,
        q: ArrayView3<f64>,
        k: ArrayView3<f64>,
        v: ArrayView3<f64>,
        allowed: ArrayView2<bool>,
        scale: f64,
    ) -> Result<AttentionOutput, Error> {
        let n = q.dim().0;
        self.0.dense_forward(q, k, v, n, &[allowed], scale)
    }
    fn masked_backward(
        &self,
        q: ArrayView3<f64>,
        k: ArrayView3<f64>,
        v: ArrayView3<f64>,
        allowed: ArrayView2<bool>,
        scale: f64,
        fwd: &AttentionOutput,
        grad_output: ArrayView3<f64>,
    ) -> Result<AttentionGrads, Error> {
        let n = q.dim().0;
        self.0
            .dense_backward(q, k, v, n, &[allowed], scale, fwd, grad_output)
    }
}

/// The dense masked kernel judged as a varlen kernel: the whole packed batch
/// is one row with the block-diagonal mask of its segments.
pub struct DenseAsVarlen;

/// The `[n, n]` block-diagonal mask of `cu_seqlens` (`n` its last entry).
///
/// # Panics
/// On an empty `cu_seqlens`; check it first (`check_cu_seqlens`).
pub fn block_diagonal(cu: &[usize]) -> Array2<bool> {
    let n = *cu.last().unwrap();
    let seg = |i: usize| cu.partition_point(|&c| c <= i);
    Array2::from_shape_fn((n, n), |(i, j)| seg(i) == seg(j))
}

impl VarlenAttention for DenseAsVarlen {
    fn name(&self) -> String {
        "attention_dense_masked (block-diagonal)".into()
    }
    fn varlen_forward(
        &self,
        q: ArrayView3<f64>,
        k: ArrayView3<f64>,
        v: ArrayView3<f64>,
        cu_seqlens: &[usize],
        scale: f64,
    ) -> Result<AttentionOutput, Error> {
        check_cu_seqlens(cu_seqlens, q.dim().0)?;
        let mask = block_diagonal(cu_seqlens);
        let n = q.dim().0;
        OptimizedAttention::F32.dense_forward(q, k, v, n, &[mask.view()], scale)
    }
    fn varlen_backward(
        &self,
        q: ArrayView3<f64>,
        k: ArrayView3<f64>,
        v: ArrayView3<f64>,
        cu_seqlens: &[usize],
        scale: f64,
        fwd: &AttentionOutput,
        grad_output: ArrayView3<f64>,
    ) -> Result<AttentionGrads, Error> {
        check_cu_seqlens(cu_seqlens, q.dim().0)?;
        let mask = block_diagonal(cu_seqlens);
        let n = q.dim().0;
        OptimizedAttention::F32.dense_backward(q, k, v, n, &[mask.view()], scale, fwd, grad_output)
    }
    fn masked_forward(
        &self,
        q: ArrayView3<f64>,
        k: ArrayView3<f64>,
        v: ArrayView3<f64>,
        allowed: ArrayView2<bool>,
        scale: f64,
    ) -> Result<AttentionOutput, Error> {
        Suite(OptimizedAttention::F32, "").masked_forward(q, k, v, allowed, scale)
    }
    #[allow(clippy::too_many_arguments)]
    fn masked_backward(
        &self,
        q: ArrayView3<f64>,
        k: ArrayView3<f64>,
        v: ArrayView3<f64>,
        allowed: ArrayView2<bool>,
        scale: f64,
        fwd: &AttentionOutput,
        grad_output: ArrayView3<f64>,
    ) -> Result<AttentionGrads, Error> {
        Suite(OptimizedAttention::F32, "").masked_backward(
            q,
            k,
            v,
            allowed,
            scale,
            fwd,
            grad_output,
        )
    }
}

/// `attention_varlen_tiled` (f32 inputs).
pub const ATTENTION_F32: Suite = Suite(OptimizedAttention::F32, "attention_varlen_tiled");
/// `attention_varlen_tiled_bf16` (bf16 inputs, f32 accumulation).
pub const ATTENTION_BF16: Suite = Suite(OptimizedAttention::BF16, "attention_varlen_tiled_bf16");

/// `alg2` of the optimized crate behind the suite's f64 interface. Inputs
/// are cast to f32 (padding values too: they are never read). The embedding
/// is a lookup, exact in any precision: the reference's is used.
pub struct FusedAlg2(pub Chunks);

fn f32s(a: ArrayView2<f64>) -> Array2<f32> {
    a.mapv(|x| x as f32)
}

impl VocabParallel for FusedAlg2 {
    fn name(&self) -> String {
        format!(
            "fused_ce_alg2 (chunks {} x {})",
            self.0.tokens, self.0.vocab
        )
    }
    fn algorithms(&self) -> Vec<ShardedAlgorithm> {
        vec![alg2::ALGORITHM]
    }
    fn cross_entropy(
        &self,
        _algorithm: ShardedAlgorithm,
        map: &ShardMap,
        logits: ArrayView2<f64>,
        targets: &[i64],
        config: &LossConfig,
        want_grad: bool,
    ) -> Result<ShardedLoss, Error> {
        alg2::sharded_cross_entropy(map, f32s(logits).view(), targets, config, want_grad)
    }
    fn linear_cross_entropy(
        &self,
        _algorithm: ShardedAlgorithm,
        map: &ShardMap,
        hidden: ArrayView2<f64>,
        weight: ArrayView2<f64>,
        targets: &[i64],
        config: &LossConfig,
        want_grad: bool,
    ) -> Result<ShardedLoss, Error> {
        alg2::sharded_linear_cross_entropy(
            map,
            f32s(hidden).view(),
            f32s(weight).view(),
            targets,
            config,
            want_grad,
            self.0,
            true,
        )
    }
    fn embedding(
        &self,
        map: &ShardMap,
        ids: &[i64],
        weight: ArrayView2<f64>,
        grad_output: Option<ArrayView2<f64>>,
    ) -> Result<ShardedEmbedding, Error> {
        sharded_embedding(map, ids, weight, grad_output)
    }
}
