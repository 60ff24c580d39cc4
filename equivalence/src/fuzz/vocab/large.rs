//! The large loss and embedding cases ([`SizeClass::Large`]): the sizes where
//! vocabulary- and token-chunked kernels break.
//!
//! - **vocabulary** `v` at a chunk boundary ([`boundary_len`]): `k * g - 1`,
//!   `k * g` or `k * g + 1` for `g` in [`VOCAB_GRAINS`] (three draws in four)
//!   or 128 and 512 (one in four), up to [`LARGE_MAX_V`] (so `4097`, `8191`,
//!   `8193` and `1025` are all reachable: the last partial chunk of 1, of
//!   `g - 1`, a vocabulary of exactly one chunk);
//! - **shards** `p` in `1..=MAX_P`, uneven or padded (padding columns on the
//!   last ranks), so a rank's local width is itself off a boundary;
//! - **tokens** `n` a handful (one case in four), or at a token-chunk
//!   boundary of [`TILE_GRAINS`] (`15`, `16`, `17`, `63`, `129`, ...), up to
//!   [`LARGE_MAX_N`] on a vocabulary of a few hundred (one in four) or within
//!   the work; the work `n * v` (times `h` for the output layer) bounded by
//!   [`CE_WORK`] / [`LINEAR_WORK`] so one case runs in a fraction of a second
//!   in the f64 reference;
//! - **at fixed slots** ([`crate::fuzz::schedule::slot`], so in every
//!   seed's default check, whose 12 large cases have slots 0 to 11): a
//!   cross-entropy vocabulary past [`LARGE_MAX_V`] at a boundary of 8,192 or
//!   16,384, the chunk sizes of kernels for 128k-256k vocabularies (Liger,
//!   cut-cross-entropy), on a few tokens ([`wide_vocab`]); an output layer
//!   of 1,023 to 2,049 tokens, a boundary of a 1,024-token chunk, at a small
//!   hidden size and a vocabulary of a few hundred ([`long_tokens`]). Both
//!   within the work bounds; before, no case had more than 8,300 entries or
//!   256 tokens, and none both `v > 1024` and `n > 64`;
//! - **options**, each likely: a softcap a third of the time (docs/FAULTS.md
//!   O1; `c` from 0.5 to 50, Gemma 2's 30 among them), the reduction `none`
//!   half of the time, gradients seven in eight, an upstream `grad_output`
//!   three in four of those (per token under `none`: O2), ignore index, label
//!   smoothing in both conventions and z-loss as the small cases draw them;
//! - **values** from the case's [`Gen`] (the input's bytes run out long before
//!   `n` tokens): targets on every shard and ignored ones, whole shards masked
//!   to `-inf` on some rows (V6).

use arbitrary::Unstructured;
use packshard_reference::vocab::{LossConfig, Reduction, ShardMap};

use super::{loss_config, shards_of, MAX_H, MAX_P};
#[cfg(doc)]
use crate::fuzz::schedule::SizeClass;
use crate::fuzz::schedule::{boundary_len, TILE_GRAINS, VOCAB_GRAINS};
use crate::fuzz::values::Gen;

/// Largest vocabulary of a large case: room for `2 * 4096 + 1` (a second
/// chunk of 4096 and one entry past it).
pub const LARGE_MAX_V: usize = 8300;
/// Most tokens of a large case: room for `4 * 128 + 1`.
pub const LARGE_MAX_N: usize = 520;
/// Most logits (`n * v`) of a large cross-entropy case: 2^19, which with the
/// unsharded form and three algorithms, each judged against the f64
/// reference, keeps a case under a fifth of a second (docs/FAULTS.md, "How
/// results are judged", has the measured times).
pub const CE_WORK: usize = 1 << 17;
/// Most multiply-adds (`n * v * h`) of a large output-layer case: 2^22 (the
/// same bound on time as [`CE_WORK`]: the reference's forward and backward
/// each take `n * v * h`).
pub const LINEAR_WORK: usize = 1 << 20;
/// Most weight elements (`v * h`) of a large output-layer case: 2^18, a
/// vocabulary of 8,193 at `h` 32 (the weight gradient and its terms are
/// `v * h` each, in every form).
pub const LINEAR_WEIGHT: usize = 1 << 18;
/// Most weight and output elements (`(v + n) * h`) of a large embedding case
/// (a lookup is cheap; this keeps the exact comparison's tensors small).
pub const EMBEDDING_WORK: usize = 1 << 19;

