//! The suites: fault examples, then seeded random cases, with coverage that must not be vacuous.

#[allow(clippy::wildcard_imports)]
use super::*;

/// What the random part of a cross-entropy suite exercised; the suite fails
/// when a kind of input it must cover did not occur.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Coverage {
    /// Cases run (each once per algorithm).
    pub cases: u32,
    /// Cases where both sides succeeded and were compared value by value.
    pub compared: u32,
    /// Cases where both sides failed alike.
    pub errors: u32,
    /// Compared cases with a target in the first / a middle / the last shard (of `p > 1`).
    pub target_shards: [u32; 3],
    /// Compared cases with an ignored target.
    pub ignored: u32,
    /// Compared cases with label smoothing, with z-loss.
    pub smoothing: u32,
    /// Compared cases with z-loss.
    pub z_loss: u32,
    /// Compared cases with a softcap (docs/FAULTS.md O1; counted, not
    /// required: a third of the configurations, too few in the 16-case
    /// negative-control runs — tests/vocab_options.rs requires them).
    pub softcap: u32,
    /// Compared cases with a per-token upstream gradient (reduction `none`;
    /// docs/FAULTS.md O2; counted, not required, as the softcap:
    /// tests/vocab_options.rs requires them).
    pub grad_output: u32,
    /// Compared cases with a `±1e4` logit.
    pub huge: u32,
    /// Compared cases with a shard whose logits are all `-inf` (masked or all padding).
    pub empty_shard: u32,
    /// Compared cases with `p` not dividing `v`.
    pub uneven: u32,
    /// Compared cases in the padded layout with padding.
    pub padded: u32,
    /// Chunk-crossing cases run after the random ones ([`CHUNK_CASES`] of
    /// [`chunk_crossing_ce_cases`] or [`chunk_crossing_linear_cases`]; not in
    /// the counts above).
    pub chunk_crossing: u32,
    /// The largest difference seen over the whole run (docs/FAULTS.md cases and
    /// random ones), in ulp of `|expected| + terms` (the tolerance is 64).
    pub worst_ulps: f64,
    /// Under [`Rule::Relative`]: the comparisons of the whole run.
    pub relative: RelativeReport,
}

impl std::fmt::Display for Coverage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} cases", self.cases)?;
        if self.compared + self.errors > 0 {
            write!(
                f,
                " ({} compared, {} failing alike)",
                self.compared, self.errors
            )?;
        }
        write!(f, ", worst {:.1} ulp of the terms", self.worst_ulps)?;
        let t = &self.relative.totals;
        if t.count > 0 {
            write!(
                f,
                "; against the f64 reference over {} tensors: max {:.3} x, mean {:.3} x the f32 baseline's error",
                t.count,
                t.max_ratio(),
                t.mean_ratio()
            )?;
        }
        Ok(())
    }
}

impl Coverage {
    fn note(&mut self, case: &CeCase) {
        let (map, logits, targets, config) =
            (&case.map, case.logits.view(), &case.targets, &case.config);
        self.compared += 1;
        let (v, p) = (map.vocab_size(), map.num_shards());
        for &t in targets {
            if t == config.ignore_index {
                continue;
            }
            if let Some((r, _)) = map.owner(t as usize).filter(|_| p > 1) {
                let slot = if r == 0 {
                    0
                } else if r == p - 1 {
                    2
                } else {
                    1
                };
                self.target_shards[slot] += 1;
            }
        }
        self.ignored += u32::from(targets.contains(&config.ignore_index));
        self.smoothing += u32::from(config.label_smoothing > 0.0);
        self.z_loss += u32::from(config.z_loss > 0.0);
        self.softcap += u32::from(config.softcap.is_some());
        self.grad_output +=
            u32::from(case.grad_output.is_some() && config.reduction == Reduction::None);
        let real = logits.slice_axis(Axis(1), Slice::from(..v));
        self.huge += u32::from(real.iter().any(|x| x.abs() == 1e4));
        let empty = map.shards().iter().any(|s| {
            logits
                .rows()
                .into_iter()
                .any(|row| (s.start..s.start + s.real).all(|j| row[j] == f64::NEG_INFINITY))
        });
        self.empty_shard += u32::from(empty);
        self.uneven += u32::from(v % p != 0);
        self.padded += u32::from(map.padded_vocab_size() > v);
    }

