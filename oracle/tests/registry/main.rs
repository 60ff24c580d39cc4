//! The registry's tests: every registered implementation of every op family
//! through every suite that judges it, one test per (implementation, suite)
//! named `<family>::<implementation>::<suite>` (libtest-mimic), so that
//! `cargo test -p packshard-oracle attention_varlen_scalar` runs that
//! kernel's suites alone and a failing kernel hides no other. Availability
//! follows the registry's one policy ([`packshard_oracle::registry::here`]),
//! see [`harness`].
//!
//! Adding a kernel to the registry puts it through these tests with no
//! change here.
// The fuzz bodies' `Failure` is a test report, not a hot error path.
#![allow(clippy::result_large_err)]

mod fuzz_budget;
mod golden;
mod harness;
mod own_numbers;
mod planted;
mod suites;

fn main() {
    let args = libtest_mimic::Arguments::from_args();
    let mut attention = packshard_oracle::registry::attention();
    if planted::asked() {
        attention.push(planted::entry());
    }
    let mut t = harness::Tests::default();
    suites::add(&mut t, &attention);
    golden::add(&mut t, &attention);
    own_numbers::add(&mut t, &attention);
    fuzz_budget::add(&mut t, &attention);
    planted::add(&mut t);
    let conclusion = libtest_mimic::run(&args, t.trials);
    golden::clean();
    conclusion.exit();
}
