//! The causal-LM packing ops (issue #15): `causal_labels` (next-token labels
//! inside each document and the loss weight of every slot under each
//! [`CausalReduction`]) and `causal_conversions` (`position_ids`,
//! `cu_seqlens`, `seq_idx` and document ids into one another), from
//! [`packshard_reference::decoder::packing`]. Bad input gets the
//! reference's errors (docs/FAULTS.md C1–C4, C7).

use packshard_reference::attention::check_cu_seqlens_named;
use packshard_reference::decoder::packing::{
    check_doc_ids, cu_seqlens_from_position_ids, cu_seqlens_from_seq_idx, doc_ids_from_varlen,
    loss_weights, next_token_labels, position_ids_from_cu_seqlens, seq_idx_from_cu_seqlens,
    varlen_from_doc_ids, CausalReduction,
};
use packshard_reference::error::check_len;
use packshard_reference::vocab::IGNORE_INDEX;
use serde_json::{json, Value};

use super::{check_values, Case, EvalError};

/// The largest position or offset the conversions accept: `i64::MAX`, so a
/// position plus one never wraps and every position is a JSON integer of
/// every reader.
const MAX_POSITION: u64 = i64::MAX as u64;

/// Values `causal_conversions` holds per token, whatever it converts from:
/// positions, seq_idx, slots, doc ids, and the input's own list while they
/// are made (measured at 10^6 tokens, input parsing included: 394-468
/// bytes per token, under the 576 of 6 values).
const TOKEN_VALUES: usize = 6;

/// What [`TOKEN_VALUES`] is for, in the refusal.
const CONVERTED: &str = "converting the tokens to every form";

/// Exactly one of `fields` is given: its name.
fn one_of<'f>(case: &Case, fields: &[&'f str]) -> Result<&'f str, EvalError> {
    let given: Vec<&str> = fields.iter().copied().filter(|f| case.has(f)).collect();
    match given.as_slice() {
        [one] => Ok(one),
        [] => Err(EvalError::new(
            "missing_field",
            format!("{}: required field is missing", fields.join(" or ")),
        )),
        [_, second, ..] => Err(EvalError::invalid(
            second,
            format!("give exactly one of {}", fields.join(", ")),
        )),
    }
}

/// The ids as JSON integers.
fn ints(xs: &[usize]) -> Value {
    json!(xs)
}

/// `causal_labels`: `input_ids` ([n_slots]) and either `doc_ids`
/// ([n_slots], 0 = padding) or `cu_seqlens` ([b + 1] over every slot);
/// `eos_token_id` (absent: a document's last token predicts nothing),
/// `ignore_index` (default -100), `num_documents` (default the documents
/// given). Result: `labels` ([n_slots]), `loss_weights_per_token`,
/// `loss_weights_per_document`, `loss_weights_per_row` ([n_slots] each),
/// `doc_ids`, `num_predicted`, `num_documents`, `ignore_index`.
pub(super) fn causal_labels(value: &Value) -> Result<Value, EvalError> {
    let case = Case::new(
        value,
        &[
            "input_ids",
            "doc_ids",
            "cu_seqlens",
            "eos_token_id",
            "ignore_index",
            "num_documents",
        ],
    )?;
    no_gradients(&case, "causal_labels")?;
    let input_ids = case.i64_list("input_ids")?;
    let n = input_ids.len();
    // labels, doc ids, three weight vectors, and the input ids and the doc
    // ids or cu_seqlens held while they are made: 7 values per id (measured:
    // 557 bytes per id at 10^6 ids, input parsing included, under the 672).
    check_values("input_ids", &[n, 7], "causal_labels's results")?;
    let ignore = case.opt_i64("ignore_index")?.unwrap_or(IGNORE_INDEX);
    let eos = case.opt_i64("eos_token_id")?;
    if eos == Some(ignore) {
        return Err(EvalError::invalid(
            "eos_token_id",
            format!("is the ignore_index {ignore}: the EOS target would read as no target"),
        ));
    }
    if let Some(i) = input_ids.iter().position(|&t| t < 0 || t == ignore) {
        return Err(EvalError::invalid(
            &format!("input_ids[{i}]"),
            if input_ids[i] < 0 {
                format!("{} is negative (token ids are >= 0)", input_ids[i])
            } else {
                format!("is the ignore_index {ignore}: a label of it would read as no target")
            },
        ));
    }
    if let Some(e) = eos.filter(|&e| e < 0) {
        return Err(EvalError::invalid(
            "eos_token_id",
            format!("{e} is negative (token ids are >= 0)"),
        ));
    }
    let (doc_ids, given_docs) = match one_of(&case, &["doc_ids", "cu_seqlens"])? {
        "doc_ids" => {
            let d = case.usize_list("doc_ids")?;
            check_len("doc_ids", d.len(), "n_slots", n, "one per input id")?;
            check_doc_ids(&d)?;
            let docs: std::collections::HashSet<usize> =
                d.iter().copied().filter(|&x| x != 0).collect();
            let count = docs.len();
            (d, count)
        }
        _ => {
            let cu = case.usize_list("cu_seqlens")?;
            check_cu_seqlens_named("cu_seqlens", "input_ids", &cu, n)?;
            let slots: Vec<usize> = (0..n).collect();
            (doc_ids_from_varlen(&slots, &cu, n)?, cu.len() - 1)
        }
    };
    let num_documents = case.opt_usize("num_documents")?.unwrap_or(given_docs);
    let labels = next_token_labels(&input_ids, &doc_ids, eos)?;
    let weights = |r: CausalReduction| loss_weights(&labels, &doc_ids, r, num_documents);
    let (per_token, per_document, per_row) = (
        weights(CausalReduction::PerToken)?,
        weights(CausalReduction::PerDocument)?,
        weights(CausalReduction::PerRow)?,
    );
    let num_predicted = labels.iter().filter(|&&l| l != IGNORE_INDEX).count();
    let shown: Vec<i64> = labels
        .iter()
        .map(|&l| if l == IGNORE_INDEX { ignore } else { l })
        .collect();
    Ok(json!({
        "op": "causal_labels",
        "labels": shown,
        "loss_weights_per_token": per_token,
        "loss_weights_per_document": per_document,
        "loss_weights_per_row": per_row,
        "doc_ids": ints(&doc_ids),
        "num_predicted": num_predicted,
        "num_documents": num_documents,
        "ignore_index": ignore,
    }))
}

