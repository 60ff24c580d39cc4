//! `packshard vocab`: the vocabulary-parallel algorithms compared on one
//! output layer (default: the MiniLM vocabulary, 30522 x 384).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use packshard::reference::limits;
use packshard::reference::vocab::{
    LossConfig, Reduction, ShardLayout, ShardedAlgorithm, SmoothingConvention,
};
use packshard::vocab_report::{self, Errors, VocabReportConfig, WORD_EMBEDDINGS};

use super::CliError;

#[derive(Args)]
pub struct VocabArgs {
    /// Vocabulary size `v` of the random weights (default: MiniLM's 30522).
    #[arg(long, default_value_t = vocab_report::MINILM_VOCAB)]
    vocab_size: usize,
    /// Hidden size `h` of the random weights (default: MiniLM's 384).
    #[arg(long, default_value_t = vocab_report::MINILM_HIDDEN)]
    hidden: usize,
    /// Tokens `n` in the batch.
    #[arg(long, default_value_t = 16)]
    tokens: usize,
    /// Shard counts, comma-separated.
    #[arg(long, default_value = "1,2,4,8", value_delimiter = ',')]
    shards: Vec<usize>,
    /// Algorithms, comma-separated (`naive`, `alg1`, `alg2`).
    #[arg(long, default_value = "naive,alg1,alg2", value_delimiter = ',')]
    algorithms: Vec<String>,
    /// `uneven` (default) or `padded` shards when `p` does not divide `v`.
    #[arg(long, default_value = "uneven")]
    layout: String,
    /// Seed of the random weights, hidden states and targets.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Label smoothing `a` in [0, 1].
    #[arg(long, default_value_t = 0.0)]
    label_smoothing: f64,
    /// `pytorch` (default) or `megatron` label-smoothing convention.
    #[arg(long, default_value = "pytorch")]
    smoothing: String,
    /// z-loss coefficient.
    #[arg(long, default_value_t = 0.0)]
    z_loss: f64,
    /// Use a checkpoint's word embeddings as the tied output layer instead of
    /// random weights: a directory with `model.safetensors` (e.g. the fetched
    /// MiniLM) or the file itself.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Print JSON instead of the table.
    #[arg(long)]
    json: bool,
}

/// The most shards `vocab` runs (as `eval`'s `num_shards`).
const MAX_SHARDS: usize = 64;

/// The most tokens `vocab` accepts (the reference is f64 and single-threaded per rank).
const MAX_TOKENS: usize = 4096;

/// Checks the report's f64 buffers against the memory budget before any is
/// allocated: the inputs (`hidden: [n, h]`, `weight: [v, h]`), the
/// unsharded logits and gradients (`[n, v]`, `[n, h]`, `[v, h]`), and per
/// sharded run its ranks' shards and gradients (about the same again).
fn check_report_memory(n: usize, v: usize, h: usize, shards: &[usize]) -> Result<(), CliError> {
    let p = shards.iter().copied().max().unwrap_or(1) as u64;
    let bytes = limits::total(&[
        limits::f64_bytes(&[n, h, 4]),
        limits::f64_bytes(&[v, h, 4]),
        limits::f64_bytes(&[n, v, 3]),
        // per rank: `[n, h]` partials and collective buffers
        limits::f64_bytes(&[n, h, 2]).and_then(|b| b.checked_mul(p)),
    ]);
    limits::check_estimate(
        "--hidden",
        bytes,
        &format!("{n} tokens x vocabulary {v} x hidden {h}"),
    )?;
    Ok(())
}

/// Runs `vocab`.
pub fn run(args: VocabArgs) -> Result<ExitCode, CliError> {
    if args.tokens == 0 || args.tokens > MAX_TOKENS {
        return Err(CliError::input(format!(
            "--tokens: {} is outside 1..={MAX_TOKENS}",
            args.tokens
        )));
    }
    let algorithms = args
        .algorithms
        .iter()
        .map(|a| a.parse::<ShardedAlgorithm>())
        .collect::<Result<Vec<_>, _>>()?;
    let loss = LossConfig {
        label_smoothing: args.label_smoothing,
        smoothing: args.smoothing.parse::<SmoothingConvention>()?,
        z_loss: args.z_loss,
        reduction: Reduction::Mean,
        ..LossConfig::default()
    };
    if let Some(&p) = args.shards.iter().find(|&&p| p == 0 || p > MAX_SHARDS) {
        return Err(CliError::input(format!(
            "--shards: {p} is outside 1..={MAX_SHARDS} (one thread per shard)"
        )));
    }
    if args.model.is_none() {
        for (flag, x) in [("--vocab-size", args.vocab_size), ("--hidden", args.hidden)] {
            if x == 0 {
                return Err(CliError::input(format!("{flag}: must be at least 1")));
            }
        }
    }
    let weight = match &args.model {
        None => None,
        Some(path) => {
            let file = if path.is_dir() {
                path.join("model.safetensors")
            } else {
                path.clone()
            };
            // The file is read whole and its f32 tensor widened to f64.
            let bytes = std::fs::metadata(&file).map_or(0, |m| m.len());
            limits::check_estimate(
                "--model",
                bytes.checked_mul(3),
                &format!("reading {}", file.display()),
            )?;
            Some(vocab_report::load_tensor(&file, WORD_EMBEDDINGS).map_err(CliError::input)?)
        }
    };
    if weight.is_none() {
        packshard::reference::vocab::check_logits_size(
            "--vocab-size",
            args.tokens,
            args.vocab_size,
        )?;
        // The weight `[v, h]` is held to the same entry count as the logits.
        let max = packshard::reference::vocab::MAX_LOGITS;
        if args
            .vocab_size
            .checked_mul(args.hidden)
            .is_none_or(|x| x > max)
        {
            return Err(CliError::input(format!(
                "--hidden: a weight of {} x {} entries is over the {max} one call may hold",
                args.vocab_size, args.hidden
            )));
        }
    }
    let (v, h) = weight
        .as_ref()
        .map_or((args.vocab_size, args.hidden), |w| w.dim());
    check_report_memory(args.tokens, v, h, &args.shards)?;
    let config = VocabReportConfig {
        weight,
        vocab_size: args.vocab_size,
        hidden: args.hidden,
        tokens: args.tokens,
        shards: args.shards,
        algorithms,
        layout: args.layout.parse::<ShardLayout>()?,
        loss,
        seed: args.seed,
    };
    let report = vocab_report::measure(&config)?;
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&report).expect("the report serializes")
        );
    } else {
        print!("{}", vocab_report::table(&report, Errors::Measured));
    }
    Ok(ExitCode::SUCCESS)
}
