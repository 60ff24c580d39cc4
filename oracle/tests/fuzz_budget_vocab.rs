//! Every registered loss and embedding kernel over the default budget of
//! the fuzz targets (`fuzz_budgeted(Budget::DEFAULT, 0, ..)`: 88 small
//! cases, then 12 large ones crossing vocabulary and token chunks), in the
//! configuration and under the judge its fuzz target runs it with, timed
//! (the figures of docs/FAULTS.md, "How results are judged").

use std::time::Instant;

use packshard_equivalence::fuzz::schedule::{fuzz_budgeted, Budget};
use packshard_equivalence::fuzz::vocab::{run_cross_entropy, run_embedding, run_linear};
use packshard_equivalence::fuzz::{Failure, Outcome};
use packshard_oracle::registry::{self, Entry};

/// Runs `body` over the default budget of seed 0 for every available entry
/// of `list`, in its registered configuration and its small one (tiles the
/// small cases cross; what its fuzz target runs), printing each one's time;
/// the number of configurations that ran.
fn every<K: ?Sized>(
    family: &str,
    list: &[Entry<K>],
    body: impl Fn(&K, &Entry<K>, &[u8]) -> Result<Outcome, Failure>,
) -> usize {
    let mut ran = 0;
    for entry in list {
        let configs = if entry.has_small() {
            vec![("registered", entry.make()), ("small", entry.make_small())]
        } else {
            vec![("registered", entry.make())]
        };
        for (which, made) in configs {
            let name = format!("{family} {} ({which})", entry.name);
            let imp = match made {
                Ok(imp) => imp,
                Err(u) if entry.needs.required() => panic!("{name}: required here: {u}"),
                Err(u) => {
                    eprintln!("{name}: skipped: {u}");
                    continue;
                }
            };
            let t = Instant::now();
            let seen = fuzz_budgeted(Budget::DEFAULT, 0, |d| body(&imp, entry, d))
                .unwrap_or_else(|f| panic!("{name}: {f}"));
            eprintln!("{name}: {:.2} s, {seen:?}", t.elapsed().as_secs_f64());
            assert_eq!(seen.cases, Budget::DEFAULT.cases);
            assert!(seen.compared >= 80, "{name}: {seen:?}");
            ran += 1;
        }
    }
    ran
}

#[test]
fn registered_cross_entropy_kernels_pass_the_default_budget() {
    let ran = every("cross_entropy", &registry::cross_entropy(), |imp, e, d| {
        run_cross_entropy(imp, e.fuzz_judge, d)
    });
    assert!(ran >= 2, "{ran}");
}

#[test]
fn registered_output_layers_pass_the_default_budget() {
    let ran = every(
        "linear_cross_entropy",
        &registry::linear_cross_entropy(),
        |imp, e, d| run_linear(imp, e.fuzz_judge, d),
    );
    assert!(ran >= 2, "{ran}");
}

#[test]
fn registered_embeddings_pass_the_default_budget() {
    let ran = every("embedding", &registry::embedding(), |imp, _, d| {
        run_embedding(imp, d)
    });
    assert!(ran >= 1, "{ran}");
}
