//! The loss fuzz cases under the size schedule: the default budget reaches
//! the sizes and options where chunked kernels break, and two such kernels,
//! planted here, are caught by it while the small cases alone (the
//! generator before size classes) let them pass.

#![allow(clippy::result_large_err)]

use std::collections::BTreeSet;

use ndarray::{Array2, ArrayView2};
use packshard_equivalence::fuzz::schedule::{
    budgeted_input, fuzz_budgeted, Budget, SizeClass, SLOTS,
};
use packshard_equivalence::fuzz::vocab::{self as fv, CeFuzzCase, LinearFuzzCase};
use packshard_equivalence::fuzz::{Failure, Outcome};
use packshard_equivalence::planted::{CeCall, FirstUpstreamOnly, Planted, VocabHooks};
use packshard_equivalence::{Judge, Tolerance};
use packshard_reference::ops::{CrossEntropyOp, LossOp};
use packshard_reference::vocab::cross_entropy::CrossEntropy;
use packshard_reference::vocab::sharded::ShardedLoss;
use packshard_reference::vocab::{
    LossConfig, Reduction, ReferenceCrossEntropy, ReferenceLinearCrossEntropy, ShardLayout,
    ShardMap, ShardPlan, SmoothingConvention,
};
use packshard_reference::Error;

const TOL: Judge = Judge::Rewrite(Tolerance::F64_REWRITE);

/// What a run of loss cases reached.
#[derive(Debug, Default)]
struct Reached {
    largest_v: usize,
    /// Token counts of more than 16 that leave a partial chunk of 16.
    partial_token_chunks: BTreeSet<usize>,
    /// Vocabularies of more than one chunk of 1024 that leave a partial one.
    partial_vocab_chunks: BTreeSet<usize>,
    ignored: bool,
    smoothing: [bool; 2],
    z_loss: bool,
    softcap: bool,
    reductions: BTreeSet<&'static str>,
    per_token_grad_output: bool,
    scalar_grad_output: bool,
    padded: bool,
    uneven: bool,
}

impl Reached {
    fn note(
        &mut self,
        map: &ShardMap,
        targets: &[i64],
        c: &LossConfig,
        grad: Option<&[f64]>,
        want_grad: bool,
    ) {
        let (v, n) = (map.vocab_size(), targets.len());
        self.largest_v = self.largest_v.max(v);
        if n > 16 && !n.is_multiple_of(16) {
            self.partial_token_chunks.insert(n);
        }
        if v > 1024 && !v.is_multiple_of(1024) {
            self.partial_vocab_chunks.insert(v);
        }
        self.ignored |= targets.contains(&c.ignore_index);
        let conv = usize::from(c.smoothing == SmoothingConvention::Megatron);
        self.smoothing[conv] |= c.label_smoothing > 0.0;
        self.z_loss |= c.z_loss > 0.0;
        self.softcap |= c.softcap.is_some();
        self.reductions.insert(c.reduction.name());
        if let Some(g) = grad.filter(|_| want_grad) {
            let per_token = c.reduction == Reduction::None && n > 1;
            self.per_token_grad_output |= per_token && g.len() == n;
            self.scalar_grad_output |= c.reduction != Reduction::None && g.len() == 1;
        }
        self.padded |= map.padded_vocab_size() > v;
        self.uneven |= map.layout() == ShardLayout::Uneven && !v.is_multiple_of(map.num_shards());
    }

    fn require(&self, what: &str) {
        assert!(self.largest_v >= 4097, "{what}: {self:?}");
        assert!(self.partial_vocab_chunks.len() >= 2, "{what}: {self:?}");
        assert!(
            self.partial_token_chunks
                .iter()
                .any(|&n| n > 64 && !n.is_multiple_of(64)),
            "{what}: {self:?}"
        );
        assert!(
            self.ignored && self.smoothing == [true, true] && self.z_loss && self.softcap,
            "{what}: {self:?}"
        );
        assert_eq!(self.reductions.len(), 3, "{what}: {self:?}");
        assert!(
            self.per_token_grad_output && self.scalar_grad_output,
            "{what}: {self:?}"
        );
        assert!(self.padded && self.uneven, "{what}: {self:?}");
    }
}