/// The slots (modulo [`SLOT_PERIOD`]) of the large cross-entropy cases of
/// [`wide_vocab`] and the large output-layer cases of [`long_tokens`]: 2 of
/// the 12 large cases of `Budget::DEFAULT`, one libFuzzer large input in six.
pub const WIDE_SLOTS: [usize; 2] = [5, 11];
/// The period of [`WIDE_SLOTS`].
pub const SLOT_PERIOD: usize = 12;
/// The vocabularies of [`wide_vocab`] at slot 11 (`16384 + 1`: a second
/// 16,384-chunk of one entry; `16384 + 4096 + 1`: of 4,097; `16384 + 8192 +
/// 1`; `2 * 16384 + 1`: a third of one) and at slot 5 (`8192 +- 1`,
/// `16384 - 1`, `16384`). Their even rows have the row maximum in the last
/// column (`CeFuzzCase`).
pub const WIDE_V: [[usize; 4]; 2] = [[8191, 8193, 16383, 16384], [16385, 20481, 24577, 32769]];
/// The token counts of [`long_tokens`] at slot 11 (past one and two
/// 1,024-token chunks by one) and at slot 5 (`1024 - 1`, `1024`, `1024 + 1`).
pub const LONG_N: [[usize; 3]; 2] = [[1023, 1024, 1025], [1025, 2049, 1025]];
/// Most tokens of a [`wide_vocab`] case: `CE_WORK / 8191` is 16, `CE_WORK /
/// 32769` is 3 (fewer as the vocabulary is padded); at most 8.
pub const WIDE_MAX_N: usize = 8;
/// Most hidden size of a [`long_tokens`] case: `LINEAR_WORK / (2049 * 4)`
/// leaves a vocabulary of 127 (less the padding), 1,023 at 1,025 tokens
/// and `h = 1`.
pub const LONG_MAX_H: usize = 4;

/// Which of [`WIDE_SLOTS`] `slot` is (0 for 5, 1 for 11), `None` for any
/// other slot.
pub fn wide_slot(slot: usize) -> Option<usize> {
    WIDE_SLOTS.iter().position(|&s| s == slot % SLOT_PERIOD)
}

/// The split and `n` of a cross-entropy case at wide slot `which` (0 or 1,
/// [`wide_slot`]): `v` from `WIDE_V[which]`, `n` in `1..=WIDE_MAX_N` within
/// [`CE_WORK`] logits; `(map, v, w, n)` as [`split_and_tokens`].
pub(super) fn wide_vocab(
    u: &mut Unstructured<'_>,
    which: usize,
) -> arbitrary::Result<(ShardMap, usize, usize, usize)> {
    let v = WIDE_V[which][u.choose_index(4)?];
    let map = shards_of(u, v)?;
    let w = map.padded_vocab_size();
    let n = u.int_in_range(1..=(CE_WORK / w).clamp(1, WIDE_MAX_N))?;
    Ok((map, v, w, n))
}

/// The hidden size, split and `n` of an output-layer case at wide slot
/// `which` (0 or 1, [`wide_slot`]): `n` from `LONG_N[which]`, `h` in
/// `1..=LONG_MAX_H`, `v` a boundary of 128 or 256 within [`LINEAR_WORK`]
/// (the padding included); `(h, map, v, w, n)`.
pub(super) fn long_tokens(
    u: &mut Unstructured<'_>,
    which: usize,
) -> arbitrary::Result<(usize, ShardMap, usize, usize, usize)> {
    let n = LONG_N[which][u.choose_index(3)?];
    let h = u.int_in_range(1..=LONG_MAX_H)?;
    // Room for the padding of up to MAX_P - 1 columns.
    let most_v = (LINEAR_WORK / (n * h)).saturating_sub(MAX_P).max(1);
    let v = boundary_len(u, &[128, 256], most_v)?;
    let map = shards_of(u, v)?;
    let w = map.padded_vocab_size();
    Ok((h, map, v, w, n))
}

