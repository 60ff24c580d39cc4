//! `packshard bench`: the optimized kernels against their baselines, ratios
//! measured in one run (see `packshard::bench`).

use std::process::ExitCode;

use clap::Args;
use packshard::bench::{self, BenchConfig, FilterReport};
use packshard::optimized::ops::LinearCeTiled;
use packshard::registry;
use serde_json::json;

use super::CliError;

#[derive(Args)]
pub struct BenchArgs {
    /// Small sizes that run in seconds (CI); without it, the sizes
    /// (BERT-base layer, cross-entropy 30522 x 384 and 256000 x 1024 on 4096 tokens).
    #[arg(long)]
    quick: bool,
    /// Which parts: `registry` (every registered implementation through its
    /// trait), `layer`, `decoder`, `attention`, `window`, `ce`,
    /// comma-separated.
    #[arg(
        long,
        default_value = "registry,layer,decoder,attention,window,ce",
        value_delimiter = ','
    )]
    only: Vec<String>,
    /// Sequences in the layer and attention batches.
    #[arg(long)]
    sequences: Option<usize>,
    /// Cross-entropy sizes as `VxH`, comma-separated (e.g. `30522x384`).
    #[arg(long, value_delimiter = ',')]
    ce_sizes: Option<Vec<String>>,
    /// Cross-entropy tokens.
    #[arg(long)]
    ce_tokens: Option<usize>,
    /// Tokens per chunk of the fused cross-entropy (default 256).
    #[arg(long)]
    ce_chunk_tokens: Option<usize>,
    /// Timed runs per measurement (the minimum is reported).
    #[arg(long)]
    reps: Option<usize>,
    /// Print JSON instead of the table.
    #[arg(long)]
    json: bool,
    /// Print the registered implementations (family, name, precision, what
    /// it needs, what changed) and exit without timing anything.
    #[arg(long)]
    list: bool,
}

fn parse_size(s: &str) -> Result<(usize, usize), CliError> {
    let bad = || CliError::input(format!("--ce-sizes: {s:?} is not VxH (e.g. 30522x384)"));
    let (v, h) = s.split_once('x').ok_or_else(bad)?;
    Ok((
        v.trim().parse().map_err(|_| bad())?,
        h.trim().parse().map_err(|_| bad())?,
    ))
}

fn mib(b: Option<usize>) -> String {
    b.map_or("n/a".into(), |b| {
        format!("{:.1}", b as f64 / (1 << 20) as f64)
    })
}

/// A registry entry as one line of the listings: family, name, precision,
/// with `needs` what it needs to run, and what it changes.
fn entry_line(e: &registry::Info, needs: bool) -> String {
    let needs = if needs {
        format!("{:<13} ", e.needs.name())
    } else {
        String::new()
    };
    format!(
        "{:<20} {:<30} {:<5} {needs}{}",
        e.family.name(),
        e.name,
        e.precision.name(),
        e.changed
    )
}

