//! `packshard pipeline`: the launcher of the MPI pipeline (crate `pipeline/`).
//!
//! The error paths need no MPI. The launch itself needs `mpirun` and the
//! `packshard-pipeline` binary next to `packshard` (built by `cargo test
//! --workspace`, which CI runs); without them it is skipped with the reason
//! printed, unless `PACKSHARD_REQUIRE_MPI=1` (set by `scripts/test.sh`), where
//! it fails instead.

use std::path::PathBuf;
use std::process::{Command, Output};

mod common;
use common::{packshard, stderr_text, stdout_text, temp_path};

fn text(out: &Output) -> (String, String) {
    (stdout_text(out), stderr_text(out))
}

/// `packshard <args>`, which must exit with status 2 (bad usage): its
/// stdout and stderr.
fn refused(args: &[&str]) -> (String, String) {
    let out = packshard(args, None);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(2), "{args:?}: {stdout}{stderr}");
    (stdout, stderr)
}

#[test]
fn a_missing_mpirun_is_one_typed_line_and_status_2() {
    let (stdout, stderr) = refused(&[
        "pipeline",
        "--ranks",
        "2",
        "--mpirun",
        "/nonexistent/mpirun",
    ]);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.starts_with("packshard: --mpirun: cannot run `/nonexistent/mpirun`")
            && stderr.contains("apt-get install -y libopenmpi-dev openmpi-bin libclang-dev"),
        "{stderr}"
    );
    assert!(stdout.is_empty(), "{stdout}");
}

#[test]
fn bad_ranks_and_iterations_name_the_argument() {
    for (args, want) in [
        (
            vec!["pipeline", "--ranks", "0"],
            "packshard: --ranks: 0 is outside 1..=64",
        ),
        (
            vec!["pipeline", "--ranks", "65"],
            "packshard: --ranks: 65 is outside 1..=64",
        ),
        (
            vec!["pipeline", "--ranks", "2", "--iterations", "0"],
            "packshard: --iterations: must be at least 1",
        ),
        (
            vec!["pipeline", "--ranks", "2", "--microbatches", "0"],
            "packshard: --microbatches: must be at least 1",
        ),
    ] {
        let (_, stderr) = refused(&args);
        assert_eq!(stderr.trim_end(), want, "{args:?}");
    }
}

#[test]
fn a_missing_binary_names_where_it_was_looked_for() {
    if !has_mpirun() {
        skip("mpirun is not installed");
        return;
    }
    let (_, stderr) = refused(&[
        "pipeline",
        "--ranks",
        "2",
        "--bin",
        "/nonexistent/packshard-pipeline",
    ]);
    assert!(
        stderr.starts_with(
            "packshard: --bin: the pipeline binary is not at /nonexistent/packshard-pipeline"
        ),
        "{stderr}"
    );
}

fn has_mpirun() -> bool {
    Command::new("mpirun")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

fn require() -> bool {
    std::env::var("PACKSHARD_REQUIRE_MPI").is_ok_and(|v| v == "1")
}

/// Prints why a test did not run; fails instead under
/// `PACKSHARD_REQUIRE_MPI=1`.
fn skip(reason: &str) {
    assert!(
        !require(),
        "PACKSHARD_REQUIRE_MPI=1 but {reason} (scripts/test.sh installs OpenMPI and runs cargo test --workspace)"
    );
    eprintln!("skipped: {reason}");
}

/// The pipeline binary the launcher finds next to `packshard`.
fn pipeline_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_packshard")).with_file_name(format!(
        "packshard-pipeline{}",
        std::env::consts::EXE_SUFFIX
    ))
}

/// `packshard pipeline --ranks 2`: the equivalence check for every placement
/// and algorithm, PASS, then the balance report at the MiniLM shape with
/// every rank of every placement.
#[test]
fn pipeline_prints_the_equivalence_check_and_the_balance_report() {
    if !has_mpirun() {
        skip("mpirun is not installed");
        return;
    }
    if !pipeline_bin().is_file() {
        skip(&format!(
            "{} is not built (cargo test --workspace builds it)",
            pipeline_bin().display()
        ));
        return;
    }
    let plot = temp_path("balance", "plot.svg");
    let out = packshard(
        &[
            "pipeline",
            "--ranks",
            "2",
            "--iterations",
            "1",
            "--plot",
            plot.to_str().expect("utf-8 temp path"),
        ],
        None,
    );
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}{stderr}");
    assert!(
        stdout.contains("equivalence with the single-process reference, p = 2"),
        "{stdout}"
    );
    for name in ["baseline", "vocab-parallel alg1", "vocab-parallel alg2"] {
        let check = stdout
            .lines()
            .find(|l| l.trim_start().starts_with(name))
            .unwrap_or_else(|| panic!("no check row for {name}:\n{stdout}"));
        assert!(check.trim_end().ends_with("PASS"), "{check}");
        for r in 0..2 {
            assert!(
                stdout.lines().any(|l| {
                    let f: Vec<&str> = l.split_whitespace().collect();
                    l.trim_start().starts_with(name)
                        && f.get(name.split(' ').count()) == Some(&r.to_string().as_str())
                }),
                "{name}: no report row for rank {r}:\n{stdout}"
            );
        }
    }
    assert!(
        stdout.contains("balance report, p = 2") && stdout.contains("v 30522, hidden 384"),
        "{stdout}"
    );
    // The picture of the same report: a bar label for every rank of every
    // placement, and the five parts of the legend (plotters writes each
    // text on its own line inside <text>).
    let svg = std::fs::read_to_string(&plot).expect("--plot wrote the SVG");
    let _ = std::fs::remove_file(&plot);
    assert!(stdout.contains("plot written to"), "{stdout}");
    for name in ["baseline", "vocab-parallel alg1", "vocab-parallel alg2"] {
        for r in 0..2 {
            let label = format!("{name} r{r}");
            assert!(svg.lines().any(|l| l.trim() == label), "no bar for {label}");
        }
    }
    for part in [
        "parameters",
        "peak activations",
        "compute",
        "communication",
        "idle",
    ] {
        assert!(
            svg.lines().any(|l| l.trim() == part),
            "no legend entry {part}"
        );
    }
}
