//! The f32/bf16 attention kernels as [`packshard_reference::ops::AttentionOp`]s: their math and their
//! declared support only; the boundary (the reference's checks, the
//! support's refusals, rounding the inputs and widening the results) is
//! [`super::boundary`]'s.

use ndarray::{Array2, Array3};
use packshard_reference::ops::{AttentionSupport, Masked, Precision, Varlen};
use packshard_reference::{Error, Result};

use super::boundary::{
    backward_in_place, forward_in_place, AttentionMath, FullRows, InPlaceF32, Inputs,
    KernelSupport, Problem32,
};
use crate::attention::{
    dense_masked_attention_backward_with, dense_masked_attention_with, varlen_attention_general,
    varlen_attention_general_backward, varlen_backward_seen, varlen_forward_seen, AttentionGrads32,
    AttentionOutput32, ScoreOptions, TILED_SUPPORT,
};
use packshard_reference::attention::options::visible_keys;

/// The most tokens the dense masked kernel takes in its varlen form: it
/// builds an `[n_tok, n_tok]` boolean mask (64 MiB at this size).
pub const MAX_DENSE_TOKENS: usize = 8192;

/// Runs `$call` with views `$q, $k, $v` of the rounded inputs `$x`, f32 or
/// bf16 (the kernels are generic over [`crate::attention::Element`]).
macro_rules! on_inputs {
    ($x:expr, |$q:ident, $k:ident, $v:ident| $call:expr) => {
        match $x {
            Inputs::F32([$q, $k, $v]) => {
                let ($q, $k, $v) = ($q.view(), $k.view(), $v.view());
                $call
            }
            Inputs::Bf16([$q, $k, $v]) => {
                let ($q, $k, $v) = ($q.view(), $k.view(), $v.view());
                $call
            }
        }
    };
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

crate::attention_op!(TiledAttention);

impl AttentionMath for TiledAttention {
    fn support(&self) -> KernelSupport {
        KernelSupport {
            attention: TILED_SUPPORT,
            input: self.precision,
            masked_cross: false,
            full_rows: None,
        }
    }

    fn forward(&self, x: &Inputs, p: Problem32<'_>) -> Result<AttentionOutput32> {
        match p {
            Problem32::Varlen(p) => on_inputs!(x, |q, k, v| varlen_attention_general(q, k, v, p)),
            Problem32::Masked(m) => dense_forward(x, &m, ScoreOptions::default()),
        }
    }

    fn backward(
        &self,
        x: &Inputs,
        p: Problem32<'_>,
        fwd: &AttentionOutput32,
        go: &Array3<f32>,
    ) -> Result<AttentionGrads32> {
        match p {
            Problem32::Varlen(p) => on_inputs!(x, |q, k, v| {
                varlen_attention_general_backward(q, k, v, p, fwd, go.view())
            }),
            Problem32::Masked(m) => dense_backward(x, &m, ScoreOptions::default(), (fwd, go)),
        }
    }
}

impl TiledAttention {
    /// The forward of `attention_varlen_tiled` on `f32` arrays read in place
    /// (no rounding, no widening): what [`packshard_reference::ops::AttentionOp::varlen_forward`]
    /// computes for the same values given in `f64`, bit for bit, in the
    /// kernel's own precision. Shapes and `p` as there; the same checks, in
    /// the same order, but the work bound (the values seen by the kernel's
    /// own reads, [`InPlaceF32`]).
    ///
    /// # Errors
    /// As `varlen_forward`; [`Error::InvalidArgument`] naming `impl` for the
    /// bf16 kernel (its inputs are rounded from `f64`).
    pub fn varlen_forward_f32(
        &self,
        x: &InPlaceF32<'_>,
        p: &Varlen<'_>,
    ) -> Result<AttentionOutput32> {
        self.check_f32()?;
        forward_in_place(self, x, p, || {
            let (q, k, v) = x.qkv();
            varlen_forward_seen((&q, &k, &v), p)
        })
    }

    /// The backward of [`TiledAttention::varlen_forward_f32`]: `fwd` its
    /// result, `x` with the `grad_output: [n_q, h, d]`; gradients as
    /// `varlen_backward`, in `f32`.
    ///
    /// # Errors
    /// As `varlen_backward` and [`TiledAttention::varlen_forward_f32`];
    /// [`Error::InvalidArgument`] naming `grad_output` when `x` has none.
    pub fn varlen_backward_f32(
        &self,
        x: &InPlaceF32<'_>,
        p: &Varlen<'_>,
        fwd: &AttentionOutput32,
    ) -> Result<AttentionGrads32> {
        self.check_f32()?;
        backward_in_place(self, x, p, fwd, |go| {
            let (q, k, v) = x.qkv();
            varlen_backward_seen((&q, &k, &v), p, fwd, &go)
        })
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

/// The dense kernel on one row of all `n_tok` tokens under `m` (square, as
/// the boundary has checked), the scores changed by `opts` before the mask.
fn dense_forward(x: &Inputs, m: &Masked<'_>, opts: ScoreOptions<'_>) -> Result<AttentionOutput32> {
    let (n, scale) = (x.q_dim().0, m.scale as f32);
    on_inputs!(x, |q, k, v| {
        dense_masked_attention_with(q, k, v, (n, &[m.allowed]), scale, opts)
    })
}

/// The backward of [`dense_forward`].
fn dense_backward(
    x: &Inputs,
    m: &Masked<'_>,
    opts: ScoreOptions<'_>,
    (fwd, go): (&AttentionOutput32, &Array3<f32>),
) -> Result<AttentionGrads32> {
    let (n, scale, allowed) = (x.q_dim().0, m.scale as f32, [m.allowed]);
    on_inputs!(x, |q, k, v| {
        let fg = (fwd, go.view());
        dense_masked_attention_backward_with(q, k, v, (n, &allowed), scale, opts, fg)
    })
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

crate::attention_op!(DenseMaskedAttention);

impl AttentionMath for DenseMaskedAttention {
    /// Self-attention (its mask is square), grouped-query or not, with
    /// every flash-attention option; f32 inputs; its varlen form scores the
    /// whole `[n_tok, n_tok]` row.
    fn support(&self) -> KernelSupport {
        KernelSupport {
            attention: AttentionSupport {
                cross: false,
                ..AttentionSupport::ALL
            },
            input: Precision::F32,
            masked_cross: false,
            full_rows: Some(FullRows {
                kernel: "attention_dense_masked",
                max_tokens: MAX_DENSE_TOKENS,
            }),
        }
    }

    fn forward(&self, x: &Inputs, p: Problem32<'_>) -> Result<AttentionOutput32> {
        match p {
            Problem32::Varlen(p) => {
                let (mask, offsets) = segment_mask(p, x.q_dim().0);
                let m = Masked::new(mask.view(), p.scale);
                dense_forward(x, &m, score_options(p, &offsets))
            }
            Problem32::Masked(m) => dense_forward(x, &m, ScoreOptions::default()),
        }
    }

    fn backward(
        &self,
        x: &Inputs,
        p: Problem32<'_>,
        fwd: &AttentionOutput32,
        go: &Array3<f32>,
    ) -> Result<AttentionGrads32> {
        match p {
            Problem32::Varlen(p) => {
                let (mask, offsets) = segment_mask(p, x.q_dim().0);
                let m = Masked::new(mask.view(), p.scale);
                dense_backward(x, &m, score_options(p, &offsets), (fwd, go))
            }
            Problem32::Masked(m) => dense_backward(x, &m, ScoreOptions::default(), (fwd, go)),
        }
    }
}

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

/// The score options of `p` over the diagonals `offsets`.
fn score_options<'a>(p: &Varlen<'a>, offsets: &'a [i64]) -> ScoreOptions<'a> {
    ScoreOptions {
        softcap: p.softcap,
        alibi_slopes: p.alibi_slopes,
        diag_offsets: Some(offsets),
    }
}
