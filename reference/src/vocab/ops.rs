//! The reference implementations of the output-layer op families
//! ([`CrossEntropyOp`], [`LinearCrossEntropyOp`], [`EmbeddingOp`]): the
//! unsharded f64 layer of [`super::cross_entropy`] and [`super::embedding`],
//! and the three sharded algorithms of [`super::sharded`] on `p` in-process
//! ranks; and the calls' inputs ([`CeCall`], [`LinearCall`],
//! [`EmbeddingCall`]) run on any implementation.

use super::cross_entropy::{cross_entropy, linear_cross_entropy, CrossEntropy};
use super::embedding::{
    embedding_backward, embedding_forward, sharded_embedding, ShardedEmbedding,
};
use super::sharded::{sharded_cross_entropy, sharded_linear_cross_entropy, ShardedLoss};
use super::{ShardMap, ShardPlan, ShardedAlgorithm};
use crate::error::Result;
use crate::ops::{
    CeCall, CrossEntropyOp, Embedding, EmbeddingCall, EmbeddingOp, LinearCall,
    LinearCrossEntropyOp, LinearLoss, LossOp, LossSupport,
};

/// The reference cross-entropy: unsharded, `naive`, `alg1` and `alg2`.
#[derive(Debug, Clone, Copy, Default)]
pub struct ReferenceCrossEntropy;

/// Every algorithm and every option: the reference defines them.
impl LossOp for ReferenceCrossEntropy {
    fn algorithms(&self) -> Vec<ShardedAlgorithm> {
        ShardedAlgorithm::ALL.to_vec()
    }

    fn options(&self) -> LossSupport {
        LossSupport::ALL
    }
}

impl CrossEntropyOp for ReferenceCrossEntropy {
    fn cross_entropy(&self, c: CeCall<'_>) -> Result<CrossEntropy> {
        cross_entropy(c.input, &c.call)
    }

    fn sharded_cross_entropy(&self, plan: ShardPlan, c: CeCall<'_>) -> Result<ShardedLoss> {
        sharded_cross_entropy(plan.algorithm, &plan.map, c.input, &c.call)
    }
}

/// The reference output layer: unsharded, `naive`, `alg1` and `alg2`.
#[derive(Debug, Clone, Copy, Default)]
pub struct ReferenceLinearCrossEntropy;

/// Every algorithm and every option: the reference defines them.
impl LossOp for ReferenceLinearCrossEntropy {
    fn algorithms(&self) -> Vec<ShardedAlgorithm> {
        ShardedAlgorithm::ALL.to_vec()
    }

    fn options(&self) -> LossSupport {
        LossSupport::ALL
    }
}

impl LinearCrossEntropyOp for ReferenceLinearCrossEntropy {
    fn linear_cross_entropy(&self, c: LinearCall<'_>) -> Result<LinearLoss> {
        let l = linear_cross_entropy(c.input.hidden, c.input.weight, &c.call)?;
        Ok(LinearLoss::new(l.ce, l.grad_hidden, l.grad_weight))
    }

    fn sharded_linear_cross_entropy(
        &self,
        plan: ShardPlan,
        c: LinearCall<'_>,
    ) -> Result<ShardedLoss> {
        let LinearCall { input, call } = c;
        sharded_linear_cross_entropy(plan.algorithm, &plan.map, input.hidden, input.weight, &call)
    }
}

/// The reference embedding: the unsharded lookup and the sharded one.
#[derive(Debug, Clone, Copy, Default)]
pub struct ReferenceEmbedding;

impl EmbeddingOp for ReferenceEmbedding {
    fn embedding(&self, c: EmbeddingCall<'_>) -> Result<Embedding> {
        let output = embedding_forward(c.ids, c.weight)?;
        let grad_weight = match c.grad_output {
            Some(g) => {
                crate::vocab::embedding::check_embedding_grad(g, c.ids.len(), c.weight.ncols())?;
                Some(embedding_backward(c.ids, g, c.weight.nrows())?)
            }
            None => None,
        };
        Ok(Embedding {
            output,
            grad_weight,
        })
    }

    fn sharded_embedding(&self, map: &ShardMap, c: EmbeddingCall<'_>) -> Result<ShardedEmbedding> {
        sharded_embedding(map, c.ids, c.weight, c.grad_output)
    }
}

impl CeCall<'_> {
    /// `op`'s unsharded cross-entropy on these inputs.
    ///
    /// # Errors
    /// `op`'s.
    pub fn unsharded(self, op: &dyn CrossEntropyOp) -> Result<CrossEntropy> {
        op.cross_entropy(self)
    }

    /// `op`'s sharded cross-entropy on these inputs.
    ///
    /// # Errors
    /// `op`'s.
    pub fn sharded(self, op: &dyn CrossEntropyOp, plan: ShardPlan) -> Result<ShardedLoss> {
        op.sharded_cross_entropy(plan, self)
    }
}

impl LinearCall<'_> {
    /// `op`'s unsharded output layer on these inputs.
    ///
    /// # Errors
    /// `op`'s.
    pub fn unsharded(self, op: &dyn LinearCrossEntropyOp) -> Result<LinearLoss> {
        op.linear_cross_entropy(self)
    }

    /// `op`'s sharded output layer on these inputs.
    ///
    /// # Errors
    /// `op`'s.
    pub fn sharded(self, op: &dyn LinearCrossEntropyOp, plan: ShardPlan) -> Result<ShardedLoss> {
        op.sharded_linear_cross_entropy(plan, self)
    }
}

impl EmbeddingCall<'_> {
    /// `op`'s unsharded embedding on these inputs.
    ///
    /// # Errors
    /// `op`'s.
    pub fn unsharded(self, op: &dyn EmbeddingOp) -> Result<Embedding> {
        op.embedding(self)
    }

    /// `op`'s sharded embedding on these inputs.
    ///
    /// # Errors
    /// `op`'s.
    pub fn sharded(self, op: &dyn EmbeddingOp, map: &ShardMap) -> Result<ShardedEmbedding> {
        op.sharded_embedding(map, self)
    }
}
