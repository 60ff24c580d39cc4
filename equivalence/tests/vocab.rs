//! The vocabulary suite on the reference, and negative controls: each
//! docs/FAULTS.md V1–V6 fault, planted into an otherwise correct sharded
//! implementation, must be caught — by the docs/FAULTS.md example check and by the
//! whole suite — and for the right reason (the failing tensor is named).

use ndarray::{Array1, Array2, ArrayView2, Axis, Slice};
use packshard_equivalence::planted::{CeCall, EmbeddingCall, LinearCall, Planted, VocabHooks};
use packshard_equivalence::vocab::{
    check_cross_entropy, check_embedding, check_linear, run_cross_entropy_suite,
    run_embedding_suite, run_linear_suite, CeCase, Coverage, EmbeddingCase, LinearCase, V1_LOGITS,
    V2_LOGITS,
};
use packshard_equivalence::{Judge, Mismatch, Tolerance};
use packshard_reference::ops::{
    CrossEntropyOp, EmbeddingOp, LinearCrossEntropyOp, LinearInput, LinearLoss, LossSupport,
};
use packshard_reference::vocab::collective::{run_ranks, Collective};
use packshard_reference::vocab::cross_entropy::CrossEntropy;
use packshard_reference::vocab::cross_entropy::{check_row, token_loss};
use packshard_reference::vocab::embedding::{check_ids, ShardedEmbedding};
use packshard_reference::vocab::sharded::{merge_stats_over, RankLoss, ShardedLoss};
use packshard_reference::vocab::sum;
use packshard_reference::vocab::ReferenceLinearCrossEntropy;
use packshard_reference::vocab::{
    cross_entropy, linear_cross_entropy, LossCall, LossConfig, ShardLayout, ShardMap, ShardPlan,
    ShardedAlgorithm, SmoothingConvention, SoftmaxStats,
};
use packshard_reference::Error;

/// The three vocabulary suites (cross-entropy, output layer, embedding) on
/// one implementation of all three, under the f64 rule; the cross-entropy
/// suite's coverage.
fn run_suite<I>(imp: &I, cases: u32) -> Result<Coverage, Mismatch>
where
    I: CrossEntropyOp + LinearCrossEntropyOp + EmbeddingOp,
{
    run_suite_judged(imp, Judge::Rewrite(Tolerance::F64_REWRITE), cases)
}

/// [`run_suite`] under `judge`.
fn run_suite_judged<I>(imp: &I, judge: Judge, cases: u32) -> Result<Coverage, Mismatch>
where
    I: CrossEntropyOp + LinearCrossEntropyOp + EmbeddingOp,
{
    let coverage = run_cross_entropy_suite(imp, judge, cases)?;
    run_linear_suite(imp, judge, cases)?;
    run_embedding_suite(imp, judge, cases)?;
    Ok(coverage)
}

/// The reference's three vocabulary ops as one value.
struct ReferenceHooks;
impl VocabHooks for ReferenceHooks {}
const REFERENCE: Planted<ReferenceHooks> = Planted(ReferenceHooks);

#[test]
fn reference_passes_the_suite() {
    let cases = std::env::var("VOCAB_CASES").map_or(128, |s| s.parse().expect("a number"));
    let coverage = run_suite(&REFERENCE, cases).unwrap();
    eprintln!("{coverage:?}");
    // Not vacuous: most cases were compared value by value, and the largest
    // difference seen is a few ulp of the terms (the tolerance is 64).
    assert!(coverage.compared >= cases / 2, "{coverage:?}");
    assert!(
        coverage.worst_ulps > 0.0 && coverage.worst_ulps < 16.0,
        "{coverage:?}"
    );
}

// ---- a planted implementation -------------------------------------------------

/// The faults docs/FAULTS.md describes, plus one against the barrier count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    None,
    /// V1: Megatron's smoothing term from the shard's own logits, not reduced.
    LocalSmoothing,
    /// V2: padded vocabulary entries are not masked.
    PaddingInSoftmax,
    /// V3: each rank keeps its partial input gradient.
    InputGradNotReduced,
    /// V4: `assert!(v % p == 0)`.
    AssertDivisible,
    /// V5: no id check; an id no shard owns silently gives a zero row (or a padding row).
    SilentZeroRow,
    /// V6: `s_i = Σ exp(z - m_i)` with `m_i = -inf` is NaN.
    NanFromEmptyShard,
    /// The input-gradient all-reduce split in two barriers.
    ExtraBarrier,
}

