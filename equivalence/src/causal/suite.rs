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

/// One docs/FAULTS.md example: its documents' lengths and how a row holds
/// them (the layout arguments of [`CausalCase::seeded`]).
#[derive(Debug, Clone, PartialEq)]
pub struct FaultCase {
    /// What the case shows.
    pub name: &'static str,
    /// Tokens of each document.
    pub lengths: Vec<usize>,
    /// Each document's first position (> 0: a continuation chunk, C6).
    pub offsets: Vec<usize>,
    /// Padding slots placed before each document in the packed rows (C4).
    pub gaps: Vec<usize>,
    /// Slots per row, packed and padded.
    pub row_len: usize,
    /// Whether each document's last token has the EOS target (C2).
    pub eos: bool,
}

impl FaultCase {
    /// Documents of `lengths` in rows of `row_len`: positions from 0, no
    /// padding between documents, no EOS target.
    fn new(name: &'static str, lengths: &[usize], row_len: usize) -> Self {
        FaultCase {
            name,
            lengths: lengths.to_vec(),
            offsets: vec![0; lengths.len()],
            gaps: vec![0; lengths.len()],
            row_len,
            eos: false,
        }
    }

    /// With the EOS target on each document's last token.
    fn eos(self) -> Self {
        FaultCase { eos: true, ..self }
    }

    /// With the documents' first positions `offsets`.
    fn offsets(self, offsets: &[usize]) -> Self {
        FaultCase {
            offsets: offsets.to_vec(),
            ..self
        }
    }

    /// With `gaps` padding slots before each document.
    fn gaps(self, gaps: &[usize]) -> Self {
        FaultCase {
            gaps: gaps.to_vec(),
            ..self
        }
    }

    /// The case on `config` with values from `seed`.
    pub fn case(&self, config: DecoderConfig, reduction: CausalReduction, seed: u64) -> CausalCase {
        CausalCase::seeded(
            config,
            &self.lengths,
            &self.offsets,
            &self.gaps,
            self.row_len,
            self.eos,
            reduction,
            seed,
        )
    }
}

/// The docs/FAULTS.md examples as cases.
pub fn fault_cases() -> Vec<FaultCase> {
    vec![
        FaultCase::new("C1 pack [a b | c d]", &[2, 2], 4),
        FaultCase::new("C2 EOS targets, [3, 4] in one row", &[3, 4], 7).eos(),
        FaultCase::new("C3 positions [0,1,2,0,0,1]", &[3, 1, 2], 6),
        FaultCase::new("C4 doc ids [1,1,1,0,2,2,0,0]", &[3, 2], 8).gaps(&[0, 1]),
        FaultCase::new("C6 a chunk at positions [5,6,7,8]", &[4, 3], 8).offsets(&[5, 0]),
        FaultCase::new("C7 2 rows of [3, 5]", &[3, 5, 3, 5], 8),
        FaultCase::new("P7 2 and 6 predicted tokens", &[3, 7], 10),
        FaultCase::new("one-token documents", &[1, 1, 1, 1], 4).eos(),
        FaultCase::new("an empty document", &[2, 0, 3], 5),
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
    for (i, fault) in fault_cases().iter().enumerate() {
        for reduction in CausalReduction::ALL {
            let config = DecoderConfig::tiny(11, 2, 1, 2, 5, 2);
            let case = fault.case(config, reduction, i as u64);
            let r = check_causal(imp, &case, judge)
                .map_err(|m| m.within(&format!("{} ({})", fault.name, reduction.name())))?;
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
