//! The op families of packshard: one trait per family, the contract every
//! implementation of that op meets — the f64 reference of this crate, the
//! optimized CPU and GPU kernels of `packshard-optimized`, and a framework
//! author's kernel. The equivalence suites, the fuzz harness, `packshard
//! eval`, the benchmarks and the golden checks take implementations through
//! these traits only; `packshard-oracle`'s registry lists them as values.
//!
//! | trait | family | reference |
//! |---|---|---|
//! | [`AttentionOp`] | varlen and masked attention, forward and backward | [`crate::attention::ReferenceAttention`] |
//! | [`CrossEntropyOp`] | cross-entropy of logits, unsharded and vocabulary-parallel | [`crate::vocab::ReferenceCrossEntropy`] |
//! | [`LinearCrossEntropyOp`] | the output layer `hidden @ weight^T` and its cross-entropy | [`crate::vocab::ReferenceLinearCrossEntropy`] |
//! | [`EmbeddingOp`] | the input embedding and its weight gradient | [`crate::vocab::ReferenceEmbedding`] |
//! | [`EncoderLayerOp`] | one BERT encoder layer, forward and backward | [`crate::bert::layer::ReferenceLayer`] |
//!
//! **At the boundary every tensor is f64.** An implementation that computes
//! in f32 or bf16 rounds its inputs on entry (refusing finite values beyond
//! its range with [`Error::InvalidArgument`] naming the field and index) and
//! widens its results on exit, exactly; so its results are judged against the
//! reference in one type, and its errors are the reference's: the same
//! [`Error::kind`] for the same bad input.
//!
//! **No silent fallback.** An implementation answers with its own numbers or
//! with an error: what it does not implement (an algorithm, grouped-query
//! attention, a causal mask, a loss option such as the softcap) it declares
//! ([`AttentionOp::support`], [`LossOp::algorithms`],
//! [`LossOp::options`]) and refuses with
//! [`Error::InvalidArgument`]; it never hands the call to the reference.
//!
//! Shape legend as in the crate docs: `n_q`/`n_k` query/key tokens, `h`
//! query heads, `h_kv` key/value heads, `d` head dim, `n` tokens, `v`
//! vocabulary, `w >= v` the given rows/columns (Megatron-style padding), `h`
//! also the hidden size of the output layer, `p` shards.

use ndarray::{Array2, Array3, ArrayView2, ArrayView3};

use crate::bert::LayerParams;
use crate::error::{Error, Result};
use crate::vocab::cross_entropy::CrossEntropy;
use crate::vocab::embedding::ShardedEmbedding;
use crate::vocab::sharded::ShardedLoss;
use crate::vocab::{LossCall, ShardMap, ShardPlan, ShardedAlgorithm};

/// What an implementation computes in: one type for the workspace, with
/// its unit roundoff and its one rounding (see [`crate::precision`]).
pub use crate::precision::Precision;

mod losses;
pub use losses::*;

// ---- attention -------------------------------------------------------------

/// flash-attention's `window_size = (left, right)`: how many keys before
/// (`left`) and after (`right`) a query's diagonal it may see; `None` is
/// flash-attention's `-1`, unbounded. `(None, None)` is no window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Window {
    /// Keys before the diagonal (`None`: all).
    pub left: Option<usize>,
    /// Keys after the diagonal (`None`: all).
    pub right: Option<usize>,
}

impl Window {
    /// No window (flash-attention's `(-1, -1)`).
    pub const UNBOUNDED: Window = Window {
        left: None,
        right: None,
    };

    /// From flash-attention's pair: `-1` is unbounded.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming `window_size[0]` or `window_size[1]`
    /// for a value below `-1`.
    pub fn from_flash(left: i64, right: i64) -> Result<Window> {
        let side = |x: i64, field: &str| -> Result<Option<usize>> {
            match x {
                -1 => Ok(None),
                x if x >= 0 => usize::try_from(x)
                    .map(Some)
                    .map_err(|_| Error::invalid(field, format!("{x} does not fit a usize"))),
                x => Err(Error::invalid(
                    field,
                    format!("{x}: a window side is -1 (unbounded) or at least 0"),
                )),
            }
        };
        Ok(Window {
            left: side(left, "window_size[0]")?,
            right: side(right, "window_size[1]")?,
        })
    }

