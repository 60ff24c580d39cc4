//! Checks for packers and packed batches (docs/FAULTS.md P1, P3, P4, P5, P6).
//!
//! A [`Packer`] maps sequence lengths to a [`PackingPlan`]; a [`Batcher`]
//! builds the model inputs of a [`PackedBatch`]. [`check_plan`] and
//! [`check_batch`] verify them from first principles — every token accounted
//! for exactly once, losses reported, positions reset per segment, padding
//! never a segment — and [`run_suite`] drives both over random cases and the
//! docs/FAULTS.md examples. Implement the traits for your own packer to check it.

use packshard_reference::packing::{
    pack_lengths, Algorithm, Overlong, PackedBatch, PackingConfig, PackingPlan,
};
use packshard_reference::Error;
use proptest::prelude::*;

use crate::compare::Mismatch;

/// Something that packs sequence lengths into a plan.
pub trait Packer {
    /// A short name for reports.
    fn name(&self) -> String;
    /// Packs `lengths: [n]` (tokens) under `config`.
    ///
    /// # Errors
    /// Must return [`Error::SequenceTooLong`] naming the first overlong
    /// sequence under `overlong = error`.
    fn pack(&self, lengths: &[usize], config: &PackingConfig) -> Result<PackingPlan, Error>;
}

/// Something that builds packed model inputs from token sequences.
pub trait Batcher {
    /// A short name for reports.
    fn name(&self) -> String;
    /// Packs `sequences` under `config` and lays them out.
    ///
    /// # Errors
    /// As [`Packer::pack`].
    fn batch(&self, input: BatchInput<'_>) -> Result<(PackingPlan, PackedBatch), Error>;
}

/// One batching call's inputs.
#[derive(Debug, Clone, Copy)]
pub struct BatchInput<'a> {
    /// Token ids, one vector per sequence (empty ones allowed).
    pub sequences: &'a [Vec<i64>],
    /// How to pack them.
    pub config: &'a PackingConfig,
    /// The token id of padding slots.
    pub pad_token_id: i64,
    /// The first position id of every sequence (0 for BERT, 2 for RoBERTa).
    pub position_offset: i64,
}

impl<'a> BatchInput<'a> {
    /// `sequences` under `config`, padded with id 0, positions from `position_offset`.
    pub fn new(sequences: &'a [Vec<i64>], config: &'a PackingConfig, position_offset: i64) -> Self {
        BatchInput {
            sequences,
            config,
            pad_token_id: 0,
            position_offset,
        }
    }

    /// The same input padded with `pad_token_id`.
    pub fn with_pad(self, pad_token_id: i64) -> Self {
        BatchInput {
            pad_token_id,
            ..self
        }
    }

    /// The same input with positions from `position_offset`.
    pub fn with_offset(self, position_offset: i64) -> Self {
        BatchInput {
            position_offset,
            ..self
        }
    }
}

/// The reference packer and batcher of `packshard-reference`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Reference;

impl Packer for Reference {
    fn name(&self) -> String {
        "reference".into()
    }
    fn pack(&self, lengths: &[usize], config: &PackingConfig) -> Result<PackingPlan, Error> {
        pack_lengths(lengths, config)
    }
}

impl Batcher for Reference {
    fn name(&self) -> String {
        "reference".into()
    }
    fn batch(&self, x: BatchInput<'_>) -> Result<(PackingPlan, PackedBatch), Error> {
        PackedBatch::from_sequences(x.sequences, x.config, x.pad_token_id, x.position_offset)
    }
}

fn fail(what: &str, detail: impl Into<String>) -> Result<(), Mismatch> {
    Err(Mismatch::new(what, detail))
}

