//! `packshard verify bert`: packed == padded on a real model and real text.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Subcommand};
use indicatif::ProgressBar;
use packshard::reference::bert::{BertModel, Reduction};
use packshard::text;
use packshard::verify::{mask_sample, verify, VerifyOptions, TOLERANCE};

use super::verify_sample::{print_run, print_table, spinner, SampleArgs};
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
