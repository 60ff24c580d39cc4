//! The f32 baseline (`baseline32`) that scales the relative rule is the
//! reference's math in f32: held here to the f64 reference within f32 error,
//! so that a broken baseline (which would loosen or tighten every f32
//! kernel's tolerance) fails in the crate that owns it.

use ndarray::Array2;
use packshard_equivalence::attention::deterministic_f32_cases;
use packshard_equivalence::baseline32::{self, round_f32};
use packshard_reference::attention::ReferenceAttention;
use packshard_reference::vocab::{cross_entropy, LossConfig};
use rand::{Rng, SeedableRng};

/// `max |a - b|` over `max |b|` (1 where `b` is all 0).
fn rel_err<'a>(a: impl IntoIterator<Item = f32>, b: impl IntoIterator<Item = &'a f64>) -> f64 {
    let (mut err, mut scale) = (0.0f64, 0.0f64);
    for (x, &y) in a.into_iter().zip(b) {
        err = err.max((f64::from(x) - y).abs());
        scale = scale.max(y.abs());
    }
    err / scale.max(1.0)
}

#[test]
fn attention_baseline_is_the_reference_in_f32() {
    let mut compared = 0;
    for c in deterministic_f32_cases(200) {
        let cu = c.cu_seqlens();
        let (want, wg) = c.varlen_pass(&ReferenceAttention).unwrap();
        let [q, k, v, go] = c.inputs_f32();
        let scale = c.scale as f32;
        let (out, lse) =
            baseline32::varlen_attention(q.view(), k.view(), v.view(), &cu, false, scale);
        let [gq, gk, gv] = baseline32::varlen_attention_backward(
            q.view(),
            k.view(),
            v.view(),
            &cu,
            false,
            scale,
            out.view(),
            lse.view(),
            go.view(),
        );
        for (name, got, exp) in [
            ("output", &out, &want.output),
            ("grad_q", &gq, &wg.grad_q),
            ("grad_k", &gk, &wg.grad_k),
            ("grad_v", &gv, &wg.grad_v),
        ] {
            let e = rel_err(got.iter().copied(), exp.iter());
            // 1e-4 relative: f32 (unit roundoff 2^-24 = 6e-8) against the f64 reference, ~1700 unit
            // roundoffs for short sums; a margin chosen, not derived.
            assert!(e < 1e-4, "{name}: relative error {e:e}");
        }
        compared += 1;
    }
    assert_eq!(compared, 200);
}

/// The options path (`varlen_attention_options` and its backward, which
/// the causal pipeline's f32 yardstick and `Baseline32Attention` run) on
/// grouped-query, cross-length segments, each of flash-attention's options
/// alone and all together: within f32 error of the f64 reference, so that a
/// baseline that drops or garbles an option (ALiBi's bias multiplied in
/// instead of added, the softcap's chain factor) fails here.
#[test]
fn attention_options_baseline_is_the_reference_in_f32() {
    use ndarray::Array3;
    use packshard_reference::ops::{AttentionOp, Grad, Qkv, Varlen, Window};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
    // Two segments: 5 queries over 9 keys, 7 queries over 4 (bottom-right
    // aligned both ways); 4 query heads over 2 key heads.
    let (cu_q, cu_k) = ([0usize, 5, 12], [0usize, 9, 13]);
    let (h, h_kv, d) = (4, 2, 3);
    let mut draw = |n: usize, heads: usize| {
        Array3::from_shape_fn((n, heads, d), |_| round_f32(rng.random_range(-1.5..1.5)))
    };
    let (q, k, v, go) = (draw(12, h), draw(13, h_kv), draw(13, h_kv), draw(12, h));
    let slopes = [0.5, 0.25, 0.125, 0.0625];
    let used = [6usize, 4];
    let base = Varlen::cross(&cu_q, &cu_k, false, 0.6);
    let window = Window {
        left: Some(2),
        right: Some(1),
    };
    let problems = [
        ("plain", base),
        (
            "causal",
            Varlen {
                causal: true,
                ..base
            },
        ),
        ("window", base.with_window(window)),
        ("softcap", base.with_softcap(0.75)),
        ("alibi", base.with_alibi_slopes(Some(&slopes))),
        ("seqused_k", base.with_seqused_k(Some(&used))),
        (
            "all",
            Varlen {
                causal: true,
                ..base
            }
            .with_window(window)
            .with_softcap(0.75)
            .with_alibi_slopes(Some(&slopes))
            .with_seqused_k(Some(&used)),
        ),
    ];
    let f32s = |x: &Array3<f64>| x.mapv(|y| y as f32);
    for (what, p) in problems {
        let x = Qkv::new(q.view(), k.view(), v.view());
        let want = ReferenceAttention.varlen_forward(x, &p).unwrap();
        let wg = ReferenceAttention
            .varlen_backward(x, &p, Grad::new(&want, go.view()))
            .unwrap();
        let [q32, k32, v32, go32] = [&q, &k, &v, &go].map(f32s);
        let (out, lse) =
            baseline32::varlen_attention_options(q32.view(), k32.view(), v32.view(), &p);
        let [gq, gk, gv] = baseline32::varlen_attention_options_backward(
            (q32.view(), k32.view(), v32.view()),
            &p,
            (out.view(), lse.view()),
            go32.view(),
        );
        for (name, got, exp) in [
            ("output", &out, &want.output),
            ("grad_q", &gq, &wg.grad_q),
            ("grad_k", &gk, &wg.grad_k),
            ("grad_v", &gv, &wg.grad_v),
        ] {
            let e = rel_err(got.iter().copied(), exp.iter());
            // As the plain test's 1e-4 (a margin of ~1700 f32 unit roundoffs; a
            // garbled option is off by O(1)).
            assert!(e < 1e-4, "{what}: {name}: relative error {e:e}");
        }
        // A query with no visible key has lse -inf in both; the rest compared.
        let pairs: Vec<(f32, &f64)> = lse.iter().copied().zip(want.lse.iter()).collect();
        for &(g, w) in &pairs {
            assert_eq!(g.is_finite(), w.is_finite(), "{what}: lse {g} against {w}");
        }
        let finite = pairs.iter().filter(|(_, w)| w.is_finite());
        let e = rel_err(finite.clone().map(|p| p.0), finite.map(|p| p.1));
        assert!(e < 1e-4, "{what}: lse: relative error {e:e}");
    }
}

