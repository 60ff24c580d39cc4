//! The attention fuzz cases reach what kernels break on under the default
//! budget (`Budget::DEFAULT`): segments of 1,024 tokens and more, every
//! grouped-query ratio, cross segments and causal masks; and three faults
//! kernel authors ship, each invisible to the earlier generator (at most 12
//! tokens a segment, `h_kv == h`, self-attention, never causal), are caught
//! by `fuzz_budgeted(Budget::DEFAULT, 0, ..)`.
// The fuzz bodies' `Failure` is a test report, not a hot error path.
#![allow(clippy::result_large_err)]

use ndarray::{Array2, Array3};
use packshard_equivalence::compare::{Judge, Tolerance};
use packshard_equivalence::fuzz::attention as fa;
use std::collections::BTreeSet;

use packshard_equivalence::fuzz::schedule::{budgeted_input, fuzz_budgeted, Budget};
use packshard_equivalence::planted::{AttentionHooks, ModuloKvHeads, Planted, TopLeftCausal};
use packshard_reference::attention::{AttentionOutput, ReferenceAttention};
use packshard_reference::ops::{AttentionOp, AttentionSupport, Qkv, Varlen};
use packshard_reference::Error;

const TOL: Judge = Judge::Rewrite(Tolerance::F64_REWRITE);

/// Flash-attention's forward with key tiles of 16 whose online softmax
/// never rescales: when a later tile raises the row maximum, the sums of
/// the earlier tiles keep their old exponent base (the missing
/// `exp(m_old - m_new)` factor). Exact while a row's keys fit one tile.
struct NoRescaleTiles;

/// The tile the fault sits at (flash-attention's CPU and older GPU kernels).
const TILE: usize = 16;

impl AttentionHooks for NoRescaleTiles {
    fn support(&self) -> AttentionSupport {
        AttentionSupport::CAUSAL_GQA_CROSS
    }

    fn varlen_forward(&self, x: Qkv<'_>, p: &Varlen<'_>) -> Result<AttentionOutput, Error> {
        // The reference validates the call (and gives its errors).
        ReferenceAttention.varlen_forward(x, p)?;
        let (n, h, d) = x.q.dim();
        let group = h / x.k.dim().1;
        let mut output = Array3::zeros((n, h, d));
        let mut lse = Array2::from_elem((h, n), f64::NEG_INFINITY);
        for (wq, wk) in p.cu_seqlens_q.windows(2).zip(p.cu_seqlens_k.windows(2)) {
            let (lq, lk) = (wq[1] - wq[0], wk[1] - wk[0]);
            for a in 0..h {
                for r in 0..lq {
                    let i = wq[0] + r;
                    let keys = if p.causal {
                        (r + lk + 1).saturating_sub(lq).min(lk)
                    } else {
                        lk
                    };
                    let (mut m, mut l) = (f64::NEG_INFINITY, 0.0);
                    let mut acc = vec![0.0; d];
                    for t in (0..keys).step_by(TILE) {
                        let s: Vec<f64> = (t..keys.min(t + TILE))
                            .map(|c| {
                                let j = wk[0] + c;
                                p.scale
                                    * (0..d)
                                        .map(|e| x.q[[i, a, e]] * x.k[[j, a / group, e]])
                                        .sum::<f64>()
                            })
                            .collect();
                        m = s.iter().copied().fold(m, f64::max);
                        // The fault: `acc` and `l` are not multiplied by
                        // exp(m_old - m) here.
                        for (o, &sc) in s.iter().enumerate() {
                            let w = (sc - m).exp();
                            l += w;
                            for (e, slot) in acc.iter_mut().enumerate() {
                                *slot += w * x.v[[wk[0] + t + o, a / group, e]];
                            }
                        }
                    }
                    if keys == 0 {
                        continue;
                    }
                    for e in 0..d {
                        output[[i, a, e]] = acc[e] / l;
                    }
                    lse[[a, i]] = m + l.ln();
                }
            }
        }
        Ok(AttentionOutput { output, lse })
    }
}

/// [`TopLeftCausal`] refusing what the reference refuses (the planted
/// fault builds its mask without validating `cu_seqlens`): only its
/// alignment differs from the reference.
struct ValidatedTopLeft;

