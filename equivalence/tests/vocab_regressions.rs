//! Regressions of the vocabulary suite: shrunk failures of its random cases,
//! pinned, each run through every sharded algorithm of the reference.

use ndarray::Array2;
use packshard_equivalence::planted::{Planted, VocabHooks};
use packshard_equivalence::vocab::{check_linear, LinearCase};
use packshard_reference::vocab::{
    linear_cross_entropy, LossCall, LossConfig, ShardLayout, ShardMap, ShardedAlgorithm,
    SmoothingConvention,
};

/// The reference's vocabulary ops as one value.
struct ReferenceHooks;
impl VocabHooks for ReferenceHooks {}
const REFERENCE: Planted<ReferenceHooks> = Planted(ReferenceHooks);

fn row(z: &[f64]) -> Array2<f64> {
    Array2::from_shape_vec((1, z.len()), z.to_vec()).unwrap()
}

fn map(v: usize, p: usize, layout: ShardLayout) -> ShardMap {
    ShardMap::new(v, p, layout).unwrap()
}

fn linear(
    v: usize,
    p: usize,
    layout: ShardLayout,
    hidden: Array2<f64>,
    weight: Array2<f64>,
    targets: Vec<i64>,
    config: LossConfig,
) -> LinearCase {
    LinearCase {
        map: map(v, p, layout),
        hidden,
        weight,
        targets,
        config,
        grad_output: None,
    }
}

fn all_algorithms_pass(case: &LinearCase) {
    for algorithm in ShardedAlgorithm::ALL {
        check_linear(&REFERENCE, algorithm, case, true)
            .unwrap_or_else(|m| panic!("{algorithm}: {m}"));
    }
}

#[test]
fn regression_two_tied_maxima_one_the_target() {
    // z = [0, 0, 9.12, 9.12], target 2: ∂L/∂x = -100 (δ_2 + δ_3) cancels to
    // 1e-2 from terms of 50; judged against the terms, as its round-off is.
    let case = linear(
        4,
        2,
        ShardLayout::Padded,
        row(&[0.0, -0.091201969259822]),
        Array2::from_shape_vec((4, 2), vec![0.0, 0.0, 0.0, 0.0, 0.0, -100.0, 0.0, -100.0]).unwrap(),
        vec![2],
        LossConfig::default()
            .with_smoothing(0.0, SmoothingConvention::Megatron)
            .with_reduction(packshard_reference::vocab::Reduction::Sum),
    );
    all_algorithms_pass(&case);
}

#[test]
fn regression_z_loss_with_a_wrong_confident_prediction() {
    // lse ≈ 1e4 and c = 0.04: 2 c lse ≈ 830. alg2 used to form the z-loss part
    // as 2 c lse (Σ(p - q) W + Σ q W), whose middle term is not bounded by the
    // gradient's own terms; it now carries Σ p W itself.
    let mut hidden = Array2::zeros((5, 3));
    hidden.row_mut(2).assign(&ndarray::arr1(&[
        -1.9899721824948018,
        0.8112167979202739,
        100.0,
    ]));
    let case = linear(
        2,
        1,
        ShardLayout::Uneven,
        hidden,
        Array2::from_shape_vec(
            (2, 3),
            vec![
                0.0,
                -100.0,
                0.0,
                1.713696252447303,
                -0.3857798636289698,
                100.0,
            ],
        )
        .unwrap(),
        vec![0; 5],
        LossConfig::default()
            .with_ignore_index(-1)
            .with_z_loss(0.04149093385139567),
    );
    all_algorithms_pass(&case);
}

