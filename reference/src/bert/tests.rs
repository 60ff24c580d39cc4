//! Gradient checks by central finite differences ([`crate::testutil`]), P8
//! rows, and small facts.

use ndarray::{Array1, Array2, ArrayViewMutD};

use super::ops::{gelu, gelu_grad};
use super::*;
use crate::error::Error;
use crate::packing::{Algorithm, PackedBatch, PackingConfig};
use crate::testutil::fd_check;

fn tiny() -> BertConfig {
    BertConfig::tiny(11, 8, 2, 2, 16, 12)
}

fn sequences() -> Vec<Vec<i64>> {
    vec![vec![1, 2, 3, 4], vec![], vec![5, 6], vec![7, 8, 9, 10, 2]]
}

fn targets() -> Targets {
    Targets {
        mlm_labels: vec![
            vec![-100, 7, -100, 3],
            vec![],
            vec![4, -100],
            vec![-100, 1, 2, -100, 9],
        ],
        nsp_labels: vec![1, -100, 0, 1],
    }
}

fn token_types() -> Vec<Vec<i64>> {
    vec![vec![0, 0, 1, 1], vec![], vec![0, 1], vec![0, 0, 0, 1, 1]]
}

fn batches() -> Vec<(&'static str, TokenBatch)> {
    let seqs = sequences();
    let tt = token_types();
    let config = PackingConfig::new(Algorithm::Spfhp, 6);
    let (_, packed) = PackedBatch::from_sequences(&seqs, &config, 0, 1).unwrap();
    vec![
        (
            "padded",
            TokenBatch::padded(&seqs, Some(&tt), 6, 0, 1).unwrap(),
        ),
        (
            "packed varlen",
            TokenBatch::packed(&packed, seqs.len(), Some(&tt), PackedAttention::Varlen).unwrap(),
        ),
        (
            "packed block-diagonal",
            TokenBatch::packed(
                &packed,
                seqs.len(),
                Some(&tt),
                PackedAttention::BlockDiagonal,
            )
            .unwrap(),
        ),
    ]
}

#[test]
fn every_parameter_gradient_matches_finite_differences() {
    let model = BertModel::random(tiny(), 7).unwrap();
    let t = targets();
    let mut checked = 0;
    let mut worst = 0.0f64;
    for reduction in Reduction::ALL {
        let w = LossWeights::new(&t, reduction);
        for (name, batch) in batches() {
            let out = model.run(&batch, &t, &w, true).unwrap();
            assert!(
                out.mlm_loss > 0.1 && out.nsp_loss > 0.1,
                "non-degenerate losses"
            );
            let grads = out.grads.unwrap();
            let g_named = grads.named();
            let mut perturbed = model.clone();
            let names: Vec<String> = model.params.named().into_iter().map(|(n, _)| n).collect();
            for (k, pname) in names.iter().enumerate() {
                let g: Vec<f64> = g_named[k].1.iter().copied().collect();
                assert!(
                    g.iter().any(|v| *v != 0.0),
                    "{name}: gradient of {pname} is all zero: the check would be vacuous"
                );
                let base = perturbed.clone();
                let mut f = |x: &ArrayViewMutD<f64>| {
                    let mut m = base.clone();
                    m.params.named_mut()[k].1.assign(x);
                    m.run(&batch, &t, &w, false).unwrap().loss
                };
                let mut view = perturbed.params.named_mut().remove(k).1;
                worst = worst.max(fd_check(
                    &format!("{name} {} {pname}", reduction.name()),
                    view.view_mut(),
                    &g,
                    &mut f,
                ));
                checked += 1;
            }
        }
    }
    // 5 embedding tensors + 16 per layer x 2 + 9 head tensors, 3 layouts, 2 reductions.
    assert_eq!(checked, (5 + 16 * 2 + 9) * 3 * 2);
    eprintln!("parameter gradients: worst |fd - analytic| = {worst:e}");
}

