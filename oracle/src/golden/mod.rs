//! Golden test vectors: canonical cases for every `eval` op, with inputs,
//! the expected outputs and gradients of the f64 reference, and the
//! tolerance each output must meet — written as safetensors files plus a
//! JSON manifest (`packshard golden`), and checked against a framework's
//! results (`packshard check`).
//!
//! ## Layout of a golden directory
//!
//! - `manifest.json`: the format, the dtype, and per case its `op`, `params`
//!   (the `eval` fields that are not tensors), and for every input and
//!   output tensor its dtype, shape, sha256 (of the stored bytes) and a
//!   rounded summary; each output also names its `result` (the tensor name
//!   a results file must use, `<case>/<output>`) and its `tolerance`.
//! - `inputs/<case>.safetensors`: the inputs, named as the `eval` op's
//!   fields (`q`, `cu_seqlens`, `logits`, `targets`, ...).
//! - `expected/<case>.safetensors`: the expected outputs, named as the
//!   `eval` op's result fields (`output`, `lse`, `grad_q`, `loss`, ...).
//!
//! ## Dtypes and tolerances
//!
//! Float inputs are stored in the requested dtype (`f64`, `f32` or `bf16`,
//! rounded to nearest); integer inputs as `I64`. The expected outputs are
//! always computed **in f64 by the reference from the stored (rounded)
//! inputs** and stored as `F64`: the ground truth of exactly the inputs a
//! framework reads. An output passes when every element satisfies
//! `|actual - expected| <= rel |expected| + atol` (NaN never passes, equal
//! infinities do), with per output:
//!
//! - integers and copies: exact;
//! - `f64`: `rel = atol / T = 64 ulp` ([`packshard_equivalence::Tolerance::F64_REWRITE`]),
//!   `T` the magnitude of the terms the output is made of (the same bounds
//!   as the differential fuzzers: [`packshard_equivalence::fuzz::attention::AttentionTerms`],
//!   [`packshard_equivalence::vocab::Terms`]);
//! - `f32`, `bf16`: `rel = 0`, `atol = LOWP_FACTOR x (the largest error of
//!   the reference computed in that precision, [`lowp`]) + LOWP_FLOOR_ULPS
//!   ulp of max |expected|`: flash-attention's rule, with a floor of a few
//!   roundings of the output.
//!
//! Every rule is written out in the manifest with its numbers.
//!
//! ## Integrity
//!
//! The manifest judges (its tolerances, shapes and names decide what
//! passes), so it is hashed as a whole: `manifest_sha256` is the sha256 of
//! the file's bytes with that value written as 64 zeros
//! ([`seal`], [`verify_seal`]). It covers every expected tensor too, through
//! their own `sha256` entries. `packshard check` refuses a set whose
//! manifest or expected files were edited, and checks every expected
//! tensor's dtype and shape against the manifest before reading a result.

pub mod cases;
pub mod check;
pub mod io;
pub mod lowp;
pub mod registry;

use std::path::Path;

use serde_json::{json, Map, Value};

pub use io::{parse_dtype, Dtype, Tensor, Values, DTYPES};

/// The manifest's `format`.
/// `/2`: the manifest carries its own hash ([`SEAL_KEY`]).
pub const FORMAT: &str = "packshard-golden/2";

/// The manifest key of the hash of the manifest itself ([`seal`]).
pub const SEAL_KEY: &str = "manifest_sha256";

/// The value [`SEAL_KEY`] holds while the manifest is hashed: 64 zeros.
const SEAL_PLACEHOLDER: &str = "0000000000000000000000000000000000000000000000000000000000000000";

/// `k` of the low-precision rule: an output may be off by at most `k` times
/// the error of the reference computed in its precision (flash-attention's
/// tests use 2 for the forward pass and the gradients).
pub const LOWP_FACTOR: f64 = 2.0;

/// The floor of the low-precision rule, in ulps of the dtype at the
/// output's largest magnitude: the output is rounded once to the dtype
/// (half an ulp) and a correct kernel's last reduction or division adds a
/// few more; a scalar's (or a small tensor's) reference error is a single
/// draw and can be lucky, so `k` times it alone is no bound. Measured: a
/// numpy f32 implementation's loss was 1 ulp off where the f32 reference
/// happened to be 0.07 ulp off.
pub const LOWP_FLOOR_ULPS: f64 = 4.0;

/// A golden-vector failure: bad input (an unreadable directory or results
/// file, a missing tensor, a wrong shape), with a one-line message naming
/// the file and tensor.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct GoldenError(pub String);

