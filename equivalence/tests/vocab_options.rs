//! The output layer's options (docs/FAULTS.md O1–O4, O6): the suites on
//! the reference with the softcap and per-token upstream gradients, and
//! negative controls — the softcap computed as `z * tanh(z)`
//! (flash-attention PR 2402), an implementation that declares no softcap yet
//! answers with the uncapped loss (a silent fallback), every row's gradient
//! scaled by `grad_output[0]` (Liger-Kernel PR 1298), the z-loss added when off (OLMo-core PR 702), the log of an
//! underflowed softmax under label smoothing (Megatron-LM issue 7464), a
//! placeholder target that reads a padded column (Apple CCE PR 59) — each
//! caught, for the right reason.

use ndarray::Array2;
use packshard_equivalence::planted::{CeCall, FirstUpstreamOnly, Planted, VocabHooks};
use packshard_equivalence::vocab::{
    check_cross_entropy, run_cross_entropy_suite, run_linear_suite, CeCase, V1_LOGITS, V2_LOGITS,
};
use packshard_equivalence::{Judge, Mismatch, Tolerance};
use packshard_reference::faults;
use packshard_reference::ops::{CrossEntropyOp, LossSupport};
use packshard_reference::vocab::cross_entropy::CrossEntropy;
use packshard_reference::vocab::sharded::ShardedLoss;
use packshard_reference::vocab::{
    GradRequest, LossCall, LossConfig, Reduction, ReferenceCrossEntropy, ShardLayout, ShardMap,
    ShardPlan, ShardedAlgorithm,
};
use packshard_reference::Result;

const RULE: Judge = Judge::Rewrite(Tolerance::F64_REWRITE);

/// The logits under the flash-attention PR 2402 fault: `z * tanh(z)`
/// whatever `c` (`-inf` kept), then the uncapped loss.
#[derive(Debug, Clone, Copy)]
struct ZTanhZ;

/// `c` with its softcap replaced by `z * tanh(z)` on the logits.
fn planted<'a>(c: CeCall<'a>, z: &'a Array2<f64>, config: &'a LossConfig) -> CeCall<'a> {
    CeCall::new(z.view(), LossCall { config, ..c.call })
}

fn fault(c: &CeCall<'_>) -> (Array2<f64>, LossConfig) {
    let z = c.input.mapv(|x| {
        if c.call.config.softcap.is_some() && x.is_finite() {
            x * x.tanh()
        } else {
            x
        }
    });
    let config = LossConfig {
        softcap: None,
        ..*c.call.config
    };
    (z, config)
}

impl VocabHooks for ZTanhZ {
    fn cross_entropy(&self, c: CeCall<'_>) -> Result<CrossEntropy> {
        let (z, config) = fault(&c);
        planted(c, &z, &config).unsharded(&ReferenceCrossEntropy)
    }

    fn sharded_cross_entropy(&self, plan: ShardPlan, c: CeCall<'_>) -> Result<ShardedLoss> {
        let (z, config) = fault(&c);
        planted(c, &z, &config).sharded(&ReferenceCrossEntropy, plan)
    }
}

/// A fault in the options alone: the call is the reference's under
/// `rewrite(config)`, the op declaring `options`.
#[derive(Debug, Clone, Copy)]
struct ConfigFault {
    rewrite: fn(&LossConfig) -> LossConfig,
    options: LossSupport,
}

impl VocabHooks for ConfigFault {
    fn options(&self) -> LossSupport {
        self.options
    }

    fn cross_entropy(&self, c: CeCall<'_>) -> Result<CrossEntropy> {
        let config = (self.rewrite)(c.call.config);
        let call = LossCall {
            config: &config,
            ..c.call
        };
        c.with_call(call).unsharded(&ReferenceCrossEntropy)
    }

    fn sharded_cross_entropy(&self, plan: ShardPlan, c: CeCall<'_>) -> Result<ShardedLoss> {
        let config = (self.rewrite)(c.call.config);
        let call = LossCall {
            config: &config,
            ..c.call
        };
        c.with_call(call).sharded(&ReferenceCrossEntropy, plan)
    }
}

/// Declares no softcap, yet answers a call with one by dropping it.
const SILENT_FALLBACK: ConfigFault = ConfigFault {
    rewrite: |c| LossConfig {
        softcap: None,
        ..*c
    },
    options: LossSupport::BASIC,
};

/// Declares no softcap and refuses it by the typed error.
#[derive(Debug, Clone, Copy)]
struct Refuses;

impl VocabHooks for Refuses {
    fn options(&self) -> LossSupport {
        LossSupport::BASIC
    }