/// `causal_conversions`: exactly one of `position_ids` ([n_tok]),
/// `cu_seqlens` ([b + 1]), `seq_idx` ([n_tok], with `num_segments`,
/// default its largest index + 1) or `doc_ids` ([n_slots], 0 = padding);
/// `first_offset` (the first segment's first position, default
/// `position_offset`; from `position_ids[0]` for `position_ids`),
/// `position_offset` (every other segment's first position, default 0:
/// `batch`'s `position_offset`, RoBERTa's 2, so a batch round-trips). Result: every form — `cu_seqlens`,
/// `max_seqlen`, `num_segments`, `position_ids`, `seq_idx`, `slots` (the
/// real slots, [n_tok]), `doc_ids` ([n_slots], renumbered 1.. in order),
/// `n_tok`, `n_slots`.
pub(super) fn causal_conversions(value: &Value) -> Result<Value, EvalError> {
    let case = Case::new(
        value,
        &[
            "position_ids",
            "cu_seqlens",
            "seq_idx",
            "num_segments",
            "doc_ids",
            "first_offset",
            "position_offset",
        ],
    )?;
    no_gradients(&case, "causal_conversions")?;
    let from = one_of(&case, &["position_ids", "cu_seqlens", "seq_idx", "doc_ids"])?;
    if case.has("num_segments") && from != "seq_idx" {
        return Err(EvalError::invalid(
            "num_segments",
            "only with seq_idx (the other forms give the segments)",
        ));
    }
    if case.has("first_offset") && from == "position_ids" {
        return Err(EvalError::invalid(
            "first_offset",
            "not with position_ids (the first offset is position_ids[0])",
        ));
    }
    // Every segment's first position but the first (`batch`'s
    // position_offset); the first segment's is first_offset.
    let position_offset = case.opt_usize("position_offset")?.unwrap_or(0);
    let mut first_offset = case.opt_usize("first_offset")?.unwrap_or(position_offset);
    // (cu_seqlens, real slots, n_slots)
    let (cu, slots, n_slots) = match from {
        "position_ids" => {
            let pos = case.usize_list("position_ids")?;
            check_values("position_ids", &[pos.len(), TOKEN_VALUES], CONVERTED)?;
            if let Some(i) = pos.iter().position(|&p| p as u64 > MAX_POSITION) {
                return Err(EvalError::invalid(
                    &format!("position_ids[{i}]"),
                    format!("{} is over {MAX_POSITION}", pos[i]),
                ));
            }
            first_offset = pos.first().copied().unwrap_or(0);
            let n = pos.len();
            (cu_seqlens_from_position_ids(&pos), (0..n).collect(), n)
        }
        "cu_seqlens" => {
            let cu = case.usize_list("cu_seqlens")?;
            let n = cu.last().copied().unwrap_or(0);
            check_cu_seqlens_named("cu_seqlens", "cu_seqlens", &cu, n)?;
            // positions, seq_idx, slots, doc ids: 4 values per token.
            check_values("cu_seqlens", &[n, TOKEN_VALUES], CONVERTED)?;
            (cu, (0..n).collect(), n)
        }
        "seq_idx" => {
            let idx = case.usize_list("seq_idx")?;
            let num = match case.opt_usize("num_segments")? {
                Some(s) => s,
                None => idx.iter().max().map_or(0, |&m| m.saturating_add(1)),
            };
            // Each segment's count and offset, and the offset in the
            // result (measured: 150 bytes per segment at 4 x 10^6 empty
            // segments, under the 192 of 2 values).
            check_values(
                "num_segments",
                &[num.saturating_add(1), 2],
                "the cu_seqlens of num_segments segments",
            )?;
            let n = idx.len();
            check_values("seq_idx", &[n, TOKEN_VALUES], CONVERTED)?;
            (cu_seqlens_from_seq_idx(&idx, num)?, (0..n).collect(), n)
        }
        _ => {
            let d = case.usize_list("doc_ids")?;
            check_values("doc_ids", &[d.len(), TOKEN_VALUES], CONVERTED)?;
            let (slots, cu) = varlen_from_doc_ids(&d)?;
            (cu, slots, d.len())
        }
    };
    let n_tok = slots.len();
    // (From position_ids the first segment's positions are given, so at
    // most MAX_POSITION already.)
    if from != "position_ids" && first_offset as u128 + n_tok as u128 > MAX_POSITION as u128 {
        // first_offset defaults to position_offset: name the one given.
        let given = if case.has("first_offset") || !case.has("position_offset") {
            "first_offset"
        } else {
            "position_offset"
        };
        return Err(EvalError::invalid(
            given,
            format!("{first_offset} + {n_tok} tokens is over {MAX_POSITION}"),
        ));
    }
    if position_offset as u128 + n_tok as u128 > MAX_POSITION as u128 {
        return Err(EvalError::invalid(
            "position_offset",
            format!("{position_offset} + {n_tok} tokens is over {MAX_POSITION}"),
        ));
    }
    let mut position_ids = position_ids_from_cu_seqlens(&cu, first_offset)?;
    let seq_idx = seq_idx_from_cu_seqlens(&cu)?;
    // position_ids_from_cu_seqlens counts every segment but the first from
    // 0; `batch` counts each from position_offset.
    for (p, &s) in position_ids.iter_mut().zip(&seq_idx) {
        if s > 0 {
            *p += position_offset;
        }
    }
    let doc_ids = doc_ids_from_varlen(&slots, &cu, n_slots)?;
    let max_seqlen = cu.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0);
    Ok(json!({
        "op": "causal_conversions",
        "cu_seqlens": ints(&cu),
        "max_seqlen": max_seqlen,
        "num_segments": cu.len() - 1,
        "position_ids": ints(&position_ids),
        "seq_idx": ints(&seq_idx),
        "slots": ints(&slots),
        "doc_ids": ints(&doc_ids),
        "n_tok": n_tok,
        "n_slots": n_slots,
    }))
}

