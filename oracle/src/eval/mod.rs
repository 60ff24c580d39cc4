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
pub mod attention_runner;
mod bert;
mod causal;
mod decoder;
pub mod fields;
pub mod input;
pub mod loss;
mod pack;
mod step;
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
    run: Runs,
}

/// What an op runs on a case.
enum Runs {
    /// An entry of the family's registry: `run(case, impl)`.
    Kernel(Family, fn(&Value, &str) -> Result<Value, EvalError>),
    /// No kernel (`impl` is `reference` alone): `run(case)`.
    Plain(fn(&Value) -> Result<Value, EvalError>),
}

impl Op {
    fn new(name: &'static str, run: Runs, summary: &'static str) -> Op {
        let impls = match run {
            Runs::Kernel(family, _) => impls(Some(family)),
            Runs::Plain(_) => impls(None),
        };
        Op {
            name,
            summary,
            impls,
            run,
        }
    }
}

/// The `impl` values of `family`'s registry entries; `reference` alone
/// without a family.
fn impls(family: Option<Family>) -> Vec<&'static str> {
    match family {
        Some(f) => registry::of(f).iter().map(|e| e.name).collect(),
        None => vec![registry::REFERENCE],
    }
}

/// The error for an `impl` that `op` does not have (`impls`: the names it
/// has), the first check of every op that runs a kernel.
pub fn no_impl(op: &str, imp: &str, impls: &[&str]) -> EvalError {
    EvalError::invalid(
        "impl",
        format!(
            "{op} has no impl {}; available: {}",
            input::show(&Value::String(imp.to_string())),
            impls.join(", ")
        ),
    )
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

/// A JSON number, or `"inf"`, `"-inf"`, `"nan"` for non-finite values
/// (JSON has no literal for them: the contract's spelling).
pub(crate) fn num(x: f64) -> Value {
    if x.is_finite() {
        json!(x)
    } else if x.is_nan() {
        json!("nan")
    } else if x > 0.0 {
        json!("inf")
    } else {
        json!("-inf")
    }
}

/// Every op the build has, in the order `--list` prints them: one row each,
/// `(op, what runs, summary)`.
#[rustfmt::skip]
pub fn ops() -> Vec<Op> {
    use Runs::{Kernel, Plain};
    vec![
        Op::new("pack", Plain(pack::pack), "pack lengths or a length histogram (SPFHP, LPFHP, NNLSHP, LPHP, FFD, BFD), with the LP lower bound on packs"),
        Op::new("batch", Plain(pack::batch), "pack token sequences into input_ids, position_ids, sequence_ids, cu_seqlens"),
        Op::new("attention", Kernel(Family::Attention, attention::attention), "varlen attention over cu_seqlens (flash_attn_varlen_func form): output, lse, gradients"),
        Op::new("bert", Plain(bert::bert), "the reference BERT encoder on a real checkpoint: hidden states and pooled outputs, packed or padded"),
        Op::new("cross_entropy", Kernel(Family::CrossEntropy, vocab::cross_entropy_op), "cross-entropy of logits, unsharded or vocabulary-parallel (naive, alg1, alg2)"),
        Op::new("linear_cross_entropy", Kernel(Family::LinearCrossEntropy, vocab::linear_cross_entropy_op), "output layer hidden @ weight^T and its cross-entropy, unsharded or vocabulary-parallel"),
        Op::new("embedding", Kernel(Family::Embedding, vocab::embedding_op), "input embedding lookup and its weight gradient, unsharded or vocabulary-parallel"),
        Op::new("causal_labels", Plain(causal::causal_labels), "causal-LM next-token labels inside each packed document, and each slot's loss weight per reduction"),
        Op::new("causal_conversions", Plain(causal::causal_conversions), "position_ids, cu_seqlens, seq_idx and document ids of a packed batch into one another, with max_seqlen"),
        Op::new("decoder_forward_backward", Plain(decoder::decoder_forward_backward), "the f64 reference causal decoder on given weights over packed documents: next-token loss, logits and every parameter's gradient"),
        Op::new("step_plan", Plain(step::step_plan), "the training step's split of a global batch over accumulation steps, data-parallel and context-parallel ranks: each rank's slots, cu_seqlens, positions, labels and global-denominator loss weights"),
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
                format!("expected a string, found {}", input::show(other)),
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
            format!(
                "op: unknown op {}; known: {}",
                input::show(&Value::String(name.to_string())),
                names.join(", ")
            ),
        )
    })?;
    let mut chosen = "reference";
    if let Some(imp) = obj.get("impl") {
        let imp = imp.as_str().ok_or_else(|| {
            EvalError::invalid(
                "impl",
                format!("expected a string, found {}", input::show(imp)),
            )
        })?;
        chosen = op.impls.iter().copied().find(|i| *i == imp).unwrap_or("");
        if chosen.is_empty() {
            return Err(no_impl(name, imp, &op.impls));
        }
    }
    match op.run {
        Runs::Kernel(_, run) => run(case, chosen),
        Runs::Plain(run) => run(case),
    }
}

