//! The output layer's options (docs/FAULTS.md O1): the suites on the
//! reference with the softcap, and negative controls — the softcap computed
//! as `z * tanh(z)` (flash-attention PR 2402), and an implementation that
//! declares no softcap yet answers with the uncapped loss (a silent
//! fallback) — each caught, for the right reason.

use ndarray::Array2;
use packshard_equivalence::planted::{CeCall, Planted, VocabHooks};
use packshard_equivalence::vocab::{
    check_cross_entropy, run_cross_entropy_suite, run_linear_suite, CeCase, V1_LOGITS,
};
use packshard_equivalence::{Judge, Mismatch, Tolerance};
use packshard_reference::faults;
use packshard_reference::ops::{CrossEntropyOp, LossSupport};
use packshard_reference::vocab::cross_entropy::CrossEntropy;
use packshard_reference::vocab::sharded::ShardedLoss;
use packshard_reference::vocab::{
    LossConfig, ReferenceCrossEntropy, ShardLayout, ShardMap, ShardedAlgorithm,
};
use packshard_reference::Result;

const RULE: Judge = Judge::Rewrite(Tolerance::F64_REWRITE);

/// The logits under the flash-attention PR 2402 fault: `z * tanh(z)`
/// whatever `c` (`-inf` kept), then the uncapped loss.
#[derive(Debug, Clone, Copy)]
struct ZTanhZ;

/// `c` with its softcap replaced by `z * tanh(z)` on the logits.
fn planted<'a>(c: CeCall<'a>, z: &'a Array2<f64>, config: &'a LossConfig) -> CeCall<'a> {
    CeCall::new(z.view(), c.targets, config, c.want_grad)
}

fn fault(c: &CeCall<'_>) -> (Array2<f64>, LossConfig) {
    let z = c.input.mapv(|x| {
        if c.config.softcap.is_some() && x.is_finite() {
            x * x.tanh()
        } else {
            x
        }
    });
    let config = LossConfig {
        softcap: None,
        ..*c.config
    };
    (z, config)
}

impl VocabHooks for ZTanhZ {
    fn cross_entropy(&self, c: CeCall<'_>) -> Result<CrossEntropy> {
        let (z, config) = fault(&c);
        planted(c, &z, &config).unsharded(&ReferenceCrossEntropy)
    }

    fn sharded_cross_entropy(
        &self,
        algorithm: ShardedAlgorithm,
        map: &ShardMap,
        c: CeCall<'_>,
    ) -> Result<ShardedLoss> {
        let (z, config) = fault(&c);
        planted(c, &z, &config).sharded(&ReferenceCrossEntropy, algorithm, map)
    }
}

/// Declares no softcap, yet answers a call with one by dropping it.
#[derive(Debug, Clone, Copy)]
struct SilentFallback;

impl VocabHooks for SilentFallback {
    fn options(&self) -> LossSupport {
        LossSupport::BASIC
    }

    fn cross_entropy(&self, c: CeCall<'_>) -> Result<CrossEntropy> {
        let config = LossConfig {
            softcap: None,
            ..*c.config
        };
        CeCall::new(c.input, c.targets, &config, c.want_grad).unsharded(&ReferenceCrossEntropy)
    }

    fn sharded_cross_entropy(
        &self,
        algorithm: ShardedAlgorithm,
        map: &ShardMap,
        c: CeCall<'_>,
    ) -> Result<ShardedLoss> {
        let config = LossConfig {
            softcap: None,
            ..*c.config
        };
        CeCall::new(c.input, c.targets, &config, c.want_grad).sharded(
            &ReferenceCrossEntropy,
            algorithm,
            map,
        )
    }
}

/// Declares no softcap and refuses it by the typed error.
#[derive(Debug, Clone, Copy)]
struct Refuses;

impl VocabHooks for Refuses {
    fn options(&self) -> LossSupport {
        LossSupport::BASIC
    }

    fn cross_entropy(&self, c: CeCall<'_>) -> Result<CrossEntropy> {
        LossSupport::BASIC.check(c.config)?;
        c.unsharded(&ReferenceCrossEntropy)
    }

    fn sharded_cross_entropy(
        &self,
        algorithm: ShardedAlgorithm,
        map: &ShardMap,
        c: CeCall<'_>,
    ) -> Result<ShardedLoss> {
        LossSupport::BASIC.check(c.config)?;
        c.sharded(&ReferenceCrossEntropy, algorithm, map)
    }
}

fn o1_case() -> CeCase {
    CeCase {
        map: ShardMap::new(8, 2, ShardLayout::Uneven).unwrap(),
        logits: Array2::from_shape_vec((1, 8), V1_LOGITS.to_vec()).unwrap(),
        targets: vec![faults::V1_TARGET],
        config: LossConfig::default().with_softcap(faults::O1_SOFTCAP),
    }
}

#[test]
fn o1_the_reference_passes_both_suites_with_softcaps() {
    struct Reference;
    impl VocabHooks for Reference {}
    let coverage = run_cross_entropy_suite(&Planted(Reference), RULE, 96).unwrap();
    assert!(coverage.softcap >= 10, "{coverage:?}");
    run_linear_suite(&Planted(Reference), RULE, 48).unwrap();
}

#[test]
fn o1_negative_control_z_tanh_z() {
    let op = Planted(ZTanhZ);
    let loss = op
        .cross_entropy(o1_case().logits.view(), &o1_case().targets, &o1_case().config, false)
        .unwrap()
        .loss;
    assert!((loss - faults::O1_LOSS_FAULT).abs() < faults::O1_PLACES, "{loss}");
    let m: Mismatch = run_cross_entropy_suite(&op, RULE, 16).unwrap_err();
    assert!(m.to_string().contains("O1"), "{m}");
    // And by the random cases alone, through the per-case check.
    let e = check_cross_entropy(&op, ShardedAlgorithm::Alg2, &o1_case(), true).unwrap_err();
    assert!(e.to_string().contains("loss"), "{e}");
}

#[test]
fn o1_negative_control_a_silent_fallback_to_the_uncapped_loss() {
    let m = run_cross_entropy_suite(&Planted(SilentFallback), RULE, 16).unwrap_err();
    assert!(m.to_string().contains("declares no softcap"), "{m}");
}

#[test]
fn o1_an_implementation_that_refuses_the_softcap_passes() {
    let coverage = run_cross_entropy_suite(&Planted(Refuses), RULE, 32).unwrap();
    assert!(coverage.cases >= 32, "{coverage:?}");
    let c = o1_case();
    let err = Planted(Refuses)
        .cross_entropy(c.logits.view(), &c.targets, &c.config, false)
        .unwrap_err();
    assert!(err.to_string().contains("softcap"), "{err}");
}
