//! optimized_attention_bf16: see `packshard::fuzzing::targets()` (the body, replayed by `cargo test`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| packshard::fuzzing::fuzz("optimized_attention_bf16", data));
