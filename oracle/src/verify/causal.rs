//! `packshard verify causal-lm`: a causal decoder on real documents, packed
//! by a packing algorithm against one document per padded row (issue #15).
//!
//! The documents (token ids, e.g. lines of real text through a tokenizer)
//! are laid out twice as [`CausalBatch`]es of `max_seq_len` slots per row:
//!
//! - **padded**: document `d` alone in row `d`, right-padded (Hugging Face's
//!   causal LM with an attention mask);
//! - **packed**: the rows of a [`PackingPlan`] from
//!   [`PackedBatch::from_sequences`] (the packer `packshard verify bert`
//!   and `packshard pack` use), documents back to back, positions restarting
//!   at 0 per document, document ids marking the boundaries.
//!
//! Each batch is trained by a [`CausalLmImpl`] (the CLI: the reference
//! pipeline, dense causal masks on the padded rows, varlen or block-causal
//! on the packed ones) under each [`CausalReduction`], and everything is
//! compared under [`TOLERANCE`]: each document's logits, the loss under each
//! reduction, every parameter gradient under each reduction. Only the order
//! of sums over tokens differs between the layouts, so the two agree to a few
//! ulp; a fault of the packed pipeline (docs/FAULTS.md C1–C7, P7) moves them
//! by far more.

use std::time::Instant;

use packshard_equivalence::causal::{grads_close, CausalBatch, CausalLmImpl, CausalRun, Observed};
use packshard_equivalence::compare::{Mismatch, Tolerance};
use packshard_reference::decoder::{CausalReduction, DecoderConfig, DecoderModel, DecoderParams};
use packshard_reference::limits::{check_estimate, f64_bytes, total};
use packshard_reference::packing::batch::MAX_BATCH_SLOTS;
use packshard_reference::packing::{
    pack_lengths, Algorithm, PackedBatch, PackingConfig, PackingPlan,
};
use packshard_reference::Error;

use super::{Diff, RunFigures};

/// The tolerance of the verdict: both layouts run the same f64 operations
/// per token, only sums over tokens change order.
pub const TOLERANCE: Tolerance = Tolerance::F64_REWRITE;

/// The id padding slots hold (never read: padding predicts nothing and no
/// real token attends to it).
pub const PAD_ID: i64 = 0;

/// What to run.
#[derive(Debug, Clone)]
pub struct CausalVerifyOptions {
    /// Pack (and padded row) length in tokens.
    pub max_seq_len: usize,
    /// The packing algorithm.
    pub algorithm: Algorithm,
    /// At most this many documents per pack.
    pub max_sequences_per_pack: Option<usize>,
}

/// A batch and where each document sits in it.
#[derive(Debug, Clone, PartialEq)]
pub struct Layout {
    /// The batch as a collator hands it over.
    pub batch: CausalBatch,
    /// Per document, its slots in token order (empty for an empty document).
    pub slots: Vec<Vec<usize>>,
}

fn blank(rows: usize, row_len: usize, num_documents: usize) -> Result<Layout, Error> {
    if row_len == 0 || rows.saturating_mul(row_len) > MAX_BATCH_SLOTS {
        return Err(Error::invalid(
            "max_seq_len",
            format!(
                "{rows} rows x {row_len} slots must be between 1 and {MAX_BATCH_SLOTS} token slots"
            ),
        ));
    }
    let n = rows * row_len;
    Ok(Layout {
        batch: CausalBatch {
            row_len,
            input_ids: vec![PAD_ID; n],
            position_ids: vec![0; n],
            doc_ids: vec![0; n],
            eos: None,
            num_documents,
        },
        slots: vec![Vec::new(); num_documents],
    })
}

impl Layout {
    fn place(&mut self, documents: &[Vec<i64>], d: usize, at: usize) {
        for (t, &id) in documents[d].iter().enumerate() {
            self.batch.input_ids[at + t] = id;
            self.batch.position_ids[at + t] = t;
            self.batch.doc_ids[at + t] = d + 1;
            self.slots[d].push(at + t);
        }
    }

    /// One document per row of `row_len` slots (an empty document is a row
    /// of padding).
    ///
    /// # Errors
    /// [`Error::SequenceTooLong`] naming `documents` and the index;
    /// [`Error::InvalidArgument`] naming `max_seq_len` for a batch of 0 or
    /// over [`MAX_BATCH_SLOTS`] slots.
    pub fn padded(documents: &[Vec<i64>], row_len: usize) -> Result<Layout, Error> {
        for (d, doc) in documents.iter().enumerate() {
            if doc.len() > row_len {
                return Err(Error::too_long("documents", d, doc.len(), row_len));
            }
        }
        let mut l = blank(documents.len(), row_len, documents.len())?;
        for d in 0..documents.len() {
            l.place(documents, d, d * row_len);
        }
        Ok(l)
    }

