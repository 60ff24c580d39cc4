//! `packshard eval`: the language-neutral oracle interface.
//!
//! A *case* is a JSON object with an `op` field; the result is a JSON object.
//! The field names are the contract of `shared/docs/INTERFACE.md` (mirrored in
//! `docs/INTERFACE.md` of this repository with the ops each issue added).
//! Bad input gives an [`EvalError`] whose `kind` is one of `invalid_json`,
//! `unknown_op`, `missing_field`, `shape_mismatch`, `sequence_too_long`,
//! `index_out_of_range`, `non_finite_input`, `invalid_argument`; never a panic.

mod attention;
mod bert;
pub mod input;
mod pack;
mod vocab;

use serde_json::{json, Value};

pub use input::{Case, Tensor};

/// An error of the eval contract: a snake_case `kind` and a message that names
/// the field and index.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct EvalError {
    /// One of the contract's kinds (`missing_field`, `shape_mismatch`, ...).
    pub kind: &'static str,
    /// What is wrong, naming the field and index.
    pub message: String,
}

impl EvalError {
    /// An error of the given kind.
    pub fn new(kind: &'static str, message: impl Into<String>) -> Self {
        EvalError {
            kind,
            message: message.into(),
        }
    }

    /// An `invalid_argument` error on `field`.
    pub fn invalid(field: &str, message: impl std::fmt::Display) -> Self {
        EvalError::new("invalid_argument", format!("{field}: {message}"))
    }

    /// The error object printed by `packshard eval`: `{"error": {"kind", "message"}}`.
    pub fn to_json(&self) -> Value {
        json!({"error": {"kind": self.kind, "message": self.message}})
    }
}

impl From<packshard_reference::Error> for EvalError {
    fn from(e: packshard_reference::Error) -> Self {
        EvalError::new(e.kind(), e.to_string())
    }
}

/// One operation of the interface.
pub struct Op {
    /// The `op` string.
    pub name: &'static str,
    /// One line on what it computes.
    pub summary: &'static str,
    /// The `impl` values it accepts: `reference` (the default) and the
    /// optimized variants of `packshard_optimized::variants` for this op.
    pub impls: Vec<&'static str>,
    run: fn(&Value, &str) -> Result<Value, EvalError>,
}

/// `reference` and the optimized variants `packshard eval` accepts for `op`.
fn impls(op: &str) -> Vec<&'static str> {
    let mut all = vec!["reference"];
    all.extend(packshard_optimized::variants::eval_impls(op));
    all
}

/// Every op the build has, in the order `--list` prints them.
pub fn ops() -> Vec<Op> {
    vec![
        Op {
            name: "pack",
            summary: "pack lengths or a length histogram (SPFHP, LPFHP, NNLSHP, LPHP, FFD, BFD), with the LP lower bound on packs",
            impls: impls("pack"),
            run: |v, _| pack::pack(v),
        },
        Op {
            name: "batch",
            summary: "pack token sequences into input_ids, position_ids, sequence_ids, cu_seqlens",
            impls: impls("batch"),
            run: |v, _| pack::batch(v),
        },
        Op {
            name: "attention",
            summary: "varlen attention over cu_seqlens (flash_attn_varlen_func form): output, lse, gradients",
            impls: impls("attention"),
            run: attention::attention,
        },
        Op {
            name: "bert",
            summary: "the reference BERT encoder on a real checkpoint: hidden states and pooled outputs, packed or padded",
            impls: impls("bert"),
            run: |v, _| bert::bert(v),
        },
        Op {
            name: "cross_entropy",
            summary: "cross-entropy of logits, unsharded or vocabulary-parallel (naive, alg1, alg2)",
            impls: impls("cross_entropy"),
            run: vocab::cross_entropy_op,
        },
        Op {
            name: "linear_cross_entropy",
            summary: "output layer hidden @ weight^T and its cross-entropy, unsharded or vocabulary-parallel",
            impls: impls("linear_cross_entropy"),
            run: vocab::linear_cross_entropy_op,
        },
        Op {
            name: "embedding",
            summary: "input embedding lookup and its weight gradient, unsharded or vocabulary-parallel",
            impls: impls("embedding"),
            run: |v, _| vocab::embedding_op(v),
        },
    ]
}

/// The `--list` answer: every op with its impls and summary.
pub fn list() -> Value {
    let ops: Vec<Value> = ops()
        .iter()
        .map(|op| json!({"op": op.name, "impls": op.impls, "summary": op.summary}))
        .collect();
    json!({ "ops": ops })
}

/// Evaluates one case.
///
/// # Errors
/// An [`EvalError`] for anything wrong with the case; see the module docs.
pub fn evaluate(case: &Value) -> Result<Value, EvalError> {
    let obj = case
        .as_object()
        .ok_or_else(|| EvalError::new("invalid_json", "a case must be a JSON object"))?;
    let name = match obj.get("op") {
        Some(Value::String(s)) => s.as_str(),
        Some(other) => {
            return Err(EvalError::invalid(
                "op",
                format!("expected a string, found {other}"),
            ))
        }
        None => {
            return Err(EvalError::new(
                "missing_field",
                "op: required field is missing",
            ))
        }
    };
    let all = ops();
    let op = all.iter().find(|o| o.name == name).ok_or_else(|| {
        let names: Vec<_> = all.iter().map(|o| o.name).collect();
        EvalError::new(
            "unknown_op",
            format!("op: unknown op {name:?}; known: {}", names.join(", ")),
        )
    })?;
    let mut chosen = "reference";
    if let Some(imp) = obj.get("impl") {
        let imp = imp
            .as_str()
            .ok_or_else(|| EvalError::invalid("impl", format!("expected a string, found {imp}")))?;
        chosen = op.impls.iter().copied().find(|i| *i == imp).unwrap_or("");
        if chosen.is_empty() {
            return Err(EvalError::invalid(
                "impl",
                format!(
                    "{name} has no impl {imp:?}; available: {}",
                    op.impls.join(", ")
                ),
            ));
        }
    }
    (op.run)(case, chosen)
}

/// Parses and evaluates one case given as text.
///
/// # Errors
/// `invalid_json` for text that is not JSON; otherwise as [`evaluate`].
pub fn evaluate_str(text: &str) -> Result<Value, EvalError> {
    let value: Value =
        serde_json::from_str(text).map_err(|e| EvalError::new("invalid_json", e.to_string()))?;
    evaluate(&value)
}
