//! The registry: every implementation of every op family, as a value.
//!
//! An [`Entry`] holds an implementation's name, one line on what changed
//! against the f64 reference, its constructor, its precision, the
//! [`Judge`] its results are held to, a configuration for small cases and the
//! fuzz targets, and what it needs to run. `packshard eval` (`impl`),
//! `packshard bench`, the criterion benches, the equivalence suites
//! (`oracle/tests/registry_*.rs`), the fuzz targets ([`crate::fuzzing`]) and
//! the golden checks iterate these lists. Nothing else matches on an
//! implementation's name, and a name without an implementation cannot exist:
//! the constructor is part of the entry.
//!
//! **Adding a kernel** (see `docs/CONTRIBUTING.md`): implement the family's
//! trait of `packshard_reference::ops` in the kernel's own file, then add one
//! entry to the family's list below. The suites, the fuzz targets, `eval`,
//! `bench` and the golden checks then cover it.

use std::fmt;

use packshard_equivalence::causal::{CausalForm, CausalLmImpl, ReferenceCausalLm};
use packshard_equivalence::compare::{Judge, RelativeRule, Tolerance, F32_UNDERFLOW};
use packshard_equivalence::roundoffs_tolerance;
use packshard_optimized::ops::{
    CrossEntropyF32, DenseMaskedAttention, EncoderLayerF32, LinearCeFused, LinearCeMaterialized,
    LinearCeTiled, LinearCeTiledFiltered, ScalarAttention, TiledAttention,
};
use packshard_optimized::vocab::Chunks;

use crate::causal_lm::F32LayersCausalLm;
use packshard_reference::attention::ReferenceAttention;
use packshard_reference::bert::layer::ReferenceLayer;
pub use packshard_reference::ops::Precision;
use packshard_reference::ops::{
    AttentionOp, CrossEntropyOp, EmbeddingOp, EncoderLayerOp, LinearCrossEntropyOp,
};
use packshard_reference::vocab::{
    ReferenceCrossEntropy, ReferenceEmbedding, ReferenceLinearCrossEntropy,
};

/// Why an implementation cannot run here (no CUDA device, no C++ compiler):
/// one line, printed once by the suites as `skipped: ...`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unavailable(pub String);

impl fmt::Display for Unavailable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Unavailable {}

/// What an implementation needs beyond this crate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Needs {
    /// Runs everywhere.
    Nothing,
    /// A CUDA device and driver (feature `cuda`).
    CudaDevice,
    /// A C++ compiler to build the CPU emulator of the CUDA kernels (feature `cuda`).
    CxxCompiler,
}

impl Needs {
    /// Whether this run must have it, so that a suite fails instead of
    /// skipping: `PACKSHARD_REQUIRE_EMULATOR=1` for the C++ compiler (the CI
    /// step of the `cuda` feature sets it), `PACKSHARD_REQUIRE_GPU=1` for the
    /// device (`scripts/gpu_check.sh` sets it).
    pub fn required(self) -> bool {
        let set = |var: &str| std::env::var(var).is_ok_and(|v| v == "1");
        match self {
            Needs::CxxCompiler => set("PACKSHARD_REQUIRE_EMULATOR"),
            Needs::CudaDevice => set("PACKSHARD_REQUIRE_GPU"),
            Needs::Nothing => false,
        }
    }

    /// A short name for listings.
    pub fn name(self) -> &'static str {
        match self {
            Needs::Nothing => "-",
            Needs::CudaDevice => "CUDA device",
            Needs::CxxCompiler => "C++ compiler",
        }
    }
}

/// The constructor of an implementation of `K`.
pub type Make<K> = fn() -> Result<Box<K>, Unavailable>;

/// What a loop over the registry does with an entry here: the one
/// availability policy of every such loop (the registry tests of
/// `oracle/tests/registry/`, the fuzz targets of [`crate::fuzzing`],
/// `packshard bench`, `tests/eval_impl.rs`), decided by [`here`].
#[derive(Debug)]
pub enum Here<T> {
    /// It runs here.
    Runs(T),
    /// It cannot run here and this run does not require it: skipped, saying
    /// why (a test reports it as ignored).
    Skipped(Unavailable),
    /// It cannot run here although this run requires it: a failure. An entry
    /// that needs nothing is always required; one that needs a C++ compiler
    /// or a device is required under `PACKSHARD_REQUIRE_EMULATOR=1` or
    /// `PACKSHARD_REQUIRE_GPU=1` ([`Needs::required`]).
    Missing(Unavailable),
}

