//! The SIMD row kernels: per-row statistics and gradients over tiles of the
//! logits, threaded over rows.

use super::*;

// ---- row kernels ----------------------------------------------------------------

/// The target distribution of one row restricted to some columns: `qo` on
/// every column, `qt` on `target` (a column index of the slice) if it is there.
#[derive(Debug, Clone, Copy)]
pub(super) struct RowQ {
    /// Whether the row counts (its target is not ignored).
    pub(super) active: bool,
    pub(super) target: Option<usize>,
    pub(super) qt: f64,
    pub(super) qo: f64,
}

impl RowQ {
    pub(super) fn at(&self, j: usize) -> f64 {
        if !self.active {
            0.0
        } else if Some(j) == self.target {
            self.qt
        } else {
            self.qo
        }
    }

    /// The same row restricted to columns `j0..j0 + width`.
    pub(super) fn tile(&self, j0: usize, width: usize) -> RowQ {
        RowQ {
            target: self
                .target
                .filter(|&t| t >= j0 && t < j0 + width)
                .map(|t| t - j0),
            ..*self
        }
    }
}

/// The [`SoftmaxStats`] of `z` (finite or `-inf`) under `q`, the sums in f32.
#[inline(always)]
pub(super) fn row_stats<S: Simd>(simd: S, z: &[f32], q: &RowQ) -> SoftmaxStats {
    let max = simd::max(simd, z);
    let (mut target, mut mass) = (0.0f64, 0.0f64);
    if q.active {
        let mut infinite = false;
        if q.qo > 0.0 && !z.is_empty() {
            mass += q.qo * z.len() as f64;
            if max == f32::NEG_INFINITY {
                // Every column is -inf: infinite, unless the only column is
                // the target, whose weight `qt` is judged below (Megatron's
                // smoothing at 1 gives it `qt = 0`).
                infinite = !(z.len() == 1 && q.target.is_some());
            } else {
                let (head, tail) = S::as_simd_f32s(z);
                let m = simd.splat_f32s(max);
                let mut acc = simd.splat_f32s(0.0);
                for &x in head {
                    acc = simd.add_f32s(acc, simd.sub_f32s(m, x));
                }
                if !tail.is_empty() {
                    acc = simd.add_f32s(acc, simd.sub_f32s(m, load_tail(simd, tail, max)));
                }
                let mut sum = simd.reduce_sum_f32s(acc) as f64;
                if sum == f64::INFINITY {
                    // A -inf column. If it is only the target's, its weight
                    // is `qt`, not `qo` (judged below): sum the others.
                    if let Some(t) = q.target.filter(|&t| z[t] == f32::NEG_INFINITY) {
                        sum = z
                            .iter()
                            .enumerate()
                            .filter(|&(j, _)| j != t)
                            .map(|(_, &x)| f64::from(max - x))
                            .sum();
                    }
                }
                infinite |= sum == f64::INFINITY;
                target += q.qo * sum;
            }
        }
        if let Some(t) = q.target {
            let extra = q.qt - q.qo;
            mass += extra;
            if z[t] == f32::NEG_INFINITY {
                infinite |= q.qt > 0.0;
            } else {
                target += extra * (max as f64 - z[t] as f64);
            }
        }
        if infinite {
            target = f64::INFINITY;
        }
    }
    if max == f32::NEG_INFINITY {
        return SoftmaxStats {
            max: f64::NEG_INFINITY,
            rest: -1.0,
            target,
            mass,
        };
    }
    let (head, tail) = S::as_simd_f32s(z);
    let m = simd.splat_f32s(max);
    let (zero, one) = (simd.splat_f32s(0.0), simd.splat_f32s(1.0));
    let (mut below, mut count) = (zero, zero);
    let mut step = |x: S::f32s| {
        let at_max = simd.equal_f32s(x, m);
        let e = simd::exp(simd, simd.sub_f32s(x, m));
        below = simd.add_f32s(below, simd.select_f32s(at_max, zero, e));
        count = simd.add_f32s(count, simd.select_f32s(at_max, one, zero));
    };
    for &x in head {
        step(x);
    }
    if !tail.is_empty() {
        step(load_tail(simd, tail, f32::NEG_INFINITY));
    }
    let count = simd.reduce_sum_f32s(count) as f64;
    let below = simd.reduce_sum_f32s(below) as f64;
    SoftmaxStats {
        max: max as f64,
        rest: (count - 1.0) + below,
        target,
        mass,
    }
}

