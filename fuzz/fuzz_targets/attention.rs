//! Every registered attention against the f64 reference and its padded form (P2, P4, P8).
//! The body is `packshard_oracle::fuzzing::targets()`'s "attention" (replayed by `cargo test`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| packshard_oracle::fuzzing::fuzz("attention", data));
