//! One work bound for every implementation of an op, and estimates before
//! any work: a long segment refused alike by every attention impl, the
//! output layer's `n x v x h`, the causal ops' results, `verify causal-lm`'s
//! parameters, and a mean of finite losses whose sum is beyond f64.

use std::time::Instant;

use serde_json::json;

use super::*;

/// The attention impls `eval` lists (`packshard eval --list`).
const ATTENTION_IMPLS: [&str; 5] = [
    "reference",
    "attention_varlen_tiled",
    "attention_varlen_tiled_bf16",
    "attention_varlen_scalar",
    "attention_dense_masked",
];

/// One segment of `n` tokens, one head of dim 1.
fn segment(n: usize, imp: &str, want_grad: bool) -> Value {
    let t = vec![json!([[0.5]]); n];
    let mut c = json!({"op": "attention", "impl": imp, "q": t, "k": t, "v": t,
                       "cu_seqlens": [0, n]});
    if want_grad {
        c["want_grad"] = json!(true);
        c["grad_output"] = json!(t);
    }
    c
}

/// Relative error of a mean summed scaled (each term divided by `n` before
/// the sum): a few ulp of f64 (2.2e-16) for one subtraction and one division
/// per term.
const SCALED_MEAN_TOL: f64 = 1e-15;

#[test]
fn every_attention_impl_refuses_a_segment_past_the_shared_work_bound() {
    // 24,000^2 pairs x (d + 1) = 1.15e9 units, over MAX_ATTENTION_WORK =
    // 2^29 = 5.4e8; the optimized impls used to run it (100,000 tokens: 47 s).
    for imp in ATTENTION_IMPLS {
        for want_grad in [false, true] {
            let t = Instant::now();
            let m = refused(&segment(24_000, imp, want_grad), "cu_seqlens");
            assert!(m.contains("one attention call may do"), "{imp}: {m}");
            // Refused before any work: seconds, not minutes (the case's
            // parsing only; 20 s is twice the 10 s ceiling).
            assert!(t.elapsed().as_secs() < 20, "{imp}: {:?}", t.elapsed());
        }
        // A negative control: a short segment is answered by the same impl.
        answered(&segment(64, imp, true));
    }
}

/// `n` tokens, `v` vocabulary rows, `h` hidden: values 0.5.
fn linear(n: usize, v: usize, h: usize, imp: &str) -> Value {
    json!({"op": "linear_cross_entropy", "impl": imp,
           "hidden": vec![vec![0.5; h]; n], "weight": vec![vec![0.5; h]; v],
           "targets": vec![0; n]})
}

#[test]
fn the_output_layer_refuses_work_past_its_bound_in_every_impl() {
    // 2048 x 2048 x 513 = 2.15e9 multiply-adds, over MAX_LINEAR_WORK = 2^31
    // (2.147e9), within the logits limit (n v = 2^22 <= 2^26) and the budget.
    for imp in ["reference", "linear_ce_fused", "linear_ce_tiled"] {
        let m = refused(&linear(2048, 2048, 513, imp), "weight");
        assert!(m.contains("multiply-adds"), "{imp}: {m}");
        // A negative control: the same n and v with h = 1 is answered.
        let out = answered(&linear(2048, 2048, 1, imp));
        assert!(out["loss"].as_f64().is_some(), "{imp}: {out}");
    }
}

/// `eval` under a budget of `budget`.
fn eval_under(budget: &str, case: &Value) -> (i32, Value) {
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_packshard"))
        .args(["eval", "-"])
        .env("PACKSHARD_MEMORY_BUDGET", budget)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            use std::io::Write;
            c.stdin
                .take()
                .unwrap()
                .write_all(case.to_string().as_bytes())?;
            c.wait_with_output()
        })
        .unwrap();
    assert_clean(&o, &case.to_string());
    let out = String::from_utf8(o.stdout).unwrap();
    (
        o.status.code().unwrap(),
        serde_json::from_str(out.trim()).unwrap(),
    )
}

