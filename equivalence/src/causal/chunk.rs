//! Continuation chunks of the causal-LM suite: `cu_seqlens_q != cu_seqlens_k`
//! (a chunk over a key/value cache), bottom-right aligned (C5, C6).

use super::*;

// ---- continuation chunks: cu_seqlens_q != cu_seqlens_k ------------------------

/// Checks `imp` on continuation chunks (docs/FAULTS.md C5, C6): documents of
/// `lengths` run whole by the f64 reference; their first `split[d]` tokens
/// run by the reference give the key/value cache; the rest, one row of
/// chunks at positions `split[d]..`, run by `imp` over that cache. The
/// chunk's logits must equal the whole run's tail rows within `tol`.
///
/// # Errors
/// The first [`Mismatch`].
pub fn check_chunk(
    imp: &dyn CausalLmImpl,
    config: &DecoderConfig,
    lengths: &[usize],
    split: &[usize],
    seed: u64,
    tol: Tolerance,
) -> Result<Observed, Mismatch> {
    let e = |w: &str, x: Error| Mismatch::new(w, format!("{IMPL}: {x}"));
    let model = DecoderModel::random(config.clone(), seed).map_err(|x| e("config", x))?;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let v = config.vocab_size as i64;
    let docs: Vec<Vec<i64>> = lengths
        .iter()
        .map(|&l| (0..l).map(|_| rng.random_range(0..v)).collect())
        .collect();
    let cu_of = |ls: &mut dyn Iterator<Item = usize>| {
        let mut c = vec![0];
        for l in ls {
            c.push(c.last().unwrap() + l);
        }
        c
    };
    let run = |ids: &[i64], pos: &[usize], cu: Vec<usize>| {
        let att = DecoderAttention::Varlen { cu_seqlens: cu };
        model.forward(
            &ReferenceAttention,
            &DecoderInput {
                input_ids: ids,
                position_ids: pos,
                attention: &att,
                past: None,
            },
        )
    };
    let whole_ids: Vec<i64> = docs.concat();
    let whole_pos: Vec<usize> = lengths.iter().flat_map(|&l| 0..l).collect();
    let whole = run(&whole_ids, &whole_pos, cu_of(&mut lengths.iter().copied()))
        .map_err(|x| Mismatch::new("whole", x.to_string()))?;
    let pre_ids: Vec<i64> = docs
        .iter()
        .zip(split)
        .flat_map(|(d, &s)| d[..s].to_vec())
        .collect();
    let pre_pos: Vec<usize> = split.iter().flat_map(|&s| 0..s).collect();
    let pre_cu = cu_of(&mut split.iter().copied());
    let pre = run(&pre_ids, &pre_pos, pre_cu.clone())
        .map_err(|x| Mismatch::new("prefix", x.to_string()))?;
    let cache = pre.present(&pre_cu);
    let mut batch = CausalBatch {
        row_len: 0,
        input_ids: Vec::new(),
        position_ids: Vec::new(),
        doc_ids: Vec::new(),
        eos: None,
        num_documents: docs.len(),
    };
    for (d, (doc, &s)) in docs.iter().zip(split).enumerate() {
        for (t, &id) in doc.iter().enumerate().skip(s) {
            batch.input_ids.push(id);
            batch.position_ids.push(t);
            batch.doc_ids.push(d + 1);
        }
    }
    batch.row_len = batch.input_ids.len();
    let chunk = imp
        .chunk_logits(&model, &batch, &cache)
        .map_err(|x| e("chunk", x))?;
    if chunk.dim() != (batch.row_len, config.vocab_size) {
        return Err(Mismatch::new(
            "chunk logits",
            format!(
                "shape {:?}, expected [{}, {}]",
                chunk.shape(),
                batch.row_len,
                config.vocab_size
            ),
        ));
    }
    let mut seen = Observed::default();
    let (mut at, mut k) = (0, 0);
    for (d, (&l, &s)) in lengths.iter().zip(split).enumerate() {
        let want: Vec<f64> = (at + s..at + l)
            .flat_map(|r| whole.logits.row(r).to_vec())
            .collect();
        let got: Vec<f64> = (k..k + l - s).flat_map(|r| chunk.row(r).to_vec()).collect();
        finite(&format!("chunk of document {d}: logits"), &got)?;
        seen.close(
            &format!("chunk of document {d}: logits"),
            &want,
            &got,
            &[l - s, config.vocab_size],
            tol,
        )?;
        at += l;
        k += l - s;
    }
    Ok(seen)
}

