//! `packshard pack`: pack real or given lengths and compare the algorithms.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use packshard::reference::packing::{
    pack_histogram, pack_lengths, Algorithm, Histogram, Overlong, PackingConfig, EMBEDDED,
    EMBEDDED_SOURCE,
};
use packshard::report;
use serde_json::json;

use super::{read_file, write_file, CliError};

#[derive(Args)]
pub struct PackArgs {
    /// An embedded real histogram: `wikipedia-512` (default) or `squad-384`.
    #[arg(long, conflicts_with_all = ["histogram", "lengths"])]
    dataset: Option<String>,
    /// A `length,count` CSV histogram file.
    #[arg(long, conflicts_with = "lengths")]
    histogram: Option<PathBuf>,
    /// A file of sequence lengths (integers separated by whitespace or commas);
    /// the plan then maps every sequence to a pack.
    #[arg(long)]
    lengths: Option<PathBuf>,
    /// `none`, `spfhp`, `lpfhp`, `nnlshp`, `lphp`, `ffd`, `bfd`, or `all` (default: all, compared in one table).
    #[arg(long, short)]
    algorithm: Option<String>,
    /// Tokens per pack (default: the dataset's length, or the longest sequence).
    #[arg(long)]
    max_seq_len: Option<usize>,
    /// At most this many sequences per pack (the depth for `nnlshp` and `lphp`).
    #[arg(long)]
    max_sequences_per_pack: Option<usize>,
    /// Sequences over `--max-seq-len`: `error` (default), `split`, `truncate`, `drop`.
    #[arg(long, default_value = "error")]
    overlong: String,
    /// Print JSON instead of the table.
    #[arg(long)]
    json: bool,
    /// Write the plan (strategies with repeat counts; packs for `--lengths`) as JSON to this file.
    #[arg(long)]
    plan_out: Option<PathBuf>,
}

enum Input {
    Histogram {
        name: String,
        histogram: Histogram,
        natural_len: usize,
    },
    Lengths {
        name: String,
        lengths: Vec<usize>,
    },
}

fn parse_lengths(name: &str, text: &str) -> Result<Vec<usize>, CliError> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("");
        for tok in line
            .split(|c: char| c.is_whitespace() || c == ',')
            .filter(|t| !t.is_empty())
        {
            let l: usize = tok.parse().map_err(|_| {
                CliError::input(format!(
                    "{name} line {}: {tok:?} is not a non-negative integer",
                    i + 1
                ))
            })?;
            out.push(l);
        }
    }
    Ok(out)
}

fn input(args: &PackArgs) -> Result<Input, CliError> {
    if let Some(path) = &args.lengths {
        let name = path.display().to_string();
        return Ok(Input::Lengths {
            lengths: parse_lengths(&name, &read_file(path)?)?,
            name,
        });
    }
    if let Some(path) = &args.histogram {
        let name = path.display().to_string();
        let histogram = Histogram::from_csv(&name, &read_file(path)?)?;
        let natural_len = histogram.longest().max(1);
        return Ok(Input::Histogram {
            name,
            histogram,
            natural_len,
        });
    }
    let name = args
        .dataset
        .clone()
        .unwrap_or_else(|| "wikipedia-512".to_string());
    let histogram = Histogram::embedded(&name)?;
    let natural_len = EMBEDDED
        .iter()
        .find(|e| e.name == name)
        .map_or(histogram.longest(), |e| e.max_seq_len);
    Ok(Input::Histogram {
        name,
        histogram,
        natural_len,
    })
}

