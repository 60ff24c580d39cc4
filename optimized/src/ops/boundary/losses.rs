//! The boundary of an f32 output-layer kernel, written once: a kernel
//! declares its support ([`LossKernelSupport`]: the sharded algorithms and
//! the loss options it implements) and implements its math on f32 tensors
//! ([`CrossEntropyMath`], [`LinearCrossEntropyMath`]), and
//! [`cross_entropy_op!`](crate::cross_entropy_op) /
//! [`linear_cross_entropy_op!`](crate::linear_cross_entropy_op) make it a
//! [`CrossEntropyOp`] / [`LinearCrossEntropyOp`] (with its [`LossOp`] taken
//! from the declaration) that
//!
//! 1. refuses what the declaration does not cover: a sharded algorithm
//!    ([`check_algorithm`], naming `algorithm`), then a loss option
//!    ([`LossSupport::check`], naming `softcap` or `grad_output`): the
//!    refusal of [`LossOp::check_declared`], with its errors;
//! 2. refuses the options an f32 kernel cannot hold ([`check_call_f32`]:
//!    `softcap`, `z_loss`, `grad_output[i]` beyond f32's range);
//! 3. rounds the inputs to f32, refusing finite values beyond its range
//!    naming the field and flat index ([`to_f32`]; sharded, only the real
//!    `v` columns of the logits or rows of the weight are checked,
//!    [`to_f32_real`]);
//! 4. calls the math, which makes the reference's checks of the call in
//!    the reference's order on the rounded inputs (shapes, finite values,
//!    options, targets: `crate::vocab`'s, as the reference's) and computes;
//! 5. widens the results to f64 exactly (the sharded math returns the
//!    reference's [`ShardedLoss`] itself).
//!
//! Shapes: `logits: [n, v]` (sharded `[n, w]`, `w >= v`, columns `v..`
//! padding never read), `hidden: [n, h]`, `weight: [v, h]` (sharded `[w,
//! h]`, rows `v..` padding), `targets: [n]`.

use ndarray::{ArrayView2, Axis};
use packshard_reference::ops::{check_algorithm, CeCall, LinearCall, LinearLoss, LossSupport};
#[cfg(doc)]
use packshard_reference::ops::{CrossEntropyOp, LinearCrossEntropyOp, LossOp};
use packshard_reference::vocab::cross_entropy::CrossEntropy;
use packshard_reference::vocab::sharded::ShardedLoss;
use packshard_reference::vocab::{LossCall, ShardPlan, ShardedAlgorithm};
use packshard_reference::Result;

use crate::convert::{check_call_f32, to_f32, to_f32_real, to_f64};
use crate::vocab::{CrossEntropy32, LinearCrossEntropy32};

/// What an output-layer kernel declares; the boundary refuses the rest.
/// Nothing is implied: a kernel lists every algorithm and option it
/// implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LossKernelSupport {
    /// The sharded algorithms it implements ([`LossOp::algorithms`]; empty:
    /// unsharded only).
    pub algorithms: &'static [ShardedAlgorithm],
    /// The loss options it implements beyond the basic ones
    /// ([`LossOp::options`]).
    pub options: LossSupport,
}

/// The math of an f32 cross-entropy kernel on given logits;
/// [`cross_entropy_op!`](crate::cross_entropy_op) gives it the boundary
/// (see the module docs).
pub trait CrossEntropyMath: Send + Sync {
    /// What it implements (declare it: the boundary refuses the rest).
    fn support(&self) -> LossKernelSupport;

    /// Unsharded: `logits: [n, v]` in f32, `call.targets: [n]`; the
    /// reference's fields, `grad_logits: [n, v]` in f32 when `call` asks for
    /// gradients.
    ///
    /// # Errors
    /// The reference's ([`packshard_reference::vocab::cross_entropy()`]),
    /// then the kernel's own.
    fn unsharded(&self, logits: ArrayView2<f32>, call: &LossCall) -> Result<CrossEntropy32>;

