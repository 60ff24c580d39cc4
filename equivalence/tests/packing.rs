//! The packing suite on the reference, the docs/FAULTS.md examples with their exact
//! values, and negative controls: each planted fault must be caught.

use packshard_equivalence::packing::{
    check_batch, check_batcher, check_packer, run_suite, tokens_for, BatchInput, Batcher, Packer,
    Reference,
};
use packshard_reference::packing::{
    pack_lengths, Algorithm, Overlong, PackedBatch, PackingConfig, PackingPlan,
};
use packshard_reference::Error;

#[test]
fn reference_passes_the_suite() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static CALLS: AtomicUsize = AtomicUsize::new(0);
    struct Counting;
    impl Packer for Counting {
        fn name(&self) -> String {
            "counting reference".into()
        }
        fn pack(&self, lengths: &[usize], config: &PackingConfig) -> Result<PackingPlan, Error> {
            CALLS.fetch_add(1, Ordering::Relaxed);
            Reference.pack(lengths, config)
        }
    }
    impl Batcher for Counting {
        fn name(&self) -> String {
            "counting reference".into()
        }
        fn batch(&self, x: BatchInput<'_>) -> Result<(PackingPlan, PackedBatch), Error> {
            Reference.batch(x)
        }
    }
    run_suite(&Counting, 512).unwrap();
    // 8 docs/FAULTS.md cases + 512 random ones: the suite is not vacuous.
    assert_eq!(CALLS.load(Ordering::Relaxed), 8 + 512);
}

fn batch_of(lengths: &[usize], msl: usize, offset: i64) -> PackedBatch {
    let config = PackingConfig::new(Algorithm::Spfhp, msl);
    Reference
        .batch(BatchInput::new(&tokens_for(lengths), &config, offset))
        .unwrap()
        .1
}

#[test]
fn p1_positions_restart_in_every_sequence() {
    let b = batch_of(&[100, 200], 300, 0);
    assert_eq!(b.num_packs(), 1);
    let pos = b.position_ids.row(0).to_vec();
    // SPFHP places the longer sequence first.
    let want: Vec<i64> = (0..200).chain(0..100).collect();
    assert_eq!(pos, want);
}

#[test]
fn p5_padding_is_never_a_sequence() {
    let b = batch_of(&[3], 8, 0);
    assert_eq!(b.sequence_ids.row(0).to_vec(), vec![1, 1, 1, 0, 0, 0, 0, 0]);
    assert_eq!(b.cu_seqlens, vec![vec![0, 3]]);
    assert_eq!(b.flat_cu_seqlens(), vec![0, 3]);
}

#[test]
fn p6_positions_start_at_the_offset() {
    let b = batch_of(&[3], 8, 2);
    assert_eq!(&b.position_ids.row(0).to_vec()[..3], &[2, 3, 4]);
}

#[test]
fn p2_the_reference_mask_is_block_diagonal() {
    // Lengths [3, 5] in a pack of 8: 0..2 see 0..2 only, 3..7 see 3..7 only.
    let b = batch_of(&[3, 5], 8, 0);
    let m = b.attention_mask(0);
    let first = b.cu_seqlens[0][1]; // 5 (longer first)
    for q in 0..8 {
        for k in 0..8 {
            assert_eq!(m[[q, k]], (q < first) == (k < first), "q {q} k {k}");
        }
    }
}

// ---- negative controls -------------------------------------------------------

/// A batcher that plants one fault into the reference batch.
struct Broken(fn(&mut PackedBatch, &PackingPlan));

impl Batcher for Broken {
    fn name(&self) -> String {
        "broken".into()
    }
    fn batch(&self, x: BatchInput<'_>) -> Result<(PackingPlan, PackedBatch), Error> {
        let (plan, mut batch) = Reference.batch(x)?;
        (self.0)(&mut batch, &plan);
        Ok((plan, batch))
    }
}

impl Packer for Broken {
    fn name(&self) -> String {
        "broken".into()
    }
    fn pack(&self, lengths: &[usize], config: &PackingConfig) -> Result<PackingPlan, Error> {
        pack_lengths(lengths, config)
    }
}

/// `f(column, position id)` on every real (non-padding) token of `b`.
fn each_real_position(b: &mut PackedBatch, f: impl Fn(usize, &mut i64)) {
    let ids = b.sequence_ids.clone();
    for ((p, c), v) in b.position_ids.indexed_iter_mut() {
        if ids[[p, c]] != 0 {
            f(c, v);
        }
    }
}

fn caught(b: &Broken, lengths: &[usize], msl: usize, offset: i64, field: &str) {
    let config = PackingConfig::new(Algorithm::Spfhp, msl);
    let err = check_batcher(b, BatchInput::new(&tokens_for(lengths), &config, offset))
        .expect_err("the planted fault must be caught");
    assert!(err.what.contains(field), "caught, but as {err}");
    assert!(run_suite(b, 64).is_err(), "the suite must catch it too");
}

#[test]
fn p1_negative_control_positions_running_on() {
    caught(
        // Positions counted along the whole row: 0..299 instead of 0..199, 0..99.
        &Broken(|b, _| each_real_position(b, |c, v| *v = c as i64)),
        &[100, 200],
        300,
        0,
        "position_ids",
    );
}

