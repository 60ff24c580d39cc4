//! The boundary of an f32 attention kernel, written once: a kernel states
//! its support and implements its math ([`F32AttentionMath`]: `forward`,
//! `backward` on f32 tensors), and [`f32_attention_op!`] makes it an
//! [`AttentionOp`] that
//!
//! 1. runs the reference's check sequence, in the reference's order (shapes,
//!    rounding `q, k, v` to f32 with finite values beyond its range refused
//!    naming the field and index, non-finite values, the offsets or mask,
//!    the scores, for a backward the saved forward and `grad_output`, the
//!    work bound last), so bad input gets the reference's error;
//! 2. refuses what the declared [`AttentionSupport`] does not cover
//!    ([`AttentionSupport::check`], [`AttentionSupport::check_head_dim`]);
//! 3. calls the math on f32 inputs with the problem as a [`KeyMask`];
//! 4. widens the results to f64 exactly.
//!
//! Shapes as [`AttentionOp`]'s: `q: [n_q, h, d]`, `k, v: [n_k, h_kv, d]`
//! (query head `a` reads key head `a / (h / h_kv)`); `output: [n_q, h, d]`,
//! `lse: [h, n_q]`.

use ndarray::{Array2, Array3};
use packshard_reference::attention::{
    check_grad_shapes, check_grad_values, check_mask_shape2, check_masked_work, check_qkv_shapes,
    check_scores, check_varlen, check_varlen_options, check_varlen_work, AttentionGrads,
    AttentionOutput,
};
use packshard_reference::ops::{AttentionSupport, Grad, Masked, Qkv, Varlen};
use packshard_reference::{Error, Result};

use crate::attention::check_finite;
use crate::attention::mask::SegmentMask;
use crate::convert::{to_f32, to_f64};

/// `q, k, v` in f32: `[n_q, h, d]`, `[n_k, h_kv, d]`, `[n_k, h_kv, d]`.
pub type Qkv32 = [Array3<f32>; 3];

/// The math of an f32 attention kernel; [`f32_attention_op!`] gives it the
/// boundary (see the module docs).
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

/// A problem's own checks besides the mask.
trait Problem: KeyMask {
    /// As the reference checks `n_q` queries over `n_k` keys of `h` heads,
    /// then the kernel's `support` for `h_kv` key heads of dim `d`.
    fn check(&self, dims: [usize; 5], support: AttentionSupport) -> Result<()>;
    /// The work against the reference's bound ([`check_varlen_work`],
    /// [`check_masked_work`]), last as the reference checks it.
    fn check_work(&self, n_q: usize, n_k: usize, h: usize, d: usize) -> Result<()>;
}

impl KeyMask for Masked<'_> {
    fn allowed(&self, i: usize, j: usize) -> bool {
        self.allowed[[i, j]]
    }
    fn scale(&self) -> f64 {
        self.scale
    }
}

impl Problem for Masked<'_> {
    fn check(&self, [n_q, n_k, h, h_kv, d]: [usize; 5], s: AttentionSupport) -> Result<()> {
        check_mask_shape2(self.allowed.shape(), n_q, n_k)?;
        if h_kv != h && !s.gqa {
            return Err(Error::invalid(
                "k",
                format!("{h_kv} key heads for {h} query heads: this implementation needs h_kv == h (no grouped-query attention)"),
            ));
        }
        s.check_head_dim(d)
    }
    fn check_work(&self, n_q: usize, n_k: usize, h: usize, d: usize) -> Result<()> {
        check_masked_work(n_q, n_k, h, d)
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

impl Problem for Segments<'_> {
    fn check(&self, [n_q, n_k, h, h_kv, d]: [usize; 5], s: AttentionSupport) -> Result<()> {
        check_varlen(self.0, n_q, n_k)?;
        check_varlen_options(self.0, h)?;
        s.check(self.0, h, h_kv)?;
        s.check_head_dim(d)
    }
    fn check_work(&self, _: usize, _: usize, h: usize, d: usize) -> Result<()> {
        check_varlen_work(self.0, h, d)
    }
}

/// `q, k, v` in f32 (all of one shape), refusing non-finite inputs as the
/// kernels do (the boundary of the CUDA attention, `crate::cuda::ops`).
#[cfg(feature = "cuda")]
pub(crate) fn inputs(x: &Qkv<'_>) -> Result<Qkv32> {
    packshard_reference::attention::check_qkv_same_shapes(x.q.shape(), x.k.shape(), x.v.shape())?;
    grouped_inputs(x)
}

/// `q: [n_q, h, d]` and `k, v: [n_k, h_kv, d]` in f32, refusing non-finite
/// inputs.
fn grouped_inputs(Qkv { q, k, v }: &Qkv<'_>) -> Result<Qkv32> {
    check_qkv_shapes(q.shape(), k.shape(), v.shape())?;
    let out = [
        to_f32("q", q.view())?,
        to_f32("k", k.view())?,
        to_f32("v", v.view())?,
    ];
    for (name, t) in ["q", "k", "v"].iter().zip(&out) {
        check_finite(name, &t.view())?;
    }
    Ok(out)
}

