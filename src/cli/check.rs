//! `packshard check DIR RESULTS.safetensors`: a framework's outputs against
//! the golden vectors (see `packshard::golden::check`).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use packshard::golden::check;

use super::CliError;

#[derive(Args)]
pub struct CheckArgs {
    /// A directory written by `packshard golden`.
    dir: PathBuf,
    /// The framework's results: one safetensors file, each output named
    /// `<case>/<output>` as the manifest's `result` fields say.
    results: PathBuf,
    /// Require the outputs of every case (by default, cases with no output
    /// in the results are skipped and listed).
    #[arg(long)]
    all: bool,
}

/// Runs `check`: prints the table; exit status 0 when every output is
/// within its tolerance, 1 when any is not, 2 for bad input (unreadable or
/// modified golden set, missing tensors, wrong shapes, unknown names).
pub fn run(args: CheckArgs) -> Result<ExitCode, CliError> {
    let report = check::check(&args.dir, &args.results, args.all).map_err(CliError::input)?;
    print!("{}", report.table());
    Ok(if report.passed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}
