//! Causal-LM packing: packed == unpacked (one document per padded row) for
//! a decoder's logits, its next-token loss under each reduction and every
//! parameter gradient (issue #15; docs/FAULTS.md C1–C7, P7).
//!
//! A [`CausalLmImpl`] trains a [`DecoderModel`] on a [`CausalBatch`] as a
//! collator hands it over: rows of `row_len` slots with `input_ids`,
//! `position_ids` and document ids (0 = padding; padding may sit between
//! documents), and an optional EOS target. It derives labels, boundaries,
//! positions and loss weights itself — which is where the C faults live —
//! and returns per-slot logits, the loss and the parameter gradients.
//! [`check_causal`] runs the padded batch (each document alone in a row) and
//! the packed one (first-fit rows, optional padding before a document) and
//! requires, for every document:
//!
//! - **packed == padded**: each document's logits, the loss, every
//!   parameter gradient, within `judge.packed()`;
//! - **padded == truth**: the same against the f64 reference decoder run by
//!   this suite on the documents themselves (labels, weights and positions
//!   written out here, not taken from the implementation), under a
//!   [`Judge::Rewrite`]'s tolerance ([`Tolerance::F64_REWRITE`] for an f64
//!   rewrite) — so a fault both forms share (positions
//!   restarted in a continuation chunk, C6) is seen too. Under a
//!   [`Judge::Relative`] (an implementation computing in f32) each tensor's
//!   error against the truth is held to the rule against the error of the
//!   same computation in the baseline's f32 ([`CausalLmImpl::baseline32`]),
//!   as the attention and layer suites hold their f32 kernels.
//!
//! [`check_chunk`] is the continuation property (C5, C6): a document's tail
//! run by the implementation as a chunk over its cached keys and values
//! (`cu_seqlens_q != cu_seqlens_k`, bottom-right aligned, positions
//! continuing) gives the logits of the whole document's tail — the only
//! place a continuation's positions show, since rotary attention sees
//! relative positions only. [`check_bottom_right`] is the same alignment on
//! one [`AttentionOp`], with a segment of more queries than keys (top rows
//! 0).
//!
//! Tolerances: both sides do the same f64 operations per token; only sums
//! over tokens (parameter gradients, the loss) and matrix products over other
//! row counts change order, moving results by a few ulp of their largest
//! term: [`Tolerance::F64_REWRITE`] (64 ulp of the tensor's scale; parameter
//! gradients scaled by the largest gradient, as the BERT suite does). Every
//! planted fault moves a value by 1e-3 of its scale or more.

use ndarray::Array2;
use packshard_reference::attention::ReferenceAttention;
use packshard_reference::decoder::{
    loss_weights, next_token_labels, varlen_from_doc_ids, CausalReduction, DecoderAttention,
    DecoderConfig, DecoderInput, DecoderModel, DecoderParams, KvCache, Mlp, Norm,
};
use packshard_reference::ops::{AttentionOp, Qkv, Varlen};
use packshard_reference::vocab::IGNORE_INDEX;
use packshard_reference::Error;
use proptest::prelude::*;
use rand::{Rng, SeedableRng};

pub use crate::attention::Observed;
use crate::attention::IMPL;
use crate::compare::{
    assert_within_k, Allowance, Judge, Mismatch, RelativeRule, RelativeTotals, Tolerance,
};

/// One batch as a collator hands it over: `rows * row_len` slots.
#[derive(Debug, Clone, PartialEq)]
pub struct CausalBatch {
    /// Slots per row.
    pub row_len: usize,
    /// `[n_slots]` token ids (padding slots hold the pad id, 0).
    pub input_ids: Vec<i64>,
    /// `[n_slots]` positions (each document's own: from its offset; 0 on padding).
    pub position_ids: Vec<usize>,
    /// `[n_slots]` document ids: document `d` of the case is `d + 1`, padding 0.
    pub doc_ids: Vec<usize>,
    /// The target of each document's last token, if any (else `-100`).
    pub eos: Option<i64>,
    /// The batch's documents (empty ones included).
    pub num_documents: usize,
}

impl CausalBatch {
    /// Rows of the batch.
    pub fn rows(&self) -> usize {
        self.input_ids.len().checked_div(self.row_len).unwrap_or(0)
    }
}

