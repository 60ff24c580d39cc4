//! The bug zoo (`packshard_equivalence::zoo`, docs/FAULTS.md "The bug zoo"):
//! every (kernel, bug) changes the result on a small hand-built input (its
//! witness), and the default check — `fuzz_budgeted(Budget::DEFAULT, 0,
//! ...)` over the family's fuzz body, what `packshard.testing.check_*`
//! runs — rejects it; the correct zoo kernels pass both. One test per
//! family; each names every bug that escaped (one escape never hides
//! another) and prints one line per bug: the first failure, its input, the
//! time the check took.

#![allow(clippy::result_large_err)]

use std::time::Instant;

use ndarray::{Array2, Array3};
use packshard_equivalence::fuzz::schedule::{budgeted_input, fuzz_budgeted, Budget};
use packshard_equivalence::fuzz::{attention as fa, vocab as fv, Failure, Outcome};
use packshard_equivalence::zoo::{
    AttentionBug, ChunkedCrossEntropy, LinearBug, LossBug, TiledAttention,
    TokenChunkedLinearCrossEntropy,
};
use packshard_equivalence::{cu_seqlens_of, Judge, Tolerance};
use packshard_reference::attention::{ReferenceAttention, Window};
use packshard_reference::ops::{
    AttentionOp, CeCall, CrossEntropyOp, Grad, LinearCall, LinearCrossEntropyOp, LinearInput, Qkv,
    Varlen,
};
use packshard_reference::vocab::{
    GradRequest, LossCall, LossConfig, Reduction, ReferenceCrossEntropy,
    ReferenceLinearCrossEntropy,
};

/// The judge of an f64 kernel, as the registry states it for one.
const JUDGE: Judge = Judge::Rewrite(Tolerance::F64_REWRITE);
/// The default checks' seed (`packshard.testing.check_*(seed=0)`).
const SEED: u64 = 0;

/// A correct zoo kernel agrees with the reference on a witness within this
/// (relative to the tensor's largest value): f64 sums reordered over at
/// most a few hundred O(1) terms differ by ~1e-14; 1e-12 leaves a margin
/// of 100 and is still 9 orders below [`CHANGED`].
const REWRITE_AGREES: f64 = 1e-12;
/// A bug must move some result of its witness by at least this (relative
/// to the tensor's largest value): every witness below is built so the bug
/// changes a result by O(0.01) to O(1).
const CHANGED: f64 = 1e-3;

/// `n` deterministic values in `[-2, 2)` (Knuth's MMIX linear congruential
/// generator, top bits).
fn values(n: usize, seed: u64) -> Vec<f64> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (x >> 11) as f64 / (1u64 << 53) as f64 * 4.0 - 2.0
        })
        .collect()
}

/// The largest difference between two lists of tensors, each relative to
/// its expected tensor's largest finite value (at least 1); equal
/// infinities agree, any other non-finite pair is infinitely far.
fn distance(actual: &[Vec<f64>], expected: &[Vec<f64>]) -> f64 {
    let mut worst = 0.0f64;
    for (a, e) in actual.iter().zip(expected) {
        assert_eq!(a.len(), e.len(), "tensor lengths");
        let scale = e
            .iter()
            .filter(|x| x.is_finite())
            .fold(1.0f64, |m, x| m.max(x.abs()));
        for (x, y) in a.iter().zip(e) {
            let d = if x == y {
                0.0
            } else if x.is_finite() && y.is_finite() {
                (x - y).abs() / scale
            } else {
                f64::INFINITY
            };
            worst = worst.max(d);
        }
    }
    worst
}

/// The failure's first mismatch on one line: the tensor and detail (first
/// line, cut at 150 characters) and the input that showed it.
fn one_line(f: &Failure) -> String {
    let detail: String = f
        .mismatch
        .detail
        .lines()
        .next()
        .unwrap_or("")
        .chars()
        .take(150)
        .collect();
    format!("{} ({}): {detail}", f.mismatch.what, f.source)
}

/// Bugs the default check is known to miss, each with the reason and the
/// case that would catch it (docs/FAULTS.md, "The bug zoo"). The family
/// tests require each to *still* escape, so that fixing the generator fails
/// the test until its entry is removed here; every other bug must be caught.
const KNOWN_ESCAPES: &[(&str, &str)] = &[];

