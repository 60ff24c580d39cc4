//! The vocabulary ops through `packshard eval` (docs/FAULTS.md V1–V6 with their
//! stated values, the collective counts, the error contract) and the
//! `packshard vocab` report, end to end; insta snapshots for the discrete
//! outputs (error messages, the report's counts with thresholded errors).

use packshard::reference::vocab::{ShardLayout, ShardedAlgorithm};
use packshard::vocab_report::{self, Errors, VocabReportConfig};
use serde_json::{json, Value};

mod common;
use common::packshard;

/// Evaluates `cases` in one `packshard eval --jsonl` run; one result per case.
fn eval_all(cases: &[Value]) -> Vec<Value> {
    let text: String = cases.iter().map(|c| format!("{c}\n")).collect();
    let o = packshard(&["eval", "--jsonl", "-"], Some(&text));
    let out = String::from_utf8(o.stdout).unwrap();
    let results: Vec<Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(results.len(), cases.len(), "{out}");
    results
}

fn eval(case: &Value) -> Value {
    eval_all(std::slice::from_ref(case)).pop().unwrap()
}

fn f(v: &Value) -> f64 {
    match v {
        Value::String(s) if s == "inf" => f64::INFINITY,
        Value::String(s) if s == "-inf" => f64::NEG_INFINITY,
        _ => v.as_f64().unwrap_or_else(|| panic!("not a number: {v}")),
    }
}

fn floats(v: &Value) -> Vec<f64> {
    match v {
        Value::Array(items) => items.iter().flat_map(floats).collect(),
        other => vec![f(other)],
    }
}

/// Every sharded variant of a case: algorithm x layout x num_shards.
fn variants(base: &Value, shards: &[usize]) -> Vec<Value> {
    let mut out = vec![base.clone()];
    for &p in shards {
        for a in ShardedAlgorithm::ALL {
            for layout in ["uneven", "padded"] {
                let mut c = base.clone();
                c["num_shards"] = json!(p);
                c["algorithm"] = json!(a.name());
                c["layout"] = json!(layout);
                out.push(c);
            }
        }
    }
    out
}

const V1: [f64; 8] = [1.0, 2.0, 0.0, -1.0, 3.0, 0.5, 1.5, -2.0];

#[test]
fn v1_label_smoothing_through_eval() {
    for (convention, want) in [("pytorch", "0.87051"), ("megatron", "0.90444")] {
        let base = json!({"op": "cross_entropy", "logits": [V1], "targets": [4],
                          "label_smoothing": 0.1, "smoothing": convention, "want_grad": true});
        let cases = variants(&base, &[1, 2, 3, 4, 5, 6, 7, 8]);
        for (case, r) in cases.iter().zip(eval_all(&cases)) {
            assert_eq!(format!("{:.5}", f(&r["loss"])), want, "{case} -> {r}");
        }
    }
}

#[test]
fn v2_padded_entries_never_enter_the_softmax_through_eval() {
    let real = [2.0, 1.0, 0.5, 3.0, -1.0, 0.0, 1.5, 2.5, -0.5, 1.0];
    let mut cases = vec![json!({"op": "cross_entropy", "logits": [real], "targets": [7]})];
    for padding in [
        json!([0.0, 0.0]),
        json!([50.0, -3.0]),
        json!([1e4, "nan"]),
        json!(["inf", "-inf"]),
    ] {
        let mut row: Vec<Value> = real.iter().map(|x| json!(x)).collect();
        row.extend(padding.as_array().unwrap().iter().cloned());
        for a in ShardedAlgorithm::ALL {
            cases.push(json!({"op": "cross_entropy", "logits": [row], "targets": [7], "vocab_size": 10,
                              "num_shards": 3, "layout": "padded", "algorithm": a.name(), "want_grad": true}));
        }
    }
    for (case, r) in cases.iter().zip(eval_all(&cases)) {
        assert_eq!(format!("{:.6}", f(&r["loss"])), "1.474030", "{case} -> {r}");
        if let Some(g) = r.get("grad_logits") {
            let g = floats(g);
            assert_eq!(g.len(), 12);
            assert_eq!(&g[10..], &[0.0, 0.0], "padding gets no gradient: {r}");
            assert_eq!(r["shards"][2], json!({"start": 8, "real": 2, "padding": 2}));
        }
    }
}