#[test]
fn p5_negative_control_padding_as_a_sequence() {
    caught(
        &Broken(|b, _| {
            for (p, cu) in b.cu_seqlens.iter_mut().enumerate() {
                if *cu.last().unwrap() < b.max_seq_len {
                    cu.push(b.max_seq_len);
                    for v in b.sequence_ids.row_mut(p).iter_mut().filter(|v| **v == 0) {
                        *v = cu.len() as i64 - 1;
                    }
                }
            }
        }),
        &[3],
        8,
        0,
        "sequence_ids",
    );
}

#[test]
fn p5_negative_control_cu_seqlens_with_padding() {
    caught(
        &Broken(|b, _| {
            for cu in b.cu_seqlens.iter_mut() {
                *cu.last_mut().unwrap() = b.max_seq_len;
            }
        }),
        &[3],
        8,
        0,
        "cu_seqlens",
    );
}

#[test]
fn p6_negative_control_offset_ignored() {
    caught(
        &Broken(|b, _| each_real_position(b, |_, v| *v -= 2)),
        &[3],
        8,
        2,
        "position_ids",
    );
    // Offset 0 with the fault is invisible: the check is not vacuous elsewhere.
}

/// A packer that plants one fault into the reference plan.
struct BrokenPlan(fn(&[usize], &PackingConfig) -> Result<PackingPlan, Error>);

impl Packer for BrokenPlan {
    fn name(&self) -> String {
        "broken plan".into()
    }
    fn pack(&self, lengths: &[usize], config: &PackingConfig) -> Result<PackingPlan, Error> {
        (self.0)(lengths, config)
    }
}

#[test]
fn p3_negative_control_overlong_dropped_silently() {
    // Drops overlong sequences without reporting them, whatever the policy.
    let silent = BrokenPlan(|lengths, config| {
        let kept: Vec<usize> = lengths
            .iter()
            .map(|&l| if l > config.max_seq_len { 0 } else { l })
            .collect();
        let mut plan = pack_lengths(&kept, config)?;
        plan.empty_sequences.retain(|&i| lengths[i] == 0);
        plan.metrics.empty_sequences = plan.empty_sequences.len() as u64;
        Ok(plan)
    });
    let config = PackingConfig::new(Algorithm::Ffd, 3);
    let err = check_packer(&silent, &[4, 2, 3, 1], &config).unwrap_err();
    assert_eq!(err.what, "overlong", "{err}");
    let err = check_packer(
        &silent,
        &[4, 2, 3, 1],
        &config.with_overlong(Overlong::Split),
    )
    .unwrap_err();
    assert!(
        err.detail
            .contains("sequence 0 (length 4): 0 tokens placed, 4 expected"),
        "{err}"
    );
    let err = check_packer(
        &silent,
        &[4, 2, 3, 1],
        &config.with_overlong(Overlong::Drop),
    )
    .unwrap_err();
    assert_eq!(err.what, "metrics.dropped_tokens", "{err}");
}

#[test]
fn p3_negative_control_truncation_unreported() {
    let unreported = BrokenPlan(|lengths, config| {
        let mut plan = pack_lengths(lengths, config)?;
        plan.metrics.dropped_tokens = 0;
        Ok(plan)
    });
    let config = PackingConfig::new(Algorithm::Ffd, 3).with_overlong(Overlong::Truncate);
    let err = check_packer(&unreported, &[4, 2, 3, 1], &config).unwrap_err();
    assert_eq!(err.what, "metrics.dropped_tokens", "{err}");
}

#[test]
fn p4_negative_control_empty_sequences_shift_indices() {
    // Filters empty sequences out first and forgets to map indices back.
    let shifting = BrokenPlan(|lengths, config| {
        let kept: Vec<usize> = lengths.iter().copied().filter(|&l| l > 0).collect();
        let mut plan = pack_lengths(&kept, config)?;
        plan.empty_sequences = lengths
            .iter()
            .enumerate()
            .filter(|(_, &l)| l == 0)
            .map(|(i, _)| i)
            .collect();
        plan.metrics.empty_sequences = plan.empty_sequences.len() as u64;
        Ok(plan)
    });
    let config = PackingConfig::new(Algorithm::Spfhp, 4);
    assert!(
        check_packer(&shifting, &[1, 1], &config).is_ok(),
        "harmless without empty sequences"
    );
    let err = check_packer(&shifting, &[1, 0, 2], &config).unwrap_err();
    assert!(err.what == "packs", "{err}");
}

#[test]
fn p4_negative_control_empty_sequences_not_reported() {
    let forgetful = BrokenPlan(|lengths, config| {
        let mut plan = pack_lengths(lengths, config)?;
        plan.empty_sequences.clear();
        Ok(plan)
    });
    let err = check_packer(
        &forgetful,
        &[1, 0, 1],
        &PackingConfig::new(Algorithm::Spfhp, 4),
    )
    .unwrap_err();
    assert_eq!(err.what, "empty_sequences", "{err}");
}

#[test]
fn check_batch_rejects_wrong_tokens() {
    let config = PackingConfig::new(Algorithm::Spfhp, 8);
    let seqs = tokens_for(&[3, 4]);
    let input = BatchInput::new(&seqs, &config, 0);
    let (plan, mut batch) = Reference.batch(input).unwrap();
    batch.input_ids[[0, 1]] += 1;
    let err = check_batch(input, &plan, &batch).unwrap_err();
    assert_eq!(err.what, "input_ids");
}