/// Refuses `want_grad: true` for an op without gradients.
fn no_gradients(case: &Case, op: &str) -> Result<(), EvalError> {
    if case.opt_bool("want_grad")? == Some(true) {
        let message = format!("{op} has no gradients");
        return Err(EvalError::invalid("want_grad", message));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `batch`'s rows with `position_offset` 2 (documents of 3 and 2 tokens:
    /// `[2, 3, 4, 2, 3]`) round-trip (issue 36); without the offset only the
    /// first segment keeps it (the negative control).
    #[test]
    fn position_offset_round_trips_a_batch_row() {
        let row = json!([2, 3, 4, 2, 3]);
        let with = causal_conversions(
            &json!({"op": "causal_conversions", "position_ids": row, "position_offset": 2}),
        )
        .unwrap();
        assert_eq!(with["position_ids"], row);
        assert_eq!(with["cu_seqlens"], json!([0, 3, 5]));
        let from_docs = causal_conversions(&json!({
            "op": "causal_conversions", "doc_ids": [1, 1, 1, 2, 2, 0], "position_offset": 2
        }))
        .unwrap();
        assert_eq!(from_docs["position_ids"], row);
        let without =
            causal_conversions(&json!({"op": "causal_conversions", "position_ids": row})).unwrap();
        assert_eq!(without["position_ids"], json!([2, 3, 4, 0, 1]));
        let e = causal_conversions(&json!({
            "op": "causal_conversions", "cu_seqlens": [0, 2], "position_offset": i64::MAX
        }))
        .unwrap_err();
        assert!(e.message.starts_with("position_offset"), "{}", e.message);
    }
}
