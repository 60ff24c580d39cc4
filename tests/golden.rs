//! Golden vectors: the manifest snapshot (hashes and rounded summaries, so a
//! change to reference numerics shows in review), the expected outputs equal
//! what `packshard eval` computes on the same case, `packshard check` passes
//! the expected values and values within tolerance and fails values beyond
//! it, the low-precision rules hold the reference computed in that precision
//! and reject an f32 pipeline against the f64 set, and bad input exits 2
//! naming the tensors.

use std::path::{Path, PathBuf};
use std::process::{Command, Output as ProcOutput};

use packshard::golden::check::check;
use packshard::golden::io::{load, serialize, Tensor};
use packshard::golden::{self, cases, Dtype, GoldenCase, Values};
use serde_json::{json, Value};

mod common;

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("packshard-golden-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn packshard(args: &[&str]) -> ProcOutput {
    Command::new(env!("CARGO_BIN_EXE_packshard"))
        .args(args)
        .output()
        .expect("the binary runs")
}

fn text(o: &ProcOutput) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Runs `packshard args`: it exits with `code` and its output says each of
/// `needles`.
fn says(args: &[&str], code: i32, needles: &[&str]) -> ProcOutput {
    let o = packshard(args);
    let out = text(&o);
    assert_eq!(o.status.code(), Some(code), "{out}");
    common::assert_mentions(&out, needles);
    o
}

/// A results file: `(name, shape, values)` as F64.
fn write_results(path: &Path, tensors: &[(String, Vec<usize>, Vec<f64>)]) {
    let ts: Vec<Tensor> = tensors
        .iter()
        .map(|(n, s, v)| Tensor::float(n, s, v.clone(), Dtype::F64))
        .collect();
    std::fs::write(path, serialize(&ts).unwrap()).unwrap();
}

/// Every expected output of `cases`, named as results must be.
fn expected_results(cases: &[GoldenCase]) -> Vec<(String, Vec<usize>, Vec<f64>)> {
    cases
        .iter()
        .flat_map(|c| {
            c.outputs.iter().map(move |o| {
                (
                    c.result_name(&o.tensor.name),
                    o.tensor.shape.clone(),
                    o.tensor.as_f64(),
                )
            })
        })
        .collect()
}

#[test]
fn manifest_snapshot() {
    let cases = cases::all(Dtype::F64).unwrap();
    insta::assert_snapshot!(golden::manifest_text(Dtype::F64, &cases));
}

#[test]
fn every_op_has_a_case_with_inputs_outputs_and_rules() {
    let cases = cases::all(Dtype::F64).unwrap();
    let ops: std::collections::BTreeSet<&str> = cases.iter().map(|c| c.op).collect();
    let eval_ops: std::collections::BTreeSet<&str> = packshard::eval::ops()
        .iter()
        .map(|o| o.name)
        // step_plan's result is nested (microbatches, then ranks), which the
        // golden format's flat tensors do not hold yet: its values are pinned
        // by oracle/tests/eval_step_plan.rs (docs/STEP.md's picture).
        .filter(|&n| n != "bert" && n != "step_plan")
        .collect();
    assert_eq!(
        ops, eval_ops,
        "a golden case per eval op (bert, step_plan: not yet)"
    );
    let names: std::collections::BTreeSet<&str> = cases.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names.len(), cases.len(), "case names are unique");
    for c in &cases {
        assert!(!c.inputs.is_empty() && !c.outputs.is_empty(), "{}", c.name);
        for o in &c.outputs {
            // Float outputs have a positive tolerance from their terms, or are exact copies.
            if let Values::F(..) = o.tensor.values {
                assert!(
                    o.rule.atol > 0.0 || o.rule.text.starts_with("exact"),
                    "{} {}",
                    c.name,
                    o.tensor.name
                );
            }
        }
    }
    // The docs/FAULTS.md rows carry their stated values.
    let first_loss = |name: &str| {
        let c = cases.iter().find(|c| c.name == name).unwrap();
        c.outputs
            .iter()
            .find(|o| o.tensor.name == "per_token_loss")
            .unwrap()
            .tensor
            .as_f64()[0]
    };
    assert_eq!(
        format!("{:.5}", first_loss("cross_entropy_megatron_none")),
        "0.90444"
    );
    assert_eq!(
        format!("{:.6}", first_loss("cross_entropy_alg2_padded")),
        "1.474030"
    );
    // Sharded algorithms and layouts are all represented.
    let algs: std::collections::BTreeSet<String> = cases
        .iter()
        .filter_map(|c| {
            c.params
                .get("algorithm")
                .and_then(Value::as_str)
                .map(str::to_string)
        })
        .collect();
    for a in ["naive", "alg1", "alg2", "unsharded", "spfhp", "ffd"] {
        assert!(algs.contains(a), "no case with algorithm {a}: {algs:?}");
    }
}

