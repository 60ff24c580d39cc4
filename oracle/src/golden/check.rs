//! `packshard check DIR RESULTS.safetensors`: a framework's outputs against
//! the golden ones, each under its manifest's rule.
//!
//! Results name each output `<case>/<output>` (the manifest's `result`), in
//! any float or integer dtype, with the expected shape. A case with no
//! output in the results is skipped (and listed), unless every case is
//! required; a case with some outputs but not all, an output of another
//! shape, or a name no case has, is bad input. The manifest is checked
//! against its own hash (`manifest_sha256`, [`super::seal`]) and every
//! expected tensor against the manifest's dtype, shape and sha256 first, so
//! an edited golden set (a tolerance, a shape, a name) is refused rather
//! than trusted; the results file's names and shapes are checked from its
//! header before any value is read.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::Path;

use serde_json::Value;

use safetensors::tensor::TensorView;

use super::io::{dtype_name, views, widen, Loaded};
use super::{fmt_e, verify_seal, GoldenError, Rule, FORMAT};

/// One output compared.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// The case.
    pub case: String,
    /// The output within it.
    pub output: String,
    /// Its shape.
    pub shape: Vec<usize>,
    /// The results file's dtype for it.
    pub dtype: String,
    /// Largest `|actual - expected|` over finite pairs.
    pub max_abs: f64,
    /// Largest `|actual - expected| / |expected|` over finite pairs with `expected != 0`.
    pub max_rel: f64,
    /// The manifest's rule.
    pub rule: Rule,
    /// Elements outside the rule.
    pub failures: usize,
    /// Elements compared.
    pub values: usize,
    /// The first failing element: index, expected, actual.
    pub first: Option<(Vec<usize>, f64, f64)>,
}

impl Row {
    /// Whether every element passed.
    pub fn passed(&self) -> bool {
        self.failures == 0
    }
}

/// What a check found.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    /// The golden set's dtype.
    pub dtype: String,
    /// Cases in the golden set.
    pub cases: usize,
    /// One row per compared output, in manifest order.
    pub rows: Vec<Row>,
    /// Cases with no output in the results.
    pub skipped: Vec<String>,
}

impl Report {
    /// Whether every compared output passed.
    pub fn passed(&self) -> bool {
        self.rows.iter().all(Row::passed)
    }

    /// The readable table: one line per output, the failures' first
    /// elements, and a verdict line.
    pub fn table(&self) -> String {
        let mut s = String::new();
        let checked: BTreeSet<&str> = self.rows.iter().map(|r| r.case.as_str()).collect();
        let _ = writeln!(
            s,
            "golden set: dtype {}, {} cases; checked {} cases, {} outputs",
            self.dtype,
            self.cases,
            checked.len(),
            self.rows.len()
        );
        if !self.skipped.is_empty() {
            let _ = writeln!(
                s,
                "skipped (no outputs in the results): {}",
                self.skipped.join(", ")
            );
        }
        let _ = writeln!(
            s,
            "{:<34} {:<15} {:<12} {:>11} {:>11} {:>10} {:>10}  result",
            "case", "output", "shape", "max abs err", "max rel err", "rel", "atol"
        );
        for r in &self.rows {
            let _ = writeln!(
                s,
                "{:<34} {:<15} {:<12} {:>11} {:>11} {:>10} {:>10}  {}",
                r.case,
                r.output,
                format!("{:?}", r.shape),
                fmt_err(r.max_abs),
                fmt_err(r.max_rel),
                fmt_e(r.rule.rel),
                fmt_e(r.rule.atol),
                if r.passed() {
                    "pass".to_string()
                } else {
                    format!("FAIL ({} of {})", r.failures, r.values)
                }
            );
        }
        let failed: Vec<&Row> = self.rows.iter().filter(|r| !r.passed()).collect();
        for r in &failed {
            if let Some((idx, e, a)) = &r.first {
                let _ = writeln!(
                    s,
                    "  {}/{}: first at {idx:?}: expected {e:e}, got {a:e}; tolerance {}",
                    r.case, r.output, r.rule.text
                );
            }
        }
        if failed.is_empty() {
            let _ = writeln!(
                s,
                "PASS: {} of {} outputs within tolerance",
                self.rows.len(),
                self.rows.len()
            );
        } else {
            let _ = writeln!(
                s,
                "FAIL: {} of {} outputs out of tolerance",
                failed.len(),
                self.rows.len()
            );
        }
        s
    }
}

fn fmt_err(x: f64) -> String {
    if x.is_nan() {
        "nan".into()
    } else if x.is_infinite() {
        "inf".into()
    } else {
        fmt_e(x)
    }
}

