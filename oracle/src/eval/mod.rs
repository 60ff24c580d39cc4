//! `packshard eval`: the language-neutral oracle interface.
//!
//! A *case* is a JSON object with an `op` field; the result is a JSON object.
//! The field names are the contract of `docs/INTERFACE.md`. The ops that run
//! kernels take `impl`: any entry of the op's family in [`crate::registry`]
//! (the f64 `reference` by default); the entry's constructor is what runs.
//! Bad input gives an [`EvalError`] whose `kind` is one of `invalid_json`,
//! `unknown_op`, `missing_field`, `shape_mismatch`, `sequence_too_long`,
//! `index_out_of_range`, `non_finite_input`, `invalid_argument`; never a panic.

mod attention;
mod bert;
pub mod input;
mod pack;
pub mod vocab;

use serde_json::{json, Value};

pub use input::{Case, Tensor};

use crate::registry::{self, Family};

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
    /// The `impl` values it accepts: the names of its family's registry
    /// entries (`reference` first, the default), or `reference` alone for
    /// the ops that run no kernel.
    pub impls: Vec<&'static str>,
    run: fn(&Value, &str) -> Result<Value, EvalError>,
}

/// The `impl` values of `family`'s registry entries; `reference` alone
/// without a family.
fn impls(family: Option<Family>) -> Vec<&'static str> {
    match family {
        Some(f) => registry::of(f).iter().map(|e| e.name).collect(),
        None => vec![registry::REFERENCE],
    }
}

/// The implementation registered as `name` in `list` (a name `evaluate`
/// has already checked against the family).
///
/// # Errors
/// `invalid_argument` on `impl` when it cannot run here (a GPU kernel
/// without a device), or when `name` is not in `list`.
pub fn make<K: ?Sized>(list: &[registry::Entry<K>], name: &str) -> Result<Box<K>, EvalError> {
    let entry = registry::find(list, name)
        .ok_or_else(|| EvalError::invalid("impl", format!("no implementation {name:?}")))?;
    entry
        .make()
        .map_err(|u| EvalError::invalid("impl", format!("{name} cannot run here: {u}")))
}

/// Every op the build has, in the order `--list` prints them.
pub fn ops() -> Vec<Op> {
    vec![
        Op {
            name: "pack",
            summary: "pack lengths or a length histogram (SPFHP, LPFHP, NNLSHP, LPHP, FFD, BFD), with the LP lower bound on packs",
            impls: impls(None),
            run: |v, _| pack::pack(v),
        },
        Op {
            name: "batch",
            summary: "pack token sequences into input_ids, position_ids, sequence_ids, cu_seqlens",
            impls: impls(None),
            run: |v, _| pack::batch(v),
        },
        Op {
            name: "attention",
            summary: "varlen attention over cu_seqlens (flash_attn_varlen_func form): output, lse, gradients",
            impls: impls(Some(Family::Attention)),
            run: attention::attention,
        },
        Op {
            name: "bert",
            summary: "the reference BERT encoder on a real checkpoint: hidden states and pooled outputs, packed or padded",
            impls: impls(None),
            run: |v, _| bert::bert(v),
        },
        Op {
            name: "cross_entropy",
            summary: "cross-entropy of logits, unsharded or vocabulary-parallel (naive, alg1, alg2)",
            impls: impls(Some(Family::CrossEntropy)),
            run: vocab::cross_entropy_op,
        },
        Op {
            name: "linear_cross_entropy",
            summary: "output layer hidden @ weight^T and its cross-entropy, unsharded or vocabulary-parallel",
            impls: impls(Some(Family::LinearCrossEntropy)),
            run: vocab::linear_cross_entropy_op,
        },
        Op {
            name: "embedding",
            summary: "input embedding lookup and its weight gradient, unsharded or vocabulary-parallel",
            impls: impls(Some(Family::Embedding)),
            run: vocab::embedding_op,
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
