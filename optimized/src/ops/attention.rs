//! The f32/bf16 attention kernels as [`AttentionOp`]s: inputs rounded on
//! entry ([`crate::convert`]), results widened on exit.

use ndarray::{Array2, Array3, ArrayView3};
use packshard_reference::attention::{
    check_grad_values, check_masked_work, check_qkv_shapes, check_scores, check_varlen,
    check_varlen_options, check_varlen_work, AttentionGrads, AttentionOutput, MAX_ATTENTION_WORK,
};
use packshard_reference::ops::{
    AttentionOp, AttentionSupport, Grad, Masked, Precision, Qkv, Varlen,
};
use packshard_reference::{Error, Result};

use crate::attention::{
    dense_masked_attention_backward_with, dense_masked_attention_with, varlen_attention_general,
    varlen_attention_general_backward, AttentionGrads32, AttentionOutput32, ScoreOptions,
    TILED_SUPPORT,
};
use crate::convert::{to_bf16, to_f32, to_f64};
use packshard_reference::attention::options::visible_keys;

/// The most tokens the dense masked kernel takes in its varlen form: it
/// builds an `[n_tok, n_tok]` boolean mask (64 MiB at this size).
pub const MAX_DENSE_TOKENS: usize = 8192;

fn widen(out: AttentionOutput32) -> AttentionOutput {
    AttentionOutput {
        output: to_f64(out.output.view()),
        lse: to_f64(out.lse.view()),
    }
}

fn widen_grads(g: AttentionGrads32) -> AttentionGrads {
    AttentionGrads {
        grad_q: to_f64(g.grad_q.view()),
        grad_k: to_f64(g.grad_k.view()),
        grad_v: to_f64(g.grad_v.view()),
    }
}

/// A backward's forward result (f32 values held in f64) and incoming
/// gradient, in f32.
fn narrow(g: Grad<'_>) -> Result<(AttentionOutput32, Array3<f32>)> {
    let fwd = AttentionOutput32 {
        output: to_f32("output", g.fwd.output.view())?,
        lse: g.fwd.lse.mapv(|v| v as f32),
    };
    Ok((fwd, to_f32("grad_output", g.grad_output)?))
}

/// Runs `$call` with `q, k, v` of `$x` rounded to `$precision` (f32 or bf16).
macro_rules! with_inputs {
    ($precision:expr, $x:expr, |$qq:ident, $kk:ident, $vv:ident| $call:expr) => {{
        let Qkv { q, k, v } = $x;
        match $precision {
            Precision::Bf16 => {
                let ($qq, $kk, $vv) = (to_bf16("q", q)?, to_bf16("k", k)?, to_bf16("v", v)?);
                let ($qq, $kk, $vv) = ($qq.view(), $kk.view(), $vv.view());
                $call
            }
            _ => {
                let ($qq, $kk, $vv) = (to_f32("q", q)?, to_f32("k", k)?, to_f32("v", v)?);
                let ($qq, $kk, $vv) = ($qq.view(), $kk.view(), $vv.view());
                $call
            }
        }
    }};
}

/// Checks a varlen problem as the reference does, then what this kernel
/// supports.
fn check_problem(
    support: AttentionSupport,
    Qkv { q, k, v }: &Qkv<'_>,
    p: &Varlen<'_>,
) -> Result<()> {
    check_problem_of(support, (q, k, v), p)
}

/// [`check_problem`] on views of any element type that widens to `f64`.
fn check_problem_of<T: Copy + Into<f64>>(
    support: AttentionSupport,
    (q, k, v): (&ArrayView3<T>, &ArrayView3<T>, &ArrayView3<T>),
    p: &Varlen<'_>,
) -> Result<()> {
    check_qkv_shapes(q.shape(), k.shape(), v.shape())?;
    check_varlen(p, q.dim().0, k.dim().0)?;
    support.check(p, q.dim().1, k.dim().1)?;
    check_varlen_options(p, q.dim().1)?;
    check_scores(q, k, p.scale)
}