impl GoldenError {
    /// An error with this message.
    pub fn new(message: impl Into<String>) -> Self {
        GoldenError(message.into())
    }
}

/// The tolerance of one output: `|actual - expected| <= rel |expected| +
/// atol`, elementwise, and the rule it came from in words.
#[derive(Debug, Clone, PartialEq)]
pub struct Rule {
    /// Relative part.
    pub rel: f64,
    /// Absolute part.
    pub atol: f64,
    /// Where the numbers come from.
    pub text: String,
}

impl Rule {
    /// Exact equality (integers, lookups).
    pub fn exact(why: &str) -> Self {
        Rule {
            rel: 0.0,
            atol: 0.0,
            text: format!("exact ({why})"),
        }
    }

    /// The f64 rule: 64 ulp relative plus 64 ulp of `terms`, the magnitude
    /// of the terms the output is made of (rounded up to 3 digits).
    pub fn f64_terms(terms: f64, what: &str) -> Self {
        let ulp64 = packshard_equivalence::Tolerance::F64_REWRITE.rel;
        Rule {
            rel: ulp64,
            atol: io::round_up_sig(ulp64 * terms),
            text: format!(
                "f64 rewrite: 64 ulp of |expected| + 64 ulp of the terms' magnitude {} ({what})",
                fmt_e(terms)
            ),
        }
    }

    /// The low-precision rule: `LOWP_FACTOR x lowp_error + LOWP_FLOOR_ULPS
    /// ulp of max|expected|` (an ulp being `2 u`, `u` the unit roundoff).
    pub fn lowp(dtype: Dtype, lowp_error: f64, max_expected: f64) -> Self {
        let ulp = 2.0 * dtype.unit_roundoff();
        Rule {
            rel: 0.0,
            atol: io::round_up_sig(LOWP_FACTOR * lowp_error + LOWP_FLOOR_ULPS * ulp * max_expected),
            text: format!(
                "{}: {LOWP_FACTOR} x the max abs error of the reference computed in {} ({}) + {LOWP_FLOOR_ULPS} ulp ({}) of max |expected| ({})",
                dtype.name(),
                dtype.name(),
                fmt_e(lowp_error),
                fmt_e(ulp),
                fmt_e(max_expected)
            ),
        }
    }

    /// Whether `actual` passes against `expected`.
    pub fn passes(&self, expected: f64, actual: f64) -> bool {
        if expected.is_finite() && actual.is_finite() {
            (actual - expected).abs() <= self.rel * expected.abs() + self.atol
        } else {
            expected == actual
        }
    }

    fn to_json(&self) -> Value {
        json!({"rel": self.rel, "atol": self.atol, "rule": self.text})
    }
}

/// `x` with 3 significant digits, e.g. `3.14e-7`.
pub(crate) fn fmt_e(x: f64) -> String {
    format!("{x:.2e}")
}

/// One expected output and its tolerance.
#[derive(Debug, Clone, PartialEq)]
pub struct Output {
    /// The expected values (f64, or I64 for integers), named as the `eval`
    /// result field.
    pub tensor: Tensor,
    /// What it must meet.
    pub rule: Rule,
    /// For an f32 or bf16 set: the same output computed by the reference in
    /// that precision ([`lowp`]), whose error the rule is derived from.
    pub in_dtype: Option<Vec<f64>>,
}

/// One canonical case of an op.
#[derive(Debug, Clone, PartialEq)]
pub struct GoldenCase {
    /// A file-name-safe name, unique in the set (`attention_varlen`).
    pub name: String,
    /// The `eval` op it mirrors.
    pub op: &'static str,
    /// What it exercises (docs/FAULTS.md entries), in one line.
    pub description: String,
    /// The `eval` fields that are not tensors (`causal`, `scale`,
    /// `ignore_index`, `num_shards`, ...).
    pub params: Map<String, Value>,
    /// The inputs, named as the `eval` fields.
    pub inputs: Vec<Tensor>,
    /// The expected outputs.
    pub outputs: Vec<Output>,
}

impl GoldenCase {
    /// The name a results file must give output `output`: `<case>/<output>`.
    pub fn result_name(&self, output: &str) -> String {
        format!("{}/{output}", self.name)
    }

