//! The text sample every `packshard verify` reads, and how a run is printed:
//! `--text` and its packing (`SampleArgs`), the progress spinner, the run's
//! figures and the packed-vs-padded table (shared by `verify bert` and
//! `verify causal-lm`).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use packshard::equivalence::attention::Observed;
use packshard::equivalence::{Mismatch, Tolerance};
use packshard::reference::packing::{Algorithm, Histogram};
use packshard::report::format_seconds;
use packshard::text;
use packshard::verify::{Diff, RunFigures};

use super::CliError;

/// The text, how many lines, and how they are packed: common to every `verify`.
#[derive(Args)]
pub(super) struct SampleArgs {
    /// A text file, or a directory of *.txt files (lines taken round-robin);
    /// each line is one sequence (document).
    #[arg(long)]
    pub text: PathBuf,
    /// Lines to read (non-blank); lines over --max-seq-len tokens are skipped.
    #[arg(long, default_value_t = 48)]
    pub max_lines: usize,
    /// Pack length and padded row length, in tokens.
    #[arg(long, default_value_t = 32)]
    pub max_seq_len: usize,
    /// Packing algorithm: spfhp, lpfhp, nnlshp, ffd, bfd.
    #[arg(long, default_value = "spfhp")]
    pub algorithm: String,
    /// At most this many sequences per pack.
    #[arg(long)]
    pub max_sequences_per_pack: Option<usize>,
}

impl SampleArgs {
    /// Checks `--max-lines` (in `1..=text::MAX_LINES`) and parses `--algorithm`.
    pub fn algorithm(&self) -> Result<Algorithm, CliError> {
        if self.max_lines == 0 || self.max_lines > text::MAX_LINES {
            return Err(CliError::input(format!(
                "--max-lines must be in 1..={}",
                text::MAX_LINES
            )));
        }
        Ok(self.algorithm.parse::<Algorithm>()?)
    }

    /// The lines of `--text` tokenized by `tok`, those over `--max-seq-len` skipped.
    pub fn read(&self, tok: &text::Tokenizer) -> Result<Documents, CliError> {
        read_documents(tok, &self.text, self.max_lines, self.max_seq_len)
    }
}

/// A spinner that shows what runs and for how long.
pub(super) fn spinner() -> ProgressBar {
    let bar = ProgressBar::new_spinner();
    bar.set_style(
        ProgressStyle::with_template("{spinner} {msg} {elapsed}").expect("valid template"),
    );
    bar.enable_steady_tick(std::time::Duration::from_millis(120));
    bar
}

/// Lines of text tokenized, those over the length limit skipped.
pub(super) struct Documents {
    /// Lines read.
    pub lines: usize,
    /// Token ids of the lines kept, in order.
    pub tokenized: Vec<Vec<i64>>,
    /// Lines over the limit.
    pub skipped: usize,
}

/// Up to `max_lines` lines of `path` tokenized by `tok` (special tokens
/// included); lines over `max_seq_len` tokens are skipped.
fn read_documents(
    tok: &text::Tokenizer,
    path: &Path,
    max_lines: usize,
    max_seq_len: usize,
) -> Result<Documents, CliError> {
    let lines = text::read_lines(path, max_lines).map_err(CliError::input)?;
    let mut tokenized = Vec::with_capacity(lines.len());
    let mut skipped = 0usize;
    for line in &lines {
        let ids = text::encode(tok, line).map_err(CliError::input)?;
        if ids.len() > max_seq_len {
            skipped += 1;
        } else {
            tokenized.push(ids);
        }
    }
    if tokenized.is_empty() {
        return Err(CliError::input(format!(
            "no line of {} fits in --max-seq-len {max_seq_len}",
            path.display()
        )));
    }
    Ok(Documents {
        lines: lines.len(),
        tokenized,
        skipped,
    })
}

/// The sample (`noun`s run, tokens, predicted tokens and what they
/// predict), its length histogram, the packing and the time of each layout.
pub(super) fn print_run(
    path: &Path,
    docs: &Documents,
    max_seq_len: usize,
    (noun, predicted): (&str, &str),
    run: &RunFigures,
) {
    println!(
        "text {}: {} lines read, {} over {max_seq_len} tokens skipped; {} {noun}, {} tokens, {} predicted{predicted}",
        path.display(),
        docs.lines,
        docs.skipped,
        run.sequences,
        run.real_tokens,
        run.predicted_tokens
    );
    let lengths: Vec<usize> = docs.tokenized.iter().map(Vec::len).collect();
    println!("length histogram (tokens: sequences):");
    print!("{}", histogram_lines(&lengths, max_seq_len));
    let m = &run.metrics;
    println!(
        "packing {} ({}): {} packs of {}, efficiency {:.2}% (padded {:.2}%), speed-up {:.3}x in tokens ({} padded slots -> {} packed)",
        m.algorithm,
        m.setting,
        m.num_packs,
        max_seq_len,
        100.0 * m.efficiency,
        100.0 * run.real_tokens as f64 / run.padded_slots as f64,
        run.padded_slots as f64 / run.packed_slots as f64,
        run.padded_slots,
        run.packed_slots
    );
    println!(
        "forward + backward: padded {}, packed {}",
        format_seconds(run.padded_seconds),
        format_seconds(run.packed_seconds)
    );
}

/// The packed-vs-padded table and the verdict line; exit 0 on PASS, 1 on FAIL.
pub(super) fn print_table(
    diffs: &[Diff],
    verdict: &Result<Observed, Mismatch>,
    tolerance: Tolerance,
) -> ExitCode {
    println!("packed vs padded:");
    println!(
        "  {:<34} {:>10} {:>12} {:>12}",
        "", "values", "max abs", "max rel"
    );
    for d in diffs {
        println!(
            "  {:<34} {:>10} {:>12.3e} {:>12.3e}",
            d.name, d.values, d.max_abs, d.max_rel
        );
    }
    println!("  (max rel = max abs / the largest magnitude of the padded values)");
    match verdict {
        Ok(_) => {
            println!(
                "PASS: packed == padded within {} (rel {:.1e})",
                tolerance.name, tolerance.rel
            );
            ExitCode::SUCCESS
        }
        Err(mismatch) => {
            println!("FAIL: {}", mismatch.to_string().replace('\n', " "));
            ExitCode::from(1)
        }
    }
}

/// Up to 8 buckets of the length range, `lo-hi: count` with a bar.
fn histogram_lines(lengths: &[usize], max_len: usize) -> String {
    let h = Histogram::from_lengths(lengths).unwrap_or_else(|_| Histogram::from_counts(vec![0]));
    let width = (max_len + 1).div_ceil(8).max(1);
    let mut out = String::new();
    let counts = h.counts();
    let most = (0..8)
        .map(|b| {
            (b * width..((b + 1) * width).min(max_len + 1))
                .map(|l| counts.get(l).copied().unwrap_or(0))
                .sum::<u64>()
        })
        .max()
        .unwrap_or(1)
        .max(1);
    for b in 0..8 {
        let (lo, hi) = (b * width, ((b + 1) * width).min(max_len + 1));
        if lo > max_len {
            break;
        }
        let n: u64 = (lo..hi).map(|l| counts.get(l).copied().unwrap_or(0)).sum();
        out.push_str(&format!(
            "  {:>4}-{:<4} {:>6} {}\n",
            lo,
            hi - 1,
            n,
            "#".repeat((40 * n).div_ceil(most) as usize)
        ));
    }
    out
}