/// The bulk of a gradient row, lane-wise: `exp(z - shift) coef + off`
/// ([`gradient_row`]; a [`simd::LaneFn`], not a closure, so it is compiled
/// with the dispatched target features).
struct RowGrad<S: Simd> {
    shift: S::f32s,
    coef: S::f32s,
    off: S::f32s,
}

impl<S: Simd> simd::LaneFn<S> for RowGrad<S> {
    #[inline(always)]
    fn apply(&self, simd: S, x: S::f32s) -> S::f32s {
        let p = simd::exp(simd, simd.sub_f32s(x, self.shift));
        simd.mul_add_f32s(p, self.coef, self.off)
    }
}

/// [`RowGrad`] times the softcap's `dy/dz = (1 - y / c)(1 + y / c)` (1 at
/// `-inf`), `inv = 1 / c`.
struct CappedRowGrad<S: Simd> {
    dy: RowGrad<S>,
    inv: S::f32s,
}

impl<S: Simd> simd::LaneFn<S> for CappedRowGrad<S> {
    #[inline(always)]
    fn apply(&self, simd: S, x: S::f32s) -> S::f32s {
        let one = simd.splat_f32s(1.0);
        let t = simd.mul_f32s(x, self.inv);
        let f = simd.mul_f32s(simd.sub_f32s(one, t), simd.add_f32s(one, t));
        let masked = simd.equal_f32s(x, simd.splat_f32s(f32::NEG_INFINITY));
        let f = simd.select_f32s(masked, one, f);
        simd.mul_f32s(self.dy.apply(simd, x), f)
    }
}

/// Overwrites `z` with `w * f(z_j, q_j)` where, for the bulk of the row,
/// `f = a * p - b * q + c * p` with `p = exp(z - m) / s` (vectorised), and
/// for the columns at the maximum `m` or holding the target, `exact(z, q)`
/// (the reference's formula in f64). `p = 0` at `-inf`. With a softcap
/// `cap`, `z` holds capped logits `y` and each entry is also multiplied by
/// `dy/dz = (1 - y / c)(1 + y / c)` (1 at `-inf`; docs/FAULTS.md O1).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) fn gradient_row<S: Simd>(
    simd: S,
    z: &mut [f32],
    q: &RowQ,
    w: f64,
    (m, s): (f64, f64),
    a: f64,
    b: f64,
    cap: Option<f64>,
    exact: impl Fn(f64, f64) -> f64,
) {
    if w == 0.0 || !q.active {
        z.fill(0.0);
        return;
    }
    let factor = |x: f32| softcap::chain(1.0, x as f64, cap);
    // The special columns first, from the logits.
    let mut special: Vec<(usize, f32)> = Vec::new();
    if m != f64::NEG_INFINITY {
        let m32 = m as f32;
        for (j, &x) in z.iter().enumerate() {
            if x == m32 {
                special.push((j, (w * exact(x as f64, q.at(j)) * factor(x)) as f32));
            }
        }
    }
    if let Some(t) = q.target {
        if !special.iter().any(|&(j, _)| j == t) {
            special.push((t, (w * exact(z[t] as f64, q.at(t)) * factor(z[t])) as f32));
        }
    }
    if m == f64::NEG_INFINITY || s == 0.0 {
        // No softmax mass here: p = 0, the gradient is -b q.
        let v = -w * b * q.qo;
        match cap {
            None => z.fill(v as f32),
            Some(_) => z.iter_mut().for_each(|x| *x = (v * factor(*x)) as f32),
        }
    } else {
        let dy = RowGrad {
            shift: simd.splat_f32s(m as f32),
            coef: simd.splat_f32s((w * a / s) as f32),
            off: simd.splat_f32s((-w * b * q.qo) as f32),
        };
        match cap {
            None => simd::map_in_place(simd, z, f32::NEG_INFINITY, &dy),
            Some(c) => {
                let capped = CappedRowGrad {
                    dy,
                    inv: simd.splat_f32s((1.0 / c) as f32),
                };
                simd::map_in_place(simd, z, f32::NEG_INFINITY, &capped);
            }
        }
    }
    for (j, v) in special {
        z[j] = v;
    }
}

