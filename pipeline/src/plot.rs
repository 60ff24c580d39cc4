//! The picture of the balance report (`packshard pipeline --plot FILE.svg`):
//! one bar per (placement, rank), memory on top (parameters and peak
//! activations, as the report's `params` and `peak act` columns) and time
//! below (compute, communication and idle, as its `compute`, `comm` and
//! `idle` columns). SVG only (plotters' SVG backend: no system libraries, no
//! font files).

use crate::report::RankTiming;
use plotters::prelude::*;

/// One rank of one placement: the figures of one line of the balance report.
#[derive(Debug, Clone, PartialEq)]
pub struct RankBalance {
    /// The placement's name (`baseline`, `vocab-parallel alg2`, ...).
    pub placement: String,
    /// The rank, `0..p`.
    pub rank: usize,
    /// Bytes of the rank's parameters.
    pub params_bytes: usize,
    /// Peak bytes of its activations over the iteration.
    pub peak_bytes: usize,
    /// Its time split, in seconds.
    pub timing: RankTiming,
}

/// The legend of the memory panel: the parts of each rank's bar.
pub const MEMORY_PARTS: [&str; 2] = ["parameters", "peak activations"];

/// The legend of the time panel.
pub const TIME_PARTS: [&str; 3] = ["compute", "communication", "idle"];

/// Draws the balance report as one SVG document (960 x 800 pixels): memory
/// per rank (MB, stacked parameters + peak activations) and time per rank
/// (seconds, stacked compute + communication + idle), bars grouped by
/// placement in the order given.
///
/// # Errors
/// The drawing backend's error as text, or `"no ranks to draw"` for an empty
/// `ranks`.
pub fn balance_svg(title: &str, ranks: &[RankBalance]) -> Result<String, String> {
    if ranks.is_empty() {
        return Err("no ranks to draw".into());
    }
    let err = |e: DrawingAreaErrorKind<std::io::Error>| format!("plot: {e}");
    let label = |i: usize| format!("{} r{}", ranks[i].placement, ranks[i].rank);
    let mb = |b: usize| b as f64 / 1e6;
    let memory: Vec<[f64; 2]> = ranks
        .iter()
        .map(|r| [mb(r.params_bytes), mb(r.peak_bytes)])
        .collect();
    let time: Vec<[f64; 3]> = ranks
        .iter()
        .map(|r| [r.timing.compute, r.timing.comm, r.timing.idle])
        .collect();

    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (960, 800)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let panels = root.split_evenly((2, 1));
        let [params, activations] = MEMORY_PARTS;
        let memory_parts = [(params, BLUE), (activations, CYAN)];
        let [compute, communication, idle] = TIME_PARTS;
        let time_parts = [(compute, GREEN), (communication, MAGENTA), (idle, RED)];
        stacked_bars(
            &panels[0],
            &format!("{title}: memory per rank"),
            "MB",
            &memory,
            &memory_parts,
            &label,
        )
        .map_err(err)?;
        stacked_bars(
            &panels[1],
            "time per rank (fastest iteration)",
            "seconds",
            &time,
            &time_parts,
            &label,
        )
        .map_err(err)?;
        root.present().map_err(err)?;
    }
    Ok(svg)
}

/// One panel of stacked bars: bar `i` stacks `values[i][k]` in the colour
/// and legend name of `parts[k]`.
fn stacked_bars<const K: usize>(
    area: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
    caption: &str,
    unit: &str,
    values: &[[f64; K]],
    parts: &[(&str, RGBColor); K],
    label: &dyn Fn(usize) -> String,
) -> Result<(), DrawingAreaErrorKind<std::io::Error>> {
    let n = values.len();
    let top = values
        .iter()
        .map(|v| v.iter().sum::<f64>())
        .fold(0.0, f64::max);
    let y_max = if top > 0.0 { top * 1.15 } else { 1.0 };
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(48)
        .y_label_area_size(72)
        .build_cartesian_2d((0..n).into_segmented(), 0.0..y_max)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(n)
        .x_label_formatter(&|v| match v {
            SegmentValue::CenterOf(i) | SegmentValue::Exact(i) if *i < n => label(*i),
            _ => String::new(),
        })
        .y_desc(unit)
        .draw()?;
    for (k, &(name, color)) in parts.iter().enumerate() {
        chart
            .draw_series(values.iter().enumerate().map(|(i, v)| {
                let below: f64 = v[..k].iter().sum();
                let mut bar = Rectangle::new(
                    [
                        (SegmentValue::Exact(i), below),
                        (SegmentValue::Exact(i + 1), below + v[k]),
                    ],
                    color.filled(),
                );
                bar.set_margin(0, 0, 6, 6);
                bar
            }))?
            .label(name)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled()));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rank(placement: &str, rank: usize, params: usize, compute: f64) -> RankBalance {
        RankBalance {
            placement: placement.into(),
            rank,
            params_bytes: params,
            peak_bytes: 1_000_000,
            timing: RankTiming {
                compute,
                comm: 0.25,
                idle: 0.5,
            },
        }
    }

    #[test]
    fn every_rank_and_part_is_drawn() {
        let ranks = [
            rank("baseline", 0, 9_000_000, 2.0),
            rank("baseline", 1, 2_000_000, 1.0),
            rank("vocab-parallel alg2", 0, 5_000_000, 1.5),
            rank("vocab-parallel alg2", 1, 5_000_000, 1.5),
        ];
        let svg = balance_svg("tiny", &ranks).unwrap();
        for needle in [
            "tiny: memory per rank",
            "time per rank (fastest iteration)",
            "baseline r0",
            "baseline r1",
            "vocab-parallel alg2 r1",
        ]
        .into_iter()
        .chain(MEMORY_PARTS)
        .chain(TIME_PARTS)
        {
            // plotters writes each text on its own line inside <text>.
            assert!(
                svg.lines().any(|l| l.trim() == needle),
                "missing {needle:?}"
            );
        }
        // 4 bars x (2 memory + 3 time parts) + 5 legend marks + 2 backgrounds
        // at least; a part left undrawn would take 4 or more away.
        let rects = svg.matches("<rect").count();
        assert!(rects >= 4 * 5 + 5, "{rects} rectangles");
    }

    #[test]
    fn no_ranks_is_an_error_not_an_empty_picture() {
        assert_eq!(balance_svg("t", &[]).unwrap_err(), "no ranks to draw");
    }
}