/// What an implementation returns for one batch.
#[derive(Debug, Clone, PartialEq)]
pub struct CausalRun {
    /// `[n_slots, v]` (padding rows are not read).
    pub logits: Array2<f64>,
    /// The reduced loss.
    pub loss: f64,
    /// Every parameter's gradient.
    pub grads: DecoderParams,
}

/// A causal-LM training step on a packed or padded batch.
pub trait CausalLmImpl {
    /// A short name for reports.
    fn name(&self) -> String;
    /// Forward, loss under `reduction`, backward.
    ///
    /// # Errors
    /// Input errors.
    fn run(
        &self,
        model: &DecoderModel,
        batch: &CausalBatch,
        reduction: CausalReduction,
    ) -> Result<CausalRun, Error>;
    /// The logits `[n_slots, v]` of a continuation chunk: `batch` holds each
    /// document's next tokens at their own positions (continuing, C6);
    /// `past` the keys and values of their earlier tokens, segment `s` for
    /// the batch's `s`-th document in slot order (C5: `cu_seqlens_k` =
    /// cached + new per segment, bottom-right aligned).
    ///
    /// # Errors
    /// Input errors.
    fn chunk_logits(
        &self,
        model: &DecoderModel,
        batch: &CausalBatch,
        past: &KvCache,
    ) -> Result<Array2<f64>, Error>;
    /// The yardstick of a [`Judge::Relative`]: the same computation with
    /// the baseline's f32 arithmetic where this implementation computes in
    /// f32 or bf16 ([`crate::baseline32`]); `None` (the default) for an f64
    /// rewrite, which the suite then judges under [`Judge::Rewrite`] only.
    fn baseline32(&self) -> Option<Box<dyn CausalLmImpl + '_>> {
        None
    }
    /// Whether it implements `config` (the suite's random cases skip the
    /// others; its fixed cases are Llama-shaped). None by default (the safe
    /// minimum, as [`packshard_reference::ops::AttentionOp::support`]'s):
    /// every implementation declares the configs it runs.
    fn supports(&self, config: &DecoderConfig) -> bool {
        let _ = config;
        false
    }
}

/// How the reference implementation attends on a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CausalForm {
    /// Padding removed, one causal varlen call over `cu_seqlens` of the
    /// document ids (flash-attention's `flash_attn_varlen_func`).
    Varlen,
    /// The slot grid with a block-diagonal causal mask per row
    /// (FlexAttention's document mask).
    BlockCausal,
}

/// The tokens one varlen call runs, taken out of a [`CausalBatch`]'s slot
/// grid: their slots (`[n_tok]`, in order), the boundaries `cu_seqlens` of
/// their documents and their position ids (`[n_tok]`).
#[derive(Debug, Clone, PartialEq)]
pub struct VarlenTokens {
    /// The slot of each token.
    pub slots: Vec<usize>,
    /// `[num_documents + 1]`, over the tokens.
    pub cu_seqlens: Vec<usize>,
    /// Each token's position id.
    pub positions: Vec<usize>,
}

impl VarlenTokens {
    /// The batch's real tokens, documents by [`varlen_from_doc_ids`], at
    /// the batch's positions.
    ///
    /// # Errors
    /// As [`varlen_from_doc_ids`].
    pub fn of(batch: &CausalBatch) -> Result<Self, Error> {
        let (slots, cu_seqlens) = varlen_from_doc_ids(&batch.doc_ids)?;
        Ok(Self::new(batch, slots, cu_seqlens))
    }

    /// The tokens at `slots` with documents `cu_seqlens`, at the batch's positions.
    pub fn new(batch: &CausalBatch, slots: Vec<usize>, cu_seqlens: Vec<usize>) -> Self {
        let positions = slots.iter().map(|&s| batch.position_ids[s]).collect();
        VarlenTokens {
            slots,
            cu_seqlens,
            positions,
        }
    }

    /// `per_slot` (one value per slot of the batch) at the tokens' slots.
    pub fn gather<T: Copy>(&self, per_slot: &[T]) -> Vec<T> {
        self.slots.iter().map(|&s| per_slot[s]).collect()
    }

