//! Reference sharded embedding against the unsharded lookup (V5).
//! The body is `packshard::fuzzing::targets()`'s "embedding" (replayed by `cargo test`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| packshard::fuzzing::fuzz("embedding", data));
