//! The training step's plan (issue #34, docs/STEP.md): `step_plan` splits a
//! global batch of documents into microbatches, data-parallel and
//! context-parallel ranks as [`packshard_reference::step`] does, and gives
//! every rank's slots with their loss weights, so a framework author can
//! check their CP partitioner (token indices, padded and real `cu_seqlens`,
//! `position_ids`, labels shifted before the split) and their loss scaling
//! (global denominators) against it. Bad input gets the reference's errors
//! (docs/FAULTS.md D1..D8 are what the weights and the split guard).

use packshard_reference::decoder::CausalReduction;
use packshard_reference::step::{step_weights, Layout, StepBatch};
use packshard_reference::vocab::IGNORE_INDEX;
use serde_json::{json, Value};

use super::input::Case;
use super::{check_values, EvalError};

/// Values of the result per slot: token index, position, input id, label,
/// weight, document.
const PER_SLOT: usize = 6;

/// `step_plan`: `documents` ([[token ids], ...], the global batch),
/// `grad_accum` (`G`, default 1), `dp` (`D`, default 1), `cp` (`C`,
/// default 1), `reduction` (`per-token` default, `per-document`,
/// `per-row`), `eos_token_id` (absent: a document's last token predicts
/// nothing). Result: `microbatches` (`G D` of them, microbatch `m` =
/// accumulation step `m / D` of data-parallel rank `m mod D`), each with
/// `grad_accum_step`, `dp_rank`, `documents` (batch indices, document `i`
/// in microbatch `i mod G D`), `cu_seqlens` and `cu_seqlens_padded` of its
/// pack (`[b + 1]`, each document padded to a multiple of `2 C`), and
/// `ranks` (`C`): `token_index` (each local slot's index in the padded
/// pack), `cu_seqlens_padded` (local, the global / `C`), `cu_seqlens`
/// (local running count of real tokens per document), `position_ids`,
/// `input_ids` (padding 0), `labels` (-100 where nothing is predicted),
/// `loss_weights` (global denominators); and `num_predicted`.
pub(super) fn step_plan(value: &Value) -> Result<Value, EvalError> {
    let case = Case::new(
        value,
        &[
            "documents",
            "grad_accum",
            "dp",
            "cp",
            "reduction",
            "eos_token_id",
        ],
    )?;
    if case.opt_bool("want_grad")? == Some(true) {
        return Err(EvalError::invalid(
            "want_grad",
            "step_plan has no gradients",
        ));
    }
    let docs = case.i64_lists("documents")?;
    for (i, d) in docs.iter().enumerate() {
        if let Some(j) = d.iter().position(|&t| t < 0) {
            return Err(EvalError::invalid(
                &format!("documents[{i}][{j}]"),
                format!("{} is negative (token ids are >= 0)", d[j]),
            ));
        }
    }
    let layout = Layout {
        grad_accum: case.opt_usize("grad_accum")?.unwrap_or(1),
        dp: case.opt_usize("dp")?.unwrap_or(1),
        cp: case.opt_usize("cp")?.unwrap_or(1),
    };
    layout.check()?;
    let reduction = match case.opt_str("reduction")?.unwrap_or("per-token") {
        "per-token" => CausalReduction::PerToken,
        "per-document" => CausalReduction::PerDocument,
        "per-row" => CausalReduction::PerRow,
        other => {
            return Err(EvalError::invalid(
                "reduction",
                format!("{other:?}: one of per-token, per-document, per-row"),
            ))
        }
    };
    let eos = case.opt_i64("eos_token_id")?;
    if let Some(e) = eos.filter(|&e| e < 0) {
        return Err(EvalError::invalid(
            "eos_token_id",
            format!("{e} is negative (token ids are >= 0)"),
        ));
    }
    // Each document's slots after padding to 2 C, before any allocation.
    let slots = docs.iter().try_fold(0usize, |acc, d| {
        d.len()
            .checked_next_multiple_of(2 * layout.cp)
            .and_then(|p| acc.checked_add(p))
    });
    check_values(
        "documents",
        &[slots.unwrap_or(usize::MAX), PER_SLOT],
        "the step's padded slots",
    )?;
    let batch = StepBatch {
        docs,
        eos,
        reduction,
    };
    let mbs = step_weights(&batch, &layout, None)?;
    let mut num_predicted = 0;
    let microbatches: Vec<Value> = mbs
        .iter()
        .map(|mb| {
            let ranks: Vec<Value> = mb
                .partition
                .ranks
                .iter()
                .zip(&mb.weights)
                .map(|(s, w)| {
                    num_predicted += s.labels.iter().filter(|&&l| l != IGNORE_INDEX).count();
                    json!({
                        "rank": s.rank,
                        "token_index": s.token_index,
                        "cu_seqlens_padded": s.cu_seqlens_padded,
                        "cu_seqlens": s.cu_seqlens,
                        "position_ids": s.position_ids,
                        "input_ids": s.input_ids,
                        "labels": s.labels,
                        "loss_weights": w,
                    })
                })
                .collect();
            json!({
                "grad_accum_step": mb.g,
                "dp_rank": mb.d,
                "documents": mb.docs,
                "cu_seqlens": mb.partition.cu_seqlens,
                "cu_seqlens_padded": mb.partition.cu_seqlens_padded,
                "ranks": ranks,
            })
        })
        .collect();
    Ok(json!({
        "op": "step_plan",
        "microbatches": microbatches,
        "num_predicted": num_predicted,
    }))
}
