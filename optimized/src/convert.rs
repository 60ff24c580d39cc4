//! Conversions at the boundary of the op traits (`packshard_reference::ops`):
//! f64 in, rounded to the kernel's precision, refusing finite values it
//! cannot hold; results widened back to f64 exactly.

use half::bf16;
use ndarray::{Array, ArrayView, Dimension};
use packshard_reference::precision;
use packshard_reference::vocab::LossCall;
use packshard_reference::{Error, Result};

/// `x` as f32, rounded to nearest. Non-finite values pass through (the
/// kernels report them as [`Error::NonFiniteInput`] with the same index).
///
/// # Errors
/// [`Error::InvalidArgument`] naming `field[i]` (flat index) for a finite
/// value beyond the f32 range (`|x| > 3.4e38`).
pub fn to_f32<D: Dimension>(field: &str, x: ArrayView<f64, D>) -> Result<Array<f32, D>> {
    check_f32_range(field, &x)?;
    Ok(x.mapv(|v| v as f32))
}

/// `x` as bf16, by the workspace's one rounding
/// ([`packshard_reference::precision::to_bf16`]: to nearest even, through
/// f32), checked as [`to_f32`].
///
/// # Errors
/// As [`to_f32`].
pub fn to_bf16<D: Dimension>(field: &str, x: ArrayView<f64, D>) -> Result<Array<bf16, D>> {
    check_f32_range(field, &x)?;
    Ok(x.mapv(precision::to_bf16))
}

/// [`to_f32`]'s refusal: the first finite value beyond the f32 range.
fn check_f32_range<D: Dimension>(field: &str, x: &ArrayView<f64, D>) -> Result<()> {
    if let Some((i, &v)) = x
        .iter()
        .enumerate()
        .find(|(_, v)| v.is_finite() && v.abs() > f32::MAX as f64)
    {
        return Err(Error::invalid(
            format!("{field}[{i}]"),
            format!("{v:e} is beyond the f32 range of the optimized kernels"),
        ));
    }
    Ok(())
}

/// An f32 tensor as f64 (exact).
pub fn to_f64<D: Dimension>(x: ArrayView<f32, D>) -> Array<f64, D> {
    x.mapv(f64::from)
}

/// `x` as f32 where only the first `v` entries along `axis` are read by the
/// kernel (the real vocabulary; the rest is Megatron-style padding, cast but
/// never checked or read).
///
/// # Errors
/// As [`to_f32`], for the real entries.
pub fn to_f32_real<D: Dimension>(
    field: &str,
    x: ArrayView<f64, D>,
    axis: ndarray::Axis,
    v: usize,
) -> Result<Array<f32, D>> {
    to_f32(
        field,
        x.slice_axis(axis, ndarray::Slice::from(..v.min(x.len_of(axis)))),
    )?;
    Ok(x.mapv(|v| v as f32))
}

/// A loss call's options checked as the f32 kernels' inputs are: the
/// `softcap` (rounded to f32 by the kernels: beyond f32's range it becomes
/// infinite, below it 0, a division by zero), the `z_loss` coefficient and
/// the upstream `grad_output` (which scale f32 gradients: beyond f32's range
/// every gradient overflows) within f32's range. The reference refuses the
/// values no kernel may take (a negative softcap, a non-finite upstream);
/// these are the ones only an f32 kernel cannot hold.
///
/// # Errors
/// [`Error::InvalidArgument`] naming `softcap`, `z_loss` or
/// `grad_output[i]`.
pub fn check_call_f32(call: &LossCall<'_>) -> Result<()> {
    let beyond = |v: f64| v.is_finite() && v.abs() > f32::MAX as f64;
    let refuse = |field: String, v: f64, why: &str| {
        Err(Error::invalid(
            field,
            format!("{v:e} {why} of the f32 kernels"),
        ))
    };
    if let Some(c) = call.config.softcap {
        if beyond(c) {
            return refuse("softcap".into(), c, "is beyond the f32 range");
        }
        if c > 0.0 && (c as f32) == 0.0 {
            return refuse("softcap".into(), c, "rounds to 0 in the f32 arithmetic");
        }
    }
    let z = call.config.z_loss;
    if beyond(z) {
        return refuse("z_loss".into(), z, "is beyond the f32 range");
    }
    if let Some(g) = call.grad.upstream() {
        if let Some((i, &v)) = g.iter().enumerate().find(|(_, &v)| beyond(v)) {
            return refuse(format!("grad_output[{i}]"), v, "is beyond the f32 range");
        }
    }
    Ok(())
}