/// `c * tanh(y / c)` in f32 over columns `j0..j0 + tile` of every row of
/// `buf: [n, width]` (`-inf` kept; nothing without a softcap): the logits
/// capped before anything reads them (docs/FAULTS.md O1).
pub(super) fn cap_tile(buf: &mut [f32], width: usize, j0: usize, tile: usize, cap: Option<f64>) {
    let Some(c) = cap else { return };
    let c = c as f32;
    for_rows(buf, width, j0, tile, |_, _, z| {
        for x in z.iter_mut().filter(|x| **x != f32::NEG_INFINITY) {
            *x = c * (*x / c).tanh();
        }
    });
}

/// `2 c lse`: the z-loss's share of a row's `p` term in the gradient, for
/// the coefficient `c = z_loss` and the row's (global) statistics `st`;
/// exactly 0 without z-loss (an infinite `lse` never meets `c = 0`).
#[inline(always)]
pub(crate) fn z_loss_factor(z_loss: f64, st: &SoftmaxStats) -> f64 {
    if z_loss == 0.0 {
        0.0
    } else {
        2.0 * z_loss * st.logsumexp()
    }
}

/// The unsharded gradient of a row with statistics `st`: `w ((p - q) + 2 c
/// lse p)` (the reference's [`SoftmaxStats::gradient`]).
#[inline(always)]
pub(super) fn unsharded_gradient_row<S: Simd>(
    simd: S,
    z: &mut [f32],
    q: &RowQ,
    w: f64,
    st: &SoftmaxStats,
    (z_loss, cap): (f64, Option<f64>),
) {
    let zl = z_loss_factor(z_loss, st);
    gradient_row(
        simd,
        z,
        q,
        w,
        (st.max, st.sum_exp()),
        1.0 + zl,
        1.0,
        cap,
        |x, qj| st.gradient(x, qj, z_loss),
    );
}

pub(super) struct RowsOp<'a, F> {
    pub(super) rows: &'a mut [f32],
    pub(super) width: usize,
    pub(super) first: usize,
    pub(super) f: &'a F,
}

impl<F: Fn(usize, &mut [f32]) + Sync> RowsOp<'_, F> {
    pub(super) fn run(self) {
        for (i, row) in self.rows.chunks_mut(self.width).enumerate() {
            (self.f)(self.first + i, row);
        }
    }
}

/// Applies `f(row index, row)` to the rows of `buf: [n, width]` (columns
/// `j0..j0 + tile` of each), in parallel chunks, each chunk in the
/// dispatched SIMD context of `kernel`.
pub(super) fn for_rows<K>(buf: &mut [f32], width: usize, j0: usize, tile: usize, kernel: K)
where
    K: Fn(pulp::Arch, usize, &mut [f32]) + Sync,
{
    const ROWS: usize = 16;
    if width == 0 {
        return;
    }
    let arch = simd::arch();
    buf.par_chunks_mut(ROWS * width)
        .enumerate()
        .for_each(|(c, chunk)| {
            let f = |i: usize, row: &mut [f32]| kernel(arch, i, &mut row[j0..j0 + tile]);
            RowsOp {
                rows: chunk,
                width,
                first: c * ROWS,
                f: &f,
            }
            .run();
        });
}

/// Row statistics of a tile under SIMD (dispatched).
pub(super) struct StatsOp<'a> {
    pub(super) z: &'a [f32],
    pub(super) q: RowQ,
}

impl WithSimd for StatsOp<'_> {
    type Output = SoftmaxStats;
    #[inline(always)]
    fn with_simd<S: Simd>(self, simd: S) -> SoftmaxStats {
        row_stats(simd, self.z, &self.q)
    }
}

pub(super) struct GradOp<'a> {
    pub(super) z: &'a mut [f32],
    pub(super) q: RowQ,
    pub(super) w: f64,
    pub(super) st: SoftmaxStats,
    /// `(z_loss, softcap)`.
    pub(super) options: (f64, Option<f64>),
}

