//! Test helpers shared by the modules' tests: central finite differences and
//! seeded tensors.
//!
//! Finite differences: `(L(x + eps) - L(x - eps)) / 2 eps` with `eps = 1e-5`
//! in f64 has truncation error `eps^2 / 6 * |L'''|` (~1e-11 here) and
//! round-off `~ 1e-16 * |L| / eps` (~1e-11 for |L| ~ 5). [`FD_TOL`] allows
//! 1e-7 absolute + 1e-6 relative: 10^4 x above both, and far below the size
//! of any real gradient bug (a missing term is O(1e-3..1) here).

use ndarray::{Array3, ArrayViewMutD};

use crate::attention::{AttentionGrads, AttentionOutput};

/// The step of the central differences.
pub const FD_EPS: f64 = 1e-5;
/// (absolute, relative) tolerance of a finite-difference gradient check.
pub const FD_TOL: (f64, f64) = (1e-7, 1e-6);

/// Central differences of `f` at every element of `x`, compared with `grad`.
/// Returns the worst (abs error, |grad|) pair.
pub fn fd_check(
    what: &str,
    mut x: ArrayViewMutD<f64>,
    grad: &[f64],
    f: &mut dyn FnMut(&ArrayViewMutD<f64>) -> f64,
) -> f64 {
    assert_eq!(x.len(), grad.len(), "{what}");
    let mut worst = 0.0f64;
    for (i, &analytic) in grad.iter().enumerate() {
        let orig = *x.iter().nth(i).unwrap();
        *x.iter_mut().nth(i).unwrap() = orig + FD_EPS;
        let up = f(&x);
        *x.iter_mut().nth(i).unwrap() = orig - FD_EPS;
        let down = f(&x);
        *x.iter_mut().nth(i).unwrap() = orig;
        let fd = (up - down) / (2.0 * FD_EPS);
        let err = (fd - analytic).abs();
        assert!(
            err <= FD_TOL.0 + FD_TOL.1 * analytic.abs(),
            "{what}[{i}]: analytic {analytic:e}, finite difference {fd:e} (error {err:e})"
        );
        worst = worst.max(err);
    }
    worst
}

pub fn random3(n: usize, h: usize, d: usize, seed: u64) -> Array3<f64> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    Array3::from_shape_fn((n, h, d), |_| 2.0 * rng.random::<f64>() - 1.0)
}

/// An attention forward on `(q, k, v)`.
pub type AttentionFn<'a> = dyn Fn(&Array3<f64>, &Array3<f64>, &Array3<f64>) -> AttentionOutput + 'a;

/// FD check of an attention op through `L = sum(grad_output * output)`.
pub fn attention_fd(
    name: &str,
    q: &Array3<f64>,
    k: &Array3<f64>,
    v: &Array3<f64>,
    go: &Array3<f64>,
    fwd: &AttentionFn,
    grads: &AttentionGrads,
) {
    let loss =
        |q: &Array3<f64>, k: &Array3<f64>, v: &Array3<f64>| (&fwd(q, k, v).output * go).sum();
    for (which, g) in [
        ("q", &grads.grad_q),
        ("k", &grads.grad_k),
        ("v", &grads.grad_v),
    ] {
        let mut x = match which {
            "q" => q.clone(),
            "k" => k.clone(),
            _ => v.clone(),
        };
        let gv: Vec<f64> = g.iter().copied().collect();
        let mut f = |x: &ArrayViewMutD<f64>| {
            let x3: Array3<f64> = x.to_owned().into_dimensionality().unwrap();
            match which {
                "q" => loss(&x3, k, v),
                "k" => loss(q, &x3, v),
                _ => loss(q, k, &x3),
            }
        };
        fd_check(
            &format!("{name} grad_{which}"),
            x.view_mut().into_dyn(),
            &gv,
            &mut f,
        );
    }
}