/// Over the default budget of seed 0 (what `cargo test` and the default
/// `check_*` calls run), the large cases reach a vocabulary of at least
/// 4,097 entries, vocabularies and token counts with partial chunks, every
/// option and a per-token `grad_output`; the small ones none of the sizes.
#[test]
fn the_default_budget_reaches_chunk_boundaries_and_every_option() {
    let b = Budget::DEFAULT;
    let (mut ce, mut linear, mut small) =
        (Reached::default(), Reached::default(), Reached::default());
    for i in 0..b.cases {
        let data = budgeted_input(&b, 0, i);
        let large = SizeClass::of(&data) == SizeClass::Large;
        let f = CeFuzzCase::from_bytes(&data).unwrap();
        let c = &f.case;
        let seen = if large { &mut ce } else { &mut small };
        seen.note(
            &c.map,
            &c.targets,
            &c.config,
            c.grad_output.as_deref(),
            f.want_grad,
        );
        let f = LinearFuzzCase::from_bytes(&data).unwrap();
        let c = &f.case;
        if large {
            linear.note(
                &c.map,
                &c.targets,
                &c.config,
                c.grad_output.as_deref(),
                f.want_grad,
            );
        }
    }
    eprintln!("cross_entropy: {ce:?}\nlinear_cross_entropy: {linear:?}");
    ce.require("cross_entropy");
    linear.require("linear_cross_entropy");
    // The small cases stay small (at most 64 entries, at most 12 tokens:
    // no chunk crossed) but draw the options too: a softcap and both forms
    // of the upstream gradient (their last byte, `small_tail`).
    assert!(small.largest_v <= fv::MAX_V, "{small:?}");
    assert!(small.partial_token_chunks.is_empty() && small.partial_vocab_chunks.is_empty());
    assert!(
        small.softcap && small.per_token_grad_output && small.scalar_grad_output,
        "{small:?}"
    );
}

/// In every seed's default check, the large cases at the wide slots (5 and
/// 11 of the 12) reach what 8,192-, 16,384- and 1,024-token-chunked kernels
/// break on: a cross-entropy vocabulary of `8192 +- 1`, `16384 - 1` or
/// `16384` (slot 5) and past 16,384 (slot 11) on at most `WIDE_MAX_N`
/// tokens; an output layer of `1024 +- 1` tokens (slot 5) and past 1,024
/// (slot 11) at `h <= 4`, its vocabulary past 64; and no other large case is
/// one of them (they are 2 of the 12).
#[test]
fn every_default_check_reaches_wide_vocabularies_and_long_token_counts() {
    let b = Budget::DEFAULT;
    let first = b.cases - b.large;
    for seed in 0..6 {
        for j in 0..b.large {
            let data = budgeted_input(&b, seed, first + j);
            let ce = CeFuzzCase::from_bytes(&data).unwrap().case;
            let lin = LinearFuzzCase::from_bytes(&data).unwrap().case;
            let (v, n_ce) = (ce.map.vocab_size(), ce.logits.nrows());
            let (n, h) = lin.hidden.dim();
            let what = format!(
                "seed {seed}, large case {j}: ce {n_ce} x {v}, linear {n} x {} x {h}",
                lin.map.vocab_size()
            );
            match j {
                5 => {
                    assert!(
                        fv::WIDE_V[0].contains(&v) && n_ce <= fv::WIDE_MAX_N,
                        "{what}"
                    );
                    assert!((1023..=1025).contains(&n) && h <= fv::LONG_MAX_H, "{what}");
                }
                11 => {
                    assert!(v > 16384 && n_ce <= fv::WIDE_MAX_N, "{what}");
                    assert!(n > 1024 && h <= fv::LONG_MAX_H, "{what}");
                }
                _ => assert!(v <= fv::LARGE_MAX_V && n <= fv::LARGE_MAX_N, "{what}"),
            }
            if j == 5 || j == 11 {
                assert!(lin.map.vocab_size() > 64, "{what}");
                // The gradients always asked for, the upstream the implicit 1.
                let lf = LinearFuzzCase::from_bytes(&data).unwrap();
                assert!(lf.want_grad && lin.grad_output.is_none(), "{what}");
                // No softcap; each even row's maximum in the last column, 4
                // above the rest (unless a whole shard of it is masked).
                assert!(ce.config.softcap.is_none(), "{what}");
                for i in (0..n_ce).step_by(2) {
                    let row = ce.logits.row(i);
                    let rest = row
                        .slice(ndarray::s![..v - 1])
                        .iter()
                        .copied()
                        .filter(|x| x.is_finite())
                        .fold(f64::NEG_INFINITY, f64::max);
                    assert!(
                        row[v - 1] == rest + 4.0 || row[v - 1] == f64::NEG_INFINITY,
                        "{what}: row {i}"
                    );
                }
            }
        }
    }
}

