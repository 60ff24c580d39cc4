//! `packshard verify bert`: packed == padded on a real model and real text.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Args, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use packshard::equivalence::attention::Observed;
use packshard::equivalence::{Mismatch, Tolerance};
use packshard::reference::bert::{BertModel, Reduction};
use packshard::reference::packing::{Algorithm, Histogram};
use packshard::report::format_seconds;
use packshard::text;
use packshard::verify::{mask_sample, verify, Diff, RunFigures, VerifyOptions, TOLERANCE};

use super::CliError;

#[derive(Args)]
pub struct VerifyArgs {
    #[command(subcommand)]
    what: VerifyWhat,
}

#[derive(Subcommand)]
enum VerifyWhat {
    /// The reference BERT on a real checkpoint and real text: packed against padded.
    Bert(BertArgs),
    /// A seeded Llama-shaped reference decoder on real text: packed against padded.
    CausalLm(super::verify_causal::CausalLmArgs),
}

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

#[derive(Args)]
pub struct BertArgs {
    /// Model directory: config.json, model.safetensors, tokenizer.json.
    #[arg(long)]
    model: PathBuf,
    #[command(flatten)]
    sample: SampleArgs,
    /// MLM reduction for the gradients: per-sequence (the packing paper's) or per-token.
    #[arg(long, default_value = "per-sequence")]
    reduction: String,
    /// Fraction of tokens masked and predicted.
    #[arg(long, default_value_t = 0.15)]
    mask_prob: f64,
    /// Seed of the masking and NSP labels.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

pub fn run(args: VerifyArgs) -> Result<ExitCode, CliError> {
    match args.what {
        VerifyWhat::Bert(a) => bert(a),
        VerifyWhat::CausalLm(a) => super::verify_causal::run(a),
    }
}

fn bert(a: BertArgs) -> Result<ExitCode, CliError> {
    if !(0.0..=1.0).contains(&a.mask_prob) {
        return Err(CliError::input(format!(
            "--mask-prob {} is not in [0, 1]",
            a.mask_prob
        )));
    }
    let opts = VerifyOptions {
        max_seq_len: a.sample.max_seq_len,
        algorithm: a.sample.algorithm()?,
        max_sequences_per_pack: a.sample.max_sequences_per_pack,
        reduction: a.reduction.parse::<Reduction>()?,
        mask_prob: a.mask_prob,
        seed: a.seed,
    };
    let bar = spinner();
    let result = bert_with(a, opts, &bar);
    bar.finish_and_clear();
    result
}

fn bert_with(a: BertArgs, opts: VerifyOptions, bar: &ProgressBar) -> Result<ExitCode, CliError> {
    bar.set_message("loading the model");
    let (model, initialised) = BertModel::load(&a.model)?;
    if opts.max_seq_len == 0 || opts.max_seq_len > model.config.max_position_embeddings {
        return Err(CliError::input(format!(
            "--max-seq-len {} must be in 1..={} (the model's positions)",
            opts.max_seq_len, model.config.max_position_embeddings
        )));
    }
    bar.set_message("tokenizing");
    let tok = text::load_tokenizer(&a.model.join("tokenizer.json")).map_err(CliError::input)?;
    let mask_id = tok.token_to_id("[MASK]").map_or(103, i64::from);
    let docs = a.sample.read(&tok)?;
    let sample = mask_sample(&docs.tokenized, mask_id, &opts);
    let progress = |m: &str| bar.set_message(m.to_string());
    let report = verify(&model, &sample, &opts, &progress)?;
    bar.finish_and_clear();

    let c = &model.config;
    println!(
        "model {}: BERT, {} layers, hidden {}, {} heads, vocab {}; heads initialised (seeded, not in the checkpoint): {}",
        a.model.display(),
        c.num_hidden_layers,
        c.hidden_size,
        c.num_attention_heads,
        c.vocab_size,
        if initialised.is_empty() { "none".to_string() } else { format!("{} tensors (cls.*)", initialised.len()) }
    );
    print_run(
        &a.sample.text,
        &docs,
        opts.max_seq_len,
        ("sequences", ""),
        &report.run,
    );
    println!(
        "losses (padded): MLM {:.6} per-token, {:.6} per-sequence; NSP {:.6}; gradients under {}",
        report.mlm_loss[0].1,
        report.mlm_loss[1].1,
        report.nsp_loss,
        opts.reduction.name()
    );
    Ok(print_table(&report.diffs, &report.verdict, TOLERANCE))
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
