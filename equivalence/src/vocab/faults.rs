//! The values `docs/FAULTS.md` states for V1–V6, checked through an implementation.

#[allow(clippy::wildcard_imports)]
use super::*;
use packshard_reference::faults;

/// docs/FAULTS.md V1 logits (`V = 8`, target 4).
pub const V1_LOGITS: [f64; 8] = [1.0, 2.0, 0.0, -1.0, 3.0, 0.5, 1.5, -2.0];
/// docs/FAULTS.md V2 logits (`V = 10`, target 7).
pub const V2_LOGITS: [f64; 10] = [2.0, 1.0, 0.5, 3.0, -1.0, 0.0, 1.5, 2.5, -0.5, 1.0];

fn row(z: &[f64]) -> Array2<f64> {
    Array2::from_shape_vec((1, z.len()), z.to_vec()).expect("one row")
}

fn map(v: usize, p: usize, layout: ShardLayout) -> ShardMap {
    ShardMap::new(v, p, layout).expect("a valid example map")
}

/// `case` checked through `imp` (named `name`), then its sharded losses
/// without the gradient.
fn checked_loss(
    imp: &dyn CrossEntropyOp,
    algorithm: ShardedAlgorithm,
    case: &CeCase,
    rule: Rule,
    name: &str,
) -> Result<ShardedLoss, Mismatch> {
    check_cross_entropy_with(imp, algorithm, case, true, rule).map_err(|m| m.within(name))?;
    sharded_ce(imp, algorithm, case, false, name)
}

/// `imp`'s sharded cross-entropy on `case`, an error as the mismatch
/// naming `name`.
fn sharded_ce(
    imp: &dyn CrossEntropyOp,
    algorithm: ShardedAlgorithm,
    case: &CeCase,
    want_grad: bool,
    name: &str,
) -> Result<ShardedLoss, Mismatch> {
    let (z, call) = (case.logits.view(), case.call(want_grad));
    imp.sharded_cross_entropy(ShardPlan::new(algorithm, case.map), CeCall::new(z, call))
        .map_err(|e| Mismatch::new(name, e.to_string()))
}

/// As [`sharded_ce`] for the output layer.
fn sharded_linear(
    imp: &dyn LinearCrossEntropyOp,
    algorithm: ShardedAlgorithm,
    case: &LinearCase,
    want_grad: bool,
    name: &str,
) -> Result<ShardedLoss, Mismatch> {
    let call = case.call(want_grad);
    imp.sharded_linear_cross_entropy(
        ShardPlan::new(algorithm, case.map),
        LinearCall::new(case.input(), call),
    )
    .map_err(|e| Mismatch::new(name, e.to_string()))
}

pub(super) const LAYOUTS: [ShardLayout; 2] = [ShardLayout::Uneven, ShardLayout::Padded];

