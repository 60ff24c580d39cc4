//! Conversions at the boundary of the op traits (`packshard_reference::ops`):
//! f64 in, rounded to the kernel's precision, refusing finite values it
//! cannot hold; results widened back to f64 exactly.

use half::bf16;
use ndarray::{Array, ArrayView, Dimension};
use packshard_reference::{Error, Result};

/// `x` as f32, rounded to nearest. Non-finite values pass through (the
/// kernels report them as [`Error::NonFiniteInput`] with the same index).
///
/// # Errors
/// [`Error::InvalidArgument`] naming `field[i]` (flat index) for a finite
/// value beyond the f32 range (`|x| > 3.4e38`).
pub fn to_f32<D: Dimension>(field: &str, x: ArrayView<f64, D>) -> Result<Array<f32, D>> {
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
    Ok(x.mapv(|v| v as f32))
}

/// `x` as bf16 (round to nearest even), checked as [`to_f32`].
///
/// # Errors
/// As [`to_f32`].
pub fn to_bf16<D: Dimension>(field: &str, x: ArrayView<f64, D>) -> Result<Array<bf16, D>> {
    Ok(to_f32(field, x)?.mapv(bf16::from_f32))
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
