//! `packshard pack`: pack real or given lengths and compare the algorithms.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use packshard::plot::PlotRow;
use packshard::reference::packing::histogram::MAX_HISTOGRAM_LENGTH;
use packshard::reference::packing::{
    check_input, pack_histogram, pack_lengths, Algorithm, Histogram, Overlong, PackingConfig,
    Strategy, EMBEDDED, EMBEDDED_SOURCE, MAX_PLAN_SEGMENTS,
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
    /// Skip the lower bound (the LP at each row's limit; ~1 s on Wikipedia at 12 per pack).
    #[arg(long)]
    no_bound: bool,
    /// Draw the length histogram, the padding of a padded batch and each
    /// algorithm's pack fill as an SVG picture to this file.
    #[arg(long)]
    plot: Option<PathBuf>,
}

enum Input {
    Histogram {
        name: String,
        histogram: Histogram,
        natural_len: usize,
    },
    Lengths {
        name: String,
        histogram: Histogram,
        /// The lengths in file order, kept while there are at most
        /// [`MAX_PLAN_SEGMENTS`] of them (a plan per sequence); `None` beyond.
        lengths: Option<Vec<usize>>,
    },
}

/// Reads a lengths file as a stream into its histogram (integers separated by
/// whitespace or commas; `#` starts a comment). The lengths themselves are
/// kept only while a plan per sequence can hold them: memory stays bounded by
/// the histogram (one counter per length up to [`MAX_HISTOGRAM_LENGTH`]) and
/// [`MAX_PLAN_SEGMENTS`] lengths, whatever the file's size.
fn read_lengths(path: &std::path::Path) -> Result<(Histogram, Option<Vec<usize>>), CliError> {
    use std::io::BufRead;
    let name = path.display().to_string();
    let file = std::fs::File::open(path).map_err(|e| CliError::input(format!("{name}: {e}")))?;
    let mut reader = std::io::BufReader::new(file);
    let mut counts: Vec<u64> = vec![0];
    let mut lengths: Option<Vec<usize>> = Some(Vec::new());
    let mut line = String::new();
    let mut number = 0usize;
    loop {
        line.clear();
        let read = reader
            .read_line(&mut line)
            .map_err(|e| CliError::input(format!("{name} line {}: {e}", number + 1)))?;
        if read == 0 {
            break;
        }
        number += 1;
        let text = line.split('#').next().unwrap_or("");
        if text.trim().is_empty() {
            continue;
        }
        for (f, field) in text.split(',').enumerate() {
            if field.trim().is_empty() {
                return Err(CliError::input(format!(
                    "{name} line {number} field {}: empty field (lengths are integers separated by whitespace or commas)",
                    f + 1
                )));
            }
            for tok in field.split_whitespace() {
                let l: usize = tok.parse().map_err(|_| {
                    CliError::input(format!(
                        "{name} line {number} field {}: {tok:?} is not a non-negative integer",
                        f + 1
                    ))
                })?;
                if l > MAX_HISTOGRAM_LENGTH {
                    return Err(CliError::input(format!(
                        "{name} line {number} field {}: {l} tokens is over the {MAX_HISTOGRAM_LENGTH} a histogram can hold",
                        f + 1
                    )));
                }
                if l >= counts.len() {
                    counts.resize(l + 1, 0);
                }
                counts[l] += 1;
                if let Some(v) = &mut lengths {
                    // Every sequence counts, empty and dropped ones too: the
                    // plan lists each of them.
                    if v.len() < MAX_PLAN_SEGMENTS {
                        v.push(l);
                    } else {
                        lengths = None;
                    }
                }
            }
        }
    }
    Ok((Histogram::from_counts(counts), lengths))
}