    /// flash-attention's pair (`-1`: unbounded).
    pub fn to_flash(self) -> (i64, i64) {
        let f = |x: Option<usize>| x.map_or(-1, |x| i64::try_from(x).unwrap_or(i64::MAX));
        (f(self.left), f(self.right))
    }

    /// True for `(-1, -1)`.
    pub fn is_unbounded(self) -> bool {
        self == Window::UNBOUNDED
    }
}

/// Output of an attention forward pass, in `f64` here (the optimized
/// kernels' `AttentionOutput32` is the same struct in `f32`).
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionOutput<T = f64> {
    /// `[n_q, h, d]`.
    pub output: Array3<T>,
    /// `[h, n_q]`, natural log; `-inf` for a query with no allowed key.
    pub lse: Array2<T>,
}

/// Gradients of an attention pass, in `f64` here (the optimized kernels'
/// `AttentionGrads32` is the same struct in `f32`).
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionGrads<T = f64> {
    /// `[n_q, h, d]`.
    pub grad_q: Array3<T>,
    /// `[n_k, h_kv, d]`: summed over the query heads that share each key head.
    pub grad_k: Array3<T>,
    /// `[n_k, h_kv, d]`.
    pub grad_v: Array3<T>,
}

/// Where the model's attention runs: the token layout of one batch.
#[derive(Debug, Clone, PartialEq)]
pub enum AttentionLayout {
    /// `allowed.len()` rows of `row_len` tokens each (`n = rows * row_len`),
    /// row `r` being tokens `r * row_len..(r + 1) * row_len`, with a dense mask
    /// `allowed[r]: [row_len, row_len]` per row. The padded batch (key padding
    /// mask) and the packed batch with a block-diagonal mask use this form.
    Dense {
        /// Tokens per row.
        row_len: usize,
        /// Per row, `[row_len, row_len]`: query `i` may attend to key `j`.
        allowed: Vec<Array2<bool>>,
    },
    /// Unpadded tokens of back-to-back segments, `cu_seqlens: [b + 1]`
    /// (flash-attention's varlen form), bidirectional.
    Varlen {
        /// `[b + 1]`, leading 0, last = `n_tok`.
        cu_seqlens: Vec<usize>,
    },
}

impl AttentionLayout {
    /// Tokens covered by the layout.
    pub fn num_tokens(&self) -> usize {
        match self {
            AttentionLayout::Dense { row_len, allowed } => row_len * allowed.len(),
            AttentionLayout::Varlen { cu_seqlens } => cu_seqlens.last().copied().unwrap_or(0),
        }
    }
}

/// One variable-length attention problem, the arguments of flash-attention's
/// `flash_attn_varlen_func` besides the tensors: segment `s` is queries
/// `cu_seqlens_q[s]..cu_seqlens_q[s + 1]` over keys
/// `cu_seqlens_k[s]..cu_seqlens_k[s + 1]` (both `[b + 1]`, leading 0); causal
/// masks are bottom-right aligned ([`crate::attention`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Varlen<'a> {
    /// `[b + 1]`: query offsets, last = `n_q`.
    pub cu_seqlens_q: &'a [usize],
    /// `[b + 1]`: key offsets, last = `n_k`.
    pub cu_seqlens_k: &'a [usize],
    /// Each query sees only keys at or before its position (bottom-right).
    pub causal: bool,
    /// Multiplies `q . k` (`1/sqrt(d)` by default, [`crate::attention::default_scale`]).
    pub scale: f64,
    /// flash-attention's `window_size` (bottom-right aligned;
    /// [`Window::UNBOUNDED`] by default).
    pub window: Window,
    /// flash-attention's `softcap`: scores become `softcap * tanh(s /
    /// softcap)` before the mask; 0 (the default) is none.
    pub softcap: f64,
    /// flash-attention's `alibi_slopes: [h]`, one per query head: the bias
    /// `-slope * |r + l_k - l_q - c|` ([`crate::attention::options`]).
    pub alibi_slopes: Option<&'a [f64]>,
    /// flash-attention's `seqused_k: [b]`: segment `s` uses only its first
    /// `seqused_k[s]` keys (at most its `l_k`), and aligns on that count.
    pub seqused_k: Option<&'a [usize]>,
}