    /// Runs `model`'s forward with `attention` over these tokens (after the
    /// key/value cache `past` when given), and `f` on its input.
    fn with_input<R>(
        &self,
        batch: &CausalBatch,
        past: Option<&KvCache>,
        f: impl FnOnce(&DecoderInput<'_>) -> Result<R, Error>,
    ) -> Result<R, Error> {
        let ids = self.gather(&batch.input_ids);
        let att = DecoderAttention::Varlen {
            cu_seqlens: self.cu_seqlens.clone(),
        };
        f(&DecoderInput {
            input_ids: &ids,
            position_ids: &self.positions,
            attention: &att,
            past,
        })
    }
}

/// Runs `model` on `tokens` (varlen) and scatters the logits back to
/// `[n_slots, v]`: the step every varlen implementation ends with, given
/// its own tokens, labels and weights (each `[n_tok]`).
///
/// # Errors
/// The model's.
pub fn run_varlen(
    model: &DecoderModel,
    attention: &dyn AttentionOp,
    batch: &CausalBatch,
    tokens: &VarlenTokens,
    labels: &[i64],
    weights: &[f64],
) -> Result<CausalRun, Error> {
    let run = tokens.with_input(batch, None, |x| model.run(attention, x, labels, weights))?;
    Ok(CausalRun {
        logits: scatter_logits(batch, &tokens.slots, &run.logits),
        loss: run.loss,
        grads: run.grads.params,
    })
}

/// `[n_slots, v]`: row `t` of `logits: [n_tok, v]` at slot `slots[t]`, 0
/// elsewhere (how a varlen implementation hands back the batch's logits).
pub fn scatter_logits(batch: &CausalBatch, slots: &[usize], logits: &Array2<f64>) -> Array2<f64> {
    let mut out = Array2::zeros((batch.input_ids.len(), logits.ncols()));
    for (t, &s) in slots.iter().enumerate() {
        out.row_mut(s).assign(&logits.row(t));
    }
    out
}

/// The continuation-chunk twin of [`run_varlen`]: the logits of `tokens`
/// over the cache `past`, scattered back to `[n_slots, v]`.
///
/// # Errors
/// The model's.
pub fn chunk_varlen(
    model: &DecoderModel,
    attention: &dyn AttentionOp,
    batch: &CausalBatch,
    tokens: &VarlenTokens,
    past: &KvCache,
) -> Result<Array2<f64>, Error> {
    let fwd = tokens.with_input(batch, Some(past), |x| model.forward(attention, x))?;
    Ok(scatter_logits(batch, &tokens.slots, &fwd.logits))
}

/// The reference pipeline: labels by [`next_token_labels`], weights by
/// [`loss_weights`], boundaries and real slots by [`varlen_from_doc_ids`],
/// the batch's own positions, through `attention` in `form`.
#[derive(Clone, Copy)]
pub struct ReferenceCausalLm<'a> {
    /// The attention every layer runs.
    pub attention: &'a dyn AttentionOp,
    /// Varlen or block-causal.
    pub form: CausalForm,
}

/// The reference pipeline with the reference attention.
pub fn reference_causal_lm(form: CausalForm) -> ReferenceCausalLm<'static> {
    ReferenceCausalLm {
        attention: &ReferenceAttention,
        form,
    }
}

