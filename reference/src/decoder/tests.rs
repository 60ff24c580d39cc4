//! The decoder's backward against central finite differences (every
//! parameter, every configuration axis: RMSNorm/LayerNorm, SwiGLU/GELU,
//! tied/untied, MHA/GQA/MQA, varlen/dense layouts, a key/value cache), and
//! properties that do not trust the code's own formulas: rotary embeddings
//! depend on relative positions only, GQA equals MHA with repeated key/value
//! heads, a continuation chunk over a cache equals the tail of the whole
//! document, causality, typed errors.
//!
//! Tolerances: finite differences as [`crate::testutil`] states (`FD_EPS`,
//! `FD_TOL`). Two f64 forms of the same per-token arithmetic whose matrix
//! products see other row counts (a chunk against the whole document, dense
//! against varlen) are held to [`REWRITE`]: 1e-12 relative to the tensor's
//! largest value, ~4500 ulp, far above reordered sums of a few dozen terms
//! (~1e-15) and far below any planted fault (>= 1e-3 here).

use ndarray::{Array2, Array3};
use rand::{Rng, SeedableRng};

use super::ops::{rms_norm, rope, rope_inv_freq};
use super::*;
use crate::attention::ReferenceAttention;
use crate::error::Error;
use crate::testutil::{FD_EPS, FD_TOL};
use crate::vocab::IGNORE_INDEX;

// Two f64 runs of the same math in another order, values of order 1: a few ulps (~1e-15); 1e-12 is
// a margin chosen, not derived.
const REWRITE: f64 = 1e-12;

fn cu(lengths: &[usize]) -> Vec<usize> {
    let mut c = vec![0];
    for l in lengths {
        c.push(c.last().unwrap() + l);
    }
    c
}

/// The reference forward of `model` on `ids` at positions `pos` under
/// `attention` (after the cache `past`).
fn forward(
    model: &DecoderModel,
    ids: &[i64],
    pos: &[usize],
    attention: &DecoderAttention,
    past: Option<&KvCache>,
) -> DecoderForward {
    let input = DecoderInput {
        input_ids: ids,
        position_ids: pos,
        attention,
        past,
    };
    model.forward(&ReferenceAttention, &input).unwrap()
}

/// Varlen attention over segments of `lengths`.
fn varlen(lengths: &[usize]) -> DecoderAttention {
    DecoderAttention::Varlen {
        cu_seqlens: cu(lengths),
    }
}

fn positions(lengths: &[usize], offsets: &[usize]) -> Vec<usize> {
    lengths
        .iter()
        .zip(offsets)
        .flat_map(|(&l, &o)| o..o + l)
        .collect()
}

fn close(what: &str, a: &[f64], b: &[f64], rel: f64) {
    assert_eq!(a.len(), b.len(), "{what}");
    let scale = a.iter().fold(1e-300f64, |m, v| m.max(v.abs()));
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= rel * scale,
            "{what}[{i}]: {x:e} vs {y:e} (scale {scale:e})"
        );
    }
}

fn flat<D: ndarray::Dimension>(a: &ndarray::Array<f64, D>) -> Vec<f64> {
    a.iter().copied().collect()
}

struct Case {
    ids: Vec<i64>,
    pos: Vec<usize>,
    attention: DecoderAttention,
    labels: Vec<i64>,
    weights: Vec<f64>,
}

fn case(model: &DecoderModel, attention: DecoderAttention, pos: Vec<usize>, seed: u64) -> Case {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let n = pos.len();
    let v = model.config.vocab_size as i64;
    let ids = (0..n).map(|_| rng.random_range(0..v)).collect();
    let labels = (0..n)
        .map(|_| {
            if rng.random_range(0..4) == 0 {
                IGNORE_INDEX
            } else {
                rng.random_range(0..v)
            }
        })
        .collect();
    let weights = (0..n).map(|_| 0.5 + rng.random::<f64>()).collect();
    Case {
        ids,
        pos,
        attention,
        labels,
        weights,
    }
}

