//! The gradient-filtering output layer (`linear_ce_tiled_filtered`, Cut
//! Cross-Entropy's §4.3 on the tiled kernel): what it skips, that the error
//! it reports it traded bounds the error it has, and that the suite judges
//! it by that report: the honest kernel passes with a threshold that skips
//! most of the gradient, the same kernel reporting nothing (or only half)
//! fails (negative controls).

mod common;

use common::random;
use ndarray::Array2;
use packshard_equivalence::planted::{KernelThenEdit, Planted, VocabHooks};
use packshard_equivalence::vocab::{check_linear_unsharded, LinearCase, Rule};
use packshard_optimized::ops::{LinearCeTiled, LinearCeTiledFiltered};
use packshard_optimized::vocab::{
    linear_cross_entropy_tiled, linear_cross_entropy_tiled_filtered, Chunks, LinearCrossEntropy32,
};
use packshard_oracle::registry::{self, SMALL_CHUNKS};
use packshard_reference::ops::{LinearLoss, LossOp, TradedError};
use packshard_reference::vocab::sharded::ShardedLoss;
use packshard_reference::vocab::{LossCall, LossConfig, Reduction, ShardLayout, ShardMap};
use packshard_reference::Error;

fn max_diff(a: &Array2<f32>, b: &Array2<f32>) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (f64::from(*x) - f64::from(*y)).abs())
        .fold(0.0, f64::max)
}

/// A random case `(n, h, v, seed)` (default options, gradients asked for) and
/// chunks `(tokens, vocab)`: its targets, the tiled kernel's results and the
/// filtered kernel's at `threshold`.
fn tiled_and_filtered(
    (n, h, v, seed): (usize, usize, usize, u64),
    (tokens, vocab): (usize, usize),
    threshold: f32,
) -> (Vec<i64>, LinearCrossEntropy32, LinearCrossEntropy32) {
    let (x, w, t) = random(n, h, v, seed);
    let config = LossConfig::default();
    let call = LossCall::with_flag(&t, &config, true);
    let chunks = Chunks { tokens, vocab };
    let tiled = linear_cross_entropy_tiled(x.view(), w.view(), &call, chunks).unwrap();
    let f =
        linear_cross_entropy_tiled_filtered(x.view(), w.view(), &call, chunks, threshold).unwrap();
    (t, tiled, f)
}

/// Threshold 0 skips exactly the all-zero tiles (a chunk of one ignored
/// token): the tiled kernel's results bit for bit, a bound of 0, and the
/// count of those tiles.
#[test]
fn threshold_zero_skips_only_zero_tiles() {
    let v = 23;
    let (t, tiled, f) = tiled_and_filtered((29, 12, v, 5), (1, 7), 0.0);
    assert_eq!(tiled.traded, None);
    let ignored = t.iter().filter(|&&t| t == -100).count();
    let want = TradedError {
        grad_hidden: 0.0,
        grad_weight: 0.0,
        skipped_tiles: ignored * v.div_ceil(7),
    };
    assert_eq!(f.traded, Some(want));
    assert_eq!(f.grad_hidden, tiled.grad_hidden);
    assert_eq!(f.grad_weight, tiled.grad_weight);
    assert_eq!(f.ce, tiled.ce);
}