    /// The rows of the plan `config` packs `documents` into
    /// ([`PackedBatch::from_sequences`]); each document whole, in one row.
    ///
    /// # Errors
    /// Those of [`PackedBatch::from_sequences`]; [`Error::InvalidArgument`]
    /// naming `plan` when it cuts a document (the comparison needs whole
    /// documents).
    pub fn packed(
        documents: &[Vec<i64>],
        config: &PackingConfig,
    ) -> Result<(PackingPlan, Layout), Error> {
        let (plan, packed) = PackedBatch::from_sequences(documents, config, PAD_ID, 0)?;
        let row_len = config.max_seq_len;
        let mut l = blank(packed.num_packs(), row_len, documents.len())?;
        for (p, pack) in plan.packs.iter().enumerate() {
            let mut at = p * row_len;
            for seg in pack {
                let len = documents[seg.sequence].len();
                if seg.offset != 0 || seg.length != len {
                    return Err(Error::invalid(
                        "plan",
                        format!(
                            "pack {p} holds tokens {}..{} of document {} ({len} tokens): documents must not be cut",
                            seg.offset,
                            seg.offset + seg.length,
                            seg.sequence
                        ),
                    ));
                }
                l.place(documents, seg.sequence, at);
                at += len;
            }
        }
        Ok((plan, l))
    }
}

/// The outcome of a verification.
#[derive(Debug, Clone)]
pub struct CausalVerifyReport {
    /// Documents (empty ones included), tokens, predicted tokens (each
    /// document's but its last), the packing; seconds summed over the three
    /// runs of each layout.
    pub run: RunFigures,
    /// The padded run's loss under each reduction.
    pub losses: Vec<(CausalReduction, f64)>,
    /// Per kind of output.
    pub diffs: Vec<Diff>,
    /// `Ok` when every value agrees under [`TOLERANCE`]; else the first
    /// [`Mismatch`].
    pub verdict: Result<Observed, Mismatch>,
}

/// Keeps the first failure of a run of comparisons.
struct Verdict {
    seen: Observed,
    first: Option<Mismatch>,
}

impl Verdict {
    fn record(&mut self, r: Result<(), Mismatch>) {
        if let (None, Err(m)) = (&self.first, r) {
            self.first = Some(m);
        }
    }
}

/// Each document's logits rows of `run` (at its `slots`), concatenated.
fn gather(run: &CausalRun, slots: &[Vec<usize>]) -> Vec<f64> {
    slots
        .iter()
        .flatten()
        .flat_map(|&s| run.logits.row(s).to_vec())
        .collect()
}

fn flat_grads(run: &CausalRun) -> Vec<f64> {
    run.grads
        .named()
        .iter()
        .flat_map(|(_, t)| t.iter().copied().collect::<Vec<_>>())
        .collect()
}

/// Checks, before the model is built or any run starts, that `config`'s
/// parameters (the model and one gradient per layout: 3 copies, f64) and
/// both layouts' runs fit the memory budget ([`verify_causal`]'s estimate),
/// the slots counted from `documents` as [`Layout::padded`] and
/// [`Layout::packed`] lay them out.
///
/// # Errors
/// [`DecoderConfig::validate`]'s; [`Error::InvalidArgument`] naming the
/// layout's field (`documents`, `max_seq_len`) or the estimate's
/// (`max_seq_len`).
pub fn check_causal_budget(
    config: &DecoderConfig,
    documents: &[Vec<i64>],
    opts: &CausalVerifyOptions,
) -> Result<(), Error> {
    config.validate()?;
    let packing = PackingConfig::new(opts.algorithm, opts.max_seq_len)
        .with_max_sequences_per_pack(opts.max_sequences_per_pack);
    if let Some(d) = documents
        .iter()
        .position(|doc| doc.len() > opts.max_seq_len)
    {
        return Err(Error::too_long(
            "documents",
            d,
            documents[d].len(),
            opts.max_seq_len,
        ));
    }
    let n_pad = documents.len().saturating_mul(opts.max_seq_len);
    let lengths: Vec<usize> = documents.iter().map(Vec::len).collect();
    let plan = pack_lengths(&lengths, &packing)?;
    let n_pack = plan.packs.len().saturating_mul(opts.max_seq_len);
    check_run_bytes(config, n_pad, n_pack)
}

/// The runs hold logits, their gradient and each layer's activations per
/// slot, and the comparison keeps both layouts' logits of the real tokens:
/// `3 x slots x (v + layers x (8 hidden + 3 inter))` f64; the parameters
/// three times (the model, each layout's gradient).
fn check_run_bytes(c: &DecoderConfig, n_pad: usize, n_pack: usize) -> Result<(), Error> {
    let v = c.vocab_size;
    let per_slot = c.num_layers.saturating_mul(
        c.hidden_size
            .saturating_mul(8)
            .saturating_add(c.intermediate_size.saturating_mul(3)),
    );
    let params = DecoderParams::shapes(c)
        .iter()
        .try_fold(0u64, |acc, (_, dims)| {
            f64_bytes(dims).and_then(|b| acc.checked_add(b))
        })
        .and_then(|b| b.checked_mul(3));
    check_estimate(
        "max_seq_len",
        total(&[
            f64_bytes(&[3, n_pad.saturating_add(n_pack), v.saturating_add(per_slot)]),
            params,
        ]),
        &format!("{n_pad} padded and {n_pack} packed slots of {v} logits and the model's parameters (verify causal-lm)"),
    )
}