#[test]
fn the_causal_ops_estimate_their_results_before_making_them() {
    // 500 tokens x 6 values x 96 bytes = 288 KB, over a 256 KiB budget, in a
    // case of ~1.5 KB (under its 2 KiB case limit): every source form refused
    // by the name it came in (position_ids had no estimate at all).
    let ones = vec![1; 500];
    let zeros = vec![0; 500];
    for (field, case) in [
        (
            "position_ids",
            json!({"op": "causal_conversions", "position_ids": zeros}),
        ),
        (
            "doc_ids",
            json!({"op": "causal_conversions", "doc_ids": ones}),
        ),
        (
            "seq_idx",
            json!({"op": "causal_conversions", "seq_idx": zeros}),
        ),
        (
            "input_ids",
            json!({"op": "causal_labels", "input_ids": ones,
                             "cu_seqlens": [0, 500]}),
        ),
    ] {
        let (code, v) = eval_under("256KiB", &case);
        assert_eq!(code, 2, "{field}: {v}");
        let m = v["error"]["message"].as_str().unwrap();
        assert!(m.starts_with(field) && m.contains("memory budget"), "{m}");
        // A negative control: 50 tokens are answered under the same budget.
        let mut small = case.clone();
        small[field] = json!(case[field].as_array().unwrap()[..50]);
        if field == "input_ids" {
            small["cu_seqlens"] = json!([0, 50]);
        }
        let (code, v) = eval_under("256KiB", &small);
        assert_eq!(code, 0, "{field}: {v}");
    }
    // A 64-byte case asking for 3e7 empty segments (5.8 GB at 192 bytes
    // each, over the default 4 GiB): refused at once; 2 are answered.
    let t = Instant::now();
    refused(
        &json!({"op": "causal_conversions", "seq_idx": [0], "num_segments": 30_000_000}),
        "num_segments",
    );
    assert!(t.elapsed().as_secs() < 5, "{:?}", t.elapsed());
    let out = answered(&json!({"op": "causal_conversions", "seq_idx": [0], "num_segments": 2}));
    assert_eq!(out["cu_seqlens"], json!([0, 1, 1]));
}

#[test]
fn a_mean_of_finite_losses_whose_sum_is_beyond_f64_is_the_mean() {
    // Each token's loss is lse - z_t = 1e308 + 1e307 = 1.1e308 (finite);
    // their sum 2.2e308 is beyond f64, their mean 1.1e308 is not (the
    // reduction answered inf). The sum's true value is beyond f64: +inf.
    let row = json!([1e308, -1e307]);
    let case = |reduction: &str| {
        json!({"op": "cross_entropy", "logits": [row, row], "targets": [1, 1],
               "reduction": reduction})
    };
    let mean = answered(&case("mean"))["loss"].as_f64().unwrap();
    assert!(
        (mean - 1.1e308).abs() <= SCALED_MEAN_TOL * 1.1e308,
        "{mean:e}"
    );
    assert_eq!(answered(&case("sum"))["loss"], json!("inf"));
    // A negative control: in range the mean is the plain one (1.1e300).
    let small = json!({"op": "cross_entropy", "logits": [[1e300, -1e299], [1e300, -1e299]],
                       "targets": [1, 1]});
    let m = answered(&small)["loss"].as_f64().unwrap();
    assert!((m - 1.1e300).abs() <= 1e-15 * 1.1e300, "{m:e}");
}

#[test]
fn verify_causal_lm_checks_the_parameters_before_building_the_model() {
    let Some(a) = packshard::assets::require(
        "verify_causal_lm_checks_the_parameters_before_building_the_model",
    ) else {
        return;
    };
    // 1,000 layers of SwiGLU 100,000 wide at hidden 32: ~77 GB of f64
    // parameters, three copies. It was allocated before any check (an abort
    // under the cap); now refused from the sizes before the model is built.
    let t = Instant::now();
    let o = common::verify_command("causal-lm", "--tokenizer", &a.minilm, &a.shakespeare)
        .args([
            "--max-lines",
            "2",
            "--layers",
            "1000",
            "--intermediate",
            "100000",
        ])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert_clean(&o, "verify causal-lm");
    let e = stderr(&o);
    assert!(e.contains("max_seq_len") && e.contains("parameters"), "{e}");
    // From the sizes: well under the 10 s a check may take.
    assert!(t.elapsed().as_secs() < 10, "{:?}", t.elapsed());
}