    /// Sharded by `plan` (its algorithm one the support declares): `logits:
    /// [n, w]` in f32 (`w >= v`, columns `v..` cast but never read), every
    /// rank's results. The default refuses every algorithm, as an
    /// unsharded-only kernel must ([`check_algorithm`] with none declared).
    ///
    /// # Errors
    /// As [`CrossEntropyMath::unsharded`], and the sharded reference's.
    fn sharded(
        &self,
        plan: ShardPlan,
        logits: ArrayView2<f32>,
        call: &LossCall,
    ) -> Result<ShardedLoss> {
        let _ = (logits, call);
        unsharded_only(plan.algorithm)
    }
}

/// The math of an f32 output layer (`logits = hidden @ weight^T` and their
/// cross-entropy); [`linear_cross_entropy_op!`](crate::linear_cross_entropy_op)
/// gives it the boundary (see the module docs).
pub trait LinearCrossEntropyMath: Send + Sync {
    /// What [`LinearCrossEntropyMath::unsharded`] returns:
    /// [`LinearCrossEntropy32`] (f32 results, widened exactly), or a
    /// [`LinearLoss`] a kernel already holds in f64 (the CUDA kernels' host
    /// merge), taken as it is.
    type Output: IntoLinearLoss;

    /// What it implements (declare it: the boundary refuses the rest).
    fn support(&self) -> LossKernelSupport;

    /// Unsharded: `hidden: [n, h]`, `weight: [v, h]` in f32, `call.targets:
    /// [n]`; `dL/dlogits: [n, v]` where the kernel holds it, `dL/dhidden:
    /// [n, h]` and `dL/dW: [v, h]` when `call` asks for gradients.
    ///
    /// # Errors
    /// The reference's
    /// ([`packshard_reference::vocab::linear_cross_entropy()`], with the f32
    /// logit bound of `crate::vocab::check_linear`), then the kernel's own.
    fn unsharded(
        &self,
        hidden: ArrayView2<f32>,
        weight: ArrayView2<f32>,
        call: &LossCall,
    ) -> Result<Self::Output>;

    /// Sharded by `plan` (its algorithm one the support declares): `weight:
    /// [w, h]` in f32 (`w >= v`, rows `v..` cast but never read). The
    /// default refuses every algorithm, as for
    /// [`CrossEntropyMath::sharded`].
    ///
    /// # Errors
    /// As [`LinearCrossEntropyMath::unsharded`], and the sharded
    /// reference's.
    fn sharded(
        &self,
        plan: ShardPlan,
        hidden: ArrayView2<f32>,
        weight: ArrayView2<f32>,
        call: &LossCall,
    ) -> Result<ShardedLoss> {
        let _ = (hidden, weight, call);
        unsharded_only(plan.algorithm)
    }
}

/// The refusal of a kernel that declares no algorithm.
fn unsharded_only(algorithm: ShardedAlgorithm) -> Result<ShardedLoss> {
    Err(check_algorithm(&[], algorithm).expect_err("no algorithm is declared"))
}

/// Steps 1 and 2 of the module docs: `algorithm` (a sharded call) and
/// `call`'s options against the declaration `s`, then the f32 options.
fn declared(
    s: &LossKernelSupport,
    algorithm: Option<ShardedAlgorithm>,
    call: &LossCall,
) -> Result<()> {
    if let Some(a) = algorithm {
        check_algorithm(s.algorithms, a)?;
    }
    s.options.check(call)?;
    check_call_f32(call)
}

/// The results of an f32 cross-entropy, widened (exactly) to the
/// reference's type.
fn widen_ce(ce: CrossEntropy32) -> CrossEntropy {
    CrossEntropy {
        loss: ce.loss,
        per_token_loss: ce.per_token_loss,
        stats: ce.stats,
        num_tokens: ce.num_tokens,
        grad_logits: ce.grad_logits.map(|g| to_f64(g.view())),
    }
}

