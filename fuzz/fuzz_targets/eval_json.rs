//! `packshard eval` on arbitrary text: every input gets a result or a typed
//! error of the contract's kinds; nothing panics.
#![no_main]

use libfuzzer_sys::fuzz_target;

const KINDS: [&str; 8] = [
    "invalid_json",
    "unknown_op",
    "missing_field",
    "shape_mismatch",
    "sequence_too_long",
    "index_out_of_range",
    "non_finite_input",
    "invalid_argument",
];

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Err(e) = packshard::eval::evaluate_str(text) {
        assert!(KINDS.contains(&e.kind), "unknown error kind {}", e.kind);
        assert!(!e.message.is_empty());
    }
});