impl CausalLmImpl for ReferenceCausalLm<'_> {
    fn name(&self) -> String {
        format!("reference causal LM ({:?})", self.form)
    }

    fn run(
        &self,
        model: &DecoderModel,
        batch: &CausalBatch,
        reduction: CausalReduction,
    ) -> Result<CausalRun, Error> {
        let labels = next_token_labels(&batch.input_ids, &batch.doc_ids, batch.eos)?;
        let weights = loss_weights(&labels, &batch.doc_ids, reduction, batch.num_documents)?;
        match self.form {
            CausalForm::Varlen => {
                let t = VarlenTokens::of(batch)?;
                let (labels, weights) = (t.gather(&labels), t.gather(&weights));
                run_varlen(model, self.attention, batch, &t, &labels, &weights)
            }
            CausalForm::BlockCausal => {
                let att = DecoderAttention::block_causal(&batch.doc_ids, batch.row_len)?;
                let input = DecoderInput {
                    input_ids: &batch.input_ids,
                    position_ids: &batch.position_ids,
                    attention: &att,
                    past: None,
                };
                let run = model.run(self.attention, &input, &labels, &weights)?;
                Ok(CausalRun {
                    logits: run.logits,
                    loss: run.loss,
                    grads: run.grads.params,
                })
            }
        }
    }

    /// Both forms run a chunk varlen: a dense mask has no key/value cache.
    fn chunk_logits(
        &self,
        model: &DecoderModel,
        batch: &CausalBatch,
        past: &KvCache,
    ) -> Result<Array2<f64>, Error> {
        let t = VarlenTokens::of(batch)?;
        chunk_varlen(model, self.attention, batch, &t, past)
    }

    /// The same pipeline with [`crate::baseline32::Baseline32Attention`]:
    /// the decoder's attention in the baseline's f32, the rest in f64 (the
    /// computation of a pipeline whose attention is an f32 kernel).
    fn baseline32(&self) -> Option<Box<dyn CausalLmImpl + '_>> {
        Some(Box::new(ReferenceCausalLm {
            attention: &crate::baseline32::Baseline32Attention,
            form: CausalForm::Varlen,
        }))
    }

    /// Every config: the reference decoder defines them.
    fn supports(&self, config: &DecoderConfig) -> bool {
        let _ = config;
        true
    }
}

/// One case: a model, documents, how they are packed and the loss reduced.
#[derive(Debug, Clone)]
pub struct CausalCase {
    /// The model (small, seeded).
    pub model: DecoderModel,
    /// Token ids per document (empty ones allowed), never the EOS id.
    pub documents: Vec<Vec<i64>>,
    /// Each document's first position (> 0: a continuation chunk, C6).
    pub offsets: Vec<usize>,
    /// Padding slots placed before each document in the packed rows (C4).
    pub gaps: Vec<usize>,
    /// Slots per row, packed and padded.
    pub row_len: usize,
    /// The EOS target of each document's last token (C2), if any.
    pub eos: Option<i64>,
    /// The declared reduction.
    pub reduction: CausalReduction,
}

impl CausalCase {
    /// A deterministic case: random tokens in `0..v - 1` (id `v - 1` is
    /// reserved for EOS, so it never appears in the inputs).
    #[allow(clippy::too_many_arguments)]
    pub fn seeded(
        config: DecoderConfig,
        lengths: &[usize],
        offsets: &[usize],
        gaps: &[usize],
        row_len: usize,
        eos: bool,
        reduction: CausalReduction,
        seed: u64,
    ) -> Self {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let v = config.vocab_size as i64;
        let model = DecoderModel::random(config, seed ^ 0x5bd1_e995).expect("valid config");
        let documents = lengths
            .iter()
            .map(|&l| (0..l).map(|_| rng.random_range(0..v - 1)).collect())
            .collect();
        CausalCase {
            model,
            documents,
            offsets: offsets.to_vec(),
            gaps: gaps.to_vec(),
            row_len,
            eos: eos.then_some(v - 1),
            reduction,
        }
    }

    fn blank(&self, rows: usize) -> CausalBatch {
        let n = rows * self.row_len;
        CausalBatch {
            row_len: self.row_len,
            input_ids: vec![0; n],
            position_ids: vec![0; n],
            doc_ids: vec![0; n],
            eos: self.eos,
            num_documents: self.documents.len(),
        }
    }

    fn place(&self, b: &mut CausalBatch, d: usize, at: usize) {
        for (t, &id) in self.documents[d].iter().enumerate() {
            b.input_ids[at + t] = id;
            b.position_ids[at + t] = self.offsets[d] + t;
            b.doc_ids[at + t] = d + 1;
        }
    }

    fn check_lengths(&self) -> Result<(), Error> {
        if self.offsets.len() != self.documents.len() {
            return Err(Error::ShapeMismatch {
                field: "offsets".into(),
                expected: format!("[documents] = [{}]", self.documents.len()),
                actual: vec![self.offsets.len()],
            });
        }
        for (d, doc) in self.documents.iter().enumerate() {
            if doc.len() > self.row_len {
                return Err(Error::too_long("documents", d, doc.len(), self.row_len));
            }
        }
        Ok(())
    }