fn loss_of(model: &DecoderModel, c: &Case, past: Option<&KvCache>) -> f64 {
    let input = DecoderInput {
        input_ids: &c.ids,
        position_ids: &c.pos,
        attention: &c.attention,
        past,
    };
    let fwd = model.forward(&ReferenceAttention, &input).unwrap();
    let (l, _) = token_cross_entropy(fwd.logits.view(), &c.labels, &c.weights).unwrap();
    l.iter().zip(&c.weights).map(|(a, b)| a * b).sum()
}

/// The central difference `(L(+eps) - L(-eps)) / 2 eps` of `loss` in the
/// value that `nudge(state, delta)` moves by `delta` (moved back after).
fn central_difference<S>(
    state: &mut S,
    nudge: impl Fn(&mut S, f64),
    loss: impl Fn(&S) -> f64,
) -> f64 {
    nudge(state, FD_EPS);
    let up = loss(state);
    nudge(state, -2.0 * FD_EPS);
    let down = loss(state);
    nudge(state, FD_EPS);
    (up - down) / (2.0 * FD_EPS)
}

fn fd_ok(what: &str, analytic: f64, fd: f64) {
    let err = (fd - analytic).abs();
    assert!(
        err <= FD_TOL.0 + FD_TOL.1 * analytic.abs(),
        "{what}: analytic {analytic:e}, finite difference {fd:e} (error {err:e})"
    );
}

/// Every parameter's gradient (and the cache's, when given) against central
/// differences of the loss. Returns the number of values checked.
fn fd_model(name: &str, model: &DecoderModel, c: &Case, past: Option<&KvCache>) -> usize {
    let input = DecoderInput {
        input_ids: &c.ids,
        position_ids: &c.pos,
        attention: &c.attention,
        past,
    };
    let run = model
        .run(&ReferenceAttention, &input, &c.labels, &c.weights)
        .unwrap();
    // REWRITE's bound, written out: the same f64 loss computed twice.
    assert!((run.loss - loss_of(model, c, past)).abs() < 1e-12);
    let grads = run.grads.params.named();
    let mut m = model.clone();
    let mut checked = 0;
    let mut nonzero = 0;
    for (t, (gname, g)) in grads.iter().enumerate() {
        let g: Vec<f64> = g.iter().copied().collect();
        for (i, &analytic) in g.iter().enumerate() {
            let nudge = |m: &mut DecoderModel, delta: f64| {
                let mut named = m.params.named_mut();
                assert_eq!(named[t].0, *gname);
                *named[t].1.iter_mut().nth(i).unwrap() += delta;
            };
            let fd = central_difference(&mut m, nudge, |m| loss_of(m, c, past));
            fd_ok(&format!("{name} {gname}[{i}]"), analytic, fd);
            checked += 1;
            // A gradient above 1e-6 counts as non-zero: above the finite difference's noise
            // (FD_TOL), so the check is not vacuous.
            nonzero += usize::from(analytic.abs() > 1e-6);
        }
    }
    // Non-degenerate: most gradients are not zero.
    assert!(
        nonzero * 2 > checked,
        "{name}: {nonzero} of {checked} non-zero"
    );
    if let Some(kv) = past {
        let pg = run.grads.past.as_ref().expect("cache gradients");
        let mut kv2 = kv.clone();
        #[allow(clippy::needless_range_loop)] // l indexes the cache, its gradients and the copy
        for l in 0..kv.layers.len() {
            for which in 0..2 {
                let g = if which == 0 { &pg[l].0 } else { &pg[l].1 };
                for (i, &analytic) in g.iter().enumerate() {
                    let at = |kv: &mut KvCache, delta: f64| {
                        let t = if which == 0 {
                            &mut kv.layers[l].0
                        } else {
                            &mut kv.layers[l].1
                        };
                        *t.iter_mut().nth(i).unwrap() += delta;
                    };
                    let fd = central_difference(&mut kv2, at, |kv| loss_of(model, c, Some(kv)));
                    fd_ok(&format!("{name} past[{l}].{which}[{i}]"), analytic, fd);
                    checked += 1;
                }
            }
        }
    }
    checked
}