/// Large cases stay within their bounds on work.
#[test]
fn large_cases_are_bounded() {
    let b = Budget {
        cases: 300,
        large: 300,
    };
    for i in 0..b.cases {
        let data = budgeted_input(&b, 9, i);
        let c = CeFuzzCase::from_bytes(&data).unwrap().case;
        let (n, w) = c.logits.dim();
        assert!(n * w <= fv::CE_WORK && n <= fv::LARGE_MAX_N, "{n} x {w}");
        // Past LARGE_MAX_V only at the wide slots, on a few tokens.
        let wide = fv::wide_slot(i % SLOTS).is_some();
        assert!(c.map.vocab_size() <= fv::LARGE_MAX_V || wide);
        assert!(
            !wide || (fv::WIDE_V.concat().contains(&c.map.vocab_size()) && n <= fv::WIDE_MAX_N)
        );
        let c = LinearFuzzCase::from_bytes(&data).unwrap().case;
        let (n, h) = c.hidden.dim();
        let w = c.weight.nrows();
        assert!(n * w * h <= fv::LINEAR_WORK, "{n} x {w} x {h}");
        assert!(n <= fv::LARGE_MAX_N || (wide && fv::LONG_N.concat().contains(&n)));
        assert!(c.map.vocab_size() * h <= fv::LINEAR_WEIGHT, "{w} x {h}");
        let e = fv::EmbeddingFuzzCase::from_bytes(&data).unwrap().case;
        let (w, h) = e.weight.dim();
        assert!((w + e.ids.len()) * h <= 2 * fv::EMBEDDING_WORK, "{w} {h}");
    }
}

// ---- negative controls: chunked kernels --------------------------------------

/// The chunk of [`DropsLastPartialChunk`].
const CHUNK: usize = 1024;

/// A vocabulary-chunked logsumexp, chunks of [`CHUNK`] entries, whose loop
/// runs over the whole chunks only (`for c in 0..v / CHUNK`) and so drops a
/// last partial chunk from the logsumexp (and the softmax) of a vocabulary
/// wider than one chunk; a vocabulary of at most one chunk is one pass, right.
/// Sharded, each rank chunks its own real columns. Seen from outside, the
/// dropped columns count as `-inf`.
struct DropsLastPartialChunk;

/// `z` with the columns of the last partial chunk of each `(start, real)`
/// part set to `-inf`.
fn drop_tails(z: ArrayView2<'_, f64>, parts: &[(usize, usize)]) -> Array2<f64> {
    let mut out = z.to_owned();
    for &(start, real) in parts {
        if real > CHUNK && !real.is_multiple_of(CHUNK) {
            let from = start + real / CHUNK * CHUNK;
            for j in from..start + real {
                out.column_mut(j).fill(f64::NEG_INFINITY);
            }
        }
    }
    out
}