impl<'a> Varlen<'a> {
    /// Self-attention over one `cu_seqlens` (queries and keys the same tokens).
    pub fn new(cu_seqlens: &'a [usize], causal: bool, scale: f64) -> Self {
        Varlen {
            cu_seqlens_q: cu_seqlens,
            cu_seqlens_k: cu_seqlens,
            causal,
            scale,
            window: Window::UNBOUNDED,
            softcap: 0.0,
            alibi_slopes: None,
            seqused_k: None,
        }
    }

    /// Queries over other keys: `cu_seqlens_k` may differ from `cu_seqlens_q`
    /// (a continuation chunk over cached keys, docs/FAULTS.md C5).
    pub fn cross(
        cu_seqlens_q: &'a [usize],
        cu_seqlens_k: &'a [usize],
        causal: bool,
        scale: f64,
    ) -> Self {
        Varlen {
            cu_seqlens_q,
            cu_seqlens_k,
            causal,
            scale,
            window: Window::UNBOUNDED,
            softcap: 0.0,
            alibi_slopes: None,
            seqused_k: None,
        }
    }

    /// True when queries and keys have the same offsets.
    pub fn is_self(&self) -> bool {
        self.cu_seqlens_q == self.cu_seqlens_k
    }

    /// The same problem with `window_size` `w`.
    pub fn with_window(self, window: Window) -> Self {
        Varlen { window, ..self }
    }

    /// The same problem with score cap `softcap` (0: none).
    pub fn with_softcap(self, softcap: f64) -> Self {
        Varlen { softcap, ..self }
    }

    /// The same problem with ALiBi slopes `[h]`.
    pub fn with_alibi_slopes(self, alibi_slopes: Option<&'a [f64]>) -> Self {
        Varlen {
            alibi_slopes,
            ..self
        }
    }

    /// The same problem with key counts `seqused_k: [b]`.
    pub fn with_seqused_k(self, seqused_k: Option<&'a [usize]>) -> Self {
        Varlen { seqused_k, ..self }
    }

    /// The keys segment `s` uses: `seqused_k[s]` when given, else its `l_k`
    /// (after [`crate::attention::check_varlen`], at most `l_k`).
    pub fn used_keys(&self, s: usize) -> usize {
        let lk = self.cu_seqlens_k[s + 1] - self.cu_seqlens_k[s];
        self.seqused_k
            .and_then(|u| u.get(s).copied())
            .map_or(lk, |u| u.min(lk))
    }

    /// True when any option beyond `causal` is set (window, softcap,
    /// ALiBi, `seqused_k`).
    pub fn has_options(&self) -> bool {
        !self.window.is_unbounded()
            || self.softcap != 0.0
            || self.alibi_slopes.is_some()
            || self.seqused_k.is_some()
    }
}

/// What an [`AttentionOp`] implements beyond bidirectional self-attention
/// with `h_kv == h`, which every implementation must.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionSupport {
    /// Causal (bottom-right) masks.
    pub causal: bool,
    /// `h_kv < h` (grouped-query and multi-query attention).
    pub gqa: bool,
    /// `cu_seqlens_k != cu_seqlens_q`.
    pub cross: bool,
    /// flash-attention's `window_size` (sliding-window attention).
    pub window: bool,
    /// flash-attention's `softcap` on the scores.
    pub softcap: bool,
    /// flash-attention's `alibi_slopes`.
    pub alibi: bool,
    /// flash-attention's `seqused_k`.
    pub seqused_k: bool,
    /// The largest head dim `d` the kernel takes (`usize::MAX`: any; a GPU
    /// kernel whose tile holds a row of `q` in registers or shared memory
    /// has a bound, flash-attention 2's is 256).
    pub max_head_dim: usize,
}

