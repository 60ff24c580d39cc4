//! The `packshard pack` and `packshard eval` commands end to end, with insta
//! snapshots of the comparison tables, small plans and batches, and errors.

use packshard::reference::packing::{pack_histogram, Histogram};
use packshard::report;

mod common;
use common::{packshard, stdout_text as stdout};

fn comparison(dataset: &str, msl: usize) -> String {
    let h = Histogram::embedded(dataset).unwrap();
    let configs = report::default_rows(msl);
    let mut rows: Vec<_> = configs
        .iter()
        .map(|c| pack_histogram(&h, c).unwrap().metrics)
        .collect();
    report::attach_bounds(&h, &configs, &mut rows);
    // Every row has a bound, and no row beats it.
    for m in &rows {
        let bound = m
            .bound_packs
            .unwrap_or_else(|| panic!("{}: no bound", m.algorithm));
        assert!(
            m.num_packs >= bound,
            "{} {}: {} < {bound}",
            m.algorithm,
            m.setting,
            m.num_packs
        );
    }
    report::table(&rows, false)
}

#[test]
fn comparison_table_wikipedia() {
    insta::assert_snapshot!(comparison("wikipedia-512", 512));
}

#[test]
fn comparison_table_squad() {
    insta::assert_snapshot!(comparison("squad-384", 384));
}

#[test]
fn pack_without_arguments_prints_the_wikipedia_table() {
    let o = packshard(&["pack"], None);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = stdout(&o);
    assert!(
        out.starts_with("wikipedia-512: 16279552 sequences"),
        "{out}"
    );
    for needle in [
        "spfhp     max 12/pack     8166708     99.604%   99.983%    30981   1.9934x  2.0013x",
        "nnlshp    depth 3         8155047     99.746%   99.884",
        "lphp      depth 3",
        "lphp      depth 12        8135729     99.983%   99.983%        2",
        "With at most 3 sequences per pack (the paper's choice): best lphp (depth 3), 99.884% efficiency",
        "8 packs over the bound of 8143829 packs (the LP optimum 8143828.86 rounded up: at most 99.884%).",
        "With at most 12 sequences per pack: best lphp (depth 12), 99.983% efficiency",
        "2 packs over the bound of 8135727 packs (the LP optimum 8135726.92 rounded up: at most 99.983%).",
        "Best overall: lphp (depth 12), 99.983% efficiency; no bound in the table allows more.",
    ] {
        assert!(out.contains(needle), "missing {needle:?} in\n{out}");
    }
}

