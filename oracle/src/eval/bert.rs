//! The `bert` op: the reference BERT encoder on a real checkpoint.

use std::path::Path;

use packshard_reference::bert::{BertModel, PackedAttention, TokenBatch};
use packshard_reference::packing::{Algorithm, PackedBatch, PackingConfig};
use serde_json::{json, Value};

use super::attention::nested2;
use super::num;
use super::pack::metrics_json;
use super::{Case, EvalError};

/// The most sequences one `bert` case may run (the reference is f64 and
/// single-threaded: a case is a check, not a dataset).
pub const MAX_SEQUENCES: usize = 4096;

/// `bert`: `model` (directory), `texts` or `sequences`, `packed` (true),
/// `max_seq_len` (the model's positions), `algorithm` (spfhp),
/// `max_sequences_per_pack`. Result: `token_ids`, `hidden`, `pooled`, and the
/// packing metrics when packed.
pub(super) fn bert(value: &Value) -> Result<Value, EvalError> {
    let case = Case::new(
        value,
        &[
            "model",
            "texts",
            "sequences",
            "packed",
            "max_seq_len",
            "algorithm",
            "max_sequences_per_pack",
        ],
    )?;
    if case.opt_bool("want_grad")?.unwrap_or(false) {
        return Err(EvalError::invalid(
            "want_grad",
            "the bert op returns no gradients",
        ));
    }
    let dir = case
        .opt_str("model")?
        .ok_or_else(|| EvalError::new("missing_field", "model: required field is missing"))?;
    let dir = Path::new(dir);
    let sequences: Vec<Vec<i64>> = match case.either("texts", "sequences")? {
        true => tokenize_texts(value, dir)?,
        false => case.i64_lists("sequences")?,
    };
    if sequences.len() > MAX_SEQUENCES {
        return Err(EvalError::invalid(
            "sequences",
            format!(
                "{} sequences is over the {MAX_SEQUENCES} one case may run",
                sequences.len()
            ),
        ));
    }
    let (model, _) = BertModel::load(dir)?;
    let max_seq_len = case
        .opt_usize("max_seq_len")?
        .unwrap_or(model.config.max_position_embeddings);
    if max_seq_len > model.config.max_position_embeddings {
        return Err(EvalError::invalid(
            "max_seq_len",
            format!(
                "{max_seq_len} is over the model's {} positions",
                model.config.max_position_embeddings
            ),
        ));
    }
    let packed = case.opt_bool("packed")?.unwrap_or(true);
    let mut out = serde_json::Map::new();
    out.insert("op".into(), json!("bert"));
    out.insert("token_ids".into(), json!(sequences));
    let result = if packed {
        let algorithm = case
            .opt_parse::<Algorithm>("algorithm")?
            .unwrap_or(Algorithm::Spfhp);
        let config = PackingConfig::new(algorithm, max_seq_len)
            .with_max_sequences_per_pack(case.opt_usize("max_sequences_per_pack")?);
        let (plan, batch) =
            PackedBatch::from_sequences(&sequences, &config, model.config.pad_token_id as i64, 0)?;
        out.extend(metrics_json(&plan.metrics));
        model.encode(&TokenBatch::packed(
            &batch,
            sequences.len(),
            None,
            PackedAttention::Varlen,
        )?)?
    } else {
        for f in ["algorithm", "max_sequences_per_pack"] {
            if case.has(f) {
                return Err(EvalError::invalid(f, "only applies with packed: true"));
            }
        }
        let row_len = sequences.iter().map(Vec::len).max().unwrap_or(0);
        if row_len > max_seq_len {
            let i = sequences
                .iter()
                .position(|s| s.len() == row_len)
                .unwrap_or(0);
            return Err(
                packshard_reference::Error::too_long("sequences", i, row_len, max_seq_len).into(),
            );
        }
        model.encode(&TokenBatch::padded(
            &sequences,
            None,
            row_len,
            model.config.pad_token_id,
            0,
        )?)?
    };
    out.insert(
        "hidden".into(),
        Value::Array(
            result
                .sequences
                .iter()
                .map(|s| nested2(s.hidden.view()))
                .collect(),
        ),
    );
    out.insert(
        "pooled".into(),
        Value::Array(
            result
                .sequences
                .iter()
                .map(|s| match &s.pooled {
                    Some(p) => Value::Array(p.iter().map(|&v| num(v)).collect()),
                    None => Value::Null,
                })
                .collect(),
        ),
    );
    Ok(Value::Object(out))
}

/// The `texts` of a case tokenized with the model's `tokenizer.json`.
#[cfg(feature = "text")]
fn tokenize_texts(value: &Value, dir: &Path) -> Result<Vec<Vec<i64>>, EvalError> {
    let texts = value["texts"]
        .as_array()
        .ok_or_else(|| EvalError::invalid("texts", "expected an array of strings"))?;
    let tok = crate::text::load_tokenizer(&dir.join("tokenizer.json"))
        .map_err(|e| EvalError::invalid("model", e))?;
    texts
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let t = t.as_str().ok_or_else(|| {
                EvalError::invalid(
                    &format!("texts[{i}]"),
                    format!("expected a string, found {}", super::input::show(t)),
                )
            })?;
            crate::text::encode(&tok, t).map_err(|e| EvalError::invalid(&format!("texts[{i}]"), e))
        })
        .collect()
}

/// Without the `text` feature there is no tokenizer: `texts` is refused.
#[cfg(not(feature = "text"))]
fn tokenize_texts(_value: &Value, _dir: &Path) -> Result<Vec<Vec<i64>>, EvalError> {
    Err(EvalError::invalid(
        "texts",
        "this build has no tokenizer (feature `text`); give token ids as sequences",
    ))
}
