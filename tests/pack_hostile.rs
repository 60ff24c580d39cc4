//! `packshard pack` and the `pack`/`batch` ops on hostile input (issue #14):
//! every refusal is exit 2 with one line naming the field, never a panic, and
//! nothing silently wrong (negative padding, swapped columns, skipped fields).

use std::path::{Path, PathBuf};
use std::process::Output;

mod common;
use common::{packshard, stdout_text as stdout, temp_path};

/// Exit 2, one line on stderr, no panic; returns the line.
/// `packshard pack <source> <path> <words...>` (`source`: `--lengths` or `--histogram`).
fn pack(source: &str, path: &Path, words: &str) -> Output {
    let mut args = vec!["pack", source, path.to_str().unwrap()];
    args.extend(words.split_whitespace());
    packshard(&args, None)
}

fn refused(o: &Output) -> String {
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(
        o.status.code(),
        Some(2),
        "stderr: {err}\nstdout: {}",
        stdout(o)
    );
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(!err.contains("panicked"), "{err}");
    err.trim_end().to_string()
}

#[test]
fn an_empty_field_in_a_lengths_file_is_refused_naming_line_and_field() {
    let path = temp_path("hostile", "empty-field.txt");
    std::fs::write(&path, "1 2\n3,4,,5\n").unwrap();
    let o = packshard(&["pack", "--lengths", path.to_str().unwrap()], None);
    let err = refused(&o);
    assert!(
        err.ends_with(
            "line 2 field 3: empty field (lengths are integers separated by whitespace or commas)"
        ),
        "{err}"
    );
}

#[test]
fn a_histogram_header_says_which_column_is_which() {
    let swapped = temp_path("hostile", "count-length.csv");
    std::fs::write(&swapped, "count,length\n10,3\n2,5\n").unwrap();
    let plain = temp_path("hostile", "length-count.csv");
    std::fs::write(&plain, "length,count\n3,10\n5,2\n").unwrap();
    let run = |p: &PathBuf| {
        let o = pack("--histogram", p, "-a ffd --json");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
        (
            v["sequences"].clone(),
            v["real_tokens"].clone(),
            v["max_seq_len"].clone(),
        )
    };
    assert_eq!(run(&swapped), run(&plain));
    assert_eq!(run(&plain), (12.into(), 40.into(), 5.into()));
    let bad = temp_path("hostile", "bad-header.csv");
    std::fs::write(&bad, "len,n\n3,10\n").unwrap();
    let err = refused(&packshard(
        &["pack", "--histogram", bad.to_str().unwrap()],
        None,
    ));
    assert!(err.contains("line 1: header `len,n`"), "{err}");
}

#[test]
fn overlong_policies_never_print_negative_padding_and_say_what_was_lost() {
    let path = temp_path("hostile", "overlong.txt");
    std::fs::write(&path, "10 20 30 250 400\n").unwrap();
    for (policy, needle) in [
        ("truncate", "overlong: 2 sequences truncated to 100 tokens, 450 tokens dropped"),
        ("drop", "overlong: 2 sequences dropped, 650 tokens with them"),
        ("split", "overlong: 2 sequences split into pieces of at most 100 tokens (10 segments packed), no token dropped"),
    ] {
        let o = pack("--lengths", &path, &format!("--max-seq-len 100 --overlong {policy} --no-bound"));
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let out = stdout(&o);
        let first = out.lines().next().unwrap();
        assert!(first.contains("max_seq_len 100, "), "{first}");
        assert!(!first.contains("max_seq_len 100, -"), "{policy}: {first}");
        assert!(out.contains(needle), "{policy}: missing {needle:?} in\n{out}");
    }
}

#[test]
fn many_lengths_stream_into_a_histogram_and_empty_ones_count_against_the_plan_limit() {
    // 1.2 M lines, a third of them empty sequences: over the 2^20 a plan
    // per sequence can list, so the table packs their histogram.
    let path = temp_path("hostile", "many.txt");
    let mut text = String::with_capacity(6 << 20);
    for i in 0..1_200_000u32 {
        text.push_str(if i % 3 == 0 {
            "0\n"
        } else if i % 3 == 1 {
            "37\n"
        } else {
            "200\n"
        });
    }
    std::fs::write(&path, text).unwrap();
    let o = pack("--lengths", &path, "--max-seq-len 256 -a spfhp");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = stdout(&o);
    assert!(
        out.starts_with(&format!("{}: 800000 sequences", path.display())),
        "{out}"
    );
    assert!(
        out.contains("packed as their histogram, no plan per sequence"),
        "{out}"
    );
    // A plan per sequence cannot list them all.
    let plan = temp_path("hostile", "many-plan.json");
    let (lengths, plan_out) = (path.to_str().unwrap(), plan.to_str().unwrap());
    let args = [
        "pack",
        "--max-seq-len",
        "256",
        "-a",
        "spfhp",
        "--lengths",
        lengths,
    ];
    let err = refused(&packshard(
        &[&args[..], &["--plan-out", plan_out]].concat(),
        None,
    ));
    assert!(
        err.starts_with("packshard: lengths: 800000 sequences"),
        "{err}"
    );
}

