//! The cases `packshard.testing` runs a user's kernel on: the equivalence
//! crate's fuzz cases (`packshard_equivalence::fuzz`), drawn exactly as
//! the default Rust checks draw them (`fuzz_budgeted`: input `i` of a seed is
//! [`input_bytes`], small cases first, then a bounded number of large,
//! tile- and chunk-crossing ones), so sizes that are not powers of two, empty
//! segments, planted outliers, ignored targets, `-inf` logits, padded and
//! uneven vocabularies, NaN padding and out-of-range targets come as the Rust
//! suites make them. Attention cases come from the default checks' size
//! schedule ([`generate_attention`]: small cases first, then large ones with
//! a segment of 1,023 to 1,100 tokens, grouped-query heads, cross segments
//! and causal masks); offsets the fuzz body malforms on purpose are
//! replaced by the segments' own (a kernel under test gets well-formed
//! input; bad input is the oracle's own business).

use ndarray::Array2;
use packshard_equivalence::fuzz::attention::AttentionFuzzCase;
use packshard_equivalence::fuzz::schedule::{budgeted_input, Budget};
use packshard_equivalence::fuzz::vocab::{CeFuzzCase, EmbeddingFuzzCase, LinearFuzzCase};
use packshard_oracle::eval::EvalError;
use packshard_reference::vocab::{LossConfig, ShardMap};

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

/// The loss options and sharding of a case, as docs/INTERFACE.md names them:
/// `softcap` only where the case has one, `grad_output` only with
/// `want_grad` and where the case has one (`[n]` under the reduction
/// `none`, `[1]` otherwise: docs/FAULTS.md O2).
fn loss_args(
    out: &mut Fields,
    map: &ShardMap,
    c: &LossConfig,
    want_grad: bool,
    grad_output: Option<&[f64]>,
) {
    out.push(("ignore_index", Out::I64(c.ignore_index)));
    out.push(("label_smoothing", Out::F64(c.label_smoothing)));
    out.push(("smoothing", Out::Str(c.smoothing.name().into())));
    out.push(("z_loss", Out::F64(c.z_loss)));
    out.push(("reduction", Out::Str(c.reduction.name().into())));
    if let Some(s) = c.softcap {
        out.push(("softcap", Out::F64(s)));
    }
    sharding(out, map);
    out.push(("want_grad", Out::Bool(want_grad)));
    if let Some(g) = grad_output.filter(|_| want_grad) {
        let g = ndarray::Array1::from(g.to_vec()).into_dyn();
        out.push(("grad_output", Out::Tensor(g)));
    }
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
/// `max_seqlen_k`, `causal` (bottom-right), `scale` (absent in a quarter
/// of the cases: the kernel's default, 1/sqrt(d)), `want_grad` (false, and
/// no `grad_output`, in the forward-only cases), and
/// when drawn `window_size` (`[left, right]`), `softcap`, `alibi_slopes`
/// (`[h]` float64) and `seqused_k` (`[b]` int64). Offsets
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
    let mut args = vec![
        ("q", t(&f.q)),
        ("k", t(&f.k)),
        ("v", t(&f.v)),
        ("cu_seqlens_q", ints(f.cu_seqlens_q())),
        ("cu_seqlens_k", ints(f.cu_seqlens_k())),
        ("cu_seqlens", ints(f.cu_seqlens_q())),
        ("max_seqlen_q", Out::Usize(max(0).unwrap_or(0))),
        ("max_seqlen_k", Out::Usize(max(1).unwrap_or(0))),
        ("causal", Out::Bool(f.causal)),
    ];
    // No `scale` in a quarter of the cases (flash-attention's
    // `softmax_scale=None`: the kernel defaults to 1/sqrt(d)); no
    // `grad_output` in the forward-only ones (AttentionFuzzCase's
    // `default_scale`, `want_grad`).
    if !f.default_scale {
        args.push(("scale", Out::F64(f.scale)));
    }
    if f.want_grad {
        args.push(("grad_output", t(&f.grad_output)));
    }
    args.push(("want_grad", Out::Bool(f.want_grad)));
    // flash-attention's options, each only when the case draws it (a
    // kernel that does not take one is given the cases without it).
    let o = &f.options;
    if !o.window.is_unbounded() {
        let (left, right) = o.window.to_flash();
        args.push(("window_size", Out::Ints(vec![left, right])));
    }
    if o.softcap != 0.0 {
        args.push(("softcap", Out::F64(o.softcap)));
    }
    if let Some(a) = &o.alibi_slopes {
        let t = ndarray::Array1::from(a.clone()).into_dyn();
        args.push(("alibi_slopes", Out::Tensor(t)));
    }
    if let Some(u) = &o.seqused_k {
        args.push(("seqused_k", ints(u.clone())));
    }
    let size = 2 * (f.q.len() + f.k.len());
    Some((args, f.describe(), size))
}