    fn cross_entropy(&self, c: CeCall<'_>) -> Result<CrossEntropy> {
        LossSupport::BASIC.check(&c.call)?;
        c.unsharded(&ReferenceCrossEntropy)
    }

    fn sharded_cross_entropy(&self, plan: ShardPlan, c: CeCall<'_>) -> Result<ShardedLoss> {
        LossSupport::BASIC.check(&c.call)?;
        c.sharded(&ReferenceCrossEntropy, plan)
    }
}

fn o1_case() -> CeCase {
    CeCase {
        config: LossConfig::default().with_softcap(faults::O1_SOFTCAP),
        ..CeCase::new(
            ShardMap::new(8, 2, ShardLayout::Uneven).unwrap(),
            Array2::from_shape_vec((1, 8), V1_LOGITS.to_vec()).unwrap(),
            vec![faults::V1_TARGET],
        )
    }
}

#[test]
fn o1_o2_the_reference_passes_both_suites_with_softcaps_and_grad_outputs() {
    struct Reference;
    impl VocabHooks for Reference {}
    let coverage = run_cross_entropy_suite(&Planted(Reference), RULE, 96).unwrap();
    assert!(coverage.softcap >= 10, "{coverage:?}");
    assert!(coverage.grad_output >= 5, "{coverage:?}");
    run_linear_suite(&Planted(Reference), RULE, 48).unwrap();
}

/// The docs/FAULTS.md O2 example's call: targets 4 and 1, reduction
/// `none`, `grad_output = [1, 0]`.
fn o2_call(config: &LossConfig) -> LossCall<'_> {
    let g = GradRequest::Upstream(&faults::O2_GRAD_OUTPUT);
    LossCall::new(&faults::O2_TARGETS, config, g)
}

#[test]
fn o2_negative_control_every_row_scaled_by_grad_output_0() {
    let op = Planted(FirstUpstreamOnly);
    let z = Array2::from_shape_fn((2, 8), |(_, j)| V1_LOGITS[j]);
    let none = LossConfig::default().with_reduction(Reduction::None);
    let g = op
        .cross_entropy(CeCall::new(z.view(), o2_call(&none)))
        .unwrap();
    let g = g.grad_logits.unwrap();
    assert!(
        (g[[1, 1]] - faults::O2_GRAD_FAULT).abs() < faults::O1_PLACES,
        "{g}"
    );
    // The suites' O2 examples catch it, in both op families ...
    let m = run_cross_entropy_suite(&op, RULE, 16).unwrap_err();
    assert!(m.to_string().contains("O2"), "{m}");
    let m = run_linear_suite(&op, RULE, 16).unwrap_err();
    assert!(m.to_string().contains("O2"), "{m}");
    // ... and the per-case check on another per-token case, for the gradient.
    let case = CeCase {
        map: ShardMap::new(8, 3, ShardLayout::Padded).unwrap(),
        logits: Array2::from_shape_fn((3, 9), |(i, j)| ((i * 5 + j * 3) % 7) as f64 - 3.0),
        targets: vec![0, 7, 3],
        config: none,
        grad_output: Some(vec![0.5, -1.0, 0.0]),
    };
    let e = check_cross_entropy(&op, ShardedAlgorithm::Alg1, &case, true).unwrap_err();
    assert!(e.to_string().contains("grad_logits"), "{e}");
    // A scalar upstream gradient (sum, mean) is all the fault reads: right.
    let case = CeCase {
        config: LossConfig::default(),
        grad_output: Some(vec![-0.5]),
        ..case
    };
    check_cross_entropy(&op, ShardedAlgorithm::Alg1, &case, true).unwrap();
}

#[test]
fn o2_an_implementation_that_refuses_grad_output_passes() {
    let coverage = run_cross_entropy_suite(&Planted(Refuses), RULE, 32).unwrap();
    assert!(coverage.grad_output >= 1, "{coverage:?}");
    let none = LossConfig::default().with_reduction(Reduction::None);
    let z = Array2::from_shape_fn((2, 8), |(_, j)| V1_LOGITS[j]);
    let err = Planted(Refuses)
        .cross_entropy(CeCall::new(z.view(), o2_call(&none)))
        .unwrap_err();
    assert!(err.to_string().contains("grad_output"), "{err}");
    // Answering it while declaring no support is caught.
    let answers = ConfigFault {
        rewrite: |c| *c,
        options: LossSupport {
            softcap: true,
            grad_output: false,
        },
    };
    let m = run_cross_entropy_suite(&Planted(answers), RULE, 16).unwrap_err();
    assert!(m.to_string().contains("declares no grad_output"), "{m}");
}