#[test]
fn v3_input_gradient_summed_over_shards_and_barrier_counts() {
    let base = json!({"op": "linear_cross_entropy", "hidden": [[1, -1]],
                      "weight": [[1, 0], [0, 1], [0.5, 0.5], [-1, 2]], "targets": [2], "want_grad": true});
    let cases = variants(&base, &[1, 2, 3, 4]);
    for (case, r) in cases.iter().zip(eval_all(&cases)) {
        let g = floats(&r["grad_hidden"]);
        assert_eq!(
            format!("{:.4} {:.4}", g[0], g[1]),
            "0.2661 -0.2661",
            "{case} -> {r}"
        );
        if let Some(a) = case["algorithm"].as_str() {
            let want = a.parse::<ShardedAlgorithm>().unwrap().barriers(true, true);
            assert_eq!(r["collectives"]["barriers"], json!(want), "{case} -> {r}");
            assert_eq!(
                want,
                match a {
                    "naive" => 3,
                    "alg1" => 2,
                    _ => 1,
                }
            );
        }
    }
    // Forward only: 2, 1, 1.
    let mut fwd = base.clone();
    fwd["want_grad"] = json!(false);
    for (a, want) in [("naive", 2), ("alg1", 1), ("alg2", 1)] {
        fwd["algorithm"] = json!(a);
        fwd["num_shards"] = json!(2);
        assert_eq!(eval(&fwd)["collectives"]["barriers"], json!(want), "{a}");
    }
}

#[test]
fn v4_a_vocabulary_not_divisible_by_eight_through_eval() {
    let v = 250_682usize;
    let row = |i: usize| -> Vec<f64> {
        (0..v)
            .map(|j| ((i * 7 + j * 13) % 101) as f64 / 17.0 - 3.0)
            .collect()
    };
    let base = json!({"op": "cross_entropy", "logits": [row(0), row(1)], "targets": [0, v - 1],
                      "label_smoothing": 0.1, "want_grad": true});
    let mut cases = vec![base.clone()];
    for a in ShardedAlgorithm::ALL {
        for layout in ["uneven", "padded"] {
            let mut c = base.clone();
            c["num_shards"] = json!(8);
            c["algorithm"] = json!(a.name());
            c["layout"] = json!(layout);
            cases.push(c);
        }
    }
    let results = eval_all(&cases);
    let want = f(&results[0]["loss"]);
    let want_grad = floats(&results[0]["grad_logits"]);
    for (case, r) in cases.iter().zip(&results).skip(1) {
        assert!(r.get("error").is_none(), "{r}");
        let got = f(&r["loss"]);
        assert!(
            (got - want).abs() <= 64.0 * f64::EPSILON * want,
            "{}: {got} vs {want}",
            case["algorithm"]
        );
        let g = floats(&r["grad_logits"]);
        let worst = g
            .iter()
            .zip(&want_grad)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        assert!(
            worst <= 64.0 * f64::EPSILON,
            "{}: grad differs by {worst:e}",
            case["algorithm"]
        );
    }
    assert_eq!(
        results[2]["shards"][7],
        json!({"start": 7 * 31_336, "real": 31_330, "padding": 6})
    );
}