impl WithSimd for GradOp<'_> {
    type Output = ();
    #[inline(always)]
    fn with_simd<S: Simd>(self, simd: S) {
        unsharded_gradient_row(simd, self.z, &self.q, self.w, &self.st, self.options);
    }
}

/// What every row needs: `q`, weights, the options.
pub(super) struct Rows<'a> {
    pub(super) q: Vec<RowQ>,
    pub(super) weights: Vec<f64>,
    pub(super) targets: Vec<Option<usize>>,
    pub(super) config: &'a LossConfig,
}

impl<'a> Rows<'a> {
    /// Targets checked against `v` (global ids), restricted to the columns
    /// `start..start + real` of a shard (`start = 0, real = v` unsharded).
    pub(super) fn new(call: &LossCall<'a>, v: usize, start: usize, real: usize) -> Result<Self> {
        let config = call.config;
        let parsed = config.targets(call.targets, v)?;
        let (qt, qo) = config.target_distribution(v);
        let weights = call.token_weights(&parsed);
        let q = parsed
            .iter()
            .map(|t| RowQ {
                active: t.is_some(),
                target: t
                    .filter(|&t| t >= start && t < start + real)
                    .map(|t| t - start),
                qt,
                qo,
            })
            .collect();
        Ok(Rows {
            q,
            weights,
            targets: parsed,
            config,
        })
    }

    /// Per-token losses and the loss from whole-row statistics.
    pub(super) fn losses(&self, stats: &[SoftmaxStats]) -> Result<(Array1<f64>, f64)> {
        for (i, st) in stats.iter().enumerate() {
            check_row(i, st, self.targets[i])?;
        }
        let per_token: Array1<f64> = stats
            .iter()
            .zip(&self.targets)
            .map(|(st, &t)| token_loss(st, t, self.config))
            .collect();
        let loss = self
            .config
            .reduce(per_token.as_slice().expect("contiguous"), &self.targets);
        Ok((per_token, loss))
    }

    pub(super) fn num_tokens(&self) -> usize {
        self.targets.iter().filter(|t| t.is_some()).count()
    }
}

/// Statistics of the columns `j0..j0 + tile` of every row of `buf: [rows, width]`,
/// merged into `stats` (rows `i0..`).
pub(super) fn merge_tile_stats(
    buf: &[f32],
    width: usize,
    j0: usize,
    tile: usize,
    rows: &Rows,
    i0: usize,
    stats: &mut [SoftmaxStats],
) {
    merge_stats_at(buf, width, (j0, j0, tile), rows, i0, stats);
}

/// As [`merge_tile_stats`] for a buffer that holds only a tile: the buffer
/// columns `at..at + tile` of every row of `buf: [rows, width]` are the
/// vocabulary columns `col..col + tile`.
pub(super) fn merge_stats_at(
    buf: &[f32],
    width: usize,
    (at, col, tile): (usize, usize, usize),
    rows: &Rows,
    i0: usize,
    stats: &mut [SoftmaxStats],
) {
    let arch = simd::arch();
    stats.par_iter_mut().enumerate().for_each(|(r, st)| {
        let z = &buf[r * width + at..r * width + at + tile];
        let q = rows.q[i0 + r].tile(col, tile);
        let t = arch.dispatch(StatsOp { z, q });
        *st = st.merge(t);
    });
}

/// The unsharded gradient of the columns `j0..j0 + tile` of every row of
/// `buf` (rows `i0..`), in place.
pub(super) fn gradient_tile(
    buf: &mut [f32],
    width: usize,
    j0: usize,
    tile: usize,
    rows: &Rows,
    i0: usize,
    stats: &[SoftmaxStats],
) {
    gradient_at(buf, width, (j0, j0, tile), rows, i0, stats);
}

/// As [`gradient_tile`] for a buffer that holds only a tile (see
/// [`merge_stats_at`]).
pub(super) fn gradient_at(
    buf: &mut [f32],
    width: usize,
    (at, col, tile): (usize, usize, usize),
    rows: &Rows,
    i0: usize,
    stats: &[SoftmaxStats],
) {
    let options = (rows.config.z_loss, rows.config.softcap);
    for_rows(buf, width, at, tile, |arch, r, z| {
        let i = i0 + r;
        arch.dispatch(GradOp {
            z,
            q: rows.q[i].tile(col, tile),
            w: rows.weights[i],
            st: stats[r],
            options,
        })
    });
}

