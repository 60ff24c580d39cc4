//! BERT packed == padded: encoder layer and whole model with losses and
//! every gradient (docs/FAULTS.md P1, P2, P4, P5, P7, P8).
//!
//! A [`BertImpl`] runs a model on a padded batch (one sequence per row, key
//! padding mask) and on a packed batch from [`packshard_reference::packing`].
//! [`check_bert`] requires that, for every input sequence, the last hidden
//! state, pooled output, NSP logits and MLM token losses agree; that the MLM,
//! NSP and total losses agree under the declared reduction; and that every
//! parameter gradient (tied decoder included) and the gradient of the input
//! embeddings agree — all under [`Tolerance::F64_REWRITE`]: both sides do the
//! same f64 operations per token, and only reductions over tokens
//! (parameter gradients, the loss sums) add the same terms in another order
//! (and padding adds exact zeros), which moves a result by a few ulp of its
//! largest term. Every value must also be finite (a NaN from a fully masked
//! row fails, P8).
//!
//! [`run_layer_suite`] is the same property for one layer ([`EncoderLayerOp`]).

use ndarray::Array2;
use packshard_reference::attention::ReferenceAttention;
use packshard_reference::bert::layer::ReferenceLayer;
use packshard_reference::bert::{
    AttentionLayout, BertConfig, BertModel, BertOutput, LayerParams, LossWeights, PackedAttention,
    Reduction, Targets, TokenBatch, IGNORE_INDEX,
};
use packshard_reference::ops::{AttentionOp, EncoderLayerOp, Layer, LayerInput, LayerPass};
use packshard_reference::packing::{Algorithm, PackedBatch, PackingConfig};
use packshard_reference::Error;
use proptest::prelude::*;
use rand::{Rng, SeedableRng};

pub use crate::attention::Observed;
use crate::attention::{RelativeReport, IMPL};
use crate::baseline32;
use crate::compare::{assert_within_k, Allowance, Judge, Mismatch, RelativeRule, Tolerance};

/// A layer's results as `(output, grad_x, parameter gradients)`.
fn parts(p: LayerPass) -> (Array2<f64>, Array2<f64>, LayerParams) {
    (p.output, p.grad_x, p.grads)
}

/// A parameter's name in the suites' messages: its Hugging Face `BertLayer`
/// name ([`LayerParams::named`]), the query/key/value ones without their
/// `attention.self.` prefix (`query.weight`).
fn short_name(name: &'static str) -> &'static str {
    name.strip_prefix("attention.self.").unwrap_or(name)
}

/// Each parameter as `(name, row-major values, shape)`, in
/// [`LayerParams::named`]'s order.
fn layer_tensors(p: &LayerParams) -> Vec<(&'static str, Vec<f64>, Vec<usize>)> {
    (p.named().into_iter())
        .map(|(n, a)| {
            (
                short_name(n),
                a.iter().copied().collect(),
                a.shape().to_vec(),
            )
        })
        .collect()
}

/// As [`layer_tensors`], the tensors mutable.
fn layer_tensors_mut(p: &mut LayerParams) -> Vec<(&'static str, ndarray::ArrayViewMutD<'_, f64>)> {
    (p.named_mut().into_iter())
        .map(|(n, a)| (short_name(n), a))
        .collect()
}

fn finite(what: &str, values: &[f64]) -> Result<(), Mismatch> {
    match values.iter().position(|v| !v.is_finite()) {
        None => Ok(()),
        Some(i) => Err(Mismatch::new(
            what,
            format!(
                "element {i} is {} (a fully masked row must give 0, never NaN: docs/FAULTS.md P8)",
                values[i]
            ),
        )),
    }
}

/// A whole BERT (embeddings, encoder, pooler, MLM and NSP heads and losses,
/// backward) on padded and packed batches.
pub trait BertImpl {
    /// A short name for reports.
    fn name(&self) -> String;
    /// The padded batch: sequence `s` of the case in row `s` of
    /// `case.max_seq_len` tokens, positions from `case.position_offset`,
    /// with gradients.
    ///
    /// # Errors
    /// Input errors.
    fn padded(&self, case: &BertCase) -> Result<BertOutput, Error>;
    /// The packed batch (`batch`: the case's sequences as the reference
    /// packer packs them, [`BertCase::packed_batch`]), with gradients.
    ///
    /// # Errors
    /// Input errors.
    fn packed(&self, case: &BertCase, batch: &PackedBatch) -> Result<BertOutput, Error>;
}

/// The reference model with a given attention inside (any [`AttentionOp`]:
/// its masked form on padded rows, its varlen form on packed ones), packed
/// with the given attention form.
#[derive(Clone, Copy)]
pub struct BertWith<'a> {
    /// The attention every layer runs.
    pub attention: &'a dyn AttentionOp,
    /// How packed batches attend (varlen or block-diagonal mask).
    pub packed: PackedAttention,
}

