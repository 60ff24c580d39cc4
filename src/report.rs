//! Human-readable reports: the packing comparison table of `packshard pack`.

use std::fmt::Write as _;

use packshard_reference::packing::{
    bound_for, Algorithm, Histogram, PackingConfig, PackingMetrics,
};

/// The rows `packshard pack` compares by default: the padding baseline, then
/// each algorithm at the paper's depth of 3 sequences per pack (LPHP, the LP
/// packing of issue #8, after NNLSHP), then the heuristics and LPHP at the
/// paper's SPFHP setting of 12 (NNLSHP has billions of strategies there).
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
            if algorithm == Algorithm::Nnlshp && limit > 3 {
                // NNLSHP at depth 12 has billions of strategies.
                continue;
            }
            rows.push(
                PackingConfig::new(algorithm, max_seq_len).with_max_sequences_per_pack(Some(limit)),
            );
        }
    }
    rows
}

/// `rows` with every limit replaced by `max_sequences_per_pack` (when given),
/// each distinct row once, in their first order.
pub fn with_limit(
    rows: Vec<PackingConfig>,
    max_sequences_per_pack: Option<usize>,
) -> Vec<PackingConfig> {
    let mut out: Vec<PackingConfig> = Vec::with_capacity(rows.len());
    for row in rows {
        let row = match max_sequences_per_pack {
            Some(k) if row.algorithm != Algorithm::None => row.with_max_sequences_per_pack(Some(k)),
            _ => row,
        };
        if !out.contains(&row) {
            out.push(row);
        }
    }
    out
}

/// The order in which to compute `rows` so that every bound is computed at
/// most once: the `lphp` rows (which find the bound of their limit as they
/// pack) first, then the rest, each group in table order.
pub fn compute_order(rows: &[PackingConfig]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..rows.len()).collect();
    order.sort_by_key(|&i| rows[i].algorithm != Algorithm::Lphp);
    order
}

/// Lower bounds already computed for one input, keyed by what they depend on
/// (limit, overlong policy, `max_seq_len`): the rows of one table share them.
#[derive(Default)]
pub struct BoundCache {
    known: Vec<(
        (usize, packshard_reference::packing::Overlong, usize),
        PackingMetrics,
    )>,
}