impl AttentionHooks for ValidatedTopLeft {
    fn support(&self) -> AttentionSupport {
        AttentionSupport::CAUSAL_GQA_CROSS
    }
    fn varlen_forward(&self, x: Qkv<'_>, p: &Varlen<'_>) -> Result<AttentionOutput, Error> {
        ReferenceAttention.varlen_forward(x, p)?;
        TopLeftCausal.varlen_forward(x, p)
    }
    fn varlen_backward(
        &self,
        x: Qkv<'_>,
        p: &Varlen<'_>,
        g: packshard_reference::ops::Grad<'_>,
    ) -> Result<packshard_reference::attention::AttentionGrads, Error> {
        ReferenceAttention.varlen_forward(x, p)?;
        TopLeftCausal.varlen_backward(x, p, g)
    }
}

/// The three faults, each with the first budgeted input that fails it.
#[test]
fn the_default_budget_catches_tile_gqa_and_alignment_faults() {
    let faults: [(&str, &dyn AttentionOp); 3] = [
        ("ModuloKvHeads", &Planted(ModuloKvHeads)),
        ("TopLeftCausal", &Planted(ValidatedTopLeft)),
        ("NoRescaleTiles", &Planted(NoRescaleTiles)),
    ];
    for (name, imp) in faults {
        match fuzz_budgeted(Budget::DEFAULT, 0, |d| fa::run(imp, TOL, d)) {
            Ok(seen) => panic!("{name} passed the default budget: {seen:?}"),
            Err(f) => {
                eprintln!("{name}: caught\n{f}\n");
                // A numeric disagreement, not a refusal of bad input.
                assert!(!f.mismatch.detail.contains("must be refused"), "{f}");
            }
        }
    }
}

/// What the default budget reaches, for three seeds: a segment of 1,024
/// tokens or more, every ratio `h / h_kv` in 1, 2, 4, 8 and multi-query
/// (`h_kv = 1 < h`), cross segments (with a key-less one and one with more
/// queries than keys), causal cases, head dims of 32 and more.
#[test]
fn the_default_budget_reaches_long_segments_every_gqa_ratio_cross_and_causal() {
    for seed in [0, 1, 2] {
        let cases: Vec<fa::AttentionFuzzCase> = (0..Budget::DEFAULT.cases)
            .map(|i| {
                let data = budgeted_input(&Budget::DEFAULT, seed, i);
                fa::AttentionFuzzCase::from_bytes(&data).unwrap()
            })
            .collect();
        // Narrowed to bidirectional self-attention with h_kv == h (the least
        // any kernel declares), a case does no more work (one pair a segment
        // at most): the budget holds for every kernel.
        for c in &cases {
            let (n, changed) = c.within(AttentionSupport::BIDIRECTIONAL);
            let (h, _, d) = c.heads();
            assert!(
                n.is_self() && !n.causal && n.heads().1 == h,
                "{}",
                n.describe()
            );
            assert!(
                n.work() <= c.work() + c.segments.len() * h * d,
                "{changed:?}: {}",
                c.describe()
            );
            assert_eq!(changed.is_empty(), n == *c);
        }
        let longest = cases.iter().map(|c| c.longest()).max().unwrap();
        assert!(longest >= 1024, "seed {seed}: longest {longest}");
        let ratios: BTreeSet<usize> = cases
            .iter()
            .map(|c| {
                let (h, h_kv, _) = c.heads();
                h / h_kv
            })
            .collect();
        for r in fa::GQA_RATIOS {
            assert!(ratios.contains(&r), "seed {seed}: ratios {ratios:?}");
        }
        let mqa = cases.iter().any(|c| {
            let (h, h_kv, _) = c.heads();
            h_kv == 1 && h > 1 && h != 8
        });
        assert!(mqa, "seed {seed}: no multi-query case with h in 2, 3, 4");
        let cross = cases.iter().filter(|c| !c.is_self()).count();
        let keyless = cases
            .iter()
            .any(|c| c.segments.iter().any(|&(q, k)| q > 0 && k == 0));
        let more_q = cases
            .iter()
            .any(|c| c.segments.iter().any(|&(q, k)| q > k && k > 0));
        let causal = cases.iter().filter(|c| c.causal).count();
        let wide = cases.iter().filter(|c| c.heads().2 >= 32).count();
        eprintln!(
            "seed {seed}: longest {longest}, ratios {ratios:?}, {cross} cross, {causal} causal, {wide} with d >= 32"
        );
        assert!(
            cross >= 15 && keyless && more_q,
            "seed {seed}: {cross} cross"
        );
        assert!((30..=70).contains(&causal), "seed {seed}: {causal} causal");
        assert!(wide >= 2, "seed {seed}: {wide} with d >= 32");
    }
}

