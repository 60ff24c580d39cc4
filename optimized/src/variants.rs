//! The one list of optimized variants: a name and one line on what changed
//! against the f64 reference (or against the variant it speeds up). The
//! tests (`optimized/tests/*.rs`), the criterion benches, `packshard bench`
//! and `packshard eval` (`impl`) all loop over [`VARIANTS`]; a test fails
//! when a variant has no suite.

/// What a variant computes (and which `packshard eval` op runs it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kernel {
    /// Varlen attention over `cu_seqlens` (eval op `attention`).
    Attention,
    /// Cross-entropy of given logits (eval op `cross_entropy`).
    CrossEntropy,
    /// Output layer plus cross-entropy (eval op `linear_cross_entropy`).
    LinearCrossEntropy,
    /// The BERT encoder layer, forward and backward (no eval op: the
    /// equivalence suite and `packshard bench` run it).
    EncoderLayer,
}

impl Kernel {
    /// The `packshard eval` op that accepts the variants of this kernel as
    /// `impl`, if any.
    pub fn eval_op(self) -> Option<&'static str> {
        match self {
            Kernel::Attention => Some("attention"),
            Kernel::CrossEntropy => Some("cross_entropy"),
            Kernel::LinearCrossEntropy => Some("linear_cross_entropy"),
            Kernel::EncoderLayer => None,
        }
    }
}

/// One optimized variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Variant {
    /// Its name (`impl` in `packshard eval`).
    pub name: &'static str,
    /// What it computes.
    pub kernel: Kernel,
    /// One line on what changed.
    pub changed: &'static str,
}

/// Every optimized variant, in the order reports print them.
pub const VARIANTS: &[Variant] = &[
    Variant {
        name: "attention_varlen_tiled",
        kernel: Kernel::Attention,
        changed: "f32; online softmax per 64 x 64 (query, key) tile of each cu_seqlens segment, pulp SIMD, rayon over (segment, head); saves lse, never builds the mask",
    },
    Variant {
        name: "attention_varlen_tiled_bf16",
        kernel: Kernel::Attention,
        changed: "attention_varlen_tiled reading bf16 q, k, v (f32 accumulation)",
    },
    Variant {
        name: "attention_dense_masked",
        kernel: Kernel::Attention,
        changed: "the same tiles over whole rows with a [len, len] boolean mask: every score is computed (the padded / block-diagonal-mask baseline)",
    },
    Variant {
        name: "cross_entropy_f32",
        kernel: Kernel::CrossEntropy,
        changed: "f32 SIMD row pass over the logits, tile statistics merged in f64; sharded: alg2 per rank with the reference's collective",
    },
    Variant {
        name: "linear_ce_materialized",
        kernel: Kernel::LinearCrossEntropy,
        changed: "f32; one gemm to the whole [n, v] logits, the SIMD row pass, two gemms for the gradients (the baseline of the fused kernel)",
    },
    Variant {
        name: "linear_ce_fused",
        kernel: Kernel::LinearCrossEntropy,
        changed: "f32; chunks of 256 tokens x 4096 entries: logits, statistics and gradient per tile while in cache, holds [256, v] not [n, v]; sharded: alg2 S and T passes, logits recomputed",
    },
    Variant {
        name: "encoder_layer",
        kernel: Kernel::EncoderLayer,
        changed: "f32 BERT layer: matmuls through gemm, SIMD LayerNorm and GELU, varlen attention on packed rows (dense masked on padded ones)",
    },
];

/// The variant called `name`.
pub fn find(name: &str) -> Option<&'static Variant> {
    VARIANTS.iter().find(|v| v.name == name)
}

/// The variants of `kernel`, in list order.
pub fn of(kernel: Kernel) -> impl Iterator<Item = &'static Variant> {
    VARIANTS.iter().filter(move |v| v.kernel == kernel)
}

/// The names `packshard eval` accepts as `impl` for `op` (besides
/// `reference`).
pub fn eval_impls(op: &str) -> Vec<&'static str> {
    VARIANTS
        .iter()
        .filter(|v| v.kernel.eval_op() == Some(op))
        .map(|v| v.name)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_lines_short() {
        for (i, a) in VARIANTS.iter().enumerate() {
            assert!(VARIANTS[i + 1..].iter().all(|b| b.name != a.name), "{a:?}");
            assert!(!a.changed.is_empty() && a.changed.len() < 200, "{a:?}");
            assert_eq!(find(a.name), Some(a));
        }
        assert_eq!(
            eval_impls("linear_cross_entropy"),
            ["linear_ce_materialized", "linear_ce_fused"]
        );
        assert!(eval_impls("pack").is_empty());
    }
}