impl BertImpl for BertWith<'_> {
    fn name(&self) -> String {
        format!("reference BERT ({:?})", self.packed)
    }
    fn padded(&self, case: &BertCase) -> Result<BertOutput, Error> {
        let batch = TokenBatch::padded(
            &case.sequences,
            Some(&case.token_type_ids),
            case.max_seq_len,
            case.model.config.pad_token_id,
            case.position_offset,
        )?;
        self.run(case, &batch)
    }
    fn packed(&self, case: &BertCase, batch: &PackedBatch) -> Result<BertOutput, Error> {
        let nsp = case.targets.nsp_labels.len();
        let tt = Some(&case.token_type_ids[..]);
        let batch = TokenBatch::packed(batch, nsp, tt, self.packed)?;
        self.run(case, &batch)
    }
}

impl BertWith<'_> {
    /// The model on `batch` with the case's targets and reduction, with gradients.
    fn run(&self, case: &BertCase, batch: &TokenBatch) -> Result<BertOutput, Error> {
        let w = LossWeights::new(&case.targets, case.reduction);
        case.model
            .run_with(self.attention, batch, &case.targets, &w, true, None)
    }
}

/// The reference model with the reference attention, packed with the given
/// attention form.
pub fn reference_bert(packed: PackedAttention) -> BertWith<'static> {
    BertWith {
        attention: &ReferenceAttention,
        packed,
    }
}

/// One model case: a configuration, parameters, sequences, targets, how to pack.
#[derive(Debug, Clone)]
pub struct BertCase {
    /// The model (small, random parameters).
    pub model: BertModel,
    /// Token ids per sequence (empty ones allowed).
    pub sequences: Vec<Vec<i64>>,
    /// Token types per sequence.
    pub token_type_ids: Vec<Vec<i64>>,
    /// MLM and NSP targets.
    pub targets: Targets,
    /// The declared reduction.
    pub reduction: Reduction,
    /// Pack length (also the padded row length).
    pub max_seq_len: usize,
    /// The packing algorithm.
    pub algorithm: Algorithm,
    /// Position offset (0 for BERT; 2 for RoBERTa-style models).
    pub position_offset: usize,
}

impl BertCase {
    /// A deterministic case: `lengths` of random tokens, about a third of the
    /// tokens predicted (at least one per non-empty sequence when
    /// `every_sequence_predicts`), NSP labels on every non-empty sequence.
    #[allow(clippy::too_many_arguments)]
    pub fn seeded(
        config: BertConfig,
        lengths: &[usize],
        max_seq_len: usize,
        algorithm: Algorithm,
        reduction: Reduction,
        position_offset: usize,
        seed: u64,
    ) -> Self {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let v = config.vocab_size as i64;
        let model = BertModel::random(config, seed ^ 0x9e37_79b9).expect("valid config");
        let sequences: Vec<Vec<i64>> = lengths
            .iter()
            .map(|&l| (0..l).map(|_| rng.random_range(1..v)).collect())
            .collect();
        let token_type_ids = lengths
            .iter()
            .map(|&l| {
                let cut = rng.random_range(0..=l);
                (0..l).map(|t| i64::from(t >= cut)).collect()
            })
            .collect();
        let mlm_labels = lengths
            .iter()
            .map(|&l| {
                let forced = if l > 0 { rng.random_range(0..l) } else { 0 };
                (0..l)
                    .map(|t| {
                        if t == forced || rng.random_range(0..3) == 0 {
                            rng.random_range(0..v)
                        } else {
                            IGNORE_INDEX
                        }
                    })
                    .collect()
            })
            .collect();
        let nsp_labels = lengths
            .iter()
            .map(|&l| {
                if l > 0 {
                    rng.random_range(0..2)
                } else {
                    IGNORE_INDEX
                }
            })
            .collect();
        BertCase {
            model,
            sequences,
            token_type_ids,
            targets: Targets {
                mlm_labels,
                nsp_labels,
            },
            reduction,
            max_seq_len,
            algorithm,
            position_offset,
        }
    }