/// The off-grain boundaries a vocabulary is also drawn around: the padded
/// vocabularies of Megatron are multiples of 128 x TP, and 512 sits between
/// the chunk sizes of [`VOCAB_GRAINS`].
const OTHER_VOCAB_GRAINS: [usize; 2] = [128, 512];

/// Hidden sizes of the large output-layer and embedding cases: the small
/// ones, a tile's 16 and 32 and 64, and 31 and 33 either side of one.
const LARGE_H: [usize; 6] = [16, 31, 32, 33, 64, 0];

/// The split and `n` of a large case of hidden size `h` (1 for the
/// cross-entropy), `n * v * h` at most `work` and `v * h` at most
/// `weight`: `(map, v, w, n)` with `w` the padded vocabulary size, `n >=
/// min_n`. The shape is one of three: a handful of tokens on a vocabulary
/// of up to [`LARGE_MAX_V`] (one in four), many tokens (a token chunk of
/// 128 and more) on a vocabulary of a few hundred (one in four), or both at
/// boundaries within the work.
pub(super) fn split_and_tokens(
    u: &mut Unstructured<'_>,
    min_n: usize,
    h: usize,
    work: usize,
    weight: usize,
) -> arbitrary::Result<(ShardMap, usize, usize, usize)> {
    let per_entry = work / h.max(1);
    let shape = u.arbitrary::<u8>()? % 4;
    let most_v = LARGE_MAX_V
        .min(per_entry / min_n.max(1))
        .min(weight / h.max(1));
    // Many tokens: room for at least 2 x 128 + 1 of them.
    let most_v = if shape == 1 {
        most_v.min(per_entry / 257)
    } else {
        most_v
    }
    .max(1);
    let grains: &[usize] = if u.arbitrary::<u8>()?.is_multiple_of(4) {
        &OTHER_VOCAB_GRAINS
    } else {
        &VOCAB_GRAINS
    };
    let v = boundary_len(u, grains, most_v)?;
    let map = shards_of(u, v)?;
    let w = map.padded_vocab_size();
    let most_n = LARGE_MAX_N.min(per_entry / w).max(min_n);
    let n = if shape == 0 {
        u.int_in_range(min_n..=most_n.min(9))?
    } else {
        boundary_len(u, &TILE_GRAINS, most_n)?.max(min_n)
    };
    Ok((map, v, w, n))
}

/// The hidden size of a large output-layer or embedding case ([`LARGE_H`],
/// the 0 there a small one in `1..=MAX_H`).
pub(super) fn hidden_size(u: &mut Unstructured<'_>) -> arbitrary::Result<usize> {
    Ok(match LARGE_H[u.choose_index(LARGE_H.len())?] {
        0 => u.int_in_range(1..=MAX_H)?,
        h => h,
    })
}

/// The loss options of a large case: [`loss_config`], then a softcap a third
/// of the time and the reduction `none` half of the time (so a per-token
/// and a scalar `grad_output` are as likely, [`grads`]).
pub(super) fn config(u: &mut Unstructured<'_>, v: usize) -> arbitrary::Result<LossConfig> {
    let mut c = loss_config(u, v)?;
    c.softcap = match u.arbitrary::<u8>()? % 9 {
        0 => Some(1.0),
        1 => Some(30.0),
        2 => Some(0.5 + 49.5 * f64::from(u.arbitrary::<u16>()?) / f64::from(u16::MAX)),
        _ => None,
    };
    // `none` a third of the time from `loss_config`, a half in all.
    if u.arbitrary::<u8>()?.is_multiple_of(4) {
        c.reduction = Reduction::None;
    }
    Ok(c)
}

