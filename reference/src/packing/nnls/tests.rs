use super::cholesky::dot;
use super::pricing::Pricing;
use super::*;
use approx::assert_relative_eq;

#[allow(clippy::needless_range_loop)]
fn dense(a: &[&[f64]]) -> SparseColumns {
    let rows = a.len();
    let mut s = SparseColumns::new(rows);
    for j in 0..a[0].len() {
        s.push((0..rows).filter(|&i| a[i][j] != 0.0).map(|i| (i, a[i][j])));
    }
    s
}

#[test]
fn matches_the_textbook_examples() {
    // The same small problems scipy and the Fortran original are tested on.
    let a = dense(&[&[1.0, 0.0], &[1.0, 0.0], &[0.0, 1.0]]);
    let x = nnls(&a, &[2.0, 1.0, 1.0]).unwrap();
    assert_relative_eq!(x[0], 1.5, epsilon = 1e-12);
    assert_relative_eq!(x[1], 1.0, epsilon = 1e-12);

    let a = dense(&[
        &[1.0, 0.5, 0.0],
        &[1.0, 0.6, 0.0],
        &[0.9, 0.5, 0.1],
        &[0.0, 0.0, 1.0],
    ]);
    let x = nnls(&a, &[2.0, 1.0, 1.0, 0.5]).unwrap();
    // The expected values are given to 8 decimals (1.37279152): 1e-7 is their last printed digit.
    assert_relative_eq!(x[0], 1.37279152, epsilon = 1e-7);
    // An exact 0 of the active-set solution, up to f64 rounding of order-1 sums: 1e-12, a margin
    // chosen.
    assert_relative_eq!(x[1], 0.0, epsilon = 1e-12);
    assert_relative_eq!(x[2], 0.47173145, epsilon = 1e-7);
}

#[test]
fn clamps_at_zero_when_the_free_solution_is_negative() {
    // b = [1, 1] is met exactly at x = [1, 0].
    let a = dense(&[&[1.0, 1.0], &[1.0, 2.0]]);
    let x = nnls(&a, &[1.0, 1.0]).unwrap();
    assert_relative_eq!(x[0], 1.0, epsilon = 1e-12);
    assert_relative_eq!(x[1], 0.0, epsilon = 1e-12);
    let x = nnls(&a, &[3.0, 2.0]).unwrap();
    // Free optimum [4, -1] is infeasible; best with x1 = 0 is x0 = 2.5.
    assert_relative_eq!(x[0], 2.5, epsilon = 1e-12);
    assert_eq!(x[1], 0.0);
}

/// `R^T R` of the factor, dense.
fn product(c: &GrowingCholesky) -> Vec<Vec<f64>> {
    let n = c.stride;
    let entry = |i: usize, j: usize| if i <= j { c.r[i * n + j] } else { 0.0 };
    (0..c.k)
        .map(|i| {
            (0..c.k)
                .map(|j| (0..=i.min(j)).map(|p| entry(p, i) * entry(p, j)).sum())
                .collect()
        })
        .collect()
}

#[test]
fn removing_a_column_keeps_the_factor_of_the_remaining_gram_matrix() {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    for trial in 0..40 {
        let (m, k) = (12, 2 + trial % 9);
        let cols: Vec<Vec<f64>> = (0..k)
            .map(|_| (0..m).map(|_| rng.random_range(-1.0..1.0)).collect())
            .collect();
        let b: Vec<f64> = (0..m).map(|_| rng.random_range(-1.0..1.0)).collect();
        let mut chol = GrowingCholesky::new(k, MAX_PASSIVE);
        for j in 0..k {
            let cross: Vec<f64> = (0..j).map(|p| dot(&cols[p], &cols[j])).collect();
            let pushed = chol.push(&cross, dot(&cols[j], &cols[j]), dot(&cols[j], &b));
            assert_eq!(pushed, Push::Added, "trial {trial}: column {j}");
        }
        let mut kept: Vec<usize> = (0..k).collect();
        // Remove two columns at random positions, one after the other.
        for _ in 0..2.min(k - 1) {
            let i = rng.random_range(0..kept.len());
            chol.remove(i);
            kept.remove(i);
            let got = product(&chol);
            for (a, &p) in kept.iter().enumerate() {
                for (b, &q) in kept.iter().enumerate() {
                    let want = dot(&cols[p], &cols[q]);
                    assert!(
                        // Gram entries updated against recomputed, f64 sums of order-1 products:
                        // 1e-12 relative (floor 1), a margin chosen over a few ulps.
                        (got[a][b] - want).abs() <= 1e-12 * (1.0 + want.abs()),
                        "trial {trial}: entry ({a}, {b}) {} vs {want}",
                        got[a][b]
                    );
                }
            }
            // The solve after the removal: (A_P^T A_P) z = A_P^T b.
            let mut z = Vec::new();
            chol.solve(&mut z);
            for (a, &p) in kept.iter().enumerate() {
                let lhs: f64 = kept
                    .iter()
                    .zip(&z)
                    .map(|(&q, zq)| dot(&cols[p], &cols[q]) * zq)
                    .sum();
                let rhs = dot(&cols[p], &b);
                assert!(
                    // Normal equations of the solved subproblem: an f64 solve's residual, 1e-9
                    // relative (floor 1), a margin chosen, not derived.
                    (lhs - rhs).abs() <= 1e-9 * (1.0 + rhs.abs()),
                    "trial {trial}: row {a}: {lhs} vs {rhs}"
                );
            }
        }
    }
}