/// Checks the cross-entropy values `docs/FAULTS.md` states, through `imp`,
/// on every rank, for every algorithm it declares: V1 (both conventions, `p`
/// in 1..=8, both layouts), V2 (padded 10 -> 12 over 3, whatever the padding
/// holds), V4 (`V = 250682` over 8, both layouts, equal to unsharded), V6 (an
/// all `-inf` shard; an all-padding shard). Each is also compared with the
/// unsharded reference by the checks above.
///
/// # Errors
/// The first failure, named by its docs/FAULTS.md entry.
pub fn check_cross_entropy_faults(imp: &dyn CrossEntropyOp, rule: Rule) -> Result<(), Mismatch> {
    let named = |name: &str, m: Mismatch| m.within(name);
    for algorithm in imp.algorithms() {
        // V1: label smoothing with the global vocabulary size.
        for (convention, want) in [
            (SmoothingConvention::PyTorch, "0.87051"),
            (SmoothingConvention::Megatron, "0.90444"),
        ] {
            let config = LossConfig::default().with_smoothing(0.1, convention);
            for p in 1..=8 {
                for layout in LAYOUTS {
                    let case = CeCase {
                        config,
                        ..CeCase::new(map(8, p, layout), row(&V1_LOGITS), vec![4])
                    };
                    let name = format!(
                        "V1 {algorithm} {} p {p} {}",
                        convention.name(),
                        layout.name()
                    );
                    let out = checked_loss(imp, algorithm, &case, rule, &name)?;
                    for r in &out.ranks {
                        if format!("{:.5}", r.loss) != want {
                            return fail(
                                &name,
                                format!(
                                    "rank {}: loss {:.5}, docs/FAULTS.md says {want}",
                                    r.rank, r.loss
                                ),
                            );
                        }
                    }
                }
            }
        }
        // O1: the softcap c * tanh(z / c), composed with every algorithm.
        for p in [1, 2, 3] {
            let case = CeCase {
                config: LossConfig::default().with_softcap(faults::O1_SOFTCAP),
                ..CeCase::new(map(8, p, ShardLayout::Padded), row(&V1_LOGITS), vec![4])
            };
            let name = format!("O1 {algorithm} p {p}");
            check_cross_entropy_with(imp, algorithm, &case, true, rule)
                .map_err(|m| named(&name, m))?;
            if imp.options().softcap {
                let out = checked_loss(imp, algorithm, &case, rule, &name)?;
                o1_loss(&name, out.loss())?;
            }
        }
        // O2: a per-token upstream gradient, the second token's 0.
        for p in [1, 3] {
            let case = o2_case(map(8, p, ShardLayout::Uneven));
            let name = format!("O2 {algorithm} p {p}");
            check_cross_entropy_with(imp, algorithm, &case, true, rule)
                .map_err(|m| named(&name, m))?;
            check_cross_entropy_unsharded(imp, &case, true, rule).map_err(|m| named(&name, m))?;
            if imp.options().grad_output {
                let out = sharded_ce(imp, algorithm, &case, true, &name)?;
                for r in &out.ranks {
                    o2_zero_row(&name, r.rank, r.grad_logits.as_ref())?;
                }
            }
        }
        // O3: z-loss off is plain cross-entropy; O4: smoothing on huge logits is finite.
        let examples = [
            (
                "O3",
                V1_LOGITS.map(|x| x + faults::O3_SHIFT),
                LossConfig::default(),
                faults::O3_LOSS,
            ),
            (
                "O4",
                V1_LOGITS.map(|x| x * faults::O4_SCALE),
                LossConfig::default()
                    .with_smoothing(faults::O4_SMOOTHING, SmoothingConvention::PyTorch),
                faults::O4_LOSS,
            ),
        ];
        for (id, logits, config, want) in examples {
            let case = CeCase {
                config,
                ..CeCase::new(map(8, 3, ShardLayout::Uneven), row(&logits), vec![4])
            };
            let name = format!("{id} {algorithm}");
            let out = checked_loss(imp, algorithm, &case, rule, &name)?;
            check_cross_entropy_unsharded(imp, &case, true, rule).map_err(|m| named(&name, m))?;
            if (out.loss() - want).abs() > faults::O1_PLACES * want.max(1.0) {
                return fail(
                    &name,
                    format!("loss {:.5}, docs/FAULTS.md says {want:.5}", out.loss()),
                );
            }
        }
        // O6: the placeholder of a target on another shard never reads padding.
        let mut z = V2_LOGITS.to_vec();
        z.extend(faults::O6_PADDING);
        for target in [7, 0] {
            let case = CeCase::new(map(10, 3, ShardLayout::Padded), row(&z), vec![target]);
            let name = format!("O6 {algorithm} target {target}");
            let out = checked_loss(imp, algorithm, &case, rule, &name)?;
            if target == 7 && format!("{:.6}", out.loss()) != "1.474030" {
                return fail(
                    &name,
                    format!(
                        "loss {:.6}, docs/FAULTS.md says 1.474030 (the fault gives {:.6})",
                        out.loss(),
                        faults::O6_LOSS_FAULT
                    ),
                );
            }
        }
        // V2: the padded entries never enter the softmax.
        for padding in [
            [0.0, 0.0],
            [9.0, -4.0],
            [1e4, 1e4],
            [f64::NAN, f64::INFINITY],
        ] {
            let mut z = V2_LOGITS.to_vec();
            z.extend(padding);
            let case = CeCase::new(map(10, 3, ShardLayout::Padded), row(&z), vec![7]);
            let name = format!("V2 {algorithm} padding {padding:?}");
            let out = checked_loss(imp, algorithm, &case, rule, &name)?;
            if format!("{:.6}", out.loss()) != "1.474030" {
                return fail(
                    &name,
                    format!("loss {:.6}, docs/FAULTS.md says 1.474030", out.loss()),
                );
            }
        }
        // V4: V = 250682 over 8 shards, targets on the first, a middle and the last shard.
        for layout in LAYOUTS {
            let v = 250_682;
            let logits = Array2::from_shape_fn((2, v), |(i, j)| {
                ((i * 7 + j * 13) % 101) as f64 / 17.0 - 3.0
            });
            let case = CeCase {
                map: map(v, 8, layout),
                logits,
                targets: vec![0, v as i64 - 1],
                config: LossConfig::default().with_smoothing(0.1, SmoothingConvention::PyTorch),
                grad_output: None,
            };
            check_cross_entropy_with(imp, algorithm, &case, true, rule)
                .map_err(|m| named(&format!("V4 {algorithm} {}", layout.name()), m))?;
        }
        // V6: a shard whose logits are all -inf, and a shard that is all padding.
        let inf = f64::NEG_INFINITY;
        let case = CeCase::new(
            map(8, 2, ShardLayout::Uneven),
            row(&[1.0, 2.0, 0.0, -1.0, inf, inf, inf, inf]),
            vec![1],
        );
        check_cross_entropy_with(imp, algorithm, &case, true, rule)
            .map_err(|m| named(&format!("V6 {algorithm} all -inf shard"), m))?;
        let case = CeCase::new(
            map(9, 4, ShardLayout::Padded),
            row(&[0.5, -1.0, 2.0, 1.0, 0.0, 3.0, -2.0, 1.5, 0.25]),
            vec![5],
        );
        check_cross_entropy_with(imp, algorithm, &case, true, rule)
            .map_err(|m| named(&format!("V6 {algorithm} all-padding shard"), m))?;
    }
    Ok(())
}