/// Bytes `eval` holds per value it computes: the f64 (8), its copies in
/// the op's working buffers and per shard (~4 x 8), and its place in the
/// result (a `serde_json::Value`, 32, and its text, ~24).
pub const BYTES_PER_RESULT_VALUE: u64 = 96;

/// Checks, before an op runs, that `values` computed values (from the
/// case's shapes: the `[n, v]` logits of the output layer, the `[n, h]`
/// lookup of an embedding) fit the memory budget.
///
/// # Errors
/// `invalid_argument` naming `field`.
pub(crate) fn check_values(field: &str, values: &[usize], what: &str) -> Result<(), EvalError> {
    let count = values
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d as u64));
    let bytes = count.and_then(|c| c.checked_mul(BYTES_PER_RESULT_VALUE));
    packshard_reference::limits::check_estimate(field, bytes, what).map_err(EvalError::from)
}

/// The most bytes of one case (`packshard eval` holds up to ~100 x its
/// text while parsing and computing): the memory budget over
/// [`INPUT_EXPANSION`], and never more than 256 MiB.
///
/// # Errors
/// As [`packshard_reference::limits::memory_budget`].
pub fn max_case_bytes() -> Result<u64, EvalError> {
    let budget = packshard_reference::limits::memory_budget()?;
    Ok((budget / INPUT_EXPANSION).min(MAX_CASE_BYTES))
}

/// How many bytes of memory `eval` may hold per byte of a case's text (the
/// parsed `serde_json::Value`, ~40 bytes per number of 2–20 characters, and
/// the op's f64 copies): measured ~80 on tensors of short numbers.
pub const INPUT_EXPANSION: u64 = 128;

/// The cap on one case's size whatever the budget: 256 MiB.
pub const MAX_CASE_BYTES: u64 = 256 << 20;

/// Parses one case: JSON text (a leading UTF-8 byte-order mark is skipped)
/// whose objects have no repeated key.
///
/// # Errors
/// `invalid_json` for text that is not JSON, and for a key given twice in
/// one object (naming the key: JSON parsers disagree on which one wins, so
/// the oracle takes neither); `invalid_argument` for text over
/// [`max_case_bytes`].
pub fn parse_case(text: &str) -> Result<Value, EvalError> {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let cap = max_case_bytes()?;
    if text.len() as u64 > cap {
        return Err(EvalError::invalid(
            "case",
            format!(
                "{} bytes is over the {cap} bytes one case may have (the memory budget / {INPUT_EXPANSION}; set {} to change it)",
                text.len(),
                packshard_reference::limits::MEMORY_BUDGET_ENV
            ),
        ));
    }
    let mut de = serde_json::Deserializer::from_str(text);
    let parsed = serde::Deserialize::deserialize(&mut de).and_then(|v: NoDuplicates| {
        de.end()?;
        Ok(v.0)
    });
    parsed.map_err(|e| EvalError::new("invalid_json", json_error(&e)))
}

/// serde_json's message, with the reason a text that starts wrongly cannot
/// be a case.
fn json_error(e: &serde_json::Error) -> String {
    let msg = e.to_string();
    if e.is_eof() && e.line() == 1 && e.column() == 0 {
        return "the case is empty: expected a JSON object".to_string();
    }
    msg
}

/// A JSON value deserialized with every object's keys checked for repeats.
struct NoDuplicates(Value);

impl<'de> serde::Deserialize<'de> for NoDuplicates {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(NoDuplicatesVisitor).map(NoDuplicates)
    }
}

struct NoDuplicatesVisitor;

impl<'de> serde::de::Visitor<'de> for NoDuplicatesVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number))
    }
    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_string()))
    }
    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
        while let Some(NoDuplicates(v)) = seq.next_element()? {
            items.push(v);
        }
        Ok(Value::Array(items))
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut obj = serde_json::Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if obj.contains_key(&key) {
                return Err(serde::de::Error::custom(format!(
                    "duplicate key {} (each field may be given once)",
                    input::show(&Value::String(key))
                )));
            }
            let NoDuplicates(v) = map.next_value()?;
            obj.insert(key, v);
        }
        Ok(Value::Object(obj))
    }
}

/// Parses and evaluates one case given as text.
///
/// # Errors
/// `invalid_json` for text that is not JSON or repeats a key; otherwise as
/// [`evaluate`].
pub fn evaluate_str(text: &str) -> Result<Value, EvalError> {
    evaluate(&parse_case(text)?)
}
