//! Packing and batching on arbitrary lengths, configs and token ids: the
//! reference must never panic and must pass its own equivalence checks
//! (every token once, losses reported, positions reset, padding no segment).
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use packshard_equivalence::packing::{check_batcher, check_packer, Reference};
use packshard_reference::packing::{Algorithm, Overlong, PackingConfig};

#[derive(Debug, Arbitrary)]
struct Case {
    lengths: Vec<u8>,
    max_seq_len: u8,
    algorithm: u8,
    limit: Option<u8>,
    overlong: u8,
    position_offset: i8,
    pad: i16,
}

fuzz_target!(|case: Case| {
    let algorithm = Algorithm::ALL[case.algorithm as usize % Algorithm::ALL.len()];
    let overlong = [Overlong::Error, Overlong::Split, Overlong::Truncate, Overlong::Drop][case.overlong as usize % 4];
    // NNLSHP builds every exact-fill pack: keep its depth small enough to be quick.
    let limit = case.limit.map(|k| if algorithm == Algorithm::Nnlshp { (k % 4) as usize } else { k as usize });
    let config = PackingConfig::new(algorithm, case.max_seq_len as usize)
        .with_max_sequences_per_pack(limit)
        .with_overlong(overlong);
    let lengths: Vec<usize> = case.lengths.iter().take(64).map(|&l| l as usize).collect();
    if config.max_seq_len == 0 || limit == Some(0) {
        // Must be a typed error, never a panic.
        assert!(check_packer(&Reference, &lengths, &config).is_err());
        return;
    }
    if let Err(m) = check_packer(&Reference, &lengths, &config) {
        panic!("{m}\nlengths {lengths:?}\nconfig {config:?}");
    }
    let sequences: Vec<Vec<i64>> =
        lengths.iter().enumerate().map(|(i, &l)| (0..l as i64).map(|t| 7 + i as i64 * 1000 + t).collect()).collect();
    if let Err(m) = check_batcher(&Reference, &sequences, &config, case.pad as i64, case.position_offset as i64) {
        panic!("{m}\nlengths {lengths:?}\nconfig {config:?}");
    }
});