/// Whether `name` is a [`KNOWN_ESCAPES`] entry.
fn known_escape(name: &str) -> Option<&'static str> {
    KNOWN_ESCAPES
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, why)| *why)
}

/// Runs the default check `check` on the correct kernels and every bug;
/// prints a table row per kernel; returns the problems (a correct kernel
/// that fails, a bug that passes, a [`KNOWN_ESCAPES`] entry that is now
/// caught), each named.
fn run_default_checks<K>(
    family: &str,
    correct: &[(String, K)],
    buggy: &[(String, K)],
    check: impl Fn(&K) -> Result<Outcome, Failure>,
) -> Vec<String> {
    let mut problems = Vec::new();
    eprintln!(); // the table starts on a line of its own under libtest
    for (name, k) in correct {
        let start = Instant::now();
        let r = check(k);
        let secs = start.elapsed().as_secs_f64();
        match r {
            Ok(o) => eprintln!(
                "| {name} (correct) | {family} | passes | {secs:.2} s | {} cases, {} compared |",
                o.cases, o.compared
            ),
            Err(f) => {
                eprintln!(
                    "| {name} (correct) | {family} | FAILS | {secs:.2} s | {} |",
                    one_line(&f)
                );
                problems.push(format!("correct {name} fails: {f}"));
            }
        }
    }
    for (name, k) in buggy {
        let start = Instant::now();
        let r = check(k);
        let secs = start.elapsed().as_secs_f64();
        match (r, known_escape(name)) {
            (Err(f), None) => eprintln!(
                "| {name} | {family} | caught | {secs:.2} s | {} |",
                one_line(&f)
            ),
            (Err(f), Some(_)) => {
                eprintln!(
                    "| {name} | {family} | caught | {secs:.2} s | {} |",
                    one_line(&f)
                );
                problems.push(format!(
                    "bug {name} is caught now: remove it from KNOWN_ESCAPES (and docs/FAULTS.md)"
                ));
            }
            (Ok(o), why) => {
                eprintln!(
                    "| {name} | {family} | ESCAPED | {secs:.2} s | {} cases passed |",
                    o.cases
                );
                if why.is_none() {
                    problems.push(format!("bug {name} escaped ({} cases)", o.cases));
                }
            }
        }
    }
    problems
}

// ---- attention ----------------------------------------------------------------

/// A hand-built attention input on which a bug changes the result.
struct AttnWitness {
    bug: AttentionBug,
    /// Query and key lengths of each segment.
    lq: &'static [usize],
    lk: &'static [usize],
    h: usize,
    h_kv: usize,
    d: usize,
    causal: bool,
    scale: f64,
    /// flash-attention's `window_size` (`-1`: unbounded).
    window: (i64, i64),
    /// `softcap` (0: none).
    softcap: f64,
    /// `alibi_slopes: [h]`.
    alibi: Option<&'static [f64]>,
}

const fn witness(bug: AttentionBug, lq: &'static [usize], lk: &'static [usize]) -> AttnWitness {
    AttnWitness {
        bug,
        lq,
        lk,
        h: 2,
        h_kv: 2,
        d: 4,
        causal: false,
        scale: 0.5,
        window: (-1, -1),
        softcap: 0.0,
        alibi: None,
    }
}