impl VocabHooks for DropsLastPartialChunk {
    fn cross_entropy(&self, c: CeCall<'_>) -> Result<CrossEntropy, Error> {
        let z = drop_tails(c.input, &[(0, c.input.ncols())]);
        ReferenceCrossEntropy.cross_entropy(CeCall::new(z.view(), c.call))
    }

    fn sharded_cross_entropy(&self, plan: ShardPlan, c: CeCall<'_>) -> Result<ShardedLoss, Error> {
        let parts: Vec<(usize, usize)> = plan
            .map
            .shards()
            .iter()
            .map(|s| (s.start, s.real))
            .collect();
        let z = drop_tails(c.input, &parts);
        ReferenceCrossEntropy.sharded_cross_entropy(plan, CeCall::new(z.view(), c.call))
    }
}

/// The failure of `body` over the small cases of the default budget of
/// seed 0 alone: an option's bug needs no large case.
fn caught_by_small_cases(body: impl FnMut(&[u8]) -> Result<Outcome, Failure>) -> Failure {
    fuzz_budgeted(Budget::small(Budget::DEFAULT.cases), 0, body).unwrap_err()
}

/// The failure of `body` over the default budget of seed 0, after checking
/// that the small cases alone (the generator before size classes) pass it.
fn caught_only_by_large_cases(mut body: impl FnMut(&[u8]) -> Result<Outcome, Failure>) -> Failure {
    let small = Budget::small(Budget::DEFAULT.cases);
    let passed = fuzz_budgeted(small, 0, &mut body).unwrap_or_else(|f| panic!("{f}"));
    assert_eq!(passed.cases, small.cases);
    fuzz_budgeted(Budget::DEFAULT, 0, body).unwrap_err()
}

#[test]
fn a_logsumexp_dropping_the_last_partial_vocabulary_chunk_is_caught() {
    let f = caught_only_by_large_cases(|d| {
        fv::run_cross_entropy(&Planted(DropsLastPartialChunk), TOL, d)
    });
    let text = f.to_string();
    eprintln!("{text}");
    assert!(f.source.starts_with("budgeted input"), "{text}");
    // Caught on a vocabulary with a partial chunk past the first.
    let v: usize = f.case["v ".len()..]
        .split([' ', ','])
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(v > CHUNK && !v.is_multiple_of(CHUNK), "{text}");
}

#[test]
fn a_per_token_grad_output_read_as_a_scalar_is_caught() {
    for linear in [false, true] {
        let f = caught_by_small_cases(|d| {
            if linear {
                fv::run_linear(&Planted(FirstUpstreamOnly), TOL, d)
            } else {
                fv::run_cross_entropy(&Planted(FirstUpstreamOnly), TOL, d)
            }
        });
        let text = f.to_string();
        eprintln!("{text}");
        assert!(
            text.contains("reduction none") && text.contains("grad_output ["),
            "{text}"
        );
        assert!(f.mismatch.what.starts_with("grad_"), "{text}");
    }
}

/// A softcapped cross-entropy whose backward forgets the cap's chain factor
/// `1 - tanh^2(z / c)`: the loss of the capped logits `c tanh(z / c)` (a
/// masked `-inf` stays masked), and their gradient returned as the raw
/// logits' (unsharded; the sharded path is the reference's).
struct SoftcapWithoutChainFactor;

impl VocabHooks for SoftcapWithoutChainFactor {
    fn cross_entropy(&self, c: CeCall<'_>) -> Result<CrossEntropy, Error> {
        let Some(cap) = c.call.config.softcap else {
            return ReferenceCrossEntropy.cross_entropy(c);
        };
        let z = c.input.mapv(|x| {
            if x == f64::NEG_INFINITY {
                x
            } else {
                cap * (x / cap).tanh()
            }
        });
        let config = LossConfig {
            softcap: None,
            ..*c.call.config
        };
        let call = packshard_reference::vocab::LossCall {
            config: &config,
            ..c.call
        };
        ReferenceCrossEntropy.cross_entropy(CeCall::new(z.view(), call))
    }
}