#[test]
fn one_limit_for_every_row_prints_each_row_once() {
    let o = packshard(
        &[
            "pack",
            "--dataset",
            "squad-384",
            "--max-sequences-per-pack",
            "3",
            "--no-bound",
        ],
        None,
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = stdout(&o);
    for algorithm in ["none", "spfhp", "lpfhp", "nnlshp", "lphp", "ffd", "bfd"] {
        let rows = out
            .lines()
            .filter(|l| l.starts_with(&format!("{algorithm:<10}")))
            .count();
        assert_eq!(rows, 1, "{algorithm} in\n{out}");
    }
    // One limit: one closing line for it, no "Best overall".
    assert!(
        out.contains("With at most 3 sequences per pack (the paper's choice): best lphp (depth 3)"),
        "{out}"
    );
    assert!(!out.contains("Best overall"), "{out}");
}

#[test]
fn pack_json_and_plan_file() {
    let dir = std::env::temp_dir().join(format!("packshard-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let lengths = dir.join("lengths.txt");
    std::fs::write(&lengths, "4 2 3\n1, 0\n").unwrap();
    let plan = dir.join("plan.json");
    let o = packshard(
        &[
            "pack",
            "--lengths",
            lengths.to_str().unwrap(),
            "--max-seq-len",
            "5",
            "-a",
            "ffd",
            "--json",
            "--plan-out",
            plan.to_str().unwrap(),
        ],
        None,
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let summary: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(summary["results"][0]["metrics"]["num_packs"], 2);
    assert_eq!(summary["empty_sequences"], 1);
    let plan: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&plan).unwrap()).unwrap();
    assert_eq!(
        plan["results"][0]["packs"],
        serde_json::json!([
            [{"sequence": 0, "offset": 0, "length": 4}, {"sequence": 3, "offset": 0, "length": 1}],
            [{"sequence": 2, "offset": 0, "length": 3}, {"sequence": 1, "offset": 0, "length": 2}]
        ])
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn pack_errors_are_one_line_and_exit_2() {
    for args in [
        vec!["pack", "--algorithm", "foo"],
        vec!["pack", "--dataset", "c4"],
        vec!["pack", "--histogram", "/nonexistent.csv"],
        vec!["pack", "--max-seq-len", "100", "--algorithm", "spfhp"],
        vec!["pack", "--bogus"],
    ] {
        let o = packshard(&args, None);
        assert_eq!(o.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    let o = packshard(
        &["pack", "--max-seq-len", "100", "--algorithm", "spfhp"],
        None,
    );
    insta::assert_snapshot!(String::from_utf8_lossy(&o.stderr), @"packshard: histogram[101]: sequence of length 101 is longer than max_seq_len 100");
}

use common::eval_text as eval;

#[test]
fn eval_pack_small_plans() {
    let (code, v) = eval(
        r#"{"op": "pack", "lengths": [4, 2, 3, 1], "max_seq_len": 3, "overlong": "split", "algorithm": "ffd"}"#,
    );
    assert_eq!(code, 0);
    insta::assert_json_snapshot!("eval_pack_p3_split", v);
    let (_, v) = eval(
        r#"{"op": "pack", "histogram": [[3, 2], [5, 1], [8, 1]], "max_seq_len": 8, "algorithm": "nnlshp"}"#,
    );
    insta::assert_json_snapshot!("eval_pack_histogram_nnlshp", v);
    // LPHP on the same histogram: the LP optimum 2.5 rounds up to 3 packs.
    let (code, v) = eval(
        r#"{"op": "pack", "histogram": [[3, 2], [5, 1], [8, 1]], "max_seq_len": 8, "algorithm": "lphp"}"#,
    );
    assert_eq!(code, 0);
    assert_eq!(
        (v["num_packs"].as_u64(), v["bound_packs"].as_u64()),
        (Some(3), Some(3))
    );
    insta::assert_json_snapshot!("eval_pack_histogram_lphp", v);
}

#[test]
fn eval_batch_small_batches() {
    let (_, v) = eval(
        r#"{"op": "batch", "sequences": [[5, 6, 7], [], [8, 9]], "max_seq_len": 4, "position_offset": 2, "pad_token_id": 1}"#,
    );
    insta::assert_json_snapshot!("eval_batch_p4_p6", v);
    let (_, v) = eval(r#"{"op": "batch", "sequences": [[5, 6, 7]], "max_seq_len": 8}"#);
    assert_eq!(
        v["sequence_ids"],
        serde_json::json!([[1, 1, 1, 0, 0, 0, 0, 0]])
    );
    assert_eq!(v["cu_seqlens"], serde_json::json!([[0, 3]]));
}

#[test]
fn eval_errors_follow_the_contract() {
    let cases = [
        ("not json", "invalid_json"),
        (r#"[1, 2]"#, "invalid_json"),
        (r#"{"lengths": [1]}"#, "missing_field"),
        (r#"{"op": "frobnicate"}"#, "unknown_op"),
        (r#"{"op": "pack", "lengths": [1]}"#, "missing_field"),
        (
            r#"{"op": "pack", "lengths": [1, -2], "max_seq_len": 4}"#,
            "invalid_argument",
        ),
        (
            r#"{"op": "pack", "lengths": [9], "max_seq_len": 4}"#,
            "sequence_too_long",
        ),
        (
            r#"{"op": "pack", "lengths": [1], "max_seq_len": 4, "algorithm": "magic"}"#,
            "invalid_argument",
        ),
        (
            r#"{"op": "pack", "lengths": [1], "max_seq_len": 4, "max_seq_length": 4}"#,
            "invalid_argument",
        ),
        (
            r#"{"op": "pack", "histogram": [[1, 2, 3]], "max_seq_len": 4}"#,
            "shape_mismatch",
        ),
        (
            r#"{"op": "pack", "lengths": [1], "max_seq_len": 4, "impl": "gpu"}"#,
            "invalid_argument",
        ),
        (
            r#"{"op": "pack", "lengths": [1], "max_seq_len": 0}"#,
            "invalid_argument",
        ),
        (
            r#"{"op": "pack", "lengths": [1], "max_seq_len": 99999999999}"#,
            "invalid_argument",
        ),
        (
            r#"{"op": "batch", "sequences": [[1], 2], "max_seq_len": 4}"#,
            "invalid_argument",
        ),
        (
            r#"{"op": "pack", "lengths": [221, 3, 8333881], "max_seq_len": 1, "overlong": "split"}"#,
            "invalid_argument",
        ),
    ];
    let mut messages = String::new();
    for (case, kind) in cases {
        let (code, v) = eval(case);
        assert_eq!(code, 2, "{case}");
        assert_eq!(v["error"]["kind"], kind, "{case}: {v}");
        messages.push_str(&format!(
            "{case}\n  -> {}\n",
            v["error"]["message"].as_str().unwrap()
        ));
    }
    insta::assert_snapshot!(messages);
}

#[test]
fn eval_jsonl_answers_every_line() {
    let input = "{\"op\": \"pack\", \"lengths\": [1, 2], \"max_seq_len\": 4}\nnope\n\n{\"op\": \"pack\", \"lengths\": [3], \"max_seq_len\": 4}\n";
    let o = packshard(&["eval", "--jsonl", "-"], Some(input));
    assert_eq!(o.status.code(), Some(2), "one line failed");
    let lines: Vec<serde_json::Value> = stdout(&o)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    // Output line i answers input line i (issue #14): the blank third line
    // gets an error line of its own, so the fourth case is still line 4.
    assert_eq!(lines.len(), 4);
    assert_eq!(lines[0]["num_packs"], 1);
    assert_eq!(lines[1]["error"]["kind"], "invalid_json");
    assert_eq!(lines[2]["error"]["kind"], "invalid_json");
    assert!(lines[2]["error"]["message"]
        .as_str()
        .unwrap()
        .starts_with("line 3: "));
    assert_eq!(lines[3]["num_packs"], 1);
}

#[test]
fn eval_list_names_the_ops() {
    common::assert_listed(&["pack", "batch"]);
}
