//! The equivalence check against the single-process reference and the
//! per-rank balance report (memory, compute, communication, idle time).

use crate::collective::{Event, EventClass};
use ndarray::ArrayViewD;

use crate::model::Params;

/// The tolerance of the pipeline against the single-process reference:
/// every gradient tensor (and the loss) must satisfy `max |actual -
/// expected| <= PIPELINE_TOLERANCE * max |expected|` over the tensor.
///
/// Where the number comes from: both sides run the same f64 operations on
/// the same microbatches; the only differences are summation orders — the
/// vocabulary-parallel softmax merges per-shard sums (a few ulp of each
/// row's terms, `packshard_equivalence::vocab::TERMS`), its `∂L/∂x` is a sum
/// over shards, and the embedding gradient is scattered per shard (exact).
/// Those few-ulp differences of `∂L/∂x_L` then flow back through `L`
/// LayerNorm'd layers, which keep their relative size (measured: at most 18
/// ulp on the tiny model at p = 1..=4). 256 ulp of the
/// tensor's largest value leaves room for that propagation and is still
/// 10^10 times tighter than the planted bug of the negative control (a
/// microbatch's output-layer gradient dropped, a change of order 1 / M of
/// the tensor). The baseline is exact: the same ops in the same order.
pub const PIPELINE_TOLERANCE: f64 = 256.0 * f64::EPSILON;

/// The difference of one tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorError {
    /// Its name.
    pub name: String,
    /// Values compared.
    pub values: usize,
    /// `max |actual - expected|`.
    pub max_abs: f64,
    /// `max |expected|`.
    pub scale: f64,
}

impl TensorError {
    /// `max_abs / scale` (0 for an all-zero tensor compared equal).
    pub fn relative(&self) -> f64 {
        if self.max_abs == 0.0 {
            0.0
        } else {
            self.max_abs / self.scale.max(f64::MIN_POSITIVE)
        }
    }

    /// Within [`PIPELINE_TOLERANCE`] (NaN never is).
    pub fn passes(&self) -> bool {
        self.max_abs.is_finite() && self.max_abs <= PIPELINE_TOLERANCE * self.scale
    }
}

/// Every tensor of `actual` against `expected`, in the order of
/// [`Params::named`].
///
/// A key bias's gradient is 0 in exact arithmetic (the softmax is invariant
/// to a shift of every score of a query, which is what the key bias adds);
/// what is computed on either side is round-off of terms as large as the
/// layer's other gradients, so it is judged against the largest gradient of
/// its layer (as `packshard_equivalence::compare::assert_close_with_scale`
/// does for the reference BERT).
pub fn compare(expected: &Params, actual: &Params) -> Vec<TensorError> {
    compare_named(&expected.named(), &actual.named())
}

