//! The fuzz targets of this repository, by name, with the body each runs.
//!
//! Every `cargo fuzz` target in `fuzz/fuzz_targets/<name>.rs` is one line:
//! `packshard::fuzzing::fuzz("<name>", data)`. The bodies live in libraries
//! (the differential ones in [`packshard_equivalence::fuzz`], feature-free), so
//! `cargo test` replays the committed inputs of every target — the seeds in
//! `fuzz/seeds/<name>/` and the inputs that ever failed in
//! `fuzz/regressions/<name>/` — through the very code libFuzzer runs
//! (`tests/fuzz_regressions.rs`).
//!
//! To fuzz another implementation of an op trait (an optimized kernel), add a
//! [`Target`] here whose body calls the op's generic body with it (e.g.
//! `|d| fuzz::attention::run(&MyKernel, tolerance, d)`), a one-line target
//! file and a `[[bin]]` entry in `fuzz/Cargo.toml`; the regression test
//! checks that the three agree.

use packshard_equivalence::compare::RelativeRule;
use packshard_equivalence::compare::{Mismatch, Tolerance};
use packshard_equivalence::fuzz::{self, catch_panic, Failure, Outcome};
use packshard_equivalence::vocab::Rule;
use packshard_equivalence::{attention, packing, vocab};
use packshard_optimized::oracle::{DenseAsVarlen, FusedAlg2, ATTENTION_BF16, ATTENTION_F32};
use packshard_optimized::vocab::Chunks;

/// The optimized f32 attention kernels against the f64 reference: 64 ulp of
/// f32 times the magnitude of the terms (the inputs' rounding to f32 is far
/// inside it).
const F32_ATTENTION: Tolerance = Tolerance::F32_REWRITE;

/// bf16 inputs: their rounding (2^-9 relative) dominates; 16 ulp of bf16
/// times the magnitude of the terms.
const BF16_ATTENTION: Tolerance =
    Tolerance::new("bf16 inputs (16 ulp of bf16)", 16.0 / 256.0, 16.0 / 256.0);

/// Chunks small enough that fuzz cases (`v <= 64`) cross chunk edges.
const FUZZ_CHUNKS: Chunks = Chunks {
    tokens: 3,
    vocab: 5,
};

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

/// Every fuzz target, in the order `cargo fuzz list` prints them.
pub fn targets() -> Vec<Target> {
    vec![
        Target {
            name: "attention",
            summary: "reference varlen attention, forward and backward, against itself packed and padded (P2, P4, P8), malformed cu_seqlens refused",
            run: |d| fuzz::attention::run(&attention::Reference, Tolerance::F64_REWRITE, d),
        },
        Target {
            name: "cross_entropy",
            summary: "reference sharded cross-entropy (naive, alg1, alg2) against the unsharded reference (V1, V2, V4, V6)",
            run: |d| fuzz::vocab::run_cross_entropy(&vocab::Reference, d),
        },
        Target {
            name: "embedding",
            summary: "reference sharded embedding against the unsharded lookup, exactly (V5)",
            run: |d| fuzz::vocab::run_embedding(&vocab::Reference, d),
        },
        Target {
            name: "eval_json",
            summary: "packshard eval on arbitrary text: a result or a typed error of the contract's kinds, never a panic",
            run: eval_json,
        },
        Target {
            name: "linear_cross_entropy",
            summary: "reference sharded output layer (naive, alg1, alg2) against the unsharded reference (V3)",
            run: |d| fuzz::vocab::run_linear(&vocab::Reference, d),
        },
        Target {
            name: "optimized_attention",
            summary: "optimized f32 varlen attention (attention_varlen_tiled), forward and backward, against the f64 reference, packed == padded",
            run: |d| fuzz::attention::run(&ATTENTION_F32, F32_ATTENTION, d),
        },
        Target {
            name: "optimized_attention_bf16",
            summary: "optimized varlen attention on bf16 inputs (attention_varlen_tiled_bf16) against the f64 reference",
            run: |d| fuzz::attention::run(&ATTENTION_BF16, BF16_ATTENTION, d),
        },
        Target {
            name: "optimized_attention_dense",
            summary: "optimized dense masked attention with the block-diagonal mask (attention_dense_masked) against the f64 reference",
            run: |d| fuzz::attention::run(&DenseAsVarlen, F32_ATTENTION, d),
        },
        Target {
            name: "optimized_cross_entropy",
            summary: "optimized f32 alg2 shard cross-entropy against the unsharded reference under RelativeRule::F32_FUZZ",
            run: |d| fuzz::vocab::run_cross_entropy_with(&FusedAlg2(FUZZ_CHUNKS), Rule::Relative(RelativeRule::F32_FUZZ), d),
        },
        Target {
            name: "optimized_linear_cross_entropy",
            summary: "optimized fused chunked output layer, alg2 shards, against the unsharded reference under RelativeRule::F32_FUZZ",
            run: |d| fuzz::vocab::run_linear_with(&FusedAlg2(FUZZ_CHUNKS), Rule::Relative(RelativeRule::F32_FUZZ), d),
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
        panic!("no fuzz target {name:?} in packshard::fuzzing::targets()");
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
