//! The differential fuzz harness: the references pass thousands of arbitrary
//! cases (and the cases cover what they claim to), and negative controls —
//! each a planted fault in an otherwise correct implementation — are found by
//! the harness from random bytes and reported readably: the tensor, the
//! index, both values and the tolerance.

#![allow(clippy::result_large_err)]

use std::cell::Cell;

use ndarray::{Array2, ArrayView3};
use packshard_equivalence::fuzz::attention::{self as fa, AttentionFuzzCase};
use packshard_equivalence::fuzz::packing::{self as fp, PackFuzzCase};
use packshard_equivalence::fuzz::schedule::{fuzz_budgeted, Budget, SizeClass};
use packshard_equivalence::fuzz::vocab as fv;
use packshard_equivalence::fuzz::{fuzz_random, replay_dirs, Failure, Outcome, ReplayError};
use packshard_equivalence::packing::{BatchInput, Batcher, Packer, Reference as RefPacking};
use packshard_equivalence::planted::{AttentionHooks, CeCall, EmbeddingCall, Planted, VocabHooks};
use packshard_equivalence::{Judge, Tolerance};
use packshard_reference::attention::ReferenceAttention as RefAttention;
use packshard_reference::bert::{AttentionGrads, AttentionOutput};
use packshard_reference::ops::{AttentionOp, AttentionSupport, Grad, Qkv, Varlen};
use packshard_reference::packing::{Overlong, PackedBatch, PackingConfig, PackingPlan};
use packshard_reference::vocab::embedding::ShardedEmbedding;
use packshard_reference::vocab::sharded::ShardedLoss;
use packshard_reference::vocab::ShardMap;
use packshard_reference::vocab::{
    LossCall, ReferenceCrossEntropy, ReferenceEmbedding, ReferenceLinearCrossEntropy, ShardPlan,
};
use packshard_reference::Error;

const TOL: Judge = Judge::Rewrite(Tolerance::F64_REWRITE);

// ---- the references pass, and the cases cover what they claim ----------------

#[test]
fn reference_attention_passes_arbitrary_cases() {
    let mut malformed = 0;
    let mut empty_segments = 0;
    let mut planted = 0;
    // Cases with a window, a softcap, ALiBi, seqused_k.
    let mut options = [0usize; 4];
    // 3,000 small cases and 24 large ones (the schedule's default share of
    // large cases would take a minute here; the default budget's own
    // figures are in tests/attention_schedule.rs).
    let budget = Budget {
        cases: 3024,
        large: 24,
    };
    let seen = fuzz_budgeted(budget, 1, |data| {
        let case = AttentionFuzzCase::from_bytes(data).unwrap();
        malformed += usize::from(!case.well_formed());
        empty_segments += usize::from(case.segments.iter().any(|&(q, k)| q == 0 || k == 0));
        planted += usize::from(case.values.contains("planted"));
        let o = &case.options;
        for (n, on) in options.iter_mut().zip([
            !o.window.is_unbounded(),
            o.softcap != 0.0,
            o.alibi_slopes.is_some(),
            o.seqused_k.is_some(),
        ]) {
            *n += usize::from(on);
        }
        fa::run(&RefAttention, TOL, data)
    })
    .unwrap_or_else(|f| panic!("{f}"));
    eprintln!("attention: {seen:?}; {malformed} malformed cu_seqlens, {empty_segments} with an empty side, {planted} with planted extremes; window, softcap, alibi, seqused_k in {options:?}");
    // Each option in about a quarter of the cases (half draw options, each
    // on one bit of four); 300 is well below that and far above none.
    assert!(options.iter().all(|&n| n >= 300), "{options:?}");
    assert_eq!(seen.cases, 3024);
    // Malformed cu_seqlens are refused by both sides alike; the rest compared.
    assert_eq!(seen.errors_alike, malformed);
    assert!(malformed >= 100, "{malformed}");
    assert_eq!(seen.compared, 3024 - malformed);
    // The reference declares everything: nothing narrowed.
    assert_eq!(seen.narrowed, 0);
    assert!(
        empty_segments >= 500 && planted >= 1000,
        "{empty_segments} {planted}"
    );
    // The reference against itself: bit-for-bit.
    assert_eq!(seen.worst, 0.0);
    assert!(seen.values > 1_000_000, "{seen:?}");
}

