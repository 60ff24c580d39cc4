//! The typed fields of a result, in the order `packshard eval` prints them:
//! what the typed runners ([`super::loss`]) return, the JSON of `eval` and
//! the dict of the Python package are both written from them.

use ndarray::ArrayViewD;
use serde_json::{json, Value};

use super::num;

/// One field of a result.
#[derive(Debug, Clone, PartialEq)]
pub enum Out {
    /// A scalar.
    F64(f64),
    /// A count.
    Usize(usize),
    /// An integer option (`ignore_index`).
    I64(i64),
    /// A flag.
    Bool(bool),
    /// A name.
    Str(String),
    /// A tensor of any rank (`[]` for a scalar loss in comparisons).
    Tensor(ndarray::ArrayD<f64>),
    /// Integers (targets, ids, `cu_seqlens`).
    Ints(Vec<i64>),
    /// Anything else, as the eval result spells it (`shards`, `collectives`).
    Json(Value),
}

/// The fields of a result, in the order `packshard eval` prints them.
pub type Fields = Vec<(&'static str, Out)>;

/// A tensor as nested JSON arrays (rank 0: the number), non-finite values
/// spelled as the contract does (`"inf"`, `"-inf"`, `"nan"`).
fn tensor_json(t: ArrayViewD<'_, f64>) -> Value {
    if t.ndim() == 0 {
        return num(t.iter().next().copied().unwrap_or(f64::NAN));
    }
    Value::Array(t.outer_iter().map(tensor_json).collect())
}

/// One field as `packshard eval` prints it.
pub fn to_json(out: &Out) -> Value {
    match out {
        Out::F64(x) => num(*x),
        Out::Usize(n) => json!(n),
        Out::I64(n) => json!(n),
        Out::Bool(b) => json!(b),
        Out::Str(s) => json!(s),
        Out::Tensor(t) => tensor_json(t.view()),
        Out::Ints(xs) => json!(xs),
        Out::Json(v) => v.clone(),
    }
}
