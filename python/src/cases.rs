//! The cases `packshard.testing` runs a user's kernel on: the equivalence
//! crate's fuzz cases (`packshard_equivalence::fuzz`), drawn exactly as
//! `fuzz_random` draws them (ChaCha8 from the seed, byte strings of
//! `0..=MAX_RANDOM_INPUT` bytes), so sizes that are not powers of two, empty
//! segments, planted outliers, ignored targets, `-inf` logits, padded and
//! uneven vocabularies, NaN padding and out-of-range targets come as the Rust
//! suites make them. Attention cases come from the default checks' size
//! schedule ([`generate_attention`]: small cases first, then large ones with
//! a segment of 1,023 to 1,100 tokens, grouped-query heads, cross segments
//! and causal masks); offsets the fuzz body malforms on purpose are
//! replaced by the segments' own (a kernel under test gets well-formed
//! input; bad input is the oracle's own business).

use ndarray::{Array1, Array2};
use packshard_equivalence::fuzz::attention::AttentionFuzzCase;
use packshard_equivalence::fuzz::schedule::{budgeted_input, Budget};
use packshard_equivalence::fuzz::vocab::{CeFuzzCase, EmbeddingFuzzCase, LinearFuzzCase};
use packshard_equivalence::fuzz::MAX_RANDOM_INPUT;
use packshard_oracle::eval::EvalError;
use packshard_reference::vocab::{LossConfig, ShardMap};
use rand::{Rng, SeedableRng};

use crate::core::{Fields, Out};

/// One generated case: the op's arguments (named as in docs/INTERFACE.md),
/// a one-line description, and its size (elements of its tensors, to pick
/// the smallest failing case).
#[derive(Debug, Clone)]
pub struct GenCase {
    /// The op's keyword arguments.
    pub args: Fields,
    /// Sizes, options and planted values.
    pub describe: String,
    /// Elements of its tensors.
    pub size: usize,
    /// Which random input of the seed it is (`random input i of seed s`).
    pub input: usize,
}

/// The ops [`generate`] knows.
pub const OPS: [&str; 4] = [
    "attention",
    "cross_entropy",
    "linear_cross_entropy",
    "embedding",
];

/// The loss options of a case as keyword arguments; `softcap` and
/// `grad_output` (`[n]` under the reduction `none`, `[1]` otherwise) only
/// when the case has them (the large cases draw both).
fn loss_args(
    out: &mut Fields,
    map: &ShardMap,
    c: &LossConfig,
    want_grad: bool,
    grad_output: Option<&[f64]>,
) {
    if let Some(cap) = c.softcap {
        out.push(("softcap", Out::F64(cap)));
    }
    if let (true, Some(g)) = (want_grad, grad_output) {
        out.push((
            "grad_output",
            Out::Tensor(Array1::from(g.to_vec()).into_dyn()),
        ));
    }
    out.push(("ignore_index", Out::I64(c.ignore_index)));
    out.push(("label_smoothing", Out::F64(c.label_smoothing)));
    out.push(("smoothing", Out::Str(c.smoothing.name().into())));
    out.push(("z_loss", Out::F64(c.z_loss)));
    out.push(("reduction", Out::Str(c.reduction.name().into())));
    sharding(out, map);
    out.push(("want_grad", Out::Bool(want_grad)));
}

fn sharding(out: &mut Fields, map: &ShardMap) {
    out.push(("vocab_size", Out::Usize(map.vocab_size())));
    out.push(("num_shards", Out::Usize(map.num_shards())));
    out.push(("layout", Out::Str(map.layout().name().into())));
}

fn t2(a: &Array2<f64>) -> Out {
    Out::Tensor(a.clone().into_dyn())
}

/// The case the byte string `data` describes for `op`, `None` for an
/// attention case with a malformed `cu_seqlens`.
fn case_of(op: &str, data: &[u8]) -> Option<(Fields, String, usize)> {
    match op {
        "attention" => attention_case(data),
        "cross_entropy" => {
            let f = CeFuzzCase::from_bytes(data).ok()?;
            let c = &f.case;
            let mut args = vec![
                ("logits", t2(&c.logits)),
                ("targets", Out::Ints(c.targets.clone())),
            ];
            loss_args(
                &mut args,
                &c.map,
                &c.config,
                f.want_grad,
                c.grad_output.as_deref(),
            );
            Some((args, f.describe(), c.logits.len()))
        }
        "linear_cross_entropy" => {
            let f = LinearFuzzCase::from_bytes(data).ok()?;
            let c = &f.case;
            let mut args = vec![
                ("hidden", t2(&c.hidden)),
                ("weight", t2(&c.weight)),
                ("targets", Out::Ints(c.targets.clone())),
            ];
            loss_args(
                &mut args,
                &c.map,
                &c.config,
                f.want_grad,
                c.grad_output.as_deref(),
            );
            Some((args, f.describe(), c.hidden.len() + c.weight.len()))
        }
        "embedding" => {
            let f = EmbeddingFuzzCase::from_bytes(data).ok()?;
            let c = &f.case;
            let mut args = vec![
                ("ids", Out::Ints(c.ids.clone())),
                ("weight", t2(&c.weight)),
                ("grad_output", t2(&c.grad_output)),
            ];
            sharding(&mut args, &c.map);
            args.push(("want_grad", Out::Bool(true)));
            Some((args, f.describe(), c.weight.len() + c.grad_output.len()))
        }
        _ => None,
    }
}