#[test]
fn random_packing_shaped_problems_meet_the_kkt_conditions() {
    // Columns of at most 3 small-integer entries, more columns than rows
    // (so columns leave the passive set), b >= 0 as in NNLSHP.
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
    for trial in 0..60 {
        let m = 4 + trial % 20;
        let n = 3 * m;
        let mut a = SparseColumns::new(m);
        for _ in 0..n {
            let mut rows = random_rows(&mut rng, m);
            rows.dedup();
            a.push(
                rows.into_iter()
                    .map(|r| (r, f64::from(rng.random_range(1..=3u8)))),
            );
        }
        let b: Vec<f64> = (0..m)
            .map(|_| f64::from(rng.random_range(0..50u8)))
            .collect();
        let x = nnls(&a, &b).unwrap();
        let mut r = b.clone();
        for (j, &xj) in x.iter().enumerate() {
            assert!(xj >= 0.0, "trial {trial}: x[{j}] = {xj}");
            for &(row, v) in a.col(j) {
                r[row] -= v * xj;
            }
        }
        // The KKT tolerance of the check: 1e-9 of the right-hand side's size (floor 1), a margin
        // chosen, not derived.
        let scale = 1e-9 * (1.0 + b.iter().sum::<f64>());
        for (j, &xj) in x.iter().enumerate() {
            let w = a.dot_dense(j, &r);
            // Stationarity: no improving direction on the zero set, and a
            // zero gradient where the coefficient is positive.
            assert!(
                w <= scale,
                "trial {trial}: gradient {w} > 0 at x[{j}] = {xj}"
            );
            if xj > 0.0 {
                assert!(
                    w.abs() <= scale,
                    "trial {trial}: gradient {w} at positive x[{j}]"
                );
            }
        }
    }
}

/// One to three random rows in `0..m`, sorted (repeats kept): a column's
/// rows in the NNLSHP-shaped test problems.
fn random_rows(rng: &mut impl rand::Rng, m: usize) -> Vec<usize> {
    let mut rows: Vec<usize> = (0..rng.random_range(1..=3))
        .map(|_| rng.random_range(0..m))
        .collect();
    rows.sort_unstable();
    rows
}

/// A random NNLSHP-shaped problem twice: as weighted multisets (the fast
/// pricing) and as plain sparse columns with the same values.
fn weighted_pair(rng: &mut impl rand::Rng, m: usize, n: usize) -> (SparseColumns, SparseColumns) {
    let weight: Vec<f64> = (0..m)
        .map(|r| {
            if r < 3 {
                0.09
            } else {
                rng.random_range(0.5..2.0)
            }
        })
        .collect();
    let mut fast = SparseColumns::weighted(weight.clone());
    let mut plain = SparseColumns::new(m);
    for _ in 0..n {
        let rows = random_rows(rng, m);
        fast.push_multiset(&rows);
        let mut entries: Vec<(usize, f64)> = Vec::new();
        for &r in &rows {
            match entries.last_mut() {
                Some((row, v)) if *row == r => *v += weight[r],
                _ => entries.push((r, weight[r])),
            }
        }
        plain.push(entries);
    }
    assert!(fast.multisets.is_some() && plain.multisets.is_none());
    (fast, plain)
}