#[test]
fn o1_negative_control_z_tanh_z() {
    let op = Planted(ZTanhZ);
    let loss = op
        .cross_entropy(CeCall::new(o1_case().logits.view(), o1_case().call(false)))
        .unwrap()
        .loss;
    assert!(
        (loss - faults::O1_LOSS_FAULT).abs() < faults::O1_PLACES,
        "{loss}"
    );
    let m: Mismatch = run_cross_entropy_suite(&op, RULE, 16).unwrap_err();
    assert!(m.to_string().contains("O1"), "{m}");
    // And by the random cases alone, through the per-case check.
    let e = check_cross_entropy(&op, ShardedAlgorithm::Alg2, &o1_case(), true).unwrap_err();
    assert!(e.to_string().contains("loss"), "{e}");
}

#[test]
fn o1_negative_control_a_silent_fallback_to_the_uncapped_loss() {
    let m = run_cross_entropy_suite(&Planted(SILENT_FALLBACK), RULE, 16).unwrap_err();
    assert!(m.to_string().contains("declares no softcap"), "{m}");
}

#[test]
fn o1_an_implementation_that_refuses_the_softcap_passes() {
    let coverage = run_cross_entropy_suite(&Planted(Refuses), RULE, 32).unwrap();
    assert!(coverage.cases >= 32, "{coverage:?}");
    let c = o1_case();
    let err = Planted(Refuses)
        .cross_entropy(CeCall::new(c.logits.view(), c.call(false)))
        .unwrap_err();
    assert!(err.to_string().contains("softcap"), "{err}");
}

/// O3's fault: with `z_loss = 0` the term is added with a default coefficient.
const Z_LOSS_WHEN_OFF: ConfigFault = ConfigFault {
    rewrite: |c| {
        let mut config = *c;
        if config.z_loss == 0.0 {
            config.z_loss = faults::O3_FAULT_COEFFICIENT;
        }
        config
    },
    options: LossSupport::ALL,
};

/// O4's fault: each token's loss as `-Σ_j q_j ln(exp(z_j - lse))`, the log
/// taken after `exp` underflowed (so `inf` where a smoothed entry's
/// probability is below the smallest f64).
#[derive(Debug, Clone, Copy)]
struct LogAfterExp;

/// `(per-token losses, loss)` of `logits: [n, >= v]` (the first `v`
/// columns), from each row's `logsumexp`.
fn log_after_exp(
    logits: ndarray::ArrayView2<f64>,
    v: usize,
    call: &LossCall,
    lse: &[f64],
) -> (Vec<f64>, f64) {
    let config = call.config;
    let parsed = config
        .targets(call.targets, v)
        .expect("the reference accepted them");
    let (qt, qo) = config.target_distribution(v);
    let per_token: Vec<f64> = (0..logits.nrows())
        .map(|i| match parsed[i] {
            None => 0.0,
            Some(t) => (0..v)
                .map(|j| {
                    let q = if j == t { qt } else { qo };
                    if q == 0.0 {
                        0.0
                    } else {
                        -q * (logits[[i, j]] - lse[i]).exp().ln()
                    }
                })
                .sum(),
        })
        .collect();
    let loss = config.reduce(&per_token, &parsed);
    (per_token, loss)
}

/// `out` with the per-token losses and the loss of a fault on every rank.
fn with_losses(mut out: ShardedLoss, per_token: &[f64], loss: f64) -> ShardedLoss {
    for r in &mut out.ranks {
        r.per_token_loss = per_token.to_vec().into();
        r.loss = loss;
    }
    out
}

impl VocabHooks for LogAfterExp {
    fn cross_entropy(&self, c: CeCall<'_>) -> Result<CrossEntropy> {
        let mut ce = c.unsharded(&ReferenceCrossEntropy)?;
        if c.call.config.softcap.is_some() {
            return Ok(ce); // the fault is in the uncapped path
        }
        let lse = ce.logsumexp().to_vec();
        let v = c.input.ncols();
        let (per_token, loss) = log_after_exp(c.input, v, &c.call, &lse);
        ce.per_token_loss = per_token.into();
        ce.loss = loss;
        Ok(ce)
    }

    fn sharded_cross_entropy(&self, plan: ShardPlan, c: CeCall<'_>) -> Result<ShardedLoss> {
        let out = c.sharded(&ReferenceCrossEntropy, plan)?;
        if c.call.config.softcap.is_some() {
            return Ok(out);
        }
        let lse = out.logsumexp().to_vec();
        let v = plan.map.vocab_size();
        let (per_token, loss) = log_after_exp(c.input, v, &c.call, &lse);
        Ok(with_losses(out, &per_token, loss))
    }
}

