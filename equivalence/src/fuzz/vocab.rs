//! Vocabulary-parallel cross-entropy, output layer and embedding against the
//! unsharded f64 reference on arbitrary cases (docs/FAULTS.md V1–V6), for every
//! algorithm an implementation has.
//!
//! The first byte of an input is its [`SizeClass`]. A small case draws the
//! split first (`v` in `1..=MAX_V`, primes weighted up; `p`
//! in `1..=min(MAX_P, v)`; uneven or padded layout), then `n`, the loss
//! options (`ignore_index` -100, -1 or a real class; label smoothing in
//! either convention; z-loss; every reduction; with or without gradients),
//! then values: logits in the bytes' style with `-inf` (masked entries),
//! planted `±1e4` and `±1e8`, whole shards masked to `-inf` on some rows
//! (V6), padding columns holding NaN, `inf` or anything (V2), targets on
//! every shard, ignored targets and, rarely, out-of-range targets and ids
//! (V5) that must be the reference's error; last, from one trailing byte
//! (a missing byte reads 0: nothing, so a stored input means the case it
//! did), a softcap a
//! third of the time and an upstream `grad_output` (`[n]` under `none`,
//! else `[1]`) half of the time gradients are asked for ([`small_tail`]).
//! Each case goes through
//! [`crate::vocab::check_cross_entropy`], [`crate::vocab::check_linear`] or
//! [`crate::vocab::check_embedding`]: the suite's [`crate::vocab::TERMS`]
//! rule, exact zeros on padding, the barrier counts, and no panic.
//!
//! A large case (module `large`) draws vocabularies at the chunk boundaries
//! of 128 to 4096 entries up to [`LARGE_MAX_V`], token counts that leave
//! partial token chunks, every option (a softcap, a per-token `grad_output`)
//! likely, the work bounded by [`CE_WORK`], [`LINEAR_WORK`] and
//! [`EMBEDDING_WORK`].

use arbitrary::{Arbitrary, Unstructured};
use ndarray::{Array2, Axis, Slice};
use packshard_reference::vocab::{
    cross_entropy, LossCall, LossConfig, Reduction, ShardLayout, ShardMap, SmoothingConvention,
};

use super::schedule::{slot, SizeClass};
use super::values::{plants, Gen};
use super::{brief, Failure, Outcome};
use crate::compare::Judge;

mod large;
#[cfg(test)]
mod tests;
use crate::compare::Mismatch;
use crate::vocab::{
    check_cross_entropy_unsharded, check_cross_entropy_with, check_embedding,
    check_linear_unsharded, check_linear_with, take_worst_ulps, CeCase, EmbeddingCase, LinearCase,
    Rule,
};
pub use large::{
    wide_slot, CE_WORK, EMBEDDING_WORK, LARGE_MAX_N, LARGE_MAX_V, LINEAR_WEIGHT, LINEAR_WORK,
    LONG_MAX_H, LONG_N, SLOT_PERIOD, WIDE_MAX_N, WIDE_SLOTS, WIDE_V,
};
use packshard_reference::ops::{CrossEntropyOp, EmbeddingOp, LinearCrossEntropyOp};

/// Largest vocabulary of a small case.
pub const MAX_V: usize = 64;
/// Most shards (small and large cases).
pub const MAX_P: usize = 8;
/// Most tokens of a small case.
pub const MAX_N: usize = 12;
/// Largest hidden size of a small case (output layer, embedding).
pub const MAX_H: usize = 8;

const PRIMES: [usize; 18] = [
    1, 2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 61,
];

fn shard_map(u: &mut Unstructured<'_>) -> arbitrary::Result<ShardMap> {
    let v = if u.arbitrary::<u8>()? % 2 == 0 {
        PRIMES[u.choose_index(PRIMES.len())?]
    } else {
        u.int_in_range(1..=MAX_V)?
    };
    shards_of(u, v)
}

/// A shard map of `v` entries: `p` in `1..=MAX_P` (at most `v`), padded or
/// uneven (small and large cases alike).
fn shards_of(u: &mut Unstructured<'_>, v: usize) -> arbitrary::Result<ShardMap> {
    let p = u.int_in_range(1..=v.min(MAX_P))?;
    let layout = if u.arbitrary::<bool>()? {
        ShardLayout::Padded
    } else {
        ShardLayout::Uneven
    };
    Ok(ShardMap::new(v, p, layout).expect("1 <= p <= v"))
}