impl AttentionSupport {
    /// Everything the family allows (the reference).
    pub const ALL: AttentionSupport = AttentionSupport {
        causal: true,
        gqa: true,
        cross: true,
        window: true,
        softcap: true,
        alibi: true,
        seqused_k: true,
        max_head_dim: usize::MAX,
    };
    /// Causal, GQA and cross attention, none of flash-attention's other
    /// options (window, softcap, ALiBi, `seqused_k`).
    pub const CAUSAL_GQA_CROSS: AttentionSupport = AttentionSupport {
        window: false,
        softcap: false,
        alibi: false,
        seqused_k: false,
        ..AttentionSupport::ALL
    };
    /// Bidirectional self-attention with `h_kv == h`: what every
    /// implementation must do, and all an [`AttentionOp`] claims unless it
    /// declares more (a kernel that never applies a causal mask must not
    /// claim one by default).
    pub const BIDIRECTIONAL: AttentionSupport = AttentionSupport {
        causal: false,
        gqa: false,
        cross: false,
        window: false,
        softcap: false,
        alibi: false,
        seqused_k: false,
        max_head_dim: usize::MAX,
    };
    /// Self-attention with `h_kv == h`, causal or not.
    pub const SELF_MHA: AttentionSupport = AttentionSupport {
        causal: true,
        ..AttentionSupport::BIDIRECTIONAL
    };

    /// The same support with head dims up to `d` only.
    pub const fn with_max_head_dim(self, d: usize) -> Self {
        AttentionSupport {
            max_head_dim: d,
            ..self
        }
    }

    /// `Ok` when a problem of `h_kv` key heads for `h` query heads is within
    /// the support (the head dim is checked by [`AttentionSupport::check_head_dim`]).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming `causal`, `k`, `cu_seqlens_k`,
    /// `window_size`, `softcap`, `alibi_slopes` or `seqused_k`.
    pub fn check(&self, p: &Varlen<'_>, h: usize, h_kv: usize) -> Result<()> {
        let refuse = |field: &str, what: &str| {
            Err(Error::invalid(
                field,
                format!("this implementation has no {what} (it declares no support for it)"),
            ))
        };
        if !p.window.is_unbounded() && !self.window {
            return refuse("window_size", "sliding window");
        }
        if p.softcap != 0.0 && !self.softcap {
            return refuse("softcap", "score soft cap");
        }
        if p.alibi_slopes.is_some() && !self.alibi {
            return refuse("alibi_slopes", "ALiBi");
        }
        if p.seqused_k.is_some() && !self.seqused_k {
            return refuse("seqused_k", "key counts per segment");
        }
        if p.causal && !self.causal {
            return Err(Error::invalid(
                "causal",
                "this implementation has no causal mask",
            ));
        }
        if h_kv != h && !self.gqa {
            return Err(Error::invalid(
                "k",
                format!("{h_kv} key heads for {h} query heads: this implementation needs h_kv == h (no grouped-query attention)"),
            ));
        }
        if !p.is_self() && !self.cross {
            return Err(Error::invalid(
                "cu_seqlens_k",
                "differs from cu_seqlens_q: this implementation runs self-attention only",
            ));
        }
        Ok(())
    }

    /// `Ok` when head dim `d` is within [`AttentionSupport::max_head_dim`].
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming `q`.
    pub fn check_head_dim(&self, d: usize) -> Result<()> {
        if d > self.max_head_dim {
            return Err(Error::invalid(
                "q",
                format!(
                    "head dim {d}: this implementation takes head dims up to {}",
                    self.max_head_dim
                ),
            ));
        }
        Ok(())
    }
}