    /// Fails unless every kind of input occurred at least `min` times.
    ///
    /// # Errors
    /// A [`Mismatch`] naming the first kind that did not.
    pub fn require(&self, min: u32) -> Result<(), Mismatch> {
        let kinds = [
            ("compared cases", self.compared),
            ("cases failing alike", self.errors),
            ("targets on the first shard", self.target_shards[0]),
            ("targets on a middle shard", self.target_shards[1]),
            ("targets on the last shard", self.target_shards[2]),
            ("ignored targets", self.ignored),
            ("label smoothing", self.smoothing),
            ("z-loss", self.z_loss),
            ("+-1e4 logits", self.huge),
            ("all -inf shards", self.empty_shard),
            ("p not dividing v", self.uneven),
            ("padded vocabularies", self.padded),
        ];
        for (kind, count) in kinds {
            if count < min {
                return fail("coverage", format!("only {count} cases with {kind} (at least {min} needed): the suite would pass vacuously"));
            }
        }
        Ok(())
    }
}

use super::relative::RELATIVE;
use crate::runner;

/// Chunk-crossing cases a loss suite runs after its random ones
/// ([`CHUNK_CROSSING`]: 4097 x 3, 1025 x 5, 257 x 65 logits): 6, two of
/// each size on average, a few hundredths of a second on the reference
/// against the random cases' few tenths (docs/FAULTS.md, "How results are
/// judged").
pub const CHUNK_CASES: u32 = 6;

impl Rule {
    /// The rule of a registry entry's [`Judge`]: [`Rule::Terms`] for an f64
    /// rewrite, [`Rule::Relative`] for a lower-precision kernel.
    pub fn of(judge: Judge) -> Rule {
        match judge.relative_rule() {
            Some(r) => Rule::Relative(r),
            None => Rule::Terms,
        }
    }
}

fn reset() {
    WORST_ULPS.with(|w| w.set(0.0));
    RELATIVE.with(|r| *r.borrow_mut() = RelativeReport::default());
}

/// Fills in the run's worst figures and, under a relative rule, applies the
/// rule's suite tier over every comparison of the run.
fn finish(mut coverage: Coverage, rule: Rule, what: &str) -> Result<Coverage, Mismatch> {
    coverage.worst_ulps = WORST_ULPS.with(|w| w.get());
    coverage.relative = RELATIVE.with(|r| r.borrow().clone());
    if let Rule::Relative(rule) = rule {
        coverage.relative.require_nonvacuous(100)?;
        coverage
            .relative
            .totals
            .check(&format!("relative {what} suite"), rule)?;
    }
    Ok(coverage)
}

fn suite_error(what: &str, e: impl std::fmt::Display) -> Mismatch {
    Mismatch::new(format!("{what} suite"), e.to_string())
}

/// The cross-entropy suite for one implementation under `judge`:
/// [`check_cross_entropy_faults`], then `cases` random cases (fixed seed, so
/// a failure reproduces), each through the unsharded form and every
/// algorithm `imp` declares, with and without gradients; the random cases
/// must cover every kind of input [`Coverage::require`] lists; then
/// [`CHUNK_CASES`] chunk-crossing ones ([`chunk_crossing_ce_cases`]).
///
/// # Errors
/// The first failure, with the (shrunk) case that produced it.
pub fn run_cross_entropy_suite(
    imp: &dyn CrossEntropyOp,
    judge: Judge,
    cases: u32,
) -> Result<Coverage, Mismatch> {
    let rule = Rule::of(judge);
    reset();
    check_cross_entropy_faults(imp, rule)?;
    let coverage = RefCell::new(Coverage::default());
    let to_case_error = |m: Mismatch| TestCaseError::fail(m.to_string());
    let check = |case: &CeCase, want_grad: bool| -> Result<(), TestCaseError> {
        check_cross_entropy_unsharded(imp, case, want_grad, rule)
            .map_err(|m| to_case_error(m.within("unsharded")))?;
        for algorithm in imp.algorithms() {
            check_cross_entropy_with(imp, algorithm, case, want_grad, rule)
                .map_err(to_case_error)?;
        }
        Ok(())
    };
    runner(cases)
        .run(&(ce_cases(), any::<bool>()), |(case, want_grad)| {
            check(&case, want_grad)?;
            let mut c = coverage.borrow_mut();
            c.cases += 1;
            let v = case.map.vocab_size();
            let real = case.logits.slice_axis(Axis(1), Slice::from(..v));
            if cross_entropy(real, &case.call(false)).is_ok() {
                c.note(&case);
            } else {
                c.errors += 1;
            }
            Ok(())
        })
        .map_err(|e| suite_error("cross_entropy", e))?;
    runner(CHUNK_CASES)
        .run(
            &(chunk_crossing_ce_cases(), any::<bool>()),
            |(case, want_grad)| {
                check(&case, want_grad)?;
                coverage.borrow_mut().chunk_crossing += 1;
                Ok(())
            },
        )
        .map_err(|e| suite_error("cross_entropy (chunk-crossing cases)", e))?;
    let coverage = finish(coverage.into_inner(), rule, "cross_entropy")?;
    coverage.require(2)?;
    Ok(coverage)
}