fn nested(t: &Tensor) -> Value {
    fn build(shape: &[usize], flat: &[Value]) -> Value {
        match shape {
            [] => flat[0].clone(),
            [_] => Value::Array(flat.to_vec()),
            [n, rest @ ..] => {
                let size: usize = rest.iter().product();
                Value::Array(
                    (0..*n)
                        .map(|i| build(rest, &flat[i * size..(i + 1) * size]))
                        .collect(),
                )
            }
        }
    }
    let flat: Vec<Value> = match &t.values {
        Values::I(v) => v.iter().map(|&x| json!(x)).collect(),
        Values::F(v, _) => v
            .iter()
            .map(|&x| {
                if x.is_nan() {
                    json!("nan")
                } else if x == f64::INFINITY {
                    json!("inf")
                } else if x == f64::NEG_INFINITY {
                    json!("-inf")
                } else {
                    json!(x)
                }
            })
            .collect(),
    };
    build(&t.shape, &flat)
}

fn flatten(v: &Value, out: &mut Vec<f64>) {
    match v {
        Value::Array(a) => a.iter().for_each(|x| flatten(x, out)),
        Value::String(s) if s == "-inf" => out.push(f64::NEG_INFINITY),
        Value::String(s) if s == "inf" => out.push(f64::INFINITY),
        other => out.push(other.as_f64().expect("a number")),
    }
}

/// The golden case as an `eval` case: its params and inputs as fields.
fn eval_case(c: &GoldenCase) -> Value {
    let mut m = c.params.clone();
    m.insert("op".into(), json!(c.op));
    if c.op == "batch" {
        // The ragged `sequences` field, from tokens split at cu_seqlens.
        let get = |n: &str| c.inputs.iter().find(|t| t.name == n).unwrap().as_f64();
        let (tokens, cu) = (get("tokens"), get("cu_seqlens"));
        let seqs: Vec<Vec<i64>> = cu
            .windows(2)
            .map(|w| {
                tokens[w[0] as usize..w[1] as usize]
                    .iter()
                    .map(|&x| x as i64)
                    .collect()
            })
            .collect();
        m.insert("sequences".into(), json!(seqs));
    } else {
        for t in &c.inputs {
            m.insert(t.name.clone(), nested(t));
        }
    }
    Value::Object(m)
}

#[test]
fn expected_outputs_are_what_eval_computes() {
    for c in cases::all(Dtype::F64).unwrap() {
        let result = packshard::eval::evaluate(&eval_case(&c))
            .unwrap_or_else(|e| panic!("{}: eval refused the case: {e}", c.name));
        let sharded = c.params.get("num_shards").is_some();
        for o in &c.outputs {
            let want = o.tensor.as_f64();
            let got: Vec<f64> = if c.op == "pack" && o.tensor.name == "segments" {
                let mut v = Vec::new();
                for (p, pack) in result["packs"].as_array().unwrap().iter().enumerate() {
                    for s in pack.as_array().unwrap() {
                        v.extend([
                            p as f64,
                            s["sequence"].as_f64().unwrap(),
                            s["offset"].as_f64().unwrap(),
                            s["length"].as_f64().unwrap(),
                        ]);
                    }
                }
                v
            } else {
                let mut v = Vec::new();
                flatten(&result[o.tensor.name.as_str()], &mut v);
                v
            };
            assert_eq!(got.len(), want.len(), "{}/{}", c.name, o.tensor.name);
            for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
                if sharded {
                    // The sharded reference equals the unsharded one within the rule.
                    assert!(
                        o.rule.passes(w, g),
                        "{}/{}[{i}]: eval {g:e}, golden {w:e}, {}",
                        c.name,
                        o.tensor.name,
                        o.rule.text
                    );
                } else {
                    assert_eq!(
                        g.to_bits(),
                        w.to_bits(),
                        "{}/{}[{i}]: eval {g:e}, golden {w:e}",
                        c.name,
                        o.tensor.name
                    );
                }
            }
        }
    }
}