/// One attention call's inputs: `q: [n_q, h, d]`, `k, v: [n_k, h_kv, d]`
/// (`h_kv` divides `h`; query head `a` reads key head `a / (h / h_kv)`).
#[derive(Debug, Clone, Copy)]
pub struct Qkv<'a> {
    /// `[n_q, h, d]`: queries.
    pub q: ArrayView3<'a, f64>,
    /// `[n_k, h_kv, d]`: keys.
    pub k: ArrayView3<'a, f64>,
    /// `[n_k, h_kv, d]`: values.
    pub v: ArrayView3<'a, f64>,
}

impl<'a> Qkv<'a> {
    /// The three views as one value.
    pub fn new(q: ArrayView3<'a, f64>, k: ArrayView3<'a, f64>, v: ArrayView3<'a, f64>) -> Self {
        Qkv { q, k, v }
    }

    /// Query rows `rows` over key rows `rows` (one row of a dense layout).
    pub fn rows(self, rows: ndarray::Slice) -> Self {
        let axis = ndarray::Axis(0);
        Qkv {
            q: self.q.slice_axis_move(axis, rows),
            k: self.k.slice_axis_move(axis, rows),
            v: self.v.slice_axis_move(axis, rows),
        }
    }
}

/// One dense attention problem, the arguments of the masked form besides
/// the tensors: `allowed: [n_q, n_k]`, `allowed[[i, j]]` when query `i` may
/// attend to key `j` (Hugging Face's additive `0 / -inf` mask as booleans).
#[derive(Debug, Clone, Copy)]
pub struct Masked<'a> {
    /// `[n_q, n_k]`: query `i` may attend to key `j`.
    pub allowed: ArrayView2<'a, bool>,
    /// Multiplies `q . k` (`1/sqrt(d)` by default, [`crate::attention::default_scale`]).
    pub scale: f64,
}

impl<'a> Masked<'a> {
    /// `allowed: [n_q, n_k]` with `scale`.
    pub fn new(allowed: ArrayView2<'a, bool>, scale: f64) -> Self {
        Masked { allowed, scale }
    }
}

/// The gradient a backward receives besides the call's inputs:
/// `grad_output: [n_q, h, d]`, the loss's gradient with respect to the
/// forward's output, with that forward's result `fwd` (`output: [n_q, h,
/// d]`, `lse: [h, n_q]`, from which flash-attention's backward recomputes
/// the probabilities).
#[derive(Debug, Clone, Copy)]
pub struct Grad<'a> {
    /// The forward's result on the same inputs.
    pub fwd: &'a AttentionOutput,
    /// `[n_q, h, d]`.
    pub grad_output: ArrayView3<'a, f64>,
}

impl<'a> Grad<'a> {
    /// The forward's result and the incoming gradient as one value.
    pub fn new(fwd: &'a AttentionOutput, grad_output: ArrayView3<'a, f64>) -> Self {
        Grad { fwd, grad_output }
    }
}

/// Attention in its two forms: variable-length over `cu_seqlens` (the packed
/// batch, [`Varlen`]) and dense with a boolean mask (the padded batch, or a
/// packed one with a block-diagonal mask, [`Masked`]). Shapes: the inputs
/// [`Qkv`] (`q: [n_q, h, d]`, `k, v: [n_k, h_kv, d]`); results `output: [n_q,
/// h, d]`, `lse: [h, n_q]` (natural log, `-inf` for a query with no allowed
/// key, whose output and gradients are 0: docs/FAULTS.md P8), `grad_q: [n_q,
/// h, d]`, `grad_k, grad_v: [n_k, h_kv, d]`; a backward's [`Grad`]
/// (`fwd`, `grad_output: [n_q, h, d]`).
///
/// Errors are the reference's ([`crate::attention`]): shapes
/// ([`Error::ShapeMismatch`]), offsets ([`Error::InvalidArgument`] naming
/// `cu_seqlens[i]`), non-finite inputs ([`Error::NonFiniteInput`]).
pub trait AttentionOp: Send + Sync {
    /// What it implements beyond bidirectional self-attention with `h_kv == h`
    /// (by default nothing: [`AttentionSupport::BIDIRECTIONAL`]).
    fn support(&self) -> AttentionSupport {
        AttentionSupport::BIDIRECTIONAL
    }