fn config(
    norm: Norm,
    mlp: Mlp,
    tied: bool,
    h: usize,
    h_kv: usize,
    d: usize,
    layers: usize,
) -> DecoderConfig {
    DecoderConfig {
        norm,
        mlp,
        tie_embeddings: tied,
        ..DecoderConfig::tiny(7, h, h_kv, d, 5, layers)
    }
}

#[test]
fn decoder_backward_matches_finite_differences_varlen() {
    // Segments [3, 0, 4, 1]: an empty one and a one-token one; the second
    // non-empty segment starts at position 5 (a continuation chunk).
    let lengths = [3, 0, 4, 1];
    let pos = positions(&lengths, &[0, 0, 5, 0]);
    for (name, cfg) in [
        (
            "rms swiglu untied gqa(2/1)",
            config(Norm::RmsNorm, Mlp::SwiGlu, false, 2, 1, 4, 2),
        ),
        (
            "layernorm gelu tied mha",
            config(Norm::LayerNorm, Mlp::Gelu, true, 2, 2, 2, 1),
        ),
        (
            "rms gelu tied gqa(4/2)",
            config(Norm::RmsNorm, Mlp::Gelu, true, 4, 2, 2, 1),
        ),
        (
            "layernorm swiglu untied mqa(3/1)",
            config(Norm::LayerNorm, Mlp::SwiGlu, false, 3, 1, 2, 1),
        ),
    ] {
        let model = DecoderModel::random(cfg, 11).unwrap();
        let c = case(&model, varlen(&lengths), pos.clone(), 3);
        let n = fd_model(name, &model, &c, None);
        assert!(n > 150, "{name}: {n}");
    }
}

#[test]
fn decoder_backward_matches_finite_differences_dense_rows() {
    // Two right-padded rows of 5 (lengths 3 and 5), and one packed row of
    // documents [2, pad, 2] under the block-causal mask (a padding query
    // attends to nothing).
    let cfg = config(Norm::RmsNorm, Mlp::SwiGlu, false, 2, 1, 2, 2);
    let model = DecoderModel::random(cfg, 5).unwrap();
    let padded = DecoderAttention::padded_rows(&[3, 5], 5);
    let c = case(&model, padded, (0..5).chain(0..5).collect(), 8);
    fd_model("padded rows", &model, &c, None);
    let packed = DecoderAttention::block_causal(&[1, 1, 0, 2, 2], 5).unwrap();
    let c = case(&model, packed, vec![0, 1, 0, 0, 1], 9);
    fd_model("block-causal row", &model, &c, None);
}

#[test]
fn decoder_cache_gradients_match_finite_differences() {
    let cfg = config(Norm::RmsNorm, Mlp::SwiGlu, false, 2, 1, 2, 2);
    let model = DecoderModel::random(cfg.clone(), 21).unwrap();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(4);
    // Segments of the chunk: 2 new over 3 cached, 1 new over 0 cached, 3 new over 1 cached.
    let past_cu = cu(&[3, 0, 1]);
    let layers = (0..2)
        .map(|_| {
            let mut t = || Array3::from_shape_fn((4, 1, 2), |_| 2.0 * rng.random::<f64>() - 1.0);
            (t(), t())
        })
        .collect();
    let past = KvCache {
        cu_seqlens: past_cu,
        layers,
    };
    let lengths = [2, 1, 3];
    let c = case(&model, varlen(&lengths), positions(&lengths, &[3, 0, 1]), 6);
    fd_model("chunk over a cache", &model, &c, Some(&past));
}

