//! `packshard eval` on arbitrary text: a result or a typed error of the contract's kinds; nothing panics.
//! The body is `packshard_oracle::fuzzing::targets()`'s "eval_json" (replayed by `cargo test`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| packshard_oracle::fuzzing::fuzz("eval_json", data));
