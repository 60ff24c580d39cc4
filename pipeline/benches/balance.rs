//! The balance benchmark of issue #5: baseline vs vocab-parallel (alg1,
//! alg2) at the real MiniLM shape (vocab 30522, hidden 384, 6 layers, 8
//! microbatches of 2 x 16 tokens), each under `mpirun -n P` in one run.
//!
//! For each P it first checks the MiniLM-shaped pipeline's loss and every
//! gradient against the single-process reference (the job exits 1 on a
//! difference and the benchmark stops), then runs
//! `PACKSHARD_BENCH_ROUNDS` (default 3) rounds, each one job that times
//! every placement `PACKSHARD_BENCH_ITERATIONS` (default 2) times and prints
//! its per-rank report: placements alternate round by round, so a burst of
//! other load on a shared machine hits all of them alike. The summary gives
//! the largest rank's parameter+activation bytes over the smallest's, each
//! round's fastest iteration and the fastest of all rounds against the
//! baseline's, and whether the target holds (P = 2: spread <= 10 %
//! and faster than the baseline).
//!
//! `cargo bench -p packshard-pipeline --bench balance`;
//! `PACKSHARD_BENCH_RANKS=2,3,4` picks the rank counts (default 2,4). Times
//! are wall-clock: with more ranks than cores they share cores (the report
//! says "oversubscribed"), and other work on the machine slows them.

use std::process::{Command, ExitCode};

/// The memory target: largest rank within 10 % of the smallest.
const SPREAD_TARGET: f64 = 0.10;

/// One placement's line of the summary.
struct Row {
    name: String,
    spread: f64,
    iteration: f64,
}

fn parse(report: &str) -> Vec<Row> {
    let mut rows = Vec::new();
    for line in report.lines() {
        let Some((name, rest)) = line.split_once(" memory: largest rank ") else {
            continue;
        };
        // "X MB = 0.1% above the smallest (Y MB); iteration 4.027 s"
        let pct = rest
            .split_once("= ")
            .and_then(|(_, r)| r.split_once('%'))
            .and_then(|(v, _)| v.trim().parse::<f64>().ok());
        let it = rest
            .rsplit_once("iteration ")
            .and_then(|(_, r)| r.trim_end_matches(" s").trim().parse::<f64>().ok());
        if let (Some(pct), Some(it)) = (pct, it) {
            rows.push(Row {
                name: name.trim().to_string(),
                spread: pct / 100.0,
                iteration: it,
            });
        }
    }
    rows
}

/// Runs `mpirun -n p packshard-pipeline args...`, echoing its output;
/// `None` (after a message) when the job failed.
fn job(p: usize, args: &[&str]) -> Option<String> {
    let out = Command::new("mpirun")
        .args(["-n", &p.to_string(), "--oversubscribe"])
        .arg(env!("CARGO_BIN_EXE_packshard-pipeline"))
        .args(args)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .output();
    let out = match out {
        Ok(o) => o,
        Err(e) => {
            eprintln!("balance: cannot run mpirun ({e}): install OpenMPI");
            return None;
        }
    };
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    print!("{stdout}");
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    println!();
    if out.status.success() {
        Some(stdout)
    } else {
        eprintln!("balance: p = {p} {args:?}: the job failed ({})", out.status);
        None
    }
}

/// A placement over the rounds: name, memory spread, each round's fastest
/// iteration (s).
type Timed = (String, f64, Vec<f64>);

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or(default)
}

fn main() -> ExitCode {
    let ranks: Vec<usize> = std::env::var("PACKSHARD_BENCH_RANKS")
        .unwrap_or_else(|_| "2,4".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let iterations = env_usize("PACKSHARD_BENCH_ITERATIONS", 2).to_string();
    let rounds = env_usize("PACKSHARD_BENCH_ROUNDS", 3);
    let mut summary: Vec<(usize, Vec<Timed>)> = Vec::new();
    for &p in &ranks {
        println!("== p = {p}: check at the MiniLM shape");
        if job(p, &["--check", "--model", "minilm", "--iterations", "1"]).is_none() {
            return ExitCode::from(1);
        }
        let mut rows: Vec<Timed> = Vec::new();
        for round in 1..=rounds {
            println!("== p = {p}: round {round} of {rounds}");
            let Some(report) = job(
                p,
                &["--report", "--model", "minilm", "--iterations", &iterations],
            ) else {
                return ExitCode::from(1);
            };
            for r in parse(&report) {
                match rows.iter_mut().find(|x| x.0 == r.name) {
                    Some(x) => x.2.push(r.iteration),
                    None => rows.push((r.name, r.spread, vec![r.iteration])),
                }
            }
        }
        summary.push((p, rows));
    }
    println!(
        "summary (fastest iteration of each round, then of all; target at p = 2: vocab-parallel spread <= 10% and iteration below the baseline's):"
    );
    println!(
        "  {:>2}  {:<20} {:>8}  {:<26} {:>9} {:>11}  target",
        "p", "placement", "spread", "rounds (s)", "fastest", "vs baseline"
    );
    let fastest = |v: &[f64]| v.iter().copied().fold(f64::INFINITY, f64::min);
    for (p, rows) in &summary {
        let base = rows
            .iter()
            .find(|r| r.0 == "baseline")
            .map(|r| fastest(&r.2));
        for (name, spread, its) in rows {
            let best = fastest(its);
            let speedup = base.map(|b| b / best);
            let target = if name == "baseline" || *p != 2 {
                "-".to_string()
            } else {
                let mem = *spread <= SPREAD_TARGET;
                let time = speedup.is_some_and(|s| s > 1.0);
                match (mem, time) {
                    (true, true) => "met".into(),
                    (false, true) => "NOT met (memory)".into(),
                    (true, false) => "NOT met (time)".into(),
                    (false, false) => "NOT met (memory, time)".into(),
                }
            };
            let rounds: Vec<String> = its.iter().map(|t| format!("{t:.3}")).collect();
            println!(
                "  {:>2}  {:<20} {:>7.1}%  {:<26} {:>8.3}s {:>10}  {target}",
                p,
                name,
                100.0 * spread,
                rounds.join(" "),
                best,
                speedup.map_or("-".into(), |s| format!("{s:.2}x")),
            );
        }
    }
    ExitCode::SUCCESS
}
