//! The encoder-layer half of the BERT suite: one [`EncoderLayerOp`] packed
//! (varlen) == padded (dense masked rows), and a lower-precision layer against
//! the f64 reference.

use super::*;

/// Checks one encoder layer: the tokens of `lengths` (random `x`,
/// `grad_output`) run padded (rows of `row_len`, key padding mask) and
/// varlen; outputs, `grad_x` of real tokens and every parameter gradient must
/// agree under [`Tolerance::F64_REWRITE`].
///
/// # Errors
/// The first [`Mismatch`].
pub fn check_layer(
    imp: &dyn EncoderLayerOp,
    config: &BertConfig,
    lengths: &[usize],
    row_len: usize,
    seed: u64,
) -> Result<Observed, Mismatch> {
    check_layer_with(imp, config, lengths, row_len, seed, Tolerance::F64_REWRITE)
}

/// The first layer of a random model of `config` (seeded).
fn first_layer(config: &BertConfig, seed: u64) -> Result<LayerParams, Mismatch> {
    let model = BertModel::random(config.clone(), seed);
    let mut model = model.map_err(|e| Mismatch::new("config", e.to_string()))?;
    Ok(model.params.layers.swap_remove(0))
}

/// As [`check_layer`] with packed == padded judged under `tol` (an f32 layer:
/// [`Tolerance::F32_REWRITE`]; its matrix products block differently for the
/// padded and the packed row counts).
///
/// # Errors
/// The first [`Mismatch`].
pub fn check_layer_with(
    imp: &dyn EncoderLayerOp,
    config: &BertConfig,
    lengths: &[usize],
    row_len: usize,
    seed: u64,
    tol: Tolerance,
) -> Result<Observed, Mismatch> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let width = config.hidden_size;
    let params = first_layer(config, seed)?;
    let n: usize = lengths.iter().sum();
    let x = Array2::from_shape_fn((n, width), |_| 2.0 * rng.random::<f64>() - 1.0);
    let go = Array2::from_shape_fn((n, width), |_| 2.0 * rng.random::<f64>() - 1.0);
    let cu = crate::cu_seqlens_of(lengths.iter().copied());
    // Padded: real tokens, then padding rows of garbage with zero grad_output.
    let b = lengths.len();
    let mut xp = Array2::from_elem((b * row_len, width), 7.5);
    let mut gp = Array2::zeros((b * row_len, width));
    for (s, &l) in lengths.iter().enumerate() {
        for t in 0..l {
            xp.row_mut(s * row_len + t).assign(&x.row(cu[s] + t));
            gp.row_mut(s * row_len + t).assign(&go.row(cu[s] + t));
        }
    }
    let dense = AttentionLayout::Dense {
        row_len,
        allowed: lengths
            .iter()
            .map(|&l| Array2::from_shape_fn((row_len, row_len), |(_, j)| j < l))
            .collect(),
    };
    let varlen = AttentionLayout::Varlen {
        cu_seqlens: cu.clone(),
    };
    let heads = config.num_attention_heads;
    let eps = config.layer_norm_eps;
    let e = |w: &str, e: Error| Mismatch::new(w, format!("{}: {e}", IMPL));
    let run = |what: &str, input: LayerInput<'_>| {
        imp.forward_backward(Layer::new(&params, heads, eps), input)
            .map(parts)
            .map_err(|x| e(what, x))
    };
    let (op, dxp, gpp) = run(
        "padded layer",
        LayerInput::new(xp.view(), &dense, gp.view()),
    )?;
    let (ov, dxv, gpv) = run(
        "varlen layer",
        LayerInput::new(x.view(), &varlen, go.view()),
    )?;
    let mut seen = Observed::default();
    for (s, &l) in lengths.iter().enumerate() {
        for t in 0..l {
            let (i, j) = (s * row_len + t, cu[s] + t);
            for (name, padded, packed) in [("output", &op, &ov), ("grad_x", &dxp, &dxv)] {
                seen.close(
                    &format!("sequence {s} token {t}: {name}"),
                    &padded.row(i).to_vec(),
                    &packed.row(j).to_vec(),
                    &[width],
                    tol,
                )?;
            }
        }
    }
    let (gp_all, gv_all) = (layer_tensors(&gpp), layer_tensors(&gpv));
    let global = gp_all
        .iter()
        .flat_map(|(_, a, _)| a.iter())
        .fold(0.0f64, |m, v| m.max(v.abs()));
    for ((name, a, shape), (_, b, _)) in gp_all.into_iter().zip(gv_all) {
        finite(&format!("padded grad {name}"), &a)?;
        seen.close_scaled(&format!("grad {name}"), &a, &b, &shape, tol, Some(global))?;
    }
    Ok(seen)
}