/// Bottom-right causal alignment of an [`AttentionOp`] (docs/FAULTS.md C5),
/// `h` query heads over `h_kv` key heads of dim `d`: in one call, a segment
/// of 3 queries over 1 key gives output 0 on its top 2 rows (no key is
/// visible to them), and a segment of 2 queries over 4 keys equals the last
/// 2 rows of 4 queries over the same 4 keys (self-attention, where both
/// alignments agree).
///
/// # Errors
/// The first [`Mismatch`].
pub fn check_bottom_right(
    op: &dyn AttentionOp,
    (h, h_kv, d): (usize, usize, usize),
    seed: u64,
    tol: Tolerance,
) -> Result<Observed, Mismatch> {
    use ndarray::{Array3, Axis};
    let e = |w: &str, x: Error| Mismatch::new(w, format!("{IMPL}: {x}"));
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut gen = |n: usize, heads: usize| {
        Array3::from_shape_fn((n, heads, d), |_| 2.0 * rng.random::<f64>() - 1.0)
    };
    let (q, k, v) = (gen(5, h), gen(5, h_kv), gen(5, h_kv));
    let head = gen(2, h);
    let scale = 1.0 / (d as f64).sqrt();
    // Rows `r` of an output, flattened.
    let rows = |o: &Array3<f64>, r: std::ops::Range<usize>| -> Vec<f64> {
        o.slice_axis(Axis(0), r.into()).iter().copied().collect()
    };
    let cross = op
        .varlen_forward(
            Qkv::new(q.view(), k.view(), v.view()),
            &Varlen::cross(&[0, 3, 5], &[0, 1, 5], true, scale),
        )
        .map_err(|x| e("attention chunk", x))?;
    for i in 0..2 {
        let row = rows(&cross.output, i..i + 1);
        if row.iter().any(|&x| x != 0.0) {
            return Err(Mismatch::new(
                format!("attention: query {i} of 3 over 1 key"),
                format!("sees no key (bottom-right) and must output 0, got {row:?}"),
            ));
        }
    }
    let q4 = ndarray::concatenate(
        Axis(0),
        &[head.view(), q.slice_axis(Axis(0), (3..5).into())],
    )
    .expect("same head shapes");
    let k4 = k.slice_axis(Axis(0), (1..5).into()).to_owned();
    let v4 = v.slice_axis(Axis(0), (1..5).into()).to_owned();
    let full = op
        .varlen_forward(
            Qkv::new(q4.view(), k4.view(), v4.view()),
            &Varlen::new(&[0, 4], true, scale),
        )
        .map_err(|x| e("attention whole", x))?;
    let (want, got) = (rows(&full.output, 2..4), rows(&cross.output, 3..5));
    let mut seen = Observed::default();
    seen.close(
        "attention: 2 queries over 4 keys vs the last 2 of 4 over 4",
        &want,
        &got,
        &[2, h, d],
        tol,
    )?;
    Ok(seen)
}

/// [`check_chunk`] on the fixed case (documents of 7 and 4 tokens split
/// after 4 and 1: chunks of 3 over 4 and 3 over 1 cached keys) and `cases`
/// random configs, lengths and split points (an empty prefix included).
///
/// # Errors
/// The first failure.
pub fn run_chunk_suite(
    imp: &dyn CausalLmImpl,
    tol: Tolerance,
    cases: u32,
) -> Result<Observed, Mismatch> {
    let seen = check_chunk(
        imp,
        &DecoderConfig::tiny(11, 4, 2, 2, 5, 2),
        &[7, 4],
        &[4, 1],
        1,
        tol,
    )
    .map_err(|m| m.within("C5/C6 chunks of 3 over 4 and 3 over 1 cached keys"))?;
    let strategy = prop::collection::vec(1usize..=7, 1..=4).prop_flat_map(|ls| {
        let splits: Vec<_> = ls.iter().map(|&l| 0usize..l).collect();
        (Just(ls), splits, configs(), any::<u64>())
    });
    let suite = format!("{IMPL} chunk suite ({})", imp.name());
    crate::run_cases(
        cases,
        &strategy,
        &suite,
        seen,
        |o, (ls, sp, config, seed)| {
            o.merge(check_chunk(imp, &config, &ls, &sp, seed, tol)?);
            Ok(())
        },
    )
}
