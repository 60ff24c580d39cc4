//! The f32 decoder layer (`packshard_optimized::decoder_layer`) against the
//! f64 reference layer (`packshard_reference::decoder::layer`) on packed
//! documents with grouped-query heads, packed == padded on the real tokens,
//! and a negative control: the same layer run with one segment per pack
//! (attention leaking across documents) is caught by the same check.

use ndarray::{Array2, Axis, Slice};
use packshard_equivalence::compare::{assert_close_with_scale, Mismatch, Tolerance};
use packshard_optimized::decoder_layer::{
    decoder_layer_backward, decoder_layer_forward, decoder_layer_params_f32, DecoderShape,
};
use packshard_reference::attention::ReferenceAttention;
use packshard_reference::decoder::layer::{
    decoder_layer_backward as ref_bwd, decoder_layer_forward as ref_fwd,
};
use packshard_reference::decoder::{DecoderAttention, DecoderConfig, DecoderParams, Mlp, Norm};
use packshard_reference::Error;
use rand::{Rng, SeedableRng};

/// f32 against f64 through one layer: 64 ulp of f32 of each tensor's
/// scale (parameter gradients: of the largest gradient), as the registry's
/// single-case judge of f32 kernels (`Tolerance::F32_REWRITE`).
const TOL: Tolerance = Tolerance::F32_REWRITE;

struct Case {
    config: DecoderConfig,
    params: DecoderParams,
    x: Array2<f64>,
    dy: Array2<f64>,
    lengths: Vec<usize>,
}

fn case((h, kv, d, inter): (usize, usize, usize, usize), lengths: &[usize], seed: u64) -> Case {
    let config = DecoderConfig::tiny(7, h, kv, d, inter, 1);
    let params = DecoderParams::random(&config, seed).unwrap();
    let n: usize = lengths.iter().sum();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed + 1);
    let mut gen = |_| 2.0 * rng.random::<f64>() - 1.0;
    let x = Array2::from_shape_fn((n, config.hidden_size), &mut gen);
    let dy = Array2::from_shape_fn((n, config.hidden_size), &mut gen);
    Case {
        config,
        params,
        x,
        dy,
        lengths: lengths.to_vec(),
    }
}

fn cu(lengths: &[usize]) -> Vec<usize> {
    let mut cu = vec![0];
    for l in lengths {
        cu.push(cu.last().unwrap() + l);
    }
    cu
}

fn positions(lengths: &[usize]) -> Vec<usize> {
    lengths.iter().flat_map(|&l| 0..l).collect()
}

fn flat<D: ndarray::Dimension>(x: &ndarray::Array<f32, D>) -> Vec<f64> {
    x.iter().map(|&v| f64::from(v)).collect()
}

