//! Class 3 of the hostile-input tests: memory. Every subcommand at its
//! documented limits under an address-space cap and a small budget.

use super::*;

/// Runs the binary under an address-space cap of `cap_mib` MiB with `env`.
fn capped(cap_mib: u64, env: &[(&str, &str)], args: &[&str], stdin_file: Option<&Path>) -> Output {
    let mut line = format!("ulimit -v {} && exec {}", cap_mib * 1024, bin());
    for a in args {
        line.push_str(&format!(" '{a}'"));
    }
    if let Some(f) = stdin_file {
        line.push_str(&format!(" < '{}'", f.display()));
    }
    let mut c = Command::new("sh");
    c.arg("-c").arg(line);
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().unwrap()
}

/// `eval -` on `case` under the address-space cap and the memory budget.
fn eval_under_budget(case: &Path) -> Output {
    capped(
        CAP_MIB,
        &[("PACKSHARD_MEMORY_BUDGET", BUDGET)],
        &["eval", "-"],
        Some(case),
    )
}

fn ok_or_refused(o: &Output, what: &str) {
    assert_clean(o, what);
    let code = o.status.code();
    assert!(
        code == Some(0) || code == Some(2),
        "{what}: status {code:?}: {}",
        stderr(o)
    );
}

/// The one-line JSON error of a refused `eval` (status 2): its kind and message.
fn refusal(o: &Output, what: &str) -> (String, String) {
    assert_eq!(o.status.code(), Some(2), "{what}: {}", stderr(o));
    assert_clean(o, what);
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    let text = |k: &str| v["error"][k].as_str().unwrap().to_string();
    (text("kind"), text("message"))
}

const BUDGET: &str = "1073741824"; // 1 GiB
const CAP_MIB: u64 = 4096; // the budget plus the binary, threads and allocator arenas

/// Each subcommand at its largest documented input (README, "Limits"), and
/// just over it, under the same address-space cap and a 1 GiB budget: the
/// largest succeeds, the one over is refused with status 2 naming the field;
/// neither aborts on a failed allocation.
#[test]
fn every_subcommand_at_its_documented_limits_under_an_address_space_cap() {
    let env = [("PACKSHARD_MEMORY_BUDGET", BUDGET)];
    let expect = |o: &Output, what: &str, code: i32, needle: &str| {
        assert_clean(o, what);
        assert_eq!(o.status.code(), Some(code), "{what}: {}", stderr(o));
        if code == 2 {
            let text = format!("{}{}", stderr(o), String::from_utf8_lossy(&o.stdout));
            assert!(text.contains(needle), "{what}: no {needle:?} in {text}");
        }
    };
    // pack --lengths: the table streams any file into a histogram; a plan per
    // sequence (--plan-out) lists at most 2^20: at the limit, then one more.
    let lengths = temp_path("hostile", "limit-lengths.txt");
    let plan = temp_path("hostile", "limit-plan.json");
    let line = |n: usize| {
        (0..n)
            .map(|i| ((i * 37) % 511 + 1).to_string())
            .collect::<Vec<_>>()
            .join("\n")
    };
    let args = [
        "pack",
        "--lengths",
        lengths.to_str().unwrap(),
        "--max-seq-len",
        "512",
        "-a",
        "spfhp",
        "--no-bound",
        "--plan-out",
        plan.to_str().unwrap(),
    ];
    std::fs::write(&lengths, line(1 << 20)).unwrap();
    expect(
        &capped(CAP_MIB, &env, &args, None),
        "pack --lengths 2^20 --plan-out",
        0,
        "",
    );
    std::fs::write(&lengths, line((1 << 20) + 1)).unwrap();
    expect(
        &capped(CAP_MIB, &env, &args, None),
        "pack --lengths 2^20 + 1 --plan-out",
        2,
        "lengths",
    );
    expect(
        &capped(CAP_MIB, &env, &args[..8], None),
        "pack --lengths 2^20 + 1 (table only)",
        0,
        "",
    );
    // pack --histogram at max_seq_len 2^24 with 2,000 rows (SPFHP near-linear), then 2^24 + 1.
    let histogram = temp_path("hostile", "limit-histogram.csv");
    let rows: String = (1..=2000u64)
        .map(|i| format!("{},{}\n", i * 8000, 1 + i % 7))
        .collect();
    std::fs::write(&histogram, format!("length,count\n{rows}")).unwrap();
    for (msl, code) in [("16777216", 0), ("16777217", 2)] {
        let args = [
            "pack",
            "--histogram",
            histogram.to_str().unwrap(),
            "--max-seq-len",
            msl,
            "-a",
            "spfhp",
            "--no-bound",
        ];
        expect(
            &capped(CAP_MIB, &env, &args, None),
            &format!("pack --max-seq-len {msl}"),
            code,
            "max_seq_len",
        );
    }
    // eval batch: 2^24 token slots x 320 bytes is over a 1 GiB budget: refused before allocating.
    let case = temp_path("hostile", "limit-batch.json");
    std::fs::write(
        &case,
        r#"{"op": "batch", "sequences": [[1, 2]], "max_seq_len": 16777216}"#,
    )
    .unwrap();
    let o = capped(CAP_MIB, &env, &["eval", "-"], Some(&case));
    let (kind, m) = refusal(&o, "eval batch 2^24 slots");
    assert_eq!(kind, "invalid_argument", "{m}");
    assert!(m.contains("memory budget"), "{m}");
    // vocab: the largest buffers within the budget run; a hidden size whose
    // buffers are over it is refused before the weights are drawn.
    let vocab = |v: &str, hidden: &str| {
        let args = [
            "vocab",
            "--vocab-size",
            v,
            "--hidden",
            hidden,
            "--tokens",
            "4",
            "--shards",
            "2",
        ];
        capped(CAP_MIB, &env, &args, None)
    };
    expect(&vocab("64", "16384"), "vocab 64 x 16384", 0, "");
    // 2^26 weight entries (the entry cap) need about 2 GiB of f64 buffers.
    expect(
        &vocab("4096", "16384"),
        "vocab 4096 x 16384",
        2,
        "memory budget",
    );
    let over = "--hidden: a weight of 64 x 16777216 entries";
    expect(&vocab("64", "16777216"), "vocab 64 x 2^24", 2, over);
    // golden and check: the whole canonical set.
    let golden = temp_path("hostile", "limit-golden");
    let _ = std::fs::remove_dir_all(&golden);
    let o = capped(
        CAP_MIB,
        &env,
        &[
            "golden",
            "--out",
            golden.to_str().unwrap(),
            "--dtype",
            "f64",
        ],
        None,
    );
    expect(&o, "golden", 0, "");
}

