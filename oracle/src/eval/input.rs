//! Typed access to the fields of one JSON case, with errors that name the field
//! and index (the `packshard eval` error contract, `docs/INTERFACE.md`).

use serde_json::{Map, Value};

use super::EvalError;

/// One case: a JSON object whose fields are read with typed getters.
pub struct Case<'a> {
    obj: &'a Map<String, Value>,
}

/// A dense tensor read from nested JSON arrays (row-major).
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    /// Extent of each dimension.
    pub shape: Vec<usize>,
    /// Values in row-major order.
    pub data: Vec<f64>,
}

impl<'a> Case<'a> {
    /// Wraps `value`, which must be an object whose fields are all in `allowed`
    /// (plus the common `op`, `impl`, `want_grad`).
    pub fn new(value: &'a Value, allowed: &[&str]) -> Result<Self, EvalError> {
        let obj = value
            .as_object()
            .ok_or_else(|| EvalError::new("invalid_json", "a case must be a JSON object"))?;
        // A set, not a scan of `allowed` per key: the decoder allows every
        // key it was given while it reads its config, and 100,000 keys
        // checked against a list of 100,000 took 13 s.
        let known: std::collections::HashSet<&str> = allowed.iter().copied().collect();
        for key in obj.keys() {
            if !["op", "impl", "want_grad"].contains(&key.as_str()) && !known.contains(key.as_str())
            {
                return Err(EvalError::new(
                    "invalid_argument",
                    format!(
                        "{}: unknown field for this op (known: {})",
                        packshard_reference::error::brief(key),
                        allowed.join(", ")
                    ),
                ));
            }
        }
        Ok(Case { obj })
    }

    /// True if the field is present and not null.
    pub fn has(&self, name: &str) -> bool {
        self.obj.get(name).is_some_and(|v| !v.is_null())
    }

    /// Which of two exclusive fields the case gives: `true` for `first`,
    /// `false` for `second`.
    ///
    /// # Errors
    /// `invalid_argument` on `second` when both are given; `missing_field`
    /// on `first` when neither is.
    pub fn either(&self, first: &str, second: &str) -> Result<bool, EvalError> {
        match (self.has(first), self.has(second)) {
            (true, true) => Err(EvalError::invalid(
                second,
                format!("give either {first} or {second}, not both"),
            )),
            (false, false) => Err(EvalError::new(
                "missing_field",
                format!("{first}: required field is missing (or give {second})"),
            )),
            (given_first, _) => Ok(given_first),
        }
    }