#[test]
fn input_embedding_gradient_matches_finite_differences() {
    let model = BertModel::random(tiny(), 11).unwrap();
    let t = targets();
    let w = LossWeights::new(&t, Reduction::PerSequence);
    for (name, batch) in batches() {
        let mut e = Array2::from_shape_fn((batch.num_tokens(), 8), |(i, j)| {
            model.params.word_embeddings[[batch.input_ids[i], j]]
        });
        let out = model
            .run_with(&ReferenceAttention, &batch, &t, &w, true, Some(&e))
            .unwrap();
        // Scatter the per-sequence gradients back onto the slots (padding: 0).
        let mut g = Array2::<f64>::zeros(e.dim());
        for (s, slots) in batch.sequences.iter().enumerate() {
            let gs = out.sequences[s].grad_inputs_embeds.as_ref().unwrap();
            for (t, &i) in slots.iter().enumerate() {
                g.row_mut(i).assign(&gs.row(t));
            }
        }
        let gv: Vec<f64> = g.iter().copied().collect();
        let e0 = e.clone();
        let mut f = |x: &ArrayViewMutD<f64>| {
            let x2 = x.to_owned().into_dimensionality().unwrap();
            model
                .run_with(&ReferenceAttention, &batch, &t, &w, false, Some(&x2))
                .unwrap()
                .loss
        };
        let mut ev = e.view_mut().into_dyn();
        fd_check(&format!("{name} inputs_embeds"), ev.view_mut(), &gv, &mut f);
        assert_eq!(e, e0);
    }
}

#[test]
fn gelu_is_the_exact_erf_form() {
    // x * Phi(x) with Phi(1) = 0.841344746068542948..., Phi(-1) = 1 - Phi(1).
    assert!((gelu(1.0) - 0.841_344_746_068_543).abs() < 1e-15);
    assert!((gelu(-1.0) + 0.158_655_253_931_457).abs() < 1e-15);
    assert_eq!(gelu(0.0), 0.0);
    // The tanh approximation differs at x = 1 by ~1.6e-4: not what we compute.
    let tanh_form = 0.5 * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (1.0 + 0.044715)).tanh());
    assert!((gelu(1.0) - tanh_form).abs() > 1e-5);
    for x in [-3.0, -0.5, 0.3, 2.0] {
        let fd = (gelu(x + 1e-6) - gelu(x - 1e-6)) / 2e-6;
        assert!((fd - gelu_grad(x)).abs() < 1e-8, "gelu'({x})");
    }
}

#[test]
fn padded_and_packed_model_agree_and_losses_follow_the_reduction() {
    let model = BertModel::random(tiny(), 3).unwrap();
    let t = targets();
    let counts = t.mlm_counts();
    assert_eq!(counts, vec![2, 0, 1, 3]);
    for reduction in Reduction::ALL {
        let w = LossWeights::new(&t, reduction);
        let outs: Vec<BertOutput> = batches()
            .iter()
            .map(|(_, b)| model.run(b, &t, &w, true).unwrap())
            .collect();
        let per_token: Vec<Vec<f64>> = outs[0]
            .sequences
            .iter()
            .map(|s| s.mlm_losses.clone())
            .collect();
        // Per-token mean over 6 tokens, or mean over 3 sequences of their means.
        let flat: Vec<f64> = per_token.iter().flatten().copied().collect();
        let want = match reduction {
            Reduction::PerToken => flat.iter().sum::<f64>() / 6.0,
            Reduction::PerSequence => {
                ((per_token[0][0] + per_token[0][1]) / 2.0
                    + per_token[2][0]
                    + (per_token[3][0] + per_token[3][1] + per_token[3][2]) / 3.0)
                    / 3.0
            }
        };
        // The same f64 mean of 3 terms in another order on losses of order 1: a few ulps (~1e-16);
        // 1e-14 is a margin chosen, not derived.
        assert!((outs[0].mlm_loss - want).abs() < 1e-14);
        assert!((outs[0].mlm_loss_under(reduction) - want).abs() < 1e-14);
        for o in &outs[1..] {
            // Packed against padded: the same f64 sums, other order; 1e-13 relative is a margin
            // chosen over a few ulps, not derived.
            assert!((o.loss - outs[0].loss).abs() <= 1e-13 * outs[0].loss.abs());
            for (a, b) in o.sequences.iter().zip(&outs[0].sequences) {
                assert_eq!(a.hidden.dim(), b.hidden.dim());
                for (x, y) in a.hidden.iter().zip(&b.hidden) {
                    // Hidden states through the layers, packed against padded in f64: 1e-12
                    // absolute on values of order 1, a margin chosen, not derived.
                    assert!((x - y).abs() < 1e-12);
                }
            }
        }
    }
    // The empty sequence has no rows and no pooled output.
    let o = model.encode(&batches()[0].1).unwrap();
    assert_eq!(o.sequences[1].hidden.dim(), (0, 8));
    assert!(o.sequences[1].pooled.is_none());
    assert!(o.sequences[0].pooled.is_some());
}

