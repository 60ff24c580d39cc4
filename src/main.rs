//! The `packshard` command line. See `packshard --help` and the README.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod cli;

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
            let line = rendered
                .lines()
                .next()
                .unwrap_or("invalid arguments")
                .trim_start_matches("error: ")
                .to_string();
            if std::env::args().nth(1).as_deref() == Some("eval") {
                let err = packshard::eval::EvalError::new("invalid_argument", line);
                println!("{}", err.to_json());
            } else {
                eprintln!("packshard: {line} (see packshard --help)");
            }
            return ExitCode::from(2);
        }
    };
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
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("packshard: {e}");
            ExitCode::from(e.code)
        }
    }
}
