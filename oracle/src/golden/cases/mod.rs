//! The canonical golden cases: small, seeded, with the docs/FAULTS.md situations
//! in them (empty segments, ignored targets, padded vocabularies, a shard of
//! `-inf`, repeated ids, planted outliers), one or more per `eval` op.

use ndarray::{Array2, Array3, ArrayView2, Axis, Slice};
use packshard_equivalence::attention::AttentionCase;
use packshard_equivalence::fuzz::attention::{AttentionTerms, SegmentOptions};
use packshard_equivalence::vocab::Terms;
use packshard_reference::attention::{
    default_scale, varlen_pass, AttentionGrads, AttentionOutput, ReferenceAttention, Window,
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

/// ALiBi's slopes for 4 heads (Press et al. 2022): `2^(-8 (a + 1) / h)`,
/// exact in every dtype.
const ALIBI_SLOPES_4: [f64; 4] = [0.25, 0.0625, 0.015625, 0.00390625];

/// flash-attention's options together, as Mistral- or Gemma-style models
/// call `flash_attn_varlen_func` on a continuation chunk: 4 query heads over
/// 2 key/value heads, causal, `window_size = (3, 0)`, `softcap = 2.5`
/// (most scores of these inputs lie in the cap's bend, the outliers on its
/// flat part), ALiBi. Segments `(l_q, l_k)`: 3 queries over 7 keys (the
/// window and causal bottom-right: query 0 sees keys 1..=4, a top-left one
/// would see key 0 only), keys without queries, a self segment of 6 (the
/// window cuts its last queries' rows), 4 queries over 2 keys (the first 2
/// see no key: `lse = -inf`, output and gradients 0), one query over 5
/// keys (a decoding step).
const GQA_CROSS_WINDOW: AttentionSpec<'static> = AttentionSpec {
    name: "attention_gqa_cross_window",
    description: "GQA (4 query heads over 2 kv heads), cu_seqlens_q != cu_seqlens_k bottom-right aligned, causal, window_size (3, 0), softcap 2.5, ALiBi; segments of more keys than queries, keys only, more queries than keys (rows that see no key: lse -inf), one query; forward and backward (P2, P8, C5, W1-W4, W6)",
    segments: &[(3, 7), (0, 2), (6, 6), (4, 2), (1, 5)],
    heads: (4, 2, 4),
    causal: true,
    window: Window {
        left: Some(3),
        right: Some(0),
    },
    softcap: 2.5,
    alibi_slopes: Some(&ALIBI_SLOPES_4),
    seed: 33,
};

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
            &AttentionSpec::plain(
                ("attention_varlen", "varlen attention over 5 segments with an empty one, planted outliers, forward and backward (P2, P4)"),
                &[(3, 3), (0, 0), (5, 5), (1, 1), (7, 7)],
                (2, 4),
                false,
                1,
            ),
            dtype,
        )?,
        attention_case(
            &AttentionSpec::plain(
                ("attention_causal", "causal varlen attention over 3 segments, forward and backward"),
                &[(4, 4), (6, 6), (2, 2)],
                (2, 3),
                true,
                2,
            ),
            dtype,
        )?,
        attention_case(&GQA_CROSS_WINDOW, dtype)?,
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

/// One attention case: its segments, heads and flash-attention's options.
struct AttentionSpec<'a> {
    name: &'a str,
    description: &'a str,
    /// `(l_q, l_k)` of each segment. All `l_q == l_k`: the self-attention
    /// form (one input `cu_seqlens`); else `cu_seqlens_q` and `cu_seqlens_k`.
    segments: &'a [(usize, usize)],
    /// `(h, h_kv, d)`: query heads, key/value heads (dividing `h`), head dim.
    heads: (usize, usize, usize),
    /// Bottom-right causal masks.
    causal: bool,
    /// `window_size` (a param when bounded).
    window: Window,
    /// `softcap` (a param when not 0).
    softcap: f64,
    /// `alibi_slopes: [h]` (an input tensor, as `eval` and flash-attention
    /// take it).
    alibi_slopes: Option<&'a [f64]>,
    /// Of the values ([`AttentionCase::seeded_tensors`]).
    seed: u64,
}

impl<'a> AttentionSpec<'a> {
    /// Self-attention over segments of `lengths`, `h` heads of dim `d` (as
    /// keys and values), no option beyond `causal`.
    fn plain(
        (name, description): (&'a str, &'a str),
        segments: &'a [(usize, usize)],
        (h, d): (usize, usize),
        causal: bool,
        seed: u64,
    ) -> Self {
        AttentionSpec {
            name,
            description,
            segments,
            heads: (h, h, d),
            causal,
            window: Window::UNBOUNDED,
            softcap: 0.0,
            alibi_slopes: None,
            seed,
        }
    }
}