/// What [`run_layer_suite`] saw: packed (varlen) against padded (dense
/// masked rows), and against the f64 reference layer for a lower-precision
/// layer (the attention suite's report).
pub type LayerReport = crate::attention::SuiteReport;

/// The encoder-layer suite under `judge`: random lengths (empty ones
/// included), configs and padding, `cases` of them, packed == padded within
/// `judge.packed()`; for a lower-precision layer also
/// [`run_layer_relative_suite`] against the f64 reference.
///
/// # Errors
/// The first failure.
pub fn run_layer_suite(
    imp: &dyn EncoderLayerOp,
    judge: Judge,
    cases: u32,
) -> Result<LayerReport, Mismatch> {
    let packed = run_layer_suite_with(imp, cases, judge.packed())?;
    let relative = match judge.relative_rule() {
        Some(rule) => Some(run_layer_relative_suite(imp, cases, rule)?),
        None => None,
    };
    Ok(LayerReport {
        packed,
        relative,
        general: None,
    })
}

/// As [`run_layer_suite`] with packed == padded judged under `tol`.
///
/// # Errors
/// The first failure.
pub fn run_layer_suite_with(
    imp: &dyn EncoderLayerOp,
    cases: u32,
    tol: Tolerance,
) -> Result<Observed, Mismatch> {
    let strategy = (
        prop::collection::vec(0usize..=7, 1..=5),
        0usize..=3,
        configs(10),
        any::<u64>(),
    );
    let suite = format!("{} layer suite", IMPL);
    crate::run_cases(
        cases,
        &strategy,
        &suite,
        Observed::default(),
        |seen, (lengths, pad, config, seed)| {
            let row_len = lengths.iter().copied().max().unwrap_or(0) + pad;
            seen.merge(check_layer_with(
                imp, &config, &lengths, row_len, seed, tol,
            )?);
            Ok(())
        },
    )
}

// ---- lower-precision layers against the f64 reference -----------------------------

/// The layer's parameters with every value rounded by `round`.
pub fn round_layer(p: &LayerParams, round: fn(f64) -> f64) -> LayerParams {
    let mut out = p.clone();
    for (_, mut t) in layer_tensors_mut(&mut out) {
        t.mapv_inplace(round);
    }
    out
}

