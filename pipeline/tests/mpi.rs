//! The pipeline under `mpirun`: equivalence with the single-process
//! reference for p in 1..=4, both placements and both algorithms; the
//! negative control; the balance report; faults on one rank ending the whole
//! job, bounded in time. Every launch runs in its own process group with a
//! wall-clock limit: past it the group is killed and the test fails (never
//! a hang); after a launch no process of the group may be left.
//!
//! Needs `mpirun` (OpenMPI; `scripts/test.sh` installs it).

mod common;

use std::time::Duration;

use common::Launch;

/// Runs `mpirun -n p packshard-pipeline args...`, killing its process group
/// after `limit`.
fn mpirun(p: usize, args: &[&str], limit: Duration) -> Launch {
    common::mpirun(env!("CARGO_BIN_EXE_packshard-pipeline"), p, args, limit)
}

const LIMIT: Duration = Duration::from_secs(180);

/// p in 1..=4, baseline and vocab-parallel alg1 and alg2: loss and every
/// gradient equal the single-process reference (the binary compares them at
/// rank 0 under `PIPELINE_TOLERANCE` and exits 1 otherwise); the baseline is
/// bit-identical (the same ops in the same order).
#[test]
fn equivalence_with_the_single_process_reference_for_p_1_to_4() {
    for p in 1..=4 {
        let run = mpirun(p, &["--check"], LIMIT);
        assert_eq!(run.code, Some(0), "p {p}:\n{}", run.output);
        let rows: Vec<&str> = run
            .output
            .lines()
            .filter(|l| {
                l.trim_start().starts_with("baseline")
                    || l.trim_start().starts_with("vocab-parallel")
            })
            .collect();
        assert_eq!(
            rows.len(),
            3,
            "p {p}: one row per placement:\n{}",
            run.output
        );
        for (row, name) in
            rows.iter()
                .zip(["baseline", "vocab-parallel alg1", "vocab-parallel alg2"])
        {
            assert!(row.trim_start().starts_with(name), "{row}");
            assert!(row.trim_end().ends_with("PASS"), "p {p}: {row}");
        }
        assert!(
            rows[0].contains("(all bit-identical)"),
            "p {p}: {}",
            rows[0]
        );
        // 86 tensors: 4 embedding tensors, 16 per layer x 5, the output layer, the loss.
        assert!(rows.iter().all(|r| r.contains(" 86 ")), "{}", run.output);
        assert!(run.output.contains(&format!(
            "equivalence with the single-process reference, p = {p}"
        )));
    }
}

/// Negative control: the last rank drops microbatch 0's output-layer weight
/// gradient; the check names `output.weight` for every placement and exits 1.
#[test]
fn a_planted_bug_is_caught_and_named() {
    let run = mpirun(2, &["--check", "--plant-bug", "drop-output-grad"], LIMIT);
    assert_eq!(run.code, Some(1), "{}", run.output);
    assert_eq!(
        run.output.matches("output.weight: max |diff|").count(),
        3,
        "{}",
        run.output
    );
    assert!(run.output.contains("; FAIL"), "{}", run.output);
}

/// The balance report prints every rank of every placement, with its bytes
/// and times.
#[test]
fn the_balance_report_covers_every_rank_and_placement() {
    let run = mpirun(3, &["--report"], LIMIT);
    assert_eq!(run.code, Some(0), "{}", run.output);
    for name in ["baseline", "vocab-parallel alg1", "vocab-parallel alg2"] {
        for r in 0..3 {
            let found = run.output.lines().any(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                l.trim_start().starts_with(name)
                    && f.get(name.split(' ').count()) == Some(&r.to_string().as_str())
            });
            assert!(found, "{name} rank {r} missing:\n{}", run.output);
        }
        assert!(
            run.output
                .contains(&format!("{name:<22} memory: largest rank")),
            "{}",
            run.output
        );
    }
    assert!(
        run.output.contains("vocab-parallel alg2 vs baseline"),
        "{}",
        run.output
    );
    assert!(
        run.output.contains("oversubscribed") == (3 > cores()),
        "{}",
        run.output
    );
}

fn cores() -> usize {
    // SAFETY: sysconf has no preconditions.
    usize::try_from(unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) }).unwrap_or(1)
}

/// How long a failed job may take to end, from launch: the tiny model's
/// iteration takes well under a second; OpenMPI tears a job down within a
/// second or two of `MPI_Abort` or a dead process.
const FAULT_BOUND: Duration = Duration::from_secs(30);

/// Runs `p` ranks with fault `kind` on `rank` at microbatch 1: the job fails
/// within [`FAULT_BOUND`], no rank finishes, and the output says each of
/// `says`.
fn fault(kind: &str, p: usize, rank: usize, says: &[&str]) -> Launch {
    let run = mpirun(
        p,
        &[
            "--check",
            "--placement",
            "vocab-parallel",
            "--fault",
            kind,
            "--fault-rank",
            &rank.to_string(),
            "--fault-microbatch",
            "1",
        ],
        LIMIT,
    );
    eprintln!("{kind}: exit {:?} after {:?}", run.code, run.elapsed);
    assert_ne!(
        run.code,
        Some(0),
        "{kind}: the job must fail:\n{}",
        run.output
    );
    assert!(run.elapsed < FAULT_BOUND, "{kind}: took {:?}", run.elapsed);
    assert!(
        !run.output.contains("equivalence with"),
        "{kind}: no rank may finish:\n{}",
        run.output
    );
    for needle in says {
        assert!(
            run.output.contains(needle),
            "{kind}: {needle:?} in\n{}",
            run.output
        );
    }
    run
}

/// Bad input on one rank (its copy of microbatch 1's `cu_seqlens`): a typed
/// error naming the field, printed by that rank, and the job aborts.
#[test]
fn bad_input_on_one_rank_ends_every_rank_with_its_message() {
    let says = "packshard-pipeline: rank 1: cu_seqlens[2]: is 14, must equal the 13 tokens";
    let run = fault("bad-input", 3, 1, &[says]);
    assert_eq!(run.code, Some(2), "{}", run.output);
}

/// A panic on one rank: its hook prints the rank, place and message on one
/// line and aborts the job.
#[test]
fn a_panic_on_one_rank_ends_every_rank_with_its_message() {
    let says = [
        "packshard-pipeline: rank 2: panicked at",
        "fault injection: rank 2 panics in the forward of microbatch 1",
    ];
    let run = fault("panic", 4, 2, &says);
    assert_eq!(run.code, Some(101), "{}", run.output);
}

/// A rank killed with SIGKILL: it can say nothing after; mpirun notices the
/// death, names the rank and kills the others.
#[test]
fn a_killed_rank_ends_every_rank() {
    let says = [
        "rank 1: fault injection: killing this process",
        "process rank 1",
    ];
    let run = fault("kill", 2, 1, &says);
    assert!(run.code.is_some_and(|c| c != 0), "{}", run.output);
}

/// Bad arguments are seen alike by every rank: exit 2 with one message, no abort.
#[test]
fn bad_arguments_exit_2_on_every_rank() {
    let run = mpirun(2, &["--check", "--layers", "1"], LIMIT);
    assert_eq!(run.code, Some(2), "{}", run.output);
    assert!(
        run.output
            .contains("packshard-pipeline: layers: 1 layers for 2 pipeline stages"),
        "{}",
        run.output
    );
    assert!(!run.output.contains("MPI_ABORT"), "{}", run.output);
}