    fn manifest_entry(&self) -> Value {
        let inputs: Map<String, Value> = self
            .inputs
            .iter()
            .map(|t| (t.name.clone(), Value::Object(t.describe())))
            .collect();
        let outputs: Map<String, Value> = self
            .outputs
            .iter()
            .map(|o| {
                let mut m = Map::new();
                m.insert("result".into(), json!(self.result_name(&o.tensor.name)));
                m.extend(o.tensor.describe());
                m.insert("tolerance".into(), o.rule.to_json());
                (o.tensor.name.clone(), Value::Object(m))
            })
            .collect();
        json!({
            "name": self.name,
            "op": self.op,
            "description": self.description,
            "inputs_file": format!("inputs/{}.safetensors", self.name),
            "expected_file": format!("expected/{}.safetensors", self.name),
            "params": self.params,
            "inputs": inputs,
            "outputs": outputs,
        })
    }
}

/// The manifest of a golden set: the format, the dtype, the conventions in
/// words, and every case.
pub fn manifest(dtype: Dtype, cases: &[GoldenCase]) -> Value {
    json!({
        "format": FORMAT,
        SEAL_KEY: SEAL_PLACEHOLDER,
        "generator": format!("packshard {}", env!("CARGO_PKG_VERSION")),
        "dtype": dtype.name(),
        "conventions": {
            "inputs": format!("float inputs stored as {} (rounded to nearest), integers as I64, named as the eval op's fields", io::safetensors_name(dtype)),
            "expected": "computed in f64 by the reference from the stored inputs, stored as F64 (I64 for integers), named as the eval op's result fields",
            "results": "one safetensors file, each output under its `result` name (<case>/<output>), any float or integer dtype, the expected shape",
            "tolerance": "element i passes when |actual_i - expected_i| <= rel |expected_i| + atol; NaN never passes, equal infinities do",
            "integrity": format!("{SEAL_KEY} is the sha256 of this file's bytes with that value written as 64 zeros; each tensor's sha256 is of its stored bytes; packshard check refuses a set that does not match"),
            "shapes": "n_tok tokens, b segments, h heads, d head dim, n rows, v vocabulary, w >= v columns (padding never read), hidden the hidden size",
        },
        "cases": cases.iter().map(GoldenCase::manifest_entry).collect::<Vec<_>>(),
    })
}

/// The manifest as written: pretty JSON with lists of numbers on one line,
/// sealed ([`seal`]).
pub fn manifest_text(dtype: Dtype, cases: &[GoldenCase]) -> String {
    let pretty = serde_json::to_string_pretty(&manifest(dtype, cases)).expect("JSON values");
    seal(&(compact_lists(&pretty) + "\n"))
}

/// The text of the manifest's hash entry holding `hex`.
fn seal_entry(hex: &str) -> String {
    format!("\"{SEAL_KEY}\": \"{hex}\"")
}

/// `text` (a manifest whose [`SEAL_KEY`] holds 64 zeros) with the zeros
/// replaced by the sha256 of `text`.
pub fn seal(text: &str) -> String {
    let hash = io::sha256_hex(text.as_bytes());
    text.replacen(&seal_entry(SEAL_PLACEHOLDER), &seal_entry(&hash), 1)
}

/// Checks the hash of a manifest's bytes ([`seal`]): exactly one
/// [`SEAL_KEY`] entry, whose value is the sha256 of the text with that value
/// written as 64 zeros. `source` names the file in errors.
///
/// # Errors
/// A [`GoldenError`] naming the file and `manifest_sha256` when the entry is
/// missing, repeated or not 64 hex digits, or the text was edited.
pub fn verify_seal(source: &str, text: &[u8]) -> Result<(), GoldenError> {
    let text = std::str::from_utf8(text)
        .map_err(|e| GoldenError::new(format!("{source}: not UTF-8 text: {e}")))?;
    let key = format!("\"{SEAL_KEY}\": \"");
    let regenerate = "regenerate the set with packshard golden";
    let mut found = text.match_indices(&key);
    let (Some((at, _)), None) = (found.next(), found.next()) else {
        return Err(GoldenError::new(format!(
            "{source}: needs exactly one {SEAL_KEY} entry (the hash of the manifest, which judges: {regenerate})"
        )));
    };
    let start = at + key.len();
    let hex = text
        .get(start..start + 64)
        .filter(|h| {
            h.bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
        })
        .filter(|_| text[start + 64..].starts_with('"'))
        .ok_or_else(|| {
            GoldenError::new(format!(
                "{source}: {SEAL_KEY} is not 64 lowercase hex digits ({regenerate})"
            ))
        })?;
    let zeroed = format!(
        "{}{SEAL_PLACEHOLDER}{}",
        &text[..start],
        &text[start + 64..]
    );
    if io::sha256_hex(zeroed.as_bytes()) != hex {
        return Err(GoldenError::new(format!(
            "{source}: does not match its {SEAL_KEY} (the manifest was edited: its tolerances, shapes and names decide what passes, so an edited one is refused; {regenerate})"
        )));
    }
    Ok(())
}

