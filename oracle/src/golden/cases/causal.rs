//! The golden cases of the causal-LM packing ops (issue #15):
//! `causal_labels` and `causal_conversions` on the docs/FAULTS.md examples
//! C1–C4 (the values of [`packshard_reference::faults`]). Every output is
//! an integer or a weight `1 / count` computed once in f64: exact.

use packshard_reference::decoder::packing::{
    cu_seqlens_from_position_ids, cu_seqlens_from_seq_idx, doc_ids_from_varlen, loss_weights,
    next_token_labels, position_ids_from_cu_seqlens, seq_idx_from_cu_seqlens, varlen_from_doc_ids,
    CausalReduction,
};
use packshard_reference::faults;
use packshard_reference::vocab::IGNORE_INDEX;
use serde_json::{json, Map, Value};

use super::super::io::{Dtype, Tensor};
use super::super::{GoldenCase, GoldenError, Output, Rule};
use super::{int_output, params};

fn ints(xs: &[usize]) -> Vec<i64> {
    xs.iter().map(|&x| x as i64).collect()
}

fn weights_output(name: &str, w: Vec<f64>) -> Output {
    Output {
        tensor: Tensor::float(name, &[w.len()], w, Dtype::F64),
        rule: Rule::exact("1 / a count of tokens or documents, one f64 division"),
        in_dtype: None,
    }
}

/// A `causal_labels` case: `input_ids` and the documents as `doc_ids` or
/// (`cu_seqlens`) every slot real.
fn labels_case(
    name: &str,
    description: &str,
    input_ids: &[i64],
    docs: (&str, &[usize]),
    eos: Option<i64>,
) -> Result<GoldenCase, GoldenError> {
    let n = input_ids.len();
    let doc_ids = match docs.0 {
        "doc_ids" => docs.1.to_vec(),
        _ => doc_ids_from_varlen(&(0..n).collect::<Vec<_>>(), docs.1, n)?,
    };
    let num_documents = match docs.0 {
        "doc_ids" => doc_ids
            .iter()
            .filter(|&&d| d != 0)
            .collect::<std::collections::HashSet<_>>()
            .len(),
        _ => docs.1.len() - 1,
    };
    let labels = next_token_labels(input_ids, &doc_ids, eos)?;
    let w = |r| loss_weights(&labels, &doc_ids, r, num_documents);
    let predicted = labels.iter().filter(|&&l| l != IGNORE_INDEX).count();
    let mut p = Map::new();
    if let Some(e) = eos {
        p.insert("eos_token_id".into(), json!(e));
    }
    Ok(GoldenCase {
        name: name.into(),
        op: "causal_labels",
        description: description.into(),
        params: p,
        inputs: vec![
            Tensor::int("input_ids", &[n], input_ids.to_vec()),
            Tensor::int(docs.0, &[docs.1.len()], ints(docs.1)),
        ],
        outputs: vec![
            int_output(
                "labels",
                &[n],
                labels.clone(),
                "next token of the same document, -100 for none",
            ),
            weights_output("loss_weights_per_token", w(CausalReduction::PerToken)?),
            weights_output(
                "loss_weights_per_document",
                w(CausalReduction::PerDocument)?,
            ),
            weights_output("loss_weights_per_row", w(CausalReduction::PerRow)?),
            int_output("num_predicted", &[], vec![predicted as i64], "a count"),
        ],
    })
}