#[test]
fn bad_model_inputs_are_typed_errors() {
    let model = BertModel::random(tiny(), 3).unwrap();
    let b = TokenBatch::padded(&[vec![1, 11]], None, 4, 0, 0).unwrap();
    let e = model.encode(&b).unwrap_err();
    assert_eq!(e.kind(), "index_out_of_range");
    assert!(e.to_string().contains("input_ids[1] = 11"), "{e}");
    let e = TokenBatch::padded(&[vec![1, 2, 3]], None, 2, 0, 0).unwrap_err();
    assert_eq!(e.kind(), "sequence_too_long");
    // Positions past max_position_embeddings (12).
    let b = TokenBatch::padded(&[vec![1]], None, 4, 0, 10).unwrap();
    let e = model.encode(&b).unwrap_err();
    assert!(e.to_string().contains("position_ids[2] = 12"), "{e}");
    // A label on an empty sequence's NSP, or a label outside the vocabulary.
    let b = TokenBatch::padded(&[vec![1], vec![]], None, 2, 0, 0).unwrap();
    let t = Targets {
        mlm_labels: vec![vec![-100], vec![]],
        nsp_labels: vec![0, 1],
    };
    let e = model
        .run(&b, &t, &LossWeights::new(&t, Reduction::PerToken), false)
        .unwrap_err();
    assert!(e.to_string().contains("nsp_labels[1]"), "{e}");
    let t = Targets {
        mlm_labels: vec![vec![11], vec![]],
        nsp_labels: vec![0, -100],
    };
    let e = model
        .run(&b, &t, &LossWeights::new(&t, Reduction::PerToken), false)
        .unwrap_err();
    assert!(e.to_string().contains("mlm_labels[0][0] = 11"), "{e}");
    // Split sequences cannot be run as BERT sequences.
    let config =
        PackingConfig::new(Algorithm::Spfhp, 2).with_overlong(crate::packing::Overlong::Split);
    let (_, packed) = PackedBatch::from_sequences(&[vec![1, 2, 3]], &config, 0, 0).unwrap();
    let e = TokenBatch::packed(&packed, 1, None, PackedAttention::Varlen).unwrap_err();
    assert!(e.to_string().contains("more than one segment"), "{e}");
    // Configs.
    let refused = |c: BertConfig| c.validate().unwrap_err().to_string();
    let mut c = tiny();
    c.num_attention_heads = 3;
    let e = refused(c);
    assert!(e.contains("num_attention_heads"), "{e}");
    // The parameter count is exact and bounded before anything is allocated.
    assert_eq!(
        tiny().num_parameters(),
        BertParams::zeros(&tiny()).num_values()
    );
    let mut huge = tiny();
    huge.vocab_size = 1 << 22;
    huge.hidden_size = 1 << 16;
    huge.num_attention_heads = 1;
    let e = refused(huge);
    assert!(e.contains("parameters"), "{e}");
    let e = BertConfig::from_json("config.json", r#"{"vocab_size": 5}"#).unwrap_err();
    assert_eq!(e.kind(), "invalid_argument");
}

#[test]
fn safetensors_round_trip_and_missing_heads_are_seeded() {
    use safetensors::tensor::{serialize, TensorView};
    let config = tiny();
    let src = BertParams::random(&config, 5);
    // Store the encoder (not the heads) as f32, with HF names, like MiniLM.
    let mut bufs: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, t) in src.named() {
        if weights::is_pretraining_head(&name) {
            continue;
        }
        let bytes: Vec<u8> = t.iter().flat_map(|&v| (v as f32).to_le_bytes()).collect();
        bufs.push((name, t.shape().to_vec(), bytes));
    }
    let views: Vec<(String, TensorView)> = bufs
        .iter()
        .map(|(n, s, b)| {
            (
                n.clone(),
                TensorView::new(safetensors::Dtype::F32, s.clone(), b).unwrap(),
            )
        })
        .collect();
    let bytes = serialize(views, None).unwrap();
    let (p, init) = BertParams::from_safetensors(&config, &bytes, 42).unwrap();
    assert_eq!(init.len(), 7, "{init:?}");
    assert!(init.iter().all(|n| n.starts_with("cls.")));
    assert_eq!(
        p.word_embeddings[[3, 2]],
        src.word_embeddings[[3, 2]] as f32 as f64
    );
    assert_eq!(p.pooler_w, src.pooler_w.mapv(|v| v as f32 as f64));
    assert!(p.mlm_ln_g.iter().all(|&g| g == 1.0) && p.mlm_bias.iter().all(|&b| b == 0.0));
    let std = (p.mlm_dense_w.iter().map(|x| x * x).sum::<f64>() / 64.0).sqrt();
    assert!(
        std > 0.01 && std < 0.03,
        "initializer_range 0.02, got {std}"
    );
    // Deterministic in the seed.
    let (p2, _) = BertParams::from_safetensors(&config, &bytes, 42).unwrap();
    assert_eq!(p, p2);
    let (p3, _) = BertParams::from_safetensors(&config, &bytes, 43).unwrap();
    assert_ne!(p.nsp_w, p3.nsp_w);
    // A wrong shape names the tensor.
    let mut c2 = config.clone();
    c2.intermediate_size = 17;
    let e = BertParams::from_safetensors(&c2, &bytes, 42).unwrap_err();
    assert_eq!(e.kind(), "shape_mismatch");
    assert!(
        e.to_string()
            .contains("encoder.layer.0.intermediate.dense.weight"),
        "{e}"
    );
    let e = BertParams::from_safetensors(&config, b"not a file", 42).unwrap_err();
    assert_eq!(e.kind(), "invalid_argument");
}