    /// The packed batch of the case (reference packer, `overlong = error`).
    ///
    /// # Errors
    /// Packing errors.
    pub fn packed_batch(&self) -> Result<PackedBatch, Error> {
        let config = PackingConfig::new(self.algorithm, self.max_seq_len);
        Ok(PackedBatch::from_sequences(
            &self.sequences,
            &config,
            self.model.config.pad_token_id as i64,
            self.position_offset as i64,
        )?
        .1)
    }
}

/// Compares a packed run with the padded one (see the module docs): per
/// sequence outputs, losses, input-embedding gradients, then every parameter
/// gradient; all finite, all within [`Tolerance::F64_REWRITE`].
///
/// # Errors
/// The first [`Mismatch`].
pub fn compare_outputs(
    padded: &BertOutput,
    packed: &BertOutput,
    seen: &mut Observed,
) -> Result<(), Mismatch> {
    let tol = Tolerance::F64_REWRITE;
    if padded.sequences.len() != packed.sequences.len() {
        return Err(Mismatch::new(
            "sequences",
            format!(
                "packed gave {} sequences, padded {}",
                packed.sequences.len(),
                padded.sequences.len()
            ),
        ));
    }
    for (name, out) in [("padded", padded), ("packed", packed)] {
        for (s, so) in out.sequences.iter().enumerate() {
            finite(
                &format!("{name} sequence {s}: hidden"),
                so.hidden.as_slice().unwrap_or(&[]),
            )?;
            if let Some(g) = &so.grad_inputs_embeds {
                finite(
                    &format!("{name} sequence {s}: grad_inputs_embeds"),
                    &g.iter().copied().collect::<Vec<_>>(),
                )?;
            }
        }
        if let Some(g) = &out.grads {
            for (t, v) in g.named() {
                finite(
                    &format!("{name} grad {t}"),
                    &v.iter().copied().collect::<Vec<_>>(),
                )?;
            }
        }
        finite(
            &format!("{name} loss"),
            &[out.mlm_loss, out.nsp_loss, out.loss],
        )?;
    }
    for (s, (a, b)) in padded.sequences.iter().zip(&packed.sequences).enumerate() {
        let v = |x: &Array2<f64>| x.iter().copied().collect::<Vec<f64>>();
        if a.hidden.dim() != b.hidden.dim() {
            return Err(Mismatch::new(
                format!("sequence {s}: hidden"),
                format!(
                    "packed shape {:?}, padded {:?}",
                    b.hidden.shape(),
                    a.hidden.shape()
                ),
            ));
        }
        seen.close(
            &format!("sequence {s}: hidden"),
            &v(&a.hidden),
            &v(&b.hidden),
            a.hidden.shape(),
            tol,
        )?;
        match (&a.pooled, &b.pooled, &a.nsp_logits, &b.nsp_logits) {
            (Some(pa), Some(pb), Some(na), Some(nb)) => {
                seen.close(
                    &format!("sequence {s}: pooled"),
                    &pa.to_vec(),
                    &pb.to_vec(),
                    pa.shape(),
                    tol,
                )?;
                seen.close(
                    &format!("sequence {s}: nsp_logits"),
                    &na.to_vec(),
                    &nb.to_vec(),
                    &[2],
                    tol,
                )?;
            }
            (None, None, None, None) => {}
            _ => {
                return Err(Mismatch::new(
                    format!("sequence {s}: pooled"),
                    "present on one side only (empty sequences have none)",
                ))
            }
        }
        seen.close(
            &format!("sequence {s}: mlm token losses"),
            &a.mlm_losses,
            &b.mlm_losses,
            &[a.mlm_losses.len()],
            tol,
        )?;
    }
    // Losses before gradients, so a wrong loss is reported as such.
    seen.close(
        "mlm_loss",
        &[padded.mlm_loss],
        &[packed.mlm_loss],
        &[1],
        tol,
    )?;
    seen.close(
        "nsp_loss",
        &[padded.nsp_loss],
        &[packed.nsp_loss],
        &[1],
        tol,
    )?;
    seen.close("loss", &[padded.loss], &[packed.loss], &[1], tol)?;
    for (s, (a, b)) in padded.sequences.iter().zip(&packed.sequences).enumerate() {
        match (&a.grad_inputs_embeds, &b.grad_inputs_embeds) {
            (Some(ga), Some(gb)) => seen.close(
                &format!("sequence {s}: grad_inputs_embeds"),
                &ga.iter().copied().collect::<Vec<_>>(),
                &gb.iter().copied().collect::<Vec<_>>(),
                ga.shape(),
                tol,
            )?,
            _ => {
                return Err(Mismatch::new(
                    format!("sequence {s}: grad_inputs_embeds"),
                    "missing",
                ))
            }
        }
    }
    let (Some(ga), Some(gb)) = (&padded.grads, &packed.grads) else {
        return Err(Mismatch::new("grads", "gradients missing"));
    };
    // The parameter gradients are one vector: the absolute floor is relative
    // to its largest element, because some parts are zero by symmetry (the
    // key biases: softmax is shift-invariant, so their gradient is pure
    // round-off of terms as large as the other gradients).
    let global = ga
        .named()
        .iter()
        .flat_map(|(_, t)| t.iter().copied().collect::<Vec<_>>())
        .fold(0.0f64, |m, v| m.max(v.abs()));
    for ((name, a), (_, b)) in ga.named().into_iter().zip(gb.named()) {
        let va: Vec<f64> = a.iter().copied().collect();
        let vb: Vec<f64> = b.iter().copied().collect();
        seen.close_scaled(
            &format!("grad {name}"),
            &va,
            &vb,
            a.shape(),
            tol,
            Some(global),
        )?;
    }
    Ok(())
}

