use super::*;
use crate::core::{attention, cross_entropy_with};
use ndarray::{Array2, Array3, ArrayD};
use packshard_oracle::registry;
use packshard_reference::vocab::LossConfig;

/// A hand-built case that crosses 64-key tiles: segments of 70 and 5 tokens
/// (and an empty one), 2 heads of dim 3, values with no common pattern.
pub(crate) fn case() -> (Array3<f64>, Vec<usize>) {
    let q = Array3::from_shape_fn((75, 2, 3), |(i, h, c)| {
        ((i * 37 + h * 11 + c * 5) % 23) as f64 / 7.0 - 1.5
    });
    (q, vec![0, 70, 70, 75])
}

pub(crate) fn args<'a>(q: &'a Array3<f64>, cu: &[usize]) -> AttentionArgs<'a> {
    AttentionArgs {
        q: q.view(),
        k: q.view(),
        v: q.view(),
        cu_seqlens: cu.to_vec(),
        cu_seqlens_k: None,
        causal: true,
        scale: None,
        grad_output: Some(q.view()),
        options: Default::default(),
    }
}

/// `fields` with `value` added at flat element `at` of tensor `name`.
fn perturbed(fields: &Fields, name: &str, at: usize, value: f64) -> Fields {
    fields
        .iter()
        .map(|(k, v)| match v {
            Out::Tensor(t) if *k == name => {
                let mut t: ArrayD<f64> = t.clone();
                t.as_slice_mut().unwrap()[at] += value;
                (*k, Out::Tensor(t))
            }
            _ => (*k, v.clone()),
        })
        .collect()
}

#[test]
fn a_built_attention_case_passes_with_the_kernels_outputs_and_fails_perturbed() {
    let (q, cu) = case();
    let a = args(&q, &cu);
    // The registered f32 kernel's own outputs: within the f32 rule.
    let got = attention("attention_varlen_tiled", &a).unwrap();
    let r = judge_attention(&a, &got, KernelPrecision::F32).unwrap();
    assert!(r.passed(), "{r}");
    let names: Vec<&str> = r.tensors.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["output", "lse", "grad_q", "grad_k", "grad_v"]);
    assert!(r.worst_share() > 0.0 && r.worst_share() <= 1.0, "{r}");
    // One value of grad_k off by 0.5: the rule allows 32 x an f32 baseline
    // error of ~1e-6 plus a floor of 256 ulp of f32 of the running bound of
    // grad_k's sums (~2000 for a 70-key segment: ~0.06).
    let at = 40 * 6 + 3 + 1; // token 40, head 1, component 1 of [75, 2, 3]
    let bad = perturbed(&got, "grad_k", at, 0.5);
    let r = judge_attention(&a, &bad, KernelPrecision::F32).unwrap();
    assert!(!r.passed());
    let t = r.tensors.iter().find(|t| t.name == "grad_k").unwrap();
    assert!(!t.passed() && t.verdict.share > 1.0, "{r}");
    assert_eq!(t.verdict.index, vec![40, 1, 1]);
    let expected = tensor_of(&got, "grad_k").unwrap().as_slice().unwrap()[at];
    // The planted +0.5 read back in f64 on values of order 1: exact up to a few ulps (~1e-16), 1e-9
    // is a margin chosen, not derived.
    assert!((t.verdict.actual - expected - 0.5).abs() < 1e-9);
    // The verdict's expected value is the f64 reference on the case rounded to f32, `expected` the
    // f32 kernel's: their gap is the kernel's f32 error; 1e-4 is a margin chosen, not derived.
    assert!((t.verdict.expected - expected).abs() < 1e-4);
    assert!(t.verdict.allowed < 0.1, "{r}");
    assert!(r.tensors.iter().filter(|t| t.passed()).count() == 4, "{r}");
    let text = r.to_string();
    assert!(text.starts_with("FAIL") && text.contains("grad_k") && text.contains("[40, 1, 1]"));
}

#[test]
fn bf16_storage_allows_bf16_rounding_of_the_results_and_no_more() {
    let (q, cu) = case();
    let a = args(&q, &cu);
    // The reference's outputs on bf16 inputs, stored in bf16: a correct
    // bf16 kernel up to its f32 arithmetic.
    let rounded = q.mapv(packshard_reference::precision::round_bf16);
    let ra = args(&rounded, &cu);
    let exact = attention(registry::REFERENCE, &ra).unwrap();
    let stored: Fields = exact
        .iter()
        .map(|(k, v)| match v {
            Out::Tensor(t) => (*k, Out::Tensor(t.mapv(|x| KernelPrecision::Bf16.round(x)))),
            _ => (*k, v.clone()),
        })
        .collect();
    let r = judge_attention(&a, &stored, KernelPrecision::Bf16).unwrap();
    assert!(r.passed(), "{r}");
    // The same outputs under the f32 rule: bf16 storage is far beyond it.
    let r32 = judge_attention(&a, &stored, KernelPrecision::F32).unwrap();
    assert!(!r32.passed(), "{r32}");
    // And a bug a bf16 kernel could hide behind its rounding does not hide:
    // output off by 0.1 (25 bf16 unit roundoffs of a value of size ~1).
    let bad = perturbed(&stored, "output", 7, 0.1);
    let r = judge_attention(&a, &bad, KernelPrecision::Bf16).unwrap();
    assert!(!r.passed(), "{r}");
}

#[test]
fn a_built_loss_case_passes_and_fails_perturbed_and_needs_its_loss() {
    let logits = Array2::from_shape_fn((9, 1030), |(i, j)| {
        ((i * 131 + j * 17) % 41) as f64 / 5.0 - 4.0
    });
    let targets: Vec<i64> = vec![3, 1029, -100, 0, 512, 1024, 7, -100, 1000];
    let a = LossArgs {
        targets,
        config: LossConfig {
            label_smoothing: 0.1,
            ..LossConfig::default()
        },
        vocab_size: None,
        num_shards: None,
        algorithm: None,
        layout: None,
        want_grad: true,
        grad_output: None,
    };
    let got = cross_entropy_with("cross_entropy_f32", logits.view(), &a).unwrap();
    let r = judge_loss(Some(logits.view()), None, &a, &got, KernelPrecision::F32).unwrap();
    assert!(r.passed(), "{r}");
    assert!(r
        .tensors
        .iter()
        .any(|t| t.name == "loss" && t.shape.is_empty()));
    // Token 5's gradient at the last vocabulary entry, off by 1e-4 (the
    // gradient's entries are at most 1 / 7 here; the allowance ~1e-9).
    let bad = perturbed(&got, "grad_logits", 5 * 1030 + 1029, 1e-4);
    let r = judge_loss(Some(logits.view()), None, &a, &bad, KernelPrecision::F32).unwrap();
    let t = r.tensors.iter().find(|t| t.name == "grad_logits").unwrap();
    assert!(!r.passed() && t.verdict.index == vec![5, 1029], "{r}");
    // Without the loss the case fails, whatever else is right.
    let partial: Fields = got.into_iter().filter(|(k, _)| *k != "loss").collect();
    let r = judge_loss(
        Some(logits.view()),
        None,
        &a,
        &partial,
        KernelPrecision::F32,
    )
    .unwrap();
    assert!(!r.passed() && r.missing.is_some(), "{r}");
}
