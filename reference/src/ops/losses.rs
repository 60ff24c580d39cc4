//! The output layer's boundary: the cross-entropy, fused linear
//! cross-entropy and embedding ops, their calls, declared support and
//! results (re-exported from [`super`]).

use super::*;

/// Refuses a sharded algorithm an implementation does not declare.
///
/// # Errors
/// [`Error::InvalidArgument`] naming `algorithm`.
pub fn check_algorithm(declared: &[ShardedAlgorithm], algorithm: ShardedAlgorithm) -> Result<()> {
    if declared.contains(&algorithm) {
        return Ok(());
    }
    let names: Vec<&str> = declared.iter().map(|a| a.name()).collect();
    let list = if names.is_empty() {
        "the unsharded form only".to_string()
    } else {
        format!("unsharded and {}", names.join(", "))
    };
    Err(Error::invalid(
        "algorithm",
        format!("this implementation runs {list}, not {algorithm}"),
    ))
}

/// The [`crate::vocab::LossConfig`] options an output-layer implementation implements
/// beyond those every implementation must (`ignore_index`, label smoothing
/// in both conventions, z-loss, every reduction). What it does not, it
/// declares ([`LossOp::options`])
/// and refuses ([`LossSupport::check`]), as for algorithms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LossSupport {
    /// Logit soft-capping ([`crate::vocab::LossConfig::softcap`]).
    pub softcap: bool,
    /// A per-token or scalar upstream gradient
    /// ([`crate::vocab::GradRequest::Upstream`]; docs/FAULTS.md O2).
    pub grad_output: bool,
}

impl LossSupport {
    /// Every option (the reference).
    pub const ALL: LossSupport = LossSupport {
        softcap: true,
        grad_output: true,
    };
    /// Only the options every implementation must have.
    pub const BASIC: LossSupport = LossSupport {
        softcap: false,
        grad_output: false,
    };

    /// Whether `call` is within the support.
    pub fn covers(&self, call: &LossCall) -> bool {
        (self.softcap || call.config.softcap.is_none())
            && (self.grad_output || call.grad.upstream().is_none())
    }

    /// Refuses a `call` that uses an option outside the support.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the option (`softcap`,
    /// `grad_output`).
    pub fn check(&self, call: &LossCall) -> Result<()> {
        if let (false, Some(c)) = (self.softcap, call.config.softcap) {
            return Err(Error::invalid(
                "softcap",
                format!("this implementation has no logit soft-capping (softcap {c} asked for)"),
            ));
        }
        if let (false, Some(g)) = (self.grad_output, call.grad.upstream()) {
            return Err(Error::invalid(
                "grad_output",
                format!(
                    "this implementation takes no upstream gradient (grad_output of {} values given)",
                    g.len()
                ),
            ));
        }
        Ok(())
    }
}

/// What an implementation of either loss family ([`CrossEntropyOp`],
/// [`LinearCrossEntropyOp`]) declares it implements: the sharded algorithms
/// and the loss options. A call outside them is refused
/// ([`LossOp::check_declared`]), never answered.
///
/// The defaults are the safe minimum, as [`AttentionOp::support`]'s: no
/// sharded algorithm and only the basic options ([`LossSupport::BASIC`]);
/// every implementation declares what it does beyond them.
pub trait LossOp: Send + Sync {
    /// The sharded algorithms it implements (the unsharded form always);
    /// none by default.
    fn algorithms(&self) -> Vec<ShardedAlgorithm> {
        Vec::new()
    }

    /// The loss options it implements beyond the basic ones; none by default
    /// ([`LossSupport::BASIC`]).
    fn options(&self) -> LossSupport {
        LossSupport::BASIC
    }

    /// The one refusal of a call outside what it declares: `algorithm` (for
    /// a sharded call) not in [`LossOp::algorithms`] ([`check_algorithm`]),
    /// or an option of `call` not in [`LossOp::options`]
    /// ([`LossSupport::check`]).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming `algorithm`, `softcap` or
    /// `grad_output`.
    fn check_declared(&self, algorithm: Option<ShardedAlgorithm>, call: &LossCall) -> Result<()> {
        if let Some(a) = algorithm {
            check_algorithm(&self.algorithms(), a)?;
        }
        self.options().check(call)
    }
}

