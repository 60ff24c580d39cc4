//! Human-readable reports: the packing comparison table of `packshard pack`.

use std::fmt::Write as _;

use packshard_reference::packing::{
    bound_for, Algorithm, Histogram, PackingConfig, PackingMetrics,
};

/// The rows `packshard pack` compares by default: the padding baseline, then
/// each algorithm at the paper's depth of 3 sequences per pack (LPHP, the LP
/// packing of issue #8, after NNLSHP), then the heuristics at the paper's
/// SPFHP setting of 12.
pub fn default_rows(max_seq_len: usize) -> Vec<PackingConfig> {
    let mut rows = vec![PackingConfig::new(Algorithm::None, max_seq_len)];
    for limit in [3, 12] {
        for algorithm in [
            Algorithm::Spfhp,
            Algorithm::Lpfhp,
            Algorithm::Nnlshp,
            Algorithm::Lphp,
            Algorithm::Ffd,
            Algorithm::Bfd,
        ] {
            if matches!(algorithm, Algorithm::Nnlshp | Algorithm::Lphp) && limit > 3 {
                // NNLSHP at depth 12 has billions of strategies; LPHP's column
                // generation takes ~20 rounds (seconds) on Wikipedia there.
                continue;
            }
            rows.push(
                PackingConfig::new(algorithm, max_seq_len).with_max_sequences_per_pack(Some(limit)),
            );
        }
    }
    rows
}

/// Adds to each row (`rows[i]` packed `histogram` under `configs[i]`) the
/// lower bound for its limit ([`bound_for`]): each distinct bound is computed
/// once, and one an `lphp` row already carries is reused. A bound that cannot
/// be computed is left out, not an error: the packing itself stands.
pub fn attach_bounds(
    histogram: &Histogram,
    configs: &[PackingConfig],
    rows: &mut [PackingMetrics],
) {
    let key = |c: &PackingConfig| (c.limit(), c.overlong, c.max_seq_len);
    let mut known: Vec<usize> = (0..rows.len())
        .filter(|&i| rows[i].bound_packs.is_some())
        .collect();
    for i in 0..rows.len().min(configs.len()) {
        if rows[i].bound_packs.is_some() {
            continue;
        }
        if let Some(&k) = known
            .iter()
            .find(|&&k| key(&configs[k]) == key(&configs[i]))
        {
            let from = rows[k].clone();
            copy_bound(&from, &mut rows[i]);
        } else if let Ok(bound) = bound_for(histogram, &configs[i]) {
            rows[i].set_bound(&bound);
        } else {
            continue;
        }
        known.push(i);
    }
}

/// Copies the bound of `from` to `to` (the same input and limit).
fn copy_bound(from: &PackingMetrics, to: &mut PackingMetrics) {
    to.bound_packs = from.bound_packs;
    to.bound_efficiency = from.bound_efficiency;
    to.bound_depth = from.bound_depth;
    to.lp_value = from.lp_value;
    to.lp_iterations = from.lp_iterations;
    to.gap_packs = from.bound_packs.map(|b| to.num_packs.saturating_sub(b));
}

/// Formats metrics as an aligned table: algorithm, setting, packs,
/// efficiency, the bound on efficiency and the gap to it in packs (see
/// [`bound_cell`]), speed-up, limit, sequences per pack, and (if `show_time`)
/// run time. Efficiency is in percent to 3 places, speed-ups to 4.
pub fn table(rows: &[PackingMetrics], show_time: bool) -> String {
    let mut out = String::new();
    let time_head = if show_time {
        format!(" {:>10}", "time")
    } else {
        String::new()
    };
    let _ = writeln!(
        out,
        "{:<9} {:<12} {:>10} {:>11} {:>10} {:>7} {:>9} {:>8} {:>9}{time_head}",
        "algorithm",
        "setting",
        "packs",
        "efficiency",
        "bound",
        "gap",
        "speed-up",
        "limit",
        "seqs/pack"
    );
    for m in rows {
        let time = if show_time {
            format!(" {:>10}", format_seconds(m.seconds))
        } else {
            String::new()
        };
        let gap = m.gap_packs.map_or("-".to_string(), |g| g.to_string());
        let _ = writeln!(
            out,
            "{:<9} {:<12} {:>10} {:>10.3}% {:>10} {:>7} {:>8.4}x {:>7.4}x {:>9.3}{time}",
            m.algorithm,
            m.setting,
            m.num_packs,
            100.0 * m.efficiency,
            bound_cell(m),
            gap,
            m.speedup,
            m.speedup_limit,
            m.sequences_per_pack
        );
    }
    if rows.iter().any(|m| m.bound_packs.is_some()) {
        let _ = writeln!(out, "{}", BOUND_NOTE);
    }
    out
}

