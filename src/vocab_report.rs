//! `packshard vocab`: what each vocabulary-parallel algorithm costs and how
//! close it stays to the unsharded layer, for a chosen `v`, `h`, token count
//! and shard counts.
//!
//! One unsharded run of the output layer (`hidden @ weight^T`, cross-entropy,
//! forward and backward) is the reference; every (algorithm, shard count)
//! then runs on in-process ranks and is measured: barriers, collective
//! calls and elements per rank (as `packshard_reference::vocab::collective`
//! counts them), the peak bytes of f64 buffers one rank holds
//! (`packshard_reference::vocab::sharded::Meter`: the `[n, w_r]`
//! logits/gradient buffer, collective buffers, the `[n, h]` input-gradient
//! partials; not the inputs nor the parameter-sized weight gradient), and
//! the largest difference from the unsharded loss and gradients.

use std::fmt::Write as _;
use std::path::Path;
use std::time::Instant;

use ndarray::Array2;
use packshard_reference::vocab::sharded::sharded_linear_cross_entropy;
use packshard_reference::vocab::{
    linear_cross_entropy, LossCall, LossConfig, ShardLayout, ShardMap, ShardedAlgorithm,
};
use packshard_reference::Error;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use crate::report::{format_seconds, optional_column};

/// The MiniLM (all-MiniLM-L6-v2, BERT WordPiece) vocabulary size.
pub const MINILM_VOCAB: usize = 30522;
/// The MiniLM hidden size.
pub const MINILM_HIDDEN: usize = 384;
/// The word-embedding tensor of a BERT checkpoint.
pub const WORD_EMBEDDINGS: &str = "embeddings.word_embeddings.weight";

/// What to measure.
#[derive(Debug, Clone)]
pub struct VocabReportConfig {
    /// `[v, h]` output weight (tied word embeddings), or `None` for seeded
    /// random weights of `vocab_size x hidden`.
    pub weight: Option<Array2<f64>>,
    /// `v` for random weights.
    pub vocab_size: usize,
    /// `h` for random weights.
    pub hidden: usize,
    /// `n`.
    pub tokens: usize,
    /// The shard counts to run.
    pub shards: Vec<usize>,
    /// The algorithms to run.
    pub algorithms: Vec<ShardedAlgorithm>,
    /// How `v` is split when `p` does not divide it.
    pub layout: ShardLayout,
    /// Loss options.
    pub loss: LossConfig,
    /// Seed of the random weights, hidden states and targets.
    pub seed: u64,
}

impl Default for VocabReportConfig {
    fn default() -> Self {
        VocabReportConfig {
            weight: None,
            vocab_size: MINILM_VOCAB,
            hidden: MINILM_HIDDEN,
            tokens: 16,
            shards: vec![1, 2, 4, 8],
            algorithms: ShardedAlgorithm::ALL.to_vec(),
            layout: ShardLayout::Uneven,
            loss: LossConfig::default(),
            seed: 0,
        }
    }
}

/// The largest difference of one tensor from the unsharded one.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Diff {
    /// `max |actual - expected|`.
    pub max_abs: f64,
    /// `max_abs / max |expected|` (relative to the tensor's scale).
    pub rel: f64,
}

impl Diff {
    fn of<'a>(
        expected: impl IntoIterator<Item = &'a f64>,
        actual: impl IntoIterator<Item = &'a f64>,
    ) -> Diff {
        let mut max_abs = 0.0f64;
        let mut scale = 0.0f64;
        for (e, a) in expected.into_iter().zip(actual) {
            max_abs = max_abs.max((a - e).abs());
            scale = scale.max(e.abs());
        }
        Diff {
            max_abs,
            rel: if scale > 0.0 {
                max_abs / scale
            } else {
                max_abs
            },
        }
    }

    /// The difference in ulp (`rel / f64::EPSILON`).
    pub fn ulps(&self) -> f64 {
        self.rel / f64::EPSILON
    }
}

/// One measured (algorithm, shard count).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Row {
    /// `unsharded`, `naive`, `alg1` or `alg2`.
    pub algorithm: String,
    /// `p`.
    pub shards: usize,
    /// Synchronisation points per rank.
    pub barriers: u64,
    /// Collective calls per rank.
    pub calls: u64,
    /// f64 values each rank contributes to collectives.
    pub elements: u64,
    /// The largest per-rank peak of f64 buffers, in bytes.
    pub peak_bytes: usize,
    /// Loss difference from unsharded.
    pub loss: Diff,
    /// `∂L/∂hidden` difference.
    pub grad_hidden: Diff,
    /// `∂L/∂W` difference.
    pub grad_weight: Diff,
    /// Wall time of the run, in seconds (all ranks, on this machine's cores).
    pub seconds: f64,
}