/// An unsharded output layer's results as the reference's type (step 5 of
/// the module docs).
pub trait IntoLinearLoss {
    /// The results in f64, exactly.
    fn into_linear_loss(self) -> LinearLoss;
}

/// Widened (exactly): the logits buffer it reports and the error it traded
/// as they are.
impl IntoLinearLoss for LinearCrossEntropy32 {
    fn into_linear_loss(self) -> LinearLoss {
        LinearLoss {
            ce: widen_ce(self.ce),
            grad_hidden: self.grad_hidden.map(|g| to_f64(g.view())),
            grad_weight: self.grad_weight.map(|g| to_f64(g.view())),
            logits_buffer_bytes: Some(self.logits_buffer_bytes),
            traded: self.traded,
        }
    }
}

/// Already f64: as it is.
impl IntoLinearLoss for LinearLoss {
    fn into_linear_loss(self) -> LinearLoss {
        self
    }
}

/// The unsharded cross-entropy of `kernel` through the boundary.
///
/// # Errors
/// The declaration's refusals, the f32 ones, then the math's (the
/// reference's).
pub fn cross_entropy<K: CrossEntropyMath + ?Sized>(
    kernel: &K,
    c: CeCall<'_>,
) -> Result<CrossEntropy> {
    declared(&kernel.support(), None, &c.call)?;
    let z = to_f32("logits", c.input)?;
    Ok(widen_ce(kernel.unsharded(z.view(), &c.call)?))
}

/// The sharded cross-entropy of `kernel` through the boundary.
///
/// # Errors
/// As [`cross_entropy`]; [`check_algorithm`] for an undeclared algorithm.
pub fn sharded_cross_entropy<K: CrossEntropyMath + ?Sized>(
    kernel: &K,
    plan: ShardPlan,
    c: CeCall<'_>,
) -> Result<ShardedLoss> {
    declared(&kernel.support(), Some(plan.algorithm), &c.call)?;
    let z = to_f32_real("logits", c.input, Axis(1), plan.map.vocab_size())?;
    kernel.sharded(plan, z.view(), &c.call)
}

/// The unsharded output layer of `kernel` through the boundary.
///
/// # Errors
/// As [`cross_entropy`].
pub fn linear_cross_entropy<K: LinearCrossEntropyMath + ?Sized>(
    kernel: &K,
    c: LinearCall<'_>,
) -> Result<LinearLoss> {
    declared(&kernel.support(), None, &c.call)?;
    let x = to_f32("hidden", c.input.hidden)?;
    let w = to_f32("weight", c.input.weight)?;
    Ok(kernel
        .unsharded(x.view(), w.view(), &c.call)?
        .into_linear_loss())
}

/// The sharded output layer of `kernel` through the boundary.
///
/// # Errors
/// As [`sharded_cross_entropy`].
pub fn sharded_linear_cross_entropy<K: LinearCrossEntropyMath + ?Sized>(
    kernel: &K,
    plan: ShardPlan,
    c: LinearCall<'_>,
) -> Result<ShardedLoss> {
    declared(&kernel.support(), Some(plan.algorithm), &c.call)?;
    let x = to_f32("hidden", c.input.hidden)?;
    let w = to_f32_real("weight", c.input.weight, Axis(0), plan.map.vocab_size())?;
    kernel.sharded(plan, x.view(), w.view(), &c.call)
}

/// The [`LossOp`] of a `$kernel` whose math declares its support (the
/// shared half of both loss macros).
#[doc(hidden)]
#[macro_export]
macro_rules! loss_op {
    (impl[$($g:tt)*] $kernel:ty, $math:path) => {
        impl<$($g)*> $crate::ops::boundary::reexport::LossOp for $kernel {
            fn algorithms(&self) -> Vec<$crate::ops::boundary::reexport::ShardedAlgorithm> {
                <Self as $math>::support(self).algorithms.to_vec()
            }
            fn options(&self) -> $crate::ops::boundary::reexport::LossSupport {
                <Self as $math>::support(self).options
            }
        }
    };
}

