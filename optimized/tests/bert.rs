//! The whole-model suite (packed == padded for hidden states, pooled
//! outputs, losses under both reductions and every gradient, FAULTS.md P1,
//! P2, P4, P5, P7, P8) with the optimized attention inside the reference
//! BERT: the varlen kernel on packed batches, the dense masked kernel on
//! padded ones. Because the two kernels give bitwise equal attention for
//! real tokens, the suite holds under its own `Tolerance::F64_REWRITE`.

use packshard_equivalence::bert::{run_bert_suite, BertImpl};
use packshard_optimized::adapt::OptimizedAttention;
use packshard_reference::bert::{
    BertModel, BertOutput, LossWeights, PackedAttention, Reduction, Targets, TokenBatch,
};
use packshard_reference::packing::PackedBatch;
use packshard_reference::Error;

struct WithOptimizedAttention(OptimizedAttention);

impl BertImpl for WithOptimizedAttention {
    fn name(&self) -> String {
        use packshard_reference::bert::AttentionKernel;
        format!("reference BERT with {}", self.0.name())
    }
    fn padded(
        &self,
        model: &BertModel,
        sequences: &[Vec<i64>],
        token_type_ids: &[Vec<i64>],
        targets: &Targets,
        reduction: Reduction,
        row_len: usize,
        position_offset: usize,
    ) -> Result<BertOutput, Error> {
        let batch = TokenBatch::padded(
            sequences,
            Some(token_type_ids),
            row_len,
            model.config.pad_token_id,
            position_offset,
        )?;
        let w = LossWeights::new(targets, reduction);
        model.run_with(&self.0, &batch, targets, &w, true, None)
    }
    fn packed(
        &self,
        model: &BertModel,
        batch: &PackedBatch,
        token_type_ids: &[Vec<i64>],
        targets: &Targets,
        reduction: Reduction,
    ) -> Result<BertOutput, Error> {
        let tb = TokenBatch::packed(
            batch,
            targets.nsp_labels.len(),
            Some(token_type_ids),
            PackedAttention::Varlen,
        )?;
        let w = LossWeights::new(targets, reduction);
        model.run_with(&self.0, &tb, targets, &w, true, None)
    }
}

#[test]
fn bert_with_optimized_attention_packed_equals_padded() {
    for imp in [
        WithOptimizedAttention(OptimizedAttention::F32),
        WithOptimizedAttention(OptimizedAttention::BF16),
    ] {
        let r = run_bert_suite(&imp, 24).unwrap_or_else(|m| panic!("{}: {m}", imp.name()));
        eprintln!("{}: {r:?}", imp.name());
        assert!(r.shared_packs > 5 && r.padding_or_empty > 5, "{r:?}");
    }
}
