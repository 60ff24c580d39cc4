//! Every registered implementation of every op family through its family's
//! equivalence suite, under the judge its registry entry states: packed ==
//! padded (sharded == unsharded) and against the f64 reference
//! (`<family>::<impl>::suite`; `suite_small` for entries with a small
//! configuration, tiles that small cases cross).
//!
//! Adding a kernel to the registry puts it through these suites with no
//! change here.

use packshard_equivalence::compare::{Judge, Tolerance};
use packshard_equivalence::{attention, bert, causal, vocab};
use packshard_oracle::registry::{self, Family};
use packshard_reference::bert::PackedAttention;

use crate::harness::{Config, Tests};

/// Cases per suite and configuration (the suites also run their fixed
/// docs/FAULTS.md and tile-edge cases).
const CASES: u32 = 48;

/// Adds the suites of every family, in both configurations.
pub fn add(
    t: &mut Tests,
    attention_list: &[registry::Entry<dyn packshard_reference::ops::AttentionOp>],
) {
    for (config, suite) in [
        (Config::Registered, "suite"),
        (Config::Small, "suite_small"),
    ] {
        // The minimum counts apply to the registered configurations.
        let min = |n: usize| if config == Config::Registered { n } else { 0 };
        t.each(
            Family::Attention,
            attention_list,
            suite,
            config,
            min(4),
            |imp, e| {
                attention::run_suite(imp, e.judge, CASES)
                    .map(|r| r.to_string())
                    .map_err(|m| m.to_string())
            },
        );
        t.each(
            Family::CrossEntropy,
            &registry::cross_entropy(),
            suite,
            config,
            min(2),
            |imp, e| {
                vocab::run_cross_entropy_suite(imp, e.judge, CASES)
                    .map(|r| r.to_string())
                    .map_err(|m| m.to_string())
            },
        );
        t.each(
            Family::LinearCrossEntropy,
            &registry::linear_cross_entropy(),
            suite,
            config,
            min(3),
            |imp, e| {
                vocab::run_linear_suite(imp, e.judge, CASES)
                    .map(|r| r.to_string())
                    .map_err(|m| m.to_string())
            },
        );
        t.each(
            Family::Embedding,
            &registry::embedding(),
            suite,
            config,
            min(1),
            |imp, e| {
                vocab::run_embedding_suite(imp, e.judge, CASES)
                    .map(|r| r.to_string())
                    .map_err(|m| m.to_string())
            },
        );
        t.each(
            Family::EncoderLayer,
            &registry::encoder_layer(),
            suite,
            config,
            min(2),
            |imp, e| {
                bert::run_layer_suite(imp, e.judge, CASES)
                    .map(|r| r.to_string())
                    .map_err(|m| m.to_string())
            },
        );
        t.each(Family::CausalLm, &registry::causal_lm(), suite, config, min(3), |imp, e| {
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
    }
    // Inside the whole model, an attention whose two forms agree bit for bit
    // (its judge's `packed` tolerance is exact) keeps BERT's packed == padded
    // under the model suite's own f64 rule (docs/FAULTS.md P1, P2, P4, P5, P7, P8).
    let bitwise: Vec<_> = attention_list
        .iter()
        .filter(|e| match e.judge {
            Judge::Rewrite(_) => true,
            Judge::Relative { packed, .. } => packed == Tolerance::EXACT,
        })
        .cloned()
        .collect();
    t.each(
        Family::Attention,
        &bitwise,
        "inside_bert",
        Config::Registered,
        3,
        |op, _| {
            let r = bert::run_bert_suite(
                &bert::BertWith {
                    attention: op,
                    packed: PackedAttention::Varlen,
                },
                16,
            )
            .map_err(|m| m.to_string())?;
            // More than 5 of each kind of batch: the suite met both forms.
            if r.shared_packs > 5 && r.padding_or_empty > 5 {
                Ok(format!("{r:?}"))
            } else {
                Err(format!("too few packs of either kind: {r:?}"))
            }
        },
    );
}
