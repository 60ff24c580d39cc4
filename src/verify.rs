//! `packshard verify bert`: the reference BERT on real weights and real text,
//! packed against padded.
//!
//! Real lines are tokenized with the model's tokenizer, about `mask_prob` of
//! their tokens (never `[CLS]`/`[SEP]`) are replaced by `[MASK]` and become
//! MLM targets, each sequence gets a seeded NSP label (the lines are not
//! sentence pairs; the label only drives a real gradient through the pooler
//! and NSP head). The batch is packed with a packing algorithm and run packed
//! (varlen attention over `cu_seqlens`) and padded (one line per row of
//! `max_seq_len`, key padding mask), forward and backward, and every output,
//! loss and gradient is compared under [`Tolerance::F64_REWRITE`].
//!
//! `packshard verify causal-lm` is [`causal`] (re-exported from
//! `packshard-oracle`); both print rows of [`Diff`].

use std::time::Instant;

use packshard_equivalence::attention::Observed;
use packshard_equivalence::bert::compare_outputs;
use packshard_equivalence::compare::{Mismatch, Tolerance};
pub use packshard_oracle::verify::{causal, Diff, RunFigures};
use packshard_reference::bert::{
    BertModel, BertOutput, LossWeights, PackedAttention, Reduction, Targets, TokenBatch,
    IGNORE_INDEX,
};
use packshard_reference::packing::{Algorithm, PackedBatch, PackingConfig};
use packshard_reference::Error;
use rand::{Rng, SeedableRng};

/// What to run.
#[derive(Debug, Clone)]
pub struct VerifyOptions {
    /// Pack (and padded row) length in tokens; longer lines are skipped.
    pub max_seq_len: usize,
    /// The packing algorithm.
    pub algorithm: Algorithm,
    /// At most this many sequences per pack.
    pub max_sequences_per_pack: Option<usize>,
    /// The MLM reduction the gradients are taken under.
    pub reduction: Reduction,
    /// Fraction of (non-special) tokens masked and predicted.
    pub mask_prob: f64,
    /// Seed of the masking and NSP labels (ChaCha8).
    pub seed: u64,
}

/// Masked inputs and targets built from tokenized lines.
#[derive(Debug, Clone)]
pub struct Sample {
    /// Input ids with `[MASK]` at predicted positions.
    pub sequences: Vec<Vec<i64>>,
    /// Per-token MLM labels and per-sequence NSP labels.
    pub targets: Targets,
}

/// Masks about `mask_prob` of the tokens between the first and last
/// (`[CLS]`, `[SEP]`) of each sequence with `mask_id`, seeded.
pub fn mask_sample(tokenized: &[Vec<i64>], mask_id: i64, opts: &VerifyOptions) -> Sample {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(opts.seed);
    let mut sequences = Vec::with_capacity(tokenized.len());
    let mut mlm_labels = Vec::with_capacity(tokenized.len());
    let mut nsp_labels = Vec::with_capacity(tokenized.len());
    for ids in tokenized {
        let mut input = ids.clone();
        let mut labels = vec![IGNORE_INDEX; ids.len()];
        for t in 1..ids.len().saturating_sub(1) {
            if rng.random::<f64>() < opts.mask_prob {
                labels[t] = ids[t];
                input[t] = mask_id;
            }
        }
        sequences.push(input);
        mlm_labels.push(labels);
        nsp_labels.push(if ids.is_empty() {
            IGNORE_INDEX
        } else {
            rng.random_range(0..2)
        });
    }
    Sample {
        sequences,
        targets: Targets {
            mlm_labels,
            nsp_labels,
        },
    }
}

/// The outcome of a verification.
#[derive(Debug, Clone)]
pub struct VerifyReport {
    /// Sequences, tokens, predicted (masked) tokens, the packing, the time.
    pub run: RunFigures,
    /// MLM loss of the padded run under each reduction.
    pub mlm_loss: [(Reduction, f64); 2],
    /// NSP loss of the padded run.
    pub nsp_loss: f64,
    /// Per kind of output.
    pub diffs: Vec<Diff>,
    /// `Ok` when every value agrees under [`Tolerance::F64_REWRITE`].
    pub verdict: Result<Observed, Mismatch>,
}

