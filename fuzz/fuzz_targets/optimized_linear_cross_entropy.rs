//! optimized_linear_cross_entropy: see `packshard::fuzzing::targets()` (the body, replayed by `cargo test`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| packshard::fuzzing::fuzz("optimized_linear_cross_entropy", data));
