//! Issue #14, "bad input and hostile surroundings", through the real binary:
//! write errors on standard output (a closed pipe, a full disk), the memory
//! budget (address-space caps), silent wrong results turned into typed
//! errors, the time limits of the reference attention, and messages that
//! say what was given. Every case: the exit status, no "panicked", one line.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use serde_json::{json, Value};

mod common;
use common::{packshard, stderr_text as stderr, temp_path};

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_packshard")
}

/// No panic, at most one line on standard error.
fn assert_clean(o: &Output, what: &str) {
    let e = stderr(o);
    assert!(!e.contains("panicked"), "{what}: {e}");
    assert!(e.lines().count() <= 1, "{what}: more than one line: {e}");
}

/// `eval` of one case: its single JSON output line.
fn eval(case: &Value) -> (Output, Value) {
    let o = packshard(&["eval", "-"], Some(&case.to_string()));
    let out = String::from_utf8(o.stdout.clone()).unwrap();
    assert_eq!(out.lines().count(), 1, "{case}: {out}");
    let v: Value = serde_json::from_str(out.trim()).unwrap();
    (o, v)
}

/// `eval` of `case` must fail with `kind` and a message containing every
/// one of `needles`.
fn eval_err(case: &Value, kind: &str, needles: &[&str]) -> String {
    let (o, v) = eval(case);
    assert_eq!(o.status.code(), Some(2), "{case}: {v}");
    assert_clean(&o, "eval");
    assert_eq!(v["error"]["kind"], kind, "{case}: {v}");
    let m = v["error"]["message"].as_str().unwrap().to_string();
    for n in needles {
        assert!(m.contains(n), "{case}: {m:?} lacks {n:?}");
    }
    m
}

// ---- class 2: lost output -------------------------------------------------