/// One witness per bug (tiles as [`AttentionBug::tiles`]).
const ATTENTION_WITNESSES: [AttnWitness; 22] = [
    // 40 keys = 3 tiles of 16: some row's maximum is in a later tile.
    witness(AttentionBug::NoRescale, &[40], &[40]),
    // Segment 0's one tile of 32 runs 12 keys into segment 1.
    witness(AttentionBug::UnmaskedTail, &[20, 20], &[20, 20]),
    // 18 = 16 + 2: the tile of rows 16..18 over keys 16..18 skips its mask.
    AttnWitness {
        causal: true,
        ..witness(AttentionBug::CausalTileEdge, &[18], &[18])
    },
    // 70 = 64 + 6: rows 64..70 never visit keys 64..70.
    AttnWitness {
        causal: true,
        ..witness(AttentionBug::DiagonalTileSkipped, &[70], &[70])
    },
    AttnWitness {
        causal: true,
        ..witness(AttentionBug::TopLeftCausal, &[3], &[7])
    },
    AttnWitness {
        h: 4,
        ..witness(AttentionBug::GqaModulo, &[10], &[10])
    },
    witness(AttentionBug::Log2Lse, &[10], &[10]),
    // 40 keys = 3 key tiles of 16.
    witness(AttentionBug::DeltaPerTile, &[40], &[40]),
    // 40 queries = 3 query tiles of 16.
    witness(AttentionBug::DkvLastQueryTile, &[40], &[40]),
    // One segment of exactly one tile of 32.
    witness(AttentionBug::RemainderTile, &[32], &[32]),
    // d = 4: the default scale is 0.5; the caller's is 0.3.
    AttnWitness {
        scale: 0.3,
        ..witness(AttentionBug::DefaultScale, &[10], &[10])
    },
    // 5 queries over 2 keys, bottom-right: queries 0..3 see no key.
    AttnWitness {
        causal: true,
        ..witness(AttentionBug::FiniteMaskFill, &[5], &[2])
    },
    AttnWitness {
        h: 4,
        ..witness(AttentionBug::GqaGradOverwrite, &[10], &[10])
    },
    // d = 40 = 32 + 8: dims 32..40 leave the scores.
    AttnWitness {
        d: 40,
        scale: 0.2,
        ..witness(AttentionBug::HeadDimTail, &[10], &[10])
    },
    // 2 queries over 40 keys: one key tile of 16 visited, not 3.
    witness(AttentionBug::MaxSeqlenQForK, &[2], &[40]),
    // docs/FAULTS.md W1-W6's tiny cases.
    AttnWitness {
        window: (2, 1),
        ..witness(AttentionBug::WindowOffByOne, &[7], &[7])
    },
    // A continuation chunk of 2 queries over 9 keys.
    AttnWitness {
        causal: true,
        window: (2, 0),
        ..witness(AttentionBug::WindowTopLeft, &[2], &[9])
    },
    AttnWitness {
        causal: true,
        window: (3, -1),
        ..witness(AttentionBug::WindowAcrossDocuments, &[6, 6], &[6, 6])
    },
    AttnWitness {
        causal: true,
        window: (1, 0),
        softcap: 0.7,
        ..witness(AttentionBug::SoftcapAfterMask, &[6], &[6])
    },
    AttnWitness {
        softcap: 0.5,
        ..witness(AttentionBug::SoftcapNoChain, &[6], &[6])
    },
    // Cross segments: the pack's |i - j| is not the aligned distance.
    AttnWitness {
        alibi: Some(&[0.5, 0.25]),
        ..witness(AttentionBug::AlibiPackStart, &[3, 4], &[7, 9])
    },
    AttnWitness {
        alibi: Some(&[0.5, 0.25]),
        ..witness(AttentionBug::AlibiSign, &[5], &[5])
    },
];

/// `output, lse, grad_q, grad_k, grad_v` of `op` on the witness (the
/// backward from `op`'s own forward), flat.
fn attention_results(op: &dyn AttentionOp, w: &AttnWitness) -> Vec<Vec<f64>> {
    let (cq, ck) = (
        cu_seqlens_of(w.lq.iter().copied()),
        cu_seqlens_of(w.lk.iter().copied()),
    );
    let (n_q, n_k) = (cq[cq.len() - 1], ck[ck.len() - 1]);
    let t = |n: usize, h: usize, seed: u64| {
        Array3::from_shape_vec((n, h, w.d), values(n * h * w.d, seed)).unwrap()
    };
    let (q, k, v, go) = (
        t(n_q, w.h, 1),
        t(n_k, w.h_kv, 2),
        t(n_k, w.h_kv, 3),
        t(n_q, w.h, 4),
    );
    let window = Window::from_flash(w.window.0, w.window.1).unwrap();
    let p = Varlen::cross(&cq, &ck, w.causal, w.scale)
        .with_window(window)
        .with_softcap(w.softcap)
        .with_alibi_slopes(w.alibi);
    let x = Qkv::new(q.view(), k.view(), v.view());
    let f = op.varlen_forward(x, &p).unwrap();
    let g = op.varlen_backward(x, &p, Grad::new(&f, go.view())).unwrap();
    let flat = |a: &Array3<f64>| a.iter().copied().collect::<Vec<_>>();
    vec![
        flat(&f.output),
        f.lse.iter().copied().collect(),
        flat(&g.grad_q),
        flat(&g.grad_k),
        flat(&g.grad_v),
    ]
}

