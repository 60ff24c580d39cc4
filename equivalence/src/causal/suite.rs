//! The causal-LM suite's strategies, the docs/FAULTS.md example cases and the
//! whole suite over them.

use super::*;

/// A small random decoder config: heads 1..=4 with a dividing `h_kv`, head
/// dim 2 or 4, 1..=2 layers, inner width 1..=6, vocabulary 5..=13, norm, MLP
/// and head tying drawn.
pub fn configs() -> impl Strategy<Value = DecoderConfig> {
    (
        1usize..=4,
        0usize..4,
        prop::sample::select(vec![2usize, 4]),
        1usize..=2,
        1usize..=6,
        5usize..=13,
        any::<(bool, bool, bool)>(),
    )
        .prop_map(|(h, kv_pick, d, layers, inter, vocab, (ln, gelu, tied))| {
            let divisors: Vec<usize> = (1..=h).filter(|k| h % k == 0).collect();
            let kv = divisors[kv_pick % divisors.len()];
            DecoderConfig {
                norm: if ln { Norm::LayerNorm } else { Norm::RmsNorm },
                mlp: if gelu { Mlp::Gelu } else { Mlp::SwiGlu },
                tie_embeddings: tied,
                ..DecoderConfig::tiny(vocab, h, kv, d, inter, layers)
            }
        })
}

/// Most slots in a random row.
pub const MAX_ROW: usize = 10;

/// Random cases: sizes first (row length, documents with empty, one-token
/// and full-row ones, offsets, gaps), then the config and the seeded values.
pub fn causal_cases() -> impl Strategy<Value = CausalCase> {
    (1usize..=MAX_ROW, 1usize..=6)
        .prop_flat_map(|(row, b)| {
            (
                Just(row),
                prop::collection::vec(prop_oneof![1 => Just(0usize), 2 => Just(1usize), 1 => Just(row), 4 => 1usize..=row], b),
                prop::collection::vec(prop_oneof![3 => Just(0usize), 1 => 1usize..=6], b),
                prop::collection::vec(prop_oneof![2 => Just(0usize), 1 => 1usize..=2], b),
                configs(),
                any::<bool>(),
                prop::sample::select(CausalReduction::ALL.to_vec()),
                any::<u64>(),
            )
        })
        .prop_map(|(row, lengths, offsets, gaps, config, eos, red, seed)| {
            CausalCase::seeded(config, &lengths, &offsets, &gaps, row, eos, red, seed)
        })
}

/// The docs/FAULTS.md examples as cases: `(name, lengths, offsets, gaps,
/// row_len, eos)`.
#[allow(clippy::type_complexity)]
pub fn fault_cases() -> Vec<(
    &'static str,
    Vec<usize>,
    Vec<usize>,
    Vec<usize>,
    usize,
    bool,
)> {
    vec![
        (
            "C1 pack [a b | c d]",
            vec![2, 2],
            vec![0, 0],
            vec![0, 0],
            4,
            false,
        ),
        (
            "C2 EOS targets, [3, 4] in one row",
            vec![3, 4],
            vec![0, 0],
            vec![0, 0],
            7,
            true,
        ),
        (
            "C3 positions [0,1,2,0,0,1]",
            vec![3, 1, 2],
            vec![0, 0, 0],
            vec![0, 0, 0],
            6,
            false,
        ),
        (
            "C4 doc ids [1,1,1,0,2,2,0,0]",
            vec![3, 2],
            vec![0, 0],
            vec![0, 1],
            8,
            false,
        ),
        (
            "C6 a chunk at positions [5,6,7,8]",
            vec![4, 3],
            vec![5, 0],
            vec![0, 0],
            8,
            false,
        ),
        (
            "C7 2 rows of [3, 5]",
            vec![3, 5, 3, 5],
            vec![0; 4],
            vec![0; 4],
            8,
            false,
        ),
        (
            "P7 2 and 6 predicted tokens",
            vec![3, 7],
            vec![0, 0],
            vec![0, 0],
            10,
            false,
        ),
        (
            "one-token documents",
            vec![1, 1, 1, 1],
            vec![0; 4],
            vec![0; 4],
            4,
            true,
        ),
        (
            "an empty document",
            vec![2, 0, 3],
            vec![0; 3],
            vec![0; 3],
            5,
            false,
        ),
    ]
}

/// The whole suite for one implementation: the fault cases under every
/// reduction (a fixed small GQA config) and `cases` random ones (fixed
/// proptest seed); under a [`Judge::Relative`], the rule's suite totals too.
///
/// # Errors
/// The first failure with its case.
pub fn run_causal_suite(
    imp: &dyn CausalLmImpl,
    judge: Judge,
    cases: u32,
) -> Result<CausalReport, Mismatch> {
    let mut report = CausalReport::default();
    for (i, (name, lengths, offsets, gaps, row, eos)) in fault_cases().into_iter().enumerate() {
        for reduction in CausalReduction::ALL {
            let config = DecoderConfig::tiny(11, 2, 1, 2, 5, 2);
            let case = CausalCase::seeded(
                config, &lengths, &offsets, &gaps, row, eos, reduction, i as u64,
            );
            let r = check_causal(imp, &case, judge).map_err(|m| {
                Mismatch::new(
                    format!("{name} ({}): {}", reduction.name(), m.what),
                    m.detail,
                )
            })?;
            report.merge(&r);
        }
    }
    let suite = format!("{IMPL} causal-LM suite ({})", imp.name());
    let report = crate::run_cases(cases, &causal_cases(), &suite, report, |report, case| {
        if !imp.supports(&case.model.config) {
            report.skipped += 1;
            return Ok(());
        }
        report.merge(&check_causal(imp, &case, judge)?);
        Ok(())
    })?;
    if let Some(rule) = judge.relative_rule() {
        report.relative.check(&suite, rule)?;
    }
    Ok(report)
}