/// The availability policy: `made`, the result of constructing an entry that
/// needs `needs`, as what a loop does with it ([`Here`]).
pub fn here<T>(needs: Needs, made: Result<T, Unavailable>) -> Here<T> {
    match made {
        Ok(t) => Here::Runs(t),
        Err(u) if needs == Needs::Nothing || needs.required() => Here::Missing(u),
        Err(u) => Here::Skipped(u),
    }
}

impl<T> Here<T> {
    /// The implementation, `Ok(None)` when skipped, or the failure of a
    /// required entry (`"<name>: required here but cannot run: ..."`).
    ///
    /// # Errors
    /// [`Here::Missing`], as a message naming `name`.
    pub fn or_fail(self, name: &str) -> Result<Option<T>, String> {
        match self {
            Here::Runs(t) => Ok(Some(t)),
            Here::Skipped(_) => Ok(None),
            Here::Missing(u) => Err(format!("{name}: required here but cannot run: {u}")),
        }
    }
}

/// One implementation of the op family `K` (a trait object type such as
/// `dyn AttentionOp`).
pub struct Entry<K: ?Sized + 'static> {
    /// Its name: `impl` in `packshard eval`, the row in `packshard bench`.
    pub name: &'static str,
    /// One line on what changed against the f64 reference (or the entry it
    /// speeds up).
    pub changed: &'static str,
    /// What it computes in.
    pub precision: Precision,
    /// How the suites judge its results against the f64 reference.
    pub judge: Judge,
    /// How a single fuzz case is judged.
    pub fuzz_judge: Judge,
    /// What it needs to run.
    pub needs: Needs,
    make: Make<K>,
    small: Option<Make<K>>,
}

impl<K: ?Sized + 'static> Entry<K> {
    /// An entry outside this registry's lists (a test's planted kernel, an
    /// out-of-tree harness), with no separate small configuration; the
    /// fields as documented on [`Entry`].
    pub fn new(
        name: &'static str,
        changed: &'static str,
        precision: Precision,
        (judge, fuzz_judge): (Judge, Judge),
        needs: Needs,
        make: Make<K>,
    ) -> Self {
        Entry {
            name,
            changed,
            precision,
            judge,
            fuzz_judge,
            needs,
            make,
            small: None,
        }
    }

    /// [`Entry::make`] under the availability policy ([`here`]).
    pub fn here(&self) -> Here<Box<K>> {
        here(self.needs, self.make())
    }

    /// [`Entry::make_small`] under the availability policy ([`here`]).
    pub fn here_small(&self) -> Here<Box<K>> {
        here(self.needs, self.make_small())
    }

    /// The implementation as registered.
    ///
    /// # Errors
    /// [`Unavailable`] when what it needs is missing here.
    pub fn make(&self) -> Result<Box<K>, Unavailable> {
        (self.make)()
    }

    /// The configuration the suites' and fuzz targets' small cases run: tiles
    /// small enough that cases of a few dozen tokens cross their edges (the
    /// registered configuration when the kernel has no tiles to shrink).
    ///
    /// # Errors
    /// As [`Entry::make`].
    pub fn make_small(&self) -> Result<Box<K>, Unavailable> {
        self.small.unwrap_or(self.make)()
    }

    /// The f64 reference of a family (named [`REFERENCE`]): judged as an f64
    /// rewrite, needs nothing, no separate small configuration.
    fn reference(changed: &'static str, make: Make<K>) -> Self {
        Entry {
            name: REFERENCE,
            changed,
            precision: Precision::F64,
            judge: F64,
            fuzz_judge: F64,
            needs: Needs::Nothing,
            make,
            small: None,
        }
    }

    /// An f32 kernel that needs nothing, judged by the f32 relative rule in
    /// every form ([`F32_FORMS`], a fuzz case [`F32_FUZZ`]).
    fn f32_relative(
        name: &'static str,
        changed: &'static str,
        make: Make<K>,
        small: Option<Make<K>>,
    ) -> Self {
        Entry {
            name,
            changed,
            precision: Precision::F32,
            judge: F32_FORMS,
            fuzz_judge: F32_FUZZ,
            needs: Needs::Nothing,
            make,
            small,
        }
    }

    /// Whether it has a separate small configuration.
    pub fn has_small(&self) -> bool {
        self.small.is_some()
    }
}

impl<K: ?Sized> Clone for Entry<K> {
    fn clone(&self) -> Self {
        Entry { ..*self }
    }
}