fn loss_config(u: &mut Unstructured<'_>, v: usize) -> arbitrary::Result<LossConfig> {
    let ignore_index = match u.arbitrary::<u8>()? % 4 {
        0 => -1,
        1 => (u.arbitrary::<u8>()? as usize % v) as i64,
        _ => -100,
    };
    let label_smoothing = match u.arbitrary::<u8>()? % 6 {
        0 => 0.1,
        1 => 0.5,
        2 => 1.0,
        3 => f64::from(u.arbitrary::<u16>()?) / f64::from(u16::MAX),
        _ => 0.0,
    };
    let smoothing = if u.arbitrary::<bool>()? {
        SmoothingConvention::Megatron
    } else {
        SmoothingConvention::PyTorch
    };
    let z_loss = match u.arbitrary::<u8>()? % 6 {
        0 => 1e-4,
        1 => 0.1,
        2 => f64::from(u.arbitrary::<u16>()?) / f64::from(u16::MAX) * 0.1,
        _ => 0.0,
    };
    let reduction = [Reduction::Mean, Reduction::Sum, Reduction::None][u.choose_index(3)?];
    Ok(LossConfig {
        ignore_index,
        label_smoothing,
        smoothing,
        z_loss,
        reduction,
        // The softcap is the suites' (equivalence::vocab): a byte read here
        // would move every stored fuzz case.
        softcap: None,
    })
}

/// What a small case draws last, from one trailing byte `b` (0, the value
/// of a missing byte, draws nothing, so the stored inputs read before this
/// byte was added describe the cases they did):
/// - where `b % 3 == 1`, the softcap (1, 30 or in `[0.5, 50]` from `gen`, as
///   a large case's: the zoo's `softcap_no_chain`);
/// - where gradients are asked for and `b / 3 % 2 == 1`, an upstream
///   gradient as [`large::grads`] draws one (`[n]` under `none`, else `[1]`:
///   the zoo's `upstream_scalar`).
///
/// Not drawn yet: small cases of 33 to 70 tokens (past a token chunk of
/// 32, the zoo's `mean_per_chunk`, `token_tail_dropped`). Tried: the f64
/// reference's sharded and unsharded results then differ by up to 0.79 of
/// [`crate::vocab::TERMS`] (seed 2, input 557: 55 tokens, smoothing 1,
/// planted +-100), past the 0.5 `equivalence/tests/fuzz.rs` holds them to;
/// the terms of such sums want a look first.
fn small_tail(
    u: &mut Unstructured<'_>,
    gen: &mut Gen,
    n: usize,
    config: &mut LossConfig,
    want_grad: bool,
) -> arbitrary::Result<Option<Vec<f64>>> {
    let b = u.arbitrary::<u8>()?;
    config.softcap = (b % 3 == 1).then(|| match gen.below(3) {
        0 => 1.0,
        1 => 30.0,
        _ => gen.uniform(0.5, 50.0),
    });
    Ok((want_grad && b / 3 % 2 == 1).then(|| large::upstream(gen, n, config.reduction)))
}

/// The split ([`shard_map`]), then the tokens `n` in `min_n..=MAX_N`: `(map,
/// v, w, n)` with `w` the padded vocabulary size.
fn split_and_tokens(
    u: &mut Unstructured<'_>,
    min_n: usize,
) -> arbitrary::Result<(ShardMap, usize, usize, usize)> {
    let map = shard_map(u)?;
    let (v, w) = (map.vocab_size(), map.padded_vocab_size());
    let n = u.int_in_range(min_n..=MAX_N)?;
    Ok((map, v, w, n))
}

/// Targets: mostly real classes (on every shard), `ignore_index` about one
/// in five, and about one in 128 out of range (`v` or -5).
fn targets(
    u: &mut Unstructured<'_>,
    gen: &mut Gen,
    n: usize,
    v: usize,
    ignore: i64,
) -> arbitrary::Result<Vec<i64>> {
    (0..n)
        .map(|_| {
            let b = u.arbitrary::<u8>()?;
            Ok(match b {
                0 => v as i64,
                1 => -5,
                _ if b % 5 == 0 => ignore,
                _ => gen.below(v) as i64,
            })
        })
        .collect()
}