/// Runs `model` on `documents` padded (through `padded_imp`) and packed
/// (through `packed_imp`) under each reduction, and compares the logits of
/// the first run, and the loss and every parameter gradient of each.
/// `progress` is told what runs next.
///
/// # Errors
/// Input errors: [`Layout::padded`]'s and [`Layout::packed`]'s;
/// [`Error::InvalidArgument`] naming `max_seq_len` when the runs' logits
/// and activations (`3 x slots x (v + layers x (8 hidden + 3 inter))` f64,
/// both layouts) are over the memory budget; the implementations' (ids outside the model's vocabulary, a batch over the
/// model's limits).
pub fn verify_causal(
    model: &DecoderModel,
    documents: &[Vec<i64>],
    opts: &CausalVerifyOptions,
    padded_imp: &dyn CausalLmImpl,
    packed_imp: &dyn CausalLmImpl,
    progress: &dyn Fn(&str),
) -> Result<CausalVerifyReport, Error> {
    let config = PackingConfig::new(opts.algorithm, opts.max_seq_len)
        .with_max_sequences_per_pack(opts.max_sequences_per_pack);
    let padded_l = Layout::padded(documents, opts.max_seq_len)?;
    let (plan, packed_l) = Layout::packed(documents, &config)?;
    let n_pad = padded_l.batch.input_ids.len();
    let n_pack = packed_l.batch.input_ids.len();
    let c = &model.config;
    let v = c.vocab_size;
    check_run_bytes(c, n_pad, n_pack)?;
    let mut verdict = Verdict {
        seen: Observed::default(),
        first: None,
    };
    let mut diffs = Vec::new();
    let mut grad_diffs = Vec::new();
    let mut losses = Vec::new();
    let (mut padded_seconds, mut packed_seconds) = (0.0, 0.0);
    for (k, r) in CausalReduction::ALL.into_iter().enumerate() {
        progress(&format!("padded forward + backward ({})", r.name()));
        let t0 = Instant::now();
        let padded = padded_imp.run(model, &padded_l.batch, r)?;
        padded_seconds += t0.elapsed().as_secs_f64();
        progress(&format!("packed forward + backward ({})", r.name()));
        let t1 = Instant::now();
        let packed = packed_imp.run(model, &packed_l.batch, r)?;
        packed_seconds += t1.elapsed().as_secs_f64();
        progress("comparing");
        if k == 0 {
            let shapes_ok = [(&padded, n_pad, "padded"), (&packed, n_pack, "packed")]
                .into_iter()
                .all(|(run, n, name)| {
                    let ok = run.logits.dim() == (n, v);
                    if !ok {
                        verdict.record(Err(Mismatch::new(
                            format!("{name} logits"),
                            format!("shape {:?}, expected [{n}, {v}]", run.logits.shape()),
                        )));
                    }
                    ok
                });
            if shapes_ok {
                let (lp, lk) = (
                    gather(&padded, &padded_l.slots),
                    gather(&packed, &packed_l.slots),
                );
                diffs.push(Diff::new("logits", &lp, &lk));
                let mut at = 0;
                for (d, s) in padded_l.slots.iter().enumerate() {
                    let m = s.len() * v;
                    let r = verdict.seen.close(
                        &format!("packed vs padded: document {d}: logits"),
                        &lp[at..at + m],
                        &lk[at..at + m],
                        &[s.len(), v],
                        TOLERANCE,
                    );
                    verdict.record(r);
                    at += m;
                }
            }
        }
        diffs.push(Diff::new(
            &format!("loss ({})", r.name()),
            &[padded.loss],
            &[packed.loss],
        ));
        let loss_check = verdict.seen.close(
            &format!("packed vs padded: loss ({})", r.name()),
            &[padded.loss],
            &[packed.loss],
            &[1],
            TOLERANCE,
        );
        verdict.record(loss_check);
        grad_diffs.push(Diff::new(
            &format!("parameter gradients ({})", r.name()),
            &flat_grads(&padded),
            &flat_grads(&packed),
        ));
        let grad_check = grads_close(
            &format!("packed vs padded: grad ({})", r.name()),
            &padded.grads,
            &packed.grads,
            TOLERANCE,
            &mut verdict.seen,
        );
        verdict.record(grad_check);
        losses.push((r, padded.loss));
    }
    diffs.extend(grad_diffs);
    Ok(CausalVerifyReport {
        run: RunFigures {
            sequences: documents.len(),
            real_tokens: documents.iter().map(Vec::len).sum(),
            predicted_tokens: documents.iter().map(|d| d.len().saturating_sub(1)).sum(),
            metrics: plan.metrics,
            padded_slots: n_pad,
            packed_slots: n_pack,
            padded_seconds,
            packed_seconds,
        },
        losses,
        diffs,
        verdict: match verdict.first {
            None => Ok(verdict.seen),
            Some(m) => Err(m),
        },
    })
}
