//! The boundary of an attention kernel, written once: a kernel states its
//! support and implements its math ([`AttentionMath`]: `forward`,
//! `backward` on inputs rounded to its precision, results in f32; or, for
//! an f32 kernel that reads the problem as a per-pair mask, the simpler
//! [`F32AttentionMath`]), and [`attention_op!`](crate::attention_op) makes it an [`AttentionOp`]
//! that
//!
//! 1. runs the reference's check sequence, in the reference's order (shapes,
//!    rounding `q, k, v` to the declared input precision with finite values
//!    beyond f32's range refused naming the field and index, non-finite
//!    values, the offsets or mask, the scores, for a backward the saved
//!    forward and `grad_output`, the work bound last), so bad input gets the
//!    reference's error;
//! 2. refuses what the declared [`KernelSupport`] does not cover
//!    ([`AttentionSupport::check`], [`AttentionSupport::check_head_dim`],
//!    non-square masks, the cost of a kernel that scores whole rows);
//! 3. calls the math on the rounded inputs with the [`Problem32`];
//! 4. widens the results to f64 exactly.
//!
//! Shapes as [`AttentionOp`]'s: `q: [n_q, h, d]`, `k, v: [n_k, h_kv, d]`
//! (query head `a` reads key head `a / (h / h_kv)`); `output: [n_q, h, d]`,
//! `lse: [h, n_q]`.

use half::bf16;
use ndarray::{Array2, Array3};
use packshard_reference::attention::{
    check_grad_shapes, check_grad_values, check_mask_shape2, check_masked_work, check_qkv_shapes,
    check_scores, check_varlen, check_varlen_options, check_varlen_work, AttentionGrads,
    AttentionOutput, MAX_ATTENTION_WORK,
};
use packshard_reference::ops::{AttentionSupport, Grad, Masked, Precision, Qkv, Varlen};
use packshard_reference::{Error, Result};

#[cfg(doc)]
use packshard_reference::ops::AttentionOp;

use crate::attention::mask::SegmentMask;
use crate::attention::{check_finite, AttentionGrads32, AttentionOutput32, Element};
use crate::convert::{to_bf16, to_f32, to_f64};

/// `q, k, v` in f32: `[n_q, h, d]`, `[n_k, h_kv, d]`, `[n_k, h_kv, d]`.
pub type Qkv32 = [Array3<f32>; 3];

/// `q, k, v` rounded to a kernel's declared input precision
/// ([`KernelSupport::input`]), shapes as [`Qkv32`].
#[derive(Debug, Clone)]
pub enum Inputs {
    /// [`Precision::F32`].
    F32(Qkv32),
    /// [`Precision::Bf16`] (the workspace's one rounding,
    /// [`packshard_reference::precision::to_bf16`]).
    Bf16([Array3<bf16>; 3]),
}

impl Inputs {
    /// The f32 inputs.
    ///
    /// # Panics
    /// On bf16 inputs: the boundary gives a kernel the precision it declares,
    /// so only a kernel that declares f32 calls this.
    pub fn f32(&self) -> &Qkv32 {
        match self {
            Inputs::F32(x) => x,
            Inputs::Bf16(_) => panic!("bf16 inputs for a kernel that declares f32"),
        }
    }

    /// `q`'s `(n_q, h, d)`.
    pub fn q_dim(&self) -> (usize, usize, usize) {
        match self {
            Inputs::F32(x) => x[0].dim(),
            Inputs::Bf16(x) => x[0].dim(),
        }
    }
}

/// The problem as the math sees it: the reference's own description, so a
/// kernel reads the structure it needs (segments and flash-attention's
/// options, or a mask), and [`Problem32::key_mask`] as the per-pair view.
#[derive(Clone, Copy)]
pub enum Problem32<'a> {
    /// Varlen segments (`cu_seqlens_q`, `cu_seqlens_k`, causal, window,
    /// softcap, ALiBi, `seqused_k`).
    Varlen(&'a Varlen<'a>),
    /// `allowed: [n_q, n_k]`.
    Masked(Masked<'a>),
}