/// Puts every JSON list without strings, lists or objects in it on one line.
fn compact_lists(pretty: &str) -> String {
    let mut out = String::with_capacity(pretty.len());
    let mut rest = pretty;
    while let Some(open) = rest.find(['[', '"']) {
        out.push_str(&rest[..open]);
        rest = &rest[open..];
        if rest.starts_with('"') {
            // Copy a string whole (it may hold brackets).
            let mut end = 1;
            let bytes = rest.as_bytes();
            while end < bytes.len() && bytes[end] != b'"' {
                end += if bytes[end] == b'\\' { 2 } else { 1 };
            }
            let end = (end + 1).min(rest.len());
            out.push_str(&rest[..end]);
            rest = &rest[end..];
            continue;
        }
        let close = rest.find(']').unwrap_or(rest.len() - 1);
        let inner = &rest[1..close];
        if inner.contains(['[', '{', '"']) {
            out.push('[');
            rest = &rest[1..];
        } else {
            let items: Vec<&str> = inner
                .split(',')
                .map(str::trim)
                .filter(|x| !x.is_empty())
                .collect();
            out.push('[');
            out.push_str(&items.join(", "));
            out.push(']');
            rest = &rest[close + 1..];
        }
    }
    out.push_str(rest);
    out
}

/// What [`write`] wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct Written {
    /// Cases written.
    pub cases: usize,
    /// Input tensors.
    pub inputs: usize,
    /// Output tensors.
    pub outputs: usize,
    /// Bytes of the safetensors files and the manifest.
    pub bytes: u64,
}

fn write_bytes(path: &Path, bytes: &[u8]) -> Result<u64, GoldenError> {
    std::fs::write(path, bytes)
        .map_err(|e| GoldenError::new(format!("{}: {e}", path.display())))?;
    Ok(bytes.len() as u64)
}

/// Writes the golden set of `dtype` to `dir` (created if needed): the
/// manifest and two safetensors files per case.
///
/// # Errors
/// A [`GoldenError`] naming the path when `dir` holds anything but a previous
/// golden set (never overwrite someone's files) or cannot be written.
pub fn write(dir: &Path, dtype: Dtype) -> Result<Written, GoldenError> {
    if dir.exists() {
        let entries = std::fs::read_dir(dir)
            .map_err(|e| GoldenError::new(format!("{}: {e}", dir.display())))?;
        for entry in entries {
            let name = entry
                .map_err(|e| GoldenError::new(format!("{}: {e}", dir.display())))?
                .file_name();
            let name = name.to_string_lossy();
            if !["manifest.json", "inputs", "expected"].contains(&name.as_ref()) {
                return Err(GoldenError::new(format!(
                    "{}: holds {name}, which is not part of a golden set; give an empty or new directory",
                    dir.display()
                )));
            }
        }
    }
    let cases = cases::all(dtype)?;
    let mut written = Written {
        cases: cases.len(),
        inputs: 0,
        outputs: 0,
        bytes: 0,
    };
    for sub in ["inputs", "expected"] {
        let d = dir.join(sub);
        if d.exists() {
            // Files of an earlier set (cases may have been renamed since).
            for entry in std::fs::read_dir(&d)
                .map_err(|e| GoldenError::new(format!("{}: {e}", d.display())))?
                .flatten()
            {
                if entry.path().extension().is_some_and(|x| x == "safetensors") {
                    std::fs::remove_file(entry.path()).map_err(|e| {
                        GoldenError::new(format!("{}: {e}", entry.path().display()))
                    })?;
                }
            }
        }
        std::fs::create_dir_all(&d)
            .map_err(|e| GoldenError::new(format!("{}: {e}", d.display())))?;
    }
    for case in &cases {
        let inputs = io::serialize(&case.inputs)?;
        let outputs: Vec<Tensor> = case.outputs.iter().map(|o| o.tensor.clone()).collect();
        let expected = io::serialize(&outputs)?;
        written.bytes += write_bytes(
            &dir.join(format!("inputs/{}.safetensors", case.name)),
            &inputs,
        )?;
        written.bytes += write_bytes(
            &dir.join(format!("expected/{}.safetensors", case.name)),
            &expected,
        )?;
        written.inputs += case.inputs.len();
        written.outputs += case.outputs.len();
    }
    let text = manifest_text(dtype, &cases);
    written.bytes += write_bytes(&dir.join("manifest.json"), text.as_bytes())?;
    Ok(written)
}