#[test]
fn each_attention_bug_changes_the_result_on_its_witness() {
    assert_eq!(
        ATTENTION_WITNESSES.map(|w| w.bug),
        AttentionBug::ALL,
        "one witness per bug, in order"
    );
    let mut problems = Vec::new();
    for w in &ATTENTION_WITNESSES {
        let expected = attention_results(&ReferenceAttention, w);
        let buggy = TiledAttention::with(w.bug);
        let fixed = distance(&attention_results(&buggy.fixed(), w), &expected);
        let broken = distance(&attention_results(&buggy, w), &expected);
        if fixed > REWRITE_AGREES {
            problems.push(format!(
                "{}: the fixed kernel is {fixed:e} off",
                w.bug.name()
            ));
        }
        if broken < CHANGED {
            problems.push(format!(
                "{}: the bug moves nothing ({broken:e})",
                w.bug.name()
            ));
        }
    }
    assert!(problems.is_empty(), "{problems:#?}");
}

#[test]
fn the_default_attention_check_catches_every_attention_bug() {
    let mut tiles: Vec<(usize, usize)> = AttentionBug::ALL.iter().map(|b| b.tiles()).collect();
    tiles.sort_unstable();
    tiles.dedup();
    let correct: Vec<(String, TiledAttention)> = tiles
        .into_iter()
        .map(|(br, bc)| (format!("tiled_{br}x{bc}"), TiledAttention::correct(br, bc)))
        .collect();
    let buggy: Vec<(String, TiledAttention)> = AttentionBug::ALL
        .iter()
        .map(|&b| (b.name().to_string(), TiledAttention::with(b)))
        .collect();
    let problems = run_default_checks("attention", &correct, &buggy, |k| {
        fuzz_budgeted(Budget::DEFAULT, SEED, |d| fa::run(k, JUDGE, d))
    });
    assert!(
        problems.is_empty(),
        "the default attention check (Budget::DEFAULT, seed {SEED}): {problems:#?}"
    );
}

/// docs/FAULTS.md W5: the score softcap's backward without its chain factor
/// `1 - tanh^2(raw / softcap)` is rejected by the default attention check
/// on a gradient, and the same kernel with the factor passes it (the
/// negative control: the check is not failing the kernel for another
/// reason).
#[test]
fn w5_softcap_gradient_without_its_chain_factor_is_caught() {
    let bug = TiledAttention::with(AttentionBug::SoftcapNoChain);
    let check = |k: &TiledAttention| fuzz_budgeted(Budget::DEFAULT, SEED, |d| fa::run(k, JUDGE, d));
    let passed = check(&bug.fixed());
    assert!(
        passed.is_ok(),
        "the kernel with the chain factor fails: {passed:?}"
    );
    let failure = check(&bug).expect_err("the softcap gradient without its chain factor passed");
    let text = failure.to_string();
    assert!(
        text.contains("grad_"),
        "caught, but not on a gradient: {text}"
    );
}

// ---- cross-entropy --------------------------------------------------------------

/// A hand-built cross-entropy input on which a bug changes the result.
struct CeWitness {
    bug: LossBug,
    v: usize,
    targets: &'static [i64],
    /// Added to every logit (values in `[-2, 2)` otherwise).
    shift: f64,
    /// Multiplies every logit.
    stretch: f64,
    config: LossConfig,
}

const fn ce(bug: LossBug, v: usize, targets: &'static [i64]) -> CeWitness {
    CeWitness {
        bug,
        v,
        targets,
        shift: 0.0,
        stretch: 1.0,
        config: LossConfig {
            ignore_index: -100,
            label_smoothing: 0.0,
            smoothing: packshard_reference::vocab::SmoothingConvention::PyTorch,
            z_loss: 0.0,
            reduction: Reduction::Mean,
            softcap: None,
        },
    }
}

