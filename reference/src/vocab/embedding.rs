//! The input embedding, unsharded and vocabulary-parallel (Megatron-LM's
//! `VocabParallelEmbedding`; arXiv:2411.05288 §4.4, the input layer).
//!
//! Sharded forward: every rank looks up the ids it owns (a masked local
//! lookup; rows of other ranks' ids are 0) and one all-reduce sum gives every
//! rank the full `[n, h]` output (1 barrier). Backward: each rank scatters
//! the replicated output gradient into its own rows of `∂L/∂W` — no
//! communication. An id outside `0..v` is an error in both layers alike
//! (docs/FAULTS.md V5): never a silent zero row (no shard owns it) nor a read of
//! a padding row.

use ndarray::{Array2, ArrayView2, Axis, Slice};

use super::check_logits_size;
use super::collective::{run_ranks, Collective, CollectiveCounts};
use super::sharded::{Meter, ShardMap};
use crate::error::{check_finite, Error, Result};

/// Checks token ids against a vocabulary of `v` entries.
///
/// # Errors
/// [`Error::IndexOutOfRange`] (field `ids`) for the first id outside `0..v`.
pub fn check_ids(ids: &[i64], v: usize) -> Result<Vec<usize>> {
    ids.iter()
        .enumerate()
        .map(|(index, &id)| {
            if id < 0 || id >= v as i64 {
                Err(Error::IndexOutOfRange {
                    field: "ids".into(),
                    index,
                    value: id,
                    lo: 0,
                    hi: v as i64,
                })
            } else {
                Ok(id as usize)
            }
        })
        .collect()
}

fn check_weight(weight: ArrayView2<f64>, rows: usize, offset: usize) -> Result<()> {
    let h = weight.ncols();
    let real = weight.slice_axis(Axis(0), Slice::from(..rows.min(weight.nrows())));
    match check_finite("weight", real.iter()) {
        Err(Error::NonFiniteInput { index, value, .. }) => Err(Error::NonFiniteInput {
            field: "weight".into(),
            index: index + offset * h,
            value,
        }),
        other => other,
    }
}

/// `output[i] = weight[ids[i]]`: `ids: [n]`, `weight: [v, h]` → `[n, h]`.
///
/// # Errors
/// [`Error::IndexOutOfRange`] for an id outside `0..v`;
/// [`Error::NonFiniteInput`] for a non-finite weight; [`Error::InvalidArgument`]
/// when `n * h` is over [`super::MAX_LOGITS`].
pub fn embedding_forward(ids: &[i64], weight: ArrayView2<f64>) -> Result<Array2<f64>> {
    let (v, h) = weight.dim();
    let ids = check_ids(ids, v)?;
    check_weight(weight, v, 0)?;
    check_logits_size("ids", ids.len(), h)?;
    let mut out = Array2::zeros((ids.len(), h));
    for (i, &id) in ids.iter().enumerate() {
        out.row_mut(i).assign(&weight.row(id));
    }
    Ok(out)
}

/// `∂L/∂W[j] = Σ_{i: ids[i] = j} grad_output[i]`: `ids: [n]`, `grad_output:
/// [n, h]` → `[v, h]`.
///
/// # Errors
/// [`Error::IndexOutOfRange`] for an id outside `0..v`;
/// [`Error::ShapeMismatch`] for `grad_output` of another shape;
/// [`Error::NonFiniteInput`] for a non-finite gradient.
pub fn embedding_backward(
    ids: &[i64],
    grad_output: ArrayView2<f64>,
    v: usize,
) -> Result<Array2<f64>> {
    let ids = check_ids(ids, v)?;
    check_grad_output(grad_output, ids.len())?;
    let mut grad = Array2::zeros((v, grad_output.ncols()));
    for (i, &id) in ids.iter().enumerate() {
        grad.row_mut(id)
            .zip_mut_with(&grad_output.row(i), |g, &x| *g += x);
    }
    Ok(grad)
}

fn check_grad_output(grad_output: ArrayView2<f64>, n: usize) -> Result<()> {
    if grad_output.nrows() != n {
        return Err(Error::ShapeMismatch {
            field: "grad_output".into(),
            expected: format!("[n, h] with n = {n} (the number of ids)"),
            actual: grad_output.shape().to_vec(),
        });
    }
    check_finite("grad_output", grad_output.iter())
}

/// Checks `grad_output: [n, h]` against the lookup it is the gradient of:
/// `n` ids and a weight of width `h` (a gradient of another width would
/// give a `grad_weight` of that width, silently not the weight's shape).
///
/// # Errors
/// [`Error::ShapeMismatch`] naming `grad_output`; [`Error::NonFiniteInput`].
pub fn check_embedding_grad(grad_output: ArrayView2<f64>, n: usize, h: usize) -> Result<()> {
    // `[0, 0]` is `[0, h]` (JSON's `[]` has no width).
    if grad_output.nrows() != n || (n > 0 && grad_output.ncols() != h) {
        return Err(Error::ShapeMismatch {
            field: "grad_output".into(),
            expected: format!("[n, h] = [{n}, {h}] (the number of ids, the weight's width)"),
            actual: grad_output.shape().to_vec(),
        });
    }
    check_finite("grad_output", grad_output.iter())
}