impl Problem32<'_> {
    /// Multiplies `q . k`.
    pub fn scale(&self) -> f64 {
        match self {
            Problem32::Varlen(p) => p.scale,
            Problem32::Masked(m) => m.scale,
        }
    }

    /// `f` of the problem as a [`KeyMask`].
    pub fn key_mask<R>(&self, f: impl FnOnce(&dyn KeyMask) -> R) -> R {
        match *self {
            Problem32::Varlen(p) => f(&Segments(p)),
            Problem32::Masked(m) => f(&m),
        }
    }
}

/// A kernel whose varlen form scores every pair of one `[n_tok, n_tok]` row
/// (building its mask), whatever the segments allow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FullRows {
    /// Its registry name, for the refusals.
    pub kernel: &'static str,
    /// The most tokens its varlen form takes.
    pub max_tokens: usize,
}

/// What a kernel declares; the boundary refuses the rest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelSupport {
    /// The options and shapes of [`AttentionOp::support`].
    pub attention: AttentionSupport,
    /// What `q, k, v` are rounded to: [`Precision::F32`] or
    /// [`Precision::Bf16`] (any other is refused naming `impl`).
    pub input: Precision,
    /// Its masked form takes `[n_q, n_k]` masks with `n_k != n_q` (else it
    /// needs square `[n, n]` masks).
    pub masked_cross: bool,
    /// Its varlen form scores whole rows (`None`: only what the segments
    /// allow).
    pub full_rows: Option<FullRows>,
}

impl KernelSupport {
    /// An f32 kernel of `attention` that takes any mask and scores only
    /// what the segments allow (an [`F32AttentionMath`]).
    pub const fn f32(attention: AttentionSupport) -> Self {
        KernelSupport {
            attention,
            input: Precision::F32,
            masked_cross: true,
            full_rows: None,
        }
    }
}

/// The math of an attention kernel; [`attention_op!`](crate::attention_op) gives it the boundary
/// (see the module docs).
pub trait AttentionMath: Send + Sync {
    /// What it implements (declare it: the boundary refuses the rest).
    fn support(&self) -> KernelSupport;

    /// `output: [n_q, h, d]`, `lse: [h, n_q]` of the checked inputs, rounded
    /// to `support().input`; a query with no allowed key has output 0 and
    /// `lse = -inf` (docs/FAULTS.md P8).
    ///
    /// # Errors
    /// The kernel's own (the boundary has checked what the reference checks).
    fn forward(&self, x: &Inputs, p: Problem32<'_>) -> Result<AttentionOutput32>;

    /// The gradients from the forward's result `fwd` and `grad_output: [n_q,
    /// h, d]`.
    ///
    /// # Errors
    /// As [`AttentionMath::forward`].
    fn backward(
        &self,
        x: &Inputs,
        p: Problem32<'_>,
        fwd: &AttentionOutput32,
        grad_output: &Array3<f32>,
    ) -> Result<AttentionGrads32>;
}

/// The math of an f32 attention kernel that reads the problem as a per-pair
/// [`KeyMask`]; an [`AttentionMath`] with [`KernelSupport::f32`].
pub trait F32AttentionMath: Send + Sync {
    /// What it implements beyond bidirectional self-attention with `h_kv ==
    /// h` (declare it: the boundary refuses the rest).
    fn support(&self) -> AttentionSupport;

    /// `(output: [n_q, h, d], lse: [h, n_q])` of the checked inputs; a query
    /// with no allowed key has output 0 and `lse = -inf` (docs/FAULTS.md P8).
    fn forward(&self, x: &Qkv32, mask: &dyn KeyMask) -> (Array3<f32>, Array2<f32>);

    /// `[grad_q, grad_k, grad_v]` from the forward's `(output, lse)` and
    /// `grad_output: [n_q, h, d]`.
    fn backward(
        &self,
        x: &Qkv32,
        mask: &dyn KeyMask,
        fwd: (&Array3<f32>, &Array2<f32>),
        grad_output: &Array3<f32>,
    ) -> [Array3<f32>; 3];
}

impl<K: F32AttentionMath + ?Sized> AttentionMath for K {
    fn support(&self) -> KernelSupport {
        KernelSupport::f32(F32AttentionMath::support(self))
    }

