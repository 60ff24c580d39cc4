//! The picture of `packshard pack --plot FILE.svg`: the length histogram, the
//! padding a padded batch would carry, and how full each algorithm's packs
//! are. SVG only (plotters' SVG backend: no system libraries, no fonts).

use packshard_reference::packing::{Histogram, PackingMetrics, Strategy};
use plotters::prelude::*;

/// Bars of the length histogram at most (lengths are grouped beyond this).
const MAX_BINS: usize = 512;

/// One packed row of the table: its figures and its strategies.
pub struct PlotRow<'a> {
    /// The row's metrics (algorithm, setting, efficiency).
    pub metrics: &'a PackingMetrics,
    /// Its strategies with repeat counts.
    pub strategies: &'a [Strategy],
}

/// The legend label of a row: `lphp depth 3: 99.884%`.
pub fn row_label(m: &PackingMetrics) -> String {
    format!(
        "{} {}: {:.3}%",
        m.algorithm,
        m.setting,
        100.0 * m.efficiency
    )
}

/// Draws the three panels as one SVG document (960 x 1080 pixels).
///
/// `histogram`: the input lengths (`counts[l]`, `l` in `0..`); lengths over
/// `max_seq_len` are drawn where they are and carry no padding.
///
/// # Errors
/// The drawing backend's error, as text.
pub fn packing_svg(
    name: &str,
    histogram: &Histogram,
    max_seq_len: usize,
    rows: &[PlotRow<'_>],
) -> Result<String, String> {
    let err = plot_error;
    let counts = histogram.counts();
    let longest = histogram.longest().max(max_seq_len).max(1);
    let width = (longest + 1).div_ceil(MAX_BINS);
    // (first length of the bin, sequences, real tokens, padding tokens)
    let bins: Vec<(usize, f64, f64, f64)> = (0..=longest)
        .step_by(width)
        .map(|start| {
            let end = (start + width).min(longest + 1);
            (start..end).fold((start, 0.0, 0.0, 0.0), |(s, n, t, p), l| {
                let c = counts.get(l).copied().unwrap_or(0) as f64;
                let pad = max_seq_len.saturating_sub(l) as f64;
                (s, n + c, t + c * l.min(max_seq_len) as f64, p + c * pad)
            })
        })
        .collect();
    let padding: f64 = bins.iter().map(|b| b.3).sum();
    let real: f64 = bins.iter().map(|b| b.2).sum();
    let x_max = (longest + 1) as f64;

    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (960, 1080)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let panels = root.split_evenly((3, 1));

        // 1. The length histogram.
        let y_max = bins.iter().map(|b| b.1).fold(1.0, f64::max) * 1.05;
        let y_desc = if width == 1 {
            "sequences"
        } else {
            "sequences per bin"
        };
        let mut chart = panel(
            &panels[0],
            &format!("{name}: sequence lengths"),
            (0.0..x_max, 0.0..y_max),
            ("length (tokens)", y_desc),
        )?;
        chart
            .draw_series(bins.iter().map(|&(s, n, _, _)| {
                Rectangle::new([(s as f64, 0.0), ((s + width) as f64, n)], BLUE.filled())
            }))
            .map_err(err)?
            .label("sequences")
            .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], BLUE.filled()));
        legend(&mut chart, SeriesLabelPosition::MiddleRight)?;

        // 2. Real and padding tokens of a padded batch, by length.
        let y_max = bins.iter().map(|b| b.2.max(b.3)).fold(1.0, f64::max) * 1.05;
        let share = if real + padding > 0.0 {
            100.0 * padding / (real + padding)
        } else {
            0.0
        };
        let mut chart = panel(
            &panels[1],
            &format!("padded to {max_seq_len}: {share:.2}% of the slots are padding"),
            (0.0..x_max, 0.0..y_max),
            ("length (tokens)", "tokens"),
        )?;
        let mid = |s: usize| s as f64 + width as f64 / 2.0;
        type Pick = fn(&(usize, f64, f64, f64)) -> f64;
        let (real, padding): (Pick, Pick) = (|b| b.2, |b| b.3);
        for (label, colour, tokens) in [
            ("real tokens", BLUE, real),
            ("padding tokens", RED, padding),
        ] {
            chart
                .draw_series(LineSeries::new(
                    bins.iter().map(|b| (mid(b.0), tokens(b))),
                    colour.stroke_width(2),
                ))
                .map_err(err)?
                .label(label)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 16, y)], colour.stroke_width(2))
                });
        }
        legend(&mut chart, SeriesLabelPosition::MiddleRight)?;

        // 3. Pack fill per algorithm: the share of packs at least x% full.
        let mut chart = panel(
            &panels[2],
            "pack fill per algorithm",
            (0.0..100.0, 0.0..1.02),
            (
                "fill (% of max_seq_len)",
                "share of packs at least this full",
            ),
        )?;
        for (i, row) in rows.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            let curve = fill_curve(row.strategies, max_seq_len);
            chart
                .draw_series(LineSeries::new(curve, color.stroke_width(2)))
                .map_err(err)?
                .label(row_label(row.metrics))
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2))
                });
        }
        legend(&mut chart, SeriesLabelPosition::LowerLeft)?;
        root.present().map_err(err)?;
    }
    Ok(svg)
}

/// A panel's chart of `x` by `y`, its caption and axis descriptions drawn.
type Panel<'a, 'b> = ChartContext<'a, SVGBackend<'b>, Cartesian2d<F64, F64>>;
/// A linear f64 axis.
type F64 = plotters::coord::types::RangedCoordf64;

fn plot_error(e: DrawingAreaErrorKind<std::io::Error>) -> String {
    format!("plot: {e}")
}

/// A panel of `area`: `caption`, the ranges `(x, y)`, the axes' `(x, y)` descriptions.
fn panel<'a, 'b>(
    area: &'a DrawingArea<SVGBackend<'b>, plotters::coord::Shift>,
    caption: &str,
    (x, y): (std::ops::Range<f64>, std::ops::Range<f64>),
    (x_desc, y_desc): (&str, &str),
) -> Result<Panel<'a, 'b>, String> {
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(72)
        .build_cartesian_2d(x, y)
        .map_err(plot_error)?;
    let mut mesh = chart.configure_mesh();
    mesh.x_desc(x_desc)
        .y_desc(y_desc)
        .draw()
        .map_err(plot_error)?;
    Ok(chart)
}

/// The legend of the series drawn on `chart`, at `position`.
fn legend<'a, 'b: 'a>(
    chart: &mut Panel<'a, 'b>,
    position: SeriesLabelPosition,
) -> Result<(), String> {
    chart
        .configure_series_labels()
        .position(position)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(plot_error)
}

/// `(x, share of packs at least x% full)` for x = 0, 1, ..., 100.
fn fill_curve(strategies: &[Strategy], max_seq_len: usize) -> Vec<(f64, f64)> {
    // Packs by whole percent of fill (rounded down).
    let mut at = [0u64; 101];
    for s in strategies {
        let pct = (100 * s.tokens() as u64 / max_seq_len.max(1) as u64).min(100) as usize;
        at[pct] += s.count;
    }
    let total: u64 = at.iter().sum();
    let mut above = total;
    (0..=100)
        .map(|x| {
            let share = if total > 0 {
                above as f64 / total as f64
            } else {
                0.0
            };
            above -= at[x];
            (x as f64, share)
        })
        .collect()
}
