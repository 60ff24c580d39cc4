//! `packshard eval`: JSON cases in, JSON results out.

use std::io::{BufRead, Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use packshard::eval::{evaluate_str, list, EvalError};

use super::CliError;

#[derive(Args)]
pub struct EvalArgs {
    /// A case file (JSON), or `-` for standard input.
    #[arg(required_unless_present = "list")]
    case: Option<PathBuf>,
    /// The input holds one case per line; print one result per line.
    #[arg(long)]
    jsonl: bool,
    /// Print the available ops and impls.
    #[arg(long)]
    list: bool,
}

fn read_input(path: &std::path::Path) -> Result<String, EvalError> {
    let mut text = String::new();
    let res = if path.as_os_str() == "-" {
        std::io::stdin().read_to_string(&mut text).map(|_| ())
    } else {
        std::fs::File::open(path)
            .and_then(|mut f| f.read_to_string(&mut text))
            .map(|_| ())
    };
    res.map_err(|e| EvalError::new("invalid_argument", format!("case: {}: {e}", path.display())))?;
    Ok(text)
}

/// Runs `eval`. Exit status 0 when every case succeeded, 2 when any failed
/// (each failure printed as `{"error": {...}}` on standard output).
pub fn run(args: EvalArgs) -> Result<ExitCode, CliError> {
    let mut out = std::io::stdout().lock();
    let print = |out: &mut std::io::StdoutLock, v: &serde_json::Value| {
        let _ = writeln!(
            out,
            "{}",
            serde_json::to_string(v).expect("json values serialize")
        );
    };
    if args.list {
        print(&mut out, &list());
        return Ok(ExitCode::SUCCESS);
    }
    let path = args.case.expect("clap requires case unless --list");
    let text = match read_input(&path) {
        Ok(t) => t,
        Err(e) => {
            print(&mut out, &e.to_json());
            return Ok(ExitCode::from(2));
        }
    };
    let mut failed = false;
    if args.jsonl {
        for line in text.as_bytes().lines() {
            let line = line.unwrap_or_default();
            if line.trim().is_empty() {
                continue;
            }
            match evaluate_str(&line) {
                Ok(v) => print(&mut out, &v),
                Err(e) => {
                    failed = true;
                    print(&mut out, &e.to_json());
                }
            }
        }
    } else {
        match evaluate_str(&text) {
            Ok(v) => print(&mut out, &v),
            Err(e) => {
                failed = true;
                print(&mut out, &e.to_json());
            }
        }
    }
    Ok(if failed {
        ExitCode::from(2)
    } else {
        ExitCode::SUCCESS
    })
}
