//! Every registered implementation of every op family timed through its
//! trait (the f64 boundary included) on one workload per family, checked
//! against the family's f64 reference first, its time given as a ratio to
//! the reference's measured in the same run.

use ndarray::{Array1, Array2, Array3};
use packshard_equivalence::causal::CausalCase;
use packshard_reference::attention::varlen_pass;
use packshard_reference::attention::AttentionLayout;
use packshard_reference::bert::{BertConfig, BertParams};
use packshard_reference::decoder::{CausalReduction, DecoderConfig};
use packshard_reference::ops::{
    CeCall, EmbeddingCall, Layer, LayerInput, LinearCall, LinearInput, Precision, Qkv, Varlen,
};
use packshard_reference::vocab::LossConfig;
use packshard_reference::{Error, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::{time_warm, wikipedia_lengths, Batch, BenchConfig};
use crate::registry::{self, Entry, Family};

/// One implementation's timing.
#[derive(Debug, Clone, PartialEq)]
pub struct ImplTiming {
    /// Its family.
    pub family: Family,
    /// Its registered name.
    pub name: &'static str,
    /// What it computes in.
    pub precision: Precision,
    /// The workload, in words.
    pub workload: String,
    /// Seconds (the minimum over `reps` after the checked run); `None` when skipped.
    pub seconds: Option<f64>,
    /// The reference's seconds over this one's: how many times faster.
    pub speedup: Option<f64>,
    /// `max |this - reference| / max |reference|` over the outputs compared.
    pub max_rel_diff: f64,
    /// Why it did not run here (`no CUDA device ...`).
    pub skipped: Option<String>,
}

/// The largest relative difference over which a result is not timed: far
/// above any legitimate f32 or bf16 rounding on these workloads (bf16 inputs
/// give ~1e-2 at most), far below a wrong result.
const NOT_TIMED_OVER: f64 = 5e-2;

fn rel_diff(pairs: &[(&[f64], &[f64])]) -> f64 {
    let mut worst = 0.0f64;
    for (want, got) in pairs {
        let scale = want
            .iter()
            .fold(0.0f64, |m, x| m.max(x.abs()))
            .max(f64::MIN_POSITIVE);
        let d = want
            .iter()
            .zip(got.iter())
            .filter(|(a, b)| a.is_finite() || b.is_finite())
            .fold(0.0f64, |m, (a, b)| m.max((a - b).abs()));
        worst = worst.max(d / scale);
    }
    worst
}

fn flat<D: ndarray::Dimension>(a: &ndarray::Array<f64, D>) -> Vec<f64> {
    a.iter().copied().collect()
}

/// Runs `run` (outputs flattened) for every entry of `list`, the reference
/// first, checks each against the reference's outputs, then times it.
fn time_family<K: ?Sized>(
    family: Family,
    list: &[Entry<K>],
    workload: &str,
    reps: usize,
    run: impl Fn(&K) -> Result<Vec<Vec<f64>>>,
) -> Result<Vec<ImplTiming>> {
    let mut out = Vec::new();
    let mut reference: Option<(Vec<Vec<f64>>, f64)> = None;
    for entry in list {
        let mut row = ImplTiming {
            family,
            name: entry.name,
            precision: entry.precision,
            workload: workload.to_string(),
            seconds: None,
            speedup: None,
            max_rel_diff: 0.0,
            skipped: None,
        };
        let imp = match entry.here() {
            registry::Here::Runs(imp) => imp,
            registry::Here::Skipped(u) => {
                row.skipped = Some(u.to_string());
                out.push(row);
                continue;
            }
            registry::Here::Missing(u) => {
                return Err(Error::invalid(
                    entry.name,
                    format!("required here but cannot run: {u}"),
                ))
            }
        };
        let got = run(&imp)?;
        if let Some((want, _)) = &reference {
            let pairs: Vec<(&[f64], &[f64])> = want
                .iter()
                .zip(&got)
                .map(|(a, b)| (a.as_slice(), b.as_slice()))
                .collect();
            row.max_rel_diff = rel_diff(&pairs);
            if row.max_rel_diff > NOT_TIMED_OVER {
                return Err(Error::invalid(
                    entry.name,
                    format!(
                        "differs from the f64 reference by {:.2e} of its scale on the {} workload: not timing",
                        row.max_rel_diff,
                        family.name()
                    ),
                ));
            }
        }
        let s = time_warm(reps, || run(&imp));
        row.seconds = Some(s);
        match &reference {
            None => reference = Some((got, s)),
            Some((_, r)) => row.speedup = Some(r / s),
        }
        if entry.name == registry::REFERENCE {
            row.speedup = Some(1.0);
        }
        out.push(row);
    }
    Ok(out)
}

fn uniform(rng: &mut ChaCha8Rng, n: usize, a: f64) -> Vec<f64> {
    (0..n).map(|_| rng.random_range(-a..a)).collect()
}

fn array3(rng: &mut ChaCha8Rng, shape: (usize, usize, usize), a: f64) -> Array3<f64> {
    Array3::from_shape_vec(shape, uniform(rng, shape.0 * shape.1 * shape.2, a))
        .expect("the shape's element count")
}

fn array2(rng: &mut ChaCha8Rng, shape: (usize, usize), a: f64) -> Array2<f64> {
    Array2::from_shape_vec(shape, uniform(rng, shape.0 * shape.1, a))
        .expect("the shape's element count")
}

fn targets(rng: &mut ChaCha8Rng, n: usize, v: usize) -> Vec<i64> {
    (0..n)
        .map(|i| {
            if i % 11 == 5 {
                -100
            } else {
                rng.random_range(0..v as i64)
            }
        })
        .collect()
}

/// Times every registered implementation of every family. Workloads (f64 at
/// the boundary, seeded by `cfg.seed`): attention forward + backward over
/// 16 `wikipedia-512`-drawn sequences packed into rows of 128 (4 heads of
/// 32, causal off); cross-entropy forward + backward on `[128, 8191]`
/// logits with ignored targets; the output layer on `[128, 64] x [8191,
/// 64]`; the embedding of 1024 ids in `[8191, 64]` with its gradient; the
/// encoder layer (hidden 64, 4 heads, 256) forward + backward on 8 packed
/// sequences in rows of 64.
///
/// # Errors
/// An implementation's error, or a result more than 5e-2 of its scale from
/// the reference's (then it is not timed).
pub fn registry(cfg: &BenchConfig) -> Result<Vec<ImplTiming>> {
    cfg.validate()?;
    let reps = cfg.reps;
    let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed + 10);
    let mut out = Vec::new();

    // Attention.
    let batch = Batch::new(wikipedia_lengths(16, 128, cfg.seed)?, 128)?;
    let n = batch.packed_slots();
    let (h, d) = (4, 32);
    let (q, k, v, go) = (
        array3(&mut rng, (n, h, d), 2.0),
        array3(&mut rng, (n, h, d), 2.0),
        array3(&mut rng, (n, h, d), 2.0),
        array3(&mut rng, (n, h, d), 1.0),
    );
    let cu = batch.cu_seqlens.clone();
    let p = Varlen::new(&cu, false, 1.0 / (d as f64).sqrt());
    out.extend(time_family(
        Family::Attention,
        &registry::attention(),
        &format!(
            "fwd+bwd, {n} tokens in {} segments, h {h}, d {d}",
            cu.len() - 1
        ),
        reps,
        |op| {
            let x = Qkv::new(q.view(), k.view(), v.view());
            let (f, g) = varlen_pass(op, x, &p, go.view())?;
            Ok(vec![
                flat(&f.output),
                flat(&g.grad_q),
                flat(&g.grad_k),
                flat(&g.grad_v),
            ])
        },
    )?);

    // Cross-entropy.
    let (nt, vocab, hd) = (128, 8191, 64);
    let logits = array2(&mut rng, (nt, vocab), 8.0);
    let t = targets(&mut rng, nt, vocab);
    let config = LossConfig::default();
    let call = packshard_reference::vocab::LossCall::with_flag(&t, &config, true);
    out.extend(time_family(
        Family::CrossEntropy,
        &registry::cross_entropy(),
        &format!("fwd+bwd, logits [{nt}, {vocab}]"),
        reps,
        |op| {
            let ce = op.cross_entropy(CeCall::new(logits.view(), call))?;
            let g = ce.grad_logits.map(|g| flat(&g)).unwrap_or_default();
            Ok(vec![flat(&ce.per_token_loss), g])
        },
    )?);

    // The output layer.
    let hidden = array2(&mut rng, (nt, hd), 1.0);
    let weight = array2(&mut rng, (vocab, hd), 0.3);
    out.extend(time_family(
        Family::LinearCrossEntropy,
        &registry::linear_cross_entropy(),
        &format!("fwd+bwd, [{nt}, {hd}] x [{vocab}, {hd}]"),
        reps,
        |op| {
            let l = op.linear_cross_entropy(LinearCall::new(
                LinearInput::new(hidden.view(), weight.view()),
                call,
            ))?;
            let gh = l.grad_hidden.map(|g| flat(&g)).unwrap_or_default();
            let gw = l.grad_weight.map(|g| flat(&g)).unwrap_or_default();
            Ok(vec![flat(&l.ce.per_token_loss), gh, gw])
        },
    )?);

    // The embedding.
    let ids: Vec<i64> = (0..1024)
        .map(|_| rng.random_range(0..vocab as i64))
        .collect();
    let gout = array2(&mut rng, (ids.len(), hd), 1.0);
    out.extend(time_family(
        Family::Embedding,
        &registry::embedding(),
        &format!("fwd+bwd, {} ids in [{vocab}, {hd}]", ids.len()),
        reps,
        |op| {
            let e = op.embedding(EmbeddingCall::new(&ids, weight.view(), Some(gout.view())))?;
            let gw = e.grad_weight.map(|g| flat(&g)).unwrap_or_default();
            Ok(vec![flat(&e.output), gw])
        },
    )?);

    // The encoder layer.
    let lb = Batch::new(wikipedia_lengths(8, 64, cfg.seed + 1)?, 64)?;
    let nl = lb.packed_slots();
    let config_l = BertConfig::tiny(8, 64, 4, 1, 256, 64);
    let params = BertParams::random(&config_l, cfg.seed)
        .layers
        .into_iter()
        .next()
        .ok_or_else(|| Error::invalid("layers", "the bench model has one layer"))?;
    let x = array2(&mut rng, (nl, 64), 1.0);
    let gl = array2(&mut rng, (nl, 64), 1.0);
    let layout = AttentionLayout::Varlen {
        cu_seqlens: lb.cu_seqlens.clone(),
    };
    out.extend(time_family(
        Family::EncoderLayer,
        &registry::encoder_layer(),
        &format!("fwd+bwd, {nl} tokens, hidden 64, 4 heads, 256"),
        reps,
        |op| {
            let r = op.forward_backward(
                Layer::new(&params, 4, 1e-12),
                LayerInput::new(x.view(), &layout, gl.view()),
            )?;
            Ok(vec![
                flat(&r.output),
                flat(&r.grad_x),
                layer_grads(&r.grads),
            ])
        },
    )?);

    // The causal LM: a two-layer GQA decoder on a packed batch of
    // wikipedia-512 lengths (rows of 64).
    let lengths = wikipedia_lengths(12, 64, cfg.seed + 2)?;
    let n_docs = lengths.len();
    let case = CausalCase::seeded(
        DecoderConfig::tiny(64, 4, 2, 8, 64, 2),
        &lengths,
        &vec![0; n_docs],
        &vec![0; n_docs],
        64,
        false,
        CausalReduction::PerToken,
        cfg.seed,
    );
    let packed = case.packed()?;
    out.extend(time_family(
        Family::CausalLm,
        &registry::causal_lm(),
        &format!(
            "fwd+bwd, {} documents in {} rows of 64, hidden 32, 4 heads over 2, 2 layers",
            n_docs,
            packed.rows()
        ),
        reps,
        |op| {
            let r = op.run(&case.model, &packed, CausalReduction::PerToken)?;
            let grads = r
                .grads
                .named()
                .iter()
                .flat_map(|(_, t)| t.iter().copied().collect::<Vec<_>>())
                .collect();
            Ok(vec![flat(&r.logits), vec![r.loss], grads])
        },
    )?);
    Ok(out)
}

fn layer_grads(g: &packshard_reference::bert::LayerParams) -> Vec<f64> {
    let mut v = Vec::new();
    let two = |a: &Array2<f64>, v: &mut Vec<f64>| v.extend(a.iter().copied());
    let one = |a: &Array1<f64>, v: &mut Vec<f64>| v.extend(a.iter().copied());
    for a in [
        &g.query_w,
        &g.key_w,
        &g.value_w,
        &g.attn_out_w,
        &g.inter_w,
        &g.out_w,
    ] {
        two(a, &mut v);
    }
    for a in [
        &g.query_b,
        &g.key_b,
        &g.value_b,
        &g.attn_out_b,
        &g.attn_ln_g,
        &g.attn_ln_b,
    ] {
        one(a, &mut v);
    }
    for a in [&g.inter_b, &g.out_b, &g.out_ln_g, &g.out_ln_b] {
        one(a, &mut v);
    }
    v
}