/// `impl LossOp + CrossEntropyOp for $kernel` through the boundary of this
/// module, for a `$kernel` that implements [`CrossEntropyMath`]; for a
/// generic one, `cross_entropy_op!(impl[B: Bound] Kernel<B>)`.
#[macro_export]
macro_rules! cross_entropy_op {
    (impl[$($g:tt)*] $kernel:ty) => {
        $crate::loss_op!(impl[$($g)*] $kernel, $crate::ops::boundary::CrossEntropyMath);
        impl<$($g)*> $crate::ops::boundary::reexport::CrossEntropyOp for $kernel {
            fn cross_entropy(
                &self,
                c: $crate::ops::boundary::reexport::CeCall<'_>,
            ) -> $crate::ops::boundary::reexport::Result<
                $crate::ops::boundary::reexport::CrossEntropy,
            > {
                $crate::ops::boundary::cross_entropy(self, c)
            }
            fn sharded_cross_entropy(
                &self,
                plan: $crate::ops::boundary::reexport::ShardPlan,
                c: $crate::ops::boundary::reexport::CeCall<'_>,
            ) -> $crate::ops::boundary::reexport::Result<
                $crate::ops::boundary::reexport::ShardedLoss,
            > {
                $crate::ops::boundary::sharded_cross_entropy(self, plan, c)
            }
        }
    };
    ($kernel:ty) => {
        $crate::cross_entropy_op!(impl[] $kernel);
    };
}

