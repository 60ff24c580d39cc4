//! Reference sharded output layer, every algorithm, against the unsharded reference (V3).
//! The body is `packshard::fuzzing::targets()`'s "linear_cross_entropy" (replayed by `cargo test`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| packshard::fuzzing::fuzz("linear_cross_entropy", data));