    /// The padded batch: document `d` alone in row `d` (an empty document is
    /// a row of padding).
    ///
    /// # Errors
    /// [`Error::SequenceTooLong`] for a document over `row_len`;
    /// [`Error::ShapeMismatch`] naming `offsets`.
    pub fn padded(&self) -> Result<CausalBatch, Error> {
        self.check_lengths()?;
        let mut b = self.blank(self.documents.len());
        for d in 0..self.documents.len() {
            self.place(&mut b, d, d * self.row_len);
        }
        Ok(b)
    }

    /// The packed batch: documents in order, each into the first row with
    /// room for its gap and its tokens (first fit); empty documents get no
    /// slots; a gap that does not fit beside the document is dropped.
    ///
    /// # Errors
    /// As [`CausalCase::padded`].
    pub fn packed(&self) -> Result<CausalBatch, Error> {
        self.check_lengths()?;
        let mut fill: Vec<usize> = Vec::new();
        let mut at = Vec::new();
        for (d, doc) in self.documents.iter().enumerate() {
            let l = doc.len();
            if l == 0 {
                at.push(None);
                continue;
            }
            let g = self.gaps.get(d).copied().unwrap_or(0).min(self.row_len - l);
            let row = match fill.iter().position(|&f| f + g + l <= self.row_len) {
                Some(r) => r,
                None => {
                    fill.push(0);
                    fill.len() - 1
                }
            };
            at.push(Some(row * self.row_len + fill[row] + g));
            fill[row] += g + l;
        }
        let mut b = self.blank(fill.len());
        for (d, a) in at.into_iter().enumerate() {
            if let Some(a) = a {
                self.place(&mut b, d, a);
            }
        }
        Ok(b)
    }

    /// The truth: the f64 reference decoder on the documents back to back
    /// (varlen), with labels, weights and positions written out from the
    /// documents here. Per document its `[len, v]` logits; the loss; the
    /// gradients.
    ///
    /// # Errors
    /// As [`CausalCase::padded`]; the model's.
    pub fn truth(&self) -> Result<(Vec<Array2<f64>>, f64, DecoderParams), Error> {
        self.check_lengths()?;
        let mut ids = Vec::new();
        let mut pos = Vec::new();
        let mut labels = Vec::new();
        let mut doc_of = Vec::new();
        let mut cu = vec![0];
        for (d, doc) in self.documents.iter().enumerate() {
            if doc.is_empty() {
                continue;
            }
            for t in 0..doc.len() {
                ids.push(doc[t]);
                pos.push(self.offsets[d] + t);
                labels.push(match doc.get(t + 1) {
                    Some(&next) => next,
                    None => self.eos.unwrap_or(IGNORE_INDEX),
                });
                doc_of.push(d);
            }
            cu.push(ids.len());
        }
        let predicted = |d: usize| self.documents[d].len() - usize::from(self.eos.is_none());
        let total: usize = (0..self.documents.len())
            .filter(|&d| !self.documents[d].is_empty())
            .map(predicted)
            .sum();
        let with_any = (0..self.documents.len())
            .filter(|&d| !self.documents[d].is_empty() && predicted(d) > 0)
            .count();
        let weights: Vec<f64> = labels
            .iter()
            .zip(&doc_of)
            .map(|(&l, &d)| match (l == IGNORE_INDEX, self.reduction) {
                (true, _) => 0.0,
                (false, CausalReduction::PerToken) => 1.0 / total as f64,
                (false, CausalReduction::PerDocument) => 1.0 / (with_any * predicted(d)) as f64,
                (false, CausalReduction::PerRow) => 1.0 / self.documents.len() as f64,
            })
            .collect();
        let att = DecoderAttention::Varlen {
            cu_seqlens: cu.clone(),
        };
        let input = DecoderInput {
            input_ids: &ids,
            position_ids: &pos,
            attention: &att,
            past: None,
        };
        let run = self
            .model
            .run(&ReferenceAttention, &input, &labels, &weights)?;
        let mut per_doc = Vec::with_capacity(self.documents.len());
        let mut k = 0;
        for doc in &self.documents {
            let rows = doc.len();
            per_doc.push(
                run.logits
                    .slice_axis(ndarray::Axis(0), (k..k + rows).into())
                    .to_owned(),
            );
            k += rows;
        }
        Ok((per_doc, run.loss, run.grads.params))
    }
}

