//! Every registered output layer, unsharded and each declared algorithm, against the unsharded reference (V3).
//! The body is `packshard_oracle::fuzzing::targets()`'s "linear_cross_entropy" (replayed by `cargo test`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| packshard_oracle::fuzzing::fuzz(
    "linear_cross_entropy",
    data
));