impl<K: ?Sized> fmt::Debug for Entry<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Entry")
            .field("name", &self.name)
            .field("precision", &self.precision)
            .field("needs", &self.needs)
            .finish()
    }
}

/// The op families.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Family {
    /// [`AttentionOp`]: eval op `attention`.
    Attention,
    /// [`CrossEntropyOp`]: eval op `cross_entropy`.
    CrossEntropy,
    /// [`LinearCrossEntropyOp`]: eval op `linear_cross_entropy`.
    LinearCrossEntropy,
    /// [`EmbeddingOp`]: eval op `embedding`.
    Embedding,
    /// [`EncoderLayerOp`]: no eval op (the suites and `packshard bench` run it).
    EncoderLayer,
    /// [`CausalLmImpl`]: a decoder's causal-LM training step on a packed or
    /// padded batch; no eval op (the causal-LM suite runs it).
    CausalLm,
}

impl Family {
    /// Every family.
    pub const ALL: [Family; 6] = [
        Family::Attention,
        Family::CrossEntropy,
        Family::LinearCrossEntropy,
        Family::Embedding,
        Family::EncoderLayer,
        Family::CausalLm,
    ];

    /// Its name (the `packshard eval` op where it has one).
    pub fn name(self) -> &'static str {
        match self {
            Family::Attention => "attention",
            Family::CrossEntropy => "cross_entropy",
            Family::LinearCrossEntropy => "linear_cross_entropy",
            Family::Embedding => "embedding",
            Family::EncoderLayer => "encoder_layer",
            Family::CausalLm => "causal_lm",
        }
    }

    /// The `packshard eval` op whose `impl` takes this family's entries.
    pub fn eval_op(self) -> Option<&'static str> {
        match self {
            Family::EncoderLayer | Family::CausalLm => None,
            other => Some(other.name()),
        }
    }
}

/// An entry's description without its constructor (for listings).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Info {
    /// Its family.
    pub family: Family,
    /// Its name.
    pub name: &'static str,
    /// One line on what changed.
    pub changed: &'static str,
    /// What it computes in.
    pub precision: Precision,
    /// What it needs.
    pub needs: Needs,
}

fn info<K: ?Sized>(family: Family, list: &[Entry<K>]) -> Vec<Info> {
    list.iter()
        .map(|e| Info {
            family,
            name: e.name,
            changed: e.changed,
            precision: e.precision,
            needs: e.needs,
        })
        .collect()
}

/// Every entry of every family, families in [`Family::ALL`] order.
pub fn all() -> Vec<Info> {
    let mut out = Vec::new();
    for f in Family::ALL {
        out.extend(of(f));
    }
    out
}

/// The entries of `family`.
pub fn of(family: Family) -> Vec<Info> {
    match family {
        Family::Attention => info(family, &attention()),
        Family::CrossEntropy => info(family, &cross_entropy()),
        Family::LinearCrossEntropy => info(family, &linear_cross_entropy()),
        Family::Embedding => info(family, &embedding()),
        Family::EncoderLayer => info(family, &encoder_layer()),
        Family::CausalLm => info(family, &causal_lm()),
    }
}

/// The entry called `name` in `list`.
pub fn find<'a, K: ?Sized>(list: &'a [Entry<K>], name: &str) -> Option<&'a Entry<K>> {
    list.iter().find(|e| e.name == name)
}

/// The name of the f64 reference entry of every family.
pub const REFERENCE: &str = "reference";

/// f64 rewrites of the reference: 64 ulp of the magnitude of the terms
/// ([`Tolerance::F64_REWRITE`]).
const F64: Judge = Judge::Rewrite(Tolerance::F64_REWRITE);

/// f32 kernels that are bitwise packed == padded: [`RelativeRule::F32`]
/// against the reference run in f32.
const F32_EXACT_FORMS: Judge = Judge::Relative {
    rule: RelativeRule::F32,
    inputs: Precision::F32,
    packed: Tolerance::EXACT,
};

/// f32 kernels whose two forms round differently (other tiles or orders):
/// packed == padded within 64 ulp of f32 of the terms.
const F32_FORMS: Judge = Judge::Relative {
    rule: RelativeRule::F32,
    inputs: Precision::F32,
    packed: Tolerance::F32_REWRITE,
};

/// Single adversarial cases of f32 kernels: [`RelativeRule::F32_FUZZ`].
const F32_FUZZ: Judge = Judge::Relative {
    rule: RelativeRule::F32_FUZZ,
    inputs: Precision::F32,
    packed: Tolerance::F32_REWRITE,
};