/// `x` in f32, after the checks the reference makes (shapes and finite
/// values, the mask, the scores) and the kernel's support.
fn checked(x: &Qkv<'_>, p: &dyn Problem, s: AttentionSupport) -> Result<Qkv32> {
    let x32 = grouped_inputs(x)?;
    let ((n_q, h, d), (n_k, h_kv, _)) = (x.q.dim(), x.k.dim());
    p.check([n_q, n_k, h, h_kv, d], s)?;
    check_scores(&x.q, &x.k, p.scale())?;
    Ok(x32)
}

fn check_work(x: &Qkv<'_>, p: &dyn Problem) -> Result<()> {
    let (n_q, h, d) = x.q.dim();
    p.check_work(n_q, x.k.dim().0, h, d)
}

fn forward<K: F32AttentionMath + ?Sized>(
    kernel: &K,
    x: Qkv<'_>,
    p: &dyn Problem,
) -> Result<AttentionOutput> {
    let x32 = checked(&x, p, kernel.support())?;
    check_work(&x, p)?;
    Ok(widen(kernel.forward(&x32, p)))
}

fn backward<K: F32AttentionMath + ?Sized>(
    kernel: &K,
    x: Qkv<'_>,
    p: &dyn Problem,
    g: Grad<'_>,
) -> Result<AttentionGrads> {
    let x32 = checked(&x, p, kernel.support())?;
    let grad_output = g.grad_output;
    let (out, lse, go) = saved(g, x.q.dim())?;
    check_grad_values(&grad_output, &x.v)?;
    check_work(&x, p)?;
    Ok(widen_grads(kernel.backward(&x32, p, (&out, &lse), &go)))
}

/// The varlen forward of `kernel` through the boundary.
///
/// # Errors
/// The reference's, then the support's refusals.
pub fn varlen_forward<K: F32AttentionMath + ?Sized>(
    kernel: &K,
    x: Qkv<'_>,
    p: &Varlen<'_>,
) -> Result<AttentionOutput> {
    forward(kernel, x, &Segments(p))
}

/// The varlen backward of `kernel` through the boundary.
///
/// # Errors
/// As [`varlen_forward`], and the backward's (`grad_output`, the saved
/// forward).
pub fn varlen_backward<K: F32AttentionMath + ?Sized>(
    kernel: &K,
    x: Qkv<'_>,
    p: &Varlen<'_>,
    g: Grad<'_>,
) -> Result<AttentionGrads> {
    backward(kernel, x, &Segments(p), g)
}

/// The masked forward of `kernel` through the boundary.
///
/// # Errors
/// As [`varlen_forward`].
pub fn masked_forward<K: F32AttentionMath + ?Sized>(
    kernel: &K,
    x: Qkv<'_>,
    m: Masked<'_>,
) -> Result<AttentionOutput> {
    forward(kernel, x, &m)
}

/// The masked backward of `kernel` through the boundary.
///
/// # Errors
/// As [`varlen_backward`].
pub fn masked_backward<K: F32AttentionMath + ?Sized>(
    kernel: &K,
    x: Qkv<'_>,
    m: Masked<'_>,
    g: Grad<'_>,
) -> Result<AttentionGrads> {
    backward(kernel, x, &m, g)
}

pub(crate) fn widen((out, lse): (Array3<f32>, Array2<f32>)) -> AttentionOutput {
    AttentionOutput {
        output: to_f64(out.view()),
        lse: to_f64(lse.view()),
    }
}

pub(crate) fn widen_grads([gq, gk, gv]: [Array3<f32>; 3]) -> AttentionGrads {
    AttentionGrads {
        grad_q: to_f64(gq.view()),
        grad_k: to_f64(gk.view()),
        grad_v: to_f64(gv.view()),
    }
}

/// The forward's results and the incoming gradient in f32, shapes checked.
pub(crate) fn saved(
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
/// a `$kernel` that implements [`F32AttentionMath`].
#[macro_export]
macro_rules! f32_attention_op {
    ($kernel:ty) => {
        impl $crate::ops::boundary::reexport::AttentionOp for $kernel {
            fn support(&self) -> $crate::ops::boundary::reexport::AttentionSupport {
                $crate::ops::boundary::F32AttentionMath::support(self)
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

/// The names [`f32_attention_op!`] expands to, so that a crate using it
/// needs no `use` of its own.
#[doc(hidden)]
pub mod reexport {
    pub use packshard_reference::attention::{AttentionGrads, AttentionOutput};
    pub use packshard_reference::ops::{AttentionOp, AttentionSupport, Grad, Masked, Qkv, Varlen};
    pub use packshard_reference::Result;
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
            ScalarAttention.forward(x, mask)
        }
        fn backward(
            &self,
            x: &Qkv32,
            mask: &dyn KeyMask,
            fwd: (&Array3<f32>, &Array2<f32>),
            go: &Array3<f32>,
        ) -> [Array3<f32>; 3] {
            ScalarAttention.backward(x, mask, fwd, go)
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
}
