//! `packshard verify causal-lm` (issue #15): the command on real text
//! (Shakespeare through the MiniLM tokenizer; skipped without the assets
//! unless `PACKSHARD_REQUIRE_ASSETS=1`), and its library on seeded documents
//! (always run): the reference passes for every packing algorithm and both
//! packed attention forms, and a planted C1 (labels shifted over the whole
//! pack, docs/FAULTS.md) is reported as a mismatch of the loss.

mod common;

use packshard::assets;
use packshard::equivalence::causal::{
    reference_causal_lm, run_varlen, CausalBatch, CausalForm, CausalLmImpl, CausalRun, VarlenTokens,
};
use packshard::reference::attention::ReferenceAttention;
use packshard::reference::decoder::{
    loss_weights, CausalReduction, DecoderConfig, DecoderModel, KvCache,
};
use packshard::reference::packing::Algorithm;
use packshard::reference::vocab::IGNORE_INDEX;
use packshard::reference::Error;
use packshard::verify::causal::{
    verify_causal, CausalVerifyOptions, CausalVerifyReport, Layout, TOLERANCE,
};
use rand::{Rng, SeedableRng};

/// The `max rel` column of the table row named `name`.
fn table_rel(out: &str, name: &str) -> f64 {
    let line = out
        .lines()
        .find(|l| l.trim_start().starts_with(name))
        .unwrap_or_else(|| panic!("no row {name:?} in\n{out}"));
    line.split_whitespace().last().unwrap().parse().unwrap()
}

#[test]
fn verify_causal_lm_command_passes_on_a_small_real_sample() {
    let Some(a) = assets::require("verify_causal_lm_command_passes_on_a_small_real_sample") else {
        return;
    };
    for form in ["varlen", "block-causal"] {
        let out = common::run_succeeded(
            common::verify_command("causal-lm", "--tokenizer", &a.minilm, &a.shakespeare)
                .args(["--max-lines", "10", "--max-seq-len", "24", "--layers", "1"])
                .args(["--packed-attention", form, "--algorithm", "lpfhp"]),
        );
        common::assert_mentions(
            &out,
            &[
                "Llama shape",
                "2 key-value heads",
                "vocab 30522",
                "10 documents",
                "efficiency",
                "speed-up",
                "PASS: packed == padded within f64 rewrite",
            ],
        );
        // Documents share packs: fewer packs than documents.
        let packs: usize = out
            .split("packs of")
            .next()
            .and_then(|s| s.split_whitespace().last())
            .unwrap()
            .parse()
            .unwrap();
        assert!(packs < 10, "{out}");
        for row in [
            "logits",
            "loss (per-token)",
            "loss (per-document)",
            "loss (per-row)",
            "parameter gradients (per-token)",
            "parameter gradients (per-document)",
            "parameter gradients (per-row)",
        ] {
            let rel = table_rel(&out, row);
            assert!(rel <= TOLERANCE.rel, "{row}: {rel} in\n{out}");
        }
    }
    // Bad input: exit 2 with one line naming the field.
    for (args, want) in [
        (&["--kv-heads", "3"][..], "num_kv_heads"),
        (&["--packed-attention", "dense"][..], "--packed-attention"),
        (&["--max-lines", "0"][..], "--max-lines"),
        (&["--max-lines", "200"][..], "memory budget"),
    ] {
        let o = common::verify_command("causal-lm", "--tokenizer", &a.minilm, &a.shakespeare)
            .args(args)
            .env("PACKSHARD_MEMORY_BUDGET", "4GiB")
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(want) && err.lines().count() == 1, "{err}");
    }
}

/// Seeded documents of lengths 0..=row over a vocabulary of `v`.
fn documents(n: usize, row: usize, v: i64, seed: u64) -> Vec<Vec<i64>> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            let len = rng.random_range(0..=row);
            (0..len).map(|_| rng.random_range(0..v)).collect()
        })
        .collect()
}

/// `verify_causal` of a small seeded model (GQA 4/2 heads) on `docs` in
/// rows of `row` slots, padded through the reference, packed through `packed`.
fn verify(
    docs: &[Vec<i64>],
    row: usize,
    algorithm: Algorithm,
    packed: &dyn CausalLmImpl,
) -> CausalVerifyReport {
    let model = DecoderModel::random(DecoderConfig::tiny(37, 4, 2, 4, 12, 2), 7).unwrap();
    let opts = CausalVerifyOptions {
        max_seq_len: row,
        algorithm,
        max_sequences_per_pack: None,
    };
    let padded = reference_causal_lm(CausalForm::BlockCausal);
    verify_causal(&model, docs, &opts, &padded, packed, &|_| {}).unwrap()
}