/// Checks a lower-precision layer on the varlen tokens of `lengths` against
/// the f64 reference layer under `rule`: parameters, `x` (uniform in [-1,
/// 1], every 11th value x 8: planted outliers) and `grad_output` rounded to
/// f32; output, `grad_x` and every parameter gradient within the rule of
/// [`baseline32::layer_forward_backward`] (parameter gradients with the
/// floor relative to the largest gradient, as [`check_layer`] does).
///
/// # Errors
/// The first tensor outside the rule.
pub fn check_layer_relative(
    imp: &dyn EncoderLayerOp,
    config: &BertConfig,
    lengths: &[usize],
    seed: u64,
    rule: RelativeRule,
) -> Result<RelativeReport, Mismatch> {
    let round = baseline32::round_f32;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let width = config.hidden_size;
    let params = first_layer(config, seed)?;
    let params = round_layer(&params, round);
    let n: usize = lengths.iter().sum();
    let mut draw = |k: usize| {
        let x = 2.0 * rng.random::<f64>() - 1.0;
        round(if k % 11 == 5 { 8.0 * x } else { x })
    };
    let x = Array2::from_shape_fn((n, width), |(i, j)| draw(i * width + j));
    let go = Array2::from_shape_fn((n, width), |(i, j)| draw(i * width + j + 3));
    let cu = crate::cu_seqlens_of(lengths.iter().copied());
    let layout = AttentionLayout::Varlen {
        cu_seqlens: cu.clone(),
    };
    let (heads, eps) = (config.num_attention_heads, config.layer_norm_eps);
    let e = |w: &str, e: Error| Mismatch::new(w, e.to_string());
    let (want_out, want_dx, want_g) = ReferenceLayer(ReferenceAttention)
        .forward_backward(
            Layer::new(&params, heads, eps),
            LayerInput::new(x.view(), &layout, go.view()),
        )
        .map(parts)
        .map_err(|x| e("reference layer", x))?;
    let (x32, go32) = (x.mapv(|v| v as f32), go.mapv(|v| v as f32));
    let (b_out, b_dx, b_g) =
        baseline32::layer_forward_backward(&params, heads, eps, x32.view(), &cu, go32.view());
    let (out, dx, g) = imp
        .forward_backward(
            Layer::new(&params, heads, eps),
            LayerInput::new(x.view(), &layout, go.view()),
        )
        .map(parts)
        .map_err(|x| e(IMPL, x))?;
    let mut report = RelativeReport::default();
    let v64 = |a: &Array2<f64>| a.iter().copied().collect::<Vec<f64>>();
    let v32 = |a: &Array2<f32>| a.iter().map(|&v| f64::from(v)).collect::<Vec<f64>>();
    let (we, be, ae) = (
        layer_tensors(&want_g),
        layer_tensors(&b_g),
        layer_tensors(&g),
    );
    // grad_x and the parameter gradients are one gradient vector; where a
    // part vanishes by symmetry (a LayerNorm over 2 values passes no gradient
    // back; key biases get none), its computed value is round-off of terms as
    // large as the rest: the floor is relative to the largest gradient.
    let global = we
        .iter()
        .flat_map(|(_, a, _)| a.iter())
        .chain(want_dx.iter())
        .fold(0.0f64, |m, v| m.max(v.abs()));
    for (name, w, b, a, scale) in [
        ("output", &want_out, &b_out, &out, None),
        ("grad_x", &want_dx, &b_dx, &dx, Some(global)),
    ] {
        if a.dim() != w.dim() {
            return Err(Mismatch::new(
                name,
                format!("shape {:?}, expected {:?}", a.shape(), w.shape()),
            ));
        }
        let r = assert_within_k(
            name,
            &v64(w),
            &v32(b),
            &v64(a),
            w.shape(),
            rule,
            Allowance::with_scale(scale),
        )?;
        report.note(name, r);
    }
    for (((name, w, shape), (_, b, _)), (_, a, _)) in we.into_iter().zip(be).zip(ae) {
        let r = assert_within_k(
            &format!("grad {name}"),
            &w,
            &b,
            &a,
            &shape,
            rule,
            Allowance::with_scale(Some(global)),
        )?;
        report.note(name, r);
    }
    Ok(report)
}

/// Layer cases that cross the attention tiles of a blocked kernel, as
/// `(name, config, lengths)`.
pub fn layer_tile_cases() -> Vec<(&'static str, BertConfig, Vec<usize>)> {
    vec![
        (
            "segments of 70, 5, 0 and 130 tokens, hidden 32, 2 heads",
            BertConfig::tiny(11, 32, 2, 1, 48, 140),
            vec![70, 5, 0, 130],
        ),
        (
            "one segment of 66, hidden 12, 3 heads",
            BertConfig::tiny(11, 12, 3, 1, 20, 70),
            vec![66],
        ),
    ]
}

/// The suite for a lower-precision layer: [`layer_tile_cases`], then `cases`
/// random configurations and lengths (fixed seed), each by
/// [`check_layer_relative`]; the suite tier of `rule` over all of them.
///
/// # Errors
/// The first failure.
pub fn run_layer_relative_suite(
    imp: &dyn EncoderLayerOp,
    cases: u32,
    rule: RelativeRule,
) -> Result<RelativeReport, Mismatch> {
    let mut report = RelativeReport::default();
    for (i, (name, config, lengths)) in layer_tile_cases().into_iter().enumerate() {
        let r = check_layer_relative(imp, &config, &lengths, 40 + i as u64, rule)
            .map_err(|m| m.within(name))?;
        report.merge(r);
    }
    let strategy = (
        prop::collection::vec(0usize..=9, 1..=5),
        configs(10),
        any::<u64>(),
    );
    let suite = format!("{} relative layer suite", IMPL);
    let report = crate::run_cases(
        cases,
        &strategy,
        &suite,
        report,
        |r, (lengths, config, seed)| {
            r.merge(check_layer_relative(imp, &config, &lengths, seed, rule)?);
            Ok(())
        },
    )?;
    report.require_nonvacuous(10)?;
    report.totals.check(&suite, rule)?;
    Ok(report)
}