    fn forward(&self, x: &Inputs, p: Problem32<'_>) -> Result<AttentionOutput32> {
        let (output, lse) = p.key_mask(|m| F32AttentionMath::forward(self, x.f32(), m));
        Ok(AttentionOutput32 { output, lse })
    }

    fn backward(
        &self,
        x: &Inputs,
        p: Problem32<'_>,
        fwd: &AttentionOutput32,
        grad_output: &Array3<f32>,
    ) -> Result<AttentionGrads32> {
        let f = (&fwd.output, &fwd.lse);
        let [grad_q, grad_k, grad_v] =
            p.key_mask(|m| F32AttentionMath::backward(self, x.f32(), m, f, grad_output));
        Ok(AttentionGrads32 {
            grad_q,
            grad_k,
            grad_v,
        })
    }
}

/// Which keys a query may see, over the whole problem as `[n_q, n_k]`, and
/// the scores' transforms.
pub trait KeyMask {
    /// Query `i` may attend to key `j`.
    fn allowed(&self, i: usize, j: usize) -> bool;
    /// Multiplies `q . k`.
    fn scale(&self) -> f64;
    /// The score of `(i, j)` at query head `a` from the scaled dot product
    /// `raw` (flash-attention's softcap and ALiBi; `raw` without them).
    fn score(&self, _a: usize, _ij: (usize, usize), raw: f32) -> f32 {
        raw
    }
    /// `d score / d raw` (1 without a softcap).
    fn chain(&self, _raw: f32) -> f32 {
        1.0
    }
}

impl KeyMask for Masked<'_> {
    fn allowed(&self, i: usize, j: usize) -> bool {
        self.allowed[[i, j]]
    }
    fn scale(&self) -> f64 {
        self.scale
    }
}

/// Query `i` in segment `s` of `cu_seqlens_q`, key `j` in the same segment
/// of `cu_seqlens_k`, within the keys [`SegmentMask::keys`] gives (causal and
/// the window bottom-right aligned, docs/FAULTS.md C5; `seqused_k`).
struct Segments<'a>(&'a Varlen<'a>);

impl Segments<'_> {
    /// `(mask of i's segment, r, c)`: local indices, `None` when `j` is not
    /// in `i`'s segment.
    fn local(&self, i: usize, j: usize) -> Option<(SegmentMask<'_>, usize, usize)> {
        let (cu_q, cu_k) = (self.0.cu_seqlens_q, self.0.cu_seqlens_k);
        let s = cu_q.partition_point(|&c| c <= i) - 1;
        if !(cu_k[s]..cu_k[s + 1]).contains(&j) {
            return None;
        }
        Some((SegmentMask::of(self.0, s), i - cu_q[s], j - cu_k[s]))
    }
}

impl KeyMask for Segments<'_> {
    fn allowed(&self, i: usize, j: usize) -> bool {
        self.local(i, j)
            .is_some_and(|(m, r, c)| m.keys(r).contains(&c))
    }
    fn scale(&self) -> f64 {
        self.0.scale
    }
    fn score(&self, a: usize, (i, j): (usize, usize), raw: f32) -> f32 {
        match self.local(i, j) {
            Some((m, r, c)) if m.transforms() => m.score(a, r, c, raw),
            _ => raw,
        }
    }
    fn chain(&self, raw: f32) -> f32 {
        crate::attention::mask::cap_grad(raw, crate::attention::mask::softcap_f32(self.0.softcap))
    }
}

