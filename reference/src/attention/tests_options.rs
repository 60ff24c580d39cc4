//! flash-attention's options in the reference (window, softcap, ALiBi,
//! `seqused_k`): against a direct formula, packed == each document alone,
//! gradients by central finite differences, typed errors.

use ndarray::{Array3, Axis, Slice};

use super::*;
use crate::testutil::{attention_fd, random3};

/// Segments `(l_q, l_k)`: a continuation chunk (2, 9), more queries than
/// keys (5, 3), self (7, 7), keys only (0, 2), one token (1, 1).
const CU_Q: [usize; 6] = [0, 2, 7, 14, 14, 15];
const CU_K: [usize; 6] = [0, 9, 12, 19, 21, 22];
/// Per segment, keys used (`seqused_k`): fewer than `l_k` in three.
const USED: [usize; 5] = [7, 3, 5, 1, 1];
/// The standard ALiBi slopes for 4 heads, `2^(-8 (a + 1) / h)`.
const SLOPES: [f64; 4] = [0.25, 0.0625, 0.015625, 0.00390625];

/// The options' problem, every option on.
fn problem(causal: bool, w: (i64, i64)) -> Varlen<'static> {
    Varlen::cross(&CU_Q, &CU_K, causal, 0.9)
        .with_window(Window::from_flash(w.0, w.1).unwrap())
        .with_softcap(0.7)
        .with_alibi_slopes(Some(&SLOPES))
        .with_seqused_k(Some(&USED))
}

/// The output of query `i`, head `a`, by the documented formula written
/// out again (not through `options`): allowed keys, capped score, bias.
fn direct(q: &Array3<f64>, k: &Array3<f64>, v: &Array3<f64>, p: &Varlen<'_>) -> Array3<f64> {
    direct_with(q, k, v, p, None)
}

/// The kernel bugs of docs/FAULTS.md W1-W6, planted in [`direct`].
#[derive(Debug, Clone, Copy, PartialEq)]
enum Fault {
    /// W1: the window's left edge one key too far.
    WindowOffByOne,
    /// W2: the window aligned top-left (`diag = r`) when `l_q != l_k`.
    WindowTopLeft,
    /// W3: the window over the pack's keys, not the document's.
    WindowAcrossDocuments,
    /// W4: the cap applied after the mask: a masked key scores `-softcap`.
    SoftcapAfterMask,
    /// W6: ALiBi's distance between pack positions, not the document's
    /// bottom-right aligned ones.
    AlibiFromPackStart,
    /// W6: ALiBi with `+slope`.
    AlibiWrongSign,
}