/// Whether a large case asks for gradients (seven in eight), and its upstream
/// gradient (three in four of those): `[n]` under the reduction `none`, `[1]`
/// otherwise (docs/FAULTS.md O2), each value 0, 1 or in `[-2, 2]` (a
/// quarter, a quarter, a half) from `gen`.
pub(super) fn grads(
    u: &mut Unstructured<'_>,
    gen: &mut Gen,
    n: usize,
    reduction: Reduction,
) -> arbitrary::Result<(bool, Option<Vec<f64>>)> {
    let b = u.arbitrary::<u8>()?;
    let want_grad = b % 8 != 7;
    if !want_grad || b / 8 % 4 == 3 {
        return Ok((want_grad, None));
    }
    Ok((want_grad, Some(upstream(gen, n, reduction))))
}

/// An upstream gradient for `n` tokens under `reduction` (`[n]` under
/// `none`, else `[1]`), each value 0, 1 or in `[-2, 2]` (a quarter, a
/// quarter, a half) from `gen`.
pub(super) fn upstream(gen: &mut Gen, n: usize, reduction: Reduction) -> Vec<f64> {
    let len = if reduction == Reduction::None { n } else { 1 };
    (0..len)
        .map(|_| match gen.below(4) {
            0 => 0.0,
            1 => 1.0,
            _ => gen.uniform(-2.0, 2.0),
        })
        .collect()
}

