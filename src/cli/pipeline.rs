//! `packshard pipeline --ranks P`: launches the MPI pipeline
//! (`packshard-pipeline`, crate `pipeline/`) under `mpirun -n P` — first the
//! equivalence check with the single-process reference (the tests' small
//! model, every placement and algorithm asked for), then the balance report
//! at the MiniLM shape (vocab 30522, hidden 384, 6 layers).
//!
//! This crate does not link MPI (a plain `cargo build` needs none); it runs
//! the pipeline binary as a child of `mpirun`. The binary is `--bin`, else
//! `$PACKSHARD_PIPELINE_BIN`, else `packshard-pipeline` next to this
//! executable; when that is missing and this executable lives in a cargo
//! target folder of the workspace (`target/<profile>/`), it is built there
//! first with `cargo build -p packshard-pipeline` in the same profile (that
//! needs OpenMPI and libclang: `apt-get install -y libopenmpi-dev
//! openmpi-bin libclang-dev`, as `scripts/test.sh` does).
//!
//! With Open MPI's `mpirun`, running as root is allowed
//! (`OMPI_ALLOW_RUN_AS_ROOT=1`, `OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1`) and
//! `--oversubscribe` is passed (Open MPI counts physical cores as slots: a
//! 2-core machine refuses `-n 4` without it).
//!
//! Exit status: 0 when every step passed, 1 when the pipeline does not equal
//! the reference, 2 for bad arguments or a missing `mpirun` or binary; a job
//! that failed otherwise passes on `mpirun`'s status.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use clap::{Args, ValueEnum};

use super::CliError;

/// Where the vocabulary layers go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PlacementArg {
    /// Input embedding on the first stage, output layer on the last.
    Baseline,
    /// Both split by vocabulary over all ranks.
    VocabParallel,
    /// Both, one after the other.
    All,
}

/// The vocabulary-parallel algorithm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum AlgorithmArg {
    /// Yeung et al. Algorithm 1 (2 barriers per microbatch).
    Alg1,
    /// Algorithm 2 (1 barrier; the T pass moves later in the schedule).
    Alg2,
    /// Both.
    All,
}

#[derive(Args)]
pub struct PipelineArgs {
    /// MPI ranks = pipeline stages (1..=64).
    #[arg(long)]
    ranks: usize,
    /// Vocabulary placement.
    #[arg(long, value_enum, default_value = "all")]
    placement: PlacementArg,
    /// Vocabulary-parallel algorithm.
    #[arg(long, value_enum, default_value = "all")]
    algorithm: AlgorithmArg,
    /// Microbatches per iteration (default: 5 for the check, 8 for the report).
    #[arg(long)]
    microbatches: Option<usize>,
    /// Only the equivalence check.
    #[arg(long, conflicts_with = "report_only")]
    check_only: bool,
    /// Only the balance report.
    #[arg(long)]
    report_only: bool,
    /// Also draw the balance report as an SVG picture to this file (memory
    /// and compute / communication / idle time per rank).
    #[arg(long, conflicts_with = "check_only")]
    plot: Option<PathBuf>,
    /// Iterations of the report per placement (the fastest is shown).
    #[arg(long, default_value_t = 2)]
    iterations: usize,
    /// The `packshard-pipeline` binary (default: $PACKSHARD_PIPELINE_BIN, else
    /// next to this executable, built there when missing).
    #[arg(long)]
    bin: Option<PathBuf>,
    /// The MPI launcher.
    #[arg(long, default_value = "mpirun")]
    mpirun: String,
    /// More arguments for packshard-pipeline (after `--`), passed to both steps.
    #[arg(last = true)]
    extra: Vec<String>,
}

/// The most ranks `pipeline` launches.
const MAX_RANKS: usize = 64;

/// How to install what the pipeline needs (Debian/Ubuntu).
const INSTALL_HINT: &str =
    "install OpenMPI and libclang (`apt-get install -y libopenmpi-dev openmpi-bin libclang-dev`, as scripts/test.sh does)";