    fn get(&self, name: &str) -> Option<&'a Value> {
        self.obj.get(name).filter(|v| !v.is_null())
    }

    fn require(&self, name: &str) -> Result<&'a Value, EvalError> {
        self.get(name).ok_or_else(|| {
            EvalError::new(
                "missing_field",
                format!("{name}: required field is missing"),
            )
        })
    }

    /// A required non-negative integer.
    pub fn usize(&self, name: &str) -> Result<usize, EvalError> {
        as_usize(self.require(name)?, name)
    }

    /// An optional non-negative integer.
    pub fn opt_usize(&self, name: &str) -> Result<Option<usize>, EvalError> {
        self.get(name).map(|v| as_usize(v, name)).transpose()
    }

    /// An optional integer.
    pub fn opt_i64(&self, name: &str) -> Result<Option<i64>, EvalError> {
        self.get(name)
            .map(|v| {
                v.as_i64()
                    .ok_or_else(|| EvalError::invalid(name, not_integer("an integer", v)))
            })
            .transpose()
    }

    /// An optional finite number.
    pub fn opt_f64(&self, name: &str) -> Result<Option<f64>, EvalError> {
        self.get(name).map(|v| as_f64(v, name)).transpose()
    }

    /// An optional boolean.
    pub fn opt_bool(&self, name: &str) -> Result<Option<bool>, EvalError> {
        self.get(name)
            .map(|v| {
                v.as_bool().ok_or_else(|| {
                    EvalError::invalid(name, format!("expected true or false, found {}", show(v)))
                })
            })
            .transpose()
    }

    /// An optional string.
    pub fn opt_str(&self, name: &str) -> Result<Option<&'a str>, EvalError> {
        self.get(name)
            .map(|v| {
                v.as_str().ok_or_else(|| {
                    EvalError::invalid(name, format!("expected a string, found {}", show(v)))
                })
            })
            .transpose()
    }

    /// An optional value parsed from a string with `FromStr`.
    pub fn opt_parse<T>(&self, name: &str) -> Result<Option<T>, EvalError>
    where
        T: std::str::FromStr<Err = packshard_reference::Error>,
    {
        self.opt_str(name)?
            .map(|s| s.parse::<T>().map_err(EvalError::from))
            .transpose()
    }

    /// A required list of non-negative integers (`[n]`).
    pub fn usize_list(&self, name: &str) -> Result<Vec<usize>, EvalError> {
        let items = as_array(self.require(name)?, name)?;
        items
            .iter()
            .enumerate()
            .map(|(i, v)| as_usize(v, &format!("{name}[{i}]")))
            .collect()
    }

    /// A required list of integers (`[n]`, negative allowed).
    pub fn i64_list(&self, name: &str) -> Result<Vec<i64>, EvalError> {
        let items = as_array(self.require(name)?, name)?;
        items
            .iter()
            .enumerate()
            .map(|(i, v)| {
                v.as_i64().ok_or_else(|| {
                    EvalError::invalid(&format!("{name}[{i}]"), not_integer("an integer", v))
                })
            })
            .collect()
    }

    /// A required list of lists of integers (`[[...], ...]`, ragged allowed).
    pub fn i64_lists(&self, name: &str) -> Result<Vec<Vec<i64>>, EvalError> {
        let items = as_array(self.require(name)?, name)?;
        items
            .iter()
            .enumerate()
            .map(|(i, row)| {
                as_array(row, &format!("{name}[{i}]"))?
                    .iter()
                    .enumerate()
                    .map(|(j, v)| {
                        v.as_i64().ok_or_else(|| {
                            EvalError::invalid(
                                &format!("{name}[{i}][{j}]"),
                                not_integer("an integer", v),
                            )
                        })
                    })
                    .collect()
            })
            .collect()
    }

    /// A required list of `[a, b]` non-negative integer pairs.
    pub fn pairs(&self, name: &str) -> Result<Vec<(usize, u64)>, EvalError> {
        let items = as_array(self.require(name)?, name)?;
        items
            .iter()
            .enumerate()
            .map(|(i, pair)| {
                let field = format!("{name}[{i}]");
                let p = as_array(pair, &field)?;
                if p.len() != 2 {
                    return Err(EvalError::new(
                        "shape_mismatch",
                        format!(
                            "{field}: expected a pair [length, count], found {} items",
                            p.len()
                        ),
                    ));
                }
                Ok((
                    as_usize(&p[0], &format!("{field}[0]"))?,
                    as_usize(&p[1], &format!("{field}[1]"))? as u64,
                ))
            })
            .collect()
    }

    /// A required tensor of `ndim` dimensions (nested arrays, row-major,
    /// finite numbers). `legend` names the expected shape for errors, e.g. `[n_tok, h, d]`.
    pub fn tensor(&self, name: &str, ndim: usize, legend: &str) -> Result<Tensor, EvalError> {
        let value = self.require(name)?;
        let mut shape = Vec::new();
        let mut probe = value;
        while let Value::Array(items) = probe {
            shape.push(items.len());
            match items.first() {
                Some(first) => probe = first,
                None => break,
            }
        }
        if shape.len() < ndim && shape.last() == Some(&0) {
            shape.resize(ndim, 0);
        }
        if shape.len() != ndim {
            return Err(EvalError::new(
                "shape_mismatch",
                format!(
                    "{name}: expected a {ndim}-d tensor {legend}, found {} nesting levels",
                    shape.len()
                ),
            ));
        }
        // No capacity from `shape`: it is the first-element chain, and a
        // ragged tensor's chain can claim terabytes (an 80 KB case asked for
        // 8 TB) before the ragged check runs; the vector grows with the
        // values present, which the case's size bounds.
        let mut data = Vec::new();
        flatten(value, &shape, 0, name, &mut data)?;
        Ok(Tensor { shape, data })
    }
}

fn flatten(
    value: &Value,
    shape: &[usize],
    depth: usize,
    path: &str,
    out: &mut Vec<f64>,
) -> Result<(), EvalError> {
    if depth == shape.len() {
        out.push(tensor_leaf(value, path)?);
        return Ok(());
    }
    let items = value.as_array().ok_or_else(|| {
        EvalError::new(
            "shape_mismatch",
            format!(
                "{path}: expected an array at depth {depth}, found {}",
                show(value)
            ),
        )
    })?;
    if items.len() != shape[depth] {
        return Err(EvalError::new(
            "shape_mismatch",
            format!(
                "{path}: has {} items where its siblings have {} (ragged tensor)",
                items.len(),
                shape[depth]
            ),
        ));
    }
    for (i, item) in items.iter().enumerate() {
        flatten(item, shape, depth + 1, &format!("{path}[{i}]"), out)?;
    }
    Ok(())
}