/// Checks the output-layer values `docs/FAULTS.md` states: V3 (`dL/dx` summed
/// over the shards, on every rank) and V4 (`V = 250682` over 8 shards), for
/// every algorithm `imp` declares.
///
/// # Errors
/// The first failure, named by its docs/FAULTS.md entry.
pub fn check_linear_faults(imp: &dyn LinearCrossEntropyOp, rule: Rule) -> Result<(), Mismatch> {
    let named = |name: &str, m: Mismatch| m.within(name);
    for algorithm in imp.algorithms() {
        // V3: the input gradient is summed over the shards, on every rank.
        let case = LinearCase {
            map: map(4, 2, ShardLayout::Uneven),
            hidden: row(&[1.0, -1.0]),
            weight: Array2::from_shape_vec((4, 2), vec![1.0, 0.0, 0.0, 1.0, 0.5, 0.5, -1.0, 2.0])
                .expect("4 x 2"),
            targets: vec![2],
            config: LossConfig::default(),
            grad_output: None,
        };
        let name = format!("V3 {algorithm}");
        check_linear_with(imp, algorithm, &case, true, rule).map_err(|m| named(&name, m))?;
        let out = sharded_linear(imp, algorithm, &case, true, &name)?;
        for r in &out.ranks {
            let g = r
                .grad_hidden
                .as_ref()
                .map(|g| format!("{:.4} {:.4}", g[[0, 0]], g[[0, 1]]));
            if g.as_deref() != Some("0.2661 -0.2661") {
                return fail(
                    &name,
                    format!(
                        "rank {}: dL/dx {g:?}, docs/FAULTS.md says [0.2661, -0.2661]",
                        r.rank
                    ),
                );
            }
        }
        // O1: the softcap on the output layer (h = 1, weight = the V1 logits).
        let case = LinearCase {
            map: map(8, 3, ShardLayout::Uneven),
            hidden: row(&[1.0]),
            weight: Array2::from_shape_vec((8, 1), V1_LOGITS.to_vec()).expect("8 x 1"),
            targets: vec![4],
            config: LossConfig::default().with_softcap(faults::O1_SOFTCAP),
            grad_output: None,
        };
        let name = format!("O1 linear {algorithm}");
        check_linear_with(imp, algorithm, &case, true, rule).map_err(|m| named(&name, m))?;
        check_linear_unsharded(imp, &case, true, rule).map_err(|m| named(&name, m))?;
        if imp.options().softcap {
            let out = sharded_linear(imp, algorithm, &case, false, &name)?;
            o1_loss(&name, out.loss())?;
        }
        // O2: the output layer (h = 1, weight = the V1 logits, hidden 1 for
        // both tokens): the second token's dL/dhidden is 0.
        let case = LinearCase {
            map: map(8, 3, ShardLayout::Uneven),
            hidden: Array2::ones((2, 1)),
            weight: Array2::from_shape_vec((8, 1), V1_LOGITS.to_vec()).expect("8 x 1"),
            targets: faults::O2_TARGETS.to_vec(),
            config: LossConfig::default().with_reduction(Reduction::None),
            grad_output: Some(faults::O2_GRAD_OUTPUT.to_vec()),
        };
        let name = format!("O2 linear {algorithm}");
        check_linear_with(imp, algorithm, &case, true, rule).map_err(|m| named(&name, m))?;
        check_linear_unsharded(imp, &case, true, rule).map_err(|m| named(&name, m))?;
        if imp.options().grad_output {
            let out = sharded_linear(imp, algorithm, &case, true, &name)?;
            for r in &out.ranks {
                o2_zero_row(&name, r.rank, r.grad_hidden.as_ref())?;
            }
        }
        for layout in LAYOUTS {
            let v = 250_682;
            let hidden = Array2::from_shape_fn((3, 2), |(i, k)| i as f64 * 0.5 - k as f64);
            let weight =
                Array2::from_shape_fn((v, 2), |(j, k)| ((j * 3 + k * 5) % 23) as f64 / 11.0 - 1.0);
            let case = LinearCase {
                map: map(v, 8, layout),
                hidden,
                weight,
                targets: vec![125_000, -100, 31_336],
                config: LossConfig::default(),
                grad_output: None,
            };
            check_linear_with(imp, algorithm, &case, true, rule)
                .map_err(|m| named(&format!("V4 linear {algorithm} {}", layout.name()), m))?;
        }
    }
    Ok(())
}

