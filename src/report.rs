//! Human-readable reports: the packing comparison table of `packshard pack`.

use std::fmt::Write as _;

use packshard_reference::packing::{Algorithm, PackingConfig, PackingMetrics};

/// The rows `packshard pack` compares by default: the padding baseline, then
/// each algorithm at the paper's depth of 3 sequences per pack, then the
/// heuristics at the paper's SPFHP setting of 12.
pub fn default_rows(max_seq_len: usize) -> Vec<PackingConfig> {
    let mut rows = vec![PackingConfig::new(Algorithm::None, max_seq_len)];
    for limit in [3, 12] {
        for algorithm in [
            Algorithm::Spfhp,
            Algorithm::Lpfhp,
            Algorithm::Nnlshp,
            Algorithm::Ffd,
            Algorithm::Bfd,
        ] {
            if algorithm == Algorithm::Nnlshp && limit > 3 {
                continue; // depth 12 has billions of strategies
            }
            rows.push(
                PackingConfig::new(algorithm, max_seq_len).with_max_sequences_per_pack(Some(limit)),
            );
        }
    }
    rows
}

/// Formats metrics as an aligned table: algorithm, setting, packs, efficiency,
/// speed-up, limit, sequences per pack, and (if `show_time`) run time.
/// Efficiency is in percent to 3 places, speed-ups to 4.
pub fn table(rows: &[PackingMetrics], show_time: bool) -> String {
    let mut out = String::new();
    let time_head = if show_time {
        format!(" {:>10}", "time")
    } else {
        String::new()
    };
    let _ = writeln!(
        out,
        "{:<9} {:<12} {:>10} {:>11} {:>9} {:>8} {:>9}{time_head}",
        "algorithm", "setting", "packs", "efficiency", "speed-up", "limit", "seqs/pack"
    );
    for m in rows {
        let time = if show_time {
            format!(" {:>10}", format_seconds(m.seconds))
        } else {
            String::new()
        };
        let _ = writeln!(
            out,
            "{:<9} {:<12} {:>10} {:>10.3}% {:>8.4}x {:>7.4}x {:>9.3}{time}",
            m.algorithm,
            m.setting,
            m.num_packs,
            100.0 * m.efficiency,
            m.speedup,
            m.speedup_limit,
            m.sequences_per_pack
        );
    }
    out
}

/// Seconds as `0.123 ms`, `12.3 ms` or `1.23 s`.
pub fn format_seconds(s: f64) -> String {
    if s < 1e-3 {
        format!("{:.1} us", s * 1e6)
    } else if s < 1.0 {
        format!("{:.1} ms", s * 1e3)
    } else {
        format!("{s:.2} s")
    }
}

/// Which row to pick, in a few lines: the most efficient plan with at most 3
/// sequences per pack (cheap attention, the paper's recommendation) and the
/// most efficient overall; ties go to the row listed first.
pub fn recommendation(rows: &[PackingMetrics]) -> String {
    let Some(baseline) = rows.iter().find(|m| m.algorithm == "none") else {
        return String::new();
    };
    let best = |filter: &dyn Fn(&PackingMetrics) -> bool| {
        rows.iter()
            .filter(|m| m.algorithm != "none" && filter(m))
            .fold(None::<&PackingMetrics>, |acc, m| match acc {
                Some(a) if a.efficiency >= m.efficiency => Some(a),
                _ => Some(m),
            })
    };
    let describe = |m: &PackingMetrics| {
        format!(
            "{} ({}): {:.3}% efficiency, {:.4}x fewer rows than padding, in {}",
            m.algorithm,
            m.setting,
            100.0 * m.efficiency,
            m.speedup,
            format_seconds(m.seconds)
        )
    };
    let mut out = format!(
        "Padding wastes {:.2}% of the compute; packing can win at most {:.4}x.\n",
        100.0 * (1.0 - baseline.efficiency),
        baseline.speedup_limit
    );
    let shallow = best(&|m| m.max_sequences_per_pack.is_some_and(|k| k <= 3));
    if let Some(s) = shallow {
        let _ = writeln!(
            out,
            "Best with at most 3 sequences per pack (the paper's choice): {}.",
            describe(s)
        );
    }
    if let Some(b) = best(&|_| true) {
        if shallow.is_some_and(|s| s.efficiency >= b.efficiency) {
            let _ = writeln!(out, "More sequences per pack buys nothing more here.");
        } else {
            let _ = writeln!(out, "Best overall: {}.", describe(b));
        }
    }
    out
}
