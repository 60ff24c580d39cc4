//! The golden cases of the vocabulary ops: cross-entropy (unsharded and
//! every sharded algorithm and layout), the output layer and the embedding.

use super::*;
use packshard_reference::faults;
use packshard_reference::vocab::{GradRequest, LossCall};

/// Seeded values uniform in `[-r, r]`, every seventh x 8 (planted outliers).
fn seeded(n: usize, r: f64, seed: u64) -> Vec<f64> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n)
        .map(|i| {
            let x = r * (2.0 * rng.random::<f64>() - 1.0);
            if i % 7 == 5 {
                8.0 * x
            } else {
                x
            }
        })
        .collect()
}

/// A sharded run's settings, reported in `params` (expected outputs are the
/// unsharded reference's: sharded == unsharded).
struct Sharding {
    algorithm: ShardedAlgorithm,
    shards: usize,
    layout: ShardLayout,
}

/// A case's sharding: `algorithm` over `shards` shards in `layout`.
fn sharded(algorithm: ShardedAlgorithm, shards: usize, layout: ShardLayout) -> Option<Sharding> {
    Some(Sharding {
        algorithm,
        shards,
        layout,
    })
}

fn loss_params(
    config: &LossConfig,
    v: usize,
    w: usize,
    sharding: Option<&Sharding>,
) -> Map<String, Value> {
    let mut p = params(&[
        ("ignore_index", json!(config.ignore_index)),
        ("label_smoothing", json!(config.label_smoothing)),
        ("smoothing", json!(config.smoothing.name())),
        ("z_loss", json!(config.z_loss)),
        ("reduction", json!(config.reduction.name())),
    ]);
    if let Some(c) = config.softcap {
        p.insert("softcap".into(), json!(c));
    }
    if w > v {
        p.insert("vocab_size".into(), json!(v));
    }
    match sharding {
        Some(s) => {
            p.insert("num_shards".into(), json!(s.shards));
            p.insert("algorithm".into(), json!(s.algorithm.name()));
            p.insert("layout".into(), json!(s.layout.name()));
        }
        None => {
            p.insert("algorithm".into(), json!("unsharded"));
        }
    }
    p.insert("want_grad".into(), json!(true));
    p
}

/// Widens `[n, v]` to `[n, w]` with zero columns (the padding's gradient).
fn widen_columns(a: &Array2<f64>, w: usize) -> Vec<f64> {
    let (n, v) = a.dim();
    Array2::from_shape_fn((n, w), |(i, j)| if j < v { a[[i, j]] } else { 0.0 })
        .iter()
        .copied()
        .collect()
}

/// Widens `[v, h]` to `[w, h]` with zero rows.
fn widen_rows(a: &Array2<f64>, w: usize) -> Vec<f64> {
    let (v, h) = a.dim();
    Array2::from_shape_fn((w, h), |(j, k)| if j < v { a[[j, k]] } else { 0.0 })
        .iter()
        .copied()
        .collect()
}