/// What a padding column or row holds: anything, it must never be read.
fn padding_value(gen: &mut Gen) -> f64 {
    match gen.below(4) {
        0 => f64::NAN,
        1 => f64::INFINITY,
        2 => 1e4,
        _ => gen.value(4.0),
    }
}

/// The split, for failure reports: `v {v}, p {p}, {layout}: {shards}`
/// (`ShardMap::describe`, which names the layout once).
fn describe_split(map: &ShardMap) -> String {
    map.describe()
}

/// `from_bytes` for each fuzz case type.
macro_rules! from_bytes {
    ($($case:ty),*) => {$(
        impl $case {
            /// The case `data` describes (every byte string describes one):
            /// its first byte the [`SizeClass`], the rest as the class reads
            /// them (small: the layout of the generator before size classes,
            /// so an input of that layout keeps its case behind a `0x00`).
            ///
            /// # Errors
            /// Never in practice: bytes that run out read as zeros.
            pub fn from_bytes(data: &[u8]) -> arbitrary::Result<Self> {
                Self::arbitrary(&mut Unstructured::new(data))
            }
        }
    )*};
}

from_bytes!(CeFuzzCase, LinearFuzzCase, EmbeddingFuzzCase);

fn describe_config(c: &LossConfig) -> String {
    let softcap = c
        .softcap
        .map_or(String::new(), |s| format!(", softcap {s}"));
    format!(
        "ignore_index {}, label_smoothing {} ({}), z_loss {}, reduction {}{softcap}",
        c.ignore_index,
        c.label_smoothing,
        c.smoothing.name(),
        c.z_loss,
        c.reduction.name()
    )
}

/// An arbitrary loss case `C` with `want_grad`: [`CeFuzzCase`],
/// [`LinearFuzzCase`].
#[derive(Debug, Clone, PartialEq)]
pub struct LossFuzzCase<C> {
    /// The split, the tensors, targets, options.
    pub case: C,
    /// Whether gradients are asked for.
    pub want_grad: bool,
    /// How the values were drawn and what was planted, for reports.
    pub values: String,
}

/// An arbitrary cross-entropy case (the split, logits `[n, w]`, targets,
/// options) with `want_grad`.
pub type CeFuzzCase = LossFuzzCase<CeCase>;

/// An arbitrary output-layer case (the split, hidden `[n, h]`, weight `[w,
/// h]`, targets, options) with `want_grad`.
pub type LinearFuzzCase = LossFuzzCase<LinearCase>;

impl<C> LossFuzzCase<C> {
    /// A one-line description for failure reports, of a case on `map` with
    /// `call`'s targets and options, `sizes` after `n` (e.g. `, h 3`).
    fn describe_loss(&self, map: &ShardMap, call: &LossCall<'_>, sizes: &str) -> String {
        let upstream = match call.grad.upstream() {
            Some(g) => format!(", grad_output {}", brief(g)),
            None => String::new(),
        };
        format!(
            "{}, n {}{sizes}, targets {}, {}, want_grad {}{upstream}; {}",
            describe_split(map),
            call.targets.len(),
            brief(call.targets),
            describe_config(call.config),
            self.want_grad,
            self.values
        )
    }
}

/// `values` (how the values were drawn) followed by what was `planted`
/// (the first 8, and a count).
fn with_planted(mut values: String, planted: &[String]) -> String {
    if planted.len() > 8 {
        let more = format!("... ({} in all)", planted.len());
        values.push_str(&format!("; planted {}, {more}", planted[..8].join(", ")));
    } else if !planted.is_empty() {
        values.push_str(&format!("; planted {}", planted.join(", ")));
    }
    values
}

/// The cell of a `rows x cols` matrix (both non-zero) a plant drawn at `at`
/// lands on: the flat index `at % (rows cols)` in row-major order, so the
/// bytes can steer a plant onto any cell (of a matrix of up to 65,536
/// cells, under the 16-bit `at`).
fn plant_at(at: usize, rows: usize, cols: usize) -> (usize, usize) {
    ((at / cols) % rows, at % cols)
}

