//! `packshard eval`: JSON cases in, JSON results out.

use std::io::Read;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use packshard::eval::{evaluate_str, list, max_case_bytes, EvalError};

use super::CliError;

#[derive(Args)]
pub struct EvalArgs {
    /// A case file (JSON), or `-` for standard input.
    #[arg(
        required_unless_present = "list",
        value_name = "CASE",
        help = "A case file (JSON), or `-` for standard input"
    )]
    case: Option<PathBuf>,
    /// The input holds one case per line; print one result per line.
    #[arg(long)]
    jsonl: bool,
    /// Print the available ops and impls.
    #[arg(long)]
    list: bool,
}

/// The input's bytes, refusing more than `cap` before reading them all.
fn read_input(path: &std::path::Path, cap: u64) -> Result<Vec<u8>, EvalError> {
    let name = path.display();
    let io = |e: std::io::Error| EvalError::new("invalid_argument", format!("case: {name}: {e}"));
    let mut bytes = Vec::new();
    if path.as_os_str() == "-" {
        std::io::stdin()
            .lock()
            .take(cap + 1)
            .read_to_end(&mut bytes)
            .map_err(io)?;
    } else {
        std::fs::File::open(path)
            .and_then(|f| f.take(cap + 1).read_to_end(&mut bytes))
            .map_err(io)?;
    }
    if bytes.len() as u64 > cap {
        return Err(EvalError::invalid(
            "case",
            format!(
                "{name}: over the {cap} bytes eval reads (the memory budget / {}; set {} to change it)",
                packshard::eval::INPUT_EXPANSION,
                packshard::reference::limits::MEMORY_BUDGET_ENV
            ),
        ));
    }
    Ok(bytes)
}

/// One case's text as UTF-8 (`line`: its 1-based line under `--jsonl`).
fn utf8(bytes: &[u8], line: Option<usize>) -> Result<&str, EvalError> {
    std::str::from_utf8(bytes).map_err(|e| {
        let at = match line {
            Some(l) => format!("line {l}: "),
            None => String::new(),
        };
        EvalError::new(
            "invalid_json",
            format!(
                "{at}not UTF-8: invalid byte at offset {} (JSON text is UTF-8)",
                e.valid_up_to()
            ),
        )
    })
}

/// Evaluates line `number` (1-based) of a `--jsonl` input: a blank line is
/// an `invalid_json` error (so output line i always answers input line i),
/// and every error names the line.
fn evaluate_line(bytes: &[u8], number: usize) -> Result<serde_json::Value, EvalError> {
    let text = utf8(bytes, Some(number))?;
    if text.trim().is_empty() {
        return Err(EvalError::new(
            "invalid_json",
            format!("line {number}: blank line, expected a case (one JSON object per line)"),
        ));
    }
    // Each line is parsed alone, so serde's "line 1" is the file's line `number`.
    evaluate_str(text).map_err(|mut e| {
        e.message = format!(
            "line {number}: {}",
            e.message.replace(" at line 1 column ", " at column ")
        );
        e
    })
}

fn print_json(v: &serde_json::Value) {
    println!(
        "{}",
        serde_json::to_string(v).expect("json values serialize")
    );
}

/// Runs `eval`. Exit status 0 when every case succeeded, 2 when any failed
/// (each failure printed as `{"error": {...}}` on standard output).
pub fn run(args: EvalArgs) -> Result<ExitCode, CliError> {
    if args.list {
        print_json(&list());
        return Ok(ExitCode::SUCCESS);
    }
    let path = args.case.expect("clap requires case unless --list");
    let bytes = match max_case_bytes().and_then(|cap| {
        // `--jsonl` holds one line's expansion at a time, plus the text.
        read_input(
            &path,
            if args.jsonl {
                cap.saturating_mul(4)
            } else {
                cap
            },
        )
    }) {
        Ok(t) => t,
        Err(e) => {
            print_json(&e.to_json());
            return Ok(ExitCode::from(2));
        }
    };
    let mut failed = false;
    let mut answer = |r: Result<serde_json::Value, EvalError>| match r {
        Ok(v) => print_json(&v),
        Err(e) => {
            failed = true;
            print_json(&e.to_json());
        }
    };
    if args.jsonl {
        // One answer per line: a final newline ends the last line, it does
        // not start an empty one.
        let body = bytes.strip_suffix(b"\n").unwrap_or(&bytes);
        if !bytes.is_empty() {
            for (i, line) in body.split(|&b| b == b'\n').enumerate() {
                let line = line.strip_suffix(b"\r").unwrap_or(line);
                answer(evaluate_line(line, i + 1));
            }
        }
    } else {
        answer(utf8(&bytes, None).and_then(evaluate_str));
    }
    Ok(if failed {
        ExitCode::from(2)
    } else {
        ExitCode::SUCCESS
    })
}