fn direct_with(
    q: &Array3<f64>,
    k: &Array3<f64>,
    v: &Array3<f64>,
    p: &Varlen<'_>,
    fault: Option<Fault>,
) -> Array3<f64> {
    let (n_q, h, d) = q.dim();
    let group = h / k.dim().1;
    let mut out = Array3::zeros((n_q, h, d));
    let (left, right) = p.window.to_flash();
    for s in 0..CU_Q.len() - 1 {
        let (q0, lq, k0) = (CU_Q[s], CU_Q[s + 1] - CU_Q[s], CU_K[s]);
        let lk = USED[s] as i64;
        for r in 0..lq as i64 {
            for a in 0..h {
                let diag = r + lk - lq as i64;
                let wdiag = if fault == Some(Fault::WindowTopLeft) {
                    r
                } else {
                    diag
                };
                let left = if fault == Some(Fault::WindowOffByOne) && left >= 0 {
                    left + 1
                } else {
                    left
                };
                let inside = |c: i64| {
                    (left < 0 || c >= wdiag - left)
                        && (right < 0 || c <= wdiag + right)
                        && (!p.causal || c <= diag)
                };
                // Keys as offsets from the segment's first key (negative or
                // past lk: other documents' keys, for W3).
                let keys: Vec<i64> = match fault {
                    Some(Fault::WindowAcrossDocuments) => {
                        (-(k0 as i64)..lk).filter(|&c| inside(c)).collect()
                    }
                    Some(Fault::SoftcapAfterMask) => (0..lk).collect(),
                    _ => (0..lk).filter(|&c| inside(c)).collect(),
                };
                let i = q0 + r as usize;
                let s: Vec<f64> = keys
                    .iter()
                    .map(|&c| {
                        let j = (k0 as i64 + c) as usize;
                        let dot: f64 = (0..d).map(|e| q[[i, a, e]] * k[[j, a / group, e]]).sum();
                        let x = p.scale * dot;
                        let dist = match fault {
                            Some(Fault::AlibiFromPackStart) => (i as i64 - j as i64).abs(),
                            _ => (diag - c).abs(),
                        } as f64;
                        let sign = if fault == Some(Fault::AlibiWrongSign) {
                            1.0
                        } else {
                            -1.0
                        };
                        if fault == Some(Fault::SoftcapAfterMask) && !inside(c) {
                            return -p.softcap; // cap(-inf)
                        }
                        p.softcap * (x / p.softcap).tanh() + sign * SLOPES[a] * dist
                    })
                    .collect();
                let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
                for (&c, &x) in keys.iter().zip(&s) {
                    for e in 0..d {
                        let j = (k0 as i64 + c) as usize;
                        out[[i, a, e]] += (x - m).exp() / z * v[[j, a / group, e]];
                    }
                }
            }
        }
    }
    out
}

fn inputs(seed: u64) -> [Array3<f64>; 4] {
    [
        random3(15, 4, 3, seed),
        random3(22, 2, 3, seed + 1),
        random3(22, 2, 3, seed + 2),
        random3(15, 4, 3, seed + 3),
    ]
}

/// Windows: one side only, both, zero, one, larger than every segment.
const WINDOWS: [(i64, i64); 6] = [(-1, -1), (2, 1), (0, 0), (1, -1), (-1, 0), (40, 40)];

#[test]
fn options_match_the_documented_formula() {
    let [q, k, v, _] = inputs(41);
    for causal in [false, true] {
        for w in WINDOWS {
            let p = problem(causal, w);
            let got = varlen_attention_general(q.view(), k.view(), v.view(), &p).unwrap();
            let want = direct(&q, &k, &v, &p);
            // 1e-14: the two sum the same terms (d = 3, at most 9 keys of
            // values below 10) in other orders, a few ulp of f64 apart.
            let err = (&got.output - &want)
                .mapv(f64::abs)
                .fold(0.0f64, |a, &b| a.max(b));
            assert!(err < 1e-14, "causal {causal} window {w:?}: {err:e}");
        }
    }
}

#[test]
fn a_packed_window_stays_inside_each_document() {
    let [q, k, v, _] = inputs(43);
    let p = problem(false, (3, 2));
    let packed = varlen_attention_general(q.view(), k.view(), v.view(), &p).unwrap();
    for s in 0..CU_Q.len() - 1 {
        let (qs, ks) = (
            Slice::from(CU_Q[s]..CU_Q[s + 1]),
            Slice::from(CU_K[s]..CU_K[s + 1]),
        );
        let (cq, ck) = ([0, CU_Q[s + 1] - CU_Q[s]], [0, CU_K[s + 1] - CU_K[s]]);
        let used = [USED[s]];
        let alone = Varlen::cross(&cq, &ck, false, 0.9)
            .with_window(p.window)
            .with_softcap(0.7)
            .with_alibi_slopes(Some(&SLOPES))
            .with_seqused_k(Some(&used));
        let one = varlen_attention_general(
            q.slice_axis(Axis(0), qs),
            k.slice_axis(Axis(0), ks),
            v.slice_axis(Axis(0), ks),
            &alone,
        )
        .unwrap();
        assert_eq!(
            one.output,
            packed.output.slice_axis(Axis(0), qs),
            "segment {s}: packed == alone, bit for bit"
        );
    }
}