/// `n` attention cases of `seed` under the default checks' schedule: the
/// inputs of `fuzz_budgeted(Budget { cases: n, large }, seed, ..)`, small
/// cases first, the last `large` large (default: `Budget::DEFAULT`'s share,
/// 12 in 100, rounded down). Case `i` is `budgeted input i of seed s`.
pub fn generate_attention(n: usize, seed: u64, large: Option<usize>) -> Vec<GenCase> {
    let budget = budget(n, large);
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
/// The budget of a run of `n` cases, `large` of them large (`None`: the
/// default's share, 12 in 100, rounded down; at most `n`).
pub fn budget(n: usize, large: Option<usize>) -> Budget {
    let d = Budget::DEFAULT;
    let large = large.unwrap_or(n * d.large / d.cases).min(n);
    Budget { cases: n, large }
}

/// The bytes of input `i` of `seed` under `budget`: the input
/// `fuzz_budgeted(budget, seed, ..)` gives its body (so a failing case of
/// the Python package is `budgeted input i of seed s` in Rust too).
pub fn input_bytes(budget: &Budget, seed: u64, i: usize) -> Vec<u8> {
    budgeted_input(budget, seed, i)
}

/// `n` cases of `op` from `seed`, `large` of them large (see [`budget`] and
/// the module docs).
///
/// # Errors
/// `unknown_op` for an op without generated cases.
pub fn generate(
    op: &str,
    n: usize,
    seed: u64,
    large: Option<usize>,
) -> Result<Vec<GenCase>, EvalError> {
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
        return Ok(generate_attention(n, seed, large));
    }
    let budget = budget(n, large);
    let mut out = Vec::with_capacity(n);
    // Every loss and embedding input gives a case: inputs 0..n. At most one
    // attention input in 16 is malformed and skipped: 4n inputs are plenty
    // (those past `n` are large, as `Budget::class_of` gives them).
    for input in 0..n.saturating_mul(4).max(16) {
        if out.len() == n {
            break;
        }
        let buf = input_bytes(&budget, seed, input);
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
            let a = generate(op, 40, 7, None).unwrap();
            let b = generate(op, 40, 7, None).unwrap();
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
        let ce = generate("cross_entropy", 200, 1, None).unwrap();
        let padded = ce.iter().filter(|c| c.describe.contains("padded")).count();
        assert!(padded > 0, "no padded vocabulary among 200 cases");
        assert!(generate("bert", 1, 0, None).is_err());
    }

    fn field<'a>(c: &'a GenCase, name: &str) -> Option<&'a Out> {
        c.args.iter().find(|(k, _)| *k == name).map(|(_, v)| v)
    }

    /// The default of `packshard.testing` (100 cases of seed 0) reaches a
    /// vocabulary past 4096, a softcap and a per-token `grad_output` (`[n]`
    /// under the reduction `none`, given only with `want_grad`), as
    /// `fuzz_budgeted(Budget::DEFAULT, 0, ..)` does; `large` is honoured.
    #[test]
    fn loss_cases_are_the_default_budget() {
        for op in ["cross_entropy", "linear_cross_entropy"] {
            let cs = generate(op, 100, 0, None).unwrap();
            assert_eq!(cs.len(), 100);
            let (mut wide, mut softcap, mut per_token) = (false, false, false);
            for c in &cs {
                let Some(Out::Usize(v)) = field(c, "vocab_size") else {
                    panic!("{op}: no vocab_size")
                };
                wide |= *v >= 4097;
                softcap |= field(c, "softcap").is_some();
                let Some(Out::Ints(t)) = field(c, "targets") else {
                    panic!("{op}: no targets")
                };
                let want = matches!(field(c, "want_grad"), Some(Out::Bool(true)));
                if let Some(Out::Tensor(g)) = field(c, "grad_output") {
                    assert!(want, "{op}: grad_output without want_grad");
                    let none = matches!(field(c, "reduction"), Some(Out::Str(r)) if r == "none");
                    assert_eq!(g.len(), if none { t.len() } else { 1 }, "{op}");
                    per_token |= none && t.len() > 1;
                }
            }
            assert!(
                wide && softcap && per_token,
                "{op}: {wide} {softcap} {per_token}"
            );
            let v = |c: &GenCase| match field(c, "vocab_size") {
                Some(Out::Usize(v)) => *v,
                _ => 0,
            };
            // The first 88 are small (at most 64 entries, `MAX_V`), the
            // rest large (a cross-entropy's at least 127, a boundary of 128;
            // an output layer's many-token shape may have fewer), as in Rust.
            if op == "linear_cross_entropy" {
                assert!(cs[..88].iter().all(|c| v(c) <= 64));
                continue;
            }
            assert!(cs[..88].iter().all(|c| v(c) <= 64));
            assert!(cs[88..].iter().all(|c| v(c) >= 127));
            let all_large = generate(op, 4, 0, Some(4)).unwrap();
            assert!(all_large.iter().all(|c| v(c) >= 127));
        }
    }
}
