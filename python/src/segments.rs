//! Attention results judged segment by segment, as the Rust fuzz judges them
//! (`packshard_equivalence::fuzz::attention`, `compare_segments`): each
//! segment's rows of a result are held to the rule with that segment's own
//! terms and its own baseline error, so a short document packed beside a
//! long one is not judged by the long one's (larger) error. Judged as one
//! tensor, a kernel that sums a softmax denominator in f16, or rounds `P`
//! to bf16 before `P V`, passed every default case: the long segment of a
//! large case allowed the error its short ones showed (issue 30's blind
//! trial, `l_fp16` and `p_bf16`).
//!
//! Rows outside every segment (past `cu_seqlens_q[-1]`) are judged together
//! under the largest segment's terms, as the whole tensor was before.

use std::ops::Range;

use serde_json::Value;

use crate::core::{judge_tensor, KernelPrecision, Verdict};

/// Which axis of an attention result its segments split, and by which
/// offsets: `output: [n_q, h, d]`, `grad_q` by query rows, `lse: [h, n_q]`
/// by its columns, `grad_k`, `grad_v: [n_k, h_kv, d]` by key rows; `None`
/// for any other name.
fn layout(what: &str) -> Option<(usize, &'static str)> {
    match what {
        "output" | "grad_q" => Some((0, "q")),
        "lse" => Some((1, "q")),
        "grad_k" | "grad_v" => Some((0, "k")),
        _ => None,
    }
}

fn usizes(v: &Value) -> Option<Vec<usize>> {
    v.as_array()?
        .iter()
        .map(|x| x.as_u64().map(|x| x as usize))
        .collect()
}

fn floats(v: &Value) -> Option<Vec<f64>> {
    v.as_array()?.iter().map(Value::as_f64).collect()
}

/// The flat (row-major) indices of `rows` along `axis` of `shape`.
fn indices(shape: &[usize], axis: usize, rows: Range<usize>) -> Vec<usize> {
    let outer: usize = shape[..axis].iter().product();
    let inner: usize = shape[axis + 1..].iter().product();
    let n = shape[axis];
    let mut out = Vec::with_capacity(outer * rows.len() * inner);
    for o in 0..outer {
        for r in rows.clone() {
            let at = (o * n + r) * inner;
            out.extend(at..at + inner);
        }
    }
    out
}

/// Holds one result of a case to the rule ([`judge_tensor`]) with its
/// `terms` (the `terms` field of the reference's attention result, or
/// `None`): an attention result with per-segment terms is judged segment by
/// segment (see the module docs) and the verdict is the deciding segment's
/// (the failing one that used the largest share of its allowance, else the
/// passing one that did), its failure text naming the segment and the index
/// given in the whole tensor; any other result is judged whole, its floor
/// the terms under its name.
pub fn judge_result(
    what: &str,
    shape: &[usize],
    expected: &[f64],
    baseline: Option<&[f64]>,
    actual: &[f64],
    precision: KernelPrecision,
    terms: Option<&Value>,
) -> Verdict {
    let whole_scale = terms.and_then(|t| t.get(what)).and_then(Value::as_f64);
    let whole = || {
        judge_tensor(
            what,
            shape,
            expected,
            baseline,
            actual,
            precision,
            whole_scale,
        )
    };
    let Some((axis, side)) = layout(what) else {
        return whole();
    };
    let segments = terms.and_then(|t| t.get("segments"));
    let (Some(cu), Some(seg_terms)) = (
        segments.and_then(|s| s.get(side)).and_then(usizes),
        segments.and_then(|s| s.get(what)).and_then(floats),
    ) else {
        return whole();
    };
    let fits = shape.len() > axis
        && cu.len() == seg_terms.len() + 1
        && cu.windows(2).all(|w| w[0] <= w[1])
        && cu.last().is_some_and(|&end| end <= shape[axis])
        && expected.len() == actual.len()
        && expected.len() == shape.iter().product::<usize>();
    if !fits {
        return whole();
    }
    let n = shape[axis];
    let mut groups: Vec<(String, Range<usize>, Option<f64>)> = cu
        .windows(2)
        .zip(&seg_terms)
        .enumerate()
        .filter(|(_, (w, _))| w[1] > w[0])
        .map(|(s, (w, &t))| {
            let name = format!("segment {s}, rows {}..{}; index within it", w[0], w[1]);
            (name, w[0]..w[1], Some(t))
        })
        .collect();
    let (first, last) = (cu[0], *cu.last().expect("fits: at least one offset"));
    for rows in [0..first, last..n] {
        if !rows.is_empty() {
            let (a, b) = (rows.start, rows.end);
            let name = format!("rows {a}..{b} outside every segment; index within them");
            groups.push((name, rows, whole_scale));
        }
    }
    let mut decided: Option<Verdict> = None;
    let mut error = 0.0f64;
    for (name, rows, scale) in groups {
        let at = indices(shape, axis, rows.clone());
        let pick = |x: &[f64]| at.iter().map(|&i| x[i]).collect::<Vec<f64>>();
        let mut sub_shape = shape.to_vec();
        sub_shape[axis] = rows.len();
        let b = baseline.map(pick);
        let label = format!("{what} ({name})");
        let mut v = judge_tensor(
            &label,
            &sub_shape,
            &pick(expected),
            b.as_deref(),
            &pick(actual),
            precision,
            scale,
        );
        error = error.max(v.error);
        if let Some(i) = v.index.get_mut(axis) {
            *i += rows.start;
        }
        let better = match &decided {
            None => true,
            Some(d) => match (v.failure.is_some(), d.failure.is_some()) {
                (true, false) => true,
                (false, true) => false,
                _ => v.share > d.share,
            },
        };
        if better {
            decided = Some(v);
        }
    }
    match decided {
        // The tensor's largest error, the deciding segment's allowance.
        Some(v) => Verdict { error, ..v },
        // No row at all: the whole (empty) tensor's verdict.
        None => whole(),
    }
}

#[cfg(test)]
#[path = "segments_tests.rs"]
mod tests;