#[test]
fn a_continuation_chunk_over_its_cache_equals_the_tail_of_the_whole_document() {
    // docs/FAULTS.md C5 and C6: documents of 7 and 4 tokens; the first 4 and
    // 1 tokens run first, the rest (3 and 3 tokens, positions 4.. and 1..)
    // run as a chunk over their cache, bottom-right aligned.
    for cfg in [
        config(Norm::RmsNorm, Mlp::SwiGlu, false, 4, 2, 4, 2),
        config(Norm::LayerNorm, Mlp::Gelu, true, 2, 1, 2, 1),
    ] {
        let model = DecoderModel::random(cfg, 2).unwrap();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(9);
        let docs: Vec<Vec<i64>> = [7, 4]
            .iter()
            .map(|&l| (0..l).map(|_| rng.random_range(0..7)).collect())
            .collect();
        let split = [4, 1];
        let all_ids: Vec<i64> = docs.concat();
        let whole = varlen(&[7, 4]);
        let pos_whole = positions(&[7, 4], &[0, 0]);
        let full = forward(&model, &all_ids, &pos_whole, &whole, None);
        let pre_ids: Vec<i64> = docs
            .iter()
            .zip(split)
            .flat_map(|(d, s)| d[..s].to_vec())
            .collect();
        let pre_cu = cu(&split);
        let pre_att = DecoderAttention::Varlen {
            cu_seqlens: pre_cu.clone(),
        };
        let pre_pos = positions(&split, &[0, 0]);
        let pre = forward(&model, &pre_ids, &pre_pos, &pre_att, None);
        let cache = pre.present(&pre_cu);
        let rest = [3, 3];
        let chunk_ids: Vec<i64> = docs
            .iter()
            .zip(split)
            .flat_map(|(d, s)| d[s..].to_vec())
            .collect();
        let chunk_att = varlen(&rest);
        let chunk_pos = positions(&rest, &split);
        let chunk = forward(&model, &chunk_ids, &chunk_pos, &chunk_att, Some(&cache));
        let want: Vec<f64> = [4usize, 5, 6, 8, 9, 10]
            .iter()
            .flat_map(|&r| full.logits.row(r).to_vec())
            .collect();
        close("chunk logits", &want, &flat(&chunk.logits), REWRITE);
        // The fault: the chunk's positions restarted at 0 (C6) moves the logits.
        let restarted = positions(&rest, &[0, 0]);
        let wrong = forward(&model, &chunk_ids, &restarted, &chunk_att, Some(&cache));
        let diff = (&wrong.logits - &chunk.logits)
            .iter()
            .fold(0.0f64, |m, v| m.max(v.abs()));
        assert!(diff > 1e-3, "restarted positions changed nothing: {diff:e}");
    }
}

#[test]
fn gqa_equals_mha_with_repeated_key_value_heads() {
    // h = 4 over h_kv = 2: query heads 0, 1 share key head 0 (HF's repeat_kv).
    let gqa =
        DecoderModel::random(config(Norm::RmsNorm, Mlp::SwiGlu, false, 4, 2, 2, 1), 13).unwrap();
    let mut mha = DecoderModel {
        config: DecoderConfig {
            num_kv_heads: 4,
            ..gqa.config.clone()
        },
        params: gqa.params.clone(),
    };
    let d = 2;
    let rep = |w: &Array2<f64>| {
        Array2::from_shape_fn((4 * d, w.ncols()), |(r, c)| w[[(r / d / 2) * d + r % d, c]])
    };
    mha.params.layers[0].wk = rep(&gqa.params.layers[0].wk);
    mha.params.layers[0].wv = rep(&gqa.params.layers[0].wv);
    let lengths = [4, 2];
    let c = case(&gqa, varlen(&lengths), positions(&lengths, &[0, 0]), 1);
    let input = DecoderInput {
        input_ids: &c.ids,
        position_ids: &c.pos,
        attention: &c.attention,
        past: None,
    };
    let a = gqa
        .run(&ReferenceAttention, &input, &c.labels, &c.weights)
        .unwrap();
    let b = mha
        .run(&ReferenceAttention, &input, &c.labels, &c.weights)
        .unwrap();
    close("logits", &flat(&a.logits), &flat(&b.logits), REWRITE);
    // The shared head's gradient is the sum over the query-head group's copies.
    let gb = &b.grads.params.layers[0].wk;
    let summed = Array2::from_shape_fn(gqa.params.layers[0].wk.dim(), |(r, c)| {
        let (kv, j) = (r / d, r % d);
        gb[[(2 * kv) * d + j, c]] + gb[[(2 * kv + 1) * d + j, c]]
    });
    close(
        "grad k_proj",
        &flat(&a.grads.params.layers[0].wk),
        &flat(&summed),
        REWRITE,
    );
}

