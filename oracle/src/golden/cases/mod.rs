//! The canonical golden cases: small, seeded, with the docs/FAULTS.md situations
//! in them (empty segments, ignored targets, padded vocabularies, a shard of
//! `-inf`, repeated ids, planted outliers), one or more per `eval` op.

use ndarray::{Array2, Array3, ArrayView2, Axis, Slice};
use packshard_equivalence::attention::AttentionCase;
use packshard_equivalence::fuzz::attention::AttentionTerms;
use packshard_equivalence::vocab::Terms;
use packshard_reference::attention::{
    default_scale, varlen_pass, AttentionGrads, AttentionOutput, ReferenceAttention,
};
use packshard_reference::ops::{Qkv, Varlen};
use packshard_reference::packing::{pack_lengths, Algorithm, Overlong, PackedBatch, PackingConfig};
use packshard_reference::vocab::embedding::{embedding_backward, embedding_forward};
use packshard_reference::vocab::{
    cross_entropy, linear_cross_entropy, LossConfig, Reduction, ShardLayout, ShardMap,
    ShardedAlgorithm, SmoothingConvention,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Map, Value};

use super::io::{Dtype, Tensor};
use super::{lowp, GoldenCase, GoldenError, Output, Rule};

impl From<packshard_reference::Error> for GoldenError {
    fn from(e: packshard_reference::Error) -> Self {
        GoldenError::new(format!("golden case: {e}"))
    }
}

fn params(pairs: &[(&str, Value)]) -> Map<String, Value> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect()
}

fn max_abs(xs: &[f64]) -> f64 {
    xs.iter()
        .filter(|x| x.is_finite())
        .fold(0.0, |m, x| m.max(x.abs()))
}

fn max_diff(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .filter(|(x, y)| x.is_finite() && y.is_finite())
        .fold(0.0, |m, (x, y)| m.max((x - y).abs()))
}

fn flat<D: ndarray::Dimension>(a: &ndarray::Array<f64, D>) -> Vec<f64> {
    a.iter().copied().collect()
}

/// A float output with its rule: the f64 terms rule at `F64`, else the
/// low-precision rule from `lowp` (the same tensor computed in `dtype`).
fn float_output(
    name: &str,
    shape: &[usize],
    expected: Vec<f64>,
    dtype: Dtype,
    terms: f64,
    what: &str,
    lowp: &[f64],
) -> Output {
    let (rule, in_dtype) = match dtype {
        Dtype::F64 => (Rule::f64_terms(terms.max(max_abs(&expected)), what), None),
        _ => (
            Rule::lowp(dtype, max_diff(&expected, lowp), max_abs(&expected)),
            Some(lowp.to_vec()),
        ),
    };
    Output {
        tensor: Tensor::float(name, shape, expected, Dtype::F64),
        rule,
        in_dtype,
    }
}

fn int_output(name: &str, shape: &[usize], values: Vec<i64>, why: &str) -> Output {
    Output {
        tensor: Tensor::int(name, shape, values),
        rule: Rule::exact(why),
        in_dtype: None,
    }
}

/// Every case at `dtype`, in manifest order.
///
/// # Errors
/// A [`GoldenError`] if a case's inputs are refused by the reference (a bug
/// in this file).
pub fn all(dtype: Dtype) -> Result<Vec<GoldenCase>, GoldenError> {
    let mut cases = vec![
        pack_case(
            "pack_spfhp",
            "SPFHP, at most 3 sequences per pack, two empty sequences (P4)",
            lengths(24, 32, 11),
            PackingConfig::new(Algorithm::Spfhp, 32).with_max_sequences_per_pack(Some(3)),
        )?,
        pack_case(
            "pack_ffd_split",
            "FFD with overlong sequences split into pieces, no token lost (P3)",
            lengths(12, 40, 12),
            PackingConfig::new(Algorithm::Ffd, 16).with_overlong(Overlong::Split),
        )?,
        batch_case()?,
        attention_case(
            "attention_varlen",
            "varlen attention over 5 segments with an empty one, planted outliers, forward and backward (P2, P4)",
            &[3, 0, 5, 1, 7],
            (2, 4),
            false,
            1,
            dtype,
        )?,
        attention_case(
            "attention_causal",
            "causal varlen attention over 3 segments, forward and backward",
            &[4, 6, 2],
            (2, 3),
            true,
            2,
            dtype,
        )?,
    ];
    cases.extend(cross_entropy_cases(dtype)?);
    cases.extend(linear_cases(dtype)?);
    cases.extend(embedding_cases(dtype)?);
    cases.extend(causal::cases()?);
    if dtype == Dtype::F64 {
        cases.push(causal::decoder_case()?);
    }
    Ok(cases)
}