fn ce_witnesses() -> [CeWitness; 8] {
    let base = LossConfig::default();
    [
        // 300 = 256 + 44: the last 44 entries, target 299 among them.
        ce(LossBug::LastChunkDropped, 300, &[5, 299, 100]),
        // 10 entries in a chunk of 1024: 1014 zeros join the sum.
        ce(LossBug::TailLoadedAsZero, 10, &[1, 2, 3]),
        ce(LossBug::IgnoredInDenominator, 10, &[1, -100, 3, -100]),
        CeWitness {
            config: base.with_smoothing(0.1, Default::default()),
            ..ce(LossBug::SmoothingOverPadded, 10, &[1, 2, 3])
        },
        // lse near 7, far from the 1 the bug puts in its place.
        CeWitness {
            shift: 5.0,
            config: base.with_z_loss(0.1),
            ..ce(LossBug::ZLossGradNoLse, 10, &[1, 2, 3])
        },
        // Every logit near -800: exp(z - 0) underflows to 0.
        CeWitness {
            shift: -800.0,
            ..ce(LossBug::MaxInitZero, 10, &[1, 2, 3])
        },
        // Logits up to 8 under a cap of 3: 1 - tanh^2 far from 1.
        CeWitness {
            stretch: 4.0,
            config: base.with_softcap(3.0),
            ..ce(LossBug::SoftcapNoChain, 10, &[1, 2, 3])
        },
        // ignore_index 2: the second token is not predicted.
        CeWitness {
            config: base.with_ignore_index(2),
            ..ce(LossBug::HardcodedIgnoreIndex, 10, &[1, 2, 3])
        },
    ]
}

/// `loss, per_token_loss, logsumexp, grad_logits` of `op` on the witness.
fn ce_results(op: &dyn CrossEntropyOp, w: &CeWitness) -> Vec<Vec<f64>> {
    let n = w.targets.len();
    let logits = Array2::from_shape_vec((n, w.v), values(n * w.v, 7))
        .unwrap()
        .mapv(|z| z * w.stretch + w.shift);
    let call = LossCall::new(w.targets, &w.config, GradRequest::Loss);
    let r = op.cross_entropy(CeCall::new(logits.view(), call)).unwrap();
    vec![
        vec![r.loss],
        r.per_token_loss.to_vec(),
        r.logsumexp().to_vec(),
        r.grad_logits.unwrap().iter().copied().collect(),
    ]
}

#[test]
fn each_cross_entropy_bug_changes_the_result_on_its_witness() {
    let witnesses = ce_witnesses();
    assert_eq!(witnesses.each_ref().map(|w| w.bug), LossBug::ALL);
    let mut problems = Vec::new();
    for w in &witnesses {
        let expected = ce_results(&ReferenceCrossEntropy, w);
        let buggy = ChunkedCrossEntropy::with(w.bug);
        let fixed = distance(&ce_results(&buggy.fixed(), w), &expected);
        let broken = distance(&ce_results(&buggy, w), &expected);
        if fixed > REWRITE_AGREES {
            problems.push(format!(
                "{}: the fixed kernel is {fixed:e} off",
                w.bug.name()
            ));
        }
        if broken < CHANGED {
            problems.push(format!(
                "{}: the bug moves nothing ({broken:e})",
                w.bug.name()
            ));
        }
    }
    assert!(problems.is_empty(), "{problems:#?}");
}

#[test]
fn the_default_cross_entropy_check_catches_every_cross_entropy_bug() {
    let mut chunks: Vec<usize> = LossBug::ALL.iter().map(|b| b.chunk()).collect();
    chunks.sort_unstable();
    chunks.dedup();
    let correct: Vec<(String, ChunkedCrossEntropy)> = chunks
        .into_iter()
        .map(|c| (format!("ce_chunked_{c}"), ChunkedCrossEntropy::correct(c)))
        .collect();
    let buggy: Vec<(String, ChunkedCrossEntropy)> = LossBug::ALL
        .iter()
        .map(|&b| (b.name().to_string(), ChunkedCrossEntropy::with(b)))
        .collect();
    let problems = run_default_checks("cross_entropy", &correct, &buggy, |k| {
        fuzz_budgeted(Budget::DEFAULT, SEED, |d| {
            fv::run_cross_entropy(k, JUDGE, d)
        })
    });
    assert!(
        problems.is_empty(),
        "the default cross-entropy check (Budget::DEFAULT, seed {SEED}): {problems:#?}"
    );
}