/// A `causal_conversions` case from one form (`input`, with `params`).
fn conversions_case(
    name: &str,
    description: &str,
    input: (&str, &[usize]),
    p: Map<String, Value>,
) -> Result<GoldenCase, GoldenError> {
    let (cu, slots, n_slots) = match input.0 {
        "position_ids" => (
            cu_seqlens_from_position_ids(input.1),
            (0..input.1.len()).collect::<Vec<_>>(),
            input.1.len(),
        ),
        "seq_idx" => {
            let num = p
                .get("num_segments")
                .and_then(Value::as_u64)
                .ok_or_else(|| GoldenError::new("golden case: seq_idx without num_segments"))?;
            (
                cu_seqlens_from_seq_idx(input.1, num as usize)?,
                (0..input.1.len()).collect(),
                input.1.len(),
            )
        }
        _ => {
            let (slots, cu) = varlen_from_doc_ids(input.1)?;
            (cu, slots, input.1.len())
        }
    };
    let first_offset = match input.0 {
        "position_ids" => input.1.first().copied().unwrap_or(0),
        _ => p.get("first_offset").and_then(Value::as_u64).unwrap_or(0) as usize,
    };
    let positions = position_ids_from_cu_seqlens(&cu, first_offset)?;
    let seq_idx = seq_idx_from_cu_seqlens(&cu)?;
    let doc_ids = doc_ids_from_varlen(&slots, &cu, n_slots)?;
    let max_seqlen = cu.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0);
    Ok(GoldenCase {
        name: name.into(),
        op: "causal_conversions",
        description: description.into(),
        params: p,
        inputs: vec![Tensor::int(input.0, &[input.1.len()], ints(input.1))],
        outputs: vec![
            int_output("cu_seqlens", &[cu.len()], ints(&cu), "segment offsets"),
            int_output("max_seqlen", &[], vec![max_seqlen as i64], "a length"),
            int_output(
                "position_ids",
                &[positions.len()],
                ints(&positions),
                "positions, each segment from 0, the first from first_offset",
            ),
            int_output(
                "seq_idx",
                &[seq_idx.len()],
                ints(&seq_idx),
                "segment index per token",
            ),
            int_output("slots", &[slots.len()], ints(&slots), "real slots"),
            int_output(
                "doc_ids",
                &[doc_ids.len()],
                ints(&doc_ids),
                "document per slot, 1.. in order, 0 for padding",
            ),
        ],
    })
}

/// The causal cases, in manifest order.
pub(super) fn cases() -> Result<Vec<GoldenCase>, GoldenError> {
    let c2_cu = {
        let mut cu = vec![0];
        for l in faults::C2_LENGTHS {
            cu.push(cu[cu.len() - 1] + l);
        }
        cu
    };
    let c2_ids: Vec<i64> = (20..20 + c2_cu[c2_cu.len() - 1] as i64).collect();
    let c4_ids: Vec<i64> = (10..10 + faults::C4_DOC_IDS.len() as i64).collect();
    Ok(vec![
        labels_case(
            "causal_labels_c1",
            "next-token labels of the pack [a b | c d]: no label crosses a document (C1)",
            &faults::C1_INPUT_IDS,
            ("doc_ids", &faults::C1_DOC_IDS),
            None,
        )?,
        labels_case(
            "causal_labels_c2_eos",
            "documents of 3 and 4 tokens given by cu_seqlens, each last token predicting EOS (C2)",
            &c2_ids,
            ("cu_seqlens", &c2_cu),
            Some(2),
        )?,
        labels_case(
            "causal_labels_c4_padding",
            "padding between and after documents predicts nothing and weighs 0 (C4, C7)",
            &c4_ids,
            ("doc_ids", &faults::C4_DOC_IDS),
            None,
        )?,
        conversions_case(
            "causal_conversions_c3",
            "position_ids with a one-token document: a reset, not a decrease, starts a document (C3)",
            ("position_ids", &faults::C3_POSITION_IDS),
            Map::new(),
        )?,
        conversions_case(
            "causal_conversions_c4",
            "document ids with padding between documents: the real slots and cu_seqlens over them (C4)",
            ("doc_ids", &faults::C4_DOC_IDS),
            Map::new(),
        )?,
        conversions_case(
            "causal_conversions_seq_idx",
            "seq_idx with empty segments (never-seen indices) and a continuation chunk's first offset (C6)",
            ("seq_idx", &[0, 0, 2, 2, 2, 3]),
            params(&[("num_segments", json!(5)), ("first_offset", json!(faults::C6_POSITIONS[0]))]),
        )?,
    ])
}