/// `n` seeded lengths in `0..=max` (every seventh empty).
fn lengths(n: usize, max: usize, seed: u64) -> Vec<usize> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n)
        .map(|i| {
            if i % 7 == 3 {
                0
            } else {
                rng.random_range(1..=max)
            }
        })
        .collect()
}

fn pack_case(
    name: &str,
    description: &str,
    lengths: Vec<usize>,
    config: PackingConfig,
) -> Result<GoldenCase, GoldenError> {
    let plan = pack_lengths(&lengths, &config)?;
    let mut segments = Vec::new();
    for (p, pack) in plan.packs.iter().enumerate() {
        for s in pack {
            segments.extend([
                p as i64,
                s.sequence as i64,
                s.offset as i64,
                s.length as i64,
            ]);
        }
    }
    let k = segments.len() / 4;
    let mut p = params(&[
        ("max_seq_len", json!(config.max_seq_len)),
        ("algorithm", json!(config.algorithm.name())),
    ]);
    if let Some(limit) = config.max_sequences_per_pack {
        p.insert("max_sequences_per_pack".into(), json!(limit));
    }
    p.insert(
        "overlong".into(),
        json!(format!("{:?}", config.overlong).to_lowercase()),
    );
    Ok(GoldenCase {
        name: name.into(),
        op: "pack",
        description: description.into(),
        params: p,
        inputs: vec![Tensor::int(
            "lengths",
            &[lengths.len()],
            lengths.iter().map(|&l| l as i64).collect(),
        )],
        outputs: vec![
            int_output("num_packs", &[], vec![plan.packs.len() as i64], "a count"),
            int_output(
                "segments",
                &[k, 4],
                segments,
                "the plan: pack, sequence, offset, length of each segment of `packs`, in order",
            ),
        ],
    })
}

fn batch_case() -> Result<GoldenCase, GoldenError> {
    let lengths = [5usize, 0, 3, 8, 2, 7];
    let mut rng = ChaCha8Rng::seed_from_u64(13);
    let sequences: Vec<Vec<i64>> = lengths
        .iter()
        .map(|&l| (0..l).map(|_| rng.random_range(1..30522)).collect())
        .collect();
    let config = PackingConfig::new(Algorithm::Ffd, 10);
    let (offset, pad) = (2, 0);
    let (_, batch) = PackedBatch::from_sequences(&sequences, &config, pad, offset)?;
    let mut cu = vec![0i64];
    for s in &sequences {
        cu.push(cu.last().expect("starts at 0") + s.len() as i64);
    }
    let tokens: Vec<i64> = sequences.concat();
    let shape = [batch.num_packs(), config.max_seq_len];
    let rows = |a: &Array2<i64>| a.iter().copied().collect::<Vec<i64>>();
    Ok(GoldenCase {
        name: "batch_ffd_offset2".into(),
        op: "batch",
        description: "token sequences packed by FFD into rows of 10 with RoBERTa-style positions from 2 and an empty sequence (P1, P4, P5, P6)".into(),
        params: params(&[
            ("max_seq_len", json!(config.max_seq_len)),
            ("algorithm", json!(config.algorithm.name())),
            ("position_offset", json!(offset)),
            ("pad_token_id", json!(pad)),
        ]),
        inputs: vec![
            Tensor::int("tokens", &[tokens.len()], tokens),
            Tensor::int("cu_seqlens", &[cu.len()], cu),
        ],
        outputs: vec![
            int_output("input_ids", &shape, rows(&batch.input_ids), "token ids"),
            int_output("position_ids", &shape, rows(&batch.position_ids), "positions"),
            int_output("sequence_ids", &shape, rows(&batch.sequence_ids), "1-based segment per pack, 0 for padding"),
        ],
    })
}