/// The f32 layer's `(y, dx, grads by name)` with attention over `cu_seqlens`.
type Run = (Array2<f32>, Array2<f32>, Vec<(&'static str, Vec<f64>)>);

fn run32(c: &Case, cu_seqlens: &[usize]) -> Result<Run, Error> {
    let s = DecoderShape::of(&c.config)?;
    let p = decoder_layer_params_f32(&c.params.layers[0])?;
    let pos = positions(&c.lengths);
    let x = c.x.mapv(|v| v as f32);
    let dy = c.dy.mapv(|v| v as f32);
    let (y, cache) = decoder_layer_forward(&s, &p, x.view(), &pos, cu_seqlens)?;
    let (dx, g) = decoder_layer_backward(&s, &p, &cache, &pos, cu_seqlens, dy.view())?;
    let grads = vec![
        ("input_layernorm", flat(&g.attn_norm_g)),
        ("q_proj", flat(&g.wq)),
        ("k_proj", flat(&g.wk)),
        ("v_proj", flat(&g.wv)),
        ("o_proj", flat(&g.wo)),
        ("post_attention_layernorm", flat(&g.mlp_norm_g)),
        ("gate_proj", flat(&g.w_gate)),
        ("up_proj", flat(&g.w_up)),
        ("down_proj", flat(&g.w_down)),
    ];
    Ok((y, dx, grads))
}

/// `run32` over the documents' own `cu_seqlens` against the f64 reference
/// layer (inputs and weights rounded to f32 first, so both see the same numbers).
fn check(c: &Case, cu_seqlens: &[usize]) -> Result<f64, Mismatch> {
    let (y, dx, grads) =
        run32(c, cu_seqlens).map_err(|e| Mismatch::new("f32 layer", e.to_string()))?;
    let round = |x: &Array2<f64>| x.mapv(|v| v as f32 as f64);
    let (x, dy) = (round(&c.x), round(&c.dy));
    let mut p = c.params.layers[0].clone();
    for t in [
        &mut p.wq,
        &mut p.wk,
        &mut p.wv,
        &mut p.wo,
        &mut p.w_gate,
        &mut p.w_up,
        &mut p.w_down,
    ] {
        t.mapv_inplace(|v| v as f32 as f64);
    }
    for t in [&mut p.attn_norm_g, &mut p.mlp_norm_g] {
        t.mapv_inplace(|v| v as f32 as f64);
    }
    let pos = positions(&c.lengths);
    let att = DecoderAttention::Varlen {
        cu_seqlens: cu(&c.lengths),
    };
    let e = |e: Error| Mismatch::new("reference", e.to_string());
    let (want_y, cache) = ref_fwd(
        &c.config,
        &p,
        &ReferenceAttention,
        x.view(),
        &pos,
        &att,
        None,
    )
    .map_err(e)?;
    let mut g = DecoderParams::zeros_like(&c.params).layers.remove(0);
    let (want_dx, _) = ref_bwd(
        &c.config,
        &p,
        &mut g,
        &ReferenceAttention,
        &cache,
        &pos,
        &att,
        None,
        dy.view(),
    )
    .map_err(e)?;
    let v = |a: &Array2<f64>| a.iter().copied().collect::<Vec<_>>();
    let mut worst = 0.0f64;
    let mut close = |what: &str, want: &[f64], got: &[f64], scale: Option<f64>| {
        let s = want
            .iter()
            .fold(scale.unwrap_or(0.0), |m, x| m.max(x.abs()));
        let err = want
            .iter()
            .zip(got)
            .fold(0.0f64, |m, (a, b)| m.max((a - b).abs()));
        worst = worst.max(err / s.max(f64::MIN_POSITIVE));
        assert_close_with_scale(what, want, got, &[want.len()], TOL, scale)
    };
    close("output", &v(&want_y), &flat(&y), None)?;
    close("dx", &v(&want_dx), &flat(&dx), None)?;
    let want_g: Vec<(&str, Vec<f64>)> = vec![
        ("input_layernorm", g.attn_norm_g.to_vec()),
        ("q_proj", v(&g.wq)),
        ("k_proj", v(&g.wk)),
        ("v_proj", v(&g.wv)),
        ("o_proj", v(&g.wo)),
        ("post_attention_layernorm", g.mlp_norm_g.to_vec()),
        ("gate_proj", v(&g.w_gate)),
        ("up_proj", v(&g.w_up)),
        ("down_proj", v(&g.w_down)),
    ];
    let global = want_g
        .iter()
        .flat_map(|(_, t)| t.iter())
        .fold(0.0f64, |m, x| m.max(x.abs()));
    for ((name, want), (_, got)) in want_g.iter().zip(&grads) {
        close(&format!("grad {name}"), want, got, Some(global))?;
    }
    Ok(worst)
}

#[test]
fn f32_layer_matches_the_reference_layer_on_packed_documents() {
    let mut worst = 0.0f64;
    for (i, (shape, lengths)) in [
        ((4, 2, 4, 12), vec![3, 1, 5]),
        ((2, 1, 2, 5), vec![7, 2]),
        ((3, 3, 4, 8), vec![1, 1, 1, 4]),
        ((4, 1, 8, 16), vec![70, 130]),
    ]
    .into_iter()
    .enumerate()
    {
        let c = case(shape, &lengths, i as u64);
        worst = worst
            .max(check(&c, &cu(&lengths)).unwrap_or_else(|m| panic!("{shape:?} {lengths:?}: {m}")));
    }
    eprintln!("f32 decoder layer vs f64 reference: worst error {worst:.2e} of the tensor's scale");
}

#[test]
fn non_llama_configs_are_refused_by_name() {
    let mut c = DecoderConfig::tiny(7, 2, 1, 2, 3, 1);
    c.norm = Norm::LayerNorm;
    assert!(
        matches!(DecoderShape::of(&c), Err(Error::InvalidArgument { field, .. }) if field == "norm")
    );
    c.norm = Norm::RmsNorm;
    c.mlp = Mlp::Gelu;
    assert!(
        matches!(DecoderShape::of(&c), Err(Error::InvalidArgument { field, .. }) if field == "mlp")
    );
}

/// Packed rows (documents back to back, one segment each) against padded
/// rows (each document first in its own row of `row_len`, the row one causal
/// segment): the real tokens' outputs and input gradients agree.
fn packed_vs_padded(c: &Case, row_len: usize, packed_cu: &[usize]) -> Result<(), Mismatch> {
    let (yp, dxp, _) = run32(c, packed_cu).map_err(|e| Mismatch::new("packed", e.to_string()))?;
    let hidden = c.config.hidden_size;
    let rows = c.lengths.len();
    let mut x = Array2::zeros((rows * row_len, hidden));
    let mut dy = Array2::zeros((rows * row_len, hidden));
    let mut at = 0;
    for (r, &l) in c.lengths.iter().enumerate() {
        let src = Slice::from(at..at + l);
        let dst = Slice::from(r * row_len..r * row_len + l);
        x.slice_axis_mut(Axis(0), dst)
            .assign(&c.x.slice_axis(Axis(0), src));
        dy.slice_axis_mut(Axis(0), dst)
            .assign(&c.dy.slice_axis(Axis(0), src));
        at += l;
    }
    let pad = Case {
        config: c.config.clone(),
        params: c.params.clone(),
        x,
        dy,
        lengths: vec![row_len; rows],
    };
    let (yd, dxd, _) =
        run32(&pad, &cu(&pad.lengths)).map_err(|e| Mismatch::new("padded", e.to_string()))?;
    let mut at = 0;
    for (r, &l) in c.lengths.iter().enumerate() {
        for (what, p, d) in [("output", &yp, &yd), ("dx", &dxp, &dxd)] {
            let a = flat(&p.slice_axis(Axis(0), Slice::from(at..at + l)).to_owned());
            let b = flat(
                &d.slice_axis(Axis(0), Slice::from(r * row_len..r * row_len + l))
                    .to_owned(),
            );
            assert_close_with_scale(
                &format!("document {r}: packed vs padded {what}"),
                &b,
                &a,
                &[l, hidden],
                TOL,
                None,
            )?;
        }
        at += l;
    }
    Ok(())
}

#[test]
fn packed_equals_padded_and_a_leak_across_documents_is_caught() {
    let c = case((4, 2, 4, 12), &[3, 1, 5, 2], 9);
    packed_vs_padded(&c, 6, &cu(&c.lengths)).unwrap();
    // The planted fault: the pack as one causal segment (no document mask).
    // The first document's outputs are unchanged (causal: it sees only
    // itself); the later documents attend to its keys, so its input
    // gradient shows the leak first.
    let n = c.x.nrows();
    let m = packed_vs_padded(&c, 6, &[0, n]).unwrap_err();
    assert!(
        m.to_string().contains("document 0: packed vs padded dx"),
        "{m}"
    );
}