/// Checks a dense problem: the square mask this kernel needs, the scores.
fn check_dense(Qkv { q, k, v }: &Qkv<'_>, scale: f64) -> Result<()> {
    check_qkv_shapes(q.shape(), k.shape(), v.shape())?;
    if k.dim().0 != q.dim().0 {
        return Err(Error::invalid(
            "k",
            format!(
                "has {} tokens for {} queries: the dense kernel needs a square [n, n] mask",
                k.dim().0,
                q.dim().0
            ),
        ));
    }
    check_scores(q, k, scale)
}

/// `attention_varlen_tiled` (f32 inputs) and `attention_varlen_tiled_bf16`
/// (bf16 inputs, f32 accumulation): the varlen form through
/// [`varlen_attention_general`] (online softmax per 64 x 64 tile of each
/// segment, never a mask; grouped-query attention, `cu_seqlens_k !=
/// cu_seqlens_q` with bottom-right causal masks, and flash-attention's
/// `window_size`, `softcap`, `alibi_slopes` and `seqused_k`:
/// [`TILED_SUPPORT`], [`AttentionSupport::ALL`]),
/// the masked form (square `[n, n]` masks) through
/// [`crate::attention::dense_masked_attention`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TiledAttention {
    /// What `q`, `k`, `v` are rounded to: [`Precision::F32`] or [`Precision::Bf16`].
    pub precision: Precision,
}

impl TiledAttention {
    /// f32 inputs.
    pub const F32: TiledAttention = TiledAttention {
        precision: Precision::F32,
    };
    /// bf16 inputs.
    pub const BF16: TiledAttention = TiledAttention {
        precision: Precision::Bf16,
    };
}

impl AttentionOp for TiledAttention {
    fn support(&self) -> AttentionSupport {
        TILED_SUPPORT
    }

    fn varlen_forward(&self, x: Qkv<'_>, p: &Varlen<'_>) -> Result<AttentionOutput> {
        check_problem(self.support(), &x, p)?;
        check_varlen_work(p, x.q.dim().1, x.q.dim().2)?;
        let out = with_inputs!(self.precision, x, |q, k, v| {
            varlen_attention_general(q, k, v, p)?
        });
        Ok(widen(out))
    }

    fn varlen_backward(&self, x: Qkv<'_>, p: &Varlen<'_>, g: Grad<'_>) -> Result<AttentionGrads> {
        check_problem(self.support(), &x, p)?;
        check_grad_values(&g.grad_output, &x.v)?;
        check_varlen_work(p, x.q.dim().1, x.q.dim().2)?;
        let (f, go) = narrow(g)?;
        let g = with_inputs!(self.precision, x, |q, k, v| {
            varlen_attention_general_backward(q, k, v, p, &f, go.view())?
        });
        Ok(widen_grads(g))
    }

    fn masked_forward(&self, x: Qkv<'_>, m: Masked<'_>) -> Result<AttentionOutput> {
        dense_forward(self.precision, x, m)
    }

    fn masked_backward(&self, x: Qkv<'_>, m: Masked<'_>, g: Grad<'_>) -> Result<AttentionGrads> {
        dense_backward(self.precision, x, m, g)
    }
}

impl TiledAttention {
    /// The forward of `attention_varlen_tiled` on `f32` arrays read in place
    /// (no rounding, no widening): what [`AttentionOp::varlen_forward`] computes
    /// for the same values given in `f64`, bit for bit, in the kernel's own
    /// precision. Shapes and `p` as there; the same checks, in the same order.
    ///
    /// # Errors
    /// As [`AttentionOp::varlen_forward`]; [`Error::InvalidArgument`] naming
    /// `impl` for the bf16 kernel (its inputs are rounded from `f64`).
    pub fn varlen_forward_f32(
        &self,
        (q, k, v): (ArrayView3<f32>, ArrayView3<f32>, ArrayView3<f32>),
        p: &Varlen<'_>,
    ) -> Result<AttentionOutput32> {
        self.check_f32()?;
        check_problem_of(self.support(), (&q, &k, &v), p)?;
        varlen_attention_general(q, k, v, p)
    }

