//! The causal-LM suite under the f32 relative judge: the reference decoder
//! pipeline with the optimized f32 attention kernels (causal, grouped-query,
//! varlen) passes — packed == padded within 64 ulp of f32, and against the
//! f64 truth within the rule of the same pipeline with the baseline's f32
//! attention (`CausalLmImpl::baseline32`); the same pipeline with a kernel
//! that attends across documents is caught under the same judge.

use ndarray::ArrayView3;
use packshard_equivalence::causal::{run_causal_suite, CausalForm, ReferenceCausalLm};
use packshard_equivalence::planted::{AttentionHooks, Planted, Qkv};
use packshard_equivalence::{Judge, RelativeRule, Tolerance};
use packshard_optimized::ops::{ScalarAttention, TiledAttention};
use packshard_reference::attention::{AttentionGrads, AttentionOutput};
use packshard_reference::ops::{AttentionOp, AttentionSupport, Precision, Varlen};
use packshard_reference::Result;

/// The f32 attention inside the f64 decoder: f64 inputs (the pipeline
/// rounds at the kernel's boundary), packed == padded within 64 ulp of f32.
const JUDGE: Judge = Judge::Relative {
    rule: RelativeRule::F32,
    inputs: Precision::F64,
    packed: Tolerance::F32_REWRITE,
};

#[test]
fn the_decoder_with_the_f32_attention_passes_under_the_f32_rule() {
    for (name, op) in [
        (
            "attention_varlen_tiled",
            &TiledAttention::F32 as &dyn AttentionOp,
        ),
        ("attention_varlen_scalar", &ScalarAttention),
    ] {
        let imp = ReferenceCausalLm {
            attention: op,
            form: CausalForm::Varlen,
        };
        let r = run_causal_suite(&imp, JUDGE, 32).unwrap_or_else(|m| panic!("{name}: {m}"));
        eprintln!(
            "{name} in the decoder: {} cases, {} tensors against the truth, max {:.3} x / mean {:.3} x the baseline's error; packed vs padded grads max rel {:.2e}",
            r.cases,
            r.relative.count,
            r.relative.max_ratio(),
            r.relative.mean_ratio(),
            r.grads.max_rel
        );
        assert!(r.relative.count > 1_000, "{r:?}");
        assert!(r.shared_rows > 10 && r.continuations > 5, "{r:?}");
    }
}

/// The tiled kernel over one segment per call: documents packed together
/// attend to each other (docs/FAULTS.md P2 in a causal LM).
struct AcrossDocuments;

fn whole(p: &Varlen<'_>) -> (Vec<usize>, Vec<usize>) {
    let last = |cu: &[usize]| vec![0, *cu.last().unwrap_or(&0)];
    (last(p.cu_seqlens_q), last(p.cu_seqlens_k))
}

impl AttentionHooks for AcrossDocuments {
    fn support(&self) -> AttentionSupport {
        AttentionSupport::ALL
    }
    fn varlen_forward(&self, x: Qkv<'_>, p: &Varlen<'_>) -> Result<AttentionOutput> {
        let (cq, ck) = whole(p);
        x.varlen_forward(
            &TiledAttention::F32,
            &Varlen::cross(&cq, &ck, p.causal, p.scale),
        )
    }
    fn varlen_backward(
        &self,
        x: Qkv<'_>,
        p: &Varlen<'_>,
        fwd: &AttentionOutput,
        g: ArrayView3<f64>,
    ) -> Result<AttentionGrads> {
        let (cq, ck) = whole(p);
        let p1 = Varlen::cross(&cq, &ck, p.causal, p.scale);
        x.varlen_backward(&TiledAttention::F32, &p1, fwd, g)
    }
}

#[test]
fn attention_across_documents_is_caught_under_the_f32_rule() {
    let leaky = Planted(AcrossDocuments);
    let imp = ReferenceCausalLm {
        attention: &leaky,
        form: CausalForm::Varlen,
    };
    // Both forms run one varlen call over the batch's real tokens, so the
    // padded batch leaks too: it is the truth (the documents run apart) that
    // sees it, under the rule, from the second document on (causal: the
    // first sees only itself).
    let m = run_causal_suite(&imp, JUDGE, 8).unwrap_err().to_string();
    assert!(m.contains("truth vs padded: document 1: logits"), "{m}");
    assert!(m.contains("x the baseline's"), "{m}");
}