#[test]
fn rope_is_identity_at_zero_preserves_norms_and_sees_relative_positions_only() {
    let inv = rope_inv_freq(6, 10_000.0).unwrap();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
    let x = Array3::from_shape_fn((2, 1, 6), |_| 2.0 * rng.random::<f64>() - 1.0);
    let at0 = rope(x.view(), &[0, 0], &inv).unwrap();
    assert_eq!(at0, x);
    let dot = |m: usize, n: usize| {
        let q = rope(x.view(), &[m, n], &inv).unwrap();
        (0..6).map(|c| q[[0, 0, c]] * q[[1, 0, c]]).sum::<f64>()
    };
    // q_m . k_n depends on m - n only (RoFormer eq. 16).
    for (m, n, s) in [(3, 1, 5), (0, 4, 9), (7, 7, 100)] {
        assert!((dot(m, n) - dot(m + s, n + s)).abs() < 1e-12, "{m} {n} {s}");
    }
    assert!(
        (dot(3, 1) - dot(1, 3)).abs() > 1e-3,
        "not symmetric in m - n"
    );
    let y = rope(x.view(), &[5, 123], &inv).unwrap();
    for t in 0..2 {
        let nx: f64 = x
            .index_axis(ndarray::Axis(0), t)
            .iter()
            .map(|v| v * v)
            .sum();
        let ny: f64 = y
            .index_axis(ndarray::Axis(0), t)
            .iter()
            .map(|v| v * v)
            .sum();
        // The same f64 sum of squares in another order: REWRITE's bound written out.
        assert!((nx - ny).abs() < 1e-12);
    }
    // Hand value: d = 2, frequency 1, position 1 rotates (1, 0) to (cos 1, sin 1).
    let e = Array3::from_shape_vec((1, 1, 2), vec![1.0, 0.0]).unwrap();
    let r = rope(e.view(), &[1], &[1.0]).unwrap();
    assert!((r[[0, 0, 0]] - 0.540_302_305_868_139_8).abs() < 1e-15);
    assert!((r[[0, 0, 1]] - 0.841_470_984_807_896_5).abs() < 1e-15);
}

#[test]
fn rms_norm_hand_value() {
    // x = [3, 4]: mean square 12.5, rms 3.5355339; gains [1, 2].
    let x = Array2::from_shape_vec((1, 2), vec![3.0, 4.0]).unwrap();
    let g = ndarray::arr1(&[1.0, 2.0]);
    let (y, _) = rms_norm(x.view(), g.view(), 0.0);
    assert!((y[[0, 0]] - 0.848_528_137_423_857).abs() < 1e-14);
    assert!((y[[0, 1]] - 2.262_741_699_796_952).abs() < 1e-14);
}

#[test]
fn causal_and_per_segment() {
    let model =
        DecoderModel::random(config(Norm::RmsNorm, Mlp::SwiGlu, false, 2, 1, 2, 2), 3).unwrap();
    let lengths = [4, 3];
    let att = varlen(&lengths);
    let pos = positions(&lengths, &[0, 0]);
    let ids: Vec<i64> = vec![1, 2, 3, 4, 5, 6, 0];
    let logits = |ids: &[i64]| forward(&model, ids, &pos, &att, None).logits;
    let base = logits(&ids);
    // A later token of document 0 moves only itself and later rows of document 0.
    let mut changed = ids.clone();
    changed[2] = 6;
    let other = logits(&changed);
    for r in 0..7 {
        let d = (&base.row(r) - &other.row(r))
            .iter()
            .fold(0.0f64, |m, v| m.max(v.abs()));
        if !(2..4).contains(&r) {
            assert_eq!(d, 0.0, "row {r} moved");
        } else {
            // A changed token moves its own and later rows' logits by far more than 1e-6 (a margin
            // chosen); the rows before it move by exactly 0.
            assert!(d > 1e-6, "row {r} did not move");
        }
    }
}