/// Every tensor of `actual` against the tensor of `expected` at the same
/// place (named as `expected` names them; as [`compare`], which is this over
/// [`Params::named`]; the causal decoder's `DecoderParams::named`).
pub fn compare_named(
    expected: &[(String, ArrayViewD<'_, f64>)],
    actual: &[(String, ArrayViewD<'_, f64>)],
) -> Vec<TensorError> {
    let named = expected;
    let layer_scale = |name: &str| -> f64 {
        let prefix = name.rsplit_once(".attention.").map_or("", |(l, _)| l);
        named
            .iter()
            .filter(|(n, _)| !prefix.is_empty() && n.starts_with(&format!("{prefix}.")))
            .flat_map(|(_, t)| t.iter().map(|x| x.abs()))
            .fold(0.0, f64::max)
    };
    let mut errs: Vec<TensorError> = named
        .iter()
        .zip(actual)
        .map(|((name, e), (_, a))| {
            let name = name.clone();
            let mut max_abs: f64 = 0.0;
            let mut scale: f64 = 0.0;
            for (x, y) in e.iter().zip(a.iter()) {
                let d = (x - y).abs();
                max_abs = if d.is_nan() { f64::NAN } else { max_abs.max(d) };
                scale = scale.max(x.abs());
            }
            if name.ends_with("attention.self.key.bias") {
                scale = scale.max(layer_scale(&name));
            }
            if e.shape() != a.shape() {
                max_abs = f64::NAN;
            }
            TensorError {
                name,
                values: e.len(),
                max_abs,
                scale,
            }
        })
        .collect();
    if expected.len() != actual.len() {
        errs.push(TensorError {
            name: format!(
                "tensor count ({} expected, {} computed)",
                expected.len(),
                actual.len()
            ),
            values: 0,
            max_abs: f64::NAN,
            scale: 0.0,
        });
    }
    errs
}

/// The loss as a [`TensorError`] of one value.
pub fn compare_loss(expected: f64, actual: f64) -> TensorError {
    TensorError {
        name: "loss".into(),
        values: 1,
        max_abs: (expected - actual).abs(),
        scale: expected.abs(),
    }
}

/// One rank's time in an iteration, in seconds.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct RankTiming {
    /// In ops, outside communication calls.
    pub compute: f64,
    /// In communication calls after every participant had arrived (moving
    /// data).
    pub comm: f64,
    /// Waiting: in communication calls before the last participant arrived,
    /// and before the rank's first op / after its last until the slowest
    /// rank finished (the pipeline bubble).
    pub idle: f64,
}

/// Events of one rank as `[class, peer, start, end]` per event (for
/// gathering over MPI).
pub fn encode(events: &[Event]) -> Vec<f64> {
    events
        .iter()
        .flat_map(|e| {
            let (c, peer) = match e.class {
                EventClass::Op => (0.0, 0.0),
                EventClass::Collective => (1.0, 0.0),
                EventClass::P2p { peer } => (2.0, peer as f64),
            };
            [c, peer, e.start, e.end]
        })
        .collect()
}

/// A rank's events back from [`encode`]: `(class, peer, start, end)`.
pub fn decode(flat: &[f64]) -> Vec<(u8, usize, f64, f64)> {
    flat.chunks(4)
        .filter(|c| c.len() == 4)
        .map(|c| (c[0] as u8, c[1] as usize, c[2], c[3]))
        .collect()
}

/// Splits every rank's time into compute, communication and idle (see
/// [`RankTiming`]) from all ranks' events (decoded, one list per rank).
/// Returns the timings and the iteration time (first op start to last op
/// end over all ranks). Timestamps are compared across ranks: one node, one
/// clock.
// `colls[r][k]`: the k-th collective of every rank r, a two-index walk.
#[allow(clippy::needless_range_loop)]
pub fn analyse(ranks: &[Vec<(u8, usize, f64, f64)>]) -> (Vec<RankTiming>, f64) {
    let p = ranks.len();
    let ops = |r: usize| ranks[r].iter().filter(|e| e.0 == 0);
    let first = (0..p)
        .filter_map(|r| ops(r).map(|e| e.2).reduce(f64::min))
        .fold(f64::INFINITY, f64::min);
    let last = (0..p)
        .filter_map(|r| ops(r).map(|e| e.3).reduce(f64::max))
        .fold(f64::NEG_INFINITY, f64::max);
    let mut out = vec![RankTiming::default(); p];
    // Collectives: the k-th of every rank is the same one.
    let colls: Vec<Vec<(f64, f64)>> = (0..p)
        .map(|r| {
            ranks[r]
                .iter()
                .filter(|e| e.0 == 1)
                .map(|e| (e.2, e.3))
                .collect()
        })
        .collect();
    let k_max = colls.iter().map(Vec::len).min().unwrap_or(0);
    for k in 0..k_max {
        let arrived = (0..p).map(|r| colls[r][k].0).fold(f64::MIN, f64::max);
        for r in 0..p {
            let (s, e) = colls[r][k];
            out[r].idle += (arrived - s).max(0.0);
            out[r].comm += (e - arrived.max(s)).max(0.0);
        }
    }
    // Point to point: the i-th exchange of r with q is the i-th of q with r.
    for r in 0..p {
        for q in 0..p {
            if q == r {
                continue;
            }
            let mine: Vec<(f64, f64)> = ranks[r]
                .iter()
                .filter(|e| e.0 == 2 && e.1 == q)
                .map(|e| (e.2, e.3))
                .collect();
            let theirs: Vec<f64> = ranks[q]
                .iter()
                .filter(|e| e.0 == 2 && e.1 == r)
                .map(|e| e.2)
                .collect();
            for (i, (s, e)) in mine.into_iter().enumerate() {
                let arrived = theirs.get(i).copied().unwrap_or(s).max(s);
                out[r].idle += arrived - s;
                out[r].comm += (e - arrived).max(0.0);
            }
        }
    }
    for r in 0..p {
        let op_time: f64 = ops(r).map(|e| e.3 - e.2).sum();
        let comm_time: f64 = ranks[r]
            .iter()
            .filter(|e| e.0 != 0)
            .map(|e| e.3 - e.2)
            .sum();
        out[r].compute = (op_time - comm_time).max(0.0);
        let start = ops(r).map(|e| e.2).fold(f64::INFINITY, f64::min);
        let end = ops(r).map(|e| e.3).fold(f64::NEG_INFINITY, f64::max);
        if start.is_finite() && end.is_finite() {
            out[r].idle += (start - first) + (last - end);
        }
    }
    (out, (last - first).max(0.0))
}

/// Bytes in a readable unit (`12.3 MB`).
pub fn bytes(b: usize) -> String {
    let b = b as f64;
    if b >= 1e9 {
        format!("{:.2} GB", b / 1e9)
    } else if b >= 1e6 {
        format!("{:.1} MB", b / 1e6)
    } else if b >= 1e3 {
        format!("{:.1} kB", b / 1e3)
    } else {
        format!("{b:.0} B")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two ranks: rank 1 arrives at the collective 2 s after rank 0, which
    /// waits; then a message rank 0 sends while rank 1 is 1 s late.
    #[test]
    fn waits_are_idle_and_transfers_are_communication() {
        let r0 = vec![
            (0, 0, 0.0, 5.0),
            (1, 0, 1.0, 3.5),
            (0, 0, 5.0, 7.0),
            (2, 1, 5.0, 6.5),
        ];
        let r1 = vec![
            (0, 0, 0.0, 4.0),
            (1, 0, 3.0, 3.5),
            (0, 0, 4.0, 8.0),
            (2, 0, 6.0, 6.5),
        ];
        let (t, iteration) = analyse(&[r0, r1]);
        assert_eq!(iteration, 8.0);
        // Rank 0: waited 2 s at the collective and 1 s for the message, then
        // 1 s at the end; moved data 0.5 + 0.5 s; computed 7 - 4 = 3 s.
        assert_eq!(t[0].idle, 2.0 + 1.0 + 1.0);
        assert_eq!(t[0].comm, 1.0);
        assert_eq!(t[0].compute, 7.0 - 2.5 - 1.5);
        assert_eq!(t[1].idle, 0.0);
        assert_eq!(t[1].comm, 1.0);
        assert_eq!(t[1].compute, 8.0 - 1.0);
        for r in &t {
            assert!(r.compute + r.comm + r.idle <= iteration + 1e-12);
        }
    }

    #[test]
    fn compare_reports_the_largest_difference_against_the_scale() {
        let c = crate::model::ModelConfig {
            vocab: 5,
            hidden: 4,
            heads: 2,
            layers: 1,
            intermediate: 4,
            seq_len: 3,
            sequences: 1,
            microbatches: 1,
            seed: 1,
        };
        let a = Params::random(&c);
        let mut b = a.clone();
        b.output[[2, 1]] += 1e-3;
        let errs = compare(&a, &b);
        assert!(errs
            .iter()
            .filter(|e| e.name != "output.weight")
            .all(|e| e.max_abs == 0.0 && e.passes()));
        let out = errs.iter().find(|e| e.name == "output.weight").unwrap();
        assert!((out.max_abs - 1e-3).abs() < 1e-12 && !out.passes());
    }
}
