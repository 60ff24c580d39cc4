//! Packing and batching from first principles: every token once, losses reported, positions reset, padding no segment.
//! The body is `packshard_oracle::fuzzing::targets()`'s "pack_batch" (replayed by `cargo test`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| packshard_oracle::fuzzing::fuzz("pack_batch", data));