/// Reads a file whole, after checking its size against the memory budget
/// (`what` it is, for the message).
fn read(path: &Path, what: &str) -> Result<Vec<u8>, GoldenError> {
    let at = |e: &dyn std::fmt::Display| GoldenError::new(format!("{}: {e}", path.display()));
    let len = std::fs::metadata(path).map_err(|e| at(&e))?.len();
    packshard_reference::limits::check_memory(
        &path.display().to_string(),
        len,
        &format!("reading {what}"),
    )
    .map_err(|e| GoldenError::new(e.to_string()))?;
    std::fs::read(path).map_err(|e| at(&e))
}

fn field<'a>(v: &'a Value, key: &str, at: &str) -> Result<&'a Value, GoldenError> {
    v.get(key)
        .ok_or_else(|| GoldenError::new(format!("manifest.json: {at}.{key} is missing")))
}

fn str_field<'a>(v: &'a Value, key: &str, at: &str) -> Result<&'a str, GoldenError> {
    field(v, key, at)?
        .as_str()
        .ok_or_else(|| GoldenError::new(format!("manifest.json: {at}.{key} is not a string")))
}

fn num_field(v: &Value, key: &str, at: &str) -> Result<f64, GoldenError> {
    field(v, key, at)?
        .as_f64()
        .ok_or_else(|| GoldenError::new(format!("manifest.json: {at}.{key} is not a number")))
}

fn shape_field(v: &Value, at: &str) -> Result<Vec<usize>, GoldenError> {
    field(v, "shape", at)?
        .as_array()
        .and_then(|a| a.iter().map(|x| x.as_u64().map(|x| x as usize)).collect())
        .ok_or_else(|| {
            GoldenError::new(format!("manifest.json: {at}.shape is not a list of sizes"))
        })
}

/// A manifest output, resolved.
struct Expected {
    case: String,
    output: String,
    result: String,
    shape: Vec<usize>,
    rule: Rule,
    values: Vec<f64>,
}

/// Unravels a flat index into `shape`.
fn unravel(flat: usize, shape: &[usize]) -> Vec<usize> {
    packshard_equivalence::compare::unravel(flat, shape)
}

fn list(names: &[String]) -> String {
    if names.len() <= 6 {
        names.join(", ")
    } else {
        format!("{}, ... ({} in all)", names[..6].join(", "), names.len())
    }
}