/// The attention case `data` describes, in flash_attn_varlen_func's names:
/// `q, grad_output: [n_q, h, d]`, `k, v: [n_k, h_kv, d]`, `cu_seqlens_q`,
/// `cu_seqlens_k` (int64, `[b + 1]`), `cu_seqlens` (= `cu_seqlens_q`, the
/// self-attention form existing kernels take), `max_seqlen_q`,
/// `max_seqlen_k`, `causal` (bottom-right), `scale`, `want_grad`. Offsets
/// the fuzz body malforms on purpose are replaced by the segments' own (a
/// kernel under test gets well-formed input).
fn attention_case(data: &[u8]) -> Option<(Fields, String, usize)> {
    let mut f = AttentionFuzzCase::from_bytes(data).ok()?;
    f.malformed = None;
    let ints = |cu: Vec<usize>| Out::Ints(cu.into_iter().map(|x| x as i64).collect());
    let max = |i: usize| {
        f.segments
            .iter()
            .map(|s| if i == 0 { s.0 } else { s.1 })
            .max()
    };
    let t = |x: &ndarray::Array3<f64>| Out::Tensor(x.clone().into_dyn());
    let args = vec![
        ("q", t(&f.q)),
        ("k", t(&f.k)),
        ("v", t(&f.v)),
        ("cu_seqlens_q", ints(f.cu_seqlens_q())),
        ("cu_seqlens_k", ints(f.cu_seqlens_k())),
        ("cu_seqlens", ints(f.cu_seqlens_q())),
        ("max_seqlen_q", Out::Usize(max(0).unwrap_or(0))),
        ("max_seqlen_k", Out::Usize(max(1).unwrap_or(0))),
        ("causal", Out::Bool(f.causal)),
        ("scale", Out::F64(f.scale)),
        ("grad_output", t(&f.grad_output)),
        ("want_grad", Out::Bool(true)),
    ];
    let size = 2 * (f.q.len() + f.k.len());
    Some((args, f.describe(), size))
}

/// `n` attention cases of `seed` under the default checks' schedule: the
/// inputs of `fuzz_budgeted(Budget { cases: n, large }, seed, ..)`, small
/// cases first, the last `large` large (default: `Budget::DEFAULT`'s share,
/// 12 in 100, rounded down). Case `i` is `budgeted input i of seed s`.
pub fn generate_attention(n: usize, seed: u64, large: Option<usize>) -> Vec<GenCase> {
    let d = Budget::DEFAULT;
    let large = large.unwrap_or(n * d.large / d.cases).min(n);
    let budget = Budget { cases: n, large };
    (0..n)
        .filter_map(|input| {
            let data = budgeted_input(&budget, seed, input);
            let (args, describe, size) = attention_case(&data)?;
            Some(GenCase {
                args,
                describe,
                size,
                input,
            })
        })
        .collect()
}

/// `n` cases of `op` from `seed` (see the module docs; attention through
/// [`generate_attention`] at its default share of large cases).
///
/// # Errors
/// `unknown_op` for an op without generated cases.
pub fn generate(op: &str, n: usize, seed: u64) -> Result<Vec<GenCase>, EvalError> {
    if !OPS.contains(&op) {
        return Err(EvalError::new(
            "unknown_op",
            format!(
                "op: no generated cases for {op:?}; known: {}",
                OPS.join(", ")
            ),
        ));
    }
    if op == "attention" {
        return Ok(generate_attention(n, seed, None));
    }
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut out = Vec::with_capacity(n);
    let mut buf = Vec::with_capacity(MAX_RANDOM_INPUT);
    // At most one attention input in 16 is malformed: 4n inputs are plenty.
    for input in 0..n.saturating_mul(4).max(16) {
        if out.len() == n {
            break;
        }
        let len = rng.random_range(0..=MAX_RANDOM_INPUT);
        buf.clear();
        buf.extend((0..len).map(|_| rng.random::<u8>()));
        if let Some((args, describe, size)) = case_of(op, &buf) {
            out.push(GenCase {
                args,
                describe,
                size,
                input,
            });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cases_are_deterministic_and_varied() {
        for op in OPS {
            let a = generate(op, 40, 7).unwrap();
            let b = generate(op, 40, 7).unwrap();
            assert_eq!(a.len(), 40, "{op}");
            assert_eq!(
                a.iter().map(|c| &c.describe).collect::<Vec<_>>(),
                b.iter().map(|c| &c.describe).collect::<Vec<_>>()
            );
            // Not one shape over and over.
            let sizes: std::collections::BTreeSet<usize> = a.iter().map(|c| c.size).collect();
            assert!(sizes.len() > 10, "{op}: sizes {sizes:?}");
        }
        // Attention: the schedule's large cases last, GQA and cross among them.
        let at = generate_attention(100, 0, None);
        assert_eq!(at.len(), 100);
        assert!(at[..88].iter().all(|c| c.describe.starts_with("Small")));
        assert!(at[88..].iter().all(|c| c.describe.starts_with("Large")));
        let gqa = at
            .iter()
            .filter(|c| match (&c.args[0].1, &c.args[1].1) {
                (Out::Tensor(q), Out::Tensor(k)) => q.shape()[1] != k.shape()[1],
                _ => false,
            })
            .count();
        let cross = at.iter().filter(|c| c.args[3].1 != c.args[4].1).count();
        assert!(gqa >= 20 && cross >= 15, "{gqa} GQA, {cross} cross");
        assert_eq!(generate_attention(10, 0, Some(10)).len(), 10);
        let ce = generate("cross_entropy", 200, 1).unwrap();
        let padded = ce.iter().filter(|c| c.describe.contains("padded")).count();
        assert!(padded > 0, "no padded vocabulary among 200 cases");
        assert!(generate("bert", 1, 0).is_err());
    }
}