impl Problem32<'_> {
    /// As the reference checks `n_q` queries over `n_k` keys of `h` heads,
    /// then the kernel's support `s` for `h_kv` key heads of dim `d`.
    pub(super) fn check(
        &self,
        [n_q, n_k, h, h_kv, d]: [usize; 5],
        s: &KernelSupport,
    ) -> Result<()> {
        let a = s.attention;
        match self {
            Problem32::Masked(m) => {
                if n_k != n_q && !s.masked_cross {
                    return Err(Error::invalid(
                        "k",
                        format!("has {n_k} tokens for {n_q} queries: the dense kernel needs a square [n, n] mask"),
                    ));
                }
                check_mask_shape2(m.allowed.shape(), n_q, n_k)?;
                if h_kv != h && !a.gqa {
                    return Err(Error::invalid(
                        "k",
                        format!("{h_kv} key heads for {h} query heads: this implementation needs h_kv == h (no grouped-query attention)"),
                    ));
                }
            }
            Problem32::Varlen(p) => {
                check_varlen(p, n_q, n_k)?;
                check_varlen_options(p, h)?;
                a.check(p, h, h_kv)?;
            }
        }
        a.check_head_dim(d)
    }

    /// The work against the reference's bound ([`check_varlen_work`],
    /// [`check_masked_work`]), last as the reference checks it; then a
    /// kernel's own cost ([`KernelSupport::full_rows`]).
    fn check_work(&self, [n_q, n_k, h, d]: [usize; 4], s: &KernelSupport) -> Result<()> {
        match self {
            Problem32::Masked(_) => check_masked_work(n_q, n_k, h, d),
            Problem32::Varlen(p) => {
                check_varlen_work(p, h, d)?;
                s.full_rows.map_or(Ok(()), |f| f.check(n_q, h, d))
            }
        }
    }
}

impl FullRows {
    /// `n` tokens of `h` heads of dim `d` in one row: at most `max_tokens`,
    /// and every score of the `[n, n]` row within [`MAX_ATTENTION_WORK`].
    fn check(&self, n: usize, h: usize, d: usize) -> Result<()> {
        let (kernel, max) = (self.kernel, self.max_tokens);
        if n > max {
            return Err(Error::invalid(
                "q",
                format!(
                    "{n} tokens: {kernel} builds an [n_tok, n_tok] mask and takes at most {max}"
                ),
            ));
        }
        let work = n as u128 * n as u128 * h as u128 * (d as u128 + 1);
        if work > u128::from(MAX_ATTENTION_WORK) {
            return Err(Error::invalid(
                "q",
                format!("{n} tokens of {h} heads of {d}: {kernel} computes all n_tok x n_tok scores, {work} units of work, over the {MAX_ATTENTION_WORK} one attention call may do"),
            ));
        }
        Ok(())
    }
}

/// `q: [n_q, h, d]` and `k, v: [n_k, h_kv, d]` rounded to `precision`,
/// refusing finite values beyond f32's range, then non-finite values.
fn rounded(Qkv { q, k, v }: &Qkv<'_>, precision: Precision) -> Result<Inputs> {
    check_qkv_shapes(q.shape(), k.shape(), v.shape())?;
    match precision {
        Precision::F32 => Ok(Inputs::F32(finite([
            to_f32("q", q.view())?,
            to_f32("k", k.view())?,
            to_f32("v", v.view())?,
        ])?)),
        Precision::Bf16 => Ok(Inputs::Bf16(finite([
            to_bf16("q", q.view())?,
            to_bf16("k", k.view())?,
            to_bf16("v", v.view())?,
        ])?)),
        other => Err(Error::invalid(
            "impl",
            format!("{other:?} inputs: the attention boundary rounds to f32 or bf16"),
        )),
    }
}

/// `x`, after refusing a non-finite value of `q`, `k`, `v` in that order.
fn finite<T: Element>(x: [Array3<T>; 3]) -> Result<[Array3<T>; 3]> {
    for (name, t) in ["q", "k", "v"].iter().zip(&x) {
        check_finite(name, &t.view())?;
    }
    Ok(x)
}

/// `x` rounded, after the checks the reference makes (shapes and finite
/// values, the mask, the scores) and the kernel's support.
fn checked(x: &Qkv<'_>, p: Problem32<'_>, s: &KernelSupport) -> Result<Inputs> {
    let x_in = rounded(x, s.input)?;
    let ((n_q, h, d), (n_k, h_kv, _)) = (x.q.dim(), x.k.dim());
    p.check([n_q, n_k, h, h_kv, d], s)?;
    check_scores(&x.q, &x.k, p.scale())?;
    Ok(x_in)
}

fn check_work(x: &Qkv<'_>, p: Problem32<'_>, s: &KernelSupport) -> Result<()> {
    let (n_q, h, d) = x.q.dim();
    p.check_work([n_q, x.k.dim().0, h, d], s)
}