fn round3(a: &Array3<f64>, dtype: Dtype) -> Array3<f64> {
    a.mapv(|x| dtype.round(x))
}

#[allow(clippy::too_many_arguments)]
fn attention_case(
    name: &str,
    description: &str,
    seq_lengths: &[usize],
    (h, d): (usize, usize),
    causal: bool,
    seed: u64,
    dtype: Dtype,
) -> Result<GoldenCase, GoldenError> {
    let c = AttentionCase::seeded(seq_lengths, h, d, 0, seed);
    let (q, k, v, go) = (
        round3(&c.q, dtype),
        round3(&c.k, dtype),
        round3(&c.v, dtype),
        round3(&c.grad_output, dtype),
    );
    let cu = c.cu_seqlens();
    let scale = default_scale(d);
    let x = Qkv::new(q.view(), k.view(), v.view());
    let p = Varlen::new(&cu, causal, scale);
    let (fwd, grads) = varlen_pass(&ReferenceAttention, x, &p, go.view())?;
    let mut terms = [0.0f64; 5];
    for w in cu.windows(2) {
        let rows = |x: &Array3<f64>| x.slice_axis(Axis(0), Slice::from(w[0]..w[1])).to_owned();
        let t = AttentionTerms::of(
            rows(&q).view(),
            rows(&k).view(),
            rows(&v).view(),
            rows(&go).view(),
            scale,
            causal,
        );
        for (m, x) in terms
            .iter_mut()
            .zip([t.output, t.lse, t.grad_q, t.grad_k, t.grad_v])
        {
            *m = m.max(x);
        }
    }
    let low = (dtype != Dtype::F64).then(|| {
        lowp::attention(
            q.view(),
            k.view(),
            v.view(),
            go.view(),
            &cu,
            causal,
            scale,
            dtype,
        )
    });
    let mut low = low.map(|l| attention_flats(&l).into_iter());
    let n = q.dim().0;
    let nhd = [n, h, d];
    let shapes: [&[usize]; 5] = [&nhd, &[h, n], &nhd, &nhd, &nhd];
    let what = "AttentionTerms";
    let out = |name: &str, shape: &[usize], e: Vec<f64>, t: f64, l: Option<Vec<f64>>| {
        float_output(name, shape, e, dtype, t, what, &l.unwrap_or_default())
    };
    Ok(GoldenCase {
        name: name.into(),
        op: "attention",
        description: description.into(),
        params: params(&[
            ("causal", json!(causal)),
            ("scale", json!(scale)),
            ("want_grad", json!(true)),
        ]),
        inputs: vec![
            Tensor::float("q", &[n, h, d], flat(&q), dtype),
            Tensor::float("k", &[n, h, d], flat(&k), dtype),
            Tensor::float("v", &[n, h, d], flat(&v), dtype),
            Tensor::int(
                "cu_seqlens",
                &[cu.len()],
                cu.iter().map(|&x| x as i64).collect(),
            ),
            Tensor::float("grad_output", &[n, h, d], flat(&go), dtype),
        ],
        outputs: ["output", "lse", "grad_q", "grad_k", "grad_v"]
            .into_iter()
            .zip(shapes)
            .zip(attention_flats(&(fwd, grads)))
            .zip(terms)
            .map(|(((name, shape), e), t)| {
                out(name, shape, e, t, low.as_mut().and_then(Iterator::next))
            })
            .collect(),
    })
}

/// `[output, lse, grad_q, grad_k, grad_v]` of an attention pass, flattened.
fn attention_flats((fwd, grads): &(AttentionOutput, AttentionGrads)) -> [Vec<f64>; 5] {
    [
        flat(&fwd.output),
        flat(&fwd.lse),
        flat(&grads.grad_q),
        flat(&grads.grad_k),
        flat(&grads.grad_v),
    ]
}

mod causal;
mod vocab;
use vocab::{cross_entropy_cases, embedding_cases, linear_cases};