/// Compares the results file `results` with the golden set in `dir`.
/// `require_all`: every case must have its outputs (otherwise cases without
/// any are skipped).
///
/// # Errors
/// A [`GoldenError`] (bad input, exit status 2 of the CLI) naming the file
/// and the tensors: an unreadable or modified golden set, an unreadable
/// results file, missing outputs, outputs of the wrong shape, names that
/// belong to no case, or no output of any case.
pub fn check(dir: &Path, results: &Path, require_all: bool) -> Result<Report, GoldenError> {
    let manifest_path = dir.join("manifest.json");
    let text = read(&manifest_path, "the manifest")?;
    let manifest: Value = serde_json::from_slice(&text)
        .map_err(|e| GoldenError::new(format!("{}: {e}", manifest_path.display())))?;
    let format = manifest.get("format").and_then(Value::as_str);
    if format != Some(FORMAT) {
        return Err(GoldenError::new(format!(
            "{}: format {}, this packshard reads {FORMAT:?} (regenerate the set with packshard golden)",
            manifest_path.display(),
            format.map_or("missing".to_string(), |f| format!("{f:?}"))
        )));
    }
    verify_seal(&manifest_path.display().to_string(), &text)?;
    let dtype = str_field(&manifest, "dtype", "manifest")?.to_string();
    let cases = field(&manifest, "cases", "manifest")?
        .as_array()
        .ok_or_else(|| GoldenError::new("manifest.json: cases is not a list"))?;
    let mut expected: Vec<Expected> = Vec::new();
    for (i, case) in cases.iter().enumerate() {
        let at = format!("cases[{i}]");
        let name = str_field(case, "name", &at)?;
        let file = str_field(case, "expected_file", &at)?;
        let path = dir.join(file);
        let source = path.display().to_string();
        let bytes = read(&path, "an expected file")?;
        let tensors = views(&source, &bytes)?;
        let outputs = field(case, "outputs", &at)?.as_object().ok_or_else(|| {
            GoldenError::new(format!("manifest.json: {at}.outputs is not an object"))
        })?;
        for (output, o) in outputs {
            let at = format!("{at}.outputs.{output}");
            let view = tensors
                .tensor(output)
                .map_err(|_| GoldenError::new(format!("{source}: tensor {output} is missing")))?;
            let shape = shape_field(o, &at)?;
            let stored = str_field(o, "dtype", &at)?;
            if view.shape() != shape.as_slice() || dtype_name(&view) != stored {
                return Err(GoldenError::new(format!(
                    "{source}: tensor {output} is {} {:?}, the manifest says {stored} {shape:?} (the golden set was modified; regenerate it with packshard golden)",
                    dtype_name(&view),
                    view.shape()
                )));
            }
            let t = widen(&source, output, &view)?;
            let sha = str_field(o, "sha256", &at)?;
            if t.sha256 != sha {
                return Err(GoldenError::new(format!(
                    "{source}: tensor {output} does not match the manifest's sha256 (the golden set was modified; regenerate it with packshard golden)"
                )));
            }
            let tol = field(o, "tolerance", &at)?;
            expected.push(Expected {
                case: name.to_string(),
                output: output.clone(),
                result: str_field(o, "result", &at)?.to_string(),
                shape,
                rule: Rule {
                    rel: num_field(tol, "rel", &format!("{at}.tolerance"))?,
                    atol: num_field(tol, "atol", &format!("{at}.tolerance"))?,
                    text: str_field(tol, "rule", &format!("{at}.tolerance"))?.to_string(),
                },
                values: t.values,
            });
        }
    }
    let source = results.display().to_string();
    let bytes = read(results, "the results file")?;
    // Names and shapes first, from the header: no value is widened before
    // the file is known to hold what the manifest asks for.
    let st = views(&source, &bytes)?;
    let actual: BTreeMap<String, TensorView<'_>> = st
        .iter()
        .map(|(name, view)| (name.to_string(), view))
        .collect();
    let known: BTreeSet<&str> = expected.iter().map(|e| e.result.as_str()).collect();
    let unknown: Vec<String> = actual
        .keys()
        .filter(|k| !known.contains(k.as_str()))
        .cloned()
        .collect();
    let present: BTreeSet<&str> = expected
        .iter()
        .filter(|e| actual.contains_key(&e.result))
        .map(|e| e.case.as_str())
        .collect();
    let mut missing = Vec::new();
    let mut wrong_shape = Vec::new();
    let mut skipped = Vec::new();
    for e in &expected {
        match actual.get(&e.result) {
            None if require_all || present.contains(e.case.as_str()) => {
                missing.push(e.result.clone())
            }
            None => {
                if skipped.last() != Some(&e.case) {
                    skipped.push(e.case.clone());
                }
            }
            Some(a) if a.shape() != e.shape.as_slice() => wrong_shape.push(format!(
                "{} {:?} (expected {:?})",
                e.result,
                a.shape(),
                e.shape
            )),
            Some(_) => {}
        }
    }
    let mut problems = Vec::new();
    if !missing.is_empty() {
        problems.push(format!("missing {}", list(&missing)));
    }
    if !wrong_shape.is_empty() {
        problems.push(format!("wrong shape: {}", list(&wrong_shape)));
    }
    if !unknown.is_empty() {
        problems.push(format!(
            "no golden output is named {} (names are <case>/<output>, see the manifest's result fields)",
            list(&unknown)
        ));
    }
    if !problems.is_empty() {
        return Err(GoldenError::new(format!(
            "{source}: {}",
            problems.join("; ")
        )));
    }
    if present.is_empty() {
        return Err(GoldenError::new(format!(
            "{source}: holds no output of any golden case (names are <case>/<output>, e.g. {})",
            expected
                .first()
                .map_or("attention_varlen/output", |e| e.result.as_str())
        )));
    }
    let mut rows = Vec::new();
    for e in &expected {
        if let Some(view) = actual.get(&e.result) {
            rows.push(compare(e, &widen(&source, &e.result, view)?));
        }
    }
    Ok(Report {
        dtype,
        cases: cases.len(),
        rows,
        skipped,
    })
}

fn compare(e: &Expected, a: &Loaded) -> Row {
    let mut row = Row {
        case: e.case.clone(),
        output: e.output.clone(),
        shape: e.shape.clone(),
        dtype: a.dtype.clone(),
        max_abs: 0.0,
        max_rel: 0.0,
        rule: e.rule.clone(),
        failures: 0,
        values: e.values.len(),
        first: None,
    };
    let mut nan_mismatch = false;
    for (i, (&x, &y)) in e.values.iter().zip(&a.values).enumerate() {
        if x.is_finite() && y.is_finite() {
            let d = (y - x).abs();
            row.max_abs = row.max_abs.max(d);
            if x != 0.0 {
                row.max_rel = row.max_rel.max(d / x.abs());
            }
        } else if x.is_nan() != y.is_nan() {
            // A NaN where the other side has a number: no distance exists.
            nan_mismatch = true;
        } else if x != y && !x.is_nan() {
            // An infinity where the other side has a number or the other
            // infinity: infinitely far.
            row.max_abs = f64::INFINITY;
            row.max_rel = f64::INFINITY;
        }
        if !e.rule.passes(x, y) {
            row.failures += 1;
            row.first.get_or_insert((unravel(i, &e.shape), x, y));
        }
    }
    if nan_mismatch {
        row.max_abs = f64::NAN;
        row.max_rel = f64::NAN;
    }
    row
}