#[test]
fn cross_entropy_baseline_is_the_reference_in_f32() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
    for trial in 0..50 {
        let (n, v) = (1 + trial % 7, 2 + trial % 13);
        let logits = Array2::from_shape_fn((n, v), |_| round_f32(rng.random_range(-8.0..8.0)));
        let targets: Vec<i64> = (0..n)
            .map(|i| {
                if i == 0 && trial % 3 == 0 {
                    -100
                } else {
                    rng.random_range(0..v as i64)
                }
            })
            .collect();
        let config = LossConfig {
            label_smoothing: if trial % 2 == 0 { 0.0 } else { 0.1 },
            z_loss: if trial % 4 == 1 { 1e-3 } else { 0.0 },
            ..LossConfig::default()
        };
        let call = packshard_reference::vocab::LossCall::with_flag(&targets, &config, true);
        let want = cross_entropy(logits.view(), &call).unwrap();
        let got = baseline32::cross_entropy(logits.mapv(|x| x as f32).view(), &call);
        let lse = want.logsumexp();
        for (name, e) in [
            ("loss", rel_err([got.loss], [&want.loss])),
            (
                "per_token_loss",
                rel_err(
                    got.per_token_loss.iter().copied(),
                    want.per_token_loss.iter(),
                ),
            ),
            (
                "logsumexp",
                rel_err(got.logsumexp.iter().copied(), lse.iter()),
            ),
            (
                "grad_logits",
                rel_err(
                    got.grad_logits.as_ref().unwrap().iter().copied(),
                    want.grad_logits.as_ref().unwrap().iter(),
                ),
            ),
        ] {
            // 1e-5 relative: ~170 unit roundoffs of f32 (2^-24) for f32 row statistics over a few
            // dozen logits; a margin chosen, not derived.
            assert!(e < 1e-5, "trial {trial}: {name}: relative error {e:e}");
        }
    }
}

/// The layer baseline (LayerNorm, GELU and the attention in f32) against the
/// f64 reference layer on f32-representable inputs: output, `grad_x` and
/// the LayerNorm parameters' gradients within f32 error.
#[test]
fn layer_baseline_is_the_reference_in_f32() {
    use packshard_equivalence::bert::round_layer;
    use packshard_reference::attention::ReferenceAttention;
    use packshard_reference::bert::layer::ReferenceLayer;
    use packshard_reference::bert::{AttentionLayout, BertConfig, BertModel};
    use packshard_reference::ops::{EncoderLayerOp, Layer, LayerInput};

    for (seed, lengths) in [(1u64, vec![3usize, 5]), (2, vec![7, 1, 4])] {
        let config = BertConfig::tiny(9, 8, 2, 1, 12, 16);
        let params = BertModel::random(config.clone(), seed)
            .unwrap()
            .params
            .layers
            .remove(0);
        let params = round_layer(&params, round_f32);
        let n: usize = lengths.iter().sum();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let mut draw = |_| round_f32(2.0 * rng.random::<f64>() - 1.0);
        let x = Array2::from_shape_fn((n, 8), &mut draw);
        let go = Array2::from_shape_fn((n, 8), &mut draw);
        let cu = packshard_equivalence::cu_seqlens_of(lengths.iter().copied());
        let layout = AttentionLayout::Varlen {
            cu_seqlens: cu.clone(),
        };
        let eps = config.layer_norm_eps;
        let want = ReferenceLayer(ReferenceAttention)
            .forward_backward(
                Layer::new(&params, 2, eps),
                LayerInput::new(x.view(), &layout, go.view()),
            )
            .unwrap();
        let (x32, go32) = (x.mapv(|v| v as f32), go.mapv(|v| v as f32));
        let (out, dx, g) =
            baseline32::layer_forward_backward(&params, 2, eps, x32.view(), &cu, go32.view());
        for (name, got, exp) in [
            ("output", &out, &want.output),
            ("grad_x", &dx, &want.grad_x),
        ] {
            let e = rel_err(got.iter().copied(), exp.iter());
            // 1e-4 relative: as for attention above, f32 against the f64 reference; a margin
            // chosen, not derived.
            assert!(e < 1e-4, "{name}: relative error {e:e}");
        }
        let flat = |a: &ndarray::Array1<f64>| a.to_vec();
        for (name, got, exp) in [
            ("attn_ln_g", flat(&g.attn_ln_g), flat(&want.grads.attn_ln_g)),
            ("attn_ln_b", flat(&g.attn_ln_b), flat(&want.grads.attn_ln_b)),
            ("out_ln_g", flat(&g.out_ln_g), flat(&want.grads.out_ln_g)),
            (
                "query_w",
                g.query_w.iter().copied().collect(),
                want.grads.query_w.iter().copied().collect(),
            ),
        ] {
            let e = rel_err(got.iter().map(|&v| v as f32), exp.iter());
            // 1e-4 relative: as above; f32 against the f64 reference, a margin chosen, not derived.
            assert!(e < 1e-4, "{name}: relative error {e:e}");
        }
    }
}