#[test]
fn options_gradients_match_finite_differences() {
    let [q, k, v, go] = inputs(47);
    for causal in [false, true] {
        for w in [(-1, -1), (2, 1), (0, 0)] {
            let p = problem(causal, w);
            let fwd = |q: &Array3<f64>, k: &Array3<f64>, v: &Array3<f64>| {
                varlen_attention_general(q.view(), k.view(), v.view(), &p).unwrap()
            };
            let out = fwd(&q, &k, &v);
            let g = varlen_attention_general_backward(
                q.view(),
                k.view(),
                v.view(),
                &p,
                &out,
                go.view(),
            )
            .unwrap();
            attention_fd(
                &format!("options causal={causal} w={w:?}"),
                &q,
                &k,
                &v,
                &go,
                &fwd,
                &g,
            );
            // Keys past seqused_k get no gradient.
            for s in 0..USED.len() {
                let past = Slice::from(CU_K[s] + USED[s]..CU_K[s + 1]);
                assert!(g.grad_k.slice_axis(Axis(0), past).iter().all(|&x| x == 0.0));
            }
        }
    }
}

#[test]
fn bad_options_are_typed_errors() {
    let [q, k, v, _] = inputs(53);
    let run = |p: Varlen<'_>| varlen_attention_general(q.view(), k.view(), v.view(), &p);
    let base = Varlen::cross(&CU_Q, &CU_K, false, 0.9);
    let e = run(base.with_softcap(-1.0)).unwrap_err();
    assert!(e.to_string().starts_with("softcap"), "{e}");
    let e = run(base.with_softcap(f64::NAN)).unwrap_err();
    assert!(e.to_string().starts_with("softcap"), "{e}");
    let e = run(base.with_alibi_slopes(Some(&[0.5; 3]))).unwrap_err();
    assert!(e.to_string().starts_with("alibi_slopes"), "{e}");
    let e = run(base.with_alibi_slopes(Some(&[0.5, f64::INFINITY, 0.5, 0.5]))).unwrap_err();
    assert!(e.to_string().starts_with("alibi_slopes[1]"), "{e}");
    let e = run(base.with_seqused_k(Some(&[1, 1]))).unwrap_err();
    assert!(e.to_string().starts_with("seqused_k"), "{e}");
    let e = run(base.with_seqused_k(Some(&[9, 4, 0, 0, 0]))).unwrap_err();
    assert!(e.to_string().starts_with("seqused_k[1]"), "{e}");
    assert_eq!(e.kind(), "invalid_argument");
}

/// Each planted bug of docs/FAULTS.md W1-W6 moves the output of the tiny
/// case by far more than the formula check's 1e-14 (at least 1e-3: the
/// smallest difference a fault makes here is a probability of a few
/// percent moved onto or off one key of values of order 1).
#[test]
fn each_planted_option_bug_is_caught_by_the_formula_check() {
    let [q, k, v, _] = inputs(41);
    let faults = [
        (Fault::WindowOffByOne, false, (2, 1)),
        (Fault::WindowTopLeft, false, (2, 1)),
        (Fault::WindowAcrossDocuments, true, (3, -1)),
        (Fault::SoftcapAfterMask, true, (1, 0)),
        (Fault::AlibiFromPackStart, false, (-1, -1)),
        (Fault::AlibiWrongSign, false, (-1, -1)),
    ];
    for (fault, causal, w) in faults {
        let p = problem(causal, w);
        let got = varlen_attention_general(q.view(), k.view(), v.view(), &p).unwrap();
        let bad = direct_with(&q, &k, &v, &p, Some(fault));
        let err = (&got.output - &bad)
            .mapv(f64::abs)
            .fold(0.0f64, |a, &b| a.max(b));
        assert!(err > 1e-3, "{fault:?}: {err:e}, not caught");
    }
}
