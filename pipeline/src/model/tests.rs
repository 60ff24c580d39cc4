use super::*;

#[test]
fn microbatches_are_deterministic_with_next_token_targets() {
    let c = ModelConfig::tiny();
    let a = microbatches(&c);
    assert_eq!(a, microbatches(&c));
    assert_eq!(a.len(), c.microbatches);
    for mb in &a {
        let AttentionLayout::Varlen { cu_seqlens } = &mb.layout else {
            panic!("varlen")
        };
        assert_eq!(cu_seqlens.len(), c.sequences + 1);
        assert_eq!(*cu_seqlens.last().unwrap(), mb.len());
        for w in cu_seqlens.windows(2) {
            assert!(w[1] - w[0] >= c.seq_len.div_ceil(2) && w[1] - w[0] <= c.seq_len);
            assert_eq!(mb.targets[w[1] - 1], IGNORE_INDEX);
            for t in w[0]..w[1] - 1 {
                assert_eq!(mb.targets[t], mb.ids[t + 1]);
                assert_eq!(mb.positions[t], t - w[0]);
            }
        }
    }
    assert_eq!(a[0].positions.iter().max(), Some(&(c.seq_len - 1)));
}

#[test]
fn stages_are_contiguous_and_cover_every_layer() {
    assert_eq!(stage_layers(5, 2), vec![0..3, 3..5]);
    assert_eq!(stage_layers(5, 4), vec![0..2, 2..3, 3..4, 4..5]);
    assert_eq!(stage_layers(6, 1), vec![0..6]);
}

#[test]
fn validate_names_the_field() {
    let c = ModelConfig::tiny();
    c.validate(5).unwrap();
    let e = c.validate(6).unwrap_err();
    assert!(e.to_string().starts_with("layers:"), "{e}");
    let mut bad = c.clone();
    bad.microbatches = 0;
    assert!(bad
        .validate(1)
        .unwrap_err()
        .to_string()
        .starts_with("microbatches:"));
}

/// The reference step's gradients against central finite differences of
/// its loss, on a few entries of every kind of tensor (so the accumulation
/// over microbatches and the `1 / M` scaling are right).
#[test]
fn reference_gradients_match_finite_differences() {
    let c = ModelConfig {
        vocab: 11,
        hidden: 8,
        heads: 2,
        layers: 2,
        intermediate: 12,
        seq_len: 5,
        sequences: 2,
        microbatches: 3,
        seed: 9,
    };
    let params = Params::random(&c);
    let mbs = microbatches(&c);
    let base = reference_step(&c, &params, &mbs).unwrap();
    let h = 1e-5;
    let names: Vec<String> = params.named().into_iter().map(|(n, _)| n).collect();
    let mut checked = 0;
    for (t, name) in names.iter().enumerate() {
        for k in [0usize, 3] {
            let mut plus = params.clone();
            let mut minus = params.clone();
            let len = plus.named()[t].1.len();
            let k = k % len;
            bump(&mut plus, t, k, h);
            bump(&mut minus, t, k, -h);
            let lp = reference_step(&c, &plus, &mbs).unwrap().loss;
            let lm = reference_step(&c, &minus, &mbs).unwrap().loss;
            let numeric = (lp - lm) / (2.0 * h);
            let analytic = base.grads.named()[t].1.iter().nth(k).copied().unwrap();
            assert!(
                (numeric - analytic).abs() <= 1e-7 + 1e-5 * analytic.abs(),
                "{name}[{k}]: numeric {numeric}, analytic {analytic}"
            );
            checked += 1;
        }
    }
    assert_eq!(checked, 2 * names.len());
    assert!(base.loss > 1.0, "non-degenerate loss {}", base.loss);
}

fn bump(p: &mut Params, tensor: usize, k: usize, h: f64) {
    let mut tensors = p.tensors_mut();
    *tensors[tensor].iter_mut().nth(k).unwrap() += h;
}