#[test]
fn layer_shape_check_names_the_tensor_that_does_not_fit() {
    let p = BertParams::random(&tiny(), 3).layers.remove(0);
    assert!(p.check_shapes().is_ok());
    assert_eq!((p.hidden(), p.intermediate()), (8, 16));
    // A wrong intermediate bias, then a wrong output weight: each named.
    let mut bad = p.clone();
    bad.inter_b = Array1::zeros(15);
    match bad.check_shapes() {
        Err(Error::ShapeMismatch {
            field,
            expected,
            actual,
        }) => {
            assert_eq!(field, "intermediate.dense.bias");
            assert_eq!((expected.as_str(), actual), ("[16]", vec![15]));
        }
        other => panic!("{other:?}"),
    }
    let mut bad = p.clone();
    bad.out_w = Array2::zeros((8, 15));
    let err = bad.check_shapes().unwrap_err().to_string();
    assert!(err.contains("output.dense.weight"), "{err}");
    // map and zeros_like keep every shape; try_map stops at the first error.
    let z = p.zeros_like();
    assert!(z.check_shapes().is_ok() && z.query_w.iter().all(|&x| x == 0.0));
    let halves = p.map(|a| a.mapv(|x| x / 2.0), |a| a.mapv(|x| x / 2.0));
    assert_eq!(halves.out_ln_b[3], p.out_ln_b[3] / 2.0);
    let mut seen = Vec::new();
    let first_vector = p.try_map(
        |n, a| {
            seen.push(n.to_string());
            Ok(a.clone())
        },
        |n, _| Err::<Array1<f64>, _>(n.to_string()),
    );
    assert_eq!(first_vector.unwrap_err(), "attention.self.query.bias");
    assert_eq!(seen, ["attention.self.query.weight"]);
}
