//! The memory budget on every path: one parser that every subcommand
//! refuses alike, a ragged tensor sized from the values present (not its
//! first-element chain) under an address-space cap, `check`'s files
//! against the budget, and byte counts under 1 MiB printed in their unit.

use std::path::Path;
use std::process::Command;

use super::*;

/// The binary under an address-space cap of `cap_mib` MiB, with
/// `PACKSHARD_MEMORY_BUDGET=budget`, `stdin` from a file.
fn capped(cap_mib: u64, budget: &str, args: &[&str], stdin: Option<&Path>) -> Output {
    let mut line = format!(
        "ulimit -v {} && exec {}",
        cap_mib * 1024,
        env!("CARGO_BIN_EXE_packshard")
    );
    for a in args {
        line.push_str(&format!(" '{a}'"));
    }
    if let Some(f) = stdin {
        line.push_str(&format!(" < '{}'", f.display()));
    }
    Command::new("sh")
        .arg("-c")
        .arg(line)
        .env("PACKSHARD_MEMORY_BUDGET", budget)
        .output()
        .unwrap()
}

/// The cap of `hostile_cli`'s memory tests: the binary, its threads and
/// allocator arenas fit in 4 GiB with a 1 GiB budget (tests/hostile_cli/memory.rs).
const CAP_MIB: u64 = 4096;

#[test]
fn a_bad_budget_is_refused_by_every_subcommand() {
    let dir = temp_path("edges-budget", "golden");
    let d = dir.to_str().unwrap();
    let commands: [&[&str]; 5] = [
        &["pack"],
        &["check", d, d],
        &["bench", "--quick"],
        &["golden", "--out", d],
        &["vocab", "--tokens", "2"],
    ];
    for args in &commands {
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_packshard"))
            .args(*args)
            .env("PACKSHARD_MEMORY_BUDGET", "abc")
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        assert_clean(&o, &format!("{args:?}"));
        assert!(
            stderr(&o).contains("PACKSHARD_MEMORY_BUDGET: \"abc\" is not a byte count"),
            "{args:?}: {}",
            stderr(&o)
        );
    }
    // eval refuses it as a JSON error.
    let o = capped(CAP_MIB, "abc", &["eval", "-"], None);
    assert_eq!(o.status.code(), Some(2));
    assert!(common::stdout_text(&o).contains("PACKSHARD_MEMORY_BUDGET"));
    // A negative control: a good budget lets pack run.
    let o = capped(CAP_MIB, "64MiB", &["pack"], None);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
}

#[test]
fn a_ragged_tensor_is_refused_without_reserving_its_first_chain() {
    // q's first-element chain claims [10^4, 10^4, 10^4] = 10^12 values (8
    // TB); only the first row of the first item holds 10^4 numbers, every
    // other list is empty: an ~80 KB case.
    let w = 10_000;
    let first_row = format!("[{}]", vec!["0"; w].join(","));
    let first_item = format!("[{first_row}{}]", ",[]".repeat(w - 1));
    let q = format!("[{first_item}{}]", ",[[]]".repeat(w - 1));
    let case = format!(
        r#"{{"op": "attention", "q": {q}, "k": [[[0]]], "v": [[[0]]], "cu_seqlens": [0, {w}]}}"#
    );
    assert!(case.len() < 200_000, "{}", case.len());
    let path = temp_path("edges-budget", "ragged.json");
    std::fs::write(&path, &case).unwrap();
    let o = capped(CAP_MIB, "1GiB", &["eval", "-"], Some(&path));
    assert_clean(&o, "ragged");
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["error"]["kind"], "shape_mismatch", "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("ragged"),
        "{v}"
    );
}

#[test]
fn check_reads_no_file_over_the_budget_and_names_its_units() {
    let dir = temp_path("edges-budget", "golden-small");
    let _ = std::fs::remove_dir_all(&dir);
    let d = dir.to_str().unwrap();
    let o = packshard(&["golden", "--out", d], None);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    // A 4 KiB budget: the manifest (~60 KB) is over it, and the message
    // says so in KiB, not "0 MiB over 0 MiB".
    let o = capped(CAP_MIB, "4KiB", &["check", d, d], None);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert_clean(&o, "check 4KiB");
    let e = stderr(&o);
    assert!(e.contains("over the memory budget of 4 KiB"), "{e}");
    assert!(!e.contains("0 MiB"), "{e}");
}