/// With a threshold that skips most tiles, the gradients' distance to the
/// unfiltered kernel's is within the reported bounds (up to f32 rounding of
/// the kept terms), the bounds are not vacuous (the error reaches a tenth of
/// them), and the losses are the tiled kernel's exactly.
#[test]
fn the_reported_bound_holds() {
    let (n, v) = (40, 90);
    let (_, tiled, f) = tiled_and_filtered((n, 16, v, 9), (4, 6), 0.05);
    let traded = f.traded.expect("the filtered kernel reports");
    let tiles = n.div_ceil(4) * v.div_ceil(6);
    assert!(
        traded.skipped_tiles > tiles / 2 && traded.skipped_tiles < tiles,
        "{traded:?} of {tiles}"
    );
    assert_eq!(f.ce, tiled.ce);
    for (what, got, want, bound) in [
        (
            "grad_hidden",
            f.grad_hidden.as_ref(),
            tiled.grad_hidden.as_ref(),
            traded.grad_hidden,
        ),
        (
            "grad_weight",
            f.grad_weight.as_ref(),
            tiled.grad_weight.as_ref(),
            traded.grad_weight,
        ),
    ] {
        let (got, want) = (got.unwrap(), want.unwrap());
        let scale = want.iter().fold(0.0f64, |m, &x| m.max(f64::from(x.abs())));
        let d = max_diff(got, want);
        // The reported bound plus f32 rounding (1e-5 of the scale, ~170 unit
        // roundoffs of f32 as the unfiltered kernels' own check); the bound
        // is tight (the error reaches a tenth of it) and not negligible
        // (over 1e-3 of the scale, so the filter skipped real work).
        assert!(d <= bound + 1e-5 * scale, "{what}: {d:e} over {bound:e}");
        assert!(
            d >= 0.1 * bound && bound > 1e-3 * scale,
            "{what}: {d:e}, {bound:e}"
        );
    }
}

#[test]
fn a_threshold_that_is_not_a_size_is_refused() {
    let (x, w, t) = random(4, 3, 5, 1);
    let config = LossConfig::default();
    let call = LossCall::with_flag(&t, &config, true);
    for bad in [-1e-3, f32::NAN, f32::INFINITY] {
        let e = linear_cross_entropy_tiled_filtered(x.view(), w.view(), &call, SMALL_CHUNKS, bad)
            .expect_err("refused");
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
        assert!(e.to_string().contains("threshold"), "{e}");
    }
    let op = LinearCeTiledFiltered::default();
    assert_eq!(op.threshold, 1.0 / 4096.0);
    assert_eq!(op.chunks, LinearCeTiled::default().chunks);
    assert!(op.algorithms().is_empty());
}

/// How a planted kernel misreports what it traded.
#[derive(Clone, Copy)]
enum Report {
    /// Honestly.
    Honest,
    /// Nothing at all (`traded: None`): an exact kernel's claim.
    Nothing,
    /// The `dL/dhidden` bound only (`dL/dW`'s stated as 0).
    HiddenOnly,
    /// A bound that is not a size (NaN).
    NotASize,
}

impl Report {
    /// Rewrites what `out` says it traded.
    fn apply(self, out: &mut LinearLoss) {
        match self {
            Report::Honest => {}
            Report::Nothing => out.traded = None,
            Report::HiddenOnly => {
                if let Some(t) = out.traded.as_mut() {
                    t.grad_weight = 0.0;
                }
            }
            Report::NotASize => {
                if let Some(t) = out.traded.as_mut() {
                    t.grad_hidden = f64::NAN;
                }
            }
        }
    }
}

/// `op` reporting what it traded as `report` says.
fn filtered(op: LinearCeTiledFiltered, report: Report) -> Planted<impl VocabHooks> {
    Planted(KernelThenEdit::new(
        op,
        move |out: &mut LinearLoss| report.apply(out),
        |_: &mut ShardedLoss| {},
    ))
}

/// Cases whose gradients lose much to a threshold of 0.05: `v = 40` (a
/// softmax near 1/40 off the target), `mean` and per-token `grad_output`
/// (weights 0, negative and 3: the test is on each row's scale).
fn cases() -> Vec<LinearCase> {
    [(11, 0), (23, 1)]
        .into_iter()
        .map(|(n, kind)| {
            let (x, w, targets) = random(n, 8, 40, 30 + kind);
            let mut config = LossConfig::default();
            let grad_output = (kind == 1).then(|| {
                config.reduction = Reduction::None;
                (0..n).map(|i| [1.0, 0.0, -2.0, 3.0][i % 4]).collect()
            });
            LinearCase {
                map: ShardMap::new(40, 1, ShardLayout::Uneven).unwrap(),
                hidden: x.mapv(f64::from),
                weight: w.mapv(f64::from),
                targets,
                config,
                grad_output,
            }
        })
        .collect()
}