/// Every number of a JSON value, nested arrays flattened in row-major
/// order, the strings `inf`, `-inf`, `nan` read as [`tensor_leaf`] does:
/// a result field read back, whatever its shape.
///
/// # Errors
/// `invalid_argument` naming `path` for a leaf that is no number.
pub fn numbers(value: &Value, path: &str) -> Result<Vec<f64>, EvalError> {
    fn collect(value: &Value, path: &str, out: &mut Vec<f64>) -> Result<(), EvalError> {
        match value {
            Value::Array(items) => items.iter().try_for_each(|x| collect(x, path, out)),
            leaf => {
                out.push(tensor_leaf(leaf, path)?);
                Ok(())
            }
        }
    }
    let mut out = Vec::new();
    collect(value, path, &mut out)?;
    Ok(out)
}

/// A tensor element: a JSON number, or one of the strings `inf`, `-inf`,
/// `nan` (JSON has no literal for them; masked logits need `-inf`). Each op
/// decides whether non-finite values are allowed.
fn tensor_leaf(value: &Value, path: &str) -> Result<f64, EvalError> {
    if let Some(v) = value.as_f64() {
        return Ok(v);
    }
    // Exactly the three documented spellings (docs/INTERFACE.md): "Infinity",
    // "-INF", "+inf" are refused, so a typo cannot pass as a value.
    match value.as_str() {
        Some("inf") => Ok(f64::INFINITY),
        Some("-inf") => Ok(f64::NEG_INFINITY),
        Some("nan") => Ok(f64::NAN),
        _ => Err(EvalError::invalid(
            path,
            format!(
                "expected a number (or one of the strings \"inf\", \"-inf\", \"nan\"), found {}",
                show(value)
            ),
        )),
    }
}

impl Tensor {
    /// Errors with `non_finite_input` naming the flat index of the first NaN or infinity.
    pub fn require_finite(&self, name: &str) -> Result<(), EvalError> {
        packshard_reference::error::check_finite(name, &self.data).map_err(EvalError::from)
    }
}

fn as_array<'v>(value: &'v Value, name: &str) -> Result<&'v Vec<Value>, EvalError> {
    value.as_array().ok_or_else(|| {
        EvalError::invalid(name, format!("expected an array, found {}", show(value)))
    })
}

fn as_usize(value: &Value, name: &str) -> Result<usize, EvalError> {
    match value.as_u64() {
        Some(v) => {
            usize::try_from(v).map_err(|_| EvalError::invalid(name, format!("{v} is too large")))
        }
        None => Err(EvalError::invalid(
            name,
            not_integer("a non-negative integer", value),
        )),
    }
}

fn as_f64(value: &Value, name: &str) -> Result<f64, EvalError> {
    let v = value.as_f64().ok_or_else(|| {
        EvalError::invalid(name, format!("expected a number, found {}", show(value)))
    })?;
    if !v.is_finite() {
        return Err(EvalError::new(
            "non_finite_input",
            format!("{name} is not finite ({v})"),
        ));
    }
    Ok(v)
}

/// `value` as JSON for an error message, cut to
/// [`packshard_reference::error::ECHO_CHARS`] characters.
pub fn show(value: &Value) -> String {
    packshard_reference::error::brief(&value.to_string())
}

/// The message for `value` where `expected` (an integer) was wanted: says
/// what was given, and for a number written with a fraction or exponent
/// (`1e2`, `100.0`) that an integer has neither.
fn not_integer(expected: &str, value: &Value) -> String {
    match value {
        // An integer beyond u64 parses as a float: it is out of range, not
        // written with a fraction.
        Value::Number(n)
            if n.is_f64() && n.as_f64().is_some_and(|x| x.fract() == 0.0 && x.abs() >= 2f64.powi(63)) =>
        {
            format!(
                "expected {expected}, found {}, which is out of range",
                show(value)
            )
        }
        Value::Number(n) if n.is_f64() => format!(
            "expected {expected}, found the number {} written with a fraction or exponent (write an integer such as {})",
            show(value),
            n.as_f64().filter(|x| x.fract() == 0.0 && x.abs() < 1e15).map_or("3".to_string(), |x| format!("{x:.0}"))
        ),
        Value::Number(n) if n.as_i64().is_some_and(|x| x < 0) => {
            format!("expected {expected}, found the negative number {n}")
        }
        Value::Number(n) => format!("expected {expected}, found {n}, which is too large"),
        _ => format!("expected {expected}, found {}", show(value)),
    }
}