/// What a suite run saw, per quantity (worst packed-vs-padded error, and
/// padded-vs-truth), and how much of the fault space its cases covered.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CausalReport {
    /// Cases run.
    pub cases: usize,
    /// Packed vs padded: logits.
    pub logits: Observed,
    /// Packed vs padded: the loss.
    pub loss: Observed,
    /// Packed vs padded: every parameter gradient.
    pub grads: Observed,
    /// Padded vs the suite's own reference run (all quantities).
    pub truth: Observed,
    /// Under a [`Judge::Relative`]: padded vs the truth, each tensor's error
    /// against the baseline's ([`CausalLmImpl::baseline32`]).
    pub relative: RelativeTotals,
    /// Cases with a row shared by two or more documents (C1, C2, C3, P7 show).
    pub shared_rows: usize,
    /// Cases with a one-token document beside another (C3).
    pub one_token: usize,
    /// Cases with padding between documents (C4).
    pub gaps: usize,
    /// Cases with a document at a position offset (C6).
    pub continuations: usize,
    /// Cases with an EOS target (C2).
    pub eos: usize,
    /// Random cases skipped: a config the implementation does not support
    /// ([`CausalLmImpl::supports`]).
    pub skipped: usize,
}

fn doc_rows(b: &CausalBatch, d: usize) -> Vec<usize> {
    (0..b.doc_ids.len())
        .filter(|&i| b.doc_ids[i] == d + 1)
        .collect()
}

fn finite(what: &str, v: &[f64]) -> Result<(), Mismatch> {
    match v.iter().position(|x| !x.is_finite()) {
        None => Ok(()),
        Some(i) => Err(Mismatch::new(what, format!("element {i} is {}", v[i]))),
    }
}