/// Cross-entropy of given logits (Vaswani et al. with PyTorch's and
/// Megatron-LM's options: `ignore_index`, label smoothing, z-loss,
/// reduction; [`crate::vocab::LossConfig`]), unsharded and split by vocabulary over `p`
/// shards (Yeung et al., arXiv:2411.05288).
///
/// Errors are the reference's ([`crate::vocab::cross_entropy()`]).
pub trait CrossEntropyOp: LossOp {
    /// Unsharded: `c.input` the logits `[n, v]`, `c.call.targets: [n]`;
    /// `grad_logits: [n, v]` when `c.call` asks for gradients (scaled by its
    /// upstream gradient, [`LossCall::token_weights`]).
    ///
    /// # Errors
    /// See the trait docs.
    fn cross_entropy(&self, c: CeCall<'_>) -> Result<CrossEntropy>;

    /// Sharded by `plan.map` with `plan.algorithm`: `c.input` the logits
    /// `[n, w]` (`w >= v`; columns `v..` are padding values that must never
    /// be read), every rank's results.
    ///
    /// # Errors
    /// See the trait docs; [`check_algorithm`] for an undeclared algorithm.
    fn sharded_cross_entropy(&self, plan: ShardPlan, c: CeCall<'_>) -> Result<ShardedLoss>;
}

/// The unsharded output layer's results.
#[derive(Debug, Clone, PartialEq)]
pub struct LinearLoss {
    /// The cross-entropy of the logits (`grad_logits: [n, v]` where the
    /// implementation materializes it; a fused kernel may leave it `None`).
    pub ce: CrossEntropy,
    /// `[n, h]` with `want_grad`.
    pub grad_hidden: Option<Array2<f64>>,
    /// `[v, h]` with `want_grad`.
    pub grad_weight: Option<Array2<f64>>,
    /// Bytes of the largest logits buffer it held at once, where it reports it.
    pub logits_buffer_bytes: Option<usize>,
    /// What an approximate kernel traded for speed (gradient filtering,
    /// Wijmans et al. 2024, §4.3); `None` for an implementation that trades
    /// nothing. The suites widen the gradients' allowance by it, and only them.
    pub traded: Option<TradedError>,
}

impl LinearLoss {
    /// The results of an implementation that reports no logits buffer and
    /// trades nothing for speed: `ce`, `grad_hidden: [n, h]`, `grad_weight:
    /// [v, h]`.
    pub fn new(
        ce: CrossEntropy,
        grad_hidden: Option<Array2<f64>>,
        grad_weight: Option<Array2<f64>>,
    ) -> Self {
        LinearLoss {
            ce,
            grad_hidden,
            grad_weight,
            logits_buffer_bytes: None,
            traded: None,
        }
    }
}

/// A rigorous bound on the error a kernel introduced on purpose in the
/// output layer's gradients (beyond rounding), as it reports it: the suites
/// add it to the allowance of `dL/dhidden` and `dL/dW` (and nothing else),
/// so an error beyond it still fails.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TradedError {
    /// The largest absolute error of any element of `dL/dhidden` it allows
    /// itself (same units as the gradient).
    pub grad_hidden: f64,
    /// The largest absolute error of any element of `dL/dW`.
    pub grad_weight: f64,
    /// Tiles of `dL/dlogits` whose products were skipped.
    pub skipped_tiles: usize,
}

/// The output layer `logits = hidden @ weight^T` and its cross-entropy,
/// unsharded and vocabulary-parallel.
///
/// Errors are the reference's ([`crate::vocab::linear_cross_entropy()`]).
pub trait LinearCrossEntropyOp: LossOp {
    /// Unsharded: `c.input.hidden: [n, h]`, `c.input.weight: [v, h]`,
    /// `c.call.targets: [n]`.
    ///
    /// # Errors
    /// See the trait docs.
    fn linear_cross_entropy(&self, c: LinearCall<'_>) -> Result<LinearLoss>;

    /// Sharded by `plan.map` with `plan.algorithm`: `c.input.weight: [w, h]`
    /// (`w >= v`; rows `v..` are padding values that must never be read).
    ///
    /// # Errors
    /// See the trait docs; [`check_algorithm`] for an undeclared algorithm.
    fn sharded_linear_cross_entropy(
        &self,
        plan: ShardPlan,
        c: LinearCall<'_>,
    ) -> Result<ShardedLoss>;
}

/// The output layer's inputs, which travel together: `hidden: [n, h]` and
/// `weight: [v, h]` (`[w, h]` with `w >= v` sharded, rows `v..` padding).
#[derive(Debug, Clone, Copy)]
pub struct LinearInput<'a> {
    /// `[n, h]`: the hidden states.
    pub hidden: ArrayView2<'a, f64>,
    /// `[v, h]` (`[w, h]` sharded): the output layer's weight.
    pub weight: ArrayView2<'a, f64>,
}

impl<'a> LinearInput<'a> {
    /// `hidden` through `weight`.
    pub fn new(hidden: ArrayView2<'a, f64>, weight: ArrayView2<'a, f64>) -> Self {
        LinearInput { hidden, weight }
    }
}

/// One loss call's inputs, which travel together: `input` the logits
/// ([`CeCall`]) or the hidden states and the output layer's weight
/// ([`LinearCall`]), and the call (`targets: [n]`, options, gradient
/// request). What [`CrossEntropyOp`] and [`LinearCrossEntropyOp`] take.
#[derive(Debug, Clone, Copy)]
pub struct LossInputs<'a, X> {
    /// `logits: [n, v]`, or the output layer's [`LinearInput`] (`hidden:
    /// [n, h]`, `weight: [v, h]`); sharded,
    /// `w >= v` columns of logits or rows of the weight.
    pub input: X,
    /// The targets, the loss's options and the gradient request.
    pub call: LossCall<'a>,
}