/// Runs `pack`.
pub fn run(args: PackArgs) -> Result<ExitCode, CliError> {
    let input = input(&args)?;
    let overlong: Overlong = args.overlong.parse()?;
    let (name, histogram, natural_len) = match &input {
        Input::Histogram {
            name,
            histogram,
            natural_len,
        } => (name.clone(), histogram.clone(), *natural_len),
        Input::Lengths { name, lengths } => {
            let h = Histogram::from_lengths(lengths)?;
            let longest = h.longest().max(1);
            (name.clone(), h, longest)
        }
    };
    let max_seq_len = args.max_seq_len.unwrap_or(natural_len);
    let algorithm = args.algorithm.as_deref().unwrap_or("all");
    let rows: Vec<PackingConfig> = if algorithm == "all" {
        report::default_rows(max_seq_len)
            .into_iter()
            .map(|c| match args.max_sequences_per_pack {
                Some(k) => c.with_max_sequences_per_pack(Some(k)),
                None => c,
            })
            .collect()
    } else {
        let a: Algorithm = algorithm.parse()?;
        vec![PackingConfig::new(a, max_seq_len)
            .with_max_sequences_per_pack(args.max_sequences_per_pack)]
    };
    let mut rows: Vec<PackingConfig> = rows
        .into_iter()
        .map(|c| c.with_overlong(overlong))
        .collect();
    rows.dedup();

    let bar = ProgressBar::new(rows.len() as u64);
    bar.set_style(
        ProgressStyle::with_template("{spinner} packing {msg} [{pos}/{len}] {elapsed}")
            .expect("valid template"),
    );
    bar.enable_steady_tick(std::time::Duration::from_millis(120));
    let mut results = Vec::with_capacity(rows.len());
    let mut plans = Vec::with_capacity(rows.len());
    for config in &rows {
        bar.set_message(format!("{} ({})", config.algorithm, config.setting()));
        match &input {
            Input::Histogram { .. } => {
                let packing = pack_histogram(&histogram, config)?;
                plans.push(json!({"strategies": packing.strategies}));
                results.push(packing.metrics);
            }
            Input::Lengths { lengths, .. } => {
                let plan = pack_lengths(lengths, config)?;
                plans.push(json!({
                    "strategies": plan.strategies,
                    "packs": plan.packs,
                    "empty_sequence_indices": plan.empty_sequences,
                    "dropped_sequence_indices": plan.dropped_sequences,
                }));
                results.push(plan.metrics);
            }
        }
        bar.inc(1);
    }
    bar.set_message("lower bounds");
    report::attach_bounds(&histogram, &rows, &mut results);
    bar.finish_and_clear();
    // Metrics first in each result, as before the bounds were attached.
    for (plan, metrics) in plans.iter_mut().zip(&results) {
        let mut object = serde_json::Map::new();
        object.insert("metrics".into(), json!(metrics));
        object.extend(plan.as_object().expect("object").clone());
        *plan = serde_json::Value::Object(object);
    }

    let document = json!({
        "input": name,
        "sequences": histogram.num_sequences(),
        "empty_sequences": histogram.empty_sequences(),
        "real_tokens": histogram.real_tokens(),
        "max_seq_len": max_seq_len,
        "results": plans,
    });
    if let Some(path) = &args.plan_out {
        write_file(
            path,
            &serde_json::to_string_pretty(&document).expect("json serializes"),
        )?;
    }
    if args.json {
        let mut summary = document.clone();
        for r in summary["results"].as_array_mut().expect("array") {
            r.as_object_mut().expect("object").remove("packs");
        }
        println!(
            "{}",
            serde_json::to_string_pretty(&summary).expect("json serializes")
        );
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{name}: {} sequences, {} tokens, max_seq_len {max_seq_len}, {:.2}% padding when padded",
        histogram.num_sequences(),
        histogram.real_tokens(),
        100.0 * histogram.padding_fraction(max_seq_len)
    );
    if EMBEDDED.iter().any(|e| e.name == name) {
        println!("source: {EMBEDDED_SOURCE}");
    }
    println!();
    print!("{}", report::table(&results, true));
    println!();
    print!("{}", report::recommendation(&results));
    if let Some(path) = &args.plan_out {
        println!("plan written to {}", path.display());
    }
    Ok(ExitCode::SUCCESS)
}