/// The output-layer suite for one implementation under `judge`:
/// [`check_linear_faults`], then `cases` random cases (fixed seed), each
/// through the unsharded form and every algorithm `imp` declares, with and
/// without gradients; then [`CHUNK_CASES`] chunk-crossing ones
/// ([`chunk_crossing_linear_cases`]).
///
/// # Errors
/// The first failure, with the (shrunk) case that produced it.
pub fn run_linear_suite(
    imp: &dyn LinearCrossEntropyOp,
    judge: Judge,
    cases: u32,
) -> Result<Coverage, Mismatch> {
    let rule = Rule::of(judge);
    reset();
    check_linear_faults(imp, rule)?;
    let mut coverage = Coverage::default();
    let to_case_error = |m: Mismatch| TestCaseError::fail(m.to_string());
    let ran = std::cell::Cell::new(0u32);
    let check = |case: &LinearCase, want_grad: bool| -> Result<(), TestCaseError> {
        check_linear_unsharded(imp, case, want_grad, rule)
            .map_err(|m| to_case_error(m.within("unsharded")))?;
        for algorithm in imp.algorithms() {
            check_linear_with(imp, algorithm, case, want_grad, rule).map_err(to_case_error)?;
        }
        Ok(())
    };
    runner(cases)
        .run(&(linear_cases(), any::<bool>()), |(case, want_grad)| {
            check(&case, want_grad)?;
            ran.set(ran.get() + 1);
            Ok(())
        })
        .map_err(|e| suite_error("linear_cross_entropy", e))?;
    coverage.cases = ran.get();
    ran.set(0);
    runner(CHUNK_CASES)
        .run(
            &(chunk_crossing_linear_cases(), any::<bool>()),
            |(case, want_grad)| {
                check(&case, want_grad)?;
                ran.set(ran.get() + 1);
                Ok(())
            },
        )
        .map_err(|e| suite_error("linear_cross_entropy (chunk-crossing cases)", e))?;
    coverage.chunk_crossing = ran.get();
    finish(coverage, rule, "linear_cross_entropy")
}

/// The embedding suite for one implementation: [`check_embedding_faults`],
/// then `cases` random cases (fixed seed), the unsharded and the sharded
/// lookup each exactly equal to the reference's (a lookup is exact in any
/// precision; under a relative `judge` the weights are rounded to f32 first).
///
/// # Errors
/// The first failure, with the (shrunk) case that produced it.
pub fn run_embedding_suite(
    imp: &dyn EmbeddingOp,
    judge: Judge,
    cases: u32,
) -> Result<Coverage, Mismatch> {
    let rule = Rule::of(judge);
    check_embedding_faults(imp, rule)?;
    let ran = std::cell::Cell::new(0u32);
    runner(cases)
        .run(&embedding_cases(), |case| {
            ran.set(ran.get() + 1);
            check_embedding_with(imp, &case, rule).map_err(|m| TestCaseError::fail(m.to_string()))
        })
        .map_err(|e| suite_error("embedding", e))?;
    Ok(Coverage {
        cases: ran.get(),
        ..Coverage::default()
    })
}

/// The largest difference this thread's [`TERMS`] comparisons have seen since
/// the last call, in ulp of `|expected| + terms` (the tolerance is 64), and
/// resets it. The fuzz bodies report it per case
/// ([`crate::fuzz::Outcome::worst`]).
pub fn take_worst_ulps() -> f64 {
    WORST_ULPS.with(|w| w.replace(0.0))
}