/// An alg1-style implementation (S pass, one merged barrier, T pass, the
/// input-gradient barrier) written independently of the reference's, with
/// one fault switch. `Planted(Alg1(Fault::None))` passes the suite.
struct Alg1(Fault);

type Linear<'a> = Option<(ArrayView2<'a, f64>, ArrayView2<'a, f64>)>;

impl Alg1 {
    fn run(
        &self,
        map: &ShardMap,
        parts: &[Array2<f64>],
        lin: Option<(ArrayView2<f64>, &[Array2<f64>])>,
        call: &LossCall,
    ) -> Result<ShardedLoss, Error> {
        let (v, p) = (map.vocab_size(), map.num_shards());
        if self.0 == Fault::AssertDivisible {
            assert!(
                v % p == 0,
                "the vocabulary ({v}) must be divisible by the shards ({p})"
            );
        }
        let targets = call.config.targets(call.targets, v)?;
        let ranks = run_ranks(p, |comm| {
            let r = comm.rank();
            let z = match lin {
                None => parts[r].clone(),
                Some((x, w)) => x.dot(&w[r].t()),
            };
            self.rank(
                comm,
                map,
                z,
                lin.map(|(x, w)| (x, w[r].view())),
                &targets,
                call,
            )
        })?;
        Ok(ShardedLoss {
            map: *map,
            ranks: ranks.into_iter().map(|r| r.output).collect(),
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn rank(
        &self,
        comm: &dyn Collective,
        map: &ShardMap,
        mut z: Array2<f64>,
        lin: Linear<'_>,
        targets: &[Option<usize>],
        call: &LossCall,
    ) -> Result<RankLoss, Error> {
        let (config, want_grad) = (call.config, call.want_grad());
        let fault = self.0;
        let shard = map.shard(comm.rank());
        let (n, width) = z.dim();
        // Mask the padding (or, planted, let it into the softmax).
        let enter = if fault == Fault::PaddingInSoftmax {
            width
        } else {
            shard.real
        };
        z.slice_axis_mut(Axis(1), Slice::from(enter..))
            .fill(f64::NEG_INFINITY);
        let (q_t, q_o) = config.target_distribution(map.vocab_size());
        let local_smoothing = fault == Fault::LocalSmoothing && config.label_smoothing > 0.0;
        let q = |i: usize, j: usize| match targets[i] {
            _ if j >= shard.real => 0.0,
            None => 0.0,
            Some(t) if t == shard.start + j => {
                if local_smoothing {
                    1.0
                } else {
                    q_t
                }
            }
            Some(_) => {
                if local_smoothing {
                    0.0
                } else {
                    q_o
                }
            }
        };
        // Megatron's V1 bug: `vocab_size = exp_logits.size(-1)` is the shard's
        // K, so `smoothing = a K / (K - 1)` and the smoothing mass is spread
        // as `smoothing / K` over the shard's own columns (right for p = 1).
        let k = shard.real as f64;
        let sm = match config.smoothing {
            SmoothingConvention::PyTorch => config.label_smoothing,
            SmoothingConvention::Megatron => config.label_smoothing * k / (k - 1.0),
        };
        let q_grad = |i: usize, j: usize| {
            if !local_smoothing || j >= shard.real || targets[i].is_none() {
                q(i, j)
            } else {
                (1.0 - sm) * q(i, j) + sm / k
            }
        };
        // S pass: local statistics.
        let local: Vec<SoftmaxStats> = (0..n)
            .map(|i| {
                let row = z.row(i).to_vec();
                if fault == Fault::NanFromEmptyShard {
                    // exp(z - m_i) with m_i = -inf is exp(NaN).
                    let m = row.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b));
                    let s = sum::sum(row.iter().map(|x| (x - m).exp()));
                    let terms = row.iter().enumerate().filter(|(j, _)| q(i, *j) > 0.0);
                    let t = sum::sum(terms.clone().map(|(j, x)| q(i, j) * (m - x)));
                    let mass = sum::sum(terms.map(|(j, _)| q(i, j)));
                    SoftmaxStats {
                        max: m,
                        rest: s - 1.0,
                        target: t,
                        mass,
                    }
                } else {
                    SoftmaxStats::of(&row, |j| q(i, j))
                }
            })
            .collect();
        let global = merge_stats_over(comm, &local)?;
        for (i, g) in global.iter().enumerate() {
            check_row(i, g, targets[i])?;
        }
        let per_token: Array1<f64> = (0..n)
            .map(|i| {
                let g = &global[i];
                if local_smoothing && targets[i].is_some() {
                    // loss = (1 - sm) nll - sm mean_K(log p), the mean over
                    // this shard's K log-probabilities only.
                    let real = z
                        .row(i)
                        .iter()
                        .take(shard.real)
                        .copied()
                        .collect::<Vec<_>>();
                    let mean = real.iter().map(|x| g.max - x).sum::<f64>() / k;
                    (1.0 - sm) * g.cross_entropy() + sm * (mean + g.rest.ln_1p())
                } else {
                    token_loss(g, targets[i], config)
                }
            })
            .collect();
        let loss = config.reduce(per_token.as_slice().expect("contiguous"), targets);
        let mut out = RankLoss {
            rank: shard.rank,
            loss,
            per_token_loss: per_token,
            local,
            global: global.clone(),
            grad_logits: None,
            grad_hidden: None,
            grad_weight: None,
            counts: comm.counts(),
            peak_bytes: 0,
        };
        if !want_grad {
            return Ok(out);
        }
        // T pass: the logit gradient from the global statistics.
        let weights = call.token_weights(targets);
        let mut g = Array2::zeros((n, width));
        for ((i, j), x) in g.indexed_iter_mut() {
            if weights[i] != 0.0 && j < enter {
                *x = weights[i] * global[i].gradient(z[[i, j]], q_grad(i, j), config.z_loss);
            }
        }
        if let Some((x, w)) = lin {
            let g_real = g.slice_axis(Axis(1), Slice::from(..shard.real));
            let w_real = w.slice_axis(Axis(0), Slice::from(..shard.real));
            let mut gx = sum::matmul(g_real, w_real);
            match fault {
                Fault::InputGradNotReduced => {}
                Fault::ExtraBarrier => {
                    let flat = gx.as_slice_mut().expect("contiguous");
                    let half = flat.len() / 2;
                    let (a, b) = flat.split_at_mut(half);
                    comm.all_reduce_sum(a)?;
                    comm.all_reduce_sum(b)?;
                }
                _ => comm.all_reduce_sum(gx.as_slice_mut().expect("contiguous"))?,
            }
            let mut gw = Array2::zeros((width, x.ncols()));
            gw.slice_axis_mut(Axis(0), Slice::from(..shard.real))
                .assign(&g_real.t().dot(&x));
            out.grad_hidden = Some(gx);
            out.grad_weight = Some(gw);
        }
        out.grad_logits = Some(g);
        out.counts = comm.counts();
        Ok(out)
    }
}

impl VocabHooks for Alg1 {
    fn algorithms(&self) -> Vec<ShardedAlgorithm> {
        vec![ShardedAlgorithm::Alg1]
    }

