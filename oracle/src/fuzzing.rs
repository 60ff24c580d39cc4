//! The fuzz targets of this repository, one per op family, with the body
//! each runs.
//!
//! Every `cargo fuzz` target in `fuzz/fuzz_targets/<name>.rs` is one line:
//! `packshard_oracle::fuzzing::fuzz("<name>", data)`. A family's target runs
//! **every registered implementation of the family** ([`crate::registry`])
//! on each input, each in its small configuration (tiles the fuzz cases
//! cross) under its entry's `fuzz_judge`, so a kernel added to the registry
//! is fuzzed with no other change. The bodies live in libraries (the
//! differential ones in [`packshard_equivalence::fuzz`]), so `cargo test`
//! replays the committed inputs of every target — the seeds in
//! `fuzz/seeds/<name>/` and the inputs that ever failed in
//! `fuzz/regressions/<name>/` — through the very code libFuzzer runs
//! (`tests/fuzz_regressions.rs`). An implementation that cannot run here (a
//! GPU kernel without a device) is skipped, said once per process, or fails
//! the target where this run requires it (the registry's one availability
//! policy, [`registry::here`]).

use packshard_equivalence::compare::Mismatch;
use packshard_equivalence::fuzz::{self, catch_panic, Failure, Outcome};
use packshard_equivalence::packing;

use crate::registry::{self, Entry};

/// One fuzz target: its name (the `cargo fuzz` target and the corpus
/// directories), what it checks, and its body.
#[derive(Clone, Copy)]
pub struct Target {
    /// The target's name, e.g. `attention`.
    pub name: &'static str,
    /// What it checks, in one line.
    pub summary: &'static str,
    /// The body: bytes in, the case's outcome or the first mismatch out.
    pub run: fn(&[u8]) -> Result<Outcome, Failure>,
}

/// Runs `body` for every available entry of `list` (its small
/// configuration), merging the outcomes; the first failure names the entry.
fn every<K: ?Sized>(
    list: &[Entry<K>],
    data: &[u8],
    body: impl Fn(&K, &Entry<K>, &[u8]) -> Result<Outcome, Failure>,
) -> Result<Outcome, Failure> {
    let mut all = Outcome::default();
    for entry in list {
        let imp = match entry.here_small() {
            registry::Here::Runs(imp) => imp,
            registry::Here::Skipped(u) => {
                skipped_once(entry.name, &u);
                continue;
            }
            registry::Here::Missing(u) => {
                return Err(Failure::new(
                    "registry",
                    entry.name,
                    "making the implementation",
                    Mismatch::new("availability", format!("required here but cannot run: {u}")),
                ))
            }
        };
        let seen =
            body(&imp, entry, data).map_err(|f| f.from_source(format!("impl {}", entry.name)))?;
        all.merge(seen);
    }
    Ok(all)
}

/// Says once per process that `name` cannot run here, and why.
fn skipped_once(name: &'static str, why: &registry::Unavailable) {
    static SAID: std::sync::Mutex<Vec<&'static str>> = std::sync::Mutex::new(Vec::new());
    let mut said = SAID.lock().unwrap_or_else(|e| e.into_inner());
    if !said.contains(&name) {
        said.push(name);
        eprintln!("{name}: skipped: {why}");
    }
}

/// Every fuzz target, in the order `cargo fuzz list` prints them.
pub fn targets() -> Vec<Target> {
    vec![
        Target {
            name: "attention",
            summary: "every registered attention, forward and backward, packed == padded and against the f64 reference (P2, P4, P8), malformed cu_seqlens refused alike",
            run: |d| every(&registry::attention(), d, |imp, e, d| fuzz::attention::run(imp, e.fuzz_judge, d)),
        },
        Target {
            name: "cross_entropy",
            summary: "every registered cross-entropy, unsharded and each declared algorithm, against the unsharded f64 reference (V1, V2, V4, V6)",
            run: |d| every(&registry::cross_entropy(), d, |imp, e, d| fuzz::vocab::run_cross_entropy(imp, e.fuzz_judge, d)),
        },
        Target {
            name: "embedding",
            summary: "every registered embedding, sharded against the unsharded lookup, exactly (V5)",
            run: |d| every(&registry::embedding(), d, |imp, _, d| fuzz::vocab::run_embedding(imp, d)),
        },
        Target {
            name: "eval_json",
            summary: "packshard eval on arbitrary text: a result or a typed error of the contract's kinds, never a panic",
            run: eval_json,
        },
        Target {
            name: "linear_cross_entropy",
            summary: "every registered output layer, unsharded and each declared algorithm, against the unsharded f64 reference (V3)",
            run: |d| every(&registry::linear_cross_entropy(), d, |imp, e, d| fuzz::vocab::run_linear(imp, e.fuzz_judge, d)),
        },
        Target {
            name: "pack_batch",
            summary: "reference packer and batcher checked from first principles (P1, P3–P6)",
            run: |d| fuzz::packing::run(&packing::Reference, d),
        },
    ]
}

/// The target called `name`.
pub fn target(name: &str) -> Option<Target> {
    targets().into_iter().find(|t| t.name == name)
}

/// The libFuzzer entry point: runs target `name` on `data`.
///
/// # Panics
/// With the failure's text when the case fails (that is how libFuzzer is
/// told), and for an unknown `name`.
pub fn fuzz(name: &str, data: &[u8]) {
    let Some(t) = target(name) else {
        panic!("no fuzz target {name:?} in packshard_oracle::fuzzing::targets()");
    };
    if let Err(f) = (t.run)(data) {
        panic!("{f}");
    }
}

/// The error kinds of the eval contract (`docs/INTERFACE.md`).
pub const EVAL_ERROR_KINDS: [&str; 8] = [
    "invalid_json",
    "unknown_op",
    "missing_field",
    "shape_mismatch",
    "sequence_too_long",
    "index_out_of_range",
    "non_finite_input",
    "invalid_argument",
];

/// The `eval_json` body: `data` as UTF-8 text through
/// [`crate::eval::evaluate_str`]; any input gets a result or an error of one
/// of [`EVAL_ERROR_KINDS`] with a message, never a panic. Bytes that are not
/// UTF-8 are skipped.
///
/// # Errors
/// A [`Failure`] for a panic, an unknown error kind or an empty message.
pub fn eval_json(data: &[u8]) -> Result<Outcome, Failure> {
    let Ok(text) = std::str::from_utf8(data) else {
        return Ok(Outcome::default());
    };
    let case = || {
        let brief: String = text.chars().take(200).collect();
        if brief.len() < text.len() {
            format!("{brief}... ({} bytes)", text.len())
        } else {
            brief
        }
    };
    let fail = |m: Mismatch| Failure::new("eval_json", "packshard eval", case(), m);
    match catch_panic("evaluate", || crate::eval::evaluate_str(text)).map_err(fail)? {
        Ok(_) => Ok(Outcome::compared(0, 0.0)),
        Err(e) if !EVAL_ERROR_KINDS.contains(&e.kind) => Err(fail(Mismatch::new(
            "error kind",
            format!("unknown error kind {} ({})", e.kind, e.message),
        ))),
        Err(e) if e.message.is_empty() => Err(fail(Mismatch::new(
            "error message",
            format!("an error of kind {} without a message", e.kind),
        ))),
        Err(_) => Ok(Outcome::errors_alike()),
    }
}