/// Runs `bench`.
pub fn run(args: BenchArgs) -> Result<ExitCode, CliError> {
    let mut cfg = if args.quick {
        BenchConfig::quick()
    } else {
        BenchConfig::full()
    };
    if let Some(s) = args.sequences {
        cfg.sequences = s;
    }
    if let Some(sizes) = &args.ce_sizes {
        cfg.ce_sizes = sizes
            .iter()
            .map(|s| parse_size(s))
            .collect::<Result<_, _>>()?;
    }
    if let Some(t) = args.ce_tokens {
        cfg.ce_tokens = t;
    }
    if let Some(t) = args.ce_chunk_tokens {
        cfg.ce_chunks.tokens = t;
    }
    if let Some(r) = args.reps {
        cfg.reps = r;
    }
    cfg.validate()?;
    for part in &args.only {
        if !["registry", "layer", "decoder", "attention", "window", "ce"].contains(&part.as_str()) {
            return Err(CliError::input(format!(
                "--only: unknown part {part:?} (registry, layer, decoder, attention, window, ce)"
            )));
        }
    }
    let want = |p: &str| args.only.iter().any(|x| x == p);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut out = serde_json::Map::new();
    out.insert(
        "machine".into(),
        json!({"threads": threads, "simd": packshard::optimized::simd::arch_name(),
               "debug_build": cfg!(debug_assertions)}),
    );
    let entries = registry::all();
    out.insert(
        "implementations".into(),
        json!(entries
            .iter()
            .map(|e| json!({"family": e.family.name(), "name": e.name, "precision": e.precision.name(),
                            "needs": e.needs.name(), "changed": e.changed}))
            .collect::<Vec<_>>()),
    );
    if args.list {
        if args.json {
            println!("{}", json!(out["implementations"]));
        } else {
            for e in &entries {
                println!("{}", entry_line(e, true));
            }
        }
        return Ok(ExitCode::SUCCESS);
    }
    if !args.json {
        println!(
            "packshard bench ({} sizes): {threads} threads, SIMD {}{}",
            if args.quick { "quick" } else { "full" },
            packshard::optimized::simd::arch_name(),
            if cfg!(debug_assertions) {
                " — DEBUG BUILD: use --release for figures"
            } else {
                ""
            }
        );
        println!("registered implementations:");
        for e in &entries {
            println!("  {}", entry_line(e, false));
        }
    }
    if want("registry") {
        let rows = packshard::bench::registry(&cfg)?;
        if !args.json {
            println!("\nevery registered implementation through its trait (f64 at the boundary), checked against the f64 reference, then timed:");
            println!(
                "  {:<20} {:<30} {:<5} {:>10} {:>9} {:>12}  workload",
                "family", "impl", "prec", "seconds", "x ref", "max rel diff"
            );
            for r in &rows {
                match (&r.skipped, r.seconds) {
                    (Some(why), _) => println!(
                        "  {:<20} {:<30} {:<5} skipped: {why}",
                        r.family.name(),
                        r.name,
                        r.precision.name()
                    ),
                    (None, Some(s)) => println!(
                        "  {:<20} {:<30} {:<5} {:>10.4} {:>8.2}x {:>12.2e}  {}",
                        r.family.name(),
                        r.name,
                        r.precision.name(),
                        s,
                        r.speedup.unwrap_or(f64::NAN),
                        r.max_rel_diff,
                        r.workload
                    ),
                    (None, None) => {}
                }
            }
        }
        out.insert(
            "registry".into(),
            json!(rows
                .iter()
                .map(|r| json!({"family": r.family.name(), "name": r.name, "precision": r.precision.name(),
                                "seconds": r.seconds, "speedup_vs_reference": r.speedup,
                                "max_rel_diff": r.max_rel_diff, "skipped": r.skipped,
                                "workload": r.workload}))
                .collect::<Vec<_>>()),
        );
    }
    if want("layer") {
        let r = bench::layer(&cfg)?;
        let frac = r.achieved_gflops() / r.gemm_gflops;
        if !args.json {
            println!(
                "\nencoder layer fwd+bwd (hidden {}, {} heads, inter {}, rows of {}): {} sequences from wikipedia-512, {} real tokens, {} packs",
                cfg.hidden, cfg.heads, cfg.intermediate, cfg.max_len, r.sequences, r.real_tokens, r.num_packs
            );
            println!(
                "  packed {:.3} s, padded {:.3} s: packed is {:.2}x faster (token-slot limit {:.4}x; target >= 1.9x)",
                r.packed_s, r.padded_s, r.speedup(), r.slot_ratio
            );
            println!(
                "  packed {:.1} GFLOP/s achieved; gemm {:.1} GFLOP/s in this run: {:.0}% (target >= 75%, issue 37)",
                r.achieved_gflops(),
                r.gemm_gflops,
                100.0 * frac
            );
            println!(
                "  f64 reference on {} sequences: {:.3} s; optimized: {:.4} s: {:.1}x faster",
                r.reference_sequences,
                r.reference_s,
                r.optimized_small_s,
                r.reference_s / r.optimized_small_s
            );
        }
        out.insert(
            "layer".into(),
            json!({"sequences": r.sequences, "real_tokens": r.real_tokens, "num_packs": r.num_packs,
                   "packed_s": r.packed_s, "padded_s": r.padded_s, "speedup": r.speedup(),
                   "slot_ratio": r.slot_ratio, "packed_gflop": r.packed_gflop,
                   "achieved_gflops": r.achieved_gflops(), "gemm_gflops": r.gemm_gflops,
                   "fraction_of_gemm": frac, "reference_sequences": r.reference_sequences,
                   "reference_s": r.reference_s, "optimized_small_s": r.optimized_small_s,
                   "packed_vs_padded_rel": r.packed_vs_padded_rel}),
        );
    }
    if want("decoder") {
        let r = bench::decoder_layer(&cfg)?;
        if !args.json {
            println!(
                "\nf32 decoder layer fwd+bwd (hidden {}, {} heads over {} kv heads, SwiGLU {}, causal, rows of {}): {} sequences from wikipedia-512, {} real tokens, {} packs",
                cfg.hidden, cfg.heads, r.kv_heads, cfg.intermediate, cfg.max_len, r.sequences, r.real_tokens, r.num_packs
            );
            println!(
                "  packed {:.3} s, padded {:.3} s: time ratio padded/packed {:.3}x, slot ratio {:.3}x: {:.3} of the slot ratio (target >= 0.95)",
                r.packed_s, r.padded_s, r.speedup(), r.slot_ratio, r.of_slot_ratio()
            );
        }
        out.insert(
            "decoder".into(),
            json!({"sequences": r.sequences, "real_tokens": r.real_tokens, "num_packs": r.num_packs,
                   "kv_heads": r.kv_heads, "packed_s": r.packed_s, "padded_s": r.padded_s,
                   "speedup": r.speedup(), "slot_ratio": r.slot_ratio,
                   "of_slot_ratio": r.of_slot_ratio(), "packed_vs_padded_rel": r.packed_vs_padded_rel}),
        );
    }
    if want("attention") {
        let r = bench::attention(&cfg)?;
        let gp = |pairs: u64, s: f64| pairs as f64 / s / 1e9;
        if !args.json {
            println!(
                "\nvarlen attention forward (f32, {} heads x {}): {} segments in {} packs; sum len^2 = {} pairs (dense: {})",
                cfg.heads,
                cfg.hidden / cfg.heads,
                r.segments,
                r.num_packs,
                r.varlen_pairs,
                r.dense_pairs
            );
            println!(
                "  ours (varlen)          {:.4} s  {:.3} Gpairs/s of the work it must do",
                r.varlen_s,
                gp(r.varlen_pairs, r.varlen_s)
            );
            println!(
                "  dense masked (ours)    {:.4} s  {:.3} Gpairs/s of that work: varlen is {:.2}x faster",
                r.dense_s,
                gp(r.varlen_pairs, r.dense_s),
                r.dense_s / r.varlen_s
            );
            match r.candle_s {
                Some(c) => println!(
                    "  candle-nn flash_attn_varlen_cpu {:.4} s  {:.3} Gpairs/s: ours is {:.2}x its speed (max |diff| {:.1e}; target >= 1x)",
                    c,
                    gp(r.varlen_pairs, c),
                    c / r.varlen_s,
                    r.candle_max_abs.unwrap_or(0.0)
                ),
                None => println!("  candle-nn: not built (feature `candle`)"),
            }
        }
        out.insert(
            "attention".into(),
            json!({"segments": r.segments, "num_packs": r.num_packs,
                   "varlen_pairs": r.varlen_pairs, "dense_pairs": r.dense_pairs,
                   "varlen_s": r.varlen_s, "dense_s": r.dense_s, "candle_s": r.candle_s,
                   "candle_max_abs": r.candle_max_abs}),
        );
    }
    if want("window") {
        let r = bench::window(&cfg)?;
        let ratio = |(a, b): (f64, f64)| a / b;
        if !args.json {
            println!(
                "\ntiled attention (f32, {} heads x {}), causal, {} rows of {}: window_size ({}, 0) against none",
                cfg.heads,
                cfg.hidden / cfg.heads,
                r.rows,
                r.row_len,
                r.left
            );
            println!(
                "  scored pairs (one head) {} / {}: work ratio {:.3} (allowed pairs {} / {}: {:.3})",
                r.scored_pairs.0,
                r.scored_pairs.1,
                r.work_ratio(),
                r.allowed_pairs.0,
                r.allowed_pairs.1,
                r.allowed_pairs.0 as f64 / r.allowed_pairs.1 as f64
            );
            println!(
                "  forward  {:.4} s / {:.4} s: time ratio {:.3}",
                r.forward_s.0,
                r.forward_s.1,
                ratio(r.forward_s)
            );
            println!(
                "  backward {:.4} s / {:.4} s: time ratio {:.3}",
                r.backward_s.0,
                r.backward_s.1,
                ratio(r.backward_s)
            );
        }
        out.insert(
            "window".into(),
            json!({"rows": r.rows, "row_len": r.row_len, "window_left": r.left,
                   "scored_pairs": [r.scored_pairs.0, r.scored_pairs.1],
                   "allowed_pairs": [r.allowed_pairs.0, r.allowed_pairs.1],
                   "work_ratio": r.work_ratio(),
                   "forward_s": [r.forward_s.0, r.forward_s.1],
                   "backward_s": [r.backward_s.0, r.backward_s.1],
                   "forward_time_ratio": ratio(r.forward_s),
                   "backward_time_ratio": ratio(r.backward_s)}),
        );
    }
    if want("ce") {
        let rs = bench::cross_entropy(&cfg)?;
        let mut rows = Vec::new();
        for r in &rs {
            if !args.json {
                println!(
                    "\nlinear cross-entropy fwd+bwd, vocab {} x hidden {}, {} tokens, fused in chunks of {} x {} (logits [n, v] f32: {} MiB; gradients returned: {} MiB)",
                    r.vocab,
                    r.hidden,
                    r.tokens,
                    cfg.ce_chunks.tokens,
                    cfg.ce_chunks.vocab,
                    mib(Some(r.logits_bytes)),
                    mib(Some(r.output_bytes))
                );
                match (r.materialized_s, r.materialized_peak) {
                    (Some(s), peak) => {
                        println!("  materialized {:.3} s, peak {} MiB", s, mib(peak))
                    }
                    (None, _) => println!("  materialized: over the 2^30-logit limit, not run"),
                }
                println!(
                    "  fused        {:.3} s, peak {} MiB",
                    r.fused_s,
                    mib(r.fused_peak)
                );
                println!(
                    "  tiled        {:.3} s, peak {} MiB (tiles of {} x {})",
                    r.tiled_s,
                    mib(r.tiled_peak),
                    LinearCeTiled::default().chunks.tokens,
                    LinearCeTiled::default().chunks.vocab
                );
                for (what, f) in [
                    ("", &r.filtered),
                    (" (peaked: W's first 512 rows x15)", &r.filtered_peaked),
                ] {
                    println!(
                        "  filtered{what} {:.3} s, tiled {:.3} s ({:.2}x; threshold 2^-12: {} of {} tiles skipped, reported bounds dL/dhidden {:.2e}, dL/dW {:.2e})",
                        f.filtered_s,
                        f.tiled_s,
                        f.filtered_s / f.tiled_s,
                        f.skipped,
                        f.tiles,
                        f.bounds.0,
                        f.bounds.1
                    );
                }
                if let (Some(m), Some(mp)) = (r.materialized_s, r.materialized_peak) {
                    let work = |p: usize| p.saturating_sub(r.output_bytes) as f64;
                    for (name, s, peak, target) in [
                        ("fused", r.fused_s, r.fused_peak, "<= 1"),
                        ("tiled", r.tiled_s, r.tiled_peak, "<= 1.4"),
                    ] {
                        let Some(p) = peak else { continue };
                        println!(
                            "  {name}/materialized: time {:.2}x (target {target}), peak {:.3} (target <= 0.125 and 0.21), peak without the returned gradients {:.4} (target <= 0.02)",
                            s / m,
                            p as f64 / mp as f64,
                            work(p) / work(mp).max(1.0)
                        );
                    }
                }
            }
            rows.push(json!({"vocab": r.vocab, "hidden": r.hidden, "tokens": r.tokens,
                             "materialized_s": r.materialized_s, "materialized_peak_bytes": r.materialized_peak,
                             "fused_s": r.fused_s, "fused_peak_bytes": r.fused_peak,
                             "tiled_s": r.tiled_s, "tiled_peak_bytes": r.tiled_peak,
                             "filtered": filter_json(&r.filtered),
                             "filtered_peaked": filter_json(&r.filtered_peaked),
                             "output_bytes": r.output_bytes, "logits_bytes": r.logits_bytes}));
        }
        out.insert("cross_entropy".into(), json!(rows));
    }
    if args.json {
        println!("{}", serde_json::Value::Object(out));
    }
    Ok(ExitCode::SUCCESS)
}

/// A [`FilterReport`] as JSON.
fn filter_json(f: &FilterReport) -> serde_json::Value {
    json!({"tiled_s": f.tiled_s, "filtered_s": f.filtered_s, "skipped_tiles": f.skipped,
           "tiles": f.tiles, "bounds": [f.bounds.0, f.bounds.1]})
}
