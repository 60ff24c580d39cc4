//! The in-place f32 entry points' checks: `q`, `k`, `v` (and
//! `grad_output`) read where they lie, no rounding, with the checks of
//! [`varlen_forward`] / [`varlen_backward`] in their order, the values
//! checked by the kernel's own reads (`Seen`).

use ndarray::ArrayView3;
use packshard_reference::attention::{
    check_grad_bound, check_grad_shapes, check_qkv_shapes, check_score_bound,
};
use packshard_reference::ops::Varlen;
use packshard_reference::{Error, Result};

#[cfg(doc)]
use super::{varlen_backward, varlen_forward};
use super::{AttentionMath, Problem32};
use crate::attention::{finite_amax, AttentionGrads32, AttentionOutput32, Seen};

/// `f32` `q: [n_q, h, d]`, `k, v: [n_k, h_kv, d]` and a backward's
/// `grad_output: [n_q, h, d]`, read in place by the in-place entry points
/// ([`crate::ops::TiledAttention::varlen_forward_f32`] and
/// `varlen_backward_f32`), which check their values as the reference does
/// (non-finite values refused first, in the order `q`, `k`, `v`,
/// `grad_output`; then the score bounds) without a pass of their own: the
/// kernel's gathers see every value they read (issue 37: a separate pass
/// over the tensors cost 6 % of the forward), and only where they did not
/// read every element, or something is refused, does [`InPlaceF32::scan`]
/// read the tensors again to say which error comes first.
#[derive(Clone, Copy)]
pub struct InPlaceF32<'a> {
    q: ArrayView3<'a, f32>,
    k: ArrayView3<'a, f32>,
    v: ArrayView3<'a, f32>,
    grad_output: Option<ArrayView3<'a, f32>>,
}

impl<'a> InPlaceF32<'a> {
    /// The tensors; nothing is read or checked yet.
    pub fn new(
        q: ArrayView3<'a, f32>,
        k: ArrayView3<'a, f32>,
        v: ArrayView3<'a, f32>,
        grad_output: Option<ArrayView3<'a, f32>>,
    ) -> Self {
        InPlaceF32 {
            q,
            k,
            v,
            grad_output,
        }
    }

    /// `q`, `k`, `v`.
    pub fn qkv(
        &self,
    ) -> (
        ArrayView3<'a, f32>,
        ArrayView3<'a, f32>,
        ArrayView3<'a, f32>,
    ) {
        (self.q, self.k, self.v)
    }

    /// `grad_output`, if given.
    pub fn grad_output(&self) -> Option<ArrayView3<'a, f32>> {
        self.grad_output
    }

    /// The values' checks in one pass per tensor ([`finite_amax`]): `max
    /// |x|` of `q`, `k`, `v`, `grad_output` (0 without one).
    ///
    /// # Errors
    /// [`Error::NonFiniteInput`] naming the first tensor (in the order `q`,
    /// `k`, `v`, `grad_output`) with a non-finite element and that
    /// element's flat (row-major) index.
    pub fn scan(&self) -> Result<[f32; 4]> {
        Ok([
            finite_amax("q", &self.q)?,
            finite_amax("k", &self.k)?,
            finite_amax("v", &self.v)?,
            self.grad_output
                .as_ref()
                .map_or(Ok(0.0), |g| finite_amax("grad_output", g))?,
        ])
    }

    /// The error to report when a later check refused `e`: a non-finite
    /// value comes first (the reference checks values before shapes,
    /// offsets and bounds).
    fn first_error(&self, e: Error) -> Error {
        self.scan().err().unwrap_or(e)
    }

    /// The largest magnitudes, from what the kernel's gathers saw when they
    /// read every element and all were finite, else from [`Self::scan`].
    fn amax(&self, seen: Seen) -> Result<[f32; 4]> {
        seen.amax().map_or_else(|| self.scan(), Ok)
    }
}

/// The checks of [`varlen_forward`] but the work bound and the values
/// ([`InPlaceF32`]), on f32 inputs read in place (no rounding): shapes, the
/// offsets and options, the kernel's support.
fn check_in_place<K: AttentionMath + ?Sized>(
    kernel: &K,
    x: &InPlaceF32<'_>,
    p: &Varlen<'_>,
) -> Result<()> {
    let (q, k, v) = x.qkv();
    check_qkv_shapes(q.shape(), k.shape(), v.shape())?;
    let ((n_q, h, d), (n_k, h_kv, _)) = (q.dim(), k.dim());
    Problem32::Varlen(p).check([n_q, n_k, h, h_kv, d], &kernel.support())
}