#[test]
fn reference_vocab_passes_arbitrary_cases() {
    type Body = Box<dyn Fn(&[u8]) -> Result<Outcome, Failure>>;
    let bodies: [(&str, Body, usize); 3] = [
        (
            "cross_entropy",
            Box::new(|d| fv::run_cross_entropy(&ReferenceCrossEntropy, TOL, d)),
            1500,
        ),
        (
            "linear_cross_entropy",
            Box::new(|d| fv::run_linear(&ReferenceLinearCrossEntropy, TOL, d)),
            1500,
        ),
        (
            "embedding",
            Box::new(|d| fv::run_embedding(&ReferenceEmbedding, d)),
            1500,
        ),
    ];
    for (name, body, inputs) in bodies {
        // Random byte strings are large one in eight (their first byte):
        // 190 large cases of each op would take a minute. The budget runs
        // the same number of inputs, as many of them large as the default
        // (tests/fuzz_vocab_sizes.rs runs the default budget itself).
        let budget = Budget {
            cases: inputs,
            large: Budget::DEFAULT.large,
        };
        let seen = fuzz_budgeted(budget, 2, |d| body(d)).unwrap_or_else(|f| panic!("{f}"));
        eprintln!("{name}: {seen:?}");
        assert_eq!(seen.cases, inputs);
        // Mostly compared value by value, some bad inputs refused alike.
        assert!(seen.compared >= inputs * 3 / 5, "{name}: {seen:?}");
        assert!(seen.errors_alike >= 20, "{name}: {seen:?}");
        // Sharded against unsharded: a few ulp of the terms (the tolerance is 64).
        assert!(seen.worst < 0.5, "{name}: {seen:?}");
        if name != "embedding" {
            assert!(
                seen.worst > 0.0,
                "{name}: sharded and unsharded never differed? {seen:?}"
            );
        }
    }
}

#[test]
fn reference_packing_passes_arbitrary_cases() {
    let seen = fuzz_random(3000, 3, |d| fp::run(&RefPacking, d)).unwrap_or_else(|f| panic!("{f}"));
    eprintln!("packing: {seen:?}");
    assert!(
        seen.compared >= 1000 && seen.errors_alike >= 100,
        "{seen:?}"
    );
}

// ---- negative controls: attention ---------------------------------------------

/// The reference attention with one planted fault.
#[derive(Clone, Copy, PartialEq)]
enum AttentionFault {
    /// P2: the whole batch is one segment.
    LeakAcrossSegments,
    /// P4: indexing the first token of every segment, empty ones included.
    PanicOnEmptySegment,
    /// A softmax without the max subtracted: `exp` overflows on large scores.
    NoMaxSubtraction,
    /// The backward forgets the softmax scale in `grad_k`.
    UnscaledGradK,
    /// No validation of `cu_seqlens`: a malformed one gives a result.
    AcceptsMalformedCuSeqlens,
}

struct BrokenAttention(AttentionFault);

fn naive_forward(
    q: ArrayView3<f64>,
    k: ArrayView3<f64>,
    v: ArrayView3<f64>,
    cu: &[usize],
    scale: f64,
) -> AttentionOutput {
    let (n, h, d) = q.dim();
    let mut output = ndarray::Array3::zeros((n, h, d));
    let mut lse = Array2::zeros((h, n));
    for w in cu.windows(2) {
        for a in 0..h {
            for i in w[0]..w[1] {
                let s: Vec<f64> = (w[0]..w[1])
                    .map(|j| scale * (0..d).map(|c| q[[i, a, c]] * k[[j, a, c]]).sum::<f64>())
                    .collect();
                let e: Vec<f64> = s.iter().map(|x| x.exp()).collect();
                let l: f64 = e.iter().sum();
                lse[[a, i]] = l.ln();
                for c in 0..d {
                    output[[i, a, c]] = (w[0]..w[1])
                        .map(|j| e[j - w[0]] / l * v[[j, a, c]])
                        .sum::<f64>();
                }
            }
        }
    }
    AttentionOutput { output, lse }
}