/// The fused kernel's tiles for small cases: 3 tokens x 5 entries, so cases
/// of `v <= 64` cross tile edges in both directions.
pub const SMALL_CHUNKS: Chunks = Chunks {
    tokens: 3,
    vocab: 5,
};

/// [`Entry::f32_relative`] for a linear cross-entropy kernel `$kernel` that
/// works in tiles (a `chunks` field): registered with its default tiles, and
/// on [`SMALL_CHUNKS`] (its other fields at their defaults) for small cases.
macro_rules! tiled_entry {
    ($kernel:ident, $name:literal, $changed:literal $(,)?) => {
        Entry::f32_relative(
            $name,
            $changed,
            || Ok(Box::new($kernel::default())),
            Some(|| {
                // Most tiled kernels have no field but `chunks`.
                #[allow(clippy::needless_update)]
                let small = $kernel {
                    chunks: SMALL_CHUNKS,
                    ..$kernel::default()
                };
                Ok(Box::new(small))
            }),
        )
    };
}

/// Every [`AttentionOp`].
pub fn attention() -> Vec<Entry<dyn AttentionOp>> {
    #[allow(unused_mut)]
    let mut list: Vec<Entry<dyn AttentionOp>> = vec![
        Entry::reference(
            "the f64 reference: plain loops over allowed keys, GQA, cu_seqlens_q/cu_seqlens_k, bottom-right causal",
            || Ok(Box::new(ReferenceAttention)),
        ),
        Entry {
            name: "attention_varlen_tiled",
            changed: "f32; online softmax per 64 x 64 (query, key) tile of each cu_seqlens segment, pulp SIMD, rayon over (segment, head); saves lse, never builds the mask; causal, GQA and cu_seqlens_k != cu_seqlens_q (bottom-right); window_size (skipping the key tiles outside every window of a query block), softcap, alibi_slopes, seqused_k",
            precision: Precision::F32,
            judge: F32_EXACT_FORMS,
            fuzz_judge: Judge::Rewrite(Tolerance::F32_REWRITE),
            needs: Needs::Nothing,
            make: || Ok(Box::new(TiledAttention::F32)),
            small: None,
        },
        Entry {
            name: "attention_varlen_tiled_bf16",
            changed: "attention_varlen_tiled reading bf16 q, k, v (f32 accumulation)",
            precision: Precision::Bf16,
            judge: Judge::Relative {
                rule: RelativeRule::F32,
                inputs: Precision::Bf16,
                packed: Tolerance::EXACT,
            },
            // bf16 inputs: their rounding (at most u = 2^-8 relative, bf16's
            // unit roundoff) dominates; 16 u (8 ulp of bf16) times the
            // magnitude of the terms.
            // The value is the right one (the fuzz regressions were judged by
            // it); the old label's "16 ulp" took 2^-8 for bf16's ulp (issue 31).
            // bf16 has f32's exponent range: the same underflow floor.
            fuzz_judge: Judge::Rewrite(
                roundoffs_tolerance!("bf16 inputs", 16, Bf16).with_underflow(F32_UNDERFLOW),
            ),
            needs: Needs::Nothing,
            make: || Ok(Box::new(TiledAttention::BF16)),
            small: None,
        },
        Entry {
            name: "attention_dense_masked",
            changed: "the same tiles over whole rows with a [len, len] boolean mask: every score is computed (the padded / block-diagonal-mask baseline); GQA, self-attention only; window_size and seqused_k in the mask, softcap and ALiBi on the scores",
            precision: Precision::F32,
            judge: F32_FORMS,
            fuzz_judge: Judge::Rewrite(Tolerance::F32_REWRITE),
            needs: Needs::Nothing,
            make: || Ok(Box::new(DenseMaskedAttention)),
            small: None,
        },
        Entry {
            name: "attention_varlen_scalar",
            changed: "the slow twin of attention_varlen_tiled: f32, plain loops, no SIMD, threads or tiles; the textbook softmax per query; causal, GQA, cross",
            precision: Precision::F32,
            judge: F32_EXACT_FORMS,
            fuzz_judge: Judge::Rewrite(Tolerance::F32_REWRITE),
            needs: Needs::Nothing,
            make: || Ok(Box::new(ScalarAttention)),
            small: None,
        },
    ];
    #[cfg(feature = "cuda")]
    list.extend(cuda::attention());
    list
}