/// A linear case's plant from its choice byte: `(true, x)` into `hidden` on
/// an even byte, `(false, x)` into `weight` on an odd one; `x` is 100,
/// -100 or 0 by `choice / 2 % 3` (so bytes 0 to 5 give each pair once).
fn linear_plant(choice: u8) -> (bool, f64) {
    (
        choice.is_multiple_of(2),
        [100.0, -100.0, 0.0][choice as usize / 2 % 3],
    )
}

/// The `x`-th distinct id of an embedding case of `v` rows: `7919 x mod
/// v`, consecutive ones a prime stride apart, so a few distinct ids do not
/// sit in one run of rows (one shard).
fn spread_id(x: usize, v: usize) -> usize {
    (x * 7919) % v
}

impl<'a> Arbitrary<'a> for CeFuzzCase {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        let first = u.arbitrary::<u8>()?;
        let class = SizeClass::of(&[first]);
        let wide = large::wide_slot(slot(&[first])).filter(|_| class == SizeClass::Large);
        let (map, v, w, n) = match (class, wide) {
            (SizeClass::Small, _) => split_and_tokens(u, 1)?,
            (SizeClass::Large, Some(which)) => large::wide_vocab(u, which)?,
            (SizeClass::Large, None) => {
                large::split_and_tokens(u, 1, 1, large::CE_WORK, usize::MAX)?
            }
        };
        let mut config = match class {
            SizeClass::Small => loss_config(u, v)?,
            SizeClass::Large => large::config(u, v)?,
        };
        let small_want_grad = class == SizeClass::Small && u.arbitrary::<bool>()?;
        let mut gen = Gen::arbitrary(u)?;
        let inf_one_in = [0, 3, 8, 32][u.choose_index(4)?];
        let mut logits = Array2::from_shape_fn((n, w), |(_, j)| {
            if j >= v {
                padding_value(&mut gen)
            } else if gen.one_in(inf_one_in) {
                f64::NEG_INFINITY
            } else {
                gen.value(4.0)
            }
        });
        // A wide case draws no softcap (a capped row maximum is at most the
        // cap: the last column's could not stand above the rest) and plants
        // no extremes (a logit of 1e8 sets the scale every row of a tensor
        // is judged on): its point is the planted maximum below.
        if wide.is_some() {
            config.softcap = None;
        }
        let mut planted = Vec::new();
        for (at, choice) in plants(u, 4)? {
            if wide.is_some() {
                continue;
            }
            let (i, j) = plant_at(at, n, v);
            let x = [1e4, -1e4, 1e8, -1e8, f64::NEG_INFINITY][choice as usize % 5];
            logits[[i, j]] = x;
            planted.push(format!("logits[{i}, {j}] = {x}"));
        }
        // A wide vocabulary's even rows have their maximum in the last
        // column (past the last 8,192 / 16,384 boundary: a last partial
        // chunk's max above the others', which a merge that does not rescale
        // gets wrong; random values put nearly the same max in every chunk).
        if wide.is_some() {
            for i in (0..n).step_by(2) {
                let top = (0..v)
                    .map(|j| logits[[i, j]])
                    .filter(|x| x.is_finite())
                    .fold(f64::NEG_INFINITY, f64::max);
                if top.is_finite() {
                    logits[[i, v - 1]] = top + 4.0;
                    planted.push(format!(
                        "logits[{i}, {}] = {} (row max + 4)",
                        v - 1,
                        top + 4.0
                    ));
                }
            }
        }
        // V6: whole shards masked to -inf on some rows (the rows of a large
        // case drawn by `gen`: its bytes run out first).
        for i in 0..n {
            let b = match class {
                SizeClass::Small => u.arbitrary::<u8>()?,
                // One row in 24, as one in 6 of the small cases' rows would
                // mask a hundred rows of a large case.
                SizeClass::Large if gen.one_in(4) => gen.below(256) as u8,
                SizeClass::Large => 0,
            };
            if b % 6 == 5 && map.num_shards() > 1 {
                let s = map.shard(b as usize / 6 % map.num_shards());
                for j in s.start..s.start + s.real {
                    logits[[i, j]] = f64::NEG_INFINITY;
                }
                planted.push(format!("row {i} of shard {} all -inf", s.rank));
            }
        }
        let (targets, want_grad, grad_output) = match class {
            SizeClass::Small => {
                let t = targets(u, &mut gen, n, v, config.ignore_index)?;
                let g = small_tail(u, &mut gen, n, &mut config, small_want_grad)?;
                (t, small_want_grad, g)
            }
            SizeClass::Large => {
                let t = large::targets(&mut gen, n, v, config.ignore_index);
                let (want_grad, g) = large::grads(u, &mut gen, n, config.reduction)?;
                (t, want_grad, g)
            }
        };
        let mut values = gen.describe();
        if inf_one_in > 0 {
            values.push_str(&format!(", 1 in {inf_one_in} logits -inf"));
        }
        Ok(CeFuzzCase {
            case: CeCase {
                map,
                logits,
                targets,
                config,
                grad_output,
            },
            want_grad,
            values: with_planted(values, &planted),
        })
    }
}

