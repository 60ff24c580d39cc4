//! Reference sharded cross-entropy, every algorithm, against the unsharded reference (V1, V2, V4, V6).
//! The body is `packshard::fuzzing::targets()`'s "cross_entropy" (replayed by `cargo test`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| packshard::fuzzing::fuzz("cross_entropy", data));