#[allow(clippy::too_many_arguments)]
fn cross_entropy_case(
    name: &str,
    description: &str,
    logits: Array2<f64>,
    v: usize,
    targets: Vec<i64>,
    config: LossConfig,
    sharding: Option<Sharding>,
    grad_output: Option<Vec<f64>>,
    dtype: Dtype,
) -> Result<GoldenCase, GoldenError> {
    let logits = logits.mapv(|x| dtype.round(x));
    let grad_output =
        grad_output.map(|g| g.into_iter().map(|x| dtype.round(x)).collect::<Vec<f64>>());
    let (n, w) = logits.dim();
    if let Some(s) = &sharding {
        // The split must exist (p <= v) and cover the given columns.
        let map = ShardMap::new(v, s.shards, s.layout)?;
        debug_assert!(map.padded_vocab_size() <= w || s.layout == ShardLayout::Uneven);
    }
    let real = logits.slice_axis(Axis(1), Slice::from(..v));
    let grad = GradRequest::of(true, grad_output.as_deref());
    let call = LossCall::new(&targets, &config, grad);
    let ce = cross_entropy(real, &call)?;
    let terms = Terms::new(real, &call, &ce);
    let grad = ce.grad_logits.as_ref().expect("asked for");
    let low = (dtype != Dtype::F64).then(|| lowp::cross_entropy(real, &call, dtype));
    let lse: Vec<f64> = ce.logsumexp().to_vec();
    let what = "vocab::Terms";
    let l = |f: &dyn Fn(&lowp::CrossEntropy) -> Vec<f64>| low.as_ref().map(f).unwrap_or_default();
    let outputs = vec![
        float_output(
            "loss",
            &[],
            vec![ce.loss],
            dtype,
            terms.loss,
            what,
            &l(&|x| vec![x.loss]),
        ),
        float_output(
            "per_token_loss",
            &[n],
            ce.per_token_loss.to_vec(),
            dtype,
            max_abs(&terms.per_token_loss),
            what,
            &l(&|x| x.per_token_loss.clone()),
        ),
        float_output(
            "logsumexp",
            &[n],
            lse,
            dtype,
            max_abs(&terms.logsumexp),
            what,
            &l(&|x| x.logsumexp.clone()),
        ),
        float_output(
            "grad_logits",
            &[n, w],
            widen_columns(grad, w),
            dtype,
            max_abs(&flat(&terms.grad_logits)),
            what,
            &l(&|x| widen_columns(&x.grad_logits, w)),
        ),
    ];
    Ok(GoldenCase {
        name: name.into(),
        op: "cross_entropy",
        description: description.into(),
        params: loss_params(&config, v, w, sharding.as_ref()),
        inputs: [
            Tensor::float("logits", &[n, w], flat(&logits), dtype),
            Tensor::int("targets", &[n], targets),
        ]
        .into_iter()
        .chain(grad_output.map(|g| Tensor::float("grad_output", &[g.len()], g, dtype)))
        .collect(),
        outputs,
    })
}