    /// The backward of [`TiledAttention::varlen_forward_f32`]: `fwd` its
    /// result, `grad_output: [n_q, h, d]`; gradients as
    /// [`AttentionOp::varlen_backward`], in `f32`.
    ///
    /// # Errors
    /// As [`AttentionOp::varlen_backward`] and
    /// [`TiledAttention::varlen_forward_f32`].
    pub fn varlen_backward_f32(
        &self,
        (q, k, v): (ArrayView3<f32>, ArrayView3<f32>, ArrayView3<f32>),
        p: &Varlen<'_>,
        fwd: &AttentionOutput32,
        grad_output: ArrayView3<f32>,
    ) -> Result<AttentionGrads32> {
        self.check_f32()?;
        check_problem_of(self.support(), (&q, &k, &v), p)?;
        check_grad_values(&grad_output, &v)?;
        varlen_attention_general_backward(q, k, v, p, fwd, grad_output)
    }

    fn check_f32(&self) -> Result<()> {
        if self.precision != Precision::F32 {
            return Err(Error::invalid(
                "impl",
                "the f32 entry points are attention_varlen_tiled's (f32 inputs)",
            ));
        }
        Ok(())
    }
}

fn dense_forward(precision: Precision, x: Qkv<'_>, m: Masked<'_>) -> Result<AttentionOutput> {
    dense_forward_with(precision, x, m, ScoreOptions::default())
}

fn dense_forward_with(
    precision: Precision,
    x: Qkv<'_>,
    m: Masked<'_>,
    opts: ScoreOptions<'_>,
) -> Result<AttentionOutput> {
    check_dense(&x, m.scale)?;
    let (n, h, d) = x.q.dim();
    check_masked_work(n, n, h, d)?;
    let out = with_inputs!(precision, x, |q, k, v| {
        dense_masked_attention_with(q, k, v, (n, &[m.allowed]), m.scale as f32, opts)?
    });
    Ok(widen(out))
}

fn dense_backward(
    precision: Precision,
    x: Qkv<'_>,
    m: Masked<'_>,
    g: Grad<'_>,
) -> Result<AttentionGrads> {
    dense_backward_with(precision, x, m, g, ScoreOptions::default())
}

fn dense_backward_with(
    precision: Precision,
    x: Qkv<'_>,
    m: Masked<'_>,
    g: Grad<'_>,
    opts: ScoreOptions<'_>,
) -> Result<AttentionGrads> {
    check_dense(&x, m.scale)?;
    check_grad_values(&g.grad_output, &x.v)?;
    let (n, h, d) = x.q.dim();
    check_masked_work(n, n, h, d)?;
    let (f, go) = narrow(g)?;
    let (allowed, scale) = ([m.allowed], m.scale as f32);
    let g = with_inputs!(precision, x, |q, k, v| {
        let fg = (&f, go.view());
        dense_masked_attention_backward_with(q, k, v, (n, &allowed), scale, opts, fg)?
    });
    Ok(widen_grads(g))
}

/// `attention_dense_masked`: every score of the whole row computed, the mask
/// applied after (the padded / block-diagonal-mask baseline). Its varlen form
/// is one row of all `n_tok` tokens with the `[n_tok, n_tok]` mask of the
/// segments (bottom-right causal within each when asked, and
/// flash-attention's window and `seqused_k` within each), at most
/// [`MAX_DENSE_TOKENS`] tokens; `softcap` and ALiBi change the row's scores
/// before the mask ([`ScoreOptions`], each query's ALiBi distance measured
/// from its own segment's diagonal).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DenseMaskedAttention;