impl AttentionHooks for BrokenAttention {
    // Bidirectional self-attention only: the cases are narrowed to it, so
    // each fault is the only difference from the reference.
    fn support(&self) -> AttentionSupport {
        AttentionSupport::BIDIRECTIONAL
    }

    fn varlen_forward(&self, x: Qkv<'_>, p: &Varlen<'_>) -> Result<AttentionOutput, Error> {
        let (cu, s) = (p.cu_seqlens_q, p.scale);
        let whole = [0, x.q.dim().0];
        let at = |cu| Varlen::new(cu, false, s);
        let r = &RefAttention;
        match self.0 {
            AttentionFault::LeakAcrossSegments => r.varlen_forward(x, &at(&whole)),
            AttentionFault::PanicOnEmptySegment => {
                for w in cu.windows(2) {
                    assert!(
                        w[1] > w[0],
                        "segment starting at {} has no first token",
                        w[0]
                    );
                }
                r.varlen_forward(x, &at(cu))
            }
            AttentionFault::NoMaxSubtraction => {
                r.varlen_forward(x, &at(cu))?;
                Ok(naive_forward(x.q, x.k, x.v, cu, s))
            }
            AttentionFault::AcceptsMalformedCuSeqlens => {
                // "Repairs" cu_seqlens instead of refusing it.
                let n = x.q.dim().0;
                let mut fixed: Vec<usize> = cu.iter().map(|&c| c.min(n)).collect();
                fixed.insert(0, 0);
                for i in 1..fixed.len() {
                    fixed[i] = fixed[i].max(fixed[i - 1]);
                }
                fixed.push(n);
                fixed.dedup();
                if fixed.len() == 1 {
                    fixed.push(n);
                }
                r.varlen_forward(x, &at(&fixed))
            }
            AttentionFault::UnscaledGradK => r.varlen_forward(x, &at(cu)),
        }
    }
    fn varlen_backward(
        &self,
        x: Qkv<'_>,
        p: &Varlen<'_>,
        up: Grad<'_>,
    ) -> Result<AttentionGrads, Error> {
        let (cu, s) = (p.cu_seqlens_q, p.scale);
        let whole = [0, x.q.dim().0];
        let at = |cu| Varlen::new(cu, false, s);
        let r = &RefAttention;
        match self.0 {
            AttentionFault::LeakAcrossSegments => r.varlen_backward(x, &at(&whole), up),
            AttentionFault::UnscaledGradK => {
                let mut grads = r.varlen_backward(x, &at(cu), up)?;
                grads.grad_k.mapv_inplace(|x| x / s);
                Ok(grads)
            }
            _ => {
                // Consistent with this forward: the reference's own forward.
                let f = r.varlen_forward(x, &at(cu))?;
                r.varlen_backward(x, &at(cu), Grad::new(&f, up.grad_output))
            }
        }
    }
}

/// Fuzzes `imp` from random bytes until the harness reports a failure.
fn find(body: impl FnMut(&[u8]) -> Result<Outcome, Failure>) -> Failure {
    match fuzz_random(3000, 11, body) {
        Ok(seen) => panic!("the planted fault was not found in {seen:?}"),
        Err(f) => {
            eprintln!("{f}\n");
            f
        }
    }
}

/// The failure the attention fuzz target finds in a kernel planted with `fault`.
fn find_attention(fault: AttentionFault) -> Failure {
    find(|d| fa::run(&Planted(BrokenAttention(fault)), TOL, d))
}

/// A numeric failure reads well: the tensor, an index, both values, the tolerance.
fn assert_readable(f: &Failure, tensor: &str) {
    let text = f.to_string();
    assert!(f.mismatch.what.starts_with(tensor), "{text}");
    for part in ["first at [", "expected ", "got ", "tolerance ", "case: "] {
        assert!(text.contains(part), "missing {part:?} in\n{text}");
    }
    assert!(f.source.starts_with("random input "), "{text}");
}

#[test]
fn attention_leak_across_segments_is_found() {
    let f = find_attention(AttentionFault::LeakAcrossSegments);
    assert_readable(&f, "output (sequence ");
}