// ---- the output layer -----------------------------------------------------------

/// A hand-built output-layer input on which a bug changes the result.
struct LinearWitness {
    bug: LinearBug,
    n: usize,
    /// Vocabulary size.
    v: usize,
    /// Token `i`'s target is `i % v`, or ignored when `i % ignore_every ==
    /// 0` (0: none ignored).
    ignore_every: usize,
    config: LossConfig,
    /// A per-token upstream gradient (reduction `none`).
    upstream: bool,
}

/// Hidden size of every output-layer witness.
const H: usize = 4;

fn linear_witnesses() -> [LinearWitness; 5] {
    let w = |bug, n| LinearWitness {
        bug,
        n,
        v: 10,
        ignore_every: 0,
        config: LossConfig::default(),
        upstream: false,
    };
    [
        // 40 = 32 + 8: the last 8 tokens are never computed.
        w(LinearBug::TokenTailDropped, 40),
        // 70 = 64 + 6: dW holds the last 6 tokens' share.
        w(LinearBug::GradWeightLastChunk, 70),
        // 40 tokens in chunks of 32 and 8, every 3rd ignored: the chunks'
        // means weigh their tokens 1/(22 x 2) and 1/(5 x 2), not 1/27.
        LinearWitness {
            ignore_every: 3,
            ..w(LinearBug::MeanPerChunk, 40)
        },
        LinearWitness {
            config: LossConfig::default().with_reduction(Reduction::None),
            upstream: true,
            ..w(LinearBug::UpstreamScalar, 12)
        },
        // 1100 = 1024 + 76: rows 1024..1100 of dW stay 0.
        LinearWitness {
            v: 1100,
            ..w(LinearBug::GradWeightVocabTail, 3)
        },
    ]
}

/// `loss, per_token_loss, grad_hidden, grad_weight` of `op` on the witness.
fn linear_results(op: &dyn LinearCrossEntropyOp, w: &LinearWitness) -> Vec<Vec<f64>> {
    let hidden = Array2::from_shape_vec((w.n, H), values(w.n * H, 11)).unwrap();
    let weight = Array2::from_shape_vec((w.v, H), values(w.v * H, 12)).unwrap();
    let targets: Vec<i64> = (0..w.n)
        .map(|i| {
            if w.ignore_every > 0 && i % w.ignore_every == 0 {
                -100
            } else {
                (i % w.v) as i64
            }
        })
        .collect();
    let upstream = values(w.n, 13);
    let grad = if w.upstream {
        GradRequest::Upstream(&upstream)
    } else {
        GradRequest::Loss
    };
    let call = LossCall::new(&targets, &w.config, grad);
    let r = op
        .linear_cross_entropy(LinearCall::new(
            LinearInput::new(hidden.view(), weight.view()),
            call,
        ))
        .unwrap();
    vec![
        vec![r.ce.loss],
        r.ce.per_token_loss.to_vec(),
        r.grad_hidden.unwrap().iter().copied().collect(),
        r.grad_weight.unwrap().iter().copied().collect(),
    ]
}

#[test]
fn each_output_layer_bug_changes_the_result_on_its_witness() {
    let witnesses = linear_witnesses();
    assert_eq!(witnesses.each_ref().map(|w| w.bug), LinearBug::ALL);
    let mut problems = Vec::new();
    for w in &witnesses {
        let expected = linear_results(&ReferenceLinearCrossEntropy, w);
        let buggy = TokenChunkedLinearCrossEntropy::with(w.bug);
        let fixed = distance(&linear_results(&buggy.fixed(), w), &expected);
        let broken = distance(&linear_results(&buggy, w), &expected);
        if fixed > REWRITE_AGREES {
            problems.push(format!(
                "{}: the fixed kernel is {fixed:e} off",
                w.bug.name()
            ));
        }
        if broken < CHANGED {
            problems.push(format!(
                "{}: the bug moves nothing ({broken:e})",
                w.bug.name()
            ));
        }
    }
    assert!(problems.is_empty(), "{problems:#?}");
}