#[test]
fn huge_max_seq_len_is_packed_or_refused_before_any_work() {
    // 2,000 distinct lengths at max_seq_len 2^24: SPFHP and LPFHP jump
    // between open packs instead of scanning every free-space value. How
    // long that takes is measured by the criterion bench `pack/wide-2^24`
    // (benches/packing.rs), not here: tests on shared machines hold no
    // timing (CONTRIBUTING). A regression to the free-space scan shows there.
    let path = temp_path("hostile", "wide.csv");
    let text: String = (1..=2000)
        .map(|i| format!("{},{}\n", i * 8000, 1 + i % 7))
        .collect();
    std::fs::write(&path, text).unwrap();
    for algorithm in ["spfhp", "lpfhp", "ffd", "bfd"] {
        let o = pack(
            "--histogram",
            &path,
            &format!("--max-seq-len 16777216 -a {algorithm} --no-bound"),
        );
        assert!(
            o.status.success(),
            "{algorithm}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    // The whole table: NNLSHP is refused before anything is packed.
    let err = refused(&pack("--histogram", &path, "--max-seq-len 16777216"));
    assert!(
        err.starts_with("packshard: max_sequences_per_pack: depth 3 at max_seq_len 16777216"),
        "{err}"
    );
}

#[test]
fn a_batch_over_the_memory_budget_is_refused_naming_the_field() {
    // 2 sequences of 2^22 tokens cannot be sent cheaply; a small budget
    // makes a small batch too large instead.
    let case = r#"{"op": "batch", "sequences": [[1, 2, 3], [4, 5]], "max_seq_len": 4096}"#;
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_packshard"))
        .args(["eval", "-"])
        .env("PACKSHARD_MEMORY_BUDGET", "1MiB")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(case.as_bytes())
        .unwrap();
    let o = child.wait_with_output().unwrap();
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(v["error"]["kind"], "invalid_argument", "{v}");
    let message = v["error"]["message"].as_str().unwrap();
    assert!(
        message.starts_with("max_seq_len: a batch of 1 packs x 4096 tokens needs about 1.25 MiB, over the memory budget of 1 MiB"),
        "{message}"
    );
    // Within the default budget the same batch is built.
    let (code, v) = eval_default(case);
    assert_eq!(code, 0, "{v}");
    assert_eq!(v["num_packs"], 1);
}

use common::eval_text as eval_default;

#[test]
fn eval_pack_computes_the_bound_only_when_cheap_or_asked() {
    let wiki = packshard::reference::packing::Histogram::embedded("wikipedia-512").unwrap();
    let pairs: Vec<[u64; 2]> = wiki
        .counts()
        .iter()
        .enumerate()
        .filter(|(_, &c)| c > 0)
        .map(|(l, &c)| [l as u64, c])
        .collect();
    let case = |bound: &str| {
        format!(
            r#"{{"op": "pack", "histogram": {}, "max_seq_len": 512, "max_sequences_per_pack": 12{bound}}}"#,
            serde_json::to_string(&pairs).unwrap()
        )
    };
    let (code, v) = eval_default(&case(""));
    assert_eq!(code, 0, "{v}");
    assert_eq!(v["num_packs"], 8166708);
    assert!(
        v["bound_packs"].is_null(),
        "expensive bound computed by default: {v}"
    );
    let (_, v) = eval_default(&case(r#", "bound": true"#));
    assert_eq!(v["bound_packs"], 8135727);
    // A small histogram gets its bound by default.
    let (_, v) = eval_default(r#"{"op": "pack", "histogram": [[3, 2], [5, 1]], "max_seq_len": 8}"#);
    assert_eq!(v["bound_packs"], 2);
}