impl CeFuzzCase {
    /// A one-line description for failure reports.
    pub fn describe(&self) -> String {
        let c = &self.case;
        self.describe_loss(&c.map, &c.call(self.want_grad), "")
    }
}

impl<'a> Arbitrary<'a> for LinearFuzzCase {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        let first = u.arbitrary::<u8>()?;
        let class = SizeClass::of(&[first]);
        let wide = large::wide_slot(slot(&[first])).filter(|_| class == SizeClass::Large);
        let (map, v, w, n, h, mut config) = match class {
            SizeClass::Large if wide.is_some() => {
                let which = wide.expect("matched");
                let (h, map, v, w, n) = large::long_tokens(u, which)?;
                (map, v, w, n, h, large::config(u, v)?)
            }
            SizeClass::Small => {
                let (map, v, w, n) = split_and_tokens(u, 1)?;
                let h = u.int_in_range(1..=MAX_H)?;
                (map, v, w, n, h, loss_config(u, v)?)
            }
            SizeClass::Large => {
                let h = large::hidden_size(u)?;
                let (map, v, w, n) =
                    large::split_and_tokens(u, 1, h, large::LINEAR_WORK, large::LINEAR_WEIGHT)?;
                (map, v, w, n, h, large::config(u, v)?)
            }
        };
        let small_want_grad = class == SizeClass::Small && u.arbitrary::<bool>()?;
        let mut gen = Gen::arbitrary(u)?;
        let mut hidden = Array2::from_shape_fn((n, h), |_| gen.value(2.0));
        let mut weight = Array2::from_shape_fn((w, h), |(j, _)| {
            if j < v {
                gen.value(2.0)
            } else {
                padding_value(&mut gen)
            }
        });
        let mut planted = Vec::new();
        for (at, choice) in plants(u, 4)? {
            let (in_hidden, x) = linear_plant(choice);
            if in_hidden {
                let (i, k) = plant_at(at, n, h);
                hidden[[i, k]] = x;
                planted.push(format!("hidden[{i}, {k}] = {x}"));
            } else {
                let (j, k) = plant_at(at, v, h);
                weight[[j, k]] = x;
                planted.push(format!("weight[{j}, {k}] = {x}"));
            }
        }
        let (targets, want_grad, grad_output) = match class {
            SizeClass::Small => {
                let t = targets(u, &mut gen, n, v, config.ignore_index)?;
                let g = small_tail(u, &mut gen, n, &mut config, small_want_grad)?;
                (t, small_want_grad, g)
            }
            // A long-token case always asks for the gradients, with the
            // implicit upstream 1 (a drawn 0 would hide every gradient): the
            // weight gradient sums over every token chunk.
            SizeClass::Large if wide.is_some() => {
                let t = large::targets(&mut gen, n, v, config.ignore_index);
                (t, true, None)
            }
            SizeClass::Large => {
                let t = large::targets(&mut gen, n, v, config.ignore_index);
                let (want_grad, g) = large::grads(u, &mut gen, n, config.reduction)?;
                (t, want_grad, g)
            }
        };
        let values = with_planted(gen.describe(), &planted);
        Ok(LinearFuzzCase {
            case: LinearCase {
                map,
                hidden,
                weight,
                targets,
                config,
                grad_output,
            },
            want_grad,
            values,
        })
    }
}