pub(super) fn cross_entropy_cases(dtype: Dtype) -> Result<Vec<GoldenCase>, GoldenError> {
    let inf = f64::NEG_INFINITY;
    let grid = |n: usize, v: usize, seed: u64| {
        Array2::from_shape_vec((n, v), seeded(n * v, 4.0, seed)).expect("n x v")
    };
    // V2: 10 real columns padded to 12 for 3 shards; the padding holds NaN and 1e4.
    let mut v2 = grid(4, 12, 22);
    let v2_row = [2.0, 1.0, 0.5, 3.0, -1.0, 0.0, 1.5, 2.5, -0.5, 1.0];
    for (j, &x) in v2_row.iter().enumerate() {
        v2[[0, j]] = x;
    }
    for i in 0..4 {
        v2[[i, 10]] = f64::NAN;
        v2[[i, 11]] = 1e4;
    }
    // V6: the second shard of row 0 all -inf, scattered -inf elsewhere.
    let mut v6 = grid(4, 8, 23);
    for j in 4..8 {
        v6[[0, j]] = inf;
    }
    v6[[2, 1]] = inf;
    v6[[3, 6]] = inf;
    // V1's row first.
    let mut v1 = grid(4, 8, 24);
    for (j, &x) in [1.0, 2.0, 0.0, -1.0, 3.0, 0.5, 1.5, -2.0]
        .iter()
        .enumerate()
    {
        v1[[0, j]] = x;
    }
    // O1: the V1 row again, and rows of large logits the softcap bounds.
    let mut o1 = grid(4, 9, 27).mapv(|x| 4.0 * x);
    for (j, &x) in [1.0, 2.0, 0.0, -1.0, 3.0, 0.5, 1.5, -2.0]
        .iter()
        .enumerate()
    {
        o1[[0, j]] = x;
    }
    o1[[0, 8]] = f64::NAN; // padding: 8 real columns padded to 9
    o1[[1, 3]] = inf; // masked, on the ignored row (smoothing puts mass on every entry)
                      // O2: the V1 row twice (targets 4 and 1), then two of the grid.
    let mut o2 = grid(4, 8, 28);
    for (j, &x) in faults::V1_LOGITS.iter().enumerate() {
        o2[[0, j]] = x;
        o2[[1, j]] = x;
    }
    let mut basic = grid(6, 11, 21);
    basic[[4, 2]] = inf;
    Ok(vec![
        cross_entropy_case(
            "cross_entropy",
            "unsharded cross-entropy, mean over the non-ignored tokens, a masked (-inf) logit",
            basic,
            11,
            vec![3, -100, 10, 0, 7, -100],
            LossConfig::default(),
            None,
            None,
            dtype,
        )?,
        cross_entropy_case(
            "cross_entropy_smoothing_zloss",
            "PyTorch label smoothing 0.1, z-loss 1e-4, sum, ignore_index -1",
            grid(5, 13, 25),
            13,
            vec![12, -1, 0, 5, 6],
            LossConfig::default()
                .with_ignore_index(-1)
                .with_smoothing(0.1, SmoothingConvention::PyTorch)
                .with_z_loss(1e-4)
                .with_reduction(Reduction::Sum),
            None,
            None,
            dtype,
        )?,
        cross_entropy_case(
            "cross_entropy_megatron_none",
            "Megatron label smoothing 0.1, no reduction; row 0 is docs/FAULTS.md V1 (loss 0.90444)",
            v1,
            8,
            vec![4, 0, 7, 2],
            LossConfig::default()
                .with_smoothing(0.1, SmoothingConvention::Megatron)
                .with_reduction(Reduction::None),
            None,
            None,
            dtype,
        )?,
        cross_entropy_case(
            "cross_entropy_alg2_padded",
            "alg2 over 3 shards, vocabulary 10 padded to 12 whose padding holds NaN and 1e4; row 0 is docs/FAULTS.md V2 (loss 1.474030)",
            v2,
            10,
            vec![7, 2, -100, 9],
            LossConfig::default(),
            sharded(ShardedAlgorithm::Alg2, 3, ShardLayout::Padded),
            None,
            dtype,
        )?,
        cross_entropy_case(
            "cross_entropy_alg1_masked_shard",
            "alg1 over 2 shards; row 0's second shard is all -inf (docs/FAULTS.md V6)",
            v6,
            8,
            vec![1, 5, 0, 3],
            LossConfig::default(),
            sharded(ShardedAlgorithm::Alg1, 2, ShardLayout::Uneven),
            None,
            dtype,
        )?,
        cross_entropy_case(
            "cross_entropy_softcap_alg2",
            "alg2 over 3 padded shards, softcap 2 with PyTorch smoothing 0.1, z-loss 1e-3 and an ignored target; row 0 is docs/FAULTS.md O1's logits (loss 1.18683 without the smoothing)",
            o1,
            8,
            vec![4, -100, 7, 0],
            LossConfig::default()
                .with_softcap(2.0)
                .with_smoothing(0.1, SmoothingConvention::PyTorch)
                .with_z_loss(1e-3)
                .with_reduction(Reduction::None),
            sharded(ShardedAlgorithm::Alg2, 3, ShardLayout::Padded),
            None,
            dtype,
        )?,
        cross_entropy_case(
            "cross_entropy_naive_uneven",
            "naive over 8 shards of a prime vocabulary 37 (docs/FAULTS.md V4), targets on the first and last shard",
            grid(3, 37, 26),
            37,
            vec![0, 36, 18],
            LossConfig::default(),
            sharded(ShardedAlgorithm::Naive, 8, ShardLayout::Uneven),
            None,
            dtype,
        )?,
        cross_entropy_case(
            "cross_entropy_grad_output_alg1",
            "alg1 over 3 uneven shards, no reduction with a per-token grad_output [1, 0, 2, -0.5]; rows 0 and 1 are docs/FAULTS.md O2 (the second token's gradient is 0)",
            o2,
            8,
            vec![4, 1, -100, 6],
            LossConfig::default().with_reduction(Reduction::None),
            sharded(ShardedAlgorithm::Alg1, 3, ShardLayout::Uneven),
            Some(vec![1.0, 0.0, 2.0, -0.5]),
            dtype,
        )?,
    ])
}

