//! Every registered implementation of every op family through its family's
//! equivalence suite, under the judge its registry entry states: packed ==
//! padded (sharded == unsharded) and against the f64 reference. An entry
//! that cannot run here (a GPU kernel without a device) says `skipped: ...`
//! once, or fails where its need is required (`Needs::required`:
//! `PACKSHARD_REQUIRE_EMULATOR=1` for the CUDA emulator). Entries with a small configuration (tiles that small cases cross)
//! run the suite in both.
//!
//! Adding a kernel to the registry puts it through these suites with no
//! change here.

use packshard_equivalence::compare::{Judge, Tolerance};
use packshard_equivalence::{attention, bert, causal, vocab};
use packshard_oracle::registry::{self, Entry};
use packshard_reference::bert::PackedAttention;

/// Cases per suite and configuration (the suites also run their fixed
/// docs/FAULTS.md and tile-edge cases).
const CASES: u32 = 48;

/// Runs `suite` on every available entry (and its small configuration),
/// printing each report; the number of implementations that ran.
fn every<K: ?Sized, R: std::fmt::Display, E: std::fmt::Display>(
    list: &[Entry<K>],
    suite: impl Fn(&K, &Entry<K>) -> Result<R, E>,
) -> usize {
    let mut ran = 0;
    for entry in list {
        let configs: Vec<(&str, Result<Box<K>, _>)> = if entry.has_small() {
            vec![("registered", entry.make()), ("small", entry.make_small())]
        } else {
            vec![("registered", entry.make())]
        };
        for (which, made) in configs {
            match made {
                Err(u) if entry.needs.required() => {
                    panic!("{}: required here but cannot run: {u}", entry.name)
                }
                Err(u) => {
                    eprintln!("{}: skipped: {u}", entry.name);
                    break;
                }
                Ok(imp) => {
                    let report = suite(&imp, entry)
                        .unwrap_or_else(|m| panic!("{} ({which}): {m}", entry.name));
                    eprintln!("{} ({which}): {report}", entry.name);
                    ran += 1;
                }
            }
        }
    }
    ran
}

/// One test per family: `test: entries, suite, at least this many ran`.
macro_rules! every_passes {
    ($($test:ident: $list:expr, $suite:path, $min:literal $what:literal;)*) => {$(
        #[test]
        fn $test() {
            let ran = every(&$list, |imp, e| $suite(imp, e.judge, CASES));
            assert!(ran >= $min, "only {ran} {} ran", $what);
        }
    )*};
}

every_passes! {
    every_attention_passes_the_attention_suite: registry::attention(), attention::run_suite, 4 "attention implementations";
    every_cross_entropy_passes_the_vocab_suite: registry::cross_entropy(), vocab::run_cross_entropy_suite, 2 "cross-entropy implementations";
    every_output_layer_passes_the_vocab_suite: registry::linear_cross_entropy(), vocab::run_linear_suite, 3 "output-layer implementations";
    every_embedding_passes_the_vocab_suite: registry::embedding(), vocab::run_embedding_suite, 1 "embeddings";
    every_encoder_layer_passes_the_layer_suite: registry::encoder_layer(), bert::run_layer_suite, 2 "encoder layers";
}

#[test]
fn every_causal_lm_passes_the_causal_suite() {
    let ran = every(&registry::causal_lm(), |imp, e| {
        causal::run_causal_suite(imp, e.judge, CASES)
            .map(|r| {
                format!(
                    "{} cases ({} skipped), packed vs padded grads max rel {:.2e}, truth max rel {:.2e}, relative tensors {} (max {:.3} x the baseline's error)",
                    r.cases,
                    r.skipped,
                    r.grads.max_rel,
                    r.truth.max_rel,
                    r.relative.count,
                    r.relative.max_ratio()
                )
            })
            .map_err(|m| m.to_string())
    });
    assert!(ran >= 3, "only {ran} causal LMs ran");
}

/// Inside the whole model, an attention whose two forms agree bit for bit
/// (its judge's `packed` tolerance is exact) keeps BERT's packed == padded
/// under the model suite's own f64 rule (docs/FAULTS.md P1, P2, P4, P5, P7, P8).
#[test]
fn bert_with_every_bitwise_attention_packed_equals_padded() {
    let mut ran = 0;
    for entry in registry::attention() {
        let exact = match entry.judge {
            Judge::Rewrite(_) => true,
            Judge::Relative { packed, .. } => packed == Tolerance::EXACT,
        };
        let Ok(op) = entry.make() else { continue };
        if !exact {
            continue;
        }
        let r = bert::run_bert_suite(
            &bert::BertWith {
                attention: &*op,
                packed: PackedAttention::Varlen,
            },
            16,
        )
        .unwrap_or_else(|m| panic!("{}: {m}", entry.name));
        eprintln!("BERT with {}: {r:?}", entry.name);
        assert!(r.shared_packs > 5 && r.padding_or_empty > 5, "{r:?}");
        ran += 1;
    }
    assert!(ran >= 3, "only {ran} attentions ran inside BERT");
}