fn input(args: &PackArgs) -> Result<Input, CliError> {
    if let Some(path) = &args.lengths {
        let name = path.display().to_string();
        let (histogram, lengths) = read_lengths(path)?;
        return Ok(Input::Lengths {
            name,
            histogram,
            lengths,
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
    let (name, histogram, natural_len, lengths) = match &input {
        Input::Histogram {
            name,
            histogram,
            natural_len,
        } => (name.clone(), histogram, *natural_len, None),
        Input::Lengths {
            name,
            histogram,
            lengths,
        } => {
            if lengths.is_none() && args.plan_out.is_some() {
                return Err(CliError::input(format!(
                    "lengths: {} sequences is over the {MAX_PLAN_SEGMENTS} a plan per sequence can list; drop --plan-out (the table packs their histogram) or split the file",
                    histogram.num_sequences()
                )));
            }
            (
                name.clone(),
                histogram,
                histogram.longest().max(1),
                lengths.as_deref(),
            )
        }
    };
    let max_seq_len = args.max_seq_len.unwrap_or(natural_len);
    let algorithm = args.algorithm.as_deref().unwrap_or("all");
    let rows: Vec<PackingConfig> = if algorithm == "all" {
        report::default_rows(max_seq_len)
    } else {
        let a: Algorithm = algorithm.parse()?;
        vec![PackingConfig::new(a, max_seq_len)]
    };
    let rows: Vec<PackingConfig> = report::with_limit(
        rows.into_iter()
            .map(|c| c.with_overlong(overlong))
            .collect(),
        args.max_sequences_per_pack,
    );
    // Every row is checked before any packs: a bad row fails at once.
    for config in &rows {
        match lengths {
            None => check_input(histogram, config)?,
            Some(_) => config.validate()?,
        }
    }

    let bar = ProgressBar::new(rows.len() as u64);
    bar.set_style(
        ProgressStyle::with_template("{spinner} packing {msg} [{pos}/{len}] {elapsed}")
            .expect("valid template"),
    );
    bar.enable_steady_tick(std::time::Duration::from_millis(120));
    // Rows in table order; plans (JSON) only where a file will hold them.
    let mut results: Vec<Option<packshard::reference::packing::PackingMetrics>> =
        vec![None; rows.len()];
    let mut plans: Vec<serde_json::Value> = vec![serde_json::Value::Null; rows.len()];
    let mut bounds = report::BoundCache::default();
    let mut plotted: Vec<Vec<Strategy>> = vec![Vec::new(); rows.len()];
    for i in report::compute_order(&rows) {
        let config = &rows[i];
        bar.set_message(format!("{} ({})", config.algorithm, config.setting()));
        let mut metrics = match lengths {
            None => {
                let packing = pack_histogram(histogram, config)?;
                if args.plan_out.is_some() || args.json {
                    plans[i] = json!({"strategies": packing.strategies});
                }
                if args.plot.is_some() {
                    plotted[i] = packing.strategies;
                }
                packing.metrics
            }
            Some(lengths) => {
                let plan = pack_lengths(lengths, config)?;
                if args.plan_out.is_some() {
                    plans[i] = json!({
                        "strategies": plan.strategies,
                        "packs": plan.packs,
                        "empty_sequence_indices": plan.empty_sequences,
                        "dropped_sequence_indices": plan.dropped_sequences,
                    });
                } else if args.json {
                    plans[i] = json!({"strategies": plan.strategies});
                }
                if args.plot.is_some() {
                    plotted[i] = plan.strategies;
                }
                plan.metrics
            }
        };
        if !args.no_bound {
            bar.set_message(format!(
                "{} ({}): bound",
                config.algorithm,
                config.setting()
            ));
            bounds.attach(histogram, config, &mut metrics);
        }
        results[i] = Some(metrics);
        bar.inc(1);
    }
    bar.finish_and_clear();
    let results: Vec<_> = results
        .into_iter()
        .map(|m| m.expect("every row ran"))
        .collect();
    // Metrics first in each result.
    for (plan, metrics) in plans.iter_mut().zip(&results) {
        let mut object = serde_json::Map::new();
        object.insert("metrics".into(), json!(metrics));
        if let Some(rest) = plan.as_object() {
            object.extend(rest.clone());
        }
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
    if let Some(path) = &args.plot {
        let rows: Vec<PlotRow<'_>> = results
            .iter()
            .zip(&plotted)
            .map(|(metrics, strategies)| PlotRow {
                metrics,
                strategies,
            })
            .collect();
        let svg = packshard::plot::packing_svg(&name, histogram, max_seq_len, &rows)
            .map_err(CliError::input)?;
        write_file(path, &svg)?;
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
    print!(
        "{}",
        report::header(&name, histogram, max_seq_len, &results)
    );
    if EMBEDDED.iter().any(|e| e.name == name) {
        println!("source: {EMBEDDED_SOURCE}");
    }
    if lengths.is_none() && matches!(input, Input::Lengths { .. }) {
        println!(
            "(over {MAX_PLAN_SEGMENTS} sequences: packed as their histogram, no plan per sequence)"
        );
    }
    println!();
    print!("{}", report::table(&results, true));
    println!();
    print!("{}", report::recommendation(&results));
    if let Some(path) = &args.plan_out {
        println!("plan written to {}", path.display());
    }
    if let Some(path) = &args.plot {
        println!("plot written to {}", path.display());
    }
    Ok(ExitCode::SUCCESS)
}