#[cfg(test)]
mod tests {
    use ndarray::{array, Array2};
    use packshard_reference::vocab::cross_entropy::cross_entropy as reference;
    use packshard_reference::vocab::{LossCall, LossConfig, SmoothingConvention};
    use packshard_reference::Result;

    use crate::vocab::cross_entropy;

    /// One row with a `-inf` logit at column 1 and its finite columns.
    const FINITE: [f64; 3] = [0.5, -1.0, 2.0];

    fn row() -> Array2<f32> {
        array![[0.5f32, f32::NEG_INFINITY, -1.0, 2.0]]
    }

    /// The kernel's loss and the reference's on [`row`] with `targets`, `cfg`.
    fn losses(targets: &[i64], cfg: &LossConfig) -> (Result<f64>, Result<f64>) {
        let call = LossCall::with_flag(targets, cfg, false);
        let logits = row();
        (
            cross_entropy(logits.view(), &call).map(|c| c.loss),
            reference(logits.mapv(f64::from).view(), &call).map(|c| c.loss),
        )
    }

    /// `logsumexp` of the finite columns, by hand in f64.
    fn lse() -> f64 {
        FINITE.iter().map(|x| x.exp()).sum::<f64>().ln()
    }

    /// The reference within 1e-12 of `by_hand` (f64 throughout) and the
    /// kernel within 1e-5: its f32 logits and exponentials carry relative
    /// errors near 6e-8, about 1e-7 of a loss near 2, and a `-inf` the
    /// kernel mishandles answers `inf`, not a near miss.
    fn assert_both_near(targets: &[i64], cfg: &LossConfig, by_hand: f64) {
        let (ours, want) = losses(targets, cfg);
        let (ours, want) = (ours.unwrap(), want.unwrap());
        assert!((want - by_hand).abs() < 1e-12, "{want} {by_hand}");
        assert!((ours - by_hand).abs() < 1e-5, "{ours} {by_hand}");
    }

    /// Without smoothing (`qo = 0`) a `-inf` column off the target weighs
    /// nothing: the loss is `lse - z_t` over the finite columns (the reference's
    /// and by hand). `row_stats` sums `max - z_j` only for `qo > 0` (that
    /// `>` turned `>=`, or its `&&` turned `||`, summed the `-inf` column
    /// and answered `inf`).
    #[test]
    fn a_minus_inf_column_off_the_target_is_ignored_without_smoothing() {
        assert_both_near(&[0], &LossConfig::default(), lse() - FINITE[0]);
    }

    /// Megatron's smoothing at 1 puts weight `qt = 0` on the target and
    /// `1 / (v - 1)` on each other column, so a target logit of `-inf` leaves
    /// the loss finite: `sum_{j != t} (lse - z_j) / (v - 1)` over the finite
    /// columns. The row's sum of `max - z_j` is infinite here (the target's
    /// column), and only the re-sum without the target gives that value
    /// (`row_stats`' `sum == inf` branch; turned `!=` it answered `inf`).
    /// The value is the reference's and the formula's by hand; the control, a
    /// target of weight `qt > 0` (smoothing 0.5), is refused or infinite in
    /// both.
    #[test]
    fn a_minus_inf_target_of_weight_zero_leaves_the_loss_finite() {
        let at = |a: f64| LossConfig::default().with_smoothing(a, SmoothingConvention::Megatron);
        let by_hand = FINITE.iter().map(|x| lse() - x).sum::<f64>() / 3.0;
        assert_both_near(&[1], &at(1.0), by_hand);
        let (ours, want) = losses(&[1], &at(0.5));
        let finite = |r: &Result<f64>| matches!(r, Ok(l) if l.is_finite());
        assert!(!finite(&want), "reference: qt > 0 on a -inf target");
        assert!(!finite(&ours), "kernel: qt > 0 on a -inf target");
    }
}
