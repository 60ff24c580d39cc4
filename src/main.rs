//! The `packshard` command line. See `packshard --help` and the README.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Every `print!`/`println!` of the binary goes through [`out::write`]: a
/// closed pipe (`packshard pack --json | head -c10`) ends the process quietly
/// with status 0, as Unix tools do, and any other write error (`> /dev/full`)
/// is one line on standard error and status [`out::WRITE_FAILED`]; never the
/// panic of `std`'s macros. These shadow the prelude's macros in every module
/// declared below.
macro_rules! print {
    ($($arg:tt)*) => { $crate::out::write(format_args!($($arg)*)) };
}
macro_rules! println {
    () => { $crate::out::write(format_args!("\n")) };
    ($($arg:tt)*) => { $crate::out::write(format_args!("{}\n", format_args!($($arg)*))) };
}

mod cli;
mod out;

/// Counts heap bytes so that `packshard bench` can report peak memory.
#[global_allocator]
static ALLOC: packshard::optimized::alloc::CountingAlloc =
    packshard::optimized::alloc::CountingAlloc;

/// Correctness oracle for sequence packing and vocabulary parallelism.
#[derive(Parser)]
#[command(name = "packshard", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Pack sequence lengths and compare the algorithms (default: every algorithm on wikipedia-512).
    Pack(cli::pack::PackArgs),
    /// Evaluate JSON cases through the oracle interface (docs/INTERFACE.md).
    Eval(cli::eval::EvalArgs),
    /// Compare the vocabulary-parallel algorithms on one output layer (default: MiniLM's 30522 x 384).
    Vocab(cli::vocab::VocabArgs),
    /// Check packed == padded on a real model and real text (`verify bert`).
    Verify(cli::verify::VerifyArgs),
    /// Write golden test vectors: inputs, expected outputs and tolerances for every op.
    Golden(cli::golden::GoldenArgs),
    /// Check a framework's outputs (RESULTS.safetensors) against golden vectors.
    Check(cli::check::CheckArgs),
    /// Run the vocabulary-parallel 1F1B pipeline under mpirun: equivalence check and balance report.
    Pipeline(cli::pipeline::PipelineArgs),
    /// Time the optimized kernels against their baselines in one run (--quick for CI sizes).
    Bench(cli::bench::BenchArgs),
}

fn main() -> ExitCode {
    // Large temporaries are reused from call to call, not mapped afresh
    // (optimized::alloc::keep_freed_memory: measured in docs/BENCHMARKS.md).
    packshard::optimized::alloc::keep_freed_memory();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e)
            if matches!(
                e.kind(),
                clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion
            ) =>
        {
            e.exit()
        }
        Err(e)
            if matches!(
                e.kind(),
                clap::error::ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
            ) =>
        {
            let _ = e.print();
            return ExitCode::from(2);
        }
        Err(e) => {
            // One line (JSON under `eval`), exit status 2.
            let rendered = e.render().to_string();
            // The message is every line before the usage: clap puts the
            // names of missing arguments on the lines after the first.
            let line = rendered
                .lines()
                .take_while(|l| !l.trim().is_empty() && !l.starts_with("Usage:"))
                .map(str::trim)
                .collect::<Vec<_>>()
                .join(" ")
                .trim_start_matches("error: ")
                .to_string();
            let line = if line.is_empty() {
                "invalid arguments".to_string()
            } else {
                packshard::reference::error::brief_to(&line, 400)
            };
            if std::env::args().nth(1).as_deref() == Some("eval") {
                let err = packshard::eval::EvalError::new("invalid_argument", line);
                println!("{}", err.to_json());
            } else {
                eprintln!("packshard: {line} (see packshard --help)");
            }
            return ExitCode::from(2);
        }
    };
    // One parser of the memory budget, refused alike by every subcommand
    // (pack, check and bench ignored a bad value that the others refused);
    // `eval` refuses it per case, as a JSON error.
    if !matches!(cli.command, Command::Eval(_)) {
        if let Err(e) = packshard::reference::limits::memory_budget() {
            eprintln!("packshard: {e}");
            out::flush();
            return ExitCode::from(2);
        }
    }
    let result = match cli.command {
        Command::Pack(args) => cli::pack::run(args),
        Command::Eval(args) => cli::eval::run(args),
        Command::Vocab(args) => cli::vocab::run(args),
        Command::Verify(args) => cli::verify::run(args),
        Command::Golden(args) => cli::golden::run(args),
        Command::Check(args) => cli::check::run(args),
        Command::Pipeline(args) => cli::pipeline::run(args),
        Command::Bench(args) => cli::bench::run(args),
    };
    let code = match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("packshard: {e}");
            ExitCode::from(e.code)
        }
    };
    out::flush();
    code
}