#[test]
fn check_passes_expected_values_and_values_within_tolerance_and_fails_beyond() {
    let dir = temp_dir("check");
    golden::write(&dir, Dtype::F64).unwrap();
    let cases = cases::all(Dtype::F64).unwrap();
    let results = dir.join("results.safetensors");
    let mut all = expected_results(&cases);
    write_results(&results, &all);
    let r = check(&dir, &results, true).unwrap();
    assert!(r.passed() && r.skipped.is_empty(), "{}", r.table());
    assert_eq!(r.rows.len(), all.len());
    assert!(r.rows.iter().all(|row| row.max_abs == 0.0));
    // Within the rule: half the allowed error on every element of grad_q.
    let i = all
        .iter()
        .position(|t| t.0 == "attention_varlen/grad_q")
        .unwrap();
    let rule = cases[3]
        .outputs
        .iter()
        .find(|o| o.tensor.name == "grad_q")
        .unwrap()
        .rule
        .clone();
    assert_eq!(cases[3].name, "attention_varlen");
    for x in all[i].2.iter_mut() {
        *x += 0.5 * (rule.rel * x.abs() + rule.atol);
    }
    write_results(&results, &all);
    let r = check(&dir, &results, true).unwrap();
    assert!(r.passed(), "{}", r.table());
    // Beyond it: one element twice the allowed error.
    let base = all[i].2[37];
    all[i].2[37] = base + 3.0 * (rule.rel * base.abs() + rule.atol);
    write_results(&results, &all);
    let r = check(&dir, &results, true).unwrap();
    assert!(!r.passed());
    let table = r.table();
    let bad: Vec<_> = r.rows.iter().filter(|row| !row.passed()).collect();
    assert_eq!(bad.len(), 1, "{table}");
    assert_eq!(
        (
            bad[0].case.as_str(),
            bad[0].output.as_str(),
            bad[0].failures
        ),
        ("attention_varlen", "grad_q", 1)
    );
    // Flat 37 of [16, 2, 4] is [4, 1, 1].
    assert_eq!(bad[0].first.as_ref().unwrap().0, vec![4, 1, 1], "{table}");
    assert!(
        table.contains("FAIL: 1 of 131 outputs out of tolerance"),
        "{table}"
    );
    assert!(
        table.contains("attention_varlen/grad_q: first at [4, 1, 1]"),
        "{table}"
    );
    // NaN never passes.
    all[i].2[37] = f64::NAN;
    write_results(&results, &all);
    let r = check(&dir, &results, true).unwrap();
    assert!(!r.passed() && r.rows.iter().any(|row| row.max_abs.is_nan()));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn low_precision_rules_hold_the_reference_in_that_precision() {
    for dtype in [Dtype::F32, Dtype::Bf16] {
        let dir = temp_dir(dtype.name());
        golden::write(&dir, dtype).unwrap();
        let cases = cases::all(dtype).unwrap();
        // Inputs are stored in the dtype, rounded; expected outputs in F64.
        let inputs = load(
            "q",
            &std::fs::read(dir.join("inputs/attention_varlen.safetensors")).unwrap(),
        )
        .unwrap();
        let q = &inputs.iter().find(|t| t.0 == "q").unwrap().1;
        assert_eq!(q.dtype, golden::io::safetensors_name(dtype));
        assert!(q.values.iter().all(|&x| dtype.round(x) == x));
        let expected = load(
            "e",
            &std::fs::read(dir.join("expected/attention_varlen.safetensors")).unwrap(),
        )
        .unwrap();
        assert!(expected.iter().all(|t| t.1.dtype == "F64"));
        // The reference computed in the dtype passes (its error is half the rule's factor)...
        let results: Vec<(String, Vec<usize>, Vec<f64>)> = cases
            .iter()
            .flat_map(|c| {
                c.outputs.iter().map(move |o| {
                    let v = o.in_dtype.clone().unwrap_or_else(|| o.tensor.as_f64());
                    (c.result_name(&o.tensor.name), o.tensor.shape.clone(), v)
                })
            })
            .collect();
        let path = dir.join("results.safetensors");
        write_results(&path, &results);
        let r = check(&dir, &path, true).unwrap();
        assert!(r.passed(), "{}", r.table());
        // ... and differs from the f64 truth (the rule is not vacuous): most
        // float outputs show an error.
        let nonzero = r.rows.iter().filter(|row| row.max_abs > 0.0).count();
        assert!(nonzero >= 30, "{nonzero}\n{}", r.table());
        // The same f32/bf16 results fail the f64 set: its rule catches a
        // kernel that silently computes in lower precision.
        let f64_dir = temp_dir(&format!("{}-vs-f64", dtype.name()));
        golden::write(&f64_dir, Dtype::F64).unwrap();
        // (Not `--all`: the f64 set alone has the decoder case.)
        let r = check(&f64_dir, &path, false).unwrap();
        let failed: Vec<String> = r
            .rows
            .iter()
            .filter(|row| !row.passed())
            .map(|row| format!("{}/{}", row.case, row.output))
            .collect();
        for out in [
            "attention_varlen/output",
            "attention_varlen/grad_q",
            "cross_entropy/loss",
            "linear_cross_entropy/grad_weight",
        ] {
            assert!(
                failed.contains(&out.to_string()),
                "{out} passed the f64 set:\n{}",
                r.table()
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
        std::fs::remove_dir_all(&f64_dir).unwrap();
    }
}

#[test]
fn cli_golden_then_check_exit_codes_and_bad_input() {
    let dir = temp_dir("cli");
    let d = dir.to_str().unwrap();
    says(&["golden", "--out", d], 0, &["wrote 26 golden cases"]);
    let cases = cases::all(Dtype::F64).unwrap();
    let results = dir.join("r.safetensors");
    let r = results.to_str().unwrap();
    let all = expected_results(&cases);
    let attention: Vec<_> = all
        .iter()
        .filter(|t| t.0.starts_with("attention_varlen/"))
        .cloned()
        .collect();

    // Only one case given: pass, the others skipped and listed; --all refuses.
    write_results(&results, &attention);
    let skipped = "skipped (no outputs in the results): pack_spfhp";
    says(
        &["check", d, r],
        0,
        &["checked 1 cases, 5 outputs", skipped],
    );
    says(
        &["check", d, r, "--all"],
        2,
        &["missing pack_spfhp/num_packs"],
    );

    // A value out of tolerance: exit 1 with the table.
    let mut bad = attention.clone();
    bad[0].2[0] += 1.0;
    write_results(&results, &bad);
    let first = "attention_varlen/output: first at [0, 0, 0]";
    says(&["check", d, r], 1, &["FAIL (1 of 128)", first]);

    // Bad input, exit 2, one line naming the tensors.
    #[allow(clippy::type_complexity)]
    let cases_of_bad_input: Vec<(Vec<(String, Vec<usize>, Vec<f64>)>, &str)> = vec![
        (attention[..4].to_vec(), "missing attention_varlen/grad_v"),
        (
            {
                let mut v = attention.clone();
                v[1].1 = vec![16, 2];
                v[1].2.truncate(32);
                v
            },
            "wrong shape: attention_varlen/lse [16, 2] (expected [2, 16])",
        ),
        (
            {
                let mut v = attention.clone();
                v.push(("attention_varlen/outptu".into(), vec![1], vec![0.0]));
                v
            },
            "no golden output is named attention_varlen/outptu",
        ),
        (
            vec![("nothing/here".into(), vec![1], vec![0.0])],
            "no golden output is named nothing/here",
        ),
        (vec![], "holds no output of any golden case"),
    ];
    for (tensors, message) in cases_of_bad_input {
        write_results(&results, &tensors);
        let o = says(&["check", d, r], 2, &[message]);
        assert_eq!(
            String::from_utf8_lossy(&o.stderr).lines().count(),
            1,
            "{}",
            text(&o)
        );
    }
    // Not a safetensors file; a directory that is not a golden set; a modified golden set.
    std::fs::write(&results, b"not safetensors").unwrap();
    says(&["check", d, r], 2, &["not a safetensors file"]);
    let manifest = "/nonexistent-golden/manifest.json";
    says(&["check", "/nonexistent-golden", r], 2, &[manifest]);
    let exp = dir.join("expected/cross_entropy.safetensors");
    let mut tampered = load("x", &std::fs::read(&exp).unwrap()).unwrap();
    tampered.sort_by(|a, b| a.0.cmp(&b.0));
    let ts: Vec<Tensor> = tampered
        .iter()
        .map(|(n, l)| {
            Tensor::float(
                n,
                &l.shape,
                l.values.iter().map(|x| x * 1.5).collect(),
                Dtype::F64,
            )
        })
        .collect();
    std::fs::write(&exp, serialize(&ts).unwrap()).unwrap();
    write_results(&results, &attention);
    says(
        &["check", d, r],
        2,
        &["does not match the manifest's sha256"],
    );

    // golden refuses a directory holding other files, and a bad dtype.
    let other = temp_dir("other");
    std::fs::create_dir_all(&other).unwrap();
    std::fs::write(other.join("notes.txt"), "mine").unwrap();
    says(
        &["golden", "--out", other.to_str().unwrap()],
        2,
        &["holds notes.txt"],
    );
    assert_eq!(
        std::fs::read_to_string(other.join("notes.txt")).unwrap(),
        "mine"
    );
    says(
        &["golden", "--out", d, "--dtype", "f16"],
        2,
        &["dtype: unknown \"f16\""],
    );
    // Rewriting an earlier set is fine (once the results file is moved out).
    let o = packshard(&["golden", "--out", d, "--dtype", "bf16"]);
    assert!(text(&o).contains("holds r.safetensors"), "{}", text(&o));
    std::fs::remove_file(&results).unwrap();
    let o = packshard(&["golden", "--out", d, "--dtype", "bf16"]);
    assert!(o.status.success(), "{}", text(&o));
    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::remove_dir_all(&other).unwrap();
}