#[test]
fn o3_negative_control_the_z_loss_added_when_off() {
    // Caught by the first example without a z-loss (V1 already) ...
    run_cross_entropy_suite(&Planted(Z_LOSS_WHEN_OFF), RULE, 16).unwrap_err();
    // ... and by O3's own example, for the loss.
    let case = CeCase {
        map: ShardMap::new(8, 3, ShardLayout::Uneven).unwrap(),
        logits: Array2::from_shape_vec((1, 8), V1_LOGITS.map(|x| x + faults::O3_SHIFT).to_vec())
            .unwrap(),
        targets: vec![faults::V1_TARGET],
        config: LossConfig::default(),
        grad_output: None,
    };
    let op = Planted(Z_LOSS_WHEN_OFF);
    let e = check_cross_entropy(&op, ShardedAlgorithm::Alg2, &case, false).unwrap_err();
    assert!(e.to_string().contains("loss"), "{e}");
    let got = op
        .cross_entropy(CeCall::new(case.logits.view(), case.call(false)))
        .unwrap()
        .loss;
    assert!(
        (got - faults::O3_LOSS_FAULT).abs() < faults::O1_PLACES,
        "{got}"
    );
}

#[test]
fn o4_negative_control_the_log_of_an_underflowed_softmax() {
    let m = run_cross_entropy_suite(&Planted(LogAfterExp), RULE, 16).unwrap_err();
    assert!(m.to_string().contains("O4"), "{m}");
    // On ordinary logits the fault is invisible: only huge ones show it.
    let z = Array2::from_shape_vec((1, 8), V1_LOGITS.to_vec()).unwrap();
    let config = LossConfig::default().with_smoothing(
        faults::O4_SMOOTHING,
        packshard_reference::vocab::SmoothingConvention::PyTorch,
    );
    let fine = Planted(LogAfterExp)
        .cross_entropy(CeCall::new(
            z.view(),
            LossCall::with_flag(&[4], &config, false),
        ))
        .unwrap();
    assert!(fine.loss.is_finite());
    let huge = z.mapv(|x| x * faults::O4_SCALE);
    let bad = Planted(LogAfterExp)
        .cross_entropy(CeCall::new(
            huge.view(),
            LossCall::with_flag(&[4], &config, false),
        ))
        .unwrap();
    assert_eq!(bad.loss, f64::INFINITY);
}

/// O6's fault: on the last shard of a padded map, a token whose target is
/// on another shard gets the placeholder "first padding column", whose
/// value is then read as the target logit (summed into the prediction).
#[derive(Debug, Clone, Copy)]
struct PlaceholderOnPadding;

impl VocabHooks for PlaceholderOnPadding {
    fn sharded_cross_entropy(&self, plan: ShardPlan, c: CeCall<'_>) -> Result<ShardedLoss> {
        let out = c.sharded(&ReferenceCrossEntropy, plan)?;
        let map = &plan.map;
        let v = map.vocab_size();
        let last = map.shard(map.num_shards() - 1);
        if map.padded_vocab_size() == v || c.input.ncols() <= v {
            return Ok(out);
        }
        let config = c.call.config;
        let parsed = config.targets(c.call.targets, v)?;
        let mut per_token = out.per_token_loss().to_vec();
        for (i, t) in parsed.iter().enumerate() {
            if let Some(t) = *t {
                if t < last.start {
                    per_token[i] -= c.input[[i, v]];
                }
            }
        }
        let loss = config.reduce(&per_token, &parsed);
        Ok(with_losses(out, &per_token, loss))
    }
}

#[test]
fn o6_negative_control_a_placeholder_target_on_a_padded_column() {
    let m = run_cross_entropy_suite(&Planted(PlaceholderOnPadding), RULE, 16).unwrap_err();
    assert!(m.to_string().contains("O6"), "{m}");
    let mut z = V2_LOGITS.to_vec();
    z.extend(faults::O6_PADDING);
    let z = Array2::from_shape_vec((1, 12), z).unwrap();
    let map = ShardMap::new(10, 3, ShardLayout::Padded).unwrap();
    let out = Planted(PlaceholderOnPadding)
        .sharded_cross_entropy(
            ShardPlan::new(ShardedAlgorithm::Alg2, map),
            CeCall::new(
                z.view(),
                LossCall::with_flag(&[7], &LossConfig::default(), false),
            ),
        )
        .unwrap();
    assert_eq!(
        format!("{:.6}", out.loss()),
        format!("{:.6}", faults::O6_LOSS_FAULT)
    );
}