/// Runs `model` on `sample` packed and padded and compares everything.
/// `progress` is told what runs next.
///
/// # Errors
/// Input errors (a sequence over `max_seq_len` or the model's positions, ids
/// outside the vocabulary).
pub fn verify(
    model: &BertModel,
    sample: &Sample,
    opts: &VerifyOptions,
    progress: &dyn Fn(&str),
) -> Result<VerifyReport, Error> {
    let config = PackingConfig::new(opts.algorithm, opts.max_seq_len)
        .with_max_sequences_per_pack(opts.max_sequences_per_pack);
    let pad = model.config.pad_token_id as i64;
    let (plan, packed_batch) = PackedBatch::from_sequences(&sample.sequences, &config, pad, 0)?;
    let b = sample.sequences.len();
    let weights = LossWeights::new(&sample.targets, opts.reduction);
    // Both runs' activations checked before either starts (each run checks
    // its own again; the parameters were checked at load).
    let padded_slots = b.saturating_mul(opts.max_seq_len);
    let packed_slots = packed_batch.flat_cu_seqlens().last().copied().unwrap_or(0);
    packshard_reference::limits::check_estimate(
        "max_seq_len",
        model
            .config
            .activation_bytes(padded_slots.max(packed_slots)),
        &format!("the activations of {padded_slots} padded token slots (verify bert)"),
    )?;

    progress("padded forward + backward");
    let t0 = Instant::now();
    let padded_tb = TokenBatch::padded(
        &sample.sequences,
        None,
        opts.max_seq_len,
        model.config.pad_token_id,
        0,
    )?;
    let padded = model.run(&padded_tb, &sample.targets, &weights, true)?;
    let padded_seconds = t0.elapsed().as_secs_f64();
    drop(padded_tb);

    progress("packed (varlen) forward + backward");
    let t1 = Instant::now();
    let packed_tb = TokenBatch::packed(&packed_batch, b, None, PackedAttention::Varlen)?;
    let packed = model.run(&packed_tb, &sample.targets, &weights, true)?;
    let packed_seconds = t1.elapsed().as_secs_f64();

    progress("comparing");
    let diffs = diffs(&padded, &packed);
    let mut seen = Observed::default();
    let verdict = compare_outputs(&padded, &packed, &mut seen).map(|()| seen);
    Ok(VerifyReport {
        run: RunFigures {
            sequences: b,
            real_tokens: sample.sequences.iter().map(Vec::len).sum(),
            predicted_tokens: sample.targets.mlm_counts().iter().sum(),
            padded_slots: b * opts.max_seq_len,
            packed_slots: packed_batch.num_packs() * opts.max_seq_len,
            metrics: plan.metrics,
            padded_seconds,
            packed_seconds,
        },
        mlm_loss: [
            (
                Reduction::PerToken,
                padded.mlm_loss_under(Reduction::PerToken),
            ),
            (
                Reduction::PerSequence,
                padded.mlm_loss_under(Reduction::PerSequence),
            ),
        ],
        nsp_loss: padded.nsp_loss,
        diffs,
        verdict,
    })
}

fn diffs(padded: &BertOutput, packed: &BertOutput) -> Vec<Diff> {
    let gather =
        |o: &BertOutput, f: &dyn Fn(&packshard_reference::bert::SequenceOutput) -> Vec<f64>| {
            o.sequences.iter().flat_map(f).collect::<Vec<f64>>()
        };
    let hidden = |s: &packshard_reference::bert::SequenceOutput| s.hidden.iter().copied().collect();
    let pooled = |s: &packshard_reference::bert::SequenceOutput| {
        s.pooled.as_ref().map(|p| p.to_vec()).unwrap_or_default()
    };
    let mlm_tok = |s: &packshard_reference::bert::SequenceOutput| s.mlm_losses.clone();
    let gie = |s: &packshard_reference::bert::SequenceOutput| {
        s.grad_inputs_embeds
            .as_ref()
            .map(|g| g.iter().copied().collect())
            .unwrap_or_default()
    };
    let grads = |o: &BertOutput| -> Vec<f64> {
        o.grads
            .as_ref()
            .map(|g| {
                g.named()
                    .iter()
                    .flat_map(|(_, t)| t.iter().copied().collect::<Vec<_>>())
                    .collect()
            })
            .unwrap_or_default()
    };
    let mut out = vec![
        Diff::new(
            "hidden states",
            &gather(padded, &hidden),
            &gather(packed, &hidden),
        ),
        Diff::new(
            "pooled outputs",
            &gather(padded, &pooled),
            &gather(packed, &pooled),
        ),
        Diff::new(
            "MLM token losses",
            &gather(padded, &mlm_tok),
            &gather(packed, &mlm_tok),
        ),
    ];
    for r in Reduction::ALL {
        out.push(Diff::new(
            &format!("MLM loss ({})", r.name()),
            &[padded.mlm_loss_under(r)],
            &[packed.mlm_loss_under(r)],
        ));
    }
    out.push(Diff::new(
        "NSP loss",
        &[padded.nsp_loss],
        &[packed.nsp_loss],
    ));
    out.push(Diff::new(
        "parameter gradients",
        &grads(padded),
        &grads(packed),
    ));
    out.push(Diff::new(
        "input-embedding gradients",
        &gather(padded, &gie),
        &gather(packed, &gie),
    ));
    out
}

/// The tolerance the verdict uses.
pub const TOLERANCE: Tolerance = Tolerance::F64_REWRITE;