/// Small, fast invocations of every printing subcommand.
fn printing_commands() -> Vec<(Vec<String>, Option<String>)> {
    let golden = temp_path("hostile", "golden-src");
    let st = Command::new(bin())
        .args(["golden", "--out", golden.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(st.status.success(), "{}", stderr(&st));
    let results = temp_path("hostile", "exact-results.safetensors");
    one_case_results(&golden, &results, None);
    let lengths = temp_path("hostile", "lengths.txt");
    std::fs::write(&lengths, "5\n7\n3\n9\n").unwrap();
    // The words of a command line, then paths (kept whole).
    let args = |words: &str, paths: &[&PathBuf]| -> Vec<String> {
        let words = words.split_whitespace().map(String::from);
        words
            .chain(paths.iter().map(|p| p.to_str().unwrap().to_string()))
            .collect()
    };
    let case = json!({"op": "pack", "lengths": [5, 7, 3], "max_seq_len": 8}).to_string();
    let vocab = "vocab --vocab-size 7 --hidden 3 --tokens 2 --shards";
    vec![
        (
            args("pack --max-seq-len 16 --json --lengths", &[&lengths]),
            None,
        ),
        (args("pack --max-seq-len 16 --lengths", &[&lengths]), None),
        (args(&format!("{vocab} 1,2"), &[]), None),
        (args(&format!("{vocab} 2 --json"), &[]), None),
        (args("bench --list", &[]), None),
        (
            args("golden --out", &[&temp_path("hostile", "golden-out")]),
            None,
        ),
        (args("check", &[&golden, &results]), None),
        (args("eval -", &[]), Some(case.clone())),
        (
            args("eval --jsonl -", &[]),
            Some(format!("{case}\n{case}\n")),
        ),
        (args("eval --list", &[]), None),
    ]
}

fn spawn(args: &[String], stdin: Option<&str>, stdout: Stdio) -> std::process::Child {
    let mut child = Command::new(bin())
        .args(args)
        .stdin(Stdio::piped())
        .stdout(stdout)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = child.stdin.take().unwrap();
    if let Some(text) = stdin {
        input.write_all(text.as_bytes()).unwrap();
    }
    drop(input);
    child
}

#[test]
fn a_full_disk_is_one_line_and_status_74_for_every_command() {
    for (args, stdin) in printing_commands() {
        let full = File::create("/dev/full").unwrap();
        let o = spawn(&args, stdin.as_deref(), Stdio::from(full))
            .wait_with_output()
            .unwrap();
        let e = stderr(&o);
        assert_eq!(o.status.code(), Some(74), "{args:?}: {e}");
        assert_clean(&o, &format!("{args:?}"));
        assert!(
            e.contains("standard output") && e.contains("No space left"),
            "{args:?}: {e}"
        );
    }
}

#[test]
fn a_closed_pipe_ends_quietly_with_status_0() {
    for (args, stdin) in printing_commands() {
        let mut child = spawn(&args, stdin.as_deref(), Stdio::piped());
        drop(child.stdout.take()); // the reader is gone before the first write
        let o = child.wait_with_output().unwrap();
        assert_eq!(o.status.code(), Some(0), "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).is_empty(), "{args:?}: {}", stderr(&o));
    }
}

#[test]
fn head_on_a_pipe_gets_its_bytes_and_status_0() {
    // As a shell user runs it: `packshard bench --list | head -c10`.
    for cmd in [
        "bench --list",
        "eval --list",
        "vocab --vocab-size 7 --hidden 3 --tokens 2 --shards 1",
    ] {
        // bash, for PIPESTATUS: the status of packshard, not of head.
        let o = Command::new("bash")
            .arg("-c")
            .arg(format!(
                "{} {cmd} | head -c10; echo \" status ${{PIPESTATUS[0]}}\"",
                bin()
            ))
            .output()
            .unwrap();
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(!stderr(&o).contains("panicked"), "{cmd}: {}", stderr(&o));
        assert!(out.ends_with("status 0\n"), "{cmd}: {out}");
    }
}

// ---- class 3: memory: tests/hostile_cli/memory.rs ----------------------------

#[path = "hostile_cli/memory.rs"]
mod memory;

// ---- class 4: silent wrong results ------------------------------------------

#[test]
fn embedding_grad_output_must_have_the_weights_width() {
    let weight = json!([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]);
    for (go, shards) in [
        (json!([[1.0, 1.0]]), None),
        (json!([[1.0, 1.0, 1.0, 1.0]]), None),
        (json!([[1.0]]), Some(2)),
        (json!([[1.0, 1.0, 1.0, 1.0, 1.0]]), Some(1)),
        (json!([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]), None),
    ] {
        let mut case = json!({"op": "embedding", "ids": [1], "weight": weight, "want_grad": true, "grad_output": go});
        if let Some(p) = shards {
            case["num_shards"] = json!(p);
        }
        eval_err(&case, "shape_mismatch", &["grad_output"]);
    }
    let (o, v) = eval(
        &json!({"op": "embedding", "ids": [1, 1], "weight": weight, "want_grad": true,
        "grad_output": [[1.0, 1.0, 1.0], [0.5, 0.5, 0.5]]}),
    );
    assert_eq!(o.status.code(), Some(0), "{v}");
    assert_eq!(v["grad_weight"], json!([[0.0, 0.0, 0.0], [1.5, 1.5, 1.5]]));
}

fn attention_case(qk: f64, scale: Option<f64>, impl_: &str) -> Value {
    let t = json!([[[qk, qk]], [[qk, -qk]], [[0.5, qk]]]);
    let mut c = json!({"op": "attention", "impl": impl_, "q": t, "k": t,
        "v": [[[1.0, 2.0]], [[3.0, 4.0]], [[5.0, 6.0]]], "cu_seqlens": [0, 1, 3]});
    if let Some(s) = scale {
        c["scale"] = json!(s);
    }
    c
}

fn attention_impls() -> Vec<String> {
    let (_, v) = common::eval_list();
    let op = v["ops"]
        .as_array()
        .unwrap()
        .iter()
        .find(|o| o["op"] == "attention")
        .unwrap();
    op["impls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_string())
        .collect()
}

#[test]
fn attention_scores_that_overflow_are_refused_by_every_impl() {
    let impls = attention_impls();
    assert!(impls.len() >= 4, "{impls:?}");
    for imp in &impls {
        // f32 kernels refuse 1e200 as beyond f32 on entry, naming q; the
        // others refuse the scores; every one names a field, none gives NaN.
        for (qk, scale, field) in [
            (1e200, None, "q"),
            (1e20, None, "q"),
            (1.0, Some(1e308), "scale"),
            (1.0, Some(-1e308), "scale"),
            (1e10, Some(1e12), "scale"),
        ] {
            let m = eval_err(
                &attention_case(qk, scale, imp),
                "invalid_argument",
                &[field],
            );
            assert!(!m.contains("NaN"), "{imp}: {m}");
        }
        // Large but safe: finite output and lse.
        let (o, v) = eval(&attention_case(1e6, Some(1e-6), imp));
        assert_eq!(o.status.code(), Some(0), "{imp}: {v}");
        for x in v["lse"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|r| r.as_array().unwrap())
        {
            assert!(x.as_f64().is_some_and(f64::is_finite), "{imp}: lse {x}");
        }
    }
}

#[test]
fn duplicate_keys_are_refused_naming_the_key() {
    for (text, key) in [
        (
            r#"{"op": "pack", "op": "batch", "lengths": [1], "max_seq_len": 4}"#,
            "op",
        ),
        (
            r#"{"op": "pack", "lengths": [1], "max_seq_len": 4, "max_seq_len": 8}"#,
            "max_seq_len",
        ),
        (
            r#"{"op": "attention", "q": [], "k": [], "v": [], "cu_seqlens": [0], "scale": 1, "scale": 2}"#,
            "scale",
        ),
        (r#"{"op": "bert", "model": {"a": 1, "a": 2}}"#, "a"),
    ] {
        let o = packshard(&["eval", "-"], Some(text));
        assert_eq!(o.status.code(), Some(2));
        assert_clean(&o, text);
        let v: Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(v["error"]["kind"], "invalid_json", "{v}");
        let m = v["error"]["message"].as_str().unwrap();
        assert!(m.contains(&format!("duplicate key \"{key}\"")), "{m}");
    }
}

#[test]
fn position_offset_must_not_be_negative() {
    for off in [json!(-1), json!(-100), json!(i64::MIN), json!(i64::MAX)] {
        let case =
            json!({"op": "batch", "sequences": [[5, 6]], "max_seq_len": 4, "position_offset": off});
        eval_err(&case, "invalid_argument", &["position_offset"]);
    }
    let (o, v) = eval(
        &json!({"op": "batch", "sequences": [[5, 6]], "max_seq_len": 4, "position_offset": 2}),
    );
    assert_eq!(o.status.code(), Some(0), "{v}");
    assert_eq!(v["position_ids"], json!([[2, 3, 0, 0]]));
}

/// `eval --jsonl` of raw bytes: the output lines as JSON.
fn jsonl(bytes: &[u8]) -> (Output, Vec<Value>) {
    let path = temp_path("hostile", &format!("cases-{}.jsonl", bytes.len()));
    std::fs::write(&path, bytes).unwrap();
    let o = packshard(&["eval", "--jsonl", path.to_str().unwrap()], None);
    let out = String::from_utf8(o.stdout.clone()).unwrap();
    let lines = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    (o, lines)
}

#[test]
fn jsonl_answers_every_line_in_place() {
    let good = r#"{"op": "pack", "lengths": [3], "max_seq_len": 4}"#;
    let mut bytes = Vec::new();
    bytes.extend_from_slice(good.as_bytes()); // line 1: ok
    bytes.extend_from_slice(b"\n\xff\xfe not utf-8\n"); // line 2: bad bytes
    bytes.extend_from_slice(b"\n"); // line 3: blank
    bytes.extend_from_slice(b"   \r\n"); // line 4: blank with CR
    bytes.extend_from_slice(good.as_bytes()); // line 5: ok
    bytes.extend_from_slice(b"\n{\"op\": \"pack\", \"lengths\": [3] \n"); // line 6: bad JSON
    bytes.extend_from_slice(b"{\"op\": \"pack\", \"lengths\": [3], \"max_seq_len\": 1e2}\r\n"); // line 7
    bytes.extend_from_slice(good.as_bytes()); // line 8: ok, no final newline
    let (o, lines) = jsonl(&bytes);
    assert_eq!(o.status.code(), Some(2));
    assert_clean(&o, "jsonl");
    assert_eq!(lines.len(), 8, "{lines:?}");
    for i in [0, 4, 7] {
        assert_eq!(lines[i]["op"], "pack", "line {}: {}", i + 1, lines[i]);
    }
    for (i, needle) in [
        (1, "not UTF-8"),
        (2, "blank line"),
        (3, "blank line"),
        (5, "column"),
        (6, "integer"),
    ] {
        let m = lines[i]["error"]["message"].as_str().unwrap();
        assert!(m.starts_with(&format!("line {}: ", i + 1)), "{m}");
        assert!(m.contains(needle), "{m}");
        assert!(!m.contains("line 1 column"), "{m}");
    }
    // Empty input: no lines, status 0; a single final newline is not a blank line.
    let (o, lines) = jsonl(b"");
    assert_eq!((o.status.code(), lines.len()), (Some(0), 0));
    let (o, lines) = jsonl(format!("{good}\n").as_bytes());
    assert_eq!((o.status.code(), lines.len()), (Some(0), 1));
}

// ---- class 5: time ---------------------------------------------------------

#[test]
fn reference_attention_refuses_work_over_its_cap_at_once() {
    for (n, segs) in [(100_000usize, 1usize), (70_000, 2), (20_000, 1)] {
        let row = json!([[0.0]]);
        let t = vec![row; n];
        let mut cu: Vec<usize> = (0..segs).map(|s| s * n / segs).collect();
        cu.push(n);
        let case = json!({"op": "attention", "q": t, "k": t, "v": t, "cu_seqlens": cu});
        // The refusal names the query-key budget, which the reference checks
        // from cu_seqlens before it allocates or computes anything; no wall
        // clock here (shared machines: timing lives in benchmarks).
        eval_err(
            &case,
            "invalid_argument",
            &["cu_seqlens", "query-key pairs"],
        );
    }
}

// ---- class 6: messages -----------------------------------------------------

#[test]
fn echoed_values_are_cut_short() {
    let huge = "x".repeat(5_000_000);
    for case in [
        json!({"op": huge}),
        json!({"op": "pack", "lengths": [3], "max_seq_len": huge}),
        json!({"op": "pack", "impl": huge}),
        json!({"op": "attention", "q": [[[huge]]], "k": [], "v": [], "cu_seqlens": [0, 1]}),
        json!({"op": "pack", "lengths": [3], "max_seq_len": 4, huge.clone(): 1}),
    ] {
        let (o, v) = eval(&case);
        assert_eq!(o.status.code(), Some(2));
        let m = v["error"]["message"].as_str().unwrap();
        assert!(m.len() < 600, "{} bytes: {}", m.len(), &m[..200]);
        assert!(
            m.contains("5000002 bytes") || m.contains("5000000 bytes"),
            "{m}"
        );
    }
    // The same through clap (one argument of at most 128 KiB: Linux's
    // MAX_ARG_STRLEN).
    let o = packshard(&["vocab", "--tokens", &"7".repeat(100_000)], None);
    assert_eq!(o.status.code(), Some(2));
    assert!(o.stderr.len() < 600, "{} bytes", o.stderr.len());
}

#[test]
fn numbers_written_as_floats_say_an_integer_is_expected() {
    for (v, given) in [
        (json!(1e2), "100.0"),
        (json!(8.5), "8.5"),
        (json!(-3), "negative"),
    ] {
        let case = json!({"op": "pack", "lengths": [3], "max_seq_len": v});
        eval_err(
            &case,
            "invalid_argument",
            &["max_seq_len", given, "integer"],
        );
    }
    let o = packshard(
        &["eval", "-"],
        Some(r#"{"op": "pack", "lengths": [1e2], "max_seq_len": 400}"#),
    );
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    let m = v["error"]["message"].as_str().unwrap();
    assert!(
        m.contains("lengths[0]") && m.contains("fraction or exponent"),
        "{m}"
    );
}

#[test]
fn a_byte_order_mark_is_skipped() {
    let case = "\u{feff}{\"op\": \"pack\", \"lengths\": [3], \"max_seq_len\": 4}";
    let o = packshard(&["eval", "-"], Some(case));
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
    let (o, lines) = jsonl(format!("{case}\n{}\n", &case[3..]).as_bytes());
    assert_eq!(o.status.code(), Some(0), "{lines:?}");
    assert_eq!(lines.len(), 2);
    // An empty case says so.
    for text in ["", "\u{feff}", "   "] {
        let o = packshard(&["eval", "-"], Some(text));
        let v: Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(v["error"]["kind"], "invalid_json", "{v}");
    }
}

#[test]
fn eval_without_a_case_names_the_argument() {
    let o = packshard(&["eval"], None);
    assert_eq!(o.status.code(), Some(2));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    let m = v["error"]["message"].as_str().unwrap();
    assert!(m.contains("<CASE>"), "{m}");
    let o = packshard(&["check"], None);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("<DIR>") && stderr(&o).contains("<RESULTS>"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn only_the_documented_spellings_of_non_finite_values() {
    for s in [
        "Infinity",
        "-INF",
        "+inf",
        "NaN",
        "inf ",
        "infinity",
        "-Infinity",
    ] {
        let case = json!({"op": "cross_entropy", "logits": [[0.0, s]], "targets": [0]});
        eval_err(
            &case,
            "invalid_argument",
            &["logits[0][1]", "\"inf\", \"-inf\", \"nan\""],
        );
    }
    let (o, v) = eval(&json!({"op": "cross_entropy", "logits": [[0.0, "-inf"]], "targets": [0]}));
    assert_eq!(o.status.code(), Some(0), "{v}");
}

#[test]
fn check_reports_an_infinite_error_as_inf() {
    let golden = temp_path("hostile", "golden-inf");
    let st = Command::new(bin())
        .args(["golden", "--out", golden.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(st.status.success());
    let results = temp_path("hostile", "inf-results.safetensors");
    let (case, name) = one_case_results(&golden, &results, Some(f64::INFINITY));
    let o = packshard(
        &["check", golden.to_str().unwrap(), results.to_str().unwrap()],
        None,
    );
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(o.status.code(), Some(1), "{out}{}", stderr(&o));
    let row = out
        .lines()
        .find(|l| l.contains(&case) && l.contains(&name))
        .unwrap_or_else(|| panic!("{out}"));
    assert!(row.contains("inf") && !row.contains("nan"), "{row}");
}

/// Writes `results`: every output of the first expected case of the golden
/// set in `golden` (`check` wants all of a case's outputs or none), as
/// stored (`fill: None`) or with every value `fill`. Returns the case and
/// its first output's name.
fn one_case_results(golden: &Path, results: &Path, fill: Option<f64>) -> (String, String) {
    let expected = golden.join("expected");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&expected)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    let first = &files[0];
    let case = first.file_stem().unwrap().to_str().unwrap().to_string();
    let bytes = std::fs::read(first).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, Value> = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let mut h = serde_json::Map::new();
    let mut body = Vec::new();
    let mut first_name = None;
    for (name, info) in header.iter().filter(|(k, _)| *k != "__metadata__") {
        assert_eq!(info["dtype"], "F64", "{info}");
        first_name.get_or_insert_with(|| name.clone());
        let shape: Vec<usize> = serde_json::from_value(info["shape"].clone()).unwrap();
        let offsets: Vec<usize> = serde_json::from_value(info["data_offsets"].clone()).unwrap();
        let data = &bytes[8 + n + offsets[0]..8 + n + offsets[1]];
        let start = body.len();
        match fill {
            None => body.extend_from_slice(data),
            Some(x) => {
                for _ in 0..data.len() / 8 {
                    body.extend_from_slice(&x.to_le_bytes());
                }
            }
        }
        h.insert(
            format!("{case}/{name}"),
            json!({"dtype": "F64", "shape": shape, "data_offsets": [start, body.len()]}),
        );
    }
    let h = Value::Object(h).to_string();
    let mut f = File::create(results).unwrap();
    f.write_all(&(h.len() as u64).to_le_bytes()).unwrap();
    f.write_all(h.as_bytes()).unwrap();
    f.write_all(&body).unwrap();
    (case, first_name.expect("the case has outputs"))
}
