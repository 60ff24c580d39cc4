//! Every registered cross-entropy, unsharded and each declared algorithm, against the unsharded reference (V1, V2, V4, V6).
//! The body is `packshard_oracle::fuzzing::targets()`'s "cross_entropy" (replayed by `cargo test`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| packshard_oracle::fuzzing::fuzz("cross_entropy", data));
