//! The loss suites' chunk-crossing cases (`vocab::CHUNK_CROSSING`): they
//! run on the reference, and they catch a vocabulary-chunked kernel that
//! the suites' random cases (at most 41 entries) let pass.

use packshard_equivalence::planted::{CeCall, Planted, VocabHooks};
use packshard_equivalence::vocab::{run_cross_entropy_suite, run_linear_suite, CHUNK_CASES};
use packshard_equivalence::{Judge, Tolerance};
use packshard_reference::ops::CrossEntropyOp;
use packshard_reference::vocab::cross_entropy::CrossEntropy;
use packshard_reference::vocab::ReferenceCrossEntropy;
use packshard_reference::Error;

const F64: Judge = Judge::Rewrite(Tolerance::F64_REWRITE);

/// An unsharded vocabulary-chunked logsumexp, chunks of 1024 entries,
/// whose loop runs over the whole chunks of a vocabulary wider than one
/// chunk and so drops the last partial one (seen from outside: those logits
/// count as `-inf`); at most one chunk is one pass, right. Its sharded path
/// is the reference's: a sharded one is already caught by the docs/FAULTS.md
/// V4 example (250,682 entries over 8 ranks of 31,336), an unsharded one by
/// nothing before the chunk-crossing cases.
struct DropsLastPartialChunk;

const CHUNK: usize = 1024;

impl VocabHooks for DropsLastPartialChunk {
    fn cross_entropy(&self, c: CeCall<'_>) -> Result<CrossEntropy, Error> {
        let v = c.input.ncols();
        let mut z = c.input.to_owned();
        if v > CHUNK && v % CHUNK != 0 {
            for j in v / CHUNK * CHUNK..v {
                z.column_mut(j).fill(f64::NEG_INFINITY);
            }
        }
        ReferenceCrossEntropy.cross_entropy(CeCall::new(z.view(), c.call))
    }
}

struct ReferenceHooks;
impl VocabHooks for ReferenceHooks {}

#[test]
fn the_reference_passes_the_chunk_crossing_cases() {
    let c = run_cross_entropy_suite(&Planted(ReferenceHooks), F64, 16).unwrap();
    assert_eq!(c.chunk_crossing, CHUNK_CASES, "{c:?}");
    let c = run_linear_suite(&Planted(ReferenceHooks), F64, 16).unwrap();
    assert_eq!(c.chunk_crossing, CHUNK_CASES, "{c:?}");
}

#[test]
fn a_logsumexp_dropping_the_last_partial_chunk_fails_only_the_chunk_crossing_cases() {
    let m = run_cross_entropy_suite(&Planted(DropsLastPartialChunk), F64, 48).unwrap_err();
    let text = m.to_string();
    assert!(text.contains("chunk-crossing cases"), "{text}");
}