#[test]
fn attention_unscaled_grad_k_is_found() {
    let f = find_attention(AttentionFault::UnscaledGradK);
    assert_readable(&f, "grad_k (sequence ");
}

#[test]
fn attention_panic_on_an_empty_segment_is_found() {
    let f = find_attention(AttentionFault::PanicOnEmptySegment);
    assert_eq!(f.mismatch.what, "varlen_forward");
    assert!(
        f.mismatch.detail.contains("panicked: segment starting at"),
        "{f}"
    );
    assert!(f.case.contains(", 0"), "the case has an empty segment: {f}");
}

#[test]
fn attention_overflow_without_max_subtraction_is_found() {
    let f = find_attention(AttentionFault::NoMaxSubtraction);
    // exp overflows to inf on a large score: NaN or inf where a finite value is expected.
    assert!(
        f.mismatch.what.starts_with("output (sequence ")
            || f.mismatch.what.starts_with("lse (sequence "),
        "{f}"
    );
    assert!(
        f.mismatch.detail.contains("got NaN") || f.mismatch.detail.contains("got inf"),
        "{f}"
    );
}

#[test]
fn attention_accepting_malformed_cu_seqlens_is_found() {
    let f = find_attention(AttentionFault::AcceptsMalformedCuSeqlens);
    assert_eq!(f.mismatch.what, "varlen_forward", "{f}");
    assert!(
        f.mismatch.detail.contains("must be refused")
            && f.mismatch.detail.contains("invalid_argument"),
        "{f}"
    );
    assert!(f.case.contains("malformed cu_seqlens"), "{f}");
}

// ---- negative controls: vocabulary parallelism --------------------------------

#[derive(Clone, Copy, PartialEq)]
enum VocabFault {
    /// Cross-entropy that ignores `ignore_index`: ignored targets are scored as class 0.
    IgnoresIgnoreIndex,
    /// The embedding gradient overwrites instead of accumulating repeated ids.
    OverwritesRepeatedIds,
}

struct BrokenVocab(VocabFault);

impl VocabHooks for BrokenVocab {
    fn sharded_cross_entropy(&self, plan: ShardPlan, c: CeCall<'_>) -> Result<ShardedLoss, Error> {
        let r = &ReferenceCrossEntropy;
        if self.0 == VocabFault::IgnoresIgnoreIndex {
            let t: Vec<i64> = c
                .call
                .targets
                .iter()
                .map(|&t| {
                    if t == c.call.config.ignore_index {
                        0
                    } else {
                        t
                    }
                })
                .collect();
            let config = &c.call.config.with_ignore_index(i64::MIN);
            let call = LossCall {
                targets: &t,
                config,
                ..c.call
            };
            return c.with_call(call).sharded(r, plan);
        }
        c.sharded(r, plan)
    }
    fn sharded_embedding(
        &self,
        map: &ShardMap,
        c: EmbeddingCall<'_>,
    ) -> Result<ShardedEmbedding, Error> {
        let mut out = c.sharded(&ReferenceEmbedding, map)?;
        if let (VocabFault::OverwritesRepeatedIds, Some(g), Some(parts)) =
            (self.0, c.grad_output, out.grad_weights.as_mut())
        {
            // Each row holds the gradient of the last token with that id.
            for (i, &id) in c.ids.iter().enumerate() {
                let (rank, local) = map.owner(id as usize).expect("ids were checked");
                parts[rank].row_mut(local).assign(&g.row(i));
            }
        }
        Ok(out)
    }
}

