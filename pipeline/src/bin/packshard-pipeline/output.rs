//! What rank 0 prints: the equivalence check's table, the balance report
//! and its plot.

use super::*;

pub(super) fn print_check(
    config: &ModelConfig,
    full: &Full,
    mbs: &[packshard_pipeline::model::Microbatch],
    outcomes: &[Outcome],
    p: usize,
) -> bool {
    let reference = match full.reference(config, mbs) {
        Ok(r) => r,
        Err(e) => {
            println!("reference failed: {e}");
            return false;
        }
    };
    println!(
        "equivalence with the single-process reference, p = {p} (loss and every gradient; tolerance {PIPELINE_TOLERANCE:.1e} x each tensor's largest value):"
    );
    println!(
        "  {:<22} {:>20} {:>9} {:>8} {:>10} {:>10}  {:<40} result",
        "placement", "loss", "|dloss|", "tensors", "values", "max rel", "worst tensor"
    );
    let mut all_ok = true;
    for o in outcomes {
        let mut errs = o.grads.compare(&reference.grads);
        errs.push(compare_loss(reference.loss, o.loss));
        // The same values with more barriers is the algorithm lost.
        let barriers_ok = o.barriers.iter().all(|&b| b == o.barriers_expected);
        let ok = errs.iter().all(|e| e.passes()) && barriers_ok;
        all_ok &= ok;
        let worst = errs
            .iter()
            .max_by(|a, b| a.relative().total_cmp(&b.relative()))
            .expect("tensors");
        let values: usize = errs.iter().map(|e| e.values).sum();
        println!(
            "  {:<22} {:>20.15} {:>9.1e} {:>8} {:>10} {:>10.1e}  {:<40} {}",
            o.placement.name(),
            o.loss,
            (o.loss - reference.loss).abs(),
            errs.len(),
            values,
            worst.relative(),
            if worst.max_abs == 0.0 {
                "(all bit-identical)"
            } else {
                worst.name.as_str()
            },
            if ok { "PASS" } else { "FAIL" }
        );
        if !barriers_ok {
            println!(
                "    barriers: the ranks took part in {:?}; {} takes {} in an iteration of {} microbatches (expected_barriers)",
                o.barriers,
                o.placement.name(),
                o.barriers_expected,
                mbs.len()
            );
        }
        if !ok {
            for e in errs.iter().filter(|e| !e.passes()) {
                println!(
                    "    {}: max |diff| {:e}, largest value {:e} (relative {:.1e} > {PIPELINE_TOLERANCE:.1e})",
                    e.name,
                    e.max_abs,
                    e.scale,
                    e.relative()
                );
            }
        }
    }
    println!(
        "reference loss {:.15} over {} microbatches; {}",
        reference.loss,
        mbs.len(),
        if all_ok { "PASS" } else { "FAIL" }
    );
    all_ok
}

/// The balance report as an SVG picture at `path`
/// ([`packshard_pipeline::plot::balance_svg`]).
pub(super) fn write_plot(
    path: &std::path::Path,
    title: &str,
    outcomes: &[Outcome],
    p: usize,
) -> Result<(), String> {
    let ranks: Vec<_> = outcomes
        .iter()
        .flat_map(|o| {
            (0..p).map(move |r| packshard_pipeline::plot::RankBalance {
                placement: o.placement.name(),
                rank: r,
                params_bytes: o.params_bytes[r],
                peak_bytes: o.peak_bytes[r],
                timing: o.timings[r],
            })
        })
        .collect();
    let svg = packshard_pipeline::plot::balance_svg(title, &ranks)?;
    std::fs::write(path, svg).map_err(|e| format!("{}: {e}", path.display()))
}

pub(super) fn print_report(outcomes: &[Outcome], p: usize) {
    println!("balance report, p = {p} (fastest of the iterations run; times in seconds):");
    println!(
        "  {:<22} {:>4} {:>10} {:>10} {:>10} {:>8} {:>8} {:>8} {:>9}",
        "placement",
        "rank",
        "params",
        "peak act",
        "param+act",
        "compute",
        "comm",
        "idle",
        "iteration"
    );
    for o in outcomes {
        let mut totals = Vec::new();
        for r in 0..p {
            let t = o.timings[r];
            let total = o.params_bytes[r] + o.peak_bytes[r];
            totals.push(total);
            println!(
                "  {:<22} {:>4} {:>10} {:>10} {:>10} {:>8.3} {:>8.3} {:>8.3} {:>9.3}",
                o.placement.name(),
                r,
                bytes(o.params_bytes[r]),
                bytes(o.peak_bytes[r]),
                bytes(total),
                t.compute,
                t.comm,
                t.idle,
                o.iteration
            );
        }
        let (lo, hi) = (
            *totals.iter().min().expect("ranks"),
            *totals.iter().max().expect("ranks"),
        );
        println!(
            "  {:<22} memory: largest rank {} = {:.1}% above the smallest ({}); iteration {:.3} s",
            o.placement.name(),
            bytes(hi),
            100.0 * (hi as f64 / lo.max(1) as f64 - 1.0),
            bytes(lo),
            o.iteration
        );
    }
    if let Some(base) = outcomes.iter().find(|o| o.placement == Placement::Baseline) {
        for o in outcomes
            .iter()
            .filter(|o| o.placement != Placement::Baseline)
        {
            println!(
                "  {} vs baseline: iteration {:.3} s vs {:.3} s ({:.2}x)",
                o.placement.name(),
                o.iteration,
                base.iteration,
                base.iteration / o.iteration
            );
        }
    }
}