/// Targets of a large case from `gen`: `ignore` one in five, else a real
/// class (on every shard).
pub(super) fn targets(gen: &mut Gen, n: usize, v: usize, ignore: i64) -> Vec<i64> {
    (0..n)
        .map(|_| {
            if gen.one_in(5) {
                ignore
            } else {
                gen.below(v) as i64
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fuzz::schedule::{budgeted_input, Budget};

    /// The draws of `split_and_tokens` over 400 byte strings, the first
    /// (shape) byte set to `shape`.
    fn draws(shape: u8, min_n: usize, h: usize, work: usize) -> Vec<(usize, usize, usize)> {
        (0..400u64)
            .map(|s| {
                let mut data = budgeted_input(&Budget::small(1), s, 0);
                data[1] = shape;
                let mut u = Unstructured::new(&data[1..]);
                let (_, v, w, n) = split_and_tokens(&mut u, min_n, h, work, usize::MAX).unwrap();
                (v, w, n)
            })
            .collect()
    }

    /// The work bound holds for any `min_n`, not only the callers' 0 and 1:
    /// at 2^15 logits and at least 8 tokens, the vocabulary stays within
    /// 2^15 / 8 (a bound by `work * min_n` would draw 8,193 entries for 8
    /// tokens, twice the work).
    #[test]
    fn the_work_bounds_the_vocabulary_by_the_fewest_tokens() {
        for shape in 0..4 {
            for (v, _, n) in draws(shape, 8, 1, 1 << 15) {
                assert!(n >= 8 && n * v <= 1 << 15, "shape {shape}: {n} x {v}");
            }
        }
    }

    /// The shape "many tokens" (one in four) keeps room for `2 * 128 + 1`
    /// tokens: its vocabulary is a boundary of 128 to 4096 within
    /// `CE_WORK / 257` = 510, never a handful of entries.
    #[test]
    fn many_tokens_come_on_a_vocabulary_of_a_few_hundred() {
        for (v, _, _) in draws(1, 1, 1, CE_WORK) {
            assert!((127..=510).contains(&v), "{v}");
        }
        // A handful of tokens may come on the widest vocabularies.
        let few = draws(0, 1, 1, CE_WORK);
        assert!(few.iter().all(|&(_, _, n)| n <= 9));
        assert!(few.iter().any(|&(v, _, _)| v > 4096), "{few:?}");
    }

    /// Large output-layer and embedding cases reach every hidden size of
    /// [`LARGE_H`] (a tile's 16, 32 and 64, 31 and 33 either side) and a
    /// small one.
    #[test]
    fn hidden_sizes_reach_the_tiles_and_either_side() {
        let seen: std::collections::BTreeSet<usize> = (0..200u64)
            .map(|s| {
                let data = budgeted_input(&Budget::small(1), s, 0);
                hidden_size(&mut Unstructured::new(&data)).unwrap()
            })
            .collect();
        for h in [16, 31, 32, 33, 64] {
            assert!(seen.contains(&h), "{h} never drawn: {seen:?}");
        }
        assert!(seen.iter().any(|h| (1..=MAX_H).contains(h)), "{seen:?}");
    }

    /// `config`'s softcap, over 900 byte strings: 1 and 30 (Gemma 2's) a
    /// ninth of the time each, a value spread over `[0.5, 50]` a ninth, none
    /// two thirds; the reduction `none` half of the time. The bounds are the
    /// expected count +- 4 standard deviations of a binomial over 900
    /// (100 +- 38, 600 +- 57, 450 +- 60).
    #[test]
    fn large_loss_options_draw_each_softcap_and_reduction_in_its_share() {
        let (mut one, mut thirty, mut spread, mut off, mut none) = (0, 0, Vec::new(), 0, 0);
        for s in 0..900u64 {
            let data = budgeted_input(&Budget::small(1), s, 0);
            let c = config(&mut Unstructured::new(&data), 300).unwrap();
            match c.softcap {
                Some(1.0) => one += 1,
                Some(30.0) => thirty += 1,
                Some(x) => spread.push(x),
                None => off += 1,
            }
            none += usize::from(c.reduction == Reduction::None);
        }
        for (what, k, lo, hi) in [
            ("softcap 1", one, 62, 138),
            ("softcap 30", thirty, 62, 138),
            ("softcap drawn", spread.len(), 62, 138),
            ("no softcap", off, 543, 657),
            ("reduction none", none, 390, 510),
        ] {
            assert!(
                (lo..=hi).contains(&k),
                "{what}: {k} of 900, not in {lo}..={hi}"
            );
        }
        assert!(
            spread.iter().all(|x| (0.5..=50.0).contains(x)),
            "{spread:?}"
        );
        let lo = spread.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = spread.iter().copied().fold(0.0, f64::max);
        assert!(lo < 10.0 && hi > 40.0, "drawn softcaps span {lo}..{hi}");
    }

    /// `grads` over 800 byte strings: gradients seven in eight (700), an
    /// upstream gradient three in four of those (525), `[n]` under `none` and
    /// `[1]` otherwise, and never an upstream without gradients. Bounds: +- 4
    /// binomial standard deviations (700 +- 38, 525 +- 54).
    #[test]
    fn large_loss_gradients_and_upstreams_come_in_their_shares() {
        let (mut want, mut given) = (0, 0);
        for s in 0..800u64 {
            let data = budgeted_input(&Budget::small(1), s, 0);
            let reduction = if s % 2 == 0 {
                Reduction::None
            } else {
                Reduction::Mean
            };
            let (w, up) = grads(
                &mut Unstructured::new(&data),
                &mut Gen::seeded(s),
                5,
                reduction,
            )
            .unwrap();
            want += usize::from(w);
            if let Some(up) = up {
                assert!(w, "an upstream gradient without gradients");
                given += 1;
                assert_eq!(up.len(), if s % 2 == 0 { 5 } else { 1 });
            }
        }
        assert!((662..=738).contains(&want), "gradients in {want} of 800");
        assert!((471..=579).contains(&given), "upstreams in {given} of 800");
    }

    /// `upstream`'s values over 800 draws: exactly 0 a quarter of the time,
    /// exactly 1 a quarter, else spread over `[-2, 2]` with both signs
    /// (bounds 200 +- 49, four binomial standard deviations).
    #[test]
    fn upstream_values_are_zero_one_or_spread_over_both_signs() {
        let v = upstream(&mut Gen::seeded(7), 800, Reduction::None);
        let zeros = v.iter().filter(|&&x| x == 0.0).count();
        let ones = v.iter().filter(|&&x| x == 1.0).count();
        assert!((151..=249).contains(&zeros), "{zeros} zeros");
        assert!((151..=249).contains(&ones), "{ones} ones");
        assert!(v.iter().all(|x| (-2.0..=2.0).contains(x)));
        assert!(v.iter().any(|&x| x < -1.0) && v.iter().any(|&x| x > 1.0));
    }
}