/// Why `packshard pipeline` could not run, or what the job said.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// `--ranks` outside `1..=MAX_RANKS`.
    #[error("--ranks: {ranks} is outside 1..={max}")]
    Ranks { ranks: usize, max: usize },
    /// `--iterations 0`.
    #[error("--iterations: must be at least 1")]
    Iterations,
    /// `--microbatches 0`.
    #[error("--microbatches: must be at least 1")]
    Microbatches,
    /// The MPI launcher could not be started.
    #[error("--mpirun: cannot run `{mpirun}` ({source}): {INSTALL_HINT}")]
    Mpirun {
        mpirun: String,
        source: std::io::Error,
    },
    /// The pipeline binary is not where it was looked for.
    #[error("{origin}: the pipeline binary is not at {}: build it with `cargo build --release -p packshard-pipeline` (needs MPI: {INSTALL_HINT}), or pass --bin", path.display())]
    Binary { origin: &'static str, path: PathBuf },
    /// Building the pipeline binary failed.
    #[error(
        "`{command}` failed ({status}): the pipeline crate needs MPI at build time: {INSTALL_HINT}"
    )]
    Build { command: String, status: String },
    /// The check found a difference from the reference.
    #[error("the pipeline does not equal the single-process reference (see the check above)")]
    NotEqual,
    /// The job failed otherwise (a rank's message is above).
    #[error(
        "`{mpirun} -n {ranks} ... {step}` failed ({status}); the failing rank's message is above"
    )]
    Job {
        mpirun: String,
        ranks: usize,
        step: String,
        status: String,
        code: u8,
    },
}

impl LaunchError {
    /// The exit status: 1 for a failed check, the job's own status for a
    /// failed job, 2 otherwise.
    pub fn code(&self) -> u8 {
        match self {
            LaunchError::NotEqual => 1,
            LaunchError::Job { code, .. } => *code,
            _ => 2,
        }
    }
}

impl From<LaunchError> for CliError {
    fn from(e: LaunchError) -> Self {
        CliError {
            code: e.code(),
            message: e.to_string(),
        }
    }
}

/// The pipeline binary: `bin`, else `$PACKSHARD_PIPELINE_BIN`, else next to
/// this executable (built there when this executable is in a workspace's
/// `target/<profile>/`).
fn locate(bin: Option<PathBuf>) -> Result<PathBuf, LaunchError> {
    if let Some(path) = bin {
        return exists(path, "--bin");
    }
    if let Some(path) = std::env::var_os("PACKSHARD_PIPELINE_BIN") {
        return exists(PathBuf::from(path), "PACKSHARD_PIPELINE_BIN");
    }
    let origin = "next to this executable";
    let exe = std::env::current_exe().map_err(|_| LaunchError::Binary {
        origin,
        path: PathBuf::from("packshard-pipeline"),
    })?;
    let path = exe.with_file_name(format!(
        "packshard-pipeline{}",
        std::env::consts::EXE_SUFFIX
    ));
    if path.is_file() {
        return Ok(path);
    }
    if let Some((root, profile)) = workspace_of(&exe) {
        build(&root, &profile)?;
    }
    exists(path, origin)
}

fn exists(path: PathBuf, origin: &'static str) -> Result<PathBuf, LaunchError> {
    if path.is_file() {
        Ok(path)
    } else {
        Err(LaunchError::Binary { origin, path })
    }
}

/// `(workspace root, cargo profile)` when `exe` is `<root>/target/<dir>/exe`
/// and `<root>/pipeline/Cargo.toml` exists (`debug` is the `dev` profile).
fn workspace_of(exe: &Path) -> Option<(PathBuf, String)> {
    let dir = exe.parent()?;
    let target = dir.parent()?;
    if target.file_name()? != "target" {
        return None;
    }
    let root = target.parent()?;
    if !root.join("pipeline/Cargo.toml").is_file() {
        return None;
    }
    let profile = match dir.file_name()?.to_str()? {
        "debug" => "dev".to_string(),
        other => other.to_string(),
    };
    Some((root.to_path_buf(), profile))
}

/// `cargo build --profile <profile> -p packshard-pipeline` in `root`.
fn build(root: &Path, profile: &str) -> Result<(), LaunchError> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let manifest = root.join("Cargo.toml");
    let command = format!(
        "{cargo} build --profile {profile} -p packshard-pipeline --manifest-path {}",
        manifest.display()
    );
    eprintln!("packshard: building the pipeline binary: {command}");
    let status = Command::new(&cargo)
        .args(["build", "--profile", profile, "-p", "packshard-pipeline"])
        .arg("--manifest-path")
        .arg(&manifest)
        .status()
        .map_err(|e| LaunchError::Build {
            command: command.clone(),
            status: e.to_string(),
        })?;
    if status.success() {
        Ok(())
    } else {
        Err(LaunchError::Build {
            command,
            status: status.to_string(),
        })
    }
}

/// Whether `mpirun` is Open MPI's (then it needs the root and
/// oversubscription settings). Errors when it cannot be started.
fn open_mpi(mpirun: &str) -> Result<bool, LaunchError> {
    let out = Command::new(mpirun)
        .arg("--version")
        .output()
        .map_err(|source| LaunchError::Mpirun {
            mpirun: mpirun.to_string(),
            source,
        })?;
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    Ok(text.contains("Open MPI") || text.contains("OpenRTE"))
}