/// Checks a plan for `lengths` under `config`:
///
/// - no pack over `max_seq_len` tokens or over the sequence limit, no empty segment;
/// - the segments of each sequence are contiguous from token 0, without overlap,
///   and cover what the overlong policy keeps (P3: all of a sequence that fits,
///   all of a split one, `max_seq_len` of a truncated one, none of a dropped one);
/// - the tokens lost equal `metrics.dropped_tokens` (P3: no silent loss);
/// - empty sequences are listed in `empty_sequences` and never placed (P4);
/// - the metrics agree with the packs.
///
/// # Errors
/// The first violation, as a [`Mismatch`] naming the pack or sequence.
pub fn check_plan(
    lengths: &[usize],
    config: &PackingConfig,
    plan: &PackingPlan,
) -> Result<(), Mismatch> {
    let msl = config.max_seq_len;
    let mut covered = vec![0usize; lengths.len()];
    let mut real = 0u64;
    for (p, pack) in plan.packs.iter().enumerate() {
        let tokens: usize = pack.iter().map(|s| s.length).sum();
        if tokens > msl {
            return fail(
                "packs",
                format!("pack {p} holds {tokens} tokens, over max_seq_len {msl}"),
            );
        }
        if pack.len() > config.limit() {
            return fail(
                "packs",
                format!(
                    "pack {p} holds {} segments, over the limit {}",
                    pack.len(),
                    config.limit()
                ),
            );
        }
        if pack.is_empty() {
            return fail("packs", format!("pack {p} is empty"));
        }
        for (k, s) in pack.iter().enumerate() {
            if s.sequence >= lengths.len() {
                return fail(
                    "packs",
                    format!(
                        "pack {p} segment {k} names sequence {} of {}",
                        s.sequence,
                        lengths.len()
                    ),
                );
            }
            if s.length == 0 {
                return fail(
                    "packs",
                    format!("pack {p} segment {k} (sequence {}) is empty", s.sequence),
                );
            }
            if s.offset != covered[s.sequence] {
                return fail(
                    "packs",
                    format!(
                        "sequence {}: segment at offset {} but tokens 0..{} were placed before it (gap or overlap)",
                        s.sequence, s.offset, covered[s.sequence]
                    ),
                );
            }
            covered[s.sequence] += s.length;
            real += s.length as u64;
        }
    }
    let mut lost = 0u64;
    for (i, &l) in lengths.iter().enumerate() {
        let want = if l <= msl {
            l
        } else {
            match config.overlong {
                Overlong::Split => l,
                Overlong::Truncate => msl,
                Overlong::Drop => 0,
                Overlong::Error => {
                    return fail(
                        "lengths",
                        format!(
                            "sequence {i} of length {l} > {msl} was packed under overlong = error"
                        ),
                    )
                }
            }
        };
        if covered[i] != want {
            return fail(
                "packs",
                format!("sequence {i} (length {l}): {} tokens placed, {want} expected under overlong = {:?}", covered[i], config.overlong),
            );
        }
        lost += (l - want) as u64;
    }
    let m = &plan.metrics;
    if m.dropped_tokens != lost {
        return fail(
            "metrics.dropped_tokens",
            format!("{} reported, {lost} tokens were left out", m.dropped_tokens),
        );
    }
    let empty: Vec<usize> = lengths
        .iter()
        .enumerate()
        .filter(|(_, &l)| l == 0)
        .map(|(i, _)| i)
        .collect();
    if plan.empty_sequences != empty {
        return fail(
            "empty_sequences",
            format!("{:?} reported, {empty:?} expected", plan.empty_sequences),
        );
    }
    if m.empty_sequences != empty.len() as u64 {
        return fail(
            "metrics.empty_sequences",
            format!("{} reported, {} expected", m.empty_sequences, empty.len()),
        );
    }
    if m.num_packs != plan.packs.len() as u64 {
        return fail(
            "metrics.num_packs",
            format!(
                "{} reported, {} packs in the plan",
                m.num_packs,
                plan.packs.len()
            ),
        );
    }
    if m.real_tokens != real {
        return fail(
            "metrics.real_tokens",
            format!("{} reported, {real} placed", m.real_tokens),
        );
    }
    if m.padding_tokens != m.num_packs * msl as u64 - real {
        return fail(
            "metrics.padding_tokens",
            format!(
                "{} reported, {} expected",
                m.padding_tokens,
                m.num_packs * msl as u64 - real
            ),
        );
    }
    Ok(())
}

