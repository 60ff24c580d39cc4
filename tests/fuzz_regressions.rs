//! Every committed fuzz input — the seeds in `fuzz/seeds/<target>/` and the
//! inputs that ever failed in `fuzz/regressions/<target>/` — replayed through
//! the body its libFuzzer target runs (`packshard::fuzzing`), so a failure
//! once fixed stays fixed. Also: the registry, the target files and
//! `fuzz/Cargo.toml` name the same targets, and every target has seeds.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use packshard::equivalence::fuzz::schedule::{SizeClass, LARGE_FROM};
use packshard::equivalence::fuzz::{replay_dirs, Outcome};
use packshard::fuzzing::targets;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn names_in(dir: &Path) -> BTreeSet<String> {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn every_committed_fuzz_input_passes() {
    let mut total = Outcome::default();
    for t in targets() {
        let seeds = root().join("fuzz/seeds").join(t.name);
        let regressions = root().join("fuzz/regressions").join(t.name);
        let seen = replay_dirs(&[&seeds, &regressions], t.run).unwrap_or_else(|e| panic!("{e}"));
        eprintln!("{}: {seen:?}", t.name);
        // Every target starts its fuzzing from real cases, and replays them here.
        assert!(
            seen.cases >= 2,
            "{}: only {} committed inputs",
            t.name,
            seen.cases
        );
        assert!(
            seen.compared >= 1,
            "{}: no committed input is compared: {seen:?}",
            t.name
        );
        total.merge(seen);
    }
    eprintln!("all targets: {total:?}");
}

#[test]
fn regressions_are_replayed_and_named_for_their_target() {
    // The inputs that once failed (an 8M-piece split that ran out of memory,
    // ...) are in the regression corpus, and each corpus directory belongs
    // to a target.
    let known: BTreeSet<String> = targets().iter().map(|t| t.name.to_string()).collect();
    for kind in ["seeds", "regressions"] {
        for dir in names_in(&root().join("fuzz").join(kind)) {
            assert!(
                known.contains(&dir),
                "fuzz/{kind}/{dir} belongs to no fuzz target ({known:?})"
            );
        }
    }
    let eval = names_in(&root().join("fuzz/regressions/eval_json"));
    assert!(
        eval.iter().filter(|n| n.starts_with("regression-")).count() >= 3,
        "{eval:?}"
    );
}

#[test]
fn registry_target_files_and_fuzz_manifest_agree() {
    let known: BTreeSet<String> = targets().iter().map(|t| t.name.to_string()).collect();
    let files: BTreeSet<String> = names_in(&root().join("fuzz/fuzz_targets"))
        .into_iter()
        .filter_map(|f| f.strip_suffix(".rs").map(str::to_string))
        .collect();
    assert_eq!(
        files, known,
        "fuzz/fuzz_targets/*.rs vs packshard::fuzzing::targets()"
    );
    let manifest = std::fs::read_to_string(root().join("fuzz/Cargo.toml")).unwrap();
    let bins: BTreeSet<String> = manifest
        .lines()
        .filter_map(|l| l.strip_prefix("name = \""))
        .filter_map(|l| l.strip_suffix('"'))
        .filter(|n| *n != "packshard-fuzz")
        .map(str::to_string)
        .collect();
    assert_eq!(bins, known, "[[bin]] entries of fuzz/Cargo.toml");
    for name in &known {
        let text =
            std::fs::read_to_string(root().join(format!("fuzz/fuzz_targets/{name}.rs"))).unwrap();
        // As rustfmt may wrap it: compared without whitespace.
        let flat: String = text.split_whitespace().collect();
        assert!(
            flat.contains(&format!("packshard_oracle::fuzzing::fuzz(\"{name}\",data)")),
            "fuzz/fuzz_targets/{name}.rs must run the body registered as {name:?}"
        );
    }
}

#[test]
fn the_libfuzzer_entry_panics_with_a_readable_failure() {
    // An eval case that passes, and the entry for an unknown target.
    packshard::fuzzing::fuzz(
        "eval_json",
        br#"{"op": "pack", "lengths": [1, 2], "max_seq_len": 4}"#,
    );
    let err = std::panic::catch_unwind(|| packshard::fuzzing::fuzz("no_such_target", b""))
        .expect_err("an unknown target panics");
    let msg = err.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(msg.contains("no fuzz target \"no_such_target\""), "{msg}");
}

/// At most one seeded input in this many is large (see the loop).
const LARGE_SHARE: usize = 100;

/// Inputs derived deterministically from the committed ones: `FUZZ_RUNS`
/// (default 2000) per target (at most 1 in [`LARGE_SHARE`] of them large),
/// drawn from a ChaCha8 stream seeded with
/// `FUZZ_SEED` (default 1) and the target's name. Each is a committed input
/// with 1 to 8 mutations (a byte set, inserted, deleted, or a run copied from
/// elsewhere in the input — libFuzzer's basic mutators), or, one time in
/// eight, fresh random bytes. This is CI's fuzz step: the same inputs on every
/// clone, so a run fails only for a change it was given; coverage-guided
/// campaigns that look for new failures are `scripts/fuzz_campaign.sh`, and
/// what they find is committed to `fuzz/regressions/` and replayed above.
#[test]
fn seeded_mutations_of_the_committed_inputs_pass() {
    use rand::{Rng, SeedableRng};
    let runs: usize = std::env::var("FUZZ_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000);
    let seed: u64 = std::env::var("FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    if runs == 0 {
        eprintln!("FUZZ_RUNS=0: seeded fuzzing skipped");
        return;
    }
    for t in targets() {
        let mut corpus: Vec<Vec<u8>> = Vec::new();
        for kind in ["seeds", "regressions"] {
            let dir = root().join("fuzz").join(kind).join(t.name);
            let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
                .map(|e| e.map(|e| e.unwrap().path()).collect())
                .unwrap_or_default();
            files.retain(|p| {
                p.is_file() && !p.file_name().unwrap().to_string_lossy().starts_with('.')
            });
            files.sort();
            corpus.extend(files.iter().map(|p| std::fs::read(p).unwrap()));
        }
        assert!(!corpus.is_empty(), "{}: no committed inputs", t.name);
        let name_hash = t.name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        });
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ name_hash);
        let mut total = Outcome::default();
        let mut large = 0usize;
        for run in 0..runs {
            let input: Vec<u8> = if rng.random_range(0..8) == 0 {
                let len = rng.random_range(0..512);
                (0..len).map(|_| rng.random()).collect()
            } else {
                let mut d = corpus[rng.random_range(0..corpus.len())].clone();
                for _ in 0..rng.random_range(1..=8) {
                    let at = rng.random_range(0..=d.len());
                    match rng.random_range(0..4) {
                        0 if at < d.len() => d[at] = rng.random(),
                        1 => d.insert(at, rng.random()),
                        2 if at < d.len() => {
                            d.remove(at);
                        }
                        _ if !d.is_empty() => {
                            let from = rng.random_range(0..d.len());
                            let len = rng.random_range(1..=16).min(d.len() - from);
                            let run: Vec<u8> = d[from..from + len].to_vec();
                            d.splice(at..at, run);
                        }
                        _ => d.push(rng.random()),
                    }
                }
                d
            };
            // A large input (first byte >= LARGE_FROM: segments of a thousand
            // tokens, vocabularies of thousands) costs 10^2 to 10^3 small
            // ones; past `runs / LARGE_SHARE` of them per target the rest
            // are read as small, so the step stays minutes, not tens of
            // minutes. The default checks run 12 large cases per kernel.
            let mut input = input;
            if SizeClass::of(&input) == SizeClass::Large {
                if large < runs / LARGE_SHARE {
                    large += 1;
                } else {
                    input[0] %= LARGE_FROM;
                }
            }
            match (t.run)(&input) {
                Ok(o) => total.merge(o),
                Err(f) => panic!(
                    "{}: seeded input {run} (FUZZ_SEED={seed}) failed: {f}\ninput bytes: {input:?}",
                    t.name
                ),
            }
        }
        eprintln!(
            "{} (FUZZ_SEED={seed}, {runs} inputs, {large} large): {total:?}",
            t.name
        );
        // The mutated inputs reach the comparisons, not only the parsers.
        assert!(
            total.compared + total.errors_alike >= 1,
            "{}: no seeded input was compared: {total:?}",
            t.name
        );
    }
}