/// The decoder's rule: no bound from the terms is derived for a whole
/// decoder, so a chosen one — 1e-12 relative plus 1e-12 of the tensor's
/// largest |expected| (about 1e4 f64 roundings, far above the rounding of
/// a 2-layer f64 recomputation in another order, far below any real bug).
fn decoder_rule(expected: &[f64]) -> Rule {
    let scale = expected
        .iter()
        .filter(|x| x.is_finite())
        .fold(0.0f64, |m, x| m.max(x.abs()));
    Rule {
        rel: DECODER_REL,
        atol: super::super::io::round_up_sig(DECODER_REL * scale),
        text: format!(
            "f64 decoder: {DECODER_REL:e} of |expected| + {DECODER_REL:e} of the tensor's max |expected| ({})",
            super::super::fmt_e(scale)
        ),
    }
}

/// See [`decoder_rule`].
const DECODER_REL: f64 = 1e-12;

/// `decoder_forward_backward` on a 2-layer grouped-query model (4 query
/// heads over 2 key/value heads) with seeded weights, over 3 segments (one
/// empty), per-document loss: the loss, logits, per-token losses, the
/// input-embedding gradient and every parameter's gradient. In the `f64`
/// set only (no lower-precision decoder exists to derive a rule from).
pub(super) fn decoder_case() -> Result<GoldenCase, GoldenError> {
    use crate::causal_lm::VarlenInput;
    use packshard_reference::attention::ReferenceAttention;
    use packshard_reference::decoder::{DecoderConfig, DecoderModel};
    let config = DecoderConfig::tiny(11, 4, 2, 2, 6, 2);
    let model = DecoderModel::random(config.clone(), 15)?;
    let ids: Vec<i64> = vec![3, 1, 4, 1, 5, 9, 2, 6, 5];
    let cu = vec![0usize, 4, 4, 9];
    let n = ids.len();
    let docs = doc_ids_from_varlen(&(0..n).collect::<Vec<_>>(), &cu, n)?;
    let labels = next_token_labels(&ids, &docs, None)?;
    let weights = loss_weights(&labels, &docs, CausalReduction::PerDocument, cu.len() - 1)?;
    let pos = position_ids_from_cu_seqlens(&cu, 0)?;
    let input = VarlenInput::new(&ids, &pos, &cu);
    let run = model.run(&ReferenceAttention, &input.input(), &labels, &weights)?;
    let float = |name: &str, shape: &[usize], values: Vec<f64>| Output {
        rule: decoder_rule(&values),
        tensor: Tensor::float(name, shape, values, Dtype::F64),
        in_dtype: None,
    };
    let mut outputs = vec![
        float("loss", &[], vec![run.loss]),
        float(
            "logits",
            &[n, config.vocab_size],
            run.logits.iter().copied().collect(),
        ),
        float("per_token_loss", &[n], run.token_losses.clone()),
        float(
            "grad_inputs_embeds",
            &[n, config.hidden_size],
            run.grads.grad_inputs_embeds.iter().copied().collect(),
        ),
    ];
    for (name, g) in run.grads.params.named() {
        outputs.push(float(
            &format!("grad.{name}"),
            g.shape(),
            g.iter().copied().collect(),
        ));
    }
    let mut inputs = vec![
        Tensor::int("input_ids", &[n], ids.clone()),
        Tensor::int("cu_seqlens", &[cu.len()], ints(&cu)),
    ];
    for (name, t) in model.params.named() {
        inputs.push(Tensor::float(
            &name,
            t.shape(),
            t.iter().copied().collect(),
            Dtype::F64,
        ));
    }
    let c = &config;
    Ok(GoldenCase {
        name: "decoder_gqa_packed".into(),
        op: "decoder_forward_backward",
        description: "a 2-layer grouped-query decoder (RMSNorm, SwiGLU, rotary) on seeded weights over 3 packed documents (one empty), per-document next-token loss: forward and every gradient (C1, P4, P7)".into(),
        params: params(&[
            ("vocab_size", json!(c.vocab_size)),
            ("num_heads", json!(c.num_heads)),
            ("num_kv_heads", json!(c.num_kv_heads)),
            ("head_dim", json!(c.head_dim)),
            ("intermediate_size", json!(c.intermediate_size)),
            ("num_layers", json!(c.num_layers)),
            ("reduction", json!("per-document")),
        ]),
        inputs,
        outputs,
    })
}