    /// No softcap: declared, and refused in every form (the softcap's
    /// controls are tests/vocab_options.rs).
    fn options(&self) -> LossSupport {
        LossSupport::BASIC
    }

    fn cross_entropy(&self, c: CeCall<'_>) -> Result<CrossEntropy, Error> {
        // The faults are planted in the sharded path.
        let ce = cross_entropy(c.input, &c.call)?;
        LossSupport::BASIC.check(&c.call)?;
        Ok(ce)
    }

    fn linear_cross_entropy(&self, c: LinearCall<'_>) -> Result<LinearLoss, Error> {
        let l = c.unsharded(&ReferenceLinearCrossEntropy)?;
        LossSupport::BASIC.check(&c.call)?;
        Ok(l)
    }

    fn sharded_cross_entropy(&self, plan: ShardPlan, c: CeCall<'_>) -> Result<ShardedLoss, Error> {
        let CeCall {
            input: logits,
            call,
        } = c;
        // Bad input fails as in the reference.
        let v = plan.map.vocab_size();
        let forward = LossCall::with_flag(call.targets, call.config, false);
        cross_entropy(logits.slice_axis(Axis(1), Slice::from(..v)), &forward)?;
        LossSupport::BASIC.check(&call)?;
        let parts = plan.map.split_columns(logits, "logits")?;
        self.run(&plan.map, &parts, None, &call)
    }