/// What the `bound` and `gap` columns mean, printed under the table.
pub const BOUND_NOTE: &str = "bound: the most efficiency any plan within the row's limit can reach (the LP optimum at that depth,\n  rounded up to whole packs; * where the LP is too large to price: tokens / max_seq_len). gap: packs over it.";

/// The `bound` cell: the bound efficiency in percent to 3 places, with `*`
/// for the depth-free token bound; `-` where none was computed.
pub fn bound_cell(m: &PackingMetrics) -> String {
    match (m.bound_efficiency, m.bound_depth) {
        (Some(e), Some(_)) => format!("{:.3}% ", 100.0 * e),
        (Some(e), None) => format!("{:.3}%*", 100.0 * e),
        (None, _) => "-".to_string(),
    }
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
        let bound = match (m.bound_efficiency, m.gap_packs) {
            (Some(b), Some(g)) => format!(
                " (bound {:.3}%{}, {g} pack{} over it)",
                100.0 * b,
                if m.bound_depth.is_none() {
                    " from tokens alone"
                } else {
                    ""
                },
                if g == 1 { "" } else { "s" }
            ),
            _ => String::new(),
        };
        format!(
            "{} ({}): {:.3}% efficiency{bound}, {:.4}x fewer rows than padding, in {}",
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
    // The LP bound at depth 3, from whichever row carries it.
    let lp3 = rows
        .iter()
        .find(|m| m.bound_depth == Some(3) && m.max_sequences_per_pack == Some(3));
    if let (Some(m), Some(packs), Some(e)) = (
        lp3,
        lp3.and_then(|m| m.bound_packs),
        lp3.and_then(|m| m.bound_efficiency),
    ) {
        let lp = m.lp_value.map_or(String::new(), |v| {
            format!(" (LP optimum {v:.2} packs, rounded up)")
        });
        let _ = writeln!(
            out,
            "No plan with at most 3 sequences per pack uses fewer than {packs} packs{lp}: at most {:.3}% efficiency.",
            100.0 * e
        );
    }
    if let Some(b) = best(&|_| true) {
        if let Some(s) = shallow.filter(|s| s.efficiency >= b.efficiency) {
            // Nothing deeper does better; say whether the bound leaves room.
            let deeper = rows
                .iter()
                .filter(|m| m.max_sequences_per_pack.is_none_or(|k| k > 3))
                .filter_map(|m| m.bound_efficiency.map(|e| (e, m)))
                .fold(None::<(f64, &PackingMetrics)>, |acc, x| match acc {
                    Some(a) if a.0 >= x.0 => Some(a),
                    _ => Some(x),
                });
            match deeper {
                Some((e, m)) if e > s.efficiency + 5e-6 => {
                    let _ = writeln!(
                        out,
                        "No algorithm here does better with more sequences per pack, though the bound at {} allows {:.3}%.",
                        m.setting,
                        100.0 * e
                    );
                }
                _ => {
                    let _ = writeln!(out, "More sequences per pack buys nothing more here.");
                }
            }
        } else {
            let _ = writeln!(out, "Best overall: {}.", describe(b));
        }
    }
    out
}