/// The docs/FAULTS.md O2 example over `map` (`v = 8`): two tokens with the
/// V1 logits, targets 4 and 1, reduction `none`, `grad_output = [1, 0]`.
fn o2_case(map: ShardMap) -> CeCase {
    CeCase {
        map,
        logits: Array2::from_shape_fn((2, 8), |(_, j)| V1_LOGITS[j]),
        targets: faults::O2_TARGETS.to_vec(),
        config: LossConfig::default().with_reduction(Reduction::None),
        grad_output: Some(faults::O2_GRAD_OUTPUT.to_vec()),
    }
}

/// The second token's row of a rank's gradient (`grad_logits` or
/// `grad_hidden`) is exactly 0 under the O2 example's `grad_output[1] = 0`,
/// or the mismatch naming `name`.
fn o2_zero_row(name: &str, rank: usize, grad: Option<&Array2<f64>>) -> Result<(), Mismatch> {
    let Some(g) = grad else {
        return Ok(()); // a fused kernel holds no dL/dz: judged by dL/dhidden
    };
    match g.row(1).iter().find(|x| **x != 0.0) {
        None => Ok(()),
        Some(x) => fail(
            name,
            format!(
                "rank {rank}: the second token's gradient holds {x}, docs/FAULTS.md says 0 \
                 (grad_output [1, 0]; every row scaled by grad_output[0] gives {} at its target)",
                faults::O2_GRAD_FAULT
            ),
        ),
    }
}

/// The loss of the docs/FAULTS.md O1 example, or the mismatch naming `name`.
fn o1_loss(name: &str, loss: f64) -> Result<(), Mismatch> {
    if (loss - faults::O1_LOSS).abs() > faults::O1_PLACES {
        return fail(
            name,
            format!(
                "loss {loss:.5}, docs/FAULTS.md says {:.5} (z * tanh(z) gives {:.5})",
                faults::O1_LOSS,
                faults::O1_LOSS_FAULT
            ),
        );
    }
    Ok(())
}

/// Checks `docs/FAULTS.md` V5 through `imp`: an id equal to `V` or negative
/// is an error in the unsharded and the sharded lookup alike.
///
/// # Errors
/// The first failure, named by its docs/FAULTS.md entry.
pub fn check_embedding_faults(imp: &dyn EmbeddingOp, rule: Rule) -> Result<(), Mismatch> {
    let named = |name: &str, m: Mismatch| m.within(name);
    // V5: id == V or negative is an error in both layers.
    let weight = Array2::from_shape_fn((5, 3), |(j, k)| (j * 3 + k) as f64);
    for layout in LAYOUTS {
        for p in [1, 2, 4] {
            for bad in [5, -1] {
                let case = EmbeddingCase {
                    map: map(5, p, layout),
                    ids: vec![0, bad, 4],
                    weight: weight.clone(),
                    grad_output: Array2::ones((3, 3)),
                };
                let name = format!("V5 id {bad} p {p} {}", layout.name());
                check_embedding_with(imp, &case, rule).map_err(|m| named(&name, m))?;
                if imp
                    .sharded_embedding(
                        &case.map,
                        EmbeddingCall::new(&case.ids, weight.view(), None),
                    )
                    .is_ok()
                {
                    return fail(&name, "an out-of-range id must be an error");
                }
                if imp
                    .embedding(EmbeddingCall::new(&case.ids, weight.view(), None))
                    .is_ok()
                {
                    return fail(&name, "an out-of-range id must be an error (unsharded)");
                }
            }
        }
    }
    Ok(())
}
