//! A token-chunked fused output layer in f64, the structure of Liger's
//! `fused_linear_cross_entropy`: tokens in chunks of `chunk` rows; for
//! each chunk its logits `hidden[chunk] @ weight^T` (`[chunk, v]`, the only
//! logits held at once), each row's summary over vocabulary chunks
//! ([`super::loss`]'s scan), the per-token losses, `dL/dz` of the chunk,
//! then `dL/dhidden[chunk] = dL/dz @ weight` and `dL/dW += dL/dz^T @
//! hidden[chunk]`. Correct by default, with the mistakes of [`LinearBug`]
//! one at a time.
//!
//! Shapes: `hidden: [n, h]`, `weight: [v, h]`, `targets: [n]`,
//! `grad_hidden: [n, h]`, `grad_weight: [v, h]`; `grad_logits` is never
//! materialised (`None`). The unsharded form only.

use ndarray::{Array1, Array2, Axis, Slice};
use packshard_reference::ops::{
    check_algorithm, LinearCall, LinearCrossEntropyOp, LinearInput, LinearLoss, LossOp, LossSupport,
};
use packshard_reference::vocab::cross_entropy::{
    check_linear, check_row, check_shapes, CrossEntropy,
};
use packshard_reference::vocab::sharded::ShardedLoss;
use packshard_reference::vocab::{
    check_logits_size, softcap, sum, Reduction, ShardPlan, ShardedAlgorithm, SoftmaxStats,
};
use packshard_reference::{Error, Result};

use super::loss::{logit_grad, mean_denominator, reduce, token_loss, token_weights, RowScan};

/// One mistake of [`TokenChunkedLinearCrossEntropy`], each one kernel
/// authors have made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LinearBug {
    /// The token-chunk count rounds down (`n / chunk`, one chunk when `n <
    /// chunk`): the last partial chunk of tokens is never computed.
    TokenTailDropped,
    /// `dL/dW` written (`=`) per token chunk instead of accumulated: it
    /// holds the last chunk's share.
    GradWeightLastChunk,
    /// The mean taken per token chunk, then averaged over chunks: wrong when
    /// chunks hold different numbers of counted tokens.
    MeanPerChunk,
    /// A per-token `grad_output` (reduction `none`) read as a scalar,
    /// `grad_output[0]` for every token (docs/FAULTS.md O2).
    UpstreamScalar,
    /// `dL/dW` written by a grid of `v / 1024` vocabulary blocks (rounded
    /// down): past 1024 entries, the rows of the last partial block keep no
    /// gradient.
    GradWeightVocabTail,
}

impl LinearBug {
    /// Every output-layer bug of the zoo.
    pub const ALL: [LinearBug; 5] = [
        LinearBug::TokenTailDropped,
        LinearBug::GradWeightLastChunk,
        LinearBug::MeanPerChunk,
        LinearBug::UpstreamScalar,
        LinearBug::GradWeightVocabTail,
    ];

    /// A short name (`token_tail_dropped`).
    pub fn name(self) -> &'static str {
        match self {
            LinearBug::TokenTailDropped => "token_tail_dropped",
            LinearBug::GradWeightLastChunk => "grad_weight_last_chunk",
            LinearBug::MeanPerChunk => "mean_per_chunk",
            LinearBug::UpstreamScalar => "upstream_scalar",
            LinearBug::GradWeightVocabTail => "grad_weight_vocab_tail",
        }
    }

    /// The token chunk the zoo's kernel with this bug uses (32 or 64).
    pub fn chunk(self) -> usize {
        match self {
            LinearBug::TokenTailDropped | LinearBug::MeanPerChunk => 32,
            LinearBug::GradWeightLastChunk
            | LinearBug::UpstreamScalar
            | LinearBug::GradWeightVocabTail => 64,
        }
    }
}

/// Vocabulary entries per chunk of the row scan inside each token chunk.
const VOCAB_CHUNK: usize = 1024;

/// The token-chunked fused output layer: token chunks of `chunk` rows, with
/// at most one [`LinearBug`]. Declares every loss option
/// ([`LossSupport::ALL`]) and no sharded algorithm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenChunkedLinearCrossEntropy {
    /// Tokens per chunk.
    pub chunk: usize,
    /// The mistake switched in; `None`: the correct kernel.
    pub bug: Option<LinearBug>,
}

impl TokenChunkedLinearCrossEntropy {
    /// The correct kernel with token chunks of `chunk` rows (at least 1).
    pub fn correct(chunk: usize) -> Self {
        TokenChunkedLinearCrossEntropy {
            chunk: chunk.max(1),
            bug: None,
        }
    }

    /// The kernel with `bug`, at the bug's [`LinearBug::chunk`].
    pub fn with(bug: LinearBug) -> Self {
        TokenChunkedLinearCrossEntropy {
            chunk: bug.chunk(),
            bug: Some(bug),
        }
    }

    /// The same kernel without its bug.
    pub fn fixed(self) -> Self {
        TokenChunkedLinearCrossEntropy { bug: None, ..self }
    }

    fn has(&self, bug: LinearBug) -> bool {
        self.bug == Some(bug)
    }

    /// The token chunks `t0..t1` the kernel computes.
    fn token_chunks(&self, n: usize) -> Vec<(usize, usize)> {
        let count = if self.has(LinearBug::TokenTailDropped) {
            (n / self.chunk).max(1)
        } else {
            n.div_ceil(self.chunk)
        };
        (0..count)
            .map(|c| (c * self.chunk, ((c + 1) * self.chunk).min(n)))
            .collect()
    }
}