#[test]
fn eval_largest_case_under_an_address_space_cap() {
    // The largest case the budget admits (1 GiB / 128 = 8 MiB) of numbers,
    // and one byte more.
    let cap = 8 << 20;
    let row = "[0.5, -1.25, 3.0, 2.5]";
    let mut text = String::from(r#"{"op": "cross_entropy", "targets": [0], "logits": ["#);
    let mut n = 0;
    while text.len() + row.len() + 40 < cap {
        if n > 0 {
            text.push(',');
        }
        text.push_str(row);
        n += 1;
    }
    text.push_str("]}");
    let text = text.replace(
        r#""targets": [0]"#,
        &format!(r#""targets": {}"#, json!(vec![1; n])),
    );
    // The targets make it longer: trim rows until it fits.
    let case_path = temp_path("hostile", "largest.json");
    let fitted = if text.len() <= cap {
        text
    } else {
        let keep = n - (text.len() - cap) / row.len() - 4;
        let rows = vec![row; keep].join(",");
        format!(
            r#"{{"op": "cross_entropy", "targets": {}, "logits": [{rows}]}}"#,
            json!(vec![1; keep])
        )
    };
    assert!(fitted.len() <= cap);
    std::fs::write(&case_path, &fitted).unwrap();
    let o = eval_under_budget(&case_path);
    ok_or_refused(&o, "largest eval case");
    // One byte over: refused before it is read whole.
    std::fs::write(
        &case_path,
        format!("{fitted}{}", " ".repeat(cap + 1 - fitted.len())),
    )
    .unwrap();
    let (_, m) = refusal(&eval_under_budget(&case_path), "one byte over");
    assert!(m.contains("memory budget"), "{m}");
    // A case whose output is far larger than its text: [n, v] logits.
    let case = json!({"op": "linear_cross_entropy", "hidden": vec![vec![1.0]; 20000],
        "weight": vec![vec![1.0]; 3000], "targets": vec![0; 20000]});
    std::fs::write(&case_path, case.to_string()).unwrap();
    let (_, m) = refusal(&eval_under_budget(&case_path), "[n, v] logits");
    assert!(m.contains("weight: ") && m.contains("memory budget"), "{m}");
    // An embedding whose lookup is far larger than its text.
    let case = json!({"op": "embedding", "ids": vec![0; 200000], "weight": [vec![0.5; 2000]]});
    std::fs::write(&case_path, case.to_string()).unwrap();
    let (_, m) = refusal(&eval_under_budget(&case_path), "embedding lookup");
    assert!(m.starts_with("ids: "), "{m}");
}

#[test]
fn vocab_sizes_are_checked_before_allocating() {
    for line in [
        "vocab --vocab-size 4 --hidden 16777216",
        "vocab --vocab-size 4 --hidden 4000000 --tokens 4096",
        "vocab --vocab-size 0",
        "vocab --hidden 0",
        "vocab --vocab-size 7 --hidden 3 --shards 0",
        "vocab --vocab-size 70000 --hidden 3 --shards 70000",
        "vocab --vocab-size 18446744073709551615 --hidden 18446744073709551615",
    ] {
        let args: Vec<&str> = line.split_whitespace().collect();
        let o = capped(CAP_MIB, &[("PACKSHARD_MEMORY_BUDGET", BUDGET)], &args, None);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        assert_clean(&o, &format!("{args:?}"));
        let e = stderr(&o);
        assert!(
            e.contains("--vocab-size") || e.contains("--hidden") || e.contains("--shards"),
            "{args:?}: {e}"
        );
    }
    // The largest default-shaped run still succeeds under the cap.
    let o = capped(
        CAP_MIB,
        &[("PACKSHARD_MEMORY_BUDGET", BUDGET)],
        &[
            "vocab",
            "--vocab-size",
            "3001",
            "--hidden",
            "64",
            "--tokens",
            "64",
            "--shards",
            "1,8",
        ],
        None,
    );
    ok_or_refused(&o, "vocab 3001 x 64");
    assert_eq!(o.status.code(), Some(0));
    // An unparseable budget is named.
    let o = capped(
        CAP_MIB,
        &[("PACKSHARD_MEMORY_BUDGET", "lots")],
        &["vocab", "--tokens", "2"],
        None,
    );
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("PACKSHARD_MEMORY_BUDGET"),
        "{}",
        stderr(&o)
    );
}

/// A safetensors file of f32 tensors (name, shape), zero-filled.
fn safetensors(path: &Path, tensors: &[(&str, Vec<usize>)]) {
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    for (name, shape) in tensors {
        let bytes = 4 * shape.iter().product::<usize>();
        header.insert(
            name.to_string(),
            json!({"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + bytes]}),
        );
        offset += bytes;
    }
    let h = Value::Object(header).to_string();
    let mut f = File::create(path).unwrap();
    f.write_all(&(h.len() as u64).to_le_bytes()).unwrap();
    f.write_all(h.as_bytes()).unwrap();
    f.write_all(&vec![0u8; offset]).unwrap();
}

#[test]
fn verify_bert_checks_the_config_against_the_weights_first() {
    let dir = temp_path("hostile", "bert-model");
    std::fs::create_dir_all(&dir).unwrap();
    safetensors(
        &dir.join("model.safetensors"),
        &[
            ("embeddings.word_embeddings.weight", vec![10, 4]),
            ("embeddings.position_embeddings.weight", vec![16, 4]),
            ("embeddings.token_type_embeddings.weight", vec![2, 4]),
            ("encoder.layer.0.intermediate.dense.weight", vec![8, 4]),
        ],
    );
    let text = temp_path("hostile", "text.txt");
    std::fs::write(&text, "to be or not to be\n").unwrap();
    let config = |vocab: usize, hidden: usize, layers: usize| {
        json!({"vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": layers,
            "num_attention_heads": 1, "intermediate_size": 8, "max_position_embeddings": 16,
            "type_vocab_size": 2})
        .to_string()
    };
    for (cfg, field, kind) in [
        (config(4_000_000, 4, 1), "vocab_size", "shape_mismatch"),
        (config(4_000_000, 128, 1), "hidden_size", "shape_mismatch"),
        (config(10, 4, 40), "num_hidden_layers", "invalid_argument"),
    ] {
        std::fs::write(dir.join("config.json"), &cfg).unwrap();
        let args = [
            "verify",
            "bert",
            "--model",
            dir.to_str().unwrap(),
            "--text",
            text.to_str().unwrap(),
        ];
        let o = capped(CAP_MIB, &[("PACKSHARD_MEMORY_BUDGET", BUDGET)], &args, None);
        assert_eq!(o.status.code(), Some(2), "{cfg}: {}", stderr(&o));
        assert_clean(&o, &cfg);
        assert!(stderr(&o).contains(field), "{cfg}: {}", stderr(&o));
        // The same model through eval's bert op.
        let case = json!({"op": "bert", "model": dir, "sequences": [[1, 2]]});
        let m = eval_err(&case, kind, &[field, "config.json"]);
        assert!(
            !m.contains("memory budget"),
            "refused on its shapes, not its size: {m}"
        );
    }
}