#[test]
fn out_of_range_integers_and_tiny_options_read_as_written() {
    let m = refused(
        &json!({"op": "pack", "lengths": [3], "max_seq_len": 1e30}),
        "max_seq_len",
    );
    assert!(m.contains("out of range") && !m.contains("fraction"), "{m}");
    // A negative control: 1.5 is an integer written with a fraction.
    let m = refused(
        &json!({"op": "pack", "lengths": [3], "max_seq_len": 1.5}),
        "max_seq_len",
    );
    assert!(m.contains("fraction"), "{m}");
    // -1e-300 is echoed as written, not with 300 digits.
    for field in ["label_smoothing", "z_loss", "softcap"] {
        let mut c = json!({"op": "cross_entropy", "logits": [[1.0, 2.0]], "targets": [0]});
        c[field] = json!(-1e-300);
        let m = refused(&c, field);
        assert!(m.contains("-1e-300") && m.len() < 120, "{m}");
    }
}

#[test]
fn bench_sizes_are_held_to_the_budget_before_any_work() {
    // 10^8 sequences: refused from the sizes alone (it took 20 s before).
    let t = std::time::Instant::now();
    let o = capped(
        CAP_MIB,
        "1GiB",
        &["bench", "--sequences", "100000000"],
        None,
    );
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert_clean(&o, "bench 1e8");
    assert!(
        stderr(&o).starts_with("packshard: sequences:"),
        "{}",
        stderr(&o)
    );
    // 2 s: process start and argument parsing, nothing drawn or timed.
    assert!(t.elapsed().as_secs_f64() < 2.0, "{:?}", t.elapsed());
    // A cross-entropy size over the budget names its index.
    let o = capped(
        CAP_MIB,
        "1GiB",
        &[
            "bench",
            "--quick",
            "--only",
            "ce",
            "--ce-sizes",
            "64x8,100000000x1024",
        ],
        None,
    );
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("ce_sizes[1]"), "{}", stderr(&o));
}

#[test]
fn a_bad_eos_token_id_is_named_as_given() {
    let base = json!({
        "op": "decoder_forward_backward", "vocab_size": 3, "num_heads": 1, "head_dim": 2,
        "intermediate_size": 2, "num_layers": 0, "input_ids": [0, 1, 2],
        "model.embed_tokens.weight": [[0.1, 0.2], [0.3, -0.1], [0.5, 0.2]],
        "model.norm.weight": [1.0, 1.0],
        "lm_head.weight": [[0.1, 0.2], [0.3, -0.1], [0.5, 0.2]],
    });
    for eos in [7, -5] {
        let mut c = base.clone();
        c["eos_token_id"] = json!(eos);
        refused(&c, "eos_token_id");
    }
    // A negative control: a good eos runs, and labels out of range are
    // still named labels[i].
    let mut c = base.clone();
    c["eos_token_id"] = json!(2);
    answered(&c);
    c.as_object_mut().unwrap().remove("eos_token_id");
    c["labels"] = json!([1, 9, 0]);
    let (code, v) = eval(&c);
    assert_eq!(code, 2);
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("labels[1]"),
        "{v}"
    );
}

#[test]
fn many_unknown_fields_are_checked_in_linear_time() {
    // 100,000 unknown keys took 13 s (each checked against a list of all).
    let mut c = json!({
        "op": "decoder_forward_backward", "vocab_size": 3, "num_heads": 1, "head_dim": 2,
        "intermediate_size": 2, "num_layers": 0, "input_ids": [0],
    });
    for i in 0..100_000 {
        c[format!("junk{i}")] = json!(0);
    }
    let t = std::time::Instant::now();
    let (code, v) = eval(&c);
    assert_eq!(code, 2, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("unknown field"),
        "{v}"
    );
    // 3 s: parsing 2 MB of JSON in a test build, with room for a loaded machine.
    assert!(t.elapsed().as_secs_f64() < 3.0, "{:?}", t.elapsed());
}