/// In every seed's default check: the 12 large cases meet every head-dim
/// class (`HEAD_DIMS[j % 9]` at large case `j`, the odd one at 8), each dim
/// past 128 (160, 192, 256) kept, two of them at least on a case that has
/// attention to do, and are
/// forward-only (`want_grad` false) exactly at `FORWARD_ONLY_SLOTS`, each of
/// those with its long segment and keys that vary. Over 1,200 small inputs, the default scale
/// (no `scale` given) comes one in four and forward-only one in eight: 300
/// and 150, bounds +- 4 binomial standard deviations (+- 60, +- 46).
#[test]
fn every_default_check_reaches_wide_heads_the_default_scale_and_forward_only() {
    let b = Budget::DEFAULT;
    let first = b.cases - b.large;
    for seed in 0..6 {
        let large: Vec<fa::AttentionFuzzCase> = (first..b.cases)
            .map(|i| fa::AttentionFuzzCase::from_bytes(&budgeted_input(&b, seed, i)).unwrap())
            .collect();
        for (j, c) in large.iter().enumerate() {
            let d = c.heads().2;
            match fa::HEAD_DIMS.get(j % fa::HEAD_DIM_CLASSES) {
                // Past 128: never cut (no long segment drawn beside it).
                Some(&want) if want > 128 => {
                    assert_eq!(d, want, "seed {seed}, large {j}: {}", c.describe());
                }
                // At most the class's dim (a long segment cuts it to fit).
                Some(&want) => assert!(d <= want, "seed {seed}, large {j}: d {d}"),
                None => assert!(d % 2 == 1 && d <= 201, "seed {seed}, large {j}: d {d}"),
            }
            let fwd = fa::FORWARD_ONLY_SLOTS.contains(&(j % fa::FORWARD_ONLY_PERIOD));
            assert_eq!(c.want_grad, !fwd, "seed {seed}, large {j}");
            if fwd {
                // Its long segment, and keys that differ (not a constant).
                assert!(
                    fa::LONG_LEN.contains(&c.longest()),
                    "seed {seed}, large {j}: {}",
                    c.describe()
                );
                let k0 = c.k.iter().next().copied();
                assert!(
                    c.k.iter().any(|&x| Some(x) != k0),
                    "seed {seed}, large {j}: constant keys"
                );
            }
        }
        // A head dim past 128 on a case with attention to do (one of the
        // three may draw only empty segments: seed 1's 256 does).
        let wide = large
            .iter()
            .filter(|c| c.heads().2 > 128 && c.work() > 0)
            .count();
        assert!(wide >= 2, "seed {seed}: {wide} cases with d > 128 and work");
        assert!(
            large
                .iter()
                .any(|c| !c.want_grad && c.segments.iter().any(|&(q, k)| q > 0 && k > 64)),
            "seed {seed}: no forward-only case crosses a 64-key tile"
        );
    }
    let (mut default_scale, mut forward) = (0, 0);
    for s in 0..1200 {
        let c =
            fa::AttentionFuzzCase::from_bytes(&budgeted_input(&Budget::small(1), s, 0)).unwrap();
        if c.default_scale {
            default_scale += 1;
            assert_eq!(c.scale, 1.0 / (c.heads().2 as f64).sqrt());
        }
        forward += usize::from(!c.want_grad);
    }
    assert!(
        (240..=360).contains(&default_scale),
        "default scale in {default_scale} of 1200"
    );
    assert!(
        (104..=196).contains(&forward),
        "forward only in {forward} of 1200"
    );
}

/// The default budget on the f64 reference: every case compared or refused
/// alike, bit for bit, and how long it takes (docs/FAULTS.md).
#[test]
fn the_default_budget_on_the_reference_passes_and_is_timed() {
    let start = std::time::Instant::now();
    let seen = fuzz_budgeted(Budget::DEFAULT, 0, |d| fa::run(&ReferenceAttention, TOL, d))
        .unwrap_or_else(|f| panic!("{f}"));
    eprintln!(
        "reference, Budget::DEFAULT seed 0: {seen:?} in {:.2?}",
        start.elapsed()
    );
    assert_eq!(seen.cases, 100);
    assert_eq!(seen.compared + seen.errors_alike, 100);
    assert_eq!(seen.worst, 0.0);
}