#[test]
fn regression_a_probability_far_below_the_maximum() {
    // z - m ≈ -329: p = exp(-329) carries 329 ulp from the rounding of its
    // argument, which alg1/alg2 round as (z - m_i) + (m_i - m).
    let mut hidden = Array2::zeros((5, 3));
    hidden.row_mut(4).assign(&ndarray::arr1(&[
        -0.051423488294847816,
        -1.6441019159452925,
        0.0,
    ]));
    let mut weight = Array2::zeros((5, 3));
    weight
        .row_mut(1)
        .assign(&ndarray::arr1(&[0.0, -100.0, 0.0]));
    weight
        .row_mut(4)
        .assign(&ndarray::arr1(&[0.16687579266156422, 100.0, 0.0]));
    let config = LossConfig::default()
        .with_ignore_index(-1)
        .with_z_loss(0.04149093385139567);
    all_algorithms_pass(&linear(
        5,
        2,
        ShardLayout::Uneven,
        hidden,
        weight,
        vec![0; 5],
        config,
    ));
}

#[test]
fn regression_subnormal_gradients() {
    // p ≈ 1e-316 is subnormal (a dozen significant bits): compared absolutely
    // below 64 x f64::MIN_POSITIVE.
    let mut hidden = Array2::zeros((7, 6));
    hidden.row_mut(1).assign(&ndarray::arr1(&[
        -1.4626960969055163,
        100.0,
        1.9504943903699983,
        -0.733827490614271,
        -1.6516896246399788,
        -1.0172813467438262,
    ]));
    let mut weight = Array2::zeros((9, 6));
    weight.row_mut(0).assign(&ndarray::arr1(&[
        -100.0,
        1.8072186681125388,
        0.0,
        -0.415431646202768,
        -0.40319892758083464,
        0.0,
    ]));
    weight.row_mut(1).assign(&ndarray::arr1(&[
        -1.2178883778505387,
        -0.9740751153418149,
        -100.0,
        -0.13707033786568013,
        0.0,
        100.0,
    ]));
    weight.row_mut(7).assign(&ndarray::arr1(&[
        -1.8138863201566786,
        1.6741532156270655,
        -1.4513526736421245,
        -1.0809916059453861,
        -100.0,
        0.0,
    ]));
    let mut targets = vec![0; 7];
    targets[1] = 2;
    let config = LossConfig::default()
        .with_ignore_index(-1)
        .with_reduction(packshard_reference::vocab::Reduction::Sum);
    all_algorithms_pass(&linear(
        9,
        8,
        ShardLayout::Uneven,
        hidden,
        weight,
        targets,
        config,
    ));
}

#[test]
fn regression_many_ties_at_the_maximum_v4() {
    // V = 250682, x = [0, -1], W_jk = ((3 j + 5 k) mod 23) / 11 - 1: ~10,900
    // logits tie at the maximum. (1 - q) - (s - 1)/s at the ties cancelled
    // (s ≈ 3e4) and put the unsharded reference 490 ulp off; 1/s - q is used
    // there now. The truth, in 64-bit-mantissa long double (numpy):
    //   z = W @ x; e = exp(z - z.max()); p = e / e.sum(); p[125000] -= 1
    //   0.5 * (p @ W) = [0.17500333010676119572, -0.26069793846085020927]
    let v = 250_682;
    let hidden = Array2::from_shape_fn((3, 2), |(i, k)| i as f64 * 0.5 - k as f64);
    let weight = Array2::from_shape_fn((v, 2), |(j, k)| ((j * 3 + k * 5) % 23) as f64 / 11.0 - 1.0);
    let targets = vec![125_000, -100, 31_336];
    let config = LossConfig::default();
    let u = linear_cross_entropy(
        hidden.view(),
        weight.view(),
        &LossCall::with_flag(&targets, &config, true),
    )
    .unwrap();
    let truth = [0.175_003_330_106_761_2, -0.260_697_938_460_850_2];
    let gh = u.grad_hidden.unwrap();
    for (k, t) in truth.iter().enumerate() {
        assert!(
            (gh[[0, k]] - t).abs() <= 4.0 * f64::EPSILON * t.abs(),
            "{k}: {} vs {t}",
            gh[[0, k]]
        );
    }
    let case = linear(v, 8, ShardLayout::Uneven, hidden, weight, targets, config);
    all_algorithms_pass(&case);
}