/// One rank of the sharded embedding forward: `ids: [n]` (replicated, global
/// ids), this rank's rows `weight: [w_r, h]` (padding rows never read).
/// Returns the full `[n, h]` output on every rank.
///
/// # Errors
/// As [`embedding_forward`] (every rank checks every id, so all ranks fail
/// alike); [`Error::ShapeMismatch`] for a weight shard of the wrong height;
/// collective failures.
pub fn embedding_rank(
    comm: &dyn Collective,
    map: &ShardMap,
    ids: &[i64],
    weight: ArrayView2<f64>,
) -> Result<(Array2<f64>, CollectiveCounts, usize)> {
    let shard = map.shard(comm.rank());
    if weight.nrows() != shard.width {
        return Err(Error::ShapeMismatch {
            field: "weight".into(),
            expected: format!("[w_r, h] with w_r = {} (shard {})", shard.width, shard.rank),
            actual: weight.shape().to_vec(),
        });
    }
    let ids = check_ids(ids, map.vocab_size())?;
    check_weight(weight, shard.real, shard.start)?;
    let h = weight.ncols();
    check_logits_size("ids", ids.len(), h)?;
    let meter = Meter::default();
    meter.hold(ids.len() * h);
    // Masked local lookup: rows of ids this shard does not own stay 0.
    let mut out = Array2::zeros((ids.len(), h));
    for (i, &id) in ids.iter().enumerate() {
        if id >= shard.start && id < shard.start + shard.real {
            out.row_mut(i).assign(&weight.row(id - shard.start));
        }
    }
    comm.all_reduce_sum(out.as_slice_mut().expect("fresh arrays are contiguous"))?;
    Ok((out, comm.counts(), meter.peak()))
}

/// One rank of the sharded embedding backward: this shard's rows of `∂L/∂W`
/// (`[w_r, h]`, padding rows 0) from the replicated `grad_output: [n, h]`.
///
/// # Errors
/// As [`embedding_backward`].
pub fn embedding_backward_rank(
    map: &ShardMap,
    rank: usize,
    ids: &[i64],
    grad_output: ArrayView2<f64>,
) -> Result<Array2<f64>> {
    let shard = map.shard(rank);
    let ids = check_ids(ids, map.vocab_size())?;
    check_grad_output(grad_output, ids.len())?;
    let mut grad = Array2::zeros((shard.width, grad_output.ncols()));
    for (i, &id) in ids.iter().enumerate() {
        if id >= shard.start && id < shard.start + shard.real {
            grad.row_mut(id - shard.start)
                .zip_mut_with(&grad_output.row(i), |g, &x| *g += x);
        }
    }
    Ok(grad)
}

/// The result of a sharded embedding run.
#[derive(Debug, Clone, PartialEq)]
pub struct ShardedEmbedding {
    /// The split.
    pub map: ShardMap,
    /// `[n, h]` on each rank (bitwise identical).
    pub outputs: Vec<Array2<f64>>,
    /// `[w_r, h]` per rank, when a `grad_output` was given.
    pub grad_weights: Option<Vec<Array2<f64>>>,
    /// The collectives of each rank.
    pub counts: Vec<CollectiveCounts>,
    /// The peak bytes of each rank (forward).
    pub peak_bytes: Vec<usize>,
}

impl ShardedEmbedding {
    /// `[v, h]`: the shards' weight gradients stacked (real rows).
    pub fn grad_weight(&self) -> Option<Array2<f64>> {
        self.grad_weights
            .as_ref()
            .map(|parts| self.map.gather_rows(parts))
    }
}

/// Runs the sharded embedding on `p` in-process ranks: `ids: [n]`, `weight:
/// [w, h]` (`w >= v`; rows `v..` padding), and with `grad_output: [n, h]` the
/// backward.
///
/// # Errors
/// As [`embedding_forward`] / [`embedding_backward`]; [`Error::ShapeMismatch`]
/// for `w < v`.
pub fn sharded_embedding(
    map: &ShardMap,
    ids: &[i64],
    weight: ArrayView2<f64>,
    grad_output: Option<ArrayView2<f64>>,
) -> Result<ShardedEmbedding> {
    let v = map.vocab_size();
    if weight.nrows() < v {
        return Err(Error::ShapeMismatch {
            field: "weight".into(),
            expected: format!("[v, h] with at least v = {v} rows"),
            actual: weight.shape().to_vec(),
        });
    }
    check_ids(ids, v)?;
    check_weight(weight, v, 0)?;
    check_logits_size("ids", ids.len(), weight.ncols())?;
    if let Some(g) = grad_output {
        check_embedding_grad(g, ids.len(), weight.ncols())?;
    }
    let parts = map.split_rows(weight, "weight")?;
    let ranks = run_ranks(map.num_shards(), |comm| {
        let (out, counts, peak) = embedding_rank(comm, map, ids, parts[comm.rank()].view())?;
        let grad = grad_output
            .map(|g| embedding_backward_rank(map, comm.rank(), ids, g))
            .transpose()?;
        Ok((out, grad, counts, peak))
    })?;
    let mut result = ShardedEmbedding {
        map: *map,
        outputs: Vec::new(),
        grad_weights: grad_output.map(|_| Vec::new()),
        counts: Vec::new(),
        peak_bytes: Vec::new(),
    };
    for r in ranks {
        let (out, grad, counts, peak) = r.output;
        result.outputs.push(out);
        if let (Some(all), Some(g)) = (result.grad_weights.as_mut(), grad) {
            all.push(g);
        }
        result.counts.push(counts);
        result.peak_bytes.push(peak);
    }
    Ok(result)
}