impl LossOp for TokenChunkedLinearCrossEntropy {
    fn algorithms(&self) -> Vec<ShardedAlgorithm> {
        Vec::new()
    }

    fn options(&self) -> LossSupport {
        LossSupport::ALL
    }
}

impl LinearCrossEntropyOp for TokenChunkedLinearCrossEntropy {
    fn linear_cross_entropy(&self, c: LinearCall<'_>) -> Result<LinearLoss> {
        let LinearInput { hidden, weight } = c.input;
        let call = c.call;
        let config = call.config;
        let (n, h) = hidden.dim();
        let v = weight.nrows();
        // The reference's checks, in its order.
        check_shapes(n, v, &call)?;
        check_linear(hidden, weight, v, 0)?;
        check_logits_size("weight", n, v)?;
        config.validate(v)?;
        let targets = config.targets(call.targets, v)?;
        let (q_t, q_o) = config.target_distribution(v);
        let q = |i: usize, j: usize| match targets[i] {
            None => 0.0,
            Some(t) if t == j => q_t,
            Some(_) => q_o,
        };
        let chunks = self.token_chunks(n);
        let per_chunk_mean =
            self.has(LinearBug::MeanPerChunk) && config.reduction == Reduction::Mean;
        let mut weights =
            token_weights(&call, &targets, false, self.has(LinearBug::UpstreamScalar));
        if per_chunk_mean {
            // 1 / (counted tokens of the chunk x chunks) for each token.
            for &(t0, t1) in &chunks {
                let counted = mean_denominator(&targets[t0..t1], false);
                for i in t0..t1 {
                    weights[i] = match (counted, targets[i]) {
                        (0, _) | (_, None) => 0.0,
                        _ => {
                            let g = call.grad.upstream().map_or(1.0, |g| g[0]);
                            g / (counted * chunks.len()) as f64
                        }
                    };
                }
            }
        }
        let scan = RowScan::chunks_of(VOCAB_CHUNK);
        let want_grad = call.want_grad();
        let mut stats = vec![SoftmaxStats::EMPTY; n];
        let mut per_token_loss = Array1::zeros(n);
        let mut grad_hidden = Array2::zeros((n, h));
        let mut grad_weight = Array2::zeros((v, h));
        let flaws = (false, false);
        for &(t0, t1) in &chunks {
            let rows = Slice::from(t0..t1);
            let x = hidden.slice_axis(Axis(0), rows);
            let mut z = x.dot(&weight.t()); // [t1 - t0, v]: this chunk's logits
            if let Some(cap) = config.softcap {
                softcap::cap_columns(z.view_mut(), v, cap);
            }
            for (r, zr) in z.rows().into_iter().enumerate() {
                let i = t0 + r;
                let row = zr.to_vec();
                let st = scan.summary(&row, |j| q(i, j));
                check_row(i, &st, targets[i])?;
                per_token_loss[i] = token_loss(&st, targets[i], config.z_loss);
                stats[i] = st;
            }
            if !want_grad {
                continue;
            }
            let gz = Array2::from_shape_fn(z.dim(), |(r, j)| {
                let i = t0 + r;
                if weights[i] == 0.0 {
                    0.0
                } else {
                    logit_grad(&stats[i], (z[[r, j]], q(i, j), weights[i]), config, flaws)
                }
            });
            grad_hidden
                .slice_axis_mut(Axis(0), rows)
                .assign(&sum::matmul(gz.view(), weight));
            let mut gw = gz.t().dot(&x);
            if self.has(LinearBug::GradWeightVocabTail) && v > VOCAB_CHUNK {
                let covered = v / VOCAB_CHUNK * VOCAB_CHUNK;
                gw.slice_axis_mut(Axis(0), Slice::from(covered..)).fill(0.0);
            }
            if self.has(LinearBug::GradWeightLastChunk) {
                grad_weight.assign(&gw);
            } else {
                grad_weight += &gw;
            }
        }
        let counted = mean_denominator(&targets, false);
        let loss = if per_chunk_mean {
            let means: Vec<f64> = chunks
                .iter()
                .map(|&(t0, t1)| {
                    let part = per_token_loss
                        .slice_axis(Axis(0), Slice::from(t0..t1))
                        .to_vec();
                    reduce(
                        &part,
                        Reduction::Mean,
                        mean_denominator(&targets[t0..t1], false),
                    )
                })
                .collect();
            sum::sum(means.iter().copied()) / chunks.len() as f64
        } else {
            reduce(
                per_token_loss.as_slice().unwrap_or(&[]),
                config.reduction,
                counted,
            )
        };
        let ce = CrossEntropy {
            loss,
            per_token_loss,
            stats,
            num_tokens: counted,
            grad_logits: None,
        };
        Ok(LinearLoss {
            ce,
            grad_hidden: want_grad.then_some(grad_hidden),
            grad_weight: want_grad.then_some(grad_weight),
            logits_buffer_bytes: Some(self.chunk.min(n) * v * std::mem::size_of::<f64>()),
            traded: None,
        })
    }

    fn sharded_linear_cross_entropy(
        &self,
        plan: ShardPlan,
        _c: LinearCall<'_>,
    ) -> Result<ShardedLoss> {
        check_algorithm(&self.algorithms(), plan.algorithm)?;
        Err(Error::invalid("algorithm", "no sharded algorithm declared"))
    }
}