/// `impl LossOp + LinearCrossEntropyOp for $kernel` through the boundary of
/// this module, for a `$kernel` that implements [`LinearCrossEntropyMath`];
/// for a generic one, `linear_cross_entropy_op!(impl[B: Bound] Kernel<B>)`.
#[macro_export]
macro_rules! linear_cross_entropy_op {
    (impl[$($g:tt)*] $kernel:ty) => {
        $crate::loss_op!(impl[$($g)*] $kernel, $crate::ops::boundary::LinearCrossEntropyMath);
        impl<$($g)*> $crate::ops::boundary::reexport::LinearCrossEntropyOp for $kernel {
            fn linear_cross_entropy(
                &self,
                c: $crate::ops::boundary::reexport::LinearCall<'_>,
            ) -> $crate::ops::boundary::reexport::Result<
                $crate::ops::boundary::reexport::LinearLoss,
            > {
                $crate::ops::boundary::linear_cross_entropy(self, c)
            }
            fn sharded_linear_cross_entropy(
                &self,
                plan: $crate::ops::boundary::reexport::ShardPlan,
                c: $crate::ops::boundary::reexport::LinearCall<'_>,
            ) -> $crate::ops::boundary::reexport::Result<
                $crate::ops::boundary::reexport::ShardedLoss,
            > {
                $crate::ops::boundary::sharded_linear_cross_entropy(self, plan, c)
            }
        }
    };
    ($kernel:ty) => {
        $crate::linear_cross_entropy_op!(impl[] $kernel);
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::{CrossEntropyF32, LinearCeMaterialized};
    use ndarray::Array2;
    use packshard_reference::ops::{CrossEntropyOp, LinearCrossEntropyOp, LinearInput, LossOp};
    use packshard_reference::vocab::{GradRequest, LossConfig, ShardLayout, ShardMap};

    /// `cross_entropy_f32`'s math under another declaration.
    struct Declares(LossKernelSupport);

    impl CrossEntropyMath for Declares {
        fn support(&self) -> LossKernelSupport {
            self.0
        }
        fn unsharded(&self, z: ArrayView2<f32>, call: &LossCall) -> Result<CrossEntropy32> {
            CrossEntropyMath::unsharded(&CrossEntropyF32, z, call)
        }
        fn sharded(
            &self,
            plan: ShardPlan,
            z: ArrayView2<f32>,
            call: &LossCall,
        ) -> Result<ShardedLoss> {
            CrossEntropyMath::sharded(&CrossEntropyF32, plan, z, call)
        }
    }

    crate::cross_entropy_op!(Declares);

    fn field<T>(r: Result<T>) -> Option<String> {
        r.err()
            .map(|e| e.to_string().split(':').next().unwrap_or("").to_string())
    }

    /// What a kernel does not declare (an algorithm, the softcap, an
    /// upstream gradient) is refused naming it, through the op and through
    /// `LossOp::check_declared` alike; declaring it, the same calls run
    /// (the negative control).
    #[test]
    fn the_loss_boundary_refuses_what_the_support_does_not_declare() {
        let z = Array2::from_shape_fn((3, 5), |(i, j)| (i * 5 + j) as f64 * 0.25 - 1.5);
        let targets = [0i64, 4, 2];
        let plain = LossConfig::default();
        let capped = LossConfig {
            softcap: Some(30.0),
            ..LossConfig::default()
        };
        let upstream = [0.5]; // a scalar: the reduction is the mean
        let map = ShardMap::new(5, 2, ShardLayout::Uneven).unwrap();
        let alg2 = ShardPlan::new(ShardedAlgorithm::Alg2, map);
        let bare = Declares(LossKernelSupport {
            algorithms: &[],
            options: LossSupport::BASIC,
        });
        let all = Declares(LossKernelSupport {
            algorithms: &[ShardedAlgorithm::Alg2],
            options: LossSupport::ALL,
        });
        let calls = [
            (LossCall::with_flag(&targets, &capped, true), "softcap"),
            (
                LossCall::new(&targets, &plain, GradRequest::Upstream(&upstream)),
                "grad_output",
            ),
        ];
        for (call, name) in calls {
            let c = CeCall::new(z.view(), call);
            assert_eq!(field(bare.cross_entropy(c)).as_deref(), Some(name));
            assert_eq!(
                field(bare.check_declared(None, &call)).as_deref(),
                Some(name)
            );
            assert_eq!(field(all.cross_entropy(c)), None);
            assert_eq!(field(all.sharded_cross_entropy(alg2, c)), None);
        }
        let c = CeCall::new(z.view(), LossCall::with_flag(&targets, &plain, true));
        assert_eq!(field(bare.cross_entropy(c)), None);
        let refused = bare.sharded_cross_entropy(alg2, c).unwrap_err();
        assert_eq!(
            refused.to_string(),
            "algorithm: this implementation runs the unsharded form only, not alg2"
        );
        assert!(bare.algorithms().is_empty());
        assert_eq!(bare.options(), LossSupport::BASIC);
    }

    /// The f32 kernels' declarations as the ops report them: every option,
    /// `alg2` or nothing sharded; an unsharded-only kernel refuses `alg2`
    /// naming `algorithm` before it reads its inputs.
    #[test]
    fn the_f32_loss_kernels_declare_what_they_implement() {
        assert_eq!(CrossEntropyF32.algorithms(), [ShardedAlgorithm::Alg2]);
        assert_eq!(CrossEntropyF32.options(), LossSupport::ALL);
        assert!(LinearCeMaterialized.algorithms().is_empty());
        assert_eq!(LinearCeMaterialized.options(), LossSupport::ALL);
        let x = Array2::from_elem((2, 3), 0.5);
        let w = Array2::from_elem((4, 3), f64::NAN);
        let targets = [1i64, 3];
        let plain = LossConfig::default();
        let c = LinearCall::new(
            LinearInput::new(x.view(), w.view()),
            LossCall::with_flag(&targets, &plain, false),
        );
        let map = ShardMap::new(4, 2, ShardLayout::Uneven).unwrap();
        let plan = ShardPlan::new(ShardedAlgorithm::Alg2, map);
        let sharded = LinearCeMaterialized.sharded_linear_cross_entropy(plan, c);
        assert_eq!(field(sharded).as_deref(), Some("algorithm"));
        // The unsharded form reads the weight: its NaN is the reference's error.
        let unsharded = LinearCeMaterialized.linear_cross_entropy(c).unwrap_err();
        assert_eq!(unsharded.kind(), "non_finite_input");
    }
}