/// The suite judges the trade by the report: with a threshold of 0.05 the
/// honest kernel passes the registry entry's rule (unsharded, as it
/// declares), the same kernel claiming no trade, or none on `dL/dW`, fails on
/// the gradient it misreports, and a bound that is not a size fails as
/// such; the losses are judged as always.
#[test]
#[allow(clippy::result_large_err)]
fn the_suite_allows_the_reported_trade_and_nothing_more() {
    let entries = registry::linear_cross_entropy();
    let entry = registry::find(&entries, "linear_ce_tiled_filtered").expect("registered");
    let rule = Rule::of(entry.judge);
    let op = LinearCeTiledFiltered {
        chunks: SMALL_CHUNKS,
        threshold: 0.05,
    };
    for (k, case) in cases().iter().enumerate() {
        let honest = filtered(op, Report::Honest);
        check_linear_unsharded(&honest, case, true, rule)
            .unwrap_or_else(|m| panic!("case {k}, honest: {m}"));
        check_linear_unsharded(&filtered(op, Report::Nothing), case, false, rule)
            .unwrap_or_else(|m| panic!("case {k}, no gradients: {m}"));
        let m = check_linear_unsharded(&filtered(op, Report::Nothing), case, true, rule)
            .expect_err("skipping while reporting no trade must fail");
        assert!(m.to_string().contains("grad_hidden"), "case {k}: {m}");
        let m = check_linear_unsharded(&filtered(op, Report::HiddenOnly), case, true, rule)
            .expect_err("an unreported dL/dW trade must fail");
        assert!(m.to_string().contains("grad_weight"), "case {k}: {m}");
        let m = check_linear_unsharded(&filtered(op, Report::NotASize), case, true, rule)
            .expect_err("a NaN bound must fail");
        assert!(m.to_string().contains("traded"), "case {k}: {m}");
    }
}

/// Threshold 1 skips every tile (`|dL/dz_ij| = w_i p_j <= w_i` off the
/// target), yet the target entries are applied (CCE's indexed term):
/// `dL/dhidden_i = w_i (p_t - 1) W_t`, `p_t = exp(-loss_i)`, `w_i = 1 /
/// tokens` under `mean`.
#[test]
fn skipped_tiles_keep_their_target_terms() {
    let (n, h, v) = (9, 5, 13);
    let (x, w, t) = random(n, h, v, 3);
    let config = LossConfig::default();
    let call = LossCall::with_flag(&t, &config, true);
    let chunks = Chunks {
        tokens: 2,
        vocab: 4,
    };
    let f = linear_cross_entropy_tiled_filtered(x.view(), w.view(), &call, chunks, 1.0).unwrap();
    let traded = f.traded.unwrap();
    assert_eq!(traded.skipped_tiles, n.div_ceil(2) * v.div_ceil(4));
    let gh = f.grad_hidden.unwrap();
    let tokens = f.ce.num_tokens as f64;
    for i in 0..n {
        for k in 0..h {
            let want = match usize::try_from(t[i]) {
                Ok(ti) => {
                    let p = (-f.ce.per_token_loss[i]).exp();
                    (p - 1.0) / tokens * f64::from(w[[ti, k]])
                }
                Err(_) => 0.0,
            };
            let got = f64::from(gh[[i, k]]);
            // 1e-6 absolute: f32 rounding of one product (p - 1) / tokens x w
            // with |w| < 1 (a few unit roundoffs of f32, 2^-24 = 6e-8).
            assert!((got - want).abs() <= 1e-6, "[{i}, {k}]: {got} vs {want}");
        }
    }
    assert!(
        traded.grad_hidden > 0.0 && traded.grad_weight > 0.0,
        "{traded:?}"
    );
}