#[test]
fn the_default_output_layer_check_catches_every_output_layer_bug() {
    let mut chunks: Vec<usize> = LinearBug::ALL.iter().map(|b| b.chunk()).collect();
    chunks.sort_unstable();
    chunks.dedup();
    let correct: Vec<(String, TokenChunkedLinearCrossEntropy)> = chunks
        .into_iter()
        .map(|c| {
            (
                format!("linear_ce_token_chunked_{c}"),
                TokenChunkedLinearCrossEntropy::correct(c),
            )
        })
        .collect();
    let buggy: Vec<(String, TokenChunkedLinearCrossEntropy)> = LinearBug::ALL
        .iter()
        .map(|&b| {
            (
                b.name().to_string(),
                TokenChunkedLinearCrossEntropy::with(b),
            )
        })
        .collect();
    let problems = run_default_checks("linear_cross_entropy", &correct, &buggy, |k| {
        fuzz_budgeted(Budget::DEFAULT, SEED, |d| fv::run_linear(k, JUDGE, d))
    });
    assert!(
        problems.is_empty(),
        "the default output-layer check (Budget::DEFAULT, seed {SEED}): {problems:#?}"
    );
}

// ---- how robustly each bug is caught ----------------------------------------------

/// Seeds the robustness measurement runs the default budget under.
const SEEDS: std::ops::Range<u64> = 0..5;

/// For each bug: how many of the default budget's inputs of seed 0 catch
/// it (small, large), and under which of [`SEEDS`] the default check
/// catches it. A measurement for docs/FAULTS.md ("The bug zoo"), slow
/// (every input of every bug is run): `cargo test -p packshard-equivalence
/// --test zoo catch_rates -- --ignored --nocapture`. Fails when a bug
/// outside [`KNOWN_ESCAPES`] escapes seed 0 (the default); an escape under
/// another seed is printed, not failed (the default is seed 0).
#[test]
#[ignore = "a measurement: runs every default input of every bug (about 2 minutes)"]
fn catch_rates_over_the_default_inputs_and_seeds() {
    type Body<'a> = Box<dyn Fn(&[u8]) -> bool + 'a>;
    let b = Budget::DEFAULT;
    let mut rows: Vec<(String, &str, Body<'_>)> = Vec::new();
    for &bug in &AttentionBug::ALL {
        let k = TiledAttention::with(bug);
        rows.push((
            bug.name().into(),
            "attention",
            Box::new(move |d| fa::run(&k, JUDGE, d).is_err()),
        ));
    }
    for &bug in &LossBug::ALL {
        let k = ChunkedCrossEntropy::with(bug);
        rows.push((
            bug.name().into(),
            "cross_entropy",
            Box::new(move |d| fv::run_cross_entropy(&k, JUDGE, d).is_err()),
        ));
    }
    for &bug in &LinearBug::ALL {
        let k = TokenChunkedLinearCrossEntropy::with(bug);
        rows.push((
            bug.name().into(),
            "linear_cross_entropy",
            Box::new(move |d| fv::run_linear(&k, JUDGE, d).is_err()),
        ));
    }
    let mut escapes = Vec::new();
    eprintln!("\n| bug | family | inputs of seed 0 that catch it (small / large) | seeds {SEEDS:?} caught |");
    for (name, family, caught) in &rows {
        let (mut small, mut large) = (0, 0);
        for i in 0..b.cases {
            let data = budgeted_input(&b, 0, i);
            if caught(&data) {
                if i < b.cases - b.large {
                    small += 1;
                } else {
                    large += 1;
                }
            }
        }
        let per_seed: Vec<bool> = SEEDS
            .map(|s| (0..b.cases).any(|i| caught(&budgeted_input(&b, s, i))))
            .collect();
        let missed: Vec<u64> = SEEDS
            .filter(|&s| !per_seed[(s - SEEDS.start) as usize])
            .collect();
        eprintln!(
            "| {name} | {family} | {small} / {large} of {} / {} | {} of {} |",
            b.cases - b.large,
            b.large,
            per_seed.iter().filter(|&&c| c).count(),
            per_seed.len()
        );
        if !missed.is_empty() {
            eprintln!("  {name} escapes under seeds {missed:?}");
        }
        if small + large == 0 && known_escape(name).is_none() {
            escapes.push(format!("{name} escapes the default check (seed 0)"));
        }
    }
    assert!(escapes.is_empty(), "{escapes:#?}");
}