impl LinearFuzzCase {
    /// A one-line description for failure reports.
    pub fn describe(&self) -> String {
        let c = &self.case;
        let h = format!(", h {}", c.hidden.ncols());
        self.describe_loss(&c.map, &c.call(self.want_grad), &h)
    }
}

/// An arbitrary embedding case (always with `grad_output`).
#[derive(Debug, Clone, PartialEq)]
pub struct EmbeddingFuzzCase {
    /// The split, ids `[n]`, weight `[w, h]`, grad_output `[n, h]`.
    pub case: EmbeddingCase,
    /// How the values were drawn, for reports.
    pub values: String,
}

impl<'a> Arbitrary<'a> for EmbeddingFuzzCase {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        let class = SizeClass::read(u)?;
        let (map, v, w, n, h) = match class {
            SizeClass::Small => {
                let (map, v, w, n) = split_and_tokens(u, 0)?;
                (map, v, w, n, u.int_in_range(1..=MAX_H)?)
            }
            SizeClass::Large => {
                let h = large::hidden_size(u)?;
                let (map, v, w, n) =
                    large::split_and_tokens(u, 0, h, large::EMBEDDING_WORK, large::EMBEDDING_WORK)?;
                (map, v, w, n, h)
            }
        };
        let mut gen = Gen::arbitrary(u)?;
        // Ids: repeats are likely (few distinct values), out of range rarely
        // (V5; in a large case, whose bytes run out, never).
        let distinct = u.int_in_range(1..=v)?;
        let ids = (0..n)
            .map(|_| {
                let b = match class {
                    SizeClass::Small => u.arbitrary::<u8>()?,
                    SizeClass::Large => 3,
                };
                Ok(match b {
                    0 => v as i64,
                    1 => -1,
                    2 => i64::MAX,
                    _ => spread_id(gen.below(distinct), v) as i64,
                })
            })
            .collect::<arbitrary::Result<Vec<i64>>>()?;
        let weight = Array2::from_shape_fn((w, h), |(j, _)| {
            if j < v {
                gen.value(2.0)
            } else {
                padding_value(&mut gen)
            }
        });
        let grad_output = Array2::from_shape_fn((n, h), |_| gen.value(1.0));
        Ok(EmbeddingFuzzCase {
            values: gen.describe(),
            case: EmbeddingCase {
                map,
                ids,
                weight,
                grad_output,
            },
        })
    }
}

impl EmbeddingFuzzCase {
    /// A one-line description for failure reports.
    pub fn describe(&self) -> String {
        let c = &self.case;
        format!(
            "{}, ids {}, h {}; {}",
            describe_split(&c.map),
            brief(&c.ids),
            c.weight.ncols(),
            self.values
        )
    }
}

/// The outcome of a vocab case: errors alike when the reference refuses the
/// inputs, else compared, with the largest difference seen in ulp of the
/// terms as a share of [`crate::vocab::TERMS`]'s 64.
fn vocab_outcome(reference_failed: bool, values: usize) -> Outcome {
    let worst = take_worst_ulps() / 64.0;
    if reference_failed {
        Outcome::errors_alike()
    } else {
        Outcome::compared(values, worst)
    }
}