/// The `[n, n]` mask of a self-attention varlen problem (already checked):
/// query `i` sees key `j` of its own segment within [`visible_keys`] (causal,
/// window, `seqused_k`), and the diagonal offset `l_k - l_q` of each query's
/// segment (`l_k` the used keys).
fn segment_mask(p: &Varlen<'_>, n: usize) -> (Array2<bool>, Vec<i64>) {
    let cu = p.cu_seqlens_q;
    let mut mask = Array2::from_elem((n, n), false);
    let mut offsets = vec![0i64; n];
    for (s, w) in cu.windows(2).enumerate() {
        let (a, lq, lk) = (w[0], w[1] - w[0], p.used_keys(s));
        for r in 0..lq {
            offsets[a + r] = lk as i64 - lq as i64;
            for c in visible_keys(r, lq, lk, p.causal, p.window) {
                mask[[a + r, a + c]] = true;
            }
        }
    }
    (mask, offsets)
}

impl DenseMaskedAttention {
    /// The `[n, n]` mask of a varlen problem and its diagonal offsets, checked.
    fn mask(&self, x: &Qkv<'_>, p: &Varlen<'_>) -> Result<(Array2<bool>, Vec<i64>)> {
        check_problem(self.support(), x, p)?;
        let (n, h, d) = x.q.dim();
        check_varlen_work(p, h, d)?;
        if n > MAX_DENSE_TOKENS {
            return Err(Error::invalid(
                "q",
                format!("{n} tokens: attention_dense_masked builds an [n_tok, n_tok] mask and takes at most {MAX_DENSE_TOKENS}"),
            ));
        }
        // Its own cost besides the shared bound: every score of the
        // [n_tok, n_tok] row, however few the segments allow.
        let work = n as u128 * n as u128 * h as u128 * (d as u128 + 1);
        if work > u128::from(MAX_ATTENTION_WORK) {
            return Err(Error::invalid(
                "q",
                format!("{n} tokens of {h} heads of {d}: attention_dense_masked computes all n_tok x n_tok scores, {work} units of work, over the {MAX_ATTENTION_WORK} one attention call may do"),
            ));
        }
        Ok(segment_mask(p, n))
    }
}

/// The score options of `p` over the diagonals `offsets`.
fn score_options<'a>(p: &Varlen<'a>, offsets: &'a [i64]) -> ScoreOptions<'a> {
    ScoreOptions {
        softcap: p.softcap,
        alibi_slopes: p.alibi_slopes,
        diag_offsets: Some(offsets),
    }
}

impl AttentionOp for DenseMaskedAttention {
    /// Self-attention (its mask is square), grouped-query or not, with
    /// every flash-attention option.
    fn support(&self) -> AttentionSupport {
        AttentionSupport {
            cross: false,
            ..AttentionSupport::ALL
        }
    }

    fn varlen_forward(&self, x: Qkv<'_>, p: &Varlen<'_>) -> Result<AttentionOutput> {
        let (mask, offsets) = self.mask(&x, p)?;
        let m = Masked::new(mask.view(), p.scale);
        dense_forward_with(Precision::F32, x, m, score_options(p, &offsets))
    }

    fn varlen_backward(&self, x: Qkv<'_>, p: &Varlen<'_>, g: Grad<'_>) -> Result<AttentionGrads> {
        let (mask, offsets) = self.mask(&x, p)?;
        let m = Masked::new(mask.view(), p.scale);
        dense_backward_with(Precision::F32, x, m, g, score_options(p, &offsets))
    }

    fn masked_forward(&self, x: Qkv<'_>, m: Masked<'_>) -> Result<AttentionOutput> {
        dense_forward(Precision::F32, x, m)
    }

    fn masked_backward(&self, x: Qkv<'_>, m: Masked<'_>, g: Grad<'_>) -> Result<AttentionGrads> {
        dense_backward(Precision::F32, x, m, g)
    }
}
