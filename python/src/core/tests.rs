use super::*;
use ndarray::Array3;

#[test]
fn fields_are_read_from_messages() {
    assert_eq!(
        field_of("cu_seqlens[3]: decreases"),
        (Some("cu_seqlens".into()), Some(3))
    );
    assert_eq!(
        field_of("ids[2] = 9 is out of range 0..5"),
        (Some("ids".into()), Some(2))
    );
    assert_eq!(
        field_of("q: shape [1] does not match"),
        (Some("q".into()), None)
    );
    assert_eq!(field_of("a case must be a JSON object"), (None, None));
}

#[test]
fn tiled_attention_is_within_the_rule_and_a_leak_is_not() {
    let n = 7;
    let q = Array3::from_shape_fn((n, 2, 3), |(i, h, c)| {
        ((i * 7 + h * 3 + c) % 5) as f64 - 2.0
    });
    let cu = vec![0, 3, 3, 7];
    let a = AttentionArgs {
        q: q.view(),
        k: q.view(),
        v: q.view(),
        cu_seqlens: cu,
        causal: false,
        scale: None,
        grad_output: Some(q.view()),
    };
    let j = attention_judged(&a, KernelPrecision::F32).unwrap();
    let got = attention("attention_varlen_tiled", &a).unwrap();
    let base = j.baseline.unwrap();
    // Tensor `name` of `got` held to the f32 rule against the reference.
    let judge = |name: &str, got: &Fields| {
        let e = tensor_of(&j.expected, name).unwrap();
        let b = tensor_of(&base, name).unwrap();
        let g = tensor_of(got, name).unwrap();
        judge_tensor(
            name,
            e.shape(),
            e.as_slice().unwrap(),
            Some(b.as_slice().unwrap()),
            g.as_slice().unwrap(),
            KernelPrecision::F32,
            None,
        )
    };
    for name in ["output", "lse", "grad_q", "grad_k", "grad_v"] {
        let v = judge(name, &got);
        assert!(v.failure.is_none(), "{name}: {:?}", v.failure);
    }
    // One segment over everything: attention across documents.
    let leak = AttentionArgs {
        cu_seqlens: vec![0, 7],
        ..a.clone()
    };
    let bad = attention(registry::REFERENCE, &leak).unwrap();
    let v = judge("output", &bad);
    assert!(v.failure.unwrap().contains("output"));
}
