//! The cases `packshard.testing` runs a user's kernel on: the equivalence
//! crate's fuzz cases (`packshard_equivalence::fuzz`), drawn exactly as
//! `fuzz_random` draws them (ChaCha8 from the seed, byte strings of
//! `0..=MAX_RANDOM_INPUT` bytes), so sizes that are not powers of two, empty
//! segments, planted outliers, ignored targets, `-inf` logits, padded and
//! uneven vocabularies, NaN padding and out-of-range targets come as the Rust
//! suites make them. Attention cases whose `cu_seqlens` the fuzz body
//! malforms on purpose are left out (a kernel under test gets well-formed
//! input; bad input is the oracle's own business).

use ndarray::Array2;
use packshard_equivalence::fuzz::attention::AttentionFuzzCase;
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

fn loss_args(out: &mut Fields, map: &ShardMap, c: &LossConfig, want_grad: bool) {
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
        "attention" => {
            let f = AttentionFuzzCase::from_bytes(data).ok()?;
            if !f.well_formed() {
                return None;
            }
            let c = &f.case;
            let describe = f.describe();
            let size = 4 * c.q.len();
            let cu = c.cu_seqlens().iter().map(|&x| x as i64).collect();
            let args = vec![
                ("q", Out::Tensor(c.q.clone().into_dyn())),
                ("k", Out::Tensor(c.k.clone().into_dyn())),
                ("v", Out::Tensor(c.v.clone().into_dyn())),
                ("cu_seqlens", Out::Ints(cu)),
                ("scale", Out::F64(c.scale)),
                ("grad_output", Out::Tensor(c.grad_output.clone().into_dyn())),
                ("want_grad", Out::Bool(true)),
            ];
            Some((args, describe, size))
        }
        "cross_entropy" => {
            let f = CeFuzzCase::from_bytes(data).ok()?;
            let c = &f.case;
            let mut args = vec![
                ("logits", t2(&c.logits)),
                ("targets", Out::Ints(c.targets.clone())),
            ];
            loss_args(&mut args, &c.map, &c.config, f.want_grad);
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
            loss_args(&mut args, &c.map, &c.config, f.want_grad);
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

/// `n` cases of `op` from `seed` (see the module docs).
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
        let ce = generate("cross_entropy", 200, 1).unwrap();
        let padded = ce.iter().filter(|c| c.describe.contains("padded")).count();
        assert!(padded > 0, "no padded vocabulary among 200 cases");
        assert!(generate("bert", 1, 0).is_err());
    }
}
