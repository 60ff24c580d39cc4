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