#[test]
fn cross_entropy_ignoring_ignore_index_is_found() {
    // Scoring an ignored token can also make an error out of a case the
    // reference accepts (an all -inf row that was ignored); those are found
    // too, but skipped here to show a numeric mismatch.
    let mut errors = 0;
    let f = find(|d| {
        match fv::run_cross_entropy(
            &Planted(BrokenVocab(VocabFault::IgnoresIgnoreIndex)),
            TOL,
            d,
        ) {
            Err(f) if f.mismatch.what == "error" => {
                errors += 1;
                Ok(Outcome::default())
            }
            other => other,
        }
    });
    eprintln!("{errors} cases failed as an unexpected error");
    let text = f.to_string();
    assert!(
        ["loss (rank", "per_token_loss (rank", "grad_logits"]
            .iter()
            .any(|t| f.mismatch.what.starts_with(t)),
        "{text}"
    );
    assert!(
        text.contains("expected ") && text.contains("got ") && text.contains("tolerance "),
        "{text}"
    );
    assert!(
        ["naive", "alg1", "alg2"].contains(&f.implementation.as_str()),
        "names the algorithm: {text}"
    );
}

#[test]
fn embedding_overwriting_repeated_ids_is_found() {
    let f =
        find(|d| fv::run_embedding(&Planted(BrokenVocab(VocabFault::OverwritesRepeatedIds)), d));
    assert_readable(&f, "grad_weight");
}

// ---- negative controls: packing -----------------------------------------------

#[derive(Clone, Copy, PartialEq)]
enum PackFault {
    /// P1: positions run on across the segments of a pack.
    PositionsRunOn,
    /// P3: truncated tokens are not reported.
    SilentTruncation,
}

struct BrokenPacking(PackFault);

impl Packer for BrokenPacking {
    fn name(&self) -> String {
        "broken packer".into()
    }
    fn pack(&self, lengths: &[usize], config: &PackingConfig) -> Result<PackingPlan, Error> {
        let mut plan = RefPacking.pack(lengths, config)?;
        if self.0 == PackFault::SilentTruncation && config.overlong == Overlong::Truncate {
            plan.metrics.dropped_tokens = 0;
        }
        Ok(plan)
    }
}

impl Batcher for BrokenPacking {
    fn name(&self) -> String {
        "broken batcher".into()
    }
    fn batch(&self, x: BatchInput<'_>) -> Result<(PackingPlan, PackedBatch), Error> {
        let (plan, mut batch) = RefPacking.batch(x)?;
        if self.0 == PackFault::PositionsRunOn {
            for (p, pack) in plan.packs.iter().enumerate() {
                let mut col = 0;
                for seg in pack {
                    for _ in 0..seg.length {
                        batch.position_ids[[p, col]] = x.position_offset + col as i64;
                        col += 1;
                    }
                }
            }
        }
        Ok((plan, batch))
    }
}

#[test]
fn packing_positions_running_on_are_found() {
    let f = find(|d| fp::run(&BrokenPacking(PackFault::PositionsRunOn), d));
    assert_eq!(f.mismatch.what, "position_ids", "{f}");
    assert!(
        f.mismatch.detail.contains("got ") && f.mismatch.detail.contains("expected "),
        "{f}"
    );
}

#[test]
fn packing_silent_truncation_is_found() {
    let f = find(|d| fp::run(&BrokenPacking(PackFault::SilentTruncation), d));
    assert_eq!(f.mismatch.what, "metrics.dropped_tokens", "{f}");
    assert!(f.case.contains("Truncate"), "{f}");
}

// ---- replaying committed inputs ----------------------------------------------