/// Checks `imp` on one case: packed (built by the reference packer) against
/// padded (rows of `max_seq_len`), see the module docs.
///
/// # Errors
/// The first [`Mismatch`], naming the sequence or tensor and index.
pub fn check_bert(imp: &dyn BertImpl, case: &BertCase) -> Result<Observed, Mismatch> {
    let err = |what: &str, e: Error| Mismatch::new(what, format!("{}: {e}", IMPL));
    let batch = case.packed_batch().map_err(|e| err("pack", e))?;
    let padded = imp.padded(case).map_err(|e| err("padded", e))?;
    let packed = imp.packed(case, &batch).map_err(|e| err("packed", e))?;
    let mut seen = Observed::default();
    compare_outputs(&padded, &packed, &mut seen)?;
    Ok(seen)
}

/// A small random configuration: heads 1..=3, head dim 1..=4, 1..=2 layers,
/// intermediate 1..=12, vocabulary 5..=23, positions for `max_seq_len + 2`.
pub fn configs(max_seq_len: usize) -> impl Strategy<Value = BertConfig> {
    (1usize..=3, 1usize..=4, 1usize..=2, 1usize..=12, 5usize..=23).prop_map(
        move |(heads, d, layers, inter, vocab)| {
            BertConfig::tiny(vocab, heads * d, heads, layers, inter, max_seq_len + 2)
        },
    )
}

/// Most tokens in a random pack.
pub const MAX_SEQ_LEN: usize = 11;

/// Random model cases: sizes first (pack length, lengths with empty ones and
/// ones that fill the pack, config), then the seeded values.
pub fn bert_cases() -> impl Strategy<Value = BertCase> {
    (1usize..=MAX_SEQ_LEN)
        .prop_flat_map(|msl| {
            (
                Just(msl),
                prop::collection::vec(
                    prop_oneof![1 => Just(0usize), 1 => Just(msl), 1 => Just(1usize), 4 => 0usize..=msl],
                    1..=7,
                ),
                configs(msl),
                prop::sample::select(vec![Algorithm::Spfhp, Algorithm::Lpfhp, Algorithm::Ffd]),
                prop::sample::select(Reduction::ALL.to_vec()),
                0usize..=2,
                any::<u64>(),
            )
        })
        .prop_map(|(msl, lengths, config, alg, red, offset, seed)| {
            BertCase::seeded(config, &lengths, msl, alg, red, offset, seed)
        })
}

/// The docs/FAULTS.md examples as model cases: `(name, lengths, max_seq_len)`.
pub fn fault_cases() -> Vec<(&'static str, Vec<usize>, usize)> {
    vec![
        (
            "P1 positions reset: [4, 7] in one pack of 11",
            vec![4, 7],
            11,
        ),
        ("P2 lengths [3, 5] in a pack of 8", vec![3, 5], 8),
        ("P4 zero-length: [1, 0, 1]", vec![1, 0, 1], 4),
        ("P5 padding is not a sequence: [3] in 8", vec![3], 8),
        ("P7 two sequences, 2 and 6 tokens", vec![2, 6, 2, 6], 8),
        ("P8 sequence ids [1, 1, 2, 0]", vec![2, 1], 4),
        ("one sequence filling the pack", vec![6], 6),
        ("many tiny sequences", vec![1, 1, 1, 1, 1, 1, 1], 4),
    ]
}

