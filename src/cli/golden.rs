//! `packshard golden`: writes the golden test vectors (see `packshard::golden`).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use packshard::golden;

use super::CliError;

#[derive(Args)]
pub struct GoldenArgs {
    /// The directory to write (created if needed; it must be empty or hold
    /// an earlier golden set).
    #[arg(long)]
    out: PathBuf,
    /// The dtype float inputs are stored in: `f64` (default), `f32` or
    /// `bf16`. Expected outputs are always computed in f64 from the stored
    /// inputs and stored as F64; the manifest gives each output's tolerance
    /// for this dtype.
    #[arg(long, default_value = "f64")]
    dtype: String,
}

/// Runs `golden`: exit status 0, or 2 for bad arguments or an unwritable
/// directory.
pub fn run(args: GoldenArgs) -> Result<ExitCode, CliError> {
    let dtype = golden::parse_dtype(&args.dtype).map_err(CliError::input)?;
    let w = golden::write(&args.out, dtype).map_err(CliError::input)?;
    println!(
        "wrote {} golden cases ({} inputs, {} expected outputs, dtype {}, {:.1} kB) to {}: manifest.json, inputs/<case>.safetensors, expected/<case>.safetensors",
        w.cases,
        w.inputs,
        w.outputs,
        dtype.name(),
        w.bytes as f64 / 1000.0,
        args.out.display()
    );
    Ok(ExitCode::SUCCESS)
}
