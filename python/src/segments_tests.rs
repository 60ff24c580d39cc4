use super::*;
use crate::core::{attention, attention_judged, tensor_of, Fields, Out};

// The judge's hand-built case: segments of 70 and 5 tokens (and an empty
// one between), 2 heads of dim 3, causal self-attention; the long segment's
// sums have ~14x the terms of the short one's.
use crate::judge::tests::{args, case};

fn flat(f: &Fields, name: &str) -> Vec<f64> {
    tensor_of(f, name)
        .expect("a result")
        .iter()
        .copied()
        .collect()
}

fn terms(f: &Fields) -> Value {
    match f.iter().find(|(k, _)| *k == "terms") {
        Some((_, Out::Json(j))) => j.clone(),
        _ => panic!("no terms"),
    }
}

#[test]
fn rows_along_an_axis_are_their_flat_indices() {
    // [2, 5, 3], rows 1..3 of axis 1: in each of the 2 outer blocks of 15,
    // elements 3..9.
    let want: Vec<usize> = (3..9).chain(18..24).collect();
    assert_eq!(indices(&[2, 5, 3], 1, 1..3), want);
    assert_eq!(indices(&[4, 2], 0, 3..4), vec![6, 7]);
    assert!(indices(&[4, 2], 0, 2..2).is_empty());
}

/// An error in the short segment that its own terms do not allow, but the
/// long segment's would: judged per segment it fails, naming the segment;
/// judged as one tensor under the largest terms (the rule before) it passed.
#[test]
fn a_short_segment_is_judged_by_its_own_terms_not_the_long_ones() {
    let (q, cu) = case();
    let a = args(&q, &cu);
    let j = attention_judged(&a, KernelPrecision::F32).unwrap();
    let t = terms(&j.expected);
    let got = attention("attention_varlen_tiled", &a).unwrap();
    let shape = [75, 2, 3];
    let (e, b) = (
        flat(&j.expected, "output"),
        flat(j.baseline.as_ref().unwrap(), "output"),
    );
    let mut x = flat(&got, "output");
    let p = KernelPrecision::F32;
    // The kernel's own outputs pass either way.
    let ok = judge_result("output", &shape, &e, Some(&b), &x, p, Some(&t));
    assert!(ok.failure.is_none(), "{ok:?}");
    // What each rule allows at the short segment's rows.
    let rows = indices(&shape, 0, 70..75);
    let pick = |v: &[f64]| rows.iter().map(|&i| v[i]).collect::<Vec<f64>>();
    let short_terms = t["segments"]["output"][2].as_f64().unwrap();
    let short = judge_tensor(
        "o",
        &[5, 2, 3],
        &pick(&e),
        Some(&pick(&b)),
        &pick(&x),
        p,
        Some(short_terms),
    );
    let whole_scale = t["output"].as_f64().unwrap();
    let whole = judge_tensor("o", &shape, &e, Some(&b), &x, p, Some(whole_scale));
    assert!(
        whole.allowed > 4.0 * short.allowed,
        "{} vs {}",
        whole.allowed,
        short.allowed
    );
    // Token 72, head 1, component 2, off by the geometric mean of the two.
    let at = 72 * 6 + 3 + 2;
    x[at] += (whole.allowed * short.allowed).sqrt();
    let before = judge_tensor("output", &shape, &e, Some(&b), &x, p, Some(whole_scale));
    assert!(
        before.failure.is_none(),
        "the whole-tensor rule allows it: {before:?}"
    );
    let v = judge_result("output", &shape, &e, Some(&b), &x, p, Some(&t));
    let text = v.failure.as_deref().expect("judged per segment, it fails");
    assert!(text.contains("segment 2, rows 70..75"), "{text}");
    assert_eq!(v.index, vec![72, 1, 2], "the index in the whole tensor");
    assert!(v.share > 1.0 && v.error >= (whole.allowed * short.allowed).sqrt() * 0.99);
}

/// `lse: [h, n]` splits along its columns: an error at the short segment's
/// last column, head 0, is found there.
#[test]
fn lse_is_split_along_its_token_axis() {
    let (q, cu) = case();
    let a = args(&q, &cu);
    let j = attention_judged(&a, KernelPrecision::F32).unwrap();
    let t = terms(&j.expected);
    let (e, b) = (
        flat(&j.expected, "lse"),
        flat(j.baseline.as_ref().unwrap(), "lse"),
    );
    let mut x = e.clone();
    x[74] += 0.05; // head 0, token 74: far past either allowance
    let v = judge_result(
        "lse",
        &[2, 75],
        &e,
        Some(&b),
        &x,
        KernelPrecision::F32,
        Some(&t),
    );
    assert!(
        v.failure.as_deref().unwrap_or("").contains("segment 2"),
        "{v:?}"
    );
    assert_eq!(v.index, vec![0, 74]);
}

/// Results that are not attention's, and terms without segments, are judged
/// whole under the terms of their name, as before.
#[test]
fn other_results_and_terms_without_segments_are_judged_whole() {
    let e = vec![1.0, 2.0, 3.0];
    let x = vec![1.0, 2.0, 3.5];
    let t = serde_json::json!({"loss": 1e6, "output": 1e6});
    for name in ["loss", "output"] {
        let seg = judge_result(name, &[3], &e, None, &x, KernelPrecision::F64, Some(&t));
        let whole = judge_tensor(name, &[3], &e, None, &x, KernelPrecision::F64, Some(1e6));
        assert_eq!(seg, whole, "{name}");
    }
}
