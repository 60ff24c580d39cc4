//! Logit soft-capping: `z -> c * tanh(z / c)` applied to every logit before
//! anything else reads it (the softmax, label smoothing, the z-loss,
//! `ignore_index`), as Gemma 2 (Gemma Team 2024, §2: `final_logit_softcapping
//! = 30`), flash-attention's `softcap` argument, Liger's and Apple's CCE
//! `softcap` do. docs/FAULTS.md O1 is the fault `z * tanh(z)`
//! (flash-attention PR 2402).
//!
//! A masked logit (`-inf`) stays `-inf`: masking comes after the cap, so a
//! masked entry never gets the probability of `-c`. The gradient of a capped
//! logit `y = c tanh(z / c)` with respect to the raw `z` is `1 - tanh^2(z /
//! c) = (1 - y / c)(1 + y / c)` (the factored form keeps its relative
//! precision while `|y| / c` is near 1); every implementation multiplies
//! `dL/dy` by it, from the capped value it already holds.

use ndarray::{ArrayViewMut2, Axis, Slice};

/// `c * tanh(z / c)`; `-inf` stays `-inf`.
#[inline]
pub fn cap(z: f64, c: f64) -> f64 {
    if z == f64::NEG_INFINITY {
        z
    } else {
        c * (z / c).tanh()
    }
}

/// `dy/dz` of `y = c tanh(z / c)` from the capped value `y`: `(1 - y / c)(1
/// + y / c)`; 1 at `y = -inf` (a masked entry is passed through unchanged).
#[inline]
pub fn grad_factor(capped: f64, c: f64) -> f64 {
    if capped == f64::NEG_INFINITY {
        1.0
    } else {
        let t = capped / c;
        (1.0 - t) * (1.0 + t)
    }
}

/// Caps the first `columns` columns of `z: [n, w]` in place (padding columns
/// past them are left as they are).
pub fn cap_columns(mut z: ArrayViewMut2<f64>, columns: usize, c: f64) {
    let columns = columns.min(z.ncols());
    z.slice_axis_mut(Axis(1), Slice::from(..columns))
        .mapv_inplace(|x| cap(x, c));
}

/// `dL/dz` from `dL/dy` and the capped logit `y` under `softcap` (`None`:
/// unchanged, bit for bit).
#[inline]
pub fn chain(grad: f64, capped: f64, softcap: Option<f64>) -> f64 {
    match softcap {
        None => grad,
        Some(c) => grad * grad_factor(capped, c),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cap_bounds_and_its_factor_is_the_derivative() {
        let c = 30.0;
        assert_eq!(cap(0.0, c), 0.0);
        assert!((cap(1e4, c) - 30.0).abs() < 1e-12);
        assert!((cap(-1e4, c) + 30.0).abs() < 1e-12);
        assert_eq!(cap(f64::NEG_INFINITY, c), f64::NEG_INFINITY);
        // Central difference against the factor.
        for z in [-70.0, -3.0, 0.5, 12.0, 45.0] {
            let h = 1e-5;
            let fd = (cap(z + h, c) - cap(z - h, c)) / (2.0 * h);
            let g = grad_factor(cap(z, c), c);
            assert!((fd - g).abs() < 1e-8, "z {z}: {fd} vs {g}");
        }
        assert_eq!(chain(2.5, 7.0, None), 2.5);
    }
}