#[test]
fn dense_padded_rows_equal_varlen() {
    let model =
        DecoderModel::random(config(Norm::LayerNorm, Mlp::SwiGlu, true, 2, 1, 4, 2), 8).unwrap();
    let lengths = [3, 5, 1];
    let c = case(&model, varlen(&lengths), positions(&lengths, &[0, 0, 0]), 2);
    let input = DecoderInput {
        input_ids: &c.ids,
        position_ids: &c.pos,
        attention: &c.attention,
        past: None,
    };
    let varlen = model.forward(&ReferenceAttention, &input).unwrap();
    let row_len = 6;
    let offs = cu(&lengths);
    let mut ids = vec![0i64; 3 * row_len];
    for (s, &l) in lengths.iter().enumerate() {
        ids[s * row_len..s * row_len + l].copy_from_slice(&c.ids[offs[s]..offs[s + 1]]);
    }
    let pos: Vec<usize> = (0..3).flat_map(|_| 0..row_len).collect();
    let att = DecoderAttention::padded_rows(&lengths, row_len);
    let dense = forward(&model, &ids, &pos, &att, None);
    for (s, &l) in lengths.iter().enumerate() {
        for t in 0..l {
            close(
                &format!("segment {s} token {t}"),
                &varlen.logits.row(offs[s] + t).to_vec(),
                &dense.logits.row(s * row_len + t).to_vec(),
                REWRITE,
            );
        }
    }
}

/// The error of `model`'s forward on tokens `[1, 2, 3]` at positions
/// `[0, 1, 2]` under `attention` over `past`.
fn forward_err(
    model: &DecoderModel,
    attention: &DecoderAttention,
    past: Option<&KvCache>,
) -> Error {
    let input = DecoderInput {
        input_ids: &[1, 2, 3],
        position_ids: &[0, 1, 2],
        attention,
        past,
    };
    model.forward(&ReferenceAttention, &input).unwrap_err()
}

#[test]
fn bad_inputs_are_typed_errors() {
    let bad = DecoderModel::random(DecoderConfig::tiny(7, 4, 3, 2, 5, 1), 0).unwrap_err();
    assert_error_field!(bad, InvalidArgument, "num_kv_heads");
    let bad = DecoderModel::random(DecoderConfig::tiny(7, 2, 1, 3, 5, 1), 0).unwrap_err();
    assert_error_field!(bad, InvalidArgument, "head_dim");
    let model = DecoderModel::random(DecoderConfig::tiny(7, 2, 1, 2, 5, 1), 0).unwrap();
    let att = DecoderAttention::Varlen {
        cu_seqlens: vec![0, 3],
    };
    let run = |ids: &[i64], pos: &[usize], att: &DecoderAttention, labels: &[i64]| {
        model.run(
            &ReferenceAttention,
            &DecoderInput {
                input_ids: ids,
                position_ids: pos,
                attention: att,
                past: None,
            },
            labels,
            &[1.0; 3],
        )
    };
    let e = run(&[1, 7, 2], &[0, 1, 2], &att, &[1, 2, 3]).unwrap_err();
    assert_eq!(
        e,
        Error::IndexOutOfRange {
            field: "input_ids".into(),
            index: 1,
            value: 7,
            lo: 0,
            hi: 7
        }
    );
    let e = run(&[1, 2, 3], &[0, 1], &att, &[1, 2, 3]).unwrap_err();
    assert_error_field!(e, ShapeMismatch, "position_ids");
    let e = run(&[1, 2, 3], &[0, 1, 2], &att, &[1, -100, -1]).unwrap_err();
    assert_eq!(
        e,
        Error::IndexOutOfRange {
            field: "labels".into(),
            index: 2,
            value: -1,
            lo: 0,
            hi: 7
        }
    );
    let e = run(
        &[1, 2, 3],
        &[0, 1, 2],
        &DecoderAttention::Varlen {
            cu_seqlens: vec![0, 4],
        },
        &[1, 2, 3],
    )
    .unwrap_err();
    assert_error_field!(e, InvalidArgument, "cu_seqlens[1]");
    let dense = DecoderAttention::padded_rows(&[3], 3);
    let past = KvCache {
        cu_seqlens: vec![0, 0],
        layers: vec![(Array3::zeros((0, 1, 2)), Array3::zeros((0, 1, 2)))],
    };
    let e = forward_err(&model, &dense, Some(&past));
    assert_error_field!(e, InvalidArgument, "past");
    let past = KvCache {
        cu_seqlens: vec![0, 2],
        layers: vec![(Array3::zeros((2, 2, 2)), Array3::zeros((2, 1, 2)))],
    };
    let e = forward_err(&model, &att, Some(&past));
    assert_error_field!(e, ShapeMismatch, "past.layers[0].k");

    let mut broken = model.clone();
    broken.params.layers[0].wk = Array2::zeros((3, 4));
    let e = forward_err(&broken, &att, None);
    assert_error_field!(e, ShapeMismatch, "model.layers.0.self_attn.k_proj.weight");
}