fn offsets(lengths: impl Iterator<Item = usize>) -> Vec<usize> {
    let mut cu = vec![0];
    for l in lengths {
        cu.push(cu[cu.len() - 1] + l);
    }
    cu
}

fn ints(xs: &[usize]) -> Vec<i64> {
    xs.iter().map(|&x| x as i64).collect()
}

fn attention_case(spec: &AttentionSpec<'_>, dtype: Dtype) -> Result<GoldenCase, GoldenError> {
    let (h, h_kv, d) = spec.heads;
    let cu_q = offsets(spec.segments.iter().map(|s| s.0));
    let cu_k = offsets(spec.segments.iter().map(|s| s.1));
    let (n, n_k) = (cu_q[cu_q.len() - 1], cu_k[cu_k.len() - 1]);
    let [q, k, v, go] =
        AttentionCase::seeded_tensors((n, n_k), spec.heads, spec.seed).map(|x| round3(&x, dtype));
    let scale = default_scale(d);
    let x = Qkv::new(q.view(), k.view(), v.view());
    let p = Varlen::cross(&cu_q, &cu_k, spec.causal, scale)
        .with_window(spec.window)
        .with_softcap(spec.softcap)
        .with_alibi_slopes(spec.alibi_slopes);
    let (fwd, grads) = varlen_pass(&ReferenceAttention, x, &p, go.view())?;
    let mut terms = [0.0f64; 5];
    for (wq, wk) in cu_q.windows(2).zip(cu_k.windows(2)) {
        let rows = |x: &Array3<f64>, w: &[usize]| {
            x.slice_axis(Axis(0), Slice::from(w[0]..w[1])).to_owned()
        };
        let t = AttentionTerms::of_with(
            rows(&q, wq).view(),
            rows(&k, wk).view(),
            rows(&v, wk).view(),
            rows(&go, wq).view(),
            (scale, spec.causal),
            SegmentOptions {
                window: spec.window,
                softcap: spec.softcap,
                alibi_slopes: spec.alibi_slopes,
                used_keys: None,
            },
        );
        for (m, x) in terms
            .iter_mut()
            .zip([t.output, t.lse, t.grad_q, t.grad_k, t.grad_v])
        {
            *m = m.max(x);
        }
    }
    let low = (dtype != Dtype::F64)
        .then(|| lowp::attention(q.view(), k.view(), v.view(), go.view(), &p, dtype));
    let mut low = low.map(|l| attention_flats(&l).into_iter());
    let (nhd, khd) = ([n, h, d], [n_k, h_kv, d]);
    let shapes: [&[usize]; 5] = [&nhd, &[h, n], &nhd, &khd, &khd];
    let what = "AttentionTerms";
    let out = |name: &str, shape: &[usize], e: Vec<f64>, t: f64, l: Option<Vec<f64>>| {
        float_output(name, shape, e, dtype, t, what, &l.unwrap_or_default())
    };
    let mut pairs = vec![("causal", json!(spec.causal)), ("scale", json!(scale))];
    if !spec.window.is_unbounded() {
        let (left, right) = spec.window.to_flash();
        pairs.push(("window_size", json!([left, right])));
    }
    if spec.softcap != 0.0 {
        pairs.push(("softcap", json!(spec.softcap)));
    }
    pairs.push(("want_grad", json!(true)));
    let mut inputs = vec![
        Tensor::float("q", &nhd, flat(&q), dtype),
        Tensor::float("k", &khd, flat(&k), dtype),
        Tensor::float("v", &khd, flat(&v), dtype),
    ];
    if p.is_self() {
        inputs.push(Tensor::int("cu_seqlens", &[cu_q.len()], ints(&cu_q)));
    } else {
        inputs.push(Tensor::int("cu_seqlens_q", &[cu_q.len()], ints(&cu_q)));
        inputs.push(Tensor::int("cu_seqlens_k", &[cu_k.len()], ints(&cu_k)));
    }
    if let Some(a) = spec.alibi_slopes {
        inputs.push(Tensor::float("alibi_slopes", &[h], a.to_vec(), dtype));
    }
    inputs.push(Tensor::float("grad_output", &nhd, flat(&go), dtype));
    Ok(GoldenCase {
        name: spec.name.into(),
        op: "attention",
        description: spec.description.into(),
        params: params(&pairs),
        inputs,
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