impl BoundCache {
    /// Adds the bound for `config`'s limit to `metrics`: the one a row with
    /// the same key carries (an `lphp` row's own), else [`bound_for`] once.
    /// A bound that cannot be computed is left out, not an error.
    pub fn attach(
        &mut self,
        histogram: &Histogram,
        config: &PackingConfig,
        metrics: &mut PackingMetrics,
    ) {
        let key = (config.limit(), config.overlong, config.max_seq_len);
        if metrics.bound_packs.is_none() {
            if let Some((_, from)) = self.known.iter().find(|(k, _)| *k == key) {
                copy_bound(from, metrics);
            } else if let Ok(bound) = bound_for(histogram, config) {
                metrics.set_bound(&bound);
            }
        }
        if metrics.bound_packs.is_some() && !self.known.iter().any(|(k, _)| *k == key) {
            self.known.push((key, metrics.clone()));
        }
    }
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
    let n = rows.len().min(configs.len());
    let mut cache = BoundCache::default();
    for i in compute_order(&configs[..n]) {
        cache.attach(histogram, &configs[i], &mut rows[i]);
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
    let time_head = optional_column(show_time, 10, "time");
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
        let time = optional_column(show_time, 10, &format_seconds(m.seconds));
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

/// A table's optional last column: `text` right-aligned in `width` after a
/// space, or nothing when the column is not `shown`.
pub fn optional_column(shown: bool, width: usize, text: &str) -> String {
    if shown {
        format!(" {text:>width$}")
    } else {
        String::new()
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

/// The lines above the table: the input, and the padding a padded batch of
/// what is packed would carry (after the overlong policy, from the first
/// row's figures: never negative), then what the policy did to the overlong
/// sequences, if any.
pub fn header(
    name: &str,
    histogram: &Histogram,
    max_seq_len: usize,
    rows: &[PackingMetrics],
) -> String {
    let mut out = String::new();
    let padding = match rows.first() {
        Some(m) if m.num_segments > 0 => {
            1.0 - m.real_tokens as f64 / (m.num_segments as f64 * max_seq_len as f64)
        }
        Some(_) => 0.0,
        None => histogram.padding_fraction(max_seq_len),
    };
    let _ = writeln!(
        out,
        "{name}: {} sequences, {} tokens, max_seq_len {max_seq_len}, {:.2}% padding when padded",
        histogram.num_sequences(),
        histogram.real_tokens(),
        100.0 * padding
    );
    if let Some(m) = rows.first() {
        let count = |n: u64, unit: &str| format!("{n} {unit}{}", if n == 1 { "" } else { "s" });
        let (sequences, tokens) = (|n| count(n, "sequence"), count(m.dropped_tokens, "token"));
        let what = if m.truncated_sequences > 0 {
            let n = sequences(m.truncated_sequences);
            format!("{n} truncated to {max_seq_len} tokens, {tokens} dropped")
        } else if m.dropped_sequences > 0 {
            format!(
                "{} dropped, {tokens} with them",
                sequences(m.dropped_sequences)
            )
        } else if m.split_sequences > 0 {
            let (n, k) = (sequences(m.split_sequences), m.num_segments);
            format!("{n} split into pieces of at most {max_seq_len} tokens ({k} segments packed), no token dropped")
        } else {
            String::new()
        };
        if !what.is_empty() {
            let _ = writeln!(out, "overlong: {what}");
        }
    }
    out
}

/// The limit of a row in words: `at most 3 sequences per pack`.
fn limit_words(limit: Option<usize>) -> String {
    match limit {
        Some(1) => "one sequence per pack".to_string(),
        Some(k) => format!("at most {k} sequences per pack"),
        None => "any number of sequences per pack".to_string(),
    }
}

/// Which row to pick, in a few lines: for each limit in the table (in the
/// order the table lists them) the most efficient plan and its distance from
/// the bound at that limit, then the best plan overall and whether a deeper
/// limit's bound leaves room. Ties go to the row listed first.
pub fn recommendation(rows: &[PackingMetrics]) -> String {
    let Some(baseline) = rows.iter().find(|m| m.algorithm == "none") else {
        return String::new();
    };
    let mut out = format!(
        "Padding wastes {:.2}% of the compute; packing can win at most {:.4}x.\n",
        100.0 * (1.0 - baseline.efficiency),
        baseline.speedup_limit
    );
    let better = |a: &PackingMetrics, b: &PackingMetrics| {
        b.num_packs < a.num_packs || (b.num_packs == a.num_packs && b.efficiency > a.efficiency)
    };
    let mut limits: Vec<Option<usize>> = Vec::new();
    for m in rows.iter().filter(|m| m.algorithm != "none") {
        if !limits.contains(&m.max_sequences_per_pack) {
            limits.push(m.max_sequences_per_pack);
        }
    }
    let mut overall: Option<&PackingMetrics> = None;
    for &limit in &limits {
        let group: Vec<&PackingMetrics> = rows
            .iter()
            .filter(|m| m.algorithm != "none" && m.max_sequences_per_pack == limit)
            .collect();
        let best = group
            .iter()
            .copied()
            .fold(None::<&PackingMetrics>, |acc, m| match acc {
                Some(a) if !better(a, m) => Some(a),
                _ => Some(m),
            })
            .expect("the group has a row");
        if overall.is_none_or(|o| better(o, best)) {
            overall = Some(best);
        }
        let paper = if limit == Some(3) {
            " (the paper's choice)"
        } else {
            ""
        };
        let mut line = format!(
            "With {}{paper}: best {} ({}), {:.3}% efficiency, {:.4}x fewer rows than padding, in {}",
            limit_words(limit),
            best.algorithm,
            best.setting,
            100.0 * best.efficiency,
            best.speedup,
            format_seconds(best.seconds)
        );
        match (best.bound_packs, best.bound_efficiency, best.gap_packs) {
            (Some(packs), Some(e), Some(gap)) => {
                let what = match (best.bound_depth, best.lp_value) {
                    (Some(_), Some(v)) => format!("the LP optimum {v:.2} rounded up"),
                    (Some(_), None) => "the LP bound".to_string(),
                    (None, _) => "tokens / max_seq_len, the LP too large to price".to_string(),
                };
                let _ = write!(
                    line,
                    "; {gap} pack{} over the bound of {packs} packs ({what}: at most {:.3}%)",
                    if gap == 1 { "" } else { "s" },
                    100.0 * e
                );
            }
            _ => line.push_str("; no bound computed"),
        }
        let _ = writeln!(out, "{line}.");
    }
    if let (Some(best), true) = (overall, limits.len() > 1) {
        let room = rows
            .iter()
            .filter_map(|m| m.bound_efficiency.map(|e| (e, m)))
            .filter(|(e, _)| *e > best.efficiency + 5e-6)
            .fold(None::<(f64, &PackingMetrics)>, |acc, x| match acc {
                Some(a) if a.0 >= x.0 => Some(a),
                _ => Some(x),
            });
        let tail = match room {
            Some((e, m)) => format!(
                "; no plan with {} can beat {:.3}%",
                limit_words(m.max_sequences_per_pack),
                100.0 * e
            ),
            None => "; no bound in the table allows more".to_string(),
        };
        let _ = writeln!(
            out,
            "Best overall: {} ({}), {:.3}% efficiency{tail}.",
            best.algorithm,
            best.setting,
            100.0 * best.efficiency
        );
    }
    out
}