#[test]
fn replay_runs_every_file_and_names_the_failing_one() {
    let dir = std::env::temp_dir().join(format!("packshard-replay-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    // An input the leak is visible on: two non-empty segments, found by the fuzzer.
    let bad = Cell::new(None::<Vec<u8>>);
    let _ = fuzz_random(3000, 11, |d| {
        let r = fa::run(
            &Planted(BrokenAttention(AttentionFault::LeakAcrossSegments)),
            TOL,
            d,
        );
        if r.is_err() {
            bad.set(Some(d.to_vec()));
        }
        r
    });
    let bad = bad.take().expect("the leak is found");
    std::fs::write(dir.join("a-passes"), [0u8; 3]).unwrap();
    std::fs::write(dir.join("b-leak"), &bad).unwrap();
    std::fs::write(dir.join(".hidden"), &bad).unwrap();
    std::fs::write(dir.join("README.md"), &bad).unwrap();
    let missing = dir.join("no-such-dir");
    // The reference passes both files (the hidden one and the README are skipped).
    let seen = replay_dirs(&[&dir, &missing], |d| fa::run(&RefAttention, TOL, d)).unwrap();
    assert_eq!(seen.cases, 2);
    let err = replay_dirs(&[&dir], |d| {
        fa::run(
            &Planted(BrokenAttention(AttentionFault::LeakAcrossSegments)),
            TOL,
            d,
        )
    })
    .unwrap_err();
    let ReplayError::Failed(f) = &err else {
        panic!("{err}")
    };
    assert!(f.source.ends_with("b-leak"), "{err}");
    assert!(err.to_string().contains("input: "), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn arbitrary_cases_are_deterministic_and_bounded() {
    let mut sizes = Vec::new();
    let _ = fuzz_random(500, 5, |d| {
        let a = AttentionFuzzCase::from_bytes(d).unwrap();
        assert_eq!(a, AttentionFuzzCase::from_bytes(d).unwrap());
        let (n, h, dim) = a.q.dim();
        let (h, h_kv, _) = (h, a.k.dim().1, dim);
        assert!(h_kv >= 1 && h % h_kv == 0, "{}", a.describe());
        let bound = match a.class {
            SizeClass::Small => fa::SMALL_MAX_WORK,
            SizeClass::Large => fa::LARGE_MAX_WORK,
        };
        assert!(a.work() <= bound, "{}", a.describe());
        assert_eq!(a.segments.iter().map(|s| s.0).sum::<usize>(), n);
        assert_eq!(a.segments.iter().map(|s| s.1).sum::<usize>(), a.k.dim().0);
        let p = PackFuzzCase::from_bytes(d).unwrap();
        assert!(p.lengths().len() <= fp::MAX_SEQUENCES);
        if a.class == SizeClass::Small {
            assert!(a.longest() <= fa::SMALL_MAX_LEN, "{}", a.describe());
            sizes.push(n);
        }
        Ok(Outcome::default())
    });
    // Not all alike: sizes vary over the range.
    assert!(
        sizes.contains(&0) && sizes.iter().any(|&n| n > 64),
        "{sizes:?}"
    );
    // Empty input: a valid (tiny) case, never an error.
    let empty = AttentionFuzzCase::from_bytes(&[]).unwrap();
    assert_eq!(empty.segments, vec![(0, 0)]);
}

/// A leak too small for the comparison (2e-15 of the first sequence's first
/// query value, added to the batch's last token) is still caught by the
/// bit-for-bit leak check, and its report names the token's own sequence.
struct SubToleranceLeak;

impl AttentionHooks for SubToleranceLeak {
    fn varlen_forward(&self, x: Qkv<'_>, p: &Varlen<'_>) -> Result<AttentionOutput, Error> {
        let mut out = RefAttention.varlen_forward(x, p)?;
        let last = out.output.dim().0 - 1;
        out.output[[last, 0, 0]] += 2e-15 * x.q[[0, 0, 0]];
        Ok(out)
    }
}

#[test]
fn a_leak_below_the_tolerance_is_reported_with_its_sequence() {
    use packshard_equivalence::attention::AttentionCase;
    // Sequences of 2, 3 and 4 tokens: token 8 is in sequence 2.
    let case = AttentionCase::seeded(&[2, 3, 4], 2, 3, 1, 7);
    let fuzz = AttentionFuzzCase::from_case(&case, "seeded");
    // The reference itself passes the same check.
    fa::check(&RefAttention, Tolerance::F64_REWRITE, &fuzz).unwrap();
    let err = fa::check(&Planted(SubToleranceLeak), Tolerance::F64_REWRITE, &fuzz).unwrap_err();
    assert_eq!(err.what, "cross-sequence leak", "{err}");
    assert!(
        err.detail.contains(
            "changing sequence 0 (tokens 0..2) changed the output of token 8 (sequence 2)"
        ),
        "{err}"
    );
}

/// The vocabulary fuzz cases reach every kind of target the docs promise:
/// real classes, `ignore_index`, and the out-of-range `v` and `-5` that both
/// sides must refuse alike.
#[test]
fn vocab_fuzz_targets_reach_every_kind() {
    let (mut real, mut ignored, mut at_v, mut negative) = (0, 0, 0, 0);
    let _ = fuzz_random(3000, 11, |d| {
        let c = fv::CeFuzzCase::from_bytes(d).unwrap().case;
        let v = c.map.vocab_size() as i64;
        for &t in &c.targets {
            match t {
                t if t == c.config.ignore_index => ignored += 1,
                t if t == v => at_v += 1,
                -5 => negative += 1,
                t if (0..v).contains(&t) => real += 1,
                t => panic!("target {t} outside the generator's kinds (v = {v})"),
            }
        }
        Ok(Outcome::default())
    });
    assert!(
        real > 2 * ignored && ignored > 0,
        "{real} real, {ignored} ignored"
    );
    assert!(at_v > 0 && negative > 0, "{at_v} at v, {negative} at -5");
}

/// Each fuzz case takes (and resets) the largest sharded-vs-unsharded
/// difference of its own comparisons: some case saw one, and nothing is left
/// over for the next after the run.
#[test]
fn worst_ulps_are_taken_once_per_case() {
    use packshard_equivalence::vocab::take_worst_ulps;
    let seen = fuzz_budgeted(Budget::small(300), 2, |d| {
        fv::run_cross_entropy(&ReferenceCrossEntropy, TOL, d)
    })
    .unwrap_or_else(|f| panic!("{f}"));
    assert!(seen.worst > 0.0 && seen.worst < 0.5, "{seen:?}");
    assert_eq!(take_worst_ulps(), 0.0);
}

/// As [`SubToleranceLeak`], through sequence 0's first key (`true`) or value
/// (`false`): the leak check changes a sequence's keys and values, not only
/// its queries.
struct SubToleranceKvLeak(bool);

impl AttentionHooks for SubToleranceKvLeak {
    fn varlen_forward(&self, x: Qkv<'_>, p: &Varlen<'_>) -> Result<AttentionOutput, Error> {
        let mut out = RefAttention.varlen_forward(x, p)?;
        let last = out.output.dim().0 - 1;
        let from = if self.0 { x.k } else { x.v };
        out.output[[last, 0, 0]] += 2e-15 * from[[0, 0, 0]];
        Ok(out)
    }
}

#[test]
fn a_leak_through_keys_or_values_is_reported_with_its_sequence() {
    use packshard_equivalence::attention::AttentionCase;
    // As above: sequences of 2, 3 and 4 tokens, token 8 in sequence 2.
    let case = AttentionCase::seeded(&[2, 3, 4], 2, 3, 1, 7);
    let fuzz = AttentionFuzzCase::from_case(&case, "seeded");
    for through_keys in [true, false] {
        let leak = Planted(SubToleranceKvLeak(through_keys));
        let err = fa::check(&leak, Tolerance::F64_REWRITE, &fuzz).unwrap_err();
        assert_eq!(err.what, "cross-sequence leak", "{err}");
        assert!(
            err.detail.contains(
                "changing sequence 0 (tokens 0..2) changed the output of token 8 (sequence 2)"
            ),
            "{err}"
        );
    }
}

/// `kinds` reads grouped-query heads (`h_kv < h`) and cross segments
/// (`l_q != l_k`) off the case, each on its own: a suites' self-attention
/// case has neither; one key head of two is grouped; a segment with one key
/// more than queries is cross.
#[test]
fn a_fuzz_case_names_its_grouped_heads_and_cross_segments() {
    use ndarray::s;
    use packshard_equivalence::attention::AttentionCase;
    let case = AttentionCase::seeded(&[2, 3], 2, 3, 1, 7);
    let plain = AttentionFuzzCase::from_case(&case, "seeded");
    assert_eq!(plain.heads().0, 2);
    assert_eq!(plain.kinds(), (false, false));
    let mut grouped = plain.clone();
    grouped.k = plain.k.slice(s![.., ..1, ..]).to_owned();
    grouped.v = plain.v.slice(s![.., ..1, ..]).to_owned();
    assert_eq!(grouped.kinds(), (true, false));
    let mut cross = plain.clone();
    cross.segments[0].1 += 1;
    assert_eq!(cross.kinds(), (false, true));
}