/// The CUDA kernels (feature `cuda`): on a device, and the same source on
/// the CPU emulator. The attention kernels are judged as
/// `attention_varlen_tiled`: the f32 relative rule against the f64
/// reference, packed == padded bit for bit (a sequence's blocks start at its
/// own first token in both forms); the output layer as `linear_ce_fused`.
#[cfg(feature = "cuda")]
mod cuda {
    use packshard_optimized::cuda::ops::{CudaAttention, CudaLinearCrossEntropy};
    use packshard_optimized::cuda::CudaError;

    use super::*;

    fn unavailable(e: CudaError) -> Unavailable {
        Unavailable(e.to_string())
    }

    pub(super) fn attention() -> [Entry<dyn AttentionOp>; 2] {
        [
            Entry {
                name: "attention_varlen_cuda",
                changed: "f32 CUDA kernels compiled by NVRTC at run time: a thread per query, online softmax over 32-key shared-memory tiles, saves lse; backward in three launches without atomics; no causal, GQA or cross attention, d <= 128",
                precision: Precision::F32,
                judge: F32_EXACT_FORMS,
                fuzz_judge: Judge::Rewrite(Tolerance::F32_REWRITE),
                needs: Needs::CudaDevice,
                make: || Ok(Box::new(CudaAttention::gpu().map_err(unavailable)?)),
                small: None,
            },
            Entry {
                name: "attention_varlen_cuda_emulated",
                changed: "attention_varlen_cuda's source built by the host C++ compiler and run on the CPU (a thread per CUDA thread, a barrier for __syncthreads): the kernels' logic without a GPU",
                precision: Precision::F32,
                judge: F32_EXACT_FORMS,
                fuzz_judge: Judge::Rewrite(Tolerance::F32_REWRITE),
                needs: Needs::CxxCompiler,
                make: || Ok(Box::new(CudaAttention::emulated().map_err(unavailable)?)),
                small: None,
            },
        ]
    }

    pub(super) fn linear_cross_entropy() -> [Entry<dyn LinearCrossEntropyOp>; 2] {
        [
            Entry {
                name: "linear_cross_entropy_cuda",
                changed: "f32 CUDA kernels compiled by NVRTC at run time: alg2's S pass (a block per token: local max, s - 1, gap, target logit; partials D_i, B_i) and T pass (dW per 32 rows), logits recomputed, never stored; merge in f64 on the host; alg2 only (unsharded = one shard)",
                precision: Precision::F32,
                judge: F32_FORMS,
                fuzz_judge: F32_FUZZ,
                needs: Needs::CudaDevice,
                make: || Ok(Box::new(CudaLinearCrossEntropy::gpu().map_err(unavailable)?)),
                small: None,
            },
            Entry {
                name: "linear_cross_entropy_cuda_emulated",
                changed: "linear_cross_entropy_cuda's source built by the host C++ compiler and run on the CPU (a thread per CUDA thread, a barrier for __syncthreads): the kernels' logic without a GPU",
                precision: Precision::F32,
                judge: F32_FORMS,
                fuzz_judge: F32_FUZZ,
                needs: Needs::CxxCompiler,
                make: || Ok(Box::new(CudaLinearCrossEntropy::emulated().map_err(unavailable)?)),
                small: None,
            },
        ]
    }
}

/// Every [`CrossEntropyOp`].
pub fn cross_entropy() -> Vec<Entry<dyn CrossEntropyOp>> {
    vec![
        Entry::reference(
            "the f64 reference: compensated sums over the vocabulary; naive, alg1, alg2 on in-process ranks",
            || Ok(Box::new(ReferenceCrossEntropy)),
        ),
        Entry::f32_relative(
            "cross_entropy_f32",
            "f32 SIMD row pass over the logits, tile statistics merged in f64; sharded: alg2 per rank with the reference's collective",
            || Ok(Box::new(CrossEntropyF32)),
            None,
        ),
    ]
}