fn forward<K: AttentionMath + ?Sized>(
    kernel: &K,
    x: Qkv<'_>,
    p: Problem32<'_>,
) -> Result<AttentionOutput> {
    let s = kernel.support();
    let x_in = checked(&x, p, &s)?;
    check_work(&x, p, &s)?;
    let f = kernel.forward(&x_in, p)?;
    Ok(widen((f.output, f.lse)))
}

fn backward<K: AttentionMath + ?Sized>(
    kernel: &K,
    x: Qkv<'_>,
    p: Problem32<'_>,
    g: Grad<'_>,
) -> Result<AttentionGrads> {
    let s = kernel.support();
    let x_in = checked(&x, p, &s)?;
    let grad_output = g.grad_output;
    let (output, lse, go) = saved(g, x.q.dim())?;
    check_grad_values(&grad_output, &x.v)?;
    check_work(&x, p, &s)?;
    let fwd = AttentionOutput32 { output, lse };
    let g = kernel.backward(&x_in, p, &fwd, &go)?;
    Ok(widen_grads([g.grad_q, g.grad_k, g.grad_v]))
}

/// The varlen forward of `kernel` through the boundary.
///
/// # Errors
/// The reference's, then the support's refusals.
pub fn varlen_forward<K: AttentionMath + ?Sized>(
    kernel: &K,
    x: Qkv<'_>,
    p: &Varlen<'_>,
) -> Result<AttentionOutput> {
    forward(kernel, x, Problem32::Varlen(p))
}

/// The varlen backward of `kernel` through the boundary.
///
/// # Errors
/// As [`varlen_forward`], and the backward's (`grad_output`, the saved
/// forward).
pub fn varlen_backward<K: AttentionMath + ?Sized>(
    kernel: &K,
    x: Qkv<'_>,
    p: &Varlen<'_>,
    g: Grad<'_>,
) -> Result<AttentionGrads> {
    backward(kernel, x, Problem32::Varlen(p), g)
}

/// The masked forward of `kernel` through the boundary.
///
/// # Errors
/// As [`varlen_forward`].
pub fn masked_forward<K: AttentionMath + ?Sized>(
    kernel: &K,
    x: Qkv<'_>,
    m: Masked<'_>,
) -> Result<AttentionOutput> {
    forward(kernel, x, Problem32::Masked(m))
}

/// The masked backward of `kernel` through the boundary.
///
/// # Errors
/// As [`varlen_backward`].
pub fn masked_backward<K: AttentionMath + ?Sized>(
    kernel: &K,
    x: Qkv<'_>,
    m: Masked<'_>,
    g: Grad<'_>,
) -> Result<AttentionGrads> {
    backward(kernel, x, Problem32::Masked(m), g)
}

fn widen((out, lse): (Array3<f32>, Array2<f32>)) -> AttentionOutput {
    AttentionOutput {
        output: to_f64(out.view()),
        lse: to_f64(lse.view()),
    }
}

fn widen_grads([gq, gk, gv]: [Array3<f32>; 3]) -> AttentionGrads {
    AttentionGrads {
        grad_q: to_f64(gq.view()),
        grad_k: to_f64(gk.view()),
        grad_v: to_f64(gv.view()),
    }
}

/// The forward's results and the incoming gradient in f32, shapes checked.
fn saved(
    Grad { fwd, grad_output }: Grad<'_>,
    dim: (usize, usize, usize),
) -> Result<(Array3<f32>, Array2<f32>, Array3<f32>)> {
    check_grad_shapes(
        grad_output.shape(),
        fwd.output.shape(),
        fwd.lse.shape(),
        dim,
    )?;
    Ok((
        to_f32("output", fwd.output.view())?,
        fwd.lse.mapv(|x| x as f32),
        to_f32("grad_output", grad_output)?,
    ))
}