/// The measured report.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    /// `v`.
    pub vocab_size: usize,
    /// `h`.
    pub hidden: usize,
    /// `n`.
    pub tokens: usize,
    /// Where the weights came from.
    pub weights: String,
    /// The layout.
    pub layout: &'static str,
    /// The unsharded loss.
    pub loss: f64,
    /// The unsharded run (first) and each sharded one.
    pub rows: Vec<Row>,
}

/// Seeded inputs: `hidden: [n, h]` uniform with standard deviation 1,
/// `weight: [v, h]` uniform with standard deviation `1 / sqrt(h)` (so logits
/// have standard deviation about 1, as a trained LM head's do), targets
/// uniform over `0..v`.
pub fn random_inputs(
    v: usize,
    h: usize,
    n: usize,
    seed: u64,
) -> (Array2<f64>, Array2<f64>, Vec<i64>) {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let a = 3f64.sqrt(); // uniform(-a, a) has standard deviation 1
    let hidden = Array2::from_shape_simple_fn((n, h), || rng.random_range(-a..a));
    let b = a / (h.max(1) as f64).sqrt();
    let weight = Array2::from_shape_simple_fn((v, h), || rng.random_range(-b..b));
    let targets = (0..n).map(|_| rng.random_range(0..v as i64)).collect();
    (hidden, weight, targets)
}

/// Tied-embedding inputs from a real `weight: [v, h]`: seeded token ids, the
/// hidden state of each token its own embedding row, the target the next id.
pub fn tied_inputs(weight: &Array2<f64>, n: usize, seed: u64) -> (Array2<f64>, Vec<i64>) {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let v = weight.nrows();
    let ids: Vec<usize> = (0..=n).map(|_| rng.random_range(0..v)).collect();
    let hidden = Array2::from_shape_fn((n, weight.ncols()), |(i, k)| weight[[ids[i], k]]);
    (hidden, ids[1..].iter().map(|&t| t as i64).collect())
}

/// Reads a 2-d f32 or f64 tensor `name` of a safetensors file as f64.
///
/// # Errors
/// A message naming the file and tensor when it cannot be read, is missing,
/// or is not a 2-d float tensor.
pub fn load_tensor(path: &Path, name: &str) -> Result<Array2<f64>, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let t = st
        .tensor(name)
        .map_err(|e| format!("{}: {name}: {e}", path.display()))?;
    let shape = t.shape().to_vec();
    if shape.len() != 2 {
        return Err(format!(
            "{}: {name} has shape {shape:?}, not [v, h]",
            path.display()
        ));
    }
    let data: Vec<f64> = match t.dtype() {
        safetensors::Dtype::F32 => t
            .data()
            .chunks_exact(4)
            .map(|b| f64::from(f32::from_le_bytes([b[0], b[1], b[2], b[3]])))
            .collect(),
        safetensors::Dtype::F64 => t
            .data()
            .chunks_exact(8)
            .map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes")))
            .collect(),
        other => {
            return Err(format!(
                "{}: {name} is {other:?}, not f32 or f64",
                path.display()
            ))
        }
    };
    Array2::from_shape_vec((shape[0], shape[1]), data)
        .map_err(|e| format!("{}: {name}: {e}", path.display()))
}