/// Every [`LinearCrossEntropyOp`].
pub fn linear_cross_entropy() -> Vec<Entry<dyn LinearCrossEntropyOp>> {
    #[allow(unused_mut)]
    let mut list: Vec<Entry<dyn LinearCrossEntropyOp>> = vec![
        Entry::reference(
            "the f64 reference: [n, v] logits, then the cross-entropy; naive, alg1, alg2 on in-process ranks",
            || Ok(Box::new(ReferenceLinearCrossEntropy)),
        ),
        Entry::f32_relative(
            "linear_ce_materialized",
            "f32; one gemm to the whole [n, v] logits, the SIMD row pass, two gemms for the gradients (the baseline of the fused kernel)",
            || Ok(Box::new(LinearCeMaterialized)),
            None,
        ),
        tiled_entry!(
            LinearCeFused,
            "linear_ce_fused",
            "f32; chunks of 256 tokens x 4096 entries: logits, statistics and gradient per tile while in cache, holds [256, v] not [n, v]; sharded: alg2 S and T passes, logits recomputed",
        ),
        tiled_entry!(
            LinearCeTiled,
            "linear_ce_tiled",
            "f32; tiles of 1024 tokens x 512 entries: pass 1 row statistics, pass 2 gradients from recomputed logits (4 products), holds one tile, never a row of v; sharded: alg2 as linear_ce_fused",
        ),
        tiled_entry!(
            LinearCeTiledFiltered,
            "linear_ce_tiled_filtered",
            "linear_ce_tiled with Cut Cross-Entropy's gradient filtering: a tile of dL/dz whose entries off the targets are all at most 2^-12 x the row's weight skips its two products (its target entries applied one row each); trades gradient error for time and reports a bound on it (judged within rounding plus that bound); unsharded only",
        ),
    ];
    #[cfg(feature = "cuda")]
    list.extend(cuda::linear_cross_entropy());
    list
}

/// Every [`EmbeddingOp`].
pub fn embedding() -> Vec<Entry<dyn EmbeddingOp>> {
    vec![Entry {
        name: REFERENCE,
        changed: "the f64 reference: a lookup, and the sharded lookup masked per shard (exact in any precision)",
        precision: Precision::F64,
        judge: Judge::Rewrite(Tolerance::EXACT),
        fuzz_judge: Judge::Rewrite(Tolerance::EXACT),
        needs: Needs::Nothing,
        make: || Ok(Box::new(ReferenceEmbedding)),
        small: None,
    }]
}

/// Every [`EncoderLayerOp`].
pub fn encoder_layer() -> Vec<Entry<dyn EncoderLayerOp>> {
    vec![
        Entry::reference(
            "the f64 reference BERT layer (post-LayerNorm, exact erf GELU) with the reference attention",
            || Ok(Box::new(ReferenceLayer(ReferenceAttention))),
        ),
        Entry::f32_relative(
            "encoder_layer",
            "f32 BERT layer: matmuls through gemm, SIMD LayerNorm and GELU, varlen attention on packed rows (dense masked on padded ones)",
            || Ok(Box::new(EncoderLayerF32)),
            None,
        ),
    ]
}

/// Every [`CausalLmImpl`]: a decoder's training step on a causal-LM batch
/// (labels, weights, boundaries and positions derived by the implementation).
pub fn causal_lm() -> Vec<Entry<dyn CausalLmImpl>> {
    vec![
        Entry {
            name: REFERENCE,
            changed: "the f64 reference decoder (RMSNorm/LayerNorm, RoPE, GQA, SwiGLU/GELU) with the reference attention, one causal varlen call over the documents",
            precision: Precision::F64,
            judge: F64,
            fuzz_judge: F64,
            needs: Needs::Nothing,
            make: || Ok(Box::new(ReferenceCausalLm {
                attention: &ReferenceAttention,
                form: CausalForm::Varlen,
            })),
            small: None,
        },
        Entry {
            name: "causal_lm_f32_attention",
            changed: "the reference decoder with attention_varlen_tiled (f32, causal GQA varlen): judged against the same pipeline with the baseline's f32 attention",
            precision: Precision::F32,
            judge: Judge::Relative {
                rule: RelativeRule::F32,
                inputs: Precision::F64,
                packed: Tolerance::F32_REWRITE,
            },
            fuzz_judge: Judge::Rewrite(Tolerance::F32_REWRITE),
            needs: Needs::Nothing,
            make: || Ok(Box::new(ReferenceCausalLm {
                attention: &TiledAttention::F32,
                form: CausalForm::Varlen,
            })),
            small: None,
        },
        Entry {
            name: "causal_lm_f32_layers",
            changed: "every decoder layer in f32 (gemm projections, RMSNorm, RoPE, tiled causal GQA attention, SwiGLU); embedding, final norm, head and loss as the reference; Llama configs only",
            precision: Precision::F32,
            judge: Judge::Rewrite(Tolerance::F32_REWRITE),
            fuzz_judge: Judge::Rewrite(Tolerance::F32_REWRITE),
            needs: Needs::Nothing,
            make: || Ok(Box::new(F32LayersCausalLm)),
            small: None,
        },
    ]
}