/// The loss fuzz targets' bodies, one row each: `data` as the row's case
/// type; `take_worst_ulps` reset; the row's `unsharded` check, then its
/// `with` check for every algorithm `imp` declares, under `judge`
/// ([`Rule::of`]), the first mismatch a [`Failure`] of the row's target
/// naming the form and the case; else the outcome over every form, with the
/// case's own `reference_values`.
macro_rules! loss_fuzz_targets {
    ($($(#[$doc:meta])* $name:ident($op:ident, $case:ty, $target:literal, $unsharded:ident, $with:ident);)*) => {$(
        $(#[$doc])*
        pub fn $name(imp: &dyn $op, judge: Judge, data: &[u8]) -> Result<Outcome, Failure> {
            let Ok(case) = <$case>::from_bytes(data) else {
                return Ok(Outcome::default());
            };
            let rule = Rule::of(judge);
            take_worst_ulps();
            let (c, want_grad) = (&case.case, case.want_grad);
            let failure = |form: String, m| Failure::new($target, form, case.describe(), m);
            $unsharded(imp, c, want_grad, rule).map_err(|m| failure("unsharded".into(), m))?;
            let algorithms = imp.algorithms();
            for &algorithm in &algorithms {
                $with(imp, algorithm, c, want_grad, rule)
                    .map_err(|m| failure(algorithm.to_string(), m))?;
            }
            let (failed, per_form) = case.reference_values();
            Ok(vocab_outcome(failed, per_form * (algorithms.len() + 1)))
        }
    )*};
}

loss_fuzz_targets! {
    /// The cross-entropy fuzz body: `data` as a [`CeFuzzCase`], checked in the
    /// unsharded form and for every algorithm `imp` declares under `judge`
    /// ([`Rule::of`]: the terms rule for an f64 implementation, the relative
    /// rule on f32-rounded inputs for a lower-precision one).
    ///
    /// # Errors
    /// A [`Failure`] naming the form, the case and the first mismatch.
    run_cross_entropy(
        CrossEntropyOp, CeFuzzCase, "cross_entropy",
        check_cross_entropy_unsharded, check_cross_entropy_with
    );
    /// The output-layer fuzz body: `data` as a [`LinearFuzzCase`], checked in
    /// the unsharded form and for every algorithm `imp` declares under `judge`
    /// (see [`run_cross_entropy`]).
    ///
    /// # Errors
    /// A [`Failure`] naming the form, the case and the first mismatch.
    run_linear(
        LinearCrossEntropyOp, LinearFuzzCase, "linear_cross_entropy",
        check_linear_unsharded, check_linear_with
    );
}

impl CeFuzzCase {
    /// Whether the unsharded reference refuses the case, and the values
    /// one form of it compares.
    fn reference_values(&self) -> (bool, usize) {
        let c = &self.case;
        let v = c.map.vocab_size();
        let real = c.logits.slice_axis(Axis(1), Slice::from(..v));
        let failed = cross_entropy(real, &c.call(false)).is_err();
        let n = c.targets.len();
        (failed, 2 * n + 1 + if self.want_grad { n * v } else { 0 })
    }
}

impl LinearFuzzCase {
    /// As [`CeFuzzCase::reference_values`].
    fn reference_values(&self) -> (bool, usize) {
        let c = &self.case;
        let v = c.map.vocab_size();
        let real = c.weight.slice_axis(Axis(0), Slice::from(..v));
        let failed =
            packshard_reference::vocab::linear_cross_entropy(c.hidden.view(), real, &c.call(false))
                .is_err();
        let (n, h) = c.hidden.dim();
        let grads = if self.want_grad {
            n * v + n * h + v * h
        } else {
            0
        };
        (failed, 2 * n + 1 + grads)
    }
}

/// The embedding fuzz body: `data` as an [`EmbeddingFuzzCase`], checked with
/// [`check_embedding`] (exact; out-of-range ids the reference's error).
///
/// # Errors
/// A [`Failure`] describing the case and the first mismatch.
pub fn run_embedding(imp: &dyn EmbeddingOp, data: &[u8]) -> Result<Outcome, Failure> {
    let Ok(case) = EmbeddingFuzzCase::from_bytes(data) else {
        return Ok(Outcome::default());
    };
    let c = &case.case;
    check_embedding(imp, c).map_err(|m: Mismatch| {
        Failure::new("embedding", "sharded and unsharded", case.describe(), m)
    })?;
    let v = c.map.vocab_size();
    let failed = packshard_reference::vocab::embedding::check_ids(&c.ids, v).is_err();
    let (n, h) = (c.ids.len(), c.weight.ncols());
    Ok(if failed {
        Outcome::errors_alike()
    } else {
        // Exact comparison: any difference fails, so a passing case used none.
        Outcome::compared(n * h + v * h, 0.0)
    })
}