#[allow(clippy::too_many_arguments)]
fn linear_case(
    name: &str,
    description: &str,
    (n, h, v): (usize, usize, usize),
    targets: Vec<i64>,
    config: LossConfig,
    sharding: Option<Sharding>,
    seed: u64,
    dtype: Dtype,
) -> Result<GoldenCase, GoldenError> {
    let round = |x: Vec<f64>| x.into_iter().map(|y| dtype.round(y)).collect::<Vec<f64>>();
    let hidden = Array2::from_shape_vec((n, h), round(seeded(n * h, 1.0, seed))).expect("n x h");
    let weight =
        Array2::from_shape_vec((v, h), round(seeded(v * h, 1.0, seed + 100))).expect("v x h");
    let call = LossCall::with_flag(&targets, &config, true);
    let l = linear_cross_entropy(hidden.view(), weight.view(), &call)?;
    let terms = Terms::new(l.logits.view(), &call, &l.ce);
    // Each logit is itself a rounded sum of h products: its terms.
    let logit_terms = hidden
        .mapv(f64::abs)
        .dot(&weight.mapv(f64::abs).t())
        .iter()
        .fold(0.0f64, |m, &x| m.max(x));
    let max_lse = max_abs(&l.ce.logsumexp().to_vec());
    let through = 2.0 * logit_terms * (1.0 + 2.0 * config.z_loss * max_lse);
    let per_loss = if config.reduction == Reduction::Mean {
        1.0
    } else {
        n as f64
    };
    let gt = &terms.grad_logits;
    let hidden_terms = max_abs(&flat(&gt.dot(&weight.mapv(f64::abs)))) * (1.0 + logit_terms);
    let weight_terms = max_abs(&flat(&gt.t().dot(&hidden.mapv(f64::abs)))) * (1.0 + logit_terms);
    let low = (dtype != Dtype::F64)
        .then(|| lowp::linear_cross_entropy(hidden.view(), weight.view(), &call, dtype));
    let what = "vocab::Terms with the logits' own rounding";
    #[allow(clippy::type_complexity)]
    let lw = |f: &dyn Fn(&(lowp::CrossEntropy, Array2<f64>, Array2<f64>)) -> Vec<f64>| {
        low.as_ref().map(f).unwrap_or_default()
    };
    let outputs = vec![
        float_output(
            "loss",
            &[],
            vec![l.ce.loss],
            dtype,
            terms.loss + per_loss * through,
            what,
            &lw(&|x| vec![x.0.loss]),
        ),
        float_output(
            "per_token_loss",
            &[n],
            l.ce.per_token_loss.to_vec(),
            dtype,
            max_abs(&terms.per_token_loss) + through,
            what,
            &lw(&|x| x.0.per_token_loss.clone()),
        ),
        float_output(
            "logsumexp",
            &[n],
            l.ce.logsumexp().to_vec(),
            dtype,
            max_abs(&terms.logsumexp) + through,
            what,
            &lw(&|x| x.0.logsumexp.clone()),
        ),
        float_output(
            "grad_hidden",
            &[n, h],
            flat(l.grad_hidden.as_ref().expect("asked for")),
            dtype,
            hidden_terms,
            what,
            &lw(&|x| flat(&x.1)),
        ),
        float_output(
            "grad_weight",
            &[v, h],
            flat(l.grad_weight.as_ref().expect("asked for")),
            dtype,
            weight_terms,
            what,
            &lw(&|x| flat(&x.2)),
        ),
    ];
    Ok(GoldenCase {
        name: name.into(),
        op: "linear_cross_entropy",
        description: description.into(),
        params: loss_params(&config, v, v, sharding.as_ref()),
        inputs: vec![
            Tensor::float("hidden", &[n, h], flat(&hidden), dtype),
            Tensor::float("weight", &[v, h], flat(&weight), dtype),
            Tensor::int("targets", &[n], targets),
        ],
        outputs,
    })
}