/// `trials` problems from [`weighted_pair`] drawn from a ChaCha8 seeded with
/// `seed`, trial `t` with `m = m0 + t % spread` rows and `cols_per_row * m`
/// columns; `check(t, rng, m, fast, plain)` runs on each (and draws the rest
/// of the trial from the same `rng`).
fn each_weighted_pair(
    seed: u64,
    trials: usize,
    (m0, spread, cols_per_row): (usize, usize, usize),
    mut check: impl FnMut(usize, &mut rand_chacha::ChaCha8Rng, usize, SparseColumns, SparseColumns),
) {
    use rand::SeedableRng;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    for trial in 0..trials {
        let m = m0 + trial % spread;
        let (fast, plain) = weighted_pair(&mut rng, m, cols_per_row * m);
        check(trial, &mut rng, m, fast, plain);
    }
}

#[test]
fn multiset_pricing_picks_the_column_the_plain_pricing_picks() {
    use rand::Rng;
    each_weighted_pair(5, 50, (5, 30, 4), |trial, rng, m, fast, plain| {
        for j in 0..fast.cols() {
            assert_eq!(fast.col(j), plain.col(j), "trial {trial}: column {j}");
        }
        let mut r = vec![0.0; m.next_power_of_two()];
        for v in &mut r[..m] {
            *v = rng.random_range(-5.0..5.0);
        }
        let (mut pf, mut pp) = (Pricing::new(&fast), Pricing::new(&plain));
        assert!(matches!(pf, Pricing::Multisets { .. }));
        assert!(matches!(pp, Pricing::Padded { .. }));
        // Block the winners one after another: both forms follow the
        // same order until no column has a positive gradient.
        let mut order = Vec::new();
        while let Some(j) = pf.most_positive(&r, 1e-12) {
            assert_eq!(pp.most_positive(&r, 1e-12), Some(j), "trial {trial}");
            assert!(plain.dot_dense(j, &r) > 0.0);
            pf.set_blocked(j, true);
            pp.set_blocked(j, true);
            order.push(j);
        }
        // The threshold passed to most_positive: an entry below 1e-12 counts as 0 (rounding of
        // order-1 sums), a margin chosen.
        assert_eq!(pp.most_positive(&r, 1e-12), None, "trial {trial}");
        // Unblocked, the first winner wins again.
        if let Some(&j) = order.first() {
            for &k in &order {
                pf.set_blocked(k, false);
            }
            assert_eq!(pf.most_positive(&r, 1e-12), Some(j), "trial {trial}");
        }
    });
}

#[test]
fn multiset_and_plain_problems_reach_the_same_optimum() {
    use rand::Rng;
    each_weighted_pair(13, 40, (4, 25, 3), |trial, rng, m, fast, plain| {
        let b: Vec<f64> = (0..m)
            .map(|_| f64::from(rng.random_range(0..60u8)))
            .collect();
        let objective = |x: &[f64]| {
            let mut r = b.clone();
            for (j, &xj) in x.iter().enumerate() {
                for &(row, v) in plain.col(j) {
                    r[row] -= v * xj;
                }
            }
            r.iter().map(|v| v * v).sum::<f64>()
        };
        let (xf, xp) = (nnls(&fast, &b).unwrap(), nnls(&plain, &b).unwrap());
        assert!(xf.iter().all(|&v| v >= 0.0));
        let (of, op) = (objective(&xf), objective(&xp));
        assert!(
            // Two solvers' objectives: 1e-9 relative (floor 1), the solve's accuracy, a margin
            // chosen, not derived.
            (of - op).abs() <= 1e-9 * (1.0 + op),
            "trial {trial}: {of} vs {op}"
        );
    });
}

#[test]
fn a_passive_set_past_its_cap_is_a_typed_error() {
    // Identity columns and b = 1: the optimum uses every column, so the
    // passive set grows to the number of rows.
    let mut a = SparseColumns::new(10);
    for r in 0..10 {
        a.push_multiset(&[r]);
    }
    let b = vec![1.0; 10];
    let x = nnls_capped(&a, &b, 10).unwrap();
    assert!(x.iter().all(|&v| (v - 1.0).abs() < 1e-12), "{x:?}");
    let err = nnls_capped(&a, &b, 9).unwrap_err();
    assert_eq!(err.kind(), "invalid_argument");
    assert!(err.to_string().contains("max_seq_len"), "{err}");
}