/// Runs the unsharded reference and every (algorithm, shard count).
///
/// # Errors
/// Bad sizes or shard counts (`p > v`), as the reference reports them.
pub fn measure(config: &VocabReportConfig) -> Result<Report, Error> {
    let (hidden, weight, targets, weights) = match &config.weight {
        Some(w) => {
            let (hidden, targets) = tied_inputs(w, config.tokens, config.seed);
            (
                hidden,
                w.clone(),
                targets,
                "given weights (tied: hidden = embedding of seeded ids, target = next id)"
                    .to_string(),
            )
        }
        None => {
            let (h, w, t) =
                random_inputs(config.vocab_size, config.hidden, config.tokens, config.seed);
            (
                h,
                w,
                t,
                format!("seeded random weights (seed {})", config.seed),
            )
        }
    };
    let (v, h) = weight.dim();
    let start = Instant::now();
    let u = linear_cross_entropy(
        hidden.view(),
        weight.view(),
        &LossCall::with_flag(&targets, &config.loss, true),
    )?;
    let unsharded_seconds = start.elapsed().as_secs_f64();
    let gh = u.grad_hidden.as_ref().expect("asked for gradients");
    let gw = u.grad_weight.as_ref().expect("asked for gradients");
    let n = config.tokens;
    let mut rows = vec![Row {
        algorithm: "unsharded".into(),
        shards: 1,
        barriers: 0,
        calls: 0,
        elements: 0,
        // logits / gradient [n, v], the input gradient [n, h], per-token vectors.
        peak_bytes: 8 * (n * v + n * h + n),
        loss: Diff::default(),
        grad_hidden: Diff::default(),
        grad_weight: Diff::default(),
        seconds: unsharded_seconds,
    }];
    for &p in &config.shards {
        let map = ShardMap::new(v, p, config.layout)?;
        for &algorithm in &config.algorithms {
            let start = Instant::now();
            let s = sharded_linear_cross_entropy(
                algorithm,
                &map,
                hidden.view(),
                weight.view(),
                &LossCall::with_flag(&targets, &config.loss, true),
            )?;
            let seconds = start.elapsed().as_secs_f64();
            let c = s.counts();
            let sgw = s.grad_weight().expect("asked for gradients");
            rows.push(Row {
                algorithm: algorithm.name().into(),
                shards: p,
                barriers: c.barriers,
                calls: c.calls,
                elements: c.elements,
                peak_bytes: s.peak_bytes(),
                loss: Diff::of([&u.ce.loss], [&s.loss()]),
                grad_hidden: Diff::of(
                    gh.iter(),
                    s.grad_hidden().expect("asked for gradients").iter(),
                ),
                grad_weight: Diff::of(gw.iter(), sgw.iter()),
                seconds,
            });
        }
    }
    Ok(Report {
        vocab_size: v,
        hidden: h,
        tokens: n,
        weights,
        layout: config.layout.name(),
        loss: u.ce.loss,
        rows,
    })
}

/// Bytes as `1.23 MB` (decimal units).
pub fn format_bytes(b: usize) -> String {
    let b = b as f64;
    if b >= 1e9 {
        format!("{:.2} GB", b / 1e9)
    } else if b >= 1e6 {
        format!("{:.2} MB", b / 1e6)
    } else if b >= 1e3 {
        format!("{:.1} kB", b / 1e3)
    } else {
        format!("{b} B")
    }
}

/// How the table shows differences.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Errors {
    /// Relative differences in scientific notation, and wall times.
    Measured,
    /// `<= 64 ulp` or the value, no times: stable across machines (snapshots).
    Thresholded,
}

fn show(d: Diff, errors: Errors) -> String {
    match errors {
        Errors::Measured => format!("{:.1e}", d.rel),
        Errors::Thresholded if d.rel <= 64.0 * f64::EPSILON => "<=64ulp".into(),
        Errors::Thresholded => format!("{:.1e}", d.rel),
    }
}

/// The report as an aligned table with a heading and a legend.
pub fn table(report: &Report, errors: Errors) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "vocab: v {}, h {}, {} tokens, {}; layout {}; f64 reference, forward + backward",
        report.vocab_size, report.hidden, report.tokens, report.weights, report.layout
    );
    let _ = writeln!(out, "unsharded loss {:.6}\n", report.loss);
    let measured = errors == Errors::Measured;
    let time_head = optional_column(measured, 9, "time");
    let _ = writeln!(
        out,
        "{:<9} {:>6} {:>8} {:>5} {:>9} {:>11} {:>9} {:>11} {:>11}{time_head}",
        "algorithm",
        "shards",
        "barriers",
        "calls",
        "elements",
        "peak/shard",
        "loss",
        "grad_hidden",
        "grad_weight"
    );
    for r in &report.rows {
        let time = optional_column(measured, 9, &format_seconds(r.seconds));
        let diff = |d: Diff| {
            if r.algorithm == "unsharded" {
                "-".to_string()
            } else {
                show(d, errors)
            }
        };
        let _ = writeln!(
            out,
            "{:<9} {:>6} {:>8} {:>5} {:>9} {:>11} {:>9} {:>11} {:>11}{time}",
            r.algorithm,
            r.shards,
            r.barriers,
            r.calls,
            r.elements,
            format_bytes(r.peak_bytes),
            diff(r.loss),
            diff(r.grad_hidden),
            diff(r.grad_weight),
        );
    }
    let _ = writeln!(
        out,
        "\nbarriers, calls, elements: per rank (a barrier is one synchronisation point; elements are the f64 values a rank contributes).\n\
         peak/shard: the most bytes of working f64 buffers one rank holds at once (logits/gradient [n, v/p], collective buffers, [n, h] partials; not inputs or the weight gradient).\n\
         loss, grad_hidden, grad_weight: largest difference from unsharded, relative to the tensor's largest element."
    );
    out
}