    /// The varlen forward: the segments of `p` (causal ones bottom-right
    /// aligned).
    ///
    /// # Errors
    /// See the trait docs.
    fn varlen_forward(&self, x: Qkv<'_>, p: &Varlen<'_>) -> Result<AttentionOutput>;

    /// The varlen backward of the forward `g.fwd` on the same inputs.
    ///
    /// # Errors
    /// See the trait docs.
    fn varlen_backward(&self, x: Qkv<'_>, p: &Varlen<'_>, g: Grad<'_>) -> Result<AttentionGrads>;

    /// The dense forward: query `i` attends to key `j` when
    /// `m.allowed[[i, j]]` (`[n_q, n_k]`).
    ///
    /// # Errors
    /// See the trait docs.
    fn masked_forward(&self, x: Qkv<'_>, m: Masked<'_>) -> Result<AttentionOutput>;

    /// The dense backward of the forward `g.fwd` on the same inputs.
    ///
    /// # Errors
    /// See the trait docs.
    fn masked_backward(&self, x: Qkv<'_>, m: Masked<'_>, g: Grad<'_>) -> Result<AttentionGrads>;
}

// ---- the output layer: `ops/losses.rs` -------------------------------------------

// ---- the encoder layer ---------------------------------------------------------

/// One encoder layer's forward and backward results.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerPass {
    /// `[n, hidden]`.
    pub output: Array2<f64>,
    /// `[n, hidden]`: the gradient of the input.
    pub grad_x: Array2<f64>,
    /// Every parameter's gradient.
    pub grads: LayerParams,
}

/// One encoder layer: its parameters, heads and LayerNorm epsilon.
#[derive(Debug, Clone, Copy)]
pub struct Layer<'a> {
    /// The parameters (`hidden` = their width).
    pub params: &'a LayerParams,
    /// Attention heads (`hidden / num_heads` = head dim).
    pub num_heads: usize,
    /// LayerNorm's epsilon (`layer_norm_eps`).
    pub eps: f64,
}

impl<'a> Layer<'a> {
    /// A layer of `params` with `num_heads` heads and LayerNorm epsilon `eps`.
    pub fn new(params: &'a LayerParams, num_heads: usize, eps: f64) -> Self {
        Layer {
            params,
            num_heads,
            eps,
        }
    }
}

/// One pass through a layer: the input `x: [n, hidden]` over a token
/// `layout`, and the upstream gradient `grad_output: [n, hidden]`.
#[derive(Debug, Clone, Copy)]
pub struct LayerInput<'a> {
    /// `[n, hidden]`.
    pub x: ArrayView2<'a, f64>,
    /// Which tokens attend to which.
    pub layout: &'a AttentionLayout,
    /// `[n, hidden]`.
    pub grad_output: ArrayView2<'a, f64>,
}

impl<'a> LayerInput<'a> {
    /// `x` over `layout`, with the upstream gradient `grad_output`.
    pub fn new(
        x: ArrayView2<'a, f64>,
        layout: &'a AttentionLayout,
        grad_output: ArrayView2<'a, f64>,
    ) -> Self {
        LayerInput {
            x,
            layout,
            grad_output,
        }
    }
}

/// One BERT encoder layer (post-LayerNorm, Hugging Face's `BertLayer`),
/// forward and backward, over a token layout.
pub trait EncoderLayerOp: Send + Sync {
    /// Forward and backward.
    ///
    /// # Errors
    /// Shape or layout errors, as [`crate::bert::layer::layer_forward`].
    fn forward_backward(&self, layer: Layer<'_>, input: LayerInput<'_>) -> Result<LayerPass>;
}