impl<'a, X> LossInputs<'a, X> {
    /// The call's inputs as one value.
    pub fn new(input: X, call: LossCall<'a>) -> Self {
        LossInputs { input, call }
    }

    /// The same inputs with another call (another config, another
    /// gradient request).
    pub fn with_call(self, call: LossCall<'a>) -> Self {
        LossInputs { call, ..self }
    }
}

/// A cross-entropy call: `input` the logits, `[n, v]` (`[n, w]` sharded).
pub type CeCall<'a> = LossInputs<'a, ArrayView2<'a, f64>>;

/// An output-layer call: `input` is `hidden: [n, h]` and `weight: [v, h]`
/// (`[w, h]` sharded).
pub type LinearCall<'a> = LossInputs<'a, LinearInput<'a>>;

/// The unsharded embedding's results.
#[derive(Debug, Clone, PartialEq)]
pub struct Embedding {
    /// `[n, h]`: row `ids[i]` of the weight.
    pub output: Array2<f64>,
    /// `[v, h]` with a `grad_output`.
    pub grad_weight: Option<Array2<f64>>,
}

/// One embedding call's inputs, which travel together: `ids: [n]`,
/// `weight: [v, h]` (`[w, h]` with `w >= v` sharded, rows `v..` padding),
/// and `grad_output: [n, h]` where the weight gradient is asked for.
#[derive(Debug, Clone, Copy)]
pub struct EmbeddingCall<'a> {
    /// `[n]`: rows of the weight to look up (each in `0..v`).
    pub ids: &'a [i64],
    /// `[v, h]`, or `[w, h]` with `w >= v` sharded.
    pub weight: ArrayView2<'a, f64>,
    /// `[n, h]`, where the weight gradient is asked for.
    pub grad_output: Option<ArrayView2<'a, f64>>,
}

impl<'a> EmbeddingCall<'a> {
    /// `ids` looked up in `weight`, with the upstream gradient `grad_output`
    /// where the weight gradient is asked for.
    pub fn new(
        ids: &'a [i64],
        weight: ArrayView2<'a, f64>,
        grad_output: Option<ArrayView2<'a, f64>>,
    ) -> Self {
        EmbeddingCall {
            ids,
            weight,
            grad_output,
        }
    }
}

/// The input embedding lookup `weight[ids]` and its weight gradient,
/// unsharded and split by vocabulary rows (docs/FAULTS.md V5: an id out of range
/// is [`Error::IndexOutOfRange`] in both).
pub trait EmbeddingOp: Send + Sync {
    /// Unsharded: `call.ids: [n]`, `call.weight: [v, h]`,
    /// `call.grad_output: [n, h]`.
    ///
    /// # Errors
    /// As [`crate::vocab::embedding::embedding_forward`].
    fn embedding(&self, call: EmbeddingCall<'_>) -> Result<Embedding>;

    /// Sharded by `map`: `call.weight: [w, h]` (`w >= v`, rows `v..` padding).
    ///
    /// # Errors
    /// As [`crate::vocab::embedding::sharded_embedding`].
    fn sharded_embedding(
        &self,
        map: &ShardMap,
        call: EmbeddingCall<'_>,
    ) -> Result<ShardedEmbedding>;
}