/// Checks a packed batch against the sequences it was built from and its plan:
///
/// - shapes `[num_packs, max_seq_len]`, one row per pack of the plan;
/// - each segment's tokens are the source tokens at the segment's offset;
/// - `position_ids` restart at `position_offset` in every segment (P1, P6);
/// - `sequence_ids` number the segments from 1; padding is 0, holds
///   `pad_token_id` and position 0;
/// - `cu_seqlens[p]` is `[0, l_1, l_1 + l_2, ...]` over real segments only —
///   padding is never a sequence (P5);
/// - `sequence_index` and `max_seqlen` agree with the plan.
///
/// The plan itself is checked with [`check_plan`].
///
/// # Errors
/// The first violation, as a [`Mismatch`] naming the field, pack and column.
pub fn check_batch(
    input: BatchInput<'_>,
    plan: &PackingPlan,
    batch: &PackedBatch,
) -> Result<(), Mismatch> {
    let BatchInput {
        sequences,
        config,
        pad_token_id,
        position_offset,
    } = input;
    let lengths: Vec<usize> = sequences.iter().map(Vec::len).collect();
    check_plan(&lengths, config, plan)?;
    let msl = config.max_seq_len;
    let shape = [plan.packs.len(), msl];
    for (name, a) in [
        ("input_ids", &batch.input_ids),
        ("position_ids", &batch.position_ids),
        ("sequence_ids", &batch.sequence_ids),
    ] {
        if a.shape() != shape {
            return fail(
                name,
                format!(
                    "shape {:?}, expected {shape:?} (num_packs, max_seq_len)",
                    a.shape()
                ),
            );
        }
    }
    if batch.cu_seqlens.len() != plan.packs.len() || batch.sequence_index.len() != plan.packs.len()
    {
        return fail(
            "cu_seqlens",
            format!(
                "{} rows for {} packs",
                batch.cu_seqlens.len(),
                plan.packs.len()
            ),
        );
    }
    let mut max_seqlen = 0;
    for (p, pack) in plan.packs.iter().enumerate() {
        let mut at = 0usize;
        let mut cu = vec![0usize];
        for (k, seg) in pack.iter().enumerate() {
            for t in 0..seg.length {
                let col = at + t;
                let checks = [
                    (
                        "input_ids",
                        batch.input_ids[[p, col]],
                        sequences[seg.sequence][seg.offset + t],
                    ),
                    (
                        "position_ids",
                        batch.position_ids[[p, col]],
                        position_offset + t as i64,
                    ),
                    ("sequence_ids", batch.sequence_ids[[p, col]], k as i64 + 1),
                ];
                let at = format!("pack {p} column {col} (segment {k}, token {t})");
                for (name, got, want) in checks {
                    expect_eq(name, &at, got, want)?;
                }
            }
            at += seg.length;
            cu.push(at);
            max_seqlen = max_seqlen.max(seg.length);
        }
        for col in at..msl {
            let checks = [
                ("sequence_ids", batch.sequence_ids[[p, col]], 0),
                ("input_ids", batch.input_ids[[p, col]], pad_token_id),
                ("position_ids", batch.position_ids[[p, col]], 0),
            ];
            for (name, got, want) in checks {
                expect_eq(name, &format!("pack {p} padding column {col}"), got, want)?;
            }
        }
        let at = format!("pack {p}");
        expect_eq(
            "cu_seqlens",
            &(at.clone() + " (padding excluded)"),
            &batch.cu_seqlens[p],
            &cu,
        )?;
        let index: Vec<usize> = pack.iter().map(|s| s.sequence).collect();
        expect_eq("sequence_index", &at, &batch.sequence_index[p], &index)?;
    }
    expect_eq("max_seqlen", "the batch", batch.max_seqlen, max_seqlen)?;
    Ok(())
}

/// A [`Mismatch`] naming `what` at `at` unless `got == want`.
fn expect_eq<T: PartialEq + std::fmt::Debug>(
    what: &str,
    at: &str,
    got: T,
    want: T,
) -> Result<(), Mismatch> {
    if got == want {
        return Ok(());
    }
    fail(what, format!("{at}: got {got:?}, expected {want:?}"))
}

/// Runs `packer` on `lengths` and checks the outcome: under `overlong =
/// error` with a sequence over `max_seq_len` it must fail naming the first
/// such sequence (P3); otherwise the plan must pass [`check_plan`].
///
/// # Errors
/// A [`Mismatch`] describing the failure.
pub fn check_packer(
    packer: &dyn Packer,
    lengths: &[usize],
    config: &PackingConfig,
) -> Result<(), Mismatch> {
    let first_overlong = lengths.iter().position(|&l| l > config.max_seq_len);
    match (
        packer.pack(lengths, config),
        first_overlong,
        config.overlong,
    ) {
        (Err(Error::SequenceTooLong { index, length, .. }), Some(i), Overlong::Error)
            if index == i && length == lengths[i] =>
        {
            Ok(())
        }
        (Ok(_), Some(i), Overlong::Error) | (Err(_), Some(i), Overlong::Error) => fail(
            "overlong",
            format!(
                "{}: sequence {i} of length {} > {} must be a SequenceTooLong error naming it",
                packer.name(),
                lengths[i],
                config.max_seq_len
            ),
        ),
        (Ok(plan), _, _) => check_plan(lengths, config, &plan),
        (Err(e), _, _) => fail("pack", format!("{}: unexpected error {e}", packer.name())),
    }
}

/// Runs `batcher` and checks the batch with [`check_batch`] (overlong errors as in [`check_packer`]).
///
/// # Errors
/// A [`Mismatch`] describing the failure.
pub fn check_batcher(batcher: &dyn Batcher, input: BatchInput<'_>) -> Result<(), Mismatch> {
    let (sequences, config) = (input.sequences, input.config);
    let first_overlong = sequences.iter().position(|s| s.len() > config.max_seq_len);
    match (batcher.batch(input), first_overlong, config.overlong) {
        (Err(Error::SequenceTooLong { index, .. }), Some(i), Overlong::Error) if index == i => {
            Ok(())
        }
        (_, Some(i), Overlong::Error) => fail(
            "overlong",
            format!(
                "{}: sequence {i} must be a SequenceTooLong error",
                batcher.name()
            ),
        ),
        (Ok((plan, batch)), _, _) => check_batch(input, &plan, &batch),
        (Err(e), _, _) => fail("batch", format!("{}: unexpected error {e}", batcher.name())),
    }
}