#[test]
fn sliding_window_packed_equals_each_document_alone() {
    // Hugging Face's sliding_window = 3: each token sees itself and the 2
    // tokens before it in its own document (window_size = (2, 0)).
    let cfg = DecoderConfig {
        sliding_window: Some(3),
        ..config(Norm::RmsNorm, Mlp::SwiGlu, false, 4, 2, 4, 2)
    };
    let model = DecoderModel::random(cfg, 21).unwrap();
    let lengths = [6, 1, 5];
    let packed = case(&model, varlen(&lengths), positions(&lengths, &[0, 0, 0]), 5);
    let run = |m: &DecoderModel, c: &Case| {
        let input = DecoderInput {
            input_ids: &c.ids,
            position_ids: &c.pos,
            attention: &c.attention,
            past: None,
        };
        m.run(&ReferenceAttention, &input, &c.labels, &c.weights)
            .unwrap()
    };
    let whole = run(&model, &packed);
    let offs = cu(&lengths);
    let mut loss = 0.0;
    let mut grads = whole.grads.params.zeros_like();
    for (s, &l) in lengths.iter().enumerate() {
        let r = offs[s]..offs[s + 1];
        let doc = Case {
            ids: packed.ids[r.clone()].to_vec(),
            pos: packed.pos[r.clone()].to_vec(),
            attention: varlen(&[l]),
            labels: packed.labels[r.clone()].to_vec(),
            weights: packed.weights[r.clone()].to_vec(),
        };
        let one = run(&model, &doc);
        loss += one.loss;
        for t in 0..l {
            let what = format!("document {s} token {t}");
            let row = |a: &ndarray::Array2<f64>, i: usize| a.row(i).to_vec();
            close(
                &format!("logits, {what}"),
                &row(&whole.logits, offs[s] + t),
                &row(&one.logits, t),
                REWRITE,
            );
            close(
                &format!("grad_inputs_embeds, {what}"),
                &row(&whole.grads.grad_inputs_embeds, offs[s] + t),
                &row(&one.grads.grad_inputs_embeds, t),
                REWRITE,
            );
        }
        for ((_, mut g), (_, x)) in grads.named_mut().into_iter().zip(one.grads.params.named()) {
            g += &x;
        }
    }
    close("loss", &[whole.loss], &[loss], REWRITE);
    for ((name, a), (_, b)) in whole.grads.params.named().iter().zip(grads.named()) {
        let flat_view = |v: &ndarray::ArrayViewD<'_, f64>| v.iter().copied().collect::<Vec<_>>();
        close(name, &flat_view(a), &flat_view(&b), REWRITE);
    }
    // Negative control: the window changes the packed loss (the test would
    // see a window that is ignored), and a window of 0 is refused by name.
    let full = DecoderModel {
        config: DecoderConfig {
            sliding_window: None,
            ..model.config.clone()
        },
        params: model.params.clone(),
    };
    assert!((run(&full, &packed).loss - whole.loss).abs() > 1e-6);
    // The backward is that of the windowed forward (packed == unpacked alone
    // would not see a backward that ignores the window on both sides).
    assert!(fd_model("sliding window", &model, &packed, None) > 0);
    let zero = DecoderConfig {
        sliding_window: Some(0),
        ..model.config.clone()
    };
    assert_error_field!(
        zero.validate().unwrap_err(),
        InvalidArgument,
        "sliding_window"
    );
}
