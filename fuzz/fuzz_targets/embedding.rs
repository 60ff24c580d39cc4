//! Every registered embedding, sharded against the unsharded lookup (V5).
//! The body is `packshard_oracle::fuzzing::targets()`'s "embedding" (replayed by `cargo test`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| packshard_oracle::fuzzing::fuzz("embedding", data));