/// What a model suite run covered.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SuiteReport {
    /// Worst errors seen.
    pub observed: Observed,
    /// Cases run.
    pub cases: usize,
    /// Cases with a pack holding two or more sequences (where P1, P2, P7 show).
    pub shared_packs: usize,
    /// Cases with an empty sequence or a padded pack (where P4, P5, P8 show).
    pub padding_or_empty: usize,
}

/// The whole model suite for one implementation: the fault cases (both
/// reductions, a fixed small config) and `cases` random ones (a fixed
/// proptest seed).
///
/// # Errors
/// The first failure with its case.
pub fn run_bert_suite(imp: &dyn BertImpl, cases: u32) -> Result<SuiteReport, Mismatch> {
    let mut report = SuiteReport::default();
    let run = |r: &mut SuiteReport, case: &BertCase| -> Result<(), Mismatch> {
        let o = check_bert(imp, case)?;
        let batch = case
            .packed_batch()
            .map_err(|e| Mismatch::new("pack", e.to_string()))?;
        r.observed.merge(o);
        r.cases += 1;
        if batch.cu_seqlens.iter().any(|c| c.len() > 2) {
            r.shared_packs += 1;
        }
        if case.sequences.iter().any(Vec::is_empty)
            || batch
                .cu_seqlens
                .iter()
                .any(|c| *c.last().unwrap() < batch.max_seq_len)
        {
            r.padding_or_empty += 1;
        }
        Ok(())
    };
    for (i, (name, lengths, msl)) in fault_cases().into_iter().enumerate() {
        for reduction in Reduction::ALL {
            let config = BertConfig::tiny(13, 6, 2, 2, 7, msl + 2);
            let case = BertCase::seeded(
                config,
                &lengths,
                msl,
                Algorithm::Spfhp,
                reduction,
                0,
                i as u64,
            );
            run(&mut report, &case)
                .map_err(|m| m.within(&format!("{name} ({})", reduction.name())))?;
        }
    }
    let suite = format!("{} BERT suite", IMPL);
    crate::run_cases(cases, &bert_cases(), &suite, report, |r, case| {
        run(r, &case)
    })
}

mod layer;
pub use layer::{
    check_layer, check_layer_relative, check_layer_with, layer_tile_cases, round_layer,
    run_layer_relative_suite, run_layer_suite, run_layer_suite_with, LayerReport,
};

#[cfg(test)]
mod tests {
    use super::*;

    /// The named tensor lists the checks iterate hold every parameter of a
    /// layer, once, under its Hugging Face name, with its own values.
    #[test]
    fn layer_tensors_list_every_parameter_once() {
        let (hidden, inter) = (6, 10);
        let config = BertConfig::tiny(9, hidden, 2, 1, inter, 8);
        let mut p = BertModel::random(config, 3)
            .unwrap()
            .params
            .layers
            .remove(0);
        let listed = layer_tensors(&p);
        let values: usize = listed.iter().map(|(_, v, _)| v.len()).sum();
        // q, k, v, attention output: [h, h] + [h]; two LayerNorms: 2 x 2 [h];
        // intermediate [i, h] + [i]; output [h, i] + [h].
        let want =
            4 * (hidden * hidden + hidden) + 4 * hidden + 2 * hidden * inter + inter + hidden;
        assert_eq!(values, want);
        let mut names: Vec<&str> = listed.iter().map(|(n, _, _)| *n).collect();
        assert_eq!(listed[0].1, p.query_w.iter().copied().collect::<Vec<_>>());
        assert_eq!(listed[15].1, p.out_ln_b.to_vec());
        assert_eq!(listed[10].2, vec![inter, hidden]);
        let mutable: Vec<(&str, Vec<f64>)> = layer_tensors_mut(&mut p)
            .into_iter()
            .map(|(n, t)| (n, t.iter().copied().collect()))
            .collect();
        for ((n, v, _), (m, w)) in listed.iter().zip(&mutable) {
            assert_eq!((n, v), (m, w));
        }
        assert_eq!(mutable.len(), listed.len());
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), 16);
    }
}