#[test]
fn a_softcap_gradient_without_its_chain_factor_is_caught() {
    let f = caught_by_small_cases(|d| {
        fv::run_cross_entropy(&Planted(SoftcapWithoutChainFactor), TOL, d)
    });
    let text = f.to_string();
    eprintln!("{text}");
    assert!(
        text.contains("softcap") && text.contains("want_grad true"),
        "{text}"
    );
    assert!(f.mismatch.what.starts_with("grad_logits"), "{text}");
}

// ---- the outcome's counts ------------------------------------------------------

/// The values one form of a loss case compares: the loss, `per_token_loss`
/// and `logsumexp` (`2n + 1`), and with gradients `grad_logits` (`n v`) and,
/// for the output layer, `grad_hidden` (`n h`) and `grad_weight` (`v h`).
fn values_per_form(n: usize, v: usize, h: Option<usize>, want_grad: bool) -> usize {
    let grads = match (want_grad, h) {
        (false, _) => 0,
        (true, None) => n * v,
        (true, Some(h)) => n * v + n * h + v * h,
    };
    2 * n + 1 + grads
}

/// The outcome counts every value of every form (unsharded and the three
/// algorithms), so a count that is off (a sign flipped in the case's
/// `reference_values`) shows; a case the reference refuses counts none.
/// Prints the time the default budget takes on the reference
/// (docs/FAULTS.md, "How results are judged").
#[test]
fn the_outcome_counts_the_values_of_every_form() {
    let b = Budget::DEFAULT;
    let forms = 1 + ReferenceCrossEntropy.algorithms().len();
    assert_eq!(forms, 4);
    // Per op: cases with gradients, without, refused alike.
    let mut kinds = [[0usize; 3]; 2];
    // Per op: seconds of the small cases, of the large ones, of the slowest.
    let mut secs = [[0.0f64; 3]; 2];
    for i in 0..b.cases {
        let data = budgeted_input(&b, 0, i);
        let class = usize::from(SizeClass::of(&data) == SizeClass::Large);
        let ce = CeFuzzCase::from_bytes(&data).unwrap();
        let linear = LinearFuzzCase::from_bytes(&data).unwrap();
        for op in 0..2 {
            let t = std::time::Instant::now();
            let (o, want_grad, expected) = if op == 0 {
                let (n, v) = (ce.case.targets.len(), ce.case.map.vocab_size());
                let o = fv::run_cross_entropy(&ReferenceCrossEntropy, TOL, &data).unwrap();
                (o, ce.want_grad, values_per_form(n, v, None, ce.want_grad))
            } else {
                let (n, h) = linear.case.hidden.dim();
                let v = linear.case.map.vocab_size();
                let o = fv::run_linear(&ReferenceLinearCrossEntropy, TOL, &data).unwrap();
                let expected = values_per_form(n, v, Some(h), linear.want_grad);
                (o, linear.want_grad, expected)
            };
            let dt = t.elapsed().as_secs_f64();
            secs[op][class] += dt;
            secs[op][2] = secs[op][2].max(dt);
            assert_eq!(o.cases, 1);
            if o.errors_alike == 1 {
                kinds[op][2] += 1;
                assert_eq!((o.compared, o.values), (0, 0), "input {i}");
            } else {
                kinds[op][usize::from(!want_grad)] += 1;
                assert_eq!(o.values, forms * expected, "op {op}, input {i}");
            }
        }
    }
    eprintln!(
        "the reference over the default budget of seed 0 (small s, large s, slowest case s): \
         cross_entropy {:.3?}, linear_cross_entropy {:.3?}",
        secs[0], secs[1]
    );
    for k in kinds {
        assert!(k.iter().all(|&c| c > 0), "{kinds:?}");
    }
}