/// Checks `imp` on one case (see the module docs) under `judge`.
///
/// # Errors
/// The first [`Mismatch`], naming the comparison, document, tensor and index.
pub fn check_causal(
    imp: &dyn CausalLmImpl,
    case: &CausalCase,
    judge: Judge,
) -> Result<CausalReport, Mismatch> {
    let tol = judge.packed();
    let err = |what: &str, e: Error| Mismatch::new(what, format!("{IMPL}: {e}"));
    let baseline = match judge.relative_rule() {
        None => None,
        Some(_) => Some(imp.baseline32().ok_or_else(|| {
            Mismatch::new(
                "judge",
                format!("a relative judge needs the implementation's f32 baseline ({} has none: CausalLmImpl::baseline32)", imp.name()),
            )
        })?),
    };
    let padded_b = case
        .padded()
        .map_err(|e| Mismatch::new("case", e.to_string()))?;
    let packed_b = case
        .packed()
        .map_err(|e| Mismatch::new("case", e.to_string()))?;
    let padded = imp
        .run(&case.model, &padded_b, case.reduction)
        .map_err(|e| err("padded", e))?;
    let packed = imp
        .run(&case.model, &packed_b, case.reduction)
        .map_err(|e| err("packed", e))?;
    let (truth_logits, truth_loss, truth_grads) = case
        .truth()
        .map_err(|e| Mismatch::new("truth", e.to_string()))?;
    let base_run = match &baseline {
        Some(b) => Some(
            b.run(&case.model, &padded_b, case.reduction)
                .map_err(|e| err("baseline (padded)", e))?,
        ),
        None => None,
    };
    let mut truth = Truth {
        tol: match judge {
            Judge::Rewrite(t) => t,
            Judge::Relative { .. } => Tolerance::F64_REWRITE,
        },
        rule: judge.relative_rule().zip(base_run.as_ref()),
        seen: Observed::default(),
        totals: RelativeTotals::default(),
    };
    let v = case.model.config.vocab_size;
    let mut r = CausalReport {
        cases: 1,
        ..CausalReport::default()
    };
    for (name, run, b) in [
        ("padded", &padded, &padded_b),
        ("packed", &packed, &packed_b),
    ] {
        if run.logits.nrows() != b.input_ids.len() || run.logits.ncols() != v {
            return Err(Mismatch::new(
                format!("{name} logits"),
                format!(
                    "shape {:?}, expected [{}, {v}]",
                    run.logits.shape(),
                    b.input_ids.len()
                ),
            ));
        }
        finite(&format!("{name} loss"), &[run.loss])?;
    }
    for (d, want) in truth_logits.iter().enumerate() {
        let rows_pad = doc_rows(&padded_b, d);
        let rows_pack = doc_rows(&packed_b, d);
        let gather = |run: &CausalRun, rows: &[usize]| -> Vec<f64> {
            rows.iter()
                .flat_map(|&i| run.logits.row(i).to_vec())
                .collect()
        };
        let (lp, lk) = (gather(&padded, &rows_pad), gather(&packed, &rows_pack));
        finite(&format!("packed document {d}: logits"), &lk)?;
        let shape = [rows_pad.len(), v];
        truth.close(
            &format!("truth vs padded: document {d}: logits"),
            (&want.iter().copied().collect::<Vec<_>>(), &lp),
            |b| gather(b, &rows_pad),
            &shape,
            None,
        )?;
        r.logits.close(
            &format!("packed vs padded: document {d}: logits"),
            &lp,
            &lk,
            &shape,
            tol,
        )?;
    }
    truth.close(
        "truth vs padded: loss",
        (&[truth_loss], &[padded.loss]),
        |b| vec![b.loss],
        &[1],
        None,
    )?;
    r.loss.close(
        "packed vs padded: loss",
        &[padded.loss],
        &[packed.loss],
        &[1],
        tol,
    )?;
    truth.grads("truth vs padded: grad", &truth_grads, &padded.grads)?;
    r.truth = truth.seen;
    r.relative = truth.totals;
    grads_close(
        "packed vs padded: grad",
        &padded.grads,
        &packed.grads,
        tol,
        &mut r.grads,
    )?;
    // Coverage.
    let ids = &packed_b.doc_ids;
    let rows: Vec<&[usize]> = ids.chunks(packed_b.row_len.max(1)).collect();
    let docs_in = |row: &[usize]| {
        let mut d: Vec<usize> = row.iter().copied().filter(|&x| x != 0).collect();
        d.dedup();
        d
    };
    r.shared_rows = usize::from(rows.iter().any(|row| docs_in(row).len() > 1));
    r.one_token = usize::from(rows.iter().any(|row| {
        let ds = docs_in(row);
        ds.len() > 1
            && ds
                .iter()
                .any(|&x| row.iter().filter(|&&y| y == x).count() == 1)
    }));
    r.gaps = usize::from(rows.iter().any(|row| {
        let first = row.iter().position(|&x| x != 0);
        let last = row.iter().rposition(|&x| x != 0);
        matches!((first, last), (Some(a), Some(b)) if row[a..=b].contains(&0))
    }));
    r.continuations = usize::from(
        case.offsets
            .iter()
            .zip(&case.documents)
            .any(|(&o, doc)| o > 0 && !doc.is_empty()),
    );
    r.eos = usize::from(case.eos.is_some());
    Ok(r)
}

impl CausalReport {
    /// Adds another case's figures.
    pub fn merge(&mut self, o: &CausalReport) {
        self.cases += o.cases;
        self.logits.merge(o.logits);
        self.loss.merge(o.loss);
        self.grads.merge(o.grads);
        self.truth.merge(o.truth);
        self.relative.merge(&o.relative);
        self.shared_rows += o.shared_rows;
        self.one_token += o.one_token;
        self.gaps += o.gaps;
        self.continuations += o.continuations;
        self.eos += o.eos;
        self.skipped += o.skipped;
    }
}

mod chunk;
mod judge;
mod suite;
pub use chunk::{check_bottom_right, check_chunk, run_chunk_suite};
pub use judge::grads_close;
use judge::Truth;
pub use suite::{causal_cases, configs, fault_cases, run_causal_suite, FaultCase, MAX_ROW};