pub(super) fn linear_cases(dtype: Dtype) -> Result<Vec<GoldenCase>, GoldenError> {
    Ok(vec![
        linear_case(
            "linear_cross_entropy",
            "the output layer hidden @ weight^T and its cross-entropy, unsharded, an ignored target",
            (5, 6, 17),
            vec![16, 0, -100, 8, 3],
            LossConfig::default(),
            None,
            31,
            dtype,
        )?,
        linear_case(
            "linear_cross_entropy_alg2",
            "alg2 over 4 uneven shards of a vocabulary of 11, label smoothing 0.1: the input gradient summed over shards (docs/FAULTS.md V3)",
            (4, 3, 11),
            vec![10, 4, 0, 7],
            LossConfig::default().with_smoothing(0.1, SmoothingConvention::PyTorch),
            sharded(ShardedAlgorithm::Alg2, 4, ShardLayout::Uneven),
            32,
            dtype,
        )?,
        linear_case(
            "linear_cross_entropy_softcap",
            "the output layer with softcap 0.5 (docs/FAULTS.md O1), Megatron smoothing 0.2, z-loss 1e-2, alg2 over 3 uneven shards",
            (5, 4, 13),
            vec![12, 0, -100, 6, 3],
            LossConfig::default()
                .with_softcap(0.5)
                .with_smoothing(0.2, SmoothingConvention::Megatron)
                .with_z_loss(1e-2),
            sharded(ShardedAlgorithm::Alg2, 3, ShardLayout::Uneven),
            33,
            dtype,
        )?,
    ])
}

#[allow(clippy::too_many_arguments)]
fn embedding_case(
    name: &str,
    description: &str,
    ids: Vec<i64>,
    (v, w, h): (usize, usize, usize),
    sharding: Option<(usize, ShardLayout)>,
    seed: u64,
    dtype: Dtype,
) -> Result<GoldenCase, GoldenError> {
    let n = ids.len();
    let mut weight = Array2::from_shape_vec((w, h), seeded(w * h, 1.0, seed))
        .expect("w x h")
        .mapv(|x| dtype.round(x));
    for j in v..w {
        weight.row_mut(j).fill(f64::NAN);
    }
    let go = Array2::from_shape_vec((n, h), seeded(n * h, 1.0, seed + 1))
        .expect("n x h")
        .mapv(|x| dtype.round(x));
    let real: ArrayView2<f64> = weight.slice_axis(Axis(0), Slice::from(..v));
    let out = embedding_forward(&ids, real)?;
    let gw = embedding_backward(&ids, go.view(), v)?;
    // The terms of each gradient row: the sum of |grad_output| of its tokens.
    let mut gterms = Array2::<f64>::zeros((v, h));
    for (i, &id) in ids.iter().enumerate() {
        let mut row = gterms.row_mut(id as usize);
        row += &go.row(i).mapv(f64::abs);
    }
    let low = (dtype != Dtype::F64).then(|| lowp::embedding_grad(&ids, go.view(), v, dtype));
    let mut p = Map::new();
    if w > v {
        p.insert("vocab_size".into(), json!(v));
    }
    if let Some((shards, layout)) = sharding {
        p.insert("num_shards".into(), json!(shards));
        p.insert("layout".into(), json!(layout.name()));
    }
    p.insert("want_grad".into(), json!(true));
    Ok(GoldenCase {
        name: name.into(),
        op: "embedding",
        description: description.into(),
        params: p,
        inputs: vec![
            Tensor::int("ids", &[n], ids),
            Tensor::float("weight", &[w, h], flat(&weight), dtype),
            Tensor::float("grad_output", &[n, h], flat(&go), dtype),
        ],
        outputs: vec![
            Output {
                tensor: Tensor::float("output", &[n, h], flat(&out), Dtype::F64),
                rule: Rule::exact("a lookup copies the stored weights"),
                in_dtype: (dtype != Dtype::F64).then(|| flat(&out)),
            },
            float_output(
                "grad_weight",
                &[w, h],
                widen_rows(&gw, w),
                dtype,
                max_abs(&flat(&gterms)),
                "the sum of |grad_output| over a row's tokens",
                &low.map(|g| widen_rows(&g, w)).unwrap_or_default(),
            ),
        ],
    })
}

pub(super) fn embedding_cases(dtype: Dtype) -> Result<Vec<GoldenCase>, GoldenError> {
    Ok(vec![
        embedding_case(
            "embedding",
            "unsharded lookup with repeated ids: their gradients accumulate",
            vec![3, 0, 8, 3, 3, 5, 0],
            (9, 9, 4),
            None,
            41,
            dtype,
        )?,
        embedding_case(
            "embedding_sharded_padded",
            "3 shards of a vocabulary of 10 padded to 12 rows (NaN padding, never read; gradient 0 there)",
            vec![9, 0, 4, 9, 5],
            (10, 12, 3),
            Some((3, ShardLayout::Padded)),
            42,
            dtype,
        )?,
    ])
}
