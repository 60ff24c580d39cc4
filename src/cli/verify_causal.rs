//! `packshard verify causal-lm`: a seeded Llama-shaped reference decoder on
//! real text, packed against padded (issue #15).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use indicatif::ProgressBar;
use packshard::equivalence::causal::{reference_causal_lm, CausalForm};
use packshard::reference::decoder::{DecoderConfig, DecoderModel};
use packshard::text;
use packshard::verify::causal::{
    check_causal_budget, verify_causal, CausalVerifyOptions, TOLERANCE,
};

use super::verify_sample::{print_run, print_table, spinner, SampleArgs};
use super::CliError;

#[derive(Args)]
pub struct CausalLmArgs {
    /// The tokenizer: a tokenizer.json, or a model directory holding one.
    #[arg(long)]
    tokenizer: PathBuf,
    #[command(flatten)]
    sample: SampleArgs,
    /// How the packed rows attend: varlen (flash-attention's varlen over
    /// cu_seqlens, padding removed) or block-causal (a document mask per row).
    #[arg(long, default_value = "varlen")]
    packed_attention: String,
    /// Decoder layers.
    #[arg(long, default_value_t = 2)]
    layers: usize,
    /// Query heads.
    #[arg(long, default_value_t = 4)]
    heads: usize,
    /// Key/value heads (grouped-query attention: must divide --heads).
    #[arg(long, default_value_t = 2)]
    kv_heads: usize,
    /// Head dim (even; hidden = heads x head dim).
    #[arg(long, default_value_t = 8)]
    head_dim: usize,
    /// The SwiGLU MLP's inner width.
    #[arg(long, default_value_t = 64)]
    intermediate: usize,
    /// Seed of the weights.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

pub fn run(a: CausalLmArgs) -> Result<ExitCode, CliError> {
    let form = match a.packed_attention.as_str() {
        "varlen" => CausalForm::Varlen,
        "block-causal" => CausalForm::BlockCausal,
        other => {
            return Err(CliError::input(format!(
                "--packed-attention {other:?}: expected varlen or block-causal"
            )))
        }
    };
    let opts = CausalVerifyOptions {
        max_seq_len: a.sample.max_seq_len,
        algorithm: a.sample.algorithm()?,
        max_sequences_per_pack: a.sample.max_sequences_per_pack,
    };
    let bar = spinner();
    let result = run_with(a, form, opts, &bar);
    bar.finish_and_clear();
    result
}

fn run_with(
    a: CausalLmArgs,
    form: CausalForm,
    opts: CausalVerifyOptions,
    bar: &ProgressBar,
) -> Result<ExitCode, CliError> {
    bar.set_message("tokenizing");
    let tok_path = if a.tokenizer.is_dir() {
        a.tokenizer.join("tokenizer.json")
    } else {
        a.tokenizer.clone()
    };
    let tok = text::load_tokenizer(&tok_path).map_err(CliError::input)?;
    let docs = a.sample.read(&tok)?;
    let config = DecoderConfig::tiny(
        tok.get_vocab_size(true),
        a.heads,
        a.kv_heads,
        a.head_dim,
        a.intermediate,
        a.layers,
    );
    // The parameters and both runs against the budget before any is built.
    check_causal_budget(&config, &docs.tokenized, &opts)?;
    bar.set_message("initialising the model");
    let model = DecoderModel::random(config, a.seed)?;
    let progress = |m: &str| bar.set_message(m.to_string());
    let report = verify_causal(
        &model,
        &docs.tokenized,
        &opts,
        &reference_causal_lm(CausalForm::BlockCausal),
        &reference_causal_lm(form),
        &progress,
    )?;
    bar.finish_and_clear();

    let c = &model.config;
    println!(
        "model: seeded reference decoder (seed {}), Llama shape: {} layers, hidden {}, {} heads / {} key-value heads of {}, SwiGLU {}, RMSNorm, RoPE theta {}, untied head, vocab {} ({})",
        a.seed,
        c.num_layers,
        c.hidden_size,
        c.num_heads,
        c.num_kv_heads,
        c.head_dim,
        c.intermediate_size,
        c.rope_theta,
        c.vocab_size,
        tok_path.display()
    );
    print_run(
        &a.sample.text,
        &docs,
        opts.max_seq_len,
        ("documents", " (next token within each document)"),
        &report.run,
    );
    println!(
        "padded: dense causal mask per row; packed: {}",
        match form {
            CausalForm::Varlen => "varlen (padding removed, cu_seqlens per document)",
            CausalForm::BlockCausal => "block-causal document mask per row",
        }
    );
    let losses: Vec<String> = report
        .losses
        .iter()
        .map(|(r, l)| format!("{l:.6} {}", r.name()))
        .collect();
    println!("losses (padded): {}", losses.join(", "));
    Ok(print_table(&report.diffs, &report.verdict, TOLERANCE))
}