/// `impl AttentionOp for $kernel` through the boundary of this module, for
/// a `$kernel` that implements [`AttentionMath`] (or [`F32AttentionMath`]);
/// for a generic one, `attention_op!(impl[B: Bound] Kernel<B>)`.
#[macro_export]
macro_rules! attention_op {
    ($kernel:ty) => {
        $crate::attention_op!(impl[] $kernel);
    };
    (impl[$($g:tt)*] $kernel:ty) => {
        impl<$($g)*> $crate::ops::boundary::reexport::AttentionOp for $kernel {
            fn support(&self) -> $crate::ops::boundary::reexport::AttentionSupport {
                $crate::ops::boundary::AttentionMath::support(self).attention
            }
            fn varlen_forward(
                &self,
                x: $crate::ops::boundary::reexport::Qkv<'_>,
                p: &$crate::ops::boundary::reexport::Varlen<'_>,
            ) -> $crate::ops::boundary::reexport::Result<
                $crate::ops::boundary::reexport::AttentionOutput,
            > {
                $crate::ops::boundary::varlen_forward(self, x, p)
            }
            fn varlen_backward(
                &self,
                x: $crate::ops::boundary::reexport::Qkv<'_>,
                p: &$crate::ops::boundary::reexport::Varlen<'_>,
                g: $crate::ops::boundary::reexport::Grad<'_>,
            ) -> $crate::ops::boundary::reexport::Result<
                $crate::ops::boundary::reexport::AttentionGrads,
            > {
                $crate::ops::boundary::varlen_backward(self, x, p, g)
            }
            fn masked_forward(
                &self,
                x: $crate::ops::boundary::reexport::Qkv<'_>,
                m: $crate::ops::boundary::reexport::Masked<'_>,
            ) -> $crate::ops::boundary::reexport::Result<
                $crate::ops::boundary::reexport::AttentionOutput,
            > {
                $crate::ops::boundary::masked_forward(self, x, m)
            }
            fn masked_backward(
                &self,
                x: $crate::ops::boundary::reexport::Qkv<'_>,
                m: $crate::ops::boundary::reexport::Masked<'_>,
                g: $crate::ops::boundary::reexport::Grad<'_>,
            ) -> $crate::ops::boundary::reexport::Result<
                $crate::ops::boundary::reexport::AttentionGrads,
            > {
                $crate::ops::boundary::masked_backward(self, x, m, g)
            }
        }
    };
}