    fn sharded_linear_cross_entropy(
        &self,
        plan: ShardPlan,
        c: LinearCall<'_>,
    ) -> Result<ShardedLoss, Error> {
        let LinearCall {
            input: LinearInput { hidden, weight },
            call,
        } = c;
        let v = plan.map.vocab_size();
        let forward = LossCall::with_flag(call.targets, call.config, false);
        linear_cross_entropy(
            hidden,
            weight.slice_axis(Axis(0), Slice::from(..v)),
            &forward,
        )?;
        LossSupport::BASIC.check(&call)?;
        let parts = plan.map.split_rows(weight, "weight")?;
        // Padding rows may hold NaN: a planted fault that reads them shows as NaN.
        let parts: Vec<Array2<f64>> = parts
            .into_iter()
            .map(|p| p.mapv(|x| if x.is_finite() { x } else { 1e3 }))
            .collect();
        self.run(&plan.map, &[], Some((hidden, &parts)), &call)
    }

    fn sharded_embedding(
        &self,
        map: &ShardMap,
        c: EmbeddingCall<'_>,
    ) -> Result<ShardedEmbedding, Error> {
        let EmbeddingCall {
            ids,
            weight,
            grad_output,
        } = c;
        if self.0 != Fault::SilentZeroRow {
            check_ids(ids, map.vocab_size())?;
        }
        let parts = map.split_rows(weight, "weight")?;
        let h = weight.ncols();
        let ranks = run_ranks(map.num_shards(), |comm| {
            let s = map.shard(comm.rank());
            // The planted fault looks up whatever falls in the shard's rows,
            // padding included, and leaves every other id a zero row.
            let owns = |id: i64| id >= s.start as i64 && id < (s.start + s.width) as i64;
            let mut out = Array2::zeros((ids.len(), h));
            for (i, &id) in ids.iter().enumerate() {
                if owns(id) {
                    out.row_mut(i)
                        .assign(&parts[comm.rank()].row(id as usize - s.start));
                }
            }
            comm.all_reduce_sum(out.as_slice_mut().expect("contiguous"))?;
            let grad = grad_output.map(|g| {
                let mut gw = Array2::zeros((s.width, h));
                for (i, &id) in ids.iter().enumerate() {
                    if owns(id) && (id as usize - s.start) < s.real {
                        let mut row = gw.row_mut(id as usize - s.start);
                        row += &g.row(i);
                    }
                }
                gw
            });
            Ok((out, grad, comm.counts()))
        })?;
        let mut result = ShardedEmbedding {
            map: *map,
            outputs: vec![],
            grad_weights: grad_output.map(|_| vec![]),
            counts: vec![],
            peak_bytes: vec![],
        };
        for r in ranks {
            let (out, grad, counts) = r.output;
            result.outputs.push(out);
            if let (Some(all), Some(g)) = (result.grad_weights.as_mut(), grad) {
                all.push(g);
            }
            result.counts.push(counts);
            result.peak_bytes.push(0);
        }
        Ok(result)
    }
}

// ---- the control passes; each fault is caught ----------------------------------

/// The rule every f32 kernel is held to: the planted faults are caught
/// under it too (a relative check that compared nothing, or the wrong
/// tensors, would let them through), and the control passes it.
#[test]
fn the_relative_rule_catches_the_planted_faults_too() {
    let judge = Judge::Relative {
        rule: packshard_equivalence::RelativeRule::F32,
        inputs: packshard_reference::ops::Precision::F32,
        packed: Tolerance::F32_REWRITE,
    };
    let coverage = run_suite_judged(&Planted(Alg1(Fault::None)), judge, 32).unwrap();
    assert!(coverage.compared >= 16, "{coverage:?}");
    for fault in [
        Fault::LocalSmoothing,
        Fault::PaddingInSoftmax,
        Fault::InputGradNotReduced,
        Fault::NanFromEmptyShard,
    ] {
        let err = run_suite_judged(&Planted(Alg1(fault)), judge, 32)
            .expect_err("the relative rule must catch the planted fault");
        eprintln!("{fault:?} caught under the relative rule by: {}", err.what);
    }
}

#[test]
fn the_planted_implementation_without_a_fault_passes_the_suite() {
    // So every rejection below is the planted fault's doing.
    let coverage = run_suite(&Planted(Alg1(Fault::None)), 64).unwrap();
    assert!(coverage.compared >= 32, "{coverage:?}");
}

fn row(z: &[f64]) -> Array2<f64> {
    Array2::from_shape_vec((1, z.len()), z.to_vec()).unwrap()
}

fn map(v: usize, p: usize, layout: ShardLayout) -> ShardMap {
    ShardMap::new(v, p, layout).unwrap()
}

/// The suite must reject `fault`, and its first failure must be a case
/// whose name contains one of `reasons` (the docs/FAULTS.md entry, or the layout
/// that exposes the fault).
fn suite_rejects(fault: Fault, reasons: &[&str]) -> Mismatch {
    let err =
        run_suite(&Planted(Alg1(fault)), 16).expect_err("the suite must catch the planted fault");
    eprintln!("{fault:?} caught by: {}", err.what);
    assert!(
        reasons.iter().any(|r| err.what.contains(r)),
        "caught, but as {err}"
    );
    err
}

#[test]
fn v1_negative_control_smoothing_with_a_shard_local_mean() {
    let planted = Planted(Alg1(Fault::LocalSmoothing));
    let config = LossConfig::default().with_smoothing(0.1, SmoothingConvention::Megatron);
    let case = CeCase {
        config,
        ..CeCase::new(map(8, 2, ShardLayout::Uneven), row(&V1_LOGITS), vec![4])
    };
    let err = check_cross_entropy(&planted, ShardedAlgorithm::Alg1, &case, false).unwrap_err();
    assert_eq!(err.what, "loss (rank 0)", "{err}");
    // ... and each rank gets a different number.
    let out = planted
        .sharded_cross_entropy(
            ShardPlan::new(ShardedAlgorithm::Alg1, case.map),
            CeCall::new(
                case.logits.view(),
                LossCall::with_flag(&[4], &config, false),
            ),
        )
        .unwrap();
    assert_ne!(out.ranks[0].loss, out.ranks[1].loss);
    // With one shard the local mean is the global one: no fault to see.
    let one = CeCase {
        map: map(8, 1, ShardLayout::Uneven),
        ..case
    };
    check_cross_entropy(&planted, ShardedAlgorithm::Alg1, &one, false).unwrap();
    suite_rejects(Fault::LocalSmoothing, &["V1"]);
}

#[test]
fn v2_negative_control_padded_entries_in_the_softmax() {
    let planted = Planted(Alg1(Fault::PaddingInSoftmax));
    let mut z = V2_LOGITS.to_vec();
    z.extend([9.0, -4.0]);
    let case = CeCase::new(map(10, 3, ShardLayout::Padded), row(&z), vec![7]);
    let err = check_cross_entropy(&planted, ShardedAlgorithm::Alg1, &case, false).unwrap_err();
    assert_eq!(err.what, "loss (rank 0)", "{err}");
    // Without padding (uneven shards) the same code is right.
    let uneven = CeCase {
        map: map(10, 3, ShardLayout::Uneven),
        logits: row(&V2_LOGITS),
        ..case
    };
    check_cross_entropy(&planted, ShardedAlgorithm::Alg1, &uneven, true).unwrap();
    // The first padded case of the suite is V1 over 3 padded shards (its
    // padding holds NaN there): the same fault, found one entry earlier.
    suite_rejects(Fault::PaddingInSoftmax, &["V2", "padded"]);
}

fn v3_case() -> LinearCase {
    LinearCase {
        map: map(4, 2, ShardLayout::Uneven),
        hidden: row(&[1.0, -1.0]),
        weight: Array2::from_shape_vec((4, 2), vec![1.0, 0.0, 0.0, 1.0, 0.5, 0.5, -1.0, 2.0])
            .unwrap(),
        targets: vec![2],
        config: LossConfig::default(),
        grad_output: None,
    }
}

#[test]
fn v3_negative_control_input_gradient_not_summed() {
    let planted = Planted(Alg1(Fault::InputGradNotReduced));
    let err = check_linear(&planted, ShardedAlgorithm::Alg1, &v3_case(), true).unwrap_err();
    assert_eq!(err.what, "grad_hidden (rank 0)", "{err}");
    suite_rejects(Fault::InputGradNotReduced, &["V3"]);
}

#[test]
fn v4_negative_control_an_assertion_on_divisibility() {
    let planted = Planted(Alg1(Fault::AssertDivisible));
    let v = 250_682;
    let logits = Array2::from_shape_fn((2, v), |(i, j)| ((i + j) % 13) as f64 - 6.0);
    let case = CeCase {
        map: map(v, 8, ShardLayout::Uneven),
        logits,
        targets: vec![0, v as i64 - 1],
        config: LossConfig::default(),
        grad_output: None,
    };
    let err = check_cross_entropy(&planted, ShardedAlgorithm::Alg1, &case, false).unwrap_err();
    assert_eq!(err.what, "panic", "{err}");
    assert!(err.detail.contains("must be divisible"), "{err}");
    // 8 shards of V = 8 divide: the same code passes there.
    let even = CeCase::new(map(8, 8, ShardLayout::Uneven), row(&V1_LOGITS), vec![4]);
    check_cross_entropy(&planted, ShardedAlgorithm::Alg1, &even, true).unwrap();
    // The suite's first V-case with p not dividing v is V1 with p = 3.
    let err = suite_rejects(Fault::AssertDivisible, &["V1 alg1 pytorch p 3"]);
    assert!(err.what.contains("panic"), "{err}");
}

#[test]
fn v5_negative_control_a_silent_zero_row() {
    let planted = Planted(Alg1(Fault::SilentZeroRow));
    let weight = Array2::from_shape_fn((5, 3), |(j, k)| (j * 3 + k) as f64 + 1.0);
    for layout in [ShardLayout::Uneven, ShardLayout::Padded] {
        for bad in [5, -1] {
            let case = EmbeddingCase {
                map: map(5, 2, layout),
                ids: vec![0, bad, 4],
                weight: weight.clone(),
                grad_output: Array2::ones((3, 3)),
            };
            let err = check_embedding(&planted, &case).unwrap_err();
            assert_eq!(err.what, "error", "{err}");
            assert!(err.detail.contains("index_out_of_range"), "{err}");
        }
    }
    // In range, the same lookup is right.
    let ok = EmbeddingCase {
        map: map(5, 2, ShardLayout::Padded),
        ids: vec![0, 3, 4],
        weight,
        grad_output: Array2::ones((3, 3)),
    };
    check_embedding(&planted, &ok).unwrap();
    suite_rejects(Fault::SilentZeroRow, &["V5"]);
}

#[test]
fn v6_negative_control_nan_from_an_all_minus_inf_shard() {
    let planted = Planted(Alg1(Fault::NanFromEmptyShard));
    let inf = f64::NEG_INFINITY;
    let case = CeCase::new(
        map(8, 2, ShardLayout::Uneven),
        row(&[1.0, 2.0, 0.0, -1.0, inf, inf, inf, inf]),
        vec![1],
    );
    let err = check_cross_entropy(&planted, ShardedAlgorithm::Alg1, &case, false).unwrap_err();
    assert_eq!(err.what, "loss (rank 0)", "{err}");
    assert!(err.detail.contains("got NaN"), "{err}");
    // One shard holding all logits: no empty shard, no NaN.
    let one = CeCase {
        map: map(8, 1, ShardLayout::Uneven),
        ..case
    };
    check_cross_entropy(&planted, ShardedAlgorithm::Alg1, &one, true).unwrap();
    // V1 over 5 padded shards of 2 has an all-padding shard: found there first.
    suite_rejects(Fault::NanFromEmptyShard, &["V6", "padded"]);
}

#[test]
fn negative_control_an_extra_barrier_is_counted() {
    let planted = Planted(Alg1(Fault::ExtraBarrier));
    let err = check_linear(&planted, ShardedAlgorithm::Alg1, &v3_case(), true).unwrap_err();
    assert_eq!(err.what, "collectives", "{err}");
    assert!(
        err.detail
            .contains("used 3 barriers; the algorithm needs 2"),
        "{err}"
    );
    suite_rejects(Fault::ExtraBarrier, &["V3"]);
}