/// Runs `pipeline`: checks the arguments, finds `mpirun` (first, so that a
/// machine without MPI hears about MPI) and the binary, then runs the check
/// and the report, each as one `mpirun -n ranks` job whose output passes
/// straight through.
pub fn run(args: PipelineArgs) -> Result<ExitCode, CliError> {
    launch(args).map_err(CliError::from)
}

fn launch(args: PipelineArgs) -> Result<ExitCode, LaunchError> {
    if args.ranks == 0 || args.ranks > MAX_RANKS {
        return Err(LaunchError::Ranks {
            ranks: args.ranks,
            max: MAX_RANKS,
        });
    }
    if args.iterations == 0 {
        return Err(LaunchError::Iterations);
    }
    if args.microbatches == Some(0) {
        return Err(LaunchError::Microbatches);
    }
    let open = open_mpi(&args.mpirun)?;
    let bin = locate(args.bin.clone())?;
    let placement = match args.placement {
        PlacementArg::Baseline => "baseline",
        PlacementArg::VocabParallel => "vocab-parallel",
        PlacementArg::All => "all",
    };
    let algorithm = match args.algorithm {
        AlgorithmArg::Alg1 => "alg1",
        AlgorithmArg::Alg2 => "alg2",
        AlgorithmArg::All => "all",
    };
    let mut steps: Vec<Vec<String>> = Vec::new();
    if !args.report_only {
        steps.push(vec!["--check".into(), "--model".into(), "tiny".into()]);
    }
    if !args.check_only {
        steps.push(vec![
            "--report".into(),
            "--model".into(),
            "minilm".into(),
            "--iterations".into(),
            args.iterations.to_string(),
        ]);
        if let Some(plot) = &args.plot {
            let step = steps.last_mut().expect("the report step was just pushed");
            step.push("--plot".into());
            step.push(plot.display().to_string());
        }
    }
    for step in steps {
        let mut cmd = Command::new(&args.mpirun);
        cmd.arg("-n").arg(args.ranks.to_string());
        if open {
            cmd.env("OMPI_ALLOW_RUN_AS_ROOT", "1")
                .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
                .arg("--oversubscribe");
        }
        cmd.arg(&bin)
            .args(&step)
            .args(["--placement", placement, "--algorithm", algorithm]);
        if let Some(m) = args.microbatches {
            cmd.arg("--microbatches").arg(m.to_string());
        }
        cmd.args(&args.extra);
        let status = cmd.status().map_err(|source| LaunchError::Mpirun {
            mpirun: args.mpirun.clone(),
            source,
        })?;
        match status.code() {
            Some(0) => {}
            Some(1) if step[0] == "--check" => return Err(LaunchError::NotEqual),
            other => {
                return Err(LaunchError::Job {
                    mpirun: args.mpirun.clone(),
                    ranks: args.ranks,
                    step: step[0].clone(),
                    status: status.to_string(),
                    // A signal, or a status that does not fit: 1.
                    code: other.map_or(1, |c| u8::try_from(c).unwrap_or(1).max(1)),
                });
            }
        }
        println!();
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_workspace_and_profile_come_from_the_target_folder() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let exe = root.join("target/debug/packshard");
        assert_eq!(
            workspace_of(&exe),
            Some((root.to_path_buf(), "dev".to_string()))
        );
        let exe = root.join("target/release/packshard");
        assert_eq!(workspace_of(&exe).map(|w| w.1), Some("release".into()));
        // Not a target folder, or no pipeline crate: no build.
        assert_eq!(workspace_of(Path::new("/usr/bin/packshard")), None);
        assert_eq!(
            workspace_of(Path::new("/nonexistent/target/debug/packshard")),
            None
        );
    }

    #[test]
    fn errors_name_the_argument_and_their_status() {
        let e = LaunchError::Ranks { ranks: 0, max: 64 };
        assert_eq!(
            (e.to_string().as_str(), e.code()),
            ("--ranks: 0 is outside 1..=64", 2)
        );
        assert_eq!(LaunchError::NotEqual.code(), 1);
        let e = LaunchError::Mpirun {
            mpirun: "mpirun".into(),
            source: std::io::Error::from(std::io::ErrorKind::NotFound),
        };
        assert!(e.to_string().starts_with("--mpirun: cannot run `mpirun`"));
        assert!(!e.to_string().contains('\n'));
        assert_eq!(e.code(), 2);
    }
}