/// The forward of an f32 kernel on inputs read in place, with
/// [`varlen_forward`]'s checks but the work bound, in its order: `run`
/// (the kernel) gives the output and what its gathers saw of the values.
///
/// # Errors
/// As [`varlen_forward`].
pub(crate) fn forward_in_place<K: AttentionMath + ?Sized>(
    kernel: &K,
    x: &InPlaceF32<'_>,
    p: &Varlen<'_>,
    run: impl FnOnce() -> Result<(AttentionOutput32, Seen)>,
) -> Result<AttentionOutput32> {
    let checked = || {
        check_in_place(kernel, x, p)?;
        let (out, seen) = run()?;
        let [aq, ak, ..] = x.amax(seen)?;
        check_score_bound(x.q.dim().2, [f64::from(aq), f64::from(ak)], p.scale)?;
        Ok(out)
    };
    checked().map_err(|e| x.first_error(e))
}

/// [`forward_in_place`] for a backward: also `grad_output` (which `x` must
/// carry) and the saved forward `fwd`: their shapes (after the score bound,
/// as this boundary's f64 path, [`varlen_backward`], checks them: `checked`
/// then `saved`; `packshard_reference`'s own backward checks the shapes
/// first), then `grad_output`'s values against `v`
/// ([`check_grad_bound`]). `run` gets the checked `grad_output`.
///
/// # Errors
/// As [`varlen_backward`]; [`Error::InvalidArgument`] naming
/// `grad_output` when `x` has none.
pub(crate) fn backward_in_place<'a, K: AttentionMath + ?Sized>(
    kernel: &K,
    x: &InPlaceF32<'a>,
    p: &Varlen<'_>,
    fwd: &AttentionOutput32,
    run: impl FnOnce(ArrayView3<'a, f32>) -> Result<(AttentionGrads32, Seen)>,
) -> Result<AttentionGrads32> {
    let d = x.q.dim().2;
    let scores =
        |[aq, ak, ..]: [f32; 4]| check_score_bound(d, [f64::from(aq), f64::from(ak)], p.scale);
    let checked = || {
        check_in_place(kernel, x, p)?;
        let go = x.grad_output.ok_or_else(|| {
            Error::invalid(
                "grad_output",
                "a backward needs grad_output: none was given",
            )
        })?;
        if let Err(e) =
            check_grad_shapes(go.shape(), fwd.output.shape(), fwd.lse.shape(), x.q.dim())
        {
            // The f64 path of this boundary bounds the scores before it
            // reads the saved forward and grad_output.
            scores(x.scan()?)?;
            return Err(e);
        }
        let (grads, seen) = run(go)?;
        let a = x.amax(seen)?;
        scores(a)?;
        check_grad_bound(d, [f64::from(a[3]), f64::from(a[2])])?;
        Ok(grads)
    };
    checked().map_err(|e| x.first_error(e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::Array3;
    use packshard_reference::attention::AttentionOutput;
    use packshard_reference::ops::{Grad, Qkv};

    /// A backward called in place with a `grad_output` of the wrong shape
    /// and scores over their bound gets the error this boundary's f64 path
    /// gives (the score bound first), not the shape's: the one order the
    /// in-place forward never reaches (it refuses the scores itself).
    #[test]
    fn the_in_place_backward_orders_its_refusals_as_the_f64_path() {
        use crate::attention::varlen_attention_general;
        use crate::ops::TiledAttention;
        use packshard_reference::ops::AttentionOp;
        let x = |o: usize| {
            Array3::from_shape_fn((6, 2, 4), |(i, a, c)| {
                ((i * 3 + a * 5 + c + o) % 7) as f32 - 3.0
            })
        };
        let cu = [0, 2, 6];
        let p = Varlen::new(&cu, false, 0.5);
        let (q, k, v) = (x(0), x(1), x(2));
        let fwd = varlen_attention_general(q.view(), k.view(), v.view(), &p).unwrap();
        let mut q_over = q.clone();
        q_over[[1, 0, 0]] = 1e16;
        let mut k_over = k.clone();
        k_over[[4, 1, 3]] = 1e15;
        let bad_go = Array3::<f32>::zeros((5, 2, 4));
        for (what, qx, kx, go) in [
            ("both", &q_over, &k_over, &bad_go),
            ("the shape only", &q, &k, &bad_go),
        ] {
            let xin = InPlaceF32::new(qx.view(), kx.view(), v.view(), Some(go.view()));
            let got = TiledAttention::F32
                .varlen_backward_f32(&xin, &p, &fwd)
                .unwrap_err();
            let wide = [qx, kx, &v, go].map(|t| t.mapv(f64::from));
            let fwd64 = AttentionOutput {
                output: fwd.output.mapv(f64::from),
                lse: fwd.lse.mapv(f64::from),
            };
            let want = TiledAttention::F32
                .varlen_backward(
                    Qkv::new(wide[0].view(), wide[1].view(), wide[2].view()),
                    &p,
                    Grad::new(&fwd64, wide[3].view()),
                )
                .unwrap_err();
            assert_eq!(got.to_string(), want.to_string(), "{what}");
        }
    }
}