/// Upper bounds of the random cases.
pub const MAX_LENGTH: usize = 48;
/// Most sequences in one random case.
pub const MAX_SEQUENCES: usize = 24;

/// A packing config: algorithm, `max_seq_len` in 1..=32, an optional limit,
/// an overlong policy.
pub fn configs() -> impl Strategy<Value = PackingConfig> {
    (
        prop::sample::select(Algorithm::ALL.to_vec()),
        1usize..=32,
        prop::option::of(1usize..=4),
        prop::sample::select(vec![
            Overlong::Error,
            Overlong::Split,
            Overlong::Truncate,
            Overlong::Drop,
        ]),
    )
        .prop_map(|(a, msl, limit, overlong)| {
            PackingConfig::new(a, msl)
                .with_max_sequences_per_pack(limit)
                .with_overlong(overlong)
        })
}

/// Sequence lengths in `0..=MAX_LENGTH` (empty ones included), up to `MAX_SEQUENCES`.
pub fn lengths() -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(
        prop_oneof![1 => Just(0usize), 8 => 1usize..=MAX_LENGTH],
        0..=MAX_SEQUENCES,
    )
}

/// Token sequences: lengths first, then ids in `1..30522` (0 is the pad id).
pub fn sequences() -> impl Strategy<Value = Vec<Vec<i64>>> {
    lengths().prop_flat_map(|ls| {
        ls.into_iter()
            .map(|l| prop::collection::vec(1i64..30522, l))
            .collect::<Vec<_>>()
    })
}

/// The docs/FAULTS.md packing examples as `(name, lengths, config)`; the batch
/// cases use token ids `1000 + sequence * 100 + position`.
pub fn fault_cases() -> Vec<(&'static str, Vec<usize>, PackingConfig, i64)> {
    let c = |msl| PackingConfig::new(Algorithm::Spfhp, msl);
    vec![
        (
            "P1 positions reset: [100, 200] in one row",
            vec![100, 200],
            c(300),
            0,
        ),
        (
            "P3 overlong error: [4, 2, 3, 1] max 3",
            vec![4, 2, 3, 1],
            c(3),
            0,
        ),
        (
            "P3 overlong split",
            vec![4, 2, 3, 1],
            c(3).with_overlong(Overlong::Split),
            0,
        ),
        (
            "P3 overlong truncate",
            vec![4, 2, 3, 1],
            c(3).with_overlong(Overlong::Truncate),
            0,
        ),
        (
            "P3 overlong drop",
            vec![4, 2, 3, 1],
            c(3).with_overlong(Overlong::Drop),
            0,
        ),
        ("P4 zero-length: [1, 0, 1]", vec![1, 0, 1], c(4), 0),
        ("P5 padding is not a sequence: [3] in 8", vec![3], c(8), 0),
        ("P6 RoBERTa offset 2: [3]", vec![3], c(8), 2),
    ]
}

/// Token sequences for `lengths` with recognisable ids.
pub fn tokens_for(lengths: &[usize]) -> Vec<Vec<i64>> {
    lengths
        .iter()
        .enumerate()
        .map(|(i, &l)| (0..l).map(|t| 1000 + 100 * i as i64 + t as i64).collect())
        .collect()
}

/// The whole suite for one implementation: the docs/FAULTS.md cases, then `cases`
/// random cases through [`check_packer`] and [`check_batcher`]. Deterministic
/// (a fixed proptest seed), so a failure reproduces.
///
/// # Errors
/// The first failure, with the case that produced it (shrunk by proptest).
pub fn run_suite<I: Packer + Batcher>(imp: &I, cases: u32) -> Result<(), Mismatch> {
    for (name, lengths, config, offset) in fault_cases() {
        let with_case = |m: Mismatch| m.within(name);
        check_packer(imp, &lengths, &config).map_err(with_case)?;
        check_batcher(imp, BatchInput::new(&tokens_for(&lengths), &config, offset))
            .map_err(with_case)?;
    }
    let suite = format!("{} packing suite", Packer::name(imp));
    let strategy = (sequences(), configs(), 0i64..=2, -1i64..=1);
    crate::run_cases(
        cases,
        &strategy,
        &suite,
        (),
        |(), (seqs, config, offset, pad)| {
            let lengths: Vec<usize> = seqs.iter().map(Vec::len).collect();
            check_packer(imp, &lengths, &config)?;
            check_batcher(imp, BatchInput::new(&seqs, &config, offset).with_pad(pad))
        },
    )
}
