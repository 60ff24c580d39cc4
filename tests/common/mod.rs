//! Helpers shared by the integration tests that run the `packshard` binary.
//! (Each test binary uses some of them.)
#![allow(dead_code)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

/// Runs the `packshard` binary built for these tests with `args`, writing
/// `stdin` (when given) to its standard input, and waits for it.
pub fn packshard(args: &[&str], stdin: Option<&str>) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_packshard"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn packshard");
    if let Some(text) = stdin {
        child
            .stdin
            .take()
            .expect("piped stdin")
            .write_all(text.as_bytes())
            .expect("write stdin");
    }
    drop(child.stdin.take());
    child.wait_with_output().expect("wait for packshard")
}

/// `packshard eval -` on one case (JSON text): its exit status and the one
/// JSON value it prints.
pub fn eval_text(case: &str) -> (i32, serde_json::Value) {
    let o = packshard(&["eval", "-"], Some(case));
    let text = String::from_utf8_lossy(&o.stdout).to_string();
    let v = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    (o.status.code().expect("an exit status"), v)
}

/// `name` inside `packshard-{prefix}-{pid}` under the system temporary
/// directory, which is created (one such directory per test process).
pub fn temp_path(prefix: &str, name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("packshard-{prefix}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// A run's standard output as text (invalid UTF-8 replaced).
pub fn stdout_text(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// A run's standard error as text (invalid UTF-8 replaced).
pub fn stderr_text(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The standard output of a run that must have succeeded (else a panic
/// showing both streams).
pub fn succeeded(o: &Output) -> String {
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{out}\n{err}");
    out
}

/// Runs `c`, which must succeed (as [`succeeded`]): its standard output.
pub fn run_succeeded(c: &mut Command) -> String {
    succeeded(&c.output().expect("the command runs"))
}

/// Asserts that `out` contains each of `wants`, naming the first missing.
pub fn assert_mentions(out: &str, wants: &[&str]) {
    for want in wants {
        assert!(out.contains(want), "missing {want:?} in\n{out}");
    }
}

/// [`eval_text`] of a JSON value.
pub fn eval(case: &serde_json::Value) -> (i32, serde_json::Value) {
    eval_text(&case.to_string())
}

/// Runs every `(name, case, kind)`, each of which must be refused (exit 2)
/// with error `kind`, and returns one line per case, `name: kind |
/// message` (the message cut at `max_chars` bytes), for a snapshot of the
/// contract's messages.
pub fn error_lines(cases: &[(&str, serde_json::Value, &str)], max_chars: usize) -> String {
    let mut lines = String::new();
    for (name, case, kind) in cases {
        let (code, v) = eval(case);
        assert_eq!(code, 2, "{name}: {v}");
        assert_eq!(v["error"]["kind"], *kind, "{name}: {v}");
        let msg = v["error"]["message"].as_str().unwrap();
        let msg = &msg[..msg.len().min(max_chars)];
        lines.push_str(&format!("{name}: {kind} | {msg}\n"));
    }
    lines
}

/// The op names `packshard eval --list` prints, and its whole answer.
pub fn eval_list() -> (Vec<String>, serde_json::Value) {
    let o = packshard(&["eval", "--list"], None);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("--list prints JSON");
    let ops = v["ops"].as_array().expect("an ops list");
    let names = ops.iter().map(|o| o["op"].as_str().unwrap().to_string());
    (names.collect(), v)
}

/// Asserts that `packshard eval --list` names every op in `ops`.
pub fn assert_listed(ops: &[&str]) {
    let (names, _) = eval_list();
    for op in ops {
        assert!(names.iter().any(|n| n == op), "{op} not in {names:?}");
    }
}

/// `packshard verify <what> <model_flag> MODEL --text TEXT`, ready for
/// more arguments (the sample size, the model's shape) before it runs.
pub fn verify_command(what: &str, model_flag: &str, model: &Path, text: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_packshard"));
    c.args(["verify", what, model_flag])
        .arg(model)
        .arg("--text")
        .arg(text);
    c
}
