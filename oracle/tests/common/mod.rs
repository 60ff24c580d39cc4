//! Inputs shared by the output-layer kernel tests.

use ndarray::Array2;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// `hidden: [n, h]` in (-1, 1), `weight: [v, h]` in (-0.5, 0.5), targets in
/// `0..v` with every 7th token (from the 4th) ignored (`-100`).
pub fn random(n: usize, h: usize, v: usize, seed: u64) -> (Array2<f32>, Array2<f32>, Vec<i64>) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let hidden = Array2::from_shape_fn((n, h), |_| rng.random_range(-1.0f32..1.0));
    let weight = Array2::from_shape_fn((v, h), |_| rng.random_range(-0.5f32..0.5));
    let targets = (0..n)
        .map(|i| {
            if i % 7 == 3 {
                -100
            } else {
                rng.random_range(0..v as i64)
            }
        })
        .collect();
    (hidden, weight, targets)
}
