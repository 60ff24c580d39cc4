//! `packshard bench --quick`: runs in seconds, checks each pair agrees before
//! timing it, and reports every figure the README table needs.

use std::process::Command;

use serde_json::Value;

#[test]
fn quick_bench_runs_and_reports_every_figure() {
    let out = Command::new(env!("CARGO_BIN_EXE_packshard"))
        .args(["bench", "--quick", "--json", "--reps", "1"])
        .output()
        .expect("runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let l = &v["layer"];
    for f in [
        "packed_s",
        "padded_s",
        "achieved_gflops",
        "gemm_gflops",
        "reference_s",
    ] {
        assert!(l[f].as_f64().unwrap() > 0.0, "{f}: {l}");
    }
    // The batch is packed: fewer slots than padded rows.
    assert!(l["slot_ratio"].as_f64().unwrap() > 1.0, "{l}");
    assert!(l["packed_vs_padded_rel"].as_f64().unwrap() < 1e-4, "{l}");
    let a = &v["attention"];
    assert!(a["varlen_pairs"].as_u64().unwrap() < a["dense_pairs"].as_u64().unwrap());
    assert!(a["varlen_s"].as_f64().unwrap() > 0.0);
    if cfg!(feature = "candle") {
        assert!(a["candle_s"].as_f64().unwrap() > 0.0, "{a}");
        assert!(a["candle_max_abs"].as_f64().unwrap() < 1e-3, "{a}");
    }
    // The sliding window (window_size (max_len / 4, 0), causal): fewer
    // allowed pairs, never more scored ones (at the quick rows of 128 the
    // 64-key tiles of a block's window are all its causal tiles), both timed.
    let w = &v["window"];
    let pair = |f: &str, i: usize| w[f][i].as_u64().unwrap();
    assert!(pair("allowed_pairs", 0) < pair("allowed_pairs", 1), "{w}");
    assert!(pair("scored_pairs", 0) <= pair("scored_pairs", 1), "{w}");
    for f in ["forward_s", "backward_s"] {
        assert!(
            w[f][0].as_f64().unwrap() > 0.0 && w[f][1].as_f64().unwrap() > 0.0,
            "{w}"
        );
    }
    let ce = &v["cross_entropy"][0];
    // The binary counts its allocations: both peaks are measured, and the
    // fused path holds less than the materialized one.
    let (m, f) = (
        ce["materialized_peak_bytes"].as_u64().unwrap(),
        ce["fused_peak_bytes"].as_u64().unwrap(),
    );
    assert!(f < m, "{ce}");
    assert!(m >= ce["logits_bytes"].as_u64().unwrap(), "{ce}");
    // Every registered implementation is listed and, where it can run here,
    // timed and checked against the reference: none is left out.
    assert_eq!(
        v["implementations"].as_array().unwrap().len(),
        packshard::registry::all().len()
    );
    let rows = v["registry"].as_array().unwrap();
    assert_eq!(rows.len(), packshard::registry::all().len(), "{rows:?}");
    for r in rows {
        if r["skipped"].is_null() {
            assert!(r["seconds"].as_f64().unwrap() > 0.0, "{r}");
            // f32 and bf16 kernels differ from the reference, but by rounding only.
            let d = r["max_rel_diff"].as_f64().unwrap();
            if r["precision"] == "f64" {
                assert!(d <= 1e-12, "{r}");
            } else {
                assert!(d > 0.0 && d < 5e-2, "{r}");
            }
        }
    }
}

#[test]
fn bad_bench_options_are_refused() {
    for args in [
        vec!["bench", "--quick", "--ce-sizes", "30522by384"],
        vec!["bench", "--quick", "--only", "gpu"],
        vec!["bench", "--quick", "--reps", "0"],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_packshard"))
            .args(&args)
            .output()
            .expect("runs");
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(!String::from_utf8_lossy(&out.stderr).contains("panicked"));
    }
}