#[test]
fn reference_passes_for_every_algorithm_and_form() {
    // Seeded lengths, and an empty, a one-token and a full-row document.
    let mut docs = documents(12, 12, 37, 3);
    docs.extend([vec![], vec![4], (0..12).collect()]);
    for algorithm in [Algorithm::Spfhp, Algorithm::Lpfhp, Algorithm::Ffd] {
        for form in [CausalForm::Varlen, CausalForm::BlockCausal] {
            let r = verify(&docs, 12, algorithm, &reference_causal_lm(form));
            let seen = r
                .verdict
                .unwrap_or_else(|m| panic!("{algorithm:?} {form:?}: {m}"));
            assert!(
                r.run.packed_slots < r.run.padded_slots,
                "{:?}",
                r.run.metrics
            );
            assert_eq!(r.losses.len(), 3);
            assert_eq!(r.diffs.len(), 7);
            assert!(
                seen.values > 10_000 && seen.max_rel <= TOLERANCE.rel,
                "{seen:?}"
            );
            // The per-row loss sums each document: larger than the means.
            assert!(r.losses[2].1 > r.losses[0].1, "{:?}", r.losses);
        }
    }
}

#[test]
fn layouts_place_whole_documents() {
    let docs = vec![vec![5, 6, 7], vec![], vec![8], vec![9, 10]];
    let p = Layout::padded(&docs, 4).unwrap();
    assert_eq!(
        p.batch.doc_ids,
        [1, 1, 1, 0, 0, 0, 0, 0, 3, 0, 0, 0, 4, 4, 0, 0]
    );
    assert_eq!(p.slots[3], [12, 13]);
    let config = packshard::reference::packing::PackingConfig::new(Algorithm::Ffd, 4);
    let (_, k) = Layout::packed(&docs, &config).unwrap();
    assert_eq!(k.batch.rows(), 2);
    for (d, doc) in docs.iter().enumerate() {
        let ids: Vec<i64> = k.slots[d].iter().map(|&s| k.batch.input_ids[s]).collect();
        let pos: Vec<usize> = k.slots[d]
            .iter()
            .map(|&s| k.batch.position_ids[s])
            .collect();
        assert_eq!(&ids, doc);
        assert_eq!(pos, (0..doc.len()).collect::<Vec<_>>());
    }
    let e = Layout::padded(&docs, 2).unwrap_err();
    assert!(e.to_string().contains("documents"), "{e}");
}

/// docs/FAULTS.md C1: next-token labels over the whole row, so a
/// document's last token predicts the next document's first.
struct LabelsAcrossThePack;

impl CausalLmImpl for LabelsAcrossThePack {
    /// Every config, as the reference it plants a fault in.
    fn supports(&self, _: &DecoderConfig) -> bool {
        true
    }

    fn name(&self) -> String {
        "C1 labels across the pack".into()
    }

    fn run(
        &self,
        model: &DecoderModel,
        b: &CausalBatch,
        reduction: CausalReduction,
    ) -> Result<CausalRun, Error> {
        let real = |i: usize| b.doc_ids.get(i).is_some_and(|&d| d != 0);
        let labels: Vec<i64> = (0..b.input_ids.len())
            .map(|i| {
                if real(i) && (i + 1) % b.row_len != 0 && real(i + 1) {
                    b.input_ids[i + 1]
                } else {
                    IGNORE_INDEX
                }
            })
            .collect();
        let weights = loss_weights(&labels, &b.doc_ids, reduction, b.num_documents)?;
        let t = VarlenTokens::of(b)?;
        let (labels, weights) = (t.gather(&labels), t.gather(&weights));
        run_varlen(model, &ReferenceAttention, b, &t, &labels, &weights)
    }

    fn chunk_logits(
        &self,
        _: &DecoderModel,
        _: &CausalBatch,
        _: &KvCache,
    ) -> Result<ndarray::Array2<f64>, Error> {
        Err(Error::invalid("past", "not used by verify"))
    }
}

#[test]
fn planted_labels_across_the_pack_fail_on_the_loss() {
    let r = verify(
        &documents(10, 10, 37, 5),
        10,
        Algorithm::Spfhp,
        &LabelsAcrossThePack,
    );
    let m = r.verdict.expect_err("C1 must be caught");
    // The logits are right (labels do not enter the forward); the loss is not.
    assert!(m.what.contains("loss (per-token)"), "{m}");
    let row = |name: &str| r.diffs.iter().find(|d| d.name == name).unwrap().clone();
    assert!(row("logits").max_rel <= TOLERANCE.rel, "{:?}", r.diffs);
    assert!(row("loss (per-token)").max_rel > 1e-3, "{:?}", r.diffs);
    assert!(
        row("parameter gradients (per-row)").max_rel > 1e-3,
        "{:?}",
        r.diffs
    );
}
