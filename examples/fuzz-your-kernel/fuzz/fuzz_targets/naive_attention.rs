//! Differential fuzzing of `NaiveAttention` against packshard's f64 reference:
//! every input is an arbitrary varlen attention case (empty segments, planted
//! outliers, malformed cu_seqlens); the first mismatch is reported with the
//! tensor, index, both values and the tolerance.
//!
//! To fuzz another op, call its body instead (`fuzz::vocab::run_cross_entropy`,
//! `run_linear`, `run_embedding`, `fuzz::packing::run`) with your implementation.
#![no_main]

use fuzz_your_kernel::NaiveAttention;
use packshard_equivalence::fuzz::attention;
use packshard_equivalence::{Judge, Tolerance};

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    // Your kernel computes in f64: hold it to 64 ulp of the terms. A
    // lower-precision kernel states its own judge here (`Judge::Relative`).
    if let Err(failure) = attention::run(&NaiveAttention, Judge::Rewrite(Tolerance::F64_REWRITE), data) {
        panic!("{failure}");
    }
});
