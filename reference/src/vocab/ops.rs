//! The reference implementations of the output-layer op families
//! ([`CrossEntropyOp`], [`LinearCrossEntropyOp`], [`EmbeddingOp`]): the
//! unsharded f64 layer of [`super::cross_entropy`] and [`super::embedding`],
//! and the three sharded algorithms of [`super::sharded`] on `p` in-process
//! ranks.

use ndarray::ArrayView2;

use super::cross_entropy::{cross_entropy, linear_cross_entropy, CrossEntropy};
use super::embedding::{
    embedding_backward, embedding_forward, sharded_embedding, ShardedEmbedding,
};
use super::sharded::{sharded_cross_entropy, sharded_linear_cross_entropy, ShardedLoss};
use super::{LossCall, ShardMap, ShardPlan};
use crate::error::Result;
use crate::ops::{
    CrossEntropyOp, Embedding, EmbeddingOp, LinearCrossEntropyOp, LinearInput, LinearLoss,
};

/// The reference cross-entropy: unsharded, `naive`, `alg1` and `alg2`.
#[derive(Debug, Clone, Copy, Default)]
pub struct ReferenceCrossEntropy;

impl CrossEntropyOp for ReferenceCrossEntropy {
    fn cross_entropy(&self, logits: ArrayView2<f64>, call: &LossCall) -> Result<CrossEntropy> {
        cross_entropy(logits, call)
    }

    fn sharded_cross_entropy(
        &self,
        plan: ShardPlan,
        logits: ArrayView2<f64>,
        call: &LossCall,
    ) -> Result<ShardedLoss> {
        sharded_cross_entropy(plan.algorithm, &plan.map, logits, call)
    }
}

/// The reference output layer: unsharded, `naive`, `alg1` and `alg2`.
#[derive(Debug, Clone, Copy, Default)]
pub struct ReferenceLinearCrossEntropy;

impl LinearCrossEntropyOp for ReferenceLinearCrossEntropy {
    fn linear_cross_entropy(
        &self,
        hidden: ArrayView2<f64>,
        weight: ArrayView2<f64>,
        call: &LossCall,
    ) -> Result<LinearLoss> {
        let l = linear_cross_entropy(hidden, weight, call)?;
        Ok(LinearLoss {
            ce: l.ce,
            grad_hidden: l.grad_hidden,
            grad_weight: l.grad_weight,
            logits_buffer_bytes: None,
            traded: None,
        })
    }

    fn sharded_linear_cross_entropy(
        &self,
        plan: ShardPlan,
        input: LinearInput<'_>,
        call: &LossCall,
    ) -> Result<ShardedLoss> {
        let LinearInput { hidden, weight } = input;
        sharded_linear_cross_entropy(plan.algorithm, &plan.map, hidden, weight, call)
    }
}

/// The reference embedding: the unsharded lookup and the sharded one.
#[derive(Debug, Clone, Copy, Default)]
pub struct ReferenceEmbedding;

impl EmbeddingOp for ReferenceEmbedding {
    fn embedding(
        &self,
        ids: &[i64],
        weight: ArrayView2<f64>,
        grad_output: Option<ArrayView2<f64>>,
    ) -> Result<Embedding> {
        let output = embedding_forward(ids, weight)?;
        let grad_weight = match grad_output {
            Some(g) => {
                crate::vocab::embedding::check_embedding_grad(g, ids.len(), weight.ncols())?;
                Some(embedding_backward(ids, g, weight.nrows())?)
            }
            None => None,
        };
        Ok(Embedding {
            output,
            grad_weight,
        })
    }

    fn sharded_embedding(
        &self,
        map: &ShardMap,
        ids: &[i64],
        weight: ArrayView2<f64>,
        grad_output: Option<ArrayView2<f64>>,
    ) -> Result<ShardedEmbedding> {
        sharded_embedding(map, ids, weight, grad_output)
    }
}
