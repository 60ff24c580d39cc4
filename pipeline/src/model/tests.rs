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
/// over microbatches and the `n_m / N` scaling are right).
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
                // Central difference, step 1e-5: truncation ~h^2 = 1e-10, rounding ~eps/h = 2e-11
                // relative; 1e-7 absolute + 1e-5 relative is a margin chosen over both, not
                // derived.
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

/// The step's loss is the mean over its tokens whatever the microbatching
/// (issue 34, docs/FAULTS.md D1): the `M` microbatches of the tiny model
/// (of unequal token counts) give the loss and every gradient of the same
/// sequences as one microbatch (the varlen attention keeps sequences apart,
/// so only the reduction can differ). The old definition, the mean of the
/// microbatches' means, is off by far more than the tolerance here, so this
/// test catches it.
#[test]
fn the_step_loss_is_the_mean_over_its_tokens_whatever_the_microbatching() {
    let c = ModelConfig::tiny();
    let params = Params::random(&c);
    let mbs = microbatches(&c);
    let counts: Vec<usize> = mbs
        .iter()
        .map(|mb| mb.targets.iter().filter(|&&t| t != IGNORE_INDEX).count())
        .collect();
    assert!(
        counts.iter().any(|&n| n != counts[0]),
        "unequal token counts: {counts:?}"
    );
    let mut one = Microbatch {
        ids: Vec::new(),
        positions: Vec::new(),
        targets: Vec::new(),
        layout: AttentionLayout::Varlen {
            cu_seqlens: vec![0],
        },
    };
    for mb in &mbs {
        let AttentionLayout::Varlen { cu_seqlens } = &mb.layout else {
            panic!("varlen")
        };
        let at = one.len();
        one.ids.extend(&mb.ids);
        one.positions.extend(&mb.positions);
        one.targets.extend(&mb.targets);
        if let AttentionLayout::Varlen { cu_seqlens: all } = &mut one.layout {
            all.extend(cu_seqlens[1..].iter().map(|&x| x + at));
        }
    }
    let split = reference_step(&c, &params, &mbs).unwrap();
    let whole = reference_step(&c, &params, &[one]).unwrap();
    // The same sums in another order: the pipeline judge's tolerance
    // (report::PIPELINE_TOLERANCE, 256 ulp of each tensor's largest value).
    let tol = crate::report::PIPELINE_TOLERANCE;
    assert!((split.loss - whole.loss).abs() <= tol * whole.loss.abs());
    for e in crate::report::compare(&whole.grads, &split.grads) {
        assert!(e.passes(), "{}: relative {:e}", e.name, e.relative());
    }
    // The old definition, (1 / M) Σ_m loss_m, is caught.
    let mean_of_means =
        split.microbatch_losses.iter().sum::<f64>() / split.microbatch_losses.len() as f64;
    assert!(
        (mean_of_means - whole.loss).abs() > 1e3 * tol * whole.loss.abs(),
        "mean of means {mean_of_means} vs {}",
        whole.loss
    );
    // And the weights are n_m / N.
    let total: usize = counts.iter().sum();
    let scales = microbatch_scales(&mbs).unwrap();
    for (s, n) in scales.iter().zip(&counts) {
        assert_eq!(*s, *n as f64 / total as f64);
    }
    let none: Vec<Microbatch> = mbs
        .iter()
        .map(|mb| Microbatch {
            targets: vec![IGNORE_INDEX; mb.len()],
            ..mb.clone()
        })
        .collect();
    let e = microbatch_scales(&none).unwrap_err();
    assert!(e.to_string().starts_with("targets:"), "{e}");
}