#[test]
fn v5_out_of_range_ids_are_the_same_error_in_both_layers() {
    let weight = json!([[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]);
    let mut lines = Vec::new();
    for bad in [5, -1] {
        for shards in [None, Some(1), Some(2), Some(4)] {
            for layout in ["uneven", "padded"] {
                let mut c = json!({"op": "embedding", "ids": [0, bad, 4], "weight": weight});
                if let Some(p) = shards {
                    c["num_shards"] = json!(p);
                    c["layout"] = json!(layout);
                } else if layout == "padded" {
                    continue;
                }
                let r = eval(&c);
                assert_eq!(r["error"]["kind"], "index_out_of_range", "{c} -> {r}");
                lines.push(r["error"]["message"].as_str().unwrap().to_string());
            }
        }
    }
    lines.dedup();
    assert_eq!(
        lines.len(),
        2,
        "one message per bad id, whatever the layer: {lines:?}"
    );
    insta::assert_snapshot!(lines.join("\n"));
    // In range, sharded and unsharded agree, forward and backward.
    let ok = json!({"op": "embedding", "ids": [4, 0, 4], "weight": weight, "want_grad": true,
                    "grad_output": [[1, 1], [2, 2], [3, 3]]});
    let mut sharded = ok.clone();
    sharded["num_shards"] = json!(3);
    sharded["layout"] = json!("padded");
    let (u, s) = (eval(&ok), eval(&sharded));
    assert_eq!(u["output"], json!([[8.0, 9.0], [0.0, 1.0], [8.0, 9.0]]));
    assert_eq!(u["output"], s["output"]);
    assert_eq!(u["grad_weight"], s["grad_weight"]);
    assert_eq!(s["grad_weight"][4], json!([4.0, 4.0]));
    assert_eq!(
        s["collectives"],
        json!({"calls": 1, "barriers": 1, "elements": 6})
    );
}

#[test]
fn v6_an_all_minus_inf_shard_through_eval() {
    let base = json!({"op": "cross_entropy", "logits": [[1, 2, 0, -1, "-inf", "-inf", "-inf", "-inf"]],
                      "targets": [1], "want_grad": true});
    let cases = variants(&base, &[2]);
    let results = eval_all(&cases);
    let want = f(&results[0]["loss"]);
    assert!(want.is_finite());
    for (case, r) in cases.iter().zip(&results) {
        let got = f(&r["loss"]);
        assert!(
            (got - want).abs() <= 4.0 * f64::EPSILON * want,
            "{case} -> {r}"
        );
        assert!(
            floats(&r["grad_logits"]).iter().all(|g| g.is_finite()),
            "{r}"
        );
    }
    // A shard that is all padding: v = 9 over 4 padded shards of 3.
    let c = json!({"op": "cross_entropy", "logits": [[0.5, -1, 2, 1, 0, 3, -2, 1.5, 0.25]], "targets": [5],
                   "num_shards": 4, "layout": "padded", "algorithm": "alg1"});
    let r = eval(&c);
    assert_eq!(r["shards"][3], json!({"start": 9, "real": 0, "padding": 3}));
    assert!(f(&r["loss"]).is_finite(), "{r}");
}

#[test]
fn non_finite_results_are_strings_and_ignored_rows_are_zero() {
    // Target on a -inf logit: the loss is +inf (probability 0), printed as "inf".
    let r = eval(
        &json!({"op": "cross_entropy", "logits": [[0, "-inf"], ["-inf", "-inf"]], "targets": [1, -100],
                         "reduction": "none", "num_shards": 2, "algorithm": "naive", "want_grad": true}),
    );
    assert_eq!(r["per_token_loss"], json!(["inf", 0.0]), "{r}");
    assert_eq!(r["logsumexp"], json!([0.0, "-inf"]));
    assert_eq!(r["num_tokens"], json!(1));
    assert_eq!(r["grad_logits"], json!([[1.0, -1.0], [0.0, 0.0]]));
}

#[test]
fn eval_errors_follow_the_contract() {
    let cases = [
        json!({"op": "cross_entropy", "logits": [[1, 2, 3]], "targets": [0], "num_shards": 4}),
        json!({"op": "cross_entropy", "logits": [[1, 2, 3]], "targets": [3]}),
        json!({"op": "cross_entropy", "logits": [[1, 2, 3]], "targets": [-7], "num_shards": 2}),
        json!({"op": "cross_entropy", "logits": [[1, "nan", 3]], "targets": [0], "num_shards": 2}),
        json!({"op": "cross_entropy", "logits": [[1, 2, "inf"]], "targets": [0]}),
        json!({"op": "cross_entropy", "logits": [["-inf", "-inf"]], "targets": [0], "num_shards": 2, "algorithm": "alg2"}),
        json!({"op": "cross_entropy", "logits": [[1, 2]], "targets": [0, 1]}),
        json!({"op": "cross_entropy", "logits": [[1, 2]], "targets": [0], "algorithm": "alg3", "num_shards": 2}),
        json!({"op": "cross_entropy", "logits": [[1, 2]], "targets": [0], "algorithm": "unsharded", "num_shards": 2}),
        json!({"op": "cross_entropy", "logits": [[1, 2]], "targets": [0], "label_smoothing": 1.5}),
        json!({"op": "cross_entropy", "logits": [[1]], "targets": [0], "label_smoothing": 0.1, "smoothing": "megatron"}),
        json!({"op": "cross_entropy", "logits": [[1, 2]], "targets": [0], "vocab_size": 3}),
        json!({"op": "cross_entropy", "logits": [[1, 2]], "targets": [0], "num_shards": 2, "layout": "striped"}),
        json!({"op": "cross_entropy", "logits": [[1, 2]], "targets": [0], "reduce": "sum"}),
        json!({"op": "linear_cross_entropy", "hidden": [[1, 2]], "weight": [[1, 2, 3]], "targets": [0]}),
        json!({"op": "linear_cross_entropy", "hidden": [[1e200, 2]], "weight": [[1e200, 0]], "targets": [0]}),
        json!({"op": "linear_cross_entropy", "hidden": [[1, 2]], "weight": [[1, 0], [0, "nan"]], "targets": [0], "num_shards": 2}),
        json!({"op": "embedding", "ids": [0, 1], "weight": [[1, 2]], "num_shards": 2}),
        json!({"op": "embedding", "ids": [0], "weight": [[1, 2]], "want_grad": true}),
        json!({"op": "embedding", "ids": [0], "weight": [[1, 2]], "want_grad": true, "grad_output": [[1, 2], [3, 4]]}),
    ];
    let mut lines = Vec::new();
    for (case, r) in cases.iter().zip(eval_all(&cases)) {
        let e = &r["error"];
        assert!(e.is_object(), "{case} must fail: {r}");
        lines.push(format!(
            "{}: {}",
            e["kind"].as_str().unwrap(),
            e["message"].as_str().unwrap()
        ));
    }
    // Exit status 2 with the error on stdout, as for every op.
    let o = packshard(&["eval", "-"], Some(&cases[0].to_string()));
    assert_eq!(o.status.code(), Some(2));
    insta::assert_snapshot!(lines.join("\n"));
}

#[test]
fn the_ops_are_listed() {
    common::assert_listed(&["cross_entropy", "linear_cross_entropy", "embedding"]);
}

#[test]
fn vocab_report_counts_and_errors() {
    // v = 97 (prime) over 1, 2, 3, 8 shards, both layouts: counts per rank and
    // differences thresholded at 64 ulp (the raw values vary with the CPU's
    // matrix kernels, the counts never).
    let mut tables = String::new();
    for layout in [ShardLayout::Uneven, ShardLayout::Padded] {
        let config = VocabReportConfig {
            vocab_size: 97,
            hidden: 7,
            tokens: 13,
            shards: vec![1, 2, 3, 8],
            layout,
            ..VocabReportConfig::default()
        };
        let report = vocab_report::measure(&config).unwrap();
        for row in &report.rows[1..] {
            assert!(
                // 64 ulp: the table's own threshold on f64 differences (the comment above).
                row.loss.ulps() <= 64.0
                    && row.grad_hidden.ulps() <= 64.0
                    && row.grad_weight.ulps() <= 64.0,
                "{row:?}"
            );
        }
        tables.push_str(&vocab_report::table(&report, Errors::Thresholded));
        tables.push('\n');
    }
    insta::assert_snapshot!(tables);
}

#[test]
fn vocab_command_runs_and_prints_json() {
    // v 1000, h 16, 5 tokens; the shard counts last.
    let small = [
        "vocab",
        "--vocab-size",
        "1000",
        "--hidden",
        "16",
        "--tokens",
        "5",
    ];
    let o = packshard(&[&small[..], &["--shards", "3,8", "--json"]].concat(), None);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let r: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(r["vocab_size"], json!(1000));
    let rows = r["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 1 + 2 * 3);
    let barriers: Vec<u64> = rows[1..4]
        .iter()
        .map(|row| row["barriers"].as_u64().unwrap())
        .collect();
    assert_eq!(barriers, [3, 2, 1]);
    let o = packshard(&[&small[..], &["--shards", "3"]].concat(), None);
    let table = String::from_utf8(o.stdout).unwrap();
    assert!(
        table.starts_with("vocab: v 1000, h 16, 5 tokens"),
        "{table}"
    );
    // Bad input: one line, exit status 2.
    let o = packshard(&["vocab", "--vocab-size", "4", "--shards", "8"], None);
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8(o.stderr).unwrap();
    assert_eq!(
        err.trim(),
        "packshard: num_shards: 8 shards for a vocabulary of 4: p must be <= v"
    );
}

#[test]
fn o1_softcap_through_eval() {
    let base = json!({"op": "cross_entropy", "logits": [V1], "targets": [4],
                      "softcap": 2.0, "want_grad": true});
    let cases = variants(&base, &[1, 2, 3, 8]);
    for (case, r) in cases.iter().zip(eval_all(&cases)) {
        assert_eq!(format!("{:.5}", f(&r["loss"])), "1.18683", "{case} -> {r}");
    }
    let cases: Vec<Value> = [json!(0.0), json!(-1.0), json!("inf")]
        .into_iter()
        .map(|c| json!({"op": "cross_entropy", "logits": [V1], "targets": [4], "softcap": c}))
        .collect();
    for (case, r) in cases.iter().zip(eval_all(&cases)) {
        let e = r["error"].to_string();
        assert!(e.contains("softcap"), "{case} -> {r}");
    }
    // The output layer (h = 1: the weight column is the logits), every impl
    // that runs it; the CUDA ones, where built, refuse it by name.
    let weight: Vec<[f64; 1]> = V1.iter().map(|&x| [x]).collect();
    for imp in ["reference", "linear_ce_materialized", "linear_ce_fused"] {
        let r = eval(
            &json!({"op": "linear_cross_entropy", "hidden": [[1.0]], "weight": weight,
                             "targets": [4], "softcap": 2.0, "impl": imp}),
        );
        assert_eq!(format!("{:.5}", f(&r["loss"])), "1.18683", "{imp} -> {r}");
    }
}

#[test]
fn o2_per_token_grad_output_through_eval() {
    // docs/FAULTS.md O2: two tokens with the V1 logits, targets 4 and 1,
    // reduction none, grad_output [1, 0]: the second token's gradient is 0.
    let base = json!({"op": "cross_entropy", "logits": [V1, V1], "targets": [4, 1],
                      "reduction": "none", "grad_output": [1.0, 0.0], "want_grad": true});
    let plain = eval(
        &json!({"op": "cross_entropy", "logits": [V1], "targets": [4],
                             "want_grad": true}),
    );
    let cases = variants(&base, &[1, 2, 3, 8]);
    for (case, r) in cases.iter().zip(eval_all(&cases)) {
        let g = &r["grad_logits"];
        let (g0, want) = (floats(&g[0]), floats(&plain["grad_logits"][0]));
        // The same f64 reference per shard count: 1e-12 absolute on gradients below 1, a margin
        // chosen over a few ulps.
        let close = g0.iter().zip(&want).all(|(a, b)| (a - b).abs() < 1e-12);
        assert!(close, "{case} -> {r}");
        assert!(floats(&g[1]).iter().all(|x| *x == 0.0), "{case} -> {r}");
        assert_eq!(format!("{:.5}", f(&r["per_token_loss"][1])), "1.63301");
    }
    let mut f32_case = base.clone();
    f32_case["impl"] = json!("cross_entropy_f32");
    let r = eval(&f32_case);
    let zero = floats(&r["grad_logits"][1]).iter().all(|x| *x == 0.0);
    assert!(zero, "cross_entropy_f32 -> {r}");
    // The output layer, every CPU impl: the second token's dL/dhidden is 0.
    let weight: Vec<[f64; 1]> = V1.iter().map(|&x| [x]).collect();
    for imp in [
        "reference",
        "linear_ce_materialized",
        "linear_ce_fused",
        "linear_ce_tiled",
        "linear_ce_tiled_filtered",
    ] {
        let r = eval(
            &json!({"op": "linear_cross_entropy", "hidden": [[1.0], [1.0]],
                             "weight": weight, "targets": [4, 1], "reduction": "none",
                             "grad_output": [1.0, 0.0], "want_grad": true, "impl": imp}),
        );
        assert_eq!(f(&r["grad_hidden"][1][0]), 0.0, "{imp} -> {r}");
        assert!(f(&r["grad_hidden"][0][0]) != 0.0, "{imp} -> {r}");
    }
    // The contract: a scalar under mean, the length, finiteness, want_grad.
    let cases = [
        (
            json!({"reduction": "mean", "grad_output": [1.0, 0.0]}),
            "shape_mismatch",
        ),
        (
            json!({"reduction": "none", "grad_output": [1.0]}),
            "shape_mismatch",
        ),
        (
            json!({"reduction": "none", "grad_output": [1.0, "nan"]}),
            "non_finite_input",
        ),
        (
            json!({"reduction": "none", "grad_output": [1.0, 0.0], "want_grad": false}),
            "invalid_argument",
        ),
    ];
    for (extra, kind) in cases {
        let mut c = json!({"op": "cross_entropy", "logits": [V1, V1], "targets": [4, 1],
                           "want_grad": true});
        for (k, v) in extra.as_object().unwrap() {
            c[k] = v.clone();
        }
        let r = eval(&c);
        assert_eq!(r["error"]["kind"], kind, "{c} -> {r}");
        assert!(
            r["error"]["message"]
                .as_str()
                .unwrap()
                .contains("grad_output"),
            "{c} -> {r}"
        );
    }
    let r = eval(
        &json!({"op": "cross_entropy", "logits": [V1, V1], "targets": [4, 1],
                         "grad_output": [-2.0], "want_grad": true, "reduction": "sum"}),
    );
    let g1 = floats(&r["grad_logits"][1]);
    // O2_GRAD_FAULT (docs/FAULTS.md O2) against eval's f64 gradient: 1e-5 absolute on a value of
    // order 1, a margin chosen, not derived.
    assert!((g1[1] - (-2.0 * faults_o2_fault())).abs() < 1e-5, "{r}");
}

/// The second token's own gradient at its target (docs/FAULTS.md O2's
/// fault value): what a scalar upstream gradient of 1 gives it.
fn faults_o2_fault() -> f64 {
    packshard::reference::faults::O2_GRAD_FAULT
}
