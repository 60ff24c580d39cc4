//! The two LPs column generation solves with the `microlp` simplex: the
//! restricted master (as its dual, for the prices) and the primal over the
//! final columns (for the pack counts).

use microlp::{ComparisonOp, OptimizationDirection, Problem, Variable};

use super::{Column, PRICING_TOL};

/// `a_j . y`: the price of `column` under the duals `y`.
pub(super) fn dot(column: &Column, y: &[f64]) -> f64 {
    column.iter().map(|&(r, t)| t as f64 * y[r]).sum()
}

/// The restricted master, solved as its dual: `max hs.y` such that
/// `a_j.y <= 1` for its columns, `y_i <= y_{i+1}` (rows ascending by length)
/// and `0 <= y <= 1`. Returns the duals and the objective.
pub(super) fn solve_master(hs: &[f64], columns: &[Column]) -> Option<(Vec<f64>, f64)> {
    let mut p = Problem::new(OptimizationDirection::Maximize);
    let y: Vec<Variable> = hs.iter().map(|&h| p.add_var(h, (0.0, 1.0))).collect();
    for column in columns {
        let terms: Vec<(Variable, f64)> = column.iter().map(|&(r, t)| (y[r], t as f64)).collect();
        p.add_constraint(&terms[..], ComparisonOp::Le, 1.0);
    }
    for w in y.windows(2) {
        p.add_constraint(&[(w[0], 1.0), (w[1], -1.0)][..], ComparisonOp::Le, 0.0);
    }
    let solution = p.solve().ok()?.into_solution().ok()?;
    let duals = y
        .iter()
        .map(|&v| solution.var_value(v).clamp(0.0, 1.0))
        .collect();
    Some((duals, solution.objective()))
}

/// The primal LP over `columns`, single-sequence packs and slot transfers
/// (`w_i` moves cover from row `i + 1` to the shorter row `i`): the pack
/// counts of `columns`, then of the single-sequence packs row by row.
///
/// With `duals` (optimal for the master of `columns`) only what complementary
/// slackness allows is offered: single-sequence packs of rows with dual 1,
/// transfers between rows of equal dual, and rows with a positive dual must
/// be met exactly; every feasible point is then optimal, and the simplex has
/// far fewer degenerate pivots to make. Without `duals`, the plain LP.
pub(super) fn solve_primal(
    h: &[u64],
    columns: &[Column],
    duals: Option<&[f64]>,
) -> Option<Vec<f64>> {
    let m = h.len();
    let tight = |a: f64, b: f64| (a - b).abs() <= PRICING_TOL;
    let single_ok = |i: usize| duals.is_none_or(|y| tight(y[i], 1.0));
    let transfer_ok = |i: usize| duals.is_none_or(|y| tight(y[i], y[i + 1]));
    let mut p = Problem::new(OptimizationDirection::Minimize);
    let x: Vec<Variable> = columns
        .iter()
        .map(|_| p.add_var(1.0, (0.0, f64::INFINITY)))
        .collect();
    let single: Vec<Option<Variable>> = (0..m)
        .map(|i| single_ok(i).then(|| p.add_var(1.0, (0.0, f64::INFINITY))))
        .collect();
    let mut rows: Vec<Vec<(Variable, f64)>> = (0..m)
        .map(|i| single[i].iter().map(|&v| (v, 1.0)).collect())
        .collect();
    for (j, column) in columns.iter().enumerate() {
        for &(r, t) in column {
            rows[r].push((x[j], t as f64));
        }
    }
    for i in (0..m.saturating_sub(1)).filter(|&i| transfer_ok(i)) {
        let w = p.add_var(0.0, (0.0, f64::INFINITY));
        rows[i].push((w, 1.0));
        rows[i + 1].push((w, -1.0));
    }
    for (i, row) in rows.iter().enumerate() {
        let exact = duals.is_some_and(|y| y[i] > PRICING_TOL);
        let op = if exact {
            ComparisonOp::Eq
        } else {
            ComparisonOp::Ge
        };
        p.add_constraint(&row[..], op, h[i] as f64);
    }
    let solution = p.solve().ok()?.into_solution().ok()?;
    let mut out: Vec<f64> = x.iter().map(|&v| solution.var_value(v).max(0.0)).collect();
    out.extend(
        single
            .iter()
            .map(|v| v.map_or(0.0, |v| solution.var_value(v).max(0.0))),
    );
    Some(out)
}