/// [`attention_op!`](crate::attention_op) for an [`F32AttentionMath`] (the name the worked
/// example uses).
#[macro_export]
macro_rules! f32_attention_op {
    ($kernel:ty) => {
        $crate::attention_op!($kernel);
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::ScalarAttention;
    use ndarray::Array3;

    /// The scalar kernel's math under a smaller declared support.
    struct Declares(AttentionSupport);

    impl F32AttentionMath for Declares {
        fn support(&self) -> AttentionSupport {
            self.0
        }
        fn forward(&self, x: &Qkv32, mask: &dyn KeyMask) -> (Array3<f32>, Array2<f32>) {
            F32AttentionMath::forward(&ScalarAttention, x, mask)
        }
        fn backward(
            &self,
            x: &Qkv32,
            mask: &dyn KeyMask,
            fwd: (&Array3<f32>, &Array2<f32>),
            go: &Array3<f32>,
        ) -> [Array3<f32>; 3] {
            F32AttentionMath::backward(&ScalarAttention, x, mask, fwd, go)
        }
    }

    fn field(r: Result<AttentionOutput>) -> Option<String> {
        r.err()
            .map(|e| e.to_string().split(':').next().unwrap_or("").to_string())
    }

    /// What a kernel does not declare is refused naming the field, and the
    /// same call passes where it is declared (the negative control: with
    /// ALL every call below runs).
    #[test]
    fn the_boundary_refuses_what_the_support_does_not_declare() {
        let q = Array3::from_shape_fn((4, 2, 8), |(i, a, c)| (i + a + c) as f64 * 0.125 - 1.0);
        let k1 = Array3::from_shape_fn((4, 1, 8), |(i, _, c)| (i * c) as f64 * 0.0625 - 0.5);
        let cu = [0usize, 3, 4];
        let causal = Varlen::new(&cu, true, 0.25);
        let plain = Varlen::new(&cu, false, 0.25);
        let allowed = ndarray::Array2::from_elem((4, 4), true);
        let masked = Masked::new(allowed.view(), 0.25);
        let mha = Qkv::new(q.view(), q.view(), q.view());
        let gqa = Qkv::new(q.view(), k1.view(), k1.view());
        let bidi = Declares(AttentionSupport::BIDIRECTIONAL);
        let all = Declares(AttentionSupport::ALL);
        let small = Declares(AttentionSupport::ALL.with_max_head_dim(4));
        let f = |k: &Declares, x, p: &Varlen| field(varlen_forward(k, x, p));
        assert_eq!(f(&bidi, mha, &causal).as_deref(), Some("causal"));
        assert_eq!(f(&bidi, gqa, &plain).as_deref(), Some("k"));
        assert_eq!(
            field(masked_forward(&bidi, gqa, masked)).as_deref(),
            Some("k")
        );
        assert_eq!(f(&small, mha, &plain).as_deref(), Some("q"));
        assert_eq!(f(&bidi, mha, &plain), None);
        for x in [mha, gqa] {
            assert_eq!(f(&all, x, &causal), None);
            assert_eq!(field(masked_forward(&all, x, masked)), None);
        }
    }

    /// The declarations beyond `AttentionSupport`: a kernel that needs square
    /// masks refuses `[n_q, n_k]` ones naming `k` (the scalar kernel, which
    /// declares them, runs the same call), and an input precision the
    /// boundary cannot round to is refused naming `impl`.
    #[test]
    fn non_square_masks_and_other_precisions_are_refused_where_not_declared() {
        use crate::ops::{DenseMaskedAttention, TiledAttention};
        use packshard_reference::ops::Precision;
        let q = Array3::from_shape_fn((3, 1, 4), |(i, _, c)| (i + c) as f64 * 0.25);
        let k = Array3::from_shape_fn((5, 1, 4), |(i, _, c)| (i * c) as f64 * 0.125);
        let allowed = ndarray::Array2::from_elem((3, 5), true);
        let m = Masked::new(allowed.view(), 0.5);
        let x = Qkv::new(q.view(), k.view(), k.view());
        for tiled in [TiledAttention::F32, TiledAttention::BF16] {
            assert_eq!(field(masked_forward(&tiled, x, m)).as_deref(), Some("k"));
        }
        let dense = field(masked_forward(&DenseMaskedAttention, x, m));
        assert_eq!(dense.as_deref(), Some("k"));
        assert_eq!(field(masked_forward(&ScalarAttention, x, m)), None);
        let square = ndarray::Array2::from_elem((3, 3), true);
        let xq = Qkv::new(q.view(), q.view(), q.view());
        let ms = Masked::new(square.view(), 0.5);
        let f16 = TiledAttention {
            precision: Precision::F16,
        };
        assert_eq!(field(masked_forward(&f16, xq, ms)).as_deref(), Some("impl"));
        assert_eq!(field(masked_forward(&TiledAttention::BF16, xq, ms)), None);
    }

    /// A whole-row kernel's own bounds are inclusive: `max_tokens` tokens
    /// pass and one more is refused, and a row whose `n^2 h (d + 1)` is
    /// exactly [`MAX_ATTENTION_WORK`] (2^14 tokens, 1 head of dim 1: 2^29)
    /// passes where one token more is refused, both naming `q`.
    #[test]
    fn full_rows_bounds_take_their_limits_and_refuse_one_more() {
        let few = FullRows {
            kernel: "k",
            max_tokens: 8,
        };
        let refused = |r: Result<()>| r.err().map(|e| e.to_string()[..2].to_string());
        assert_eq!(refused(few.check(8, 1, 1)), None);
        assert_eq!(refused(few.check(9, 1, 1)).as_deref(), Some("q:"));
        let many = FullRows {
            kernel: "k",
            max_tokens: usize::MAX,
        };
        let n = 1usize << 14;
        assert_eq!(n as u64 * n as u64 * 2, MAX_ATTENTION_WORK);
        assert_eq!(refused(many.check(n, 1, 1)), None);
        assert_eq!(refused(many.check(n + 1, 1, 1)).as_deref(), Some("q:"));
        // The heads and the head dim count: the same row at 2 heads is over.
        assert_eq!(refused(many.check(n, 2, 1)).as_deref(), Some("q:"));
    }
}
