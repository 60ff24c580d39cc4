//! One rank of the pipeline: its share of the parameters, and the execution
//! of its [`schedule`](crate::schedule) over MPI.

use std::collections::HashMap;
use std::ops::Range;

use mpi::point_to_point::send_receive_into_with_tags;
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::traits::*;
use ndarray::{Array1, Array2, ArrayViewD, ArrayViewMutD};
use packshard_reference::bert::layer::LayerCache;
use packshard_reference::bert::LayerParams;
use packshard_reference::decoder::{DecoderConfig, DecoderParams};
use packshard_reference::vocab::collective::Collective;
use packshard_reference::vocab::embedding::{embedding_forward, embedding_rank};
use packshard_reference::vocab::sharded::{linear_cross_entropy_rank_s, OutputSPass};
use packshard_reference::vocab::{linear_cross_entropy, LossCall, ShardLayout, ShardMap};
use packshard_reference::{Error, Result};

use crate::collective::{EventClass, MpiCollective, Trace};
use crate::decoder::{stage_backward, stage_forward, DecoderStage, StageCache};
use crate::model::{
    embedding_finish, embedding_finish_backward, layer_named, layer_tensors_mut, layers_backward,
    layers_forward, scaled_output_grads, stage_layers, word_grad_accumulate, EmbeddingCache,
    Microbatch, ModelConfig, Params,
};
use crate::schedule::{schedules, Costs, Op, Placement};

/// How the model is laid over `p` ranks.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// Ranks (= stages).
    pub p: usize,
    /// Where the vocabulary layers live.
    pub placement: Placement,
    /// Each stage's contiguous layers.
    pub stages: Vec<Range<usize>>,
    /// The vocabulary split (uneven contiguous shards; used when
    /// vocabulary-parallel).
    pub map: ShardMap,
    /// Every rank's schedule.
    pub schedules: Vec<Vec<Op>>,
}

impl Plan {
    /// The plan of `config` over `p` ranks.
    ///
    /// # Errors
    /// The errors of [`ModelConfig::validate`] and [`ShardMap::new`].
    pub fn new(config: &ModelConfig, p: usize, placement: Placement) -> Result<Self> {
        config.validate(p)?;
        let costs = Costs::for_model(config, p);
        Ok(Plan {
            p,
            placement,
            stages: stage_layers(config.layers, p),
            map: ShardMap::new(config.vocab, p, ShardLayout::Uneven)?,
            schedules: schedules(p, config.microbatches, placement, &costs),
        })
    }

    /// The rows `[start, start + len)` of the word embedding / output layer
    /// rank `r` holds, if any.
    pub fn vocab_rows(&self, r: usize, v: usize, input: bool) -> Option<Range<usize>> {
        if self.placement.is_vocab_parallel() {
            let s = self.map.shard(r);
            Some(s.start..s.start + s.real)
        } else if (input && r == 0) || (!input && r == self.p - 1) {
            Some(0..v)
        } else {
            None
        }
    }
}

/// The parameters (or gradients) one rank holds.
#[derive(Debug, Clone, PartialEq)]
pub struct RankParams {
    /// The rank.
    pub rank: usize,
    /// Its stage's layers.
    pub layers: Vec<LayerParams>,
    /// `[w, hidden]`: its rows of the word embedding (all `v` on stage 0 in
    /// the baseline, its shard when vocabulary-parallel).
    pub word: Option<Array2<f64>>,
    /// Stage 0: the position embedding and the embedding LayerNorm.
    pub embedding_tail: Option<(Array2<f64>, Array1<f64>, Array1<f64>)>,
    /// `[w, hidden]`: its rows of the output layer.
    pub output: Option<Array2<f64>>,
    /// The causal decoder's stage (then `layers` and `embedding_tail` are
    /// empty): its layers and, on the last rank, the final norm. With tied
    /// embeddings `word` and `output` are copies of the same rows of the one
    /// weight, and their gradients are summed after the iteration.
    pub decoder: Option<DecoderStage>,
}

impl RankParams {
    /// Rank `r`'s share of `full`.
    pub fn from_full(full: &Params, plan: &Plan, r: usize) -> Self {
        let v = full.word.nrows();
        let rows =
            |a: &Array2<f64>, range: Range<usize>| a.slice(ndarray::s![range, ..]).to_owned();
        RankParams {
            rank: r,
            layers: full.layers[plan.stages[r].clone()].to_vec(),
            word: plan.vocab_rows(r, v, true).map(|g| rows(&full.word, g)),
            embedding_tail: (r == 0)
                .then(|| (full.position.clone(), full.ln_g.clone(), full.ln_b.clone())),
            output: plan.vocab_rows(r, v, false).map(|g| rows(&full.output, g)),
            decoder: None,
        }
    }

    /// Rank `r`'s share of the decoder `full` (of shape `config`): its
    /// stage's layers, the final norm on the last rank, its rows of the
    /// embedding and of the output layer (`lm_head`, or `embed` when tied).
    pub fn from_decoder(
        full: &DecoderParams,
        config: &DecoderConfig,
        plan: &Plan,
        r: usize,
    ) -> Self {
        let v = full.embed.nrows();
        let rows =
            |a: &Array2<f64>, range: Range<usize>| a.slice(ndarray::s![range, ..]).to_owned();
        let head = if config.tie_embeddings {
            &full.embed
        } else {
            &full.lm_head
        };
        RankParams {
            rank: r,
            layers: Vec::new(),
            word: plan.vocab_rows(r, v, true).map(|g| rows(&full.embed, g)),
            embedding_tail: None,
            output: plan.vocab_rows(r, v, false).map(|g| rows(head, g)),
            decoder: Some(DecoderStage {
                config: config.clone(),
                layers: full.layers[plan.stages[r].clone()].to_vec(),
                final_norm: (r == plan.p - 1)
                    .then(|| (full.final_norm_g.clone(), full.final_norm_b.clone())),
            }),
        }
    }

    /// Copies this rank's decoder tensors into their places in `full`: the
    /// input-embedding rows into `embed`, the output rows into `lm_head`
    /// (untied) or, tied, into `tied_head: [v, hidden]` (the output ranks'
    /// copy of the one weight, checked against `embed` separately).
    pub fn place_into_decoder(
        &self,
        full: &mut DecoderParams,
        tied_head: &mut Array2<f64>,
        plan: &Plan,
    ) {
        let v = full.embed.nrows();
        let r = self.rank;
        let Some(stage) = &self.decoder else { return };
        for (l, lp) in plan.stages[r].clone().zip(&stage.layers) {
            full.layers[l] = lp.clone();
        }
        if let Some((g, b)) = &stage.final_norm {
            full.final_norm_g.assign(g);
            full.final_norm_b.assign(b);
        }
        if let (Some(w), Some(g)) = (&self.word, plan.vocab_rows(r, v, true)) {
            full.embed.slice_mut(ndarray::s![g, ..]).assign(w);
        }
        if let (Some(o), Some(g)) = (&self.output, plan.vocab_rows(r, v, false)) {
            let head = if stage.config.tie_embeddings {
                tied_head
            } else {
                &mut full.lm_head
            };
            head.slice_mut(ndarray::s![g, ..]).assign(o);
        }
    }

    /// Zeros of the same shapes (a gradient).
    pub fn zeros_like(&self) -> Self {
        RankParams {
            rank: self.rank,
            layers: self.layers.iter().map(LayerParams::zeros_like).collect(),
            word: self.word.as_ref().map(|a| Array2::zeros(a.dim())),
            embedding_tail: self.embedding_tail.as_ref().map(|(p, g, b)| {
                (
                    Array2::zeros(p.dim()),
                    Array1::zeros(g.len()),
                    Array1::zeros(b.len()),
                )
            }),
            output: self.output.as_ref().map(|a| Array2::zeros(a.dim())),
            decoder: self.decoder.as_ref().map(DecoderStage::zeros_like),
        }
    }

    /// Every tensor, in a fixed order.
    pub fn tensors(&self) -> Vec<ArrayViewD<'_, f64>> {
        let mut out: Vec<ArrayViewD<'_, f64>> = self
            .layers
            .iter()
            .flat_map(|l| layer_named(0, l).into_iter().map(|(_, t)| t))
            .collect();
        if let Some(w) = &self.word {
            out.push(w.view().into_dyn());
        }
        if let Some((p, g, b)) = &self.embedding_tail {
            out.extend([
                p.view().into_dyn(),
                g.view().into_dyn(),
                b.view().into_dyn(),
            ]);
        }
        if let Some(o) = &self.output {
            out.push(o.view().into_dyn());
        }
        if let Some(d) = &self.decoder {
            for l in &d.layers {
                out.extend(l.named().into_iter().map(|(_, t)| t));
            }
            if let Some((g, b)) = &d.final_norm {
                out.extend([g.view().into_dyn(), b.view().into_dyn()]);
            }
        }
        out
    }

    /// Every tensor, mutable, in the order of [`RankParams::tensors`].
    pub fn tensors_mut(&mut self) -> Vec<ArrayViewMutD<'_, f64>> {
        let mut out: Vec<ArrayViewMutD<'_, f64>> = Vec::new();
        for l in &mut self.layers {
            out.extend(layer_tensors_mut(l));
        }
        if let Some(w) = &mut self.word {
            out.push(w.view_mut().into_dyn());
        }
        if let Some((p, g, b)) = &mut self.embedding_tail {
            out.extend([
                p.view_mut().into_dyn(),
                g.view_mut().into_dyn(),
                b.view_mut().into_dyn(),
            ]);
        }
        if let Some(o) = &mut self.output {
            out.push(o.view_mut().into_dyn());
        }
        if let Some(d) = &mut self.decoder {
            for l in &mut d.layers {
                out.extend(l.named_mut().into_iter().map(|(_, t)| t));
            }
            if let Some((g, b)) = &mut d.final_norm {
                out.extend([g.view_mut().into_dyn(), b.view_mut().into_dyn()]);
            }
        }
        out
    }

    /// Values held.
    pub fn num_values(&self) -> usize {
        self.tensors().iter().map(|t| t.len()).sum()
    }

    /// Bytes of the parameters (f64).
    pub fn bytes(&self) -> usize {
        8 * self.num_values()
    }

    /// All values, flat, in the order of [`RankParams::tensors`].
    pub fn flatten(&self) -> Vec<f64> {
        let mut out = Vec::with_capacity(self.num_values());
        for t in self.tensors() {
            out.extend(t.iter().copied());
        }
        out
    }

    /// Fills the tensors from `flat` (as [`RankParams::flatten`] made it).
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when the lengths differ.
    pub fn fill(&mut self, flat: &[f64]) -> Result<()> {
        if flat.len() != self.num_values() {
            return Err(Error::ShapeMismatch {
                field: format!("gradients of rank {}", self.rank),
                expected: format!("{} values", self.num_values()),
                actual: vec![flat.len()],
            });
        }
        let mut at = 0;
        for mut t in self.tensors_mut() {
            for x in t.iter_mut() {
                *x = flat[at];
                at += 1;
            }
        }
        Ok(())
    }

    /// Copies this rank's tensors into their places in `full`.
    pub fn place_into(&self, full: &mut Params, plan: &Plan) {
        let v = full.word.nrows();
        let r = self.rank;
        for (l, lp) in plan.stages[r].clone().zip(&self.layers) {
            full.layers[l] = lp.clone();
        }
        if let (Some(w), Some(g)) = (&self.word, plan.vocab_rows(r, v, true)) {
            full.word.slice_mut(ndarray::s![g, ..]).assign(w);
        }
        if let Some((p, g, b)) = &self.embedding_tail {
            full.position.assign(p);
            full.ln_g.assign(g);
            full.ln_b.assign(b);
        }
        if let (Some(o), Some(g)) = (&self.output, plan.vocab_rows(r, v, false)) {
            full.output.slice_mut(ndarray::s![g, ..]).assign(o);
        }
    }
}

/// A fault to inject on one rank (the fault tests' `--fault` options).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// No fault.
    None,
    /// The rank's copy of the microbatch's `cu_seqlens` is corrupted (its
    /// last entry one past the tokens): the attention of its forward rejects
    /// it with a typed error.
    BadInput,
    /// The rank panics in its forward of the microbatch.
    Panic,
    /// The rank kills its own process with `SIGKILL` in its forward of the
    /// microbatch.
    Kill,
}

/// Where a fault strikes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FaultPlan {
    /// What.
    pub fault: Fault,
    /// On which rank.
    pub rank: usize,
    /// In which microbatch's forward.
    pub microbatch: usize,
}

impl FaultPlan {
    /// No fault.
    pub const NONE: FaultPlan = FaultPlan {
        fault: Fault::None,
        rank: 0,
        microbatch: 0,
    };

    /// Corrupts `microbatches` if this is the faulty rank with bad input.
    pub fn corrupt(&self, rank: usize, microbatches: &mut [Microbatch]) {
        if self.fault == Fault::BadInput && rank == self.rank {
            if let Some(mb) = microbatches.get_mut(self.microbatch) {
                if let packshard_reference::bert::attention::AttentionLayout::Varlen {
                    cu_seqlens,
                } = &mut mb.layout
                {
                    if let Some(last) = cu_seqlens.last_mut() {
                        *last += 1;
                    }
                }
            }
        }
    }
}

/// A deliberately planted bug (negative control of the equivalence check).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlantedBug {
    /// None.
    None,
    /// The last rank drops microbatch 0's contribution to its output-layer
    /// weight gradient.
    DropOutputGrad,
    /// Tied embeddings: the gradients of the two uses of the one weight are
    /// not summed (each copy keeps its own use's gradient).
    TiedNotSummed,
    /// Vocabulary-parallel: rank 0's T pass reads its output shard as
    /// starting one row later than it does
    /// (`OutputSPass::with_wrong_shard_start`).
    TShardOffset,
    /// Vocabulary-parallel, barriers the paper's algorithms remove come back
    /// (Yeung et al., arXiv:2411.05288, §3) while every value stays the
    /// same: alg1's output layer runs with the naive algorithm's collectives
    /// (the max, the sum and `∂L/∂x` each their own all-reduce); alg2 sums a
    /// value over the ranks in a barrier of its own after the S pass (a
    /// separate all-reduce for what the S pass's one barrier could carry).
    NaiveBarriers,
}

/// What one rank returns from an iteration.
#[derive(Debug, Clone, PartialEq)]
pub struct RankOutcome {
    /// Each microbatch's loss, where this rank computed it.
    pub losses: Vec<Option<f64>>,
    /// Heap bytes live when the iteration started.
    pub start_bytes: usize,
    /// Peak heap bytes during the iteration, above `start_bytes`.
    pub peak_activation_bytes: usize,
    /// The collective barriers this rank took part in during the iteration
    /// (each all-reduce or broadcast of the vocabulary layers is one); see
    /// [`expected_barriers`].
    pub barriers: u64,
}

/// The barriers one rank takes part in during an iteration of `plan` over
/// `microbatches`: none in the baseline placement (the vocabulary layers
/// live on one rank each); vocabulary-parallel, per microbatch, the input
/// embedding's all-reduce, the broadcast of the last hidden state, the
/// output layer's barriers
/// ([`ShardedAlgorithm::barriers`](packshard_reference::vocab::ShardedAlgorithm::barriers): 2 for alg1, 1
/// for alg2, with the input gradient) and the broadcast of the word rows'
/// gradient. Yeung et al. (arXiv:2411.05288) §3: alg1 and alg2 exist to
/// cut the output layer's barriers; an implementation that computes the
/// same values with more barriers has lost what they buy, which no value
/// check sees.
pub fn expected_barriers(plan: &Plan, microbatches: usize) -> u64 {
    match plan.placement {
        Placement::Baseline => 0,
        Placement::VocabParallel(alg) => microbatches as u64 * (3 + alg.barriers(true, true)),
    }
}

/// Executes rank `comm.rank()`'s schedule of `plan` for one iteration:
/// gradients accumulate into `grads` (zeroed by the caller). `trace` gets
/// every op and every communication.
///
/// # Errors
/// The errors of the reference ops (bad ids, targets, layouts) and of the
/// collectives. A rank that fails leaves its peers blocked in MPI: the caller
/// aborts the job (`MPI_Abort`).
#[allow(clippy::too_many_arguments)]
pub fn run_iteration(
    comm: &SimpleCommunicator,
    config: &ModelConfig,
    plan: &Plan,
    params: &RankParams,
    grads: &mut RankParams,
    microbatches: &[Microbatch],
    fault: FaultPlan,
    bug: PlantedBug,
    trace: &Trace,
) -> Result<RankOutcome> {
    let coll = MpiCollective::new(comm, trace);
    let rank = comm.rank() as usize;
    let start_bytes = packshard_optimized::alloc::live_bytes();
    packshard_optimized::alloc::reset_peak();
    let mut ex = Exec {
        comm,
        coll: &coll,
        config,
        plan,
        rank,
        params,
        grads,
        mbs: microbatches,
        scales: crate::model::microbatch_scales(microbatches)?,
        word_rows: HashMap::new(),
        act_in: HashMap::new(),
        caches: HashMap::new(),
        decoder_caches: HashMap::new(),
        act_out: HashMap::new(),
        grad_out: HashMap::new(),
        grad_in: HashMap::new(),
        word_grad: HashMap::new(),
        hidden: HashMap::new(),
        s_passes: HashMap::new(),
        losses: vec![None; microbatches.len()],
        fault,
        bug,
    };
    for &op in &plan.schedules[rank] {
        trace.set_op(op);
        let start = Trace::now();
        ex.run(op, trace)?;
        trace.record(EventClass::Op, start, Trace::now());
    }
    let losses = ex.losses;
    let tied = params
        .decoder
        .as_ref()
        .is_some_and(|d| d.config.tie_embeddings);
    if tied && bug != PlantedBug::TiedNotSummed {
        sum_tied_grads(comm, plan, grads, trace)?;
    }
    Ok(RankOutcome {
        losses,
        start_bytes,
        peak_activation_bytes: packshard_optimized::alloc::peak_bytes().saturating_sub(start_bytes),
        barriers: coll.counts().barriers,
    })
}

/// The message tag of the tied embedding's gradient exchange: above every
/// microbatch's ([`tag`] of at most
/// [`MAX_MICROBATCHES`](crate::model::MAX_MICROBATCHES)), below 32767 (the
/// least `MPI_TAG_UB` the MPI standard allows).
const TIED_TAG: i32 = (2 * crate::model::MAX_MICROBATCHES + 2) as i32;

/// Tied embeddings: the one weight's gradient is the sum of its input use's
/// (`grads.word`) and its output use's (`grads.output`), `word + output` on
/// every copy (the same sum, bit for bit, wherever it is formed). Under
/// vocabulary parallelism each rank's shard serves both uses: summed in
/// place. In the baseline placement stage 0 and the last stage exchange
/// their `[v, hidden]` gradients point to point (Megatron-LM's embedding
/// group all-reduce); one rank (`p = 1`) sums in place.
fn sum_tied_grads(
    comm: &SimpleCommunicator,
    plan: &Plan,
    grads: &mut RankParams,
    trace: &Trace,
) -> Result<()> {
    let rank = comm.rank() as usize;
    let last = plan.p - 1;
    let missing = |what: &str| Error::invalid("tied", format!("rank {rank} holds no {what}"));
    if plan.placement.is_vocab_parallel() || plan.p == 1 {
        let out = grads
            .output
            .as_ref()
            .ok_or_else(|| missing("output layer"))?;
        let word = grads
            .word
            .as_mut()
            .ok_or_else(|| missing("word embedding"))?;
        *word += out;
        let sum = word.clone();
        grads.output = Some(sum);
        return Ok(());
    }
    if rank != 0 && rank != last {
        return Ok(());
    }
    let peer_rank = if rank == 0 { last } else { 0 };
    let mine = if rank == 0 {
        grads
            .word
            .as_mut()
            .ok_or_else(|| missing("word embedding"))?
    } else {
        grads
            .output
            .as_mut()
            .ok_or_else(|| missing("output layer"))?
    };
    let mut theirs = Array2::<f64>::zeros(mine.dim());
    let peer = comm.process_at_rank(peer_rank as i32);
    let start = Trace::now();
    send_receive_into_with_tags(
        mine.as_slice().expect("contiguous"),
        &peer,
        TIED_TAG,
        theirs.as_slice_mut().expect("fresh arrays are contiguous"),
        &peer,
        TIED_TAG,
    );
    trace.record(EventClass::P2p { peer: peer_rank }, start, Trace::now());
    // word + output on both ranks.
    if rank == 0 {
        *mine += &theirs;
    } else {
        theirs += &*mine;
        *mine = theirs;
    }
    Ok(())
}

/// The message tag of microbatch `m`'s activation (gradient: + 1).
fn tag(m: usize, grad: bool) -> i32 {
    (2 * m + usize::from(grad)) as i32
}

struct Exec<'a> {
    comm: &'a SimpleCommunicator,
    coll: &'a MpiCollective<'a>,
    config: &'a ModelConfig,
    plan: &'a Plan,
    rank: usize,
    params: &'a RankParams,
    grads: &'a mut RankParams,
    mbs: &'a [Microbatch],
    /// Each microbatch's weight in the step ([`crate::model::microbatch_scales`]).
    scales: Vec<f64>,
    /// Stage 0, vocabulary-parallel: the all-reduced word rows of `I(m)`.
    word_rows: HashMap<usize, Array2<f64>>,
    /// `x_in(m)` received.
    act_in: HashMap<usize, Array2<f64>>,
    /// What the backward of `m` needs.
    caches: HashMap<usize, (Option<EmbeddingCache>, Vec<LayerCache>)>,
    /// The decoder: what the backward of `m` needs.
    decoder_caches: HashMap<usize, StageCache>,
    /// `x_out(m)` to send (the last stage: `x_L(m)`).
    act_out: HashMap<usize, Array2<f64>>,
    /// `∂L/∂x_out(m)`.
    grad_out: HashMap<usize, Array2<f64>>,
    /// `∂L/∂x_in(m)` to send.
    grad_in: HashMap<usize, Array2<f64>>,
    /// Stage 0, vocabulary-parallel: `∂L/∂(word rows)(m)` until `E(m)`.
    word_grad: HashMap<usize, Array2<f64>>,
    /// Vocabulary-parallel: the broadcast `x_L(m)` until `T(m)`.
    hidden: HashMap<usize, Array2<f64>>,
    /// Vocabulary-parallel: S passes waiting for their T pass.
    s_passes: HashMap<usize, OutputSPass>,
    losses: Vec<Option<f64>>,
    fault: FaultPlan,
    bug: PlantedBug,
}

fn take<T>(map: &mut HashMap<usize, T>, m: usize, what: &str) -> Result<T> {
    map.remove(&m)
        .ok_or_else(|| Error::invalid("schedule", format!("{what} of microbatch {m} is missing")))
}

impl Exec<'_> {
    fn h(&self) -> usize {
        self.config.hidden
    }

    fn zeros(&self, m: usize) -> Array2<f64> {
        Array2::zeros((self.mbs[m].len(), self.h()))
    }

    /// Runs `f` with the neighbour `up` (the previous stage, toward stage
    /// 0) or down (the next one), and records the time as a p2p event with
    /// that rank.
    fn traced_p2p<T>(
        &self,
        up: bool,
        trace: &Trace,
        f: impl FnOnce(&mpi::topology::Process<'_>) -> T,
    ) -> T {
        let rank = if up { self.rank - 1 } else { self.rank + 1 };
        let peer = self.comm.process_at_rank(rank as i32);
        let start = Trace::now();
        let out = f(&peer);
        trace.record(EventClass::P2p { peer: rank }, start, Trace::now());
        out
    }

    /// Receives microbatch `m`'s `[len, h]` tensor from the neighbour `up`
    /// (toward stage 0: its output activation) or down (its input gradient).
    fn receive(&self, m: usize, up: bool, trace: &Trace) -> Array2<f64> {
        let mut buf = self.zeros(m);
        let slice = buf.as_slice_mut().expect("fresh arrays are contiguous");
        self.traced_p2p(up, trace, |peer| {
            peer.receive_into_with_tag(slice, tag(m, !up))
        });
        buf
    }

    /// Sends microbatch `m`'s tensor `x` to the neighbour `up` (this stage's
    /// input gradient) or down (its output activation).
    fn send(&self, m: usize, x: &Array2<f64>, up: bool, trace: &Trace) {
        let slice = x.as_slice().expect("contiguous");
        self.traced_p2p(up, trace, |peer| peer.send_with_tag(slice, tag(m, up)));
    }

    /// [`Exec::send`] of microbatch `send`'s `x` and [`Exec::receive`] of
    /// microbatch `recv`'s tensor from the same neighbour, as one exchange.
    fn exchange(
        &self,
        send: usize,
        x: &Array2<f64>,
        recv: usize,
        up: bool,
        trace: &Trace,
    ) -> Array2<f64> {
        let mut buf = self.zeros(recv);
        let out = buf.as_slice_mut().expect("contiguous");
        self.traced_p2p(up, trace, |peer| {
            send_receive_into_with_tags(
                x.as_slice().expect("contiguous"),
                peer,
                tag(send, up),
                out,
                peer,
                tag(recv, !up),
            )
        });
        buf
    }

    /// What a send of microbatch `m` to the neighbour `up` carries: this
    /// stage's input gradient, or (down) its output activation.
    fn outgoing(&mut self, m: usize, up: bool) -> Result<Array2<f64>> {
        if up {
            take(&mut self.grad_in, m, "the input gradient")
        } else {
            take(&mut self.act_out, m, "the output activation")
        }
    }

    /// Keeps microbatch `m`'s tensor `x` received from the neighbour `up`
    /// (this stage's input activation) or down (its output's gradient).
    fn arrived(&mut self, m: usize, up: bool, x: Array2<f64>) {
        if up {
            self.act_in.insert(m, x);
        } else {
            self.grad_out.insert(m, x);
        }
    }

    fn algorithm(&self) -> packshard_reference::vocab::ShardedAlgorithm {
        match self.plan.placement {
            Placement::VocabParallel(packshard_reference::vocab::ShardedAlgorithm::Alg1)
                if self.bug == PlantedBug::NaiveBarriers =>
            {
                packshard_reference::vocab::ShardedAlgorithm::Naive
            }
            Placement::VocabParallel(a) => a,
            Placement::Baseline => packshard_reference::vocab::ShardedAlgorithm::Alg1,
        }
    }

    fn word(&self) -> Result<&Array2<f64>> {
        self.params
            .word
            .as_ref()
            .ok_or_else(|| Error::invalid("schedule", "this rank holds no word embedding"))
    }

    fn output(&self) -> Result<&Array2<f64>> {
        self.params
            .output
            .as_ref()
            .ok_or_else(|| Error::invalid("schedule", "this rank holds no output layer"))
    }

    fn add_output_grad(&mut self, m: usize, gw: &Array2<f64>) -> Result<()> {
        if self.bug == PlantedBug::DropOutputGrad && m == 0 && self.rank == self.plan.p - 1 {
            return Ok(());
        }
        let g = self
            .grads
            .output
            .as_mut()
            .ok_or_else(|| Error::invalid("schedule", "this rank holds no output layer"))?;
        *g += gw;
        Ok(())
    }

    fn inject(&self, m: usize) {
        if self.fault.rank != self.rank || self.fault.microbatch != m {
            return;
        }
        match self.fault.fault {
            Fault::Panic => panic!(
                "fault injection: rank {} panics in the forward of microbatch {m}",
                self.rank
            ),
            Fault::Kill => {
                eprintln!(
                    "packshard-pipeline: rank {}: fault injection: killing this process (SIGKILL) in the forward of microbatch {m}",
                    self.rank
                );
                // SAFETY: getpid and kill have no preconditions.
                unsafe {
                    libc::kill(libc::getpid(), libc::SIGKILL);
                }
            }
            Fault::None | Fault::BadInput => {}
        }
    }

    fn run(&mut self, op: Op, trace: &Trace) -> Result<()> {
        let last = self.plan.p - 1;
        let config = self.config;
        match op {
            Op::Embed(m) => {
                let mb = &self.mbs[m];
                let (rows, _, _) =
                    embedding_rank(self.coll, &self.plan.map, &mb.ids, self.word()?.view())?;
                if self.rank == 0 {
                    self.word_rows.insert(m, rows);
                }
            }
            Op::RecvAct(m) | Op::RecvGrad(m) => {
                let up = matches!(op, Op::RecvAct(_));
                let x = self.receive(m, up, trace);
                self.arrived(m, up, x);
            }
            Op::Forward(m) if self.params.decoder.is_some() => {
                self.inject(m);
                let mb = &self.mbs[m];
                let x = if self.rank == 0 {
                    if self.plan.placement.is_vocab_parallel() {
                        take(&mut self.word_rows, m, "the word rows")?
                    } else {
                        embedding_forward(&mb.ids, self.word()?.view())?
                    }
                } else {
                    take(&mut self.act_in, m, "the input activation")?
                };
                let stage = self.params.decoder.as_ref().expect("matched");
                let (y, cache) = stage_forward(stage, x, mb)?;
                self.decoder_caches.insert(m, cache);
                self.act_out.insert(m, y);
            }
            Op::Forward(m) => {
                self.inject(m);
                let mb = &self.mbs[m];
                let (x, emb) = if self.rank == 0 {
                    let rows = if self.plan.placement.is_vocab_parallel() {
                        take(&mut self.word_rows, m, "the word rows")?
                    } else {
                        embedding_forward(&mb.ids, self.word()?.view())?
                    };
                    let (pos, g, b) = self.params.embedding_tail.as_ref().ok_or_else(|| {
                        Error::invalid("schedule", "stage 0 holds no position embedding")
                    })?;
                    let (x, cache) =
                        embedding_finish(rows, &mb.positions, pos.view(), g, b, config.eps())?;
                    (x, Some(cache))
                } else {
                    (take(&mut self.act_in, m, "the input activation")?, None)
                };
                let (y, caches) = layers_forward(
                    &self.params.layers,
                    config.heads,
                    config.eps(),
                    x,
                    &mb.layout,
                )?;
                self.caches.insert(m, (emb, caches));
                self.act_out.insert(m, y);
            }
            Op::SendAct(m) | Op::SendGrad(m) => {
                let up = matches!(op, Op::SendGrad(_));
                let x = self.outgoing(m, up)?;
                self.send(m, &x, up, trace);
            }
            Op::SendActRecvGrad { send, recv } | Op::SendGradRecvAct { send, recv } => {
                let up = matches!(op, Op::SendGradRecvAct { .. });
                let x = self.outgoing(send, up)?;
                let got = self.exchange(send, &x, recv, up, trace);
                self.arrived(recv, up, got);
            }
            Op::Loss(m) => {
                let hidden = take(&mut self.act_out, m, "the last hidden state")?;
                let mb = &self.mbs[m];
                let out = linear_cross_entropy(
                    hidden.view(),
                    self.output()?.view(),
                    &LossCall::with_flag(&mb.targets, &config.loss_config(), true),
                )?;
                self.losses[m] = Some(out.ce.loss);
                let (gx, gw) =
                    scaled_output_grads(out.grad_hidden, out.grad_weight, self.scales[m])?;
                self.add_output_grad(m, &gw)?;
                self.grad_out.insert(m, gx);
            }
            Op::BroadcastHidden(m) => {
                let mut buf = if self.rank == last {
                    take(&mut self.act_out, m, "the last hidden state")?
                } else {
                    self.zeros(m)
                };
                self.coll.broadcast(
                    last,
                    buf.as_slice_mut().expect("fresh arrays are contiguous"),
                )?;
                self.hidden.insert(m, buf);
            }
            Op::OutputS(m) => {
                let hidden = self
                    .hidden
                    .get(&m)
                    .ok_or_else(|| Error::invalid("schedule", format!("no hidden state of {m}")))?;
                let s = linear_cross_entropy_rank_s(
                    self.coll,
                    self.algorithm(),
                    &self.plan.map,
                    hidden.view(),
                    self.output()?.view(),
                    &LossCall::with_flag(&self.mbs[m].targets, &config.loss_config(), true),
                )?;
                self.losses[m] = Some(s.loss());
                if self.bug == PlantedBug::NaiveBarriers
                    && self.algorithm() == packshard_reference::vocab::ShardedAlgorithm::Alg2
                {
                    let mut loss = [if self.rank == 0 { s.loss() } else { 0.0 }];
                    self.coll.all_reduce_sum(&mut loss)?;
                }
                if self.rank == last {
                    if let Some(gx) = s.grad_hidden() {
                        self.grad_out.insert(m, gx.mapv(|x| x * self.scales[m]));
                    }
                }
                self.s_passes.insert(m, s);
            }
            Op::OutputT(m) => {
                let mut s = take(&mut self.s_passes, m, "the S pass")?;
                if self.bug == PlantedBug::TShardOffset && self.rank == 0 {
                    s = s.with_wrong_shard_start(self.plan.map.shard(0).start + 1);
                }
                let hidden = take(&mut self.hidden, m, "the hidden state")?;
                let out = s.t_pass(self.coll, hidden.view(), self.output()?.view())?;
                let (gx, gw) =
                    scaled_output_grads(out.grad_hidden, out.grad_weight, self.scales[m])?;
                self.add_output_grad(m, &gw)?;
                if self.rank == last && !self.grad_out.contains_key(&m) {
                    self.grad_out.insert(m, gx);
                }
            }
            Op::Backward(m) if self.params.decoder.is_some() => {
                let dy = take(&mut self.grad_out, m, "the output gradient")?;
                let cache = take(&mut self.decoder_caches, m, "the forward caches")?;
                let mb = &self.mbs[m];
                let stage = self.params.decoder.as_ref().expect("matched");
                let g = self.grads.decoder.as_mut().ok_or_else(|| {
                    Error::invalid("schedule", "the gradients hold no decoder stage")
                })?;
                let dx = stage_backward(stage, g, &cache, mb, dy)?;
                drop(cache);
                if self.rank == 0 {
                    if self.plan.placement.is_vocab_parallel() {
                        self.word_grad.insert(m, dx);
                    } else {
                        let grad = self.grads.word.as_mut().ok_or_else(|| {
                            Error::invalid("schedule", "stage 0 holds no word embedding")
                        })?;
                        word_grad_accumulate(&mb.ids, config.vocab, dx.view(), grad, 0)?;
                    }
                } else {
                    self.grad_in.insert(m, dx);
                }
            }
            Op::Backward(m) => {
                let dy = take(&mut self.grad_out, m, "the output gradient")?;
                let (emb, caches) = take(&mut self.caches, m, "the forward caches")?;
                let mb = &self.mbs[m];
                let dx = layers_backward(
                    &self.params.layers,
                    &mut self.grads.layers,
                    config.heads,
                    &caches,
                    &mb.layout,
                    dy,
                )?;
                drop(caches);
                if let Some(emb) = emb {
                    let (_, g, _) = self.params.embedding_tail.as_ref().ok_or_else(|| {
                        Error::invalid("schedule", "stage 0 holds no position embedding")
                    })?;
                    let (gp, gg, gb) = self.grads.embedding_tail.as_mut().ok_or_else(|| {
                        Error::invalid("schedule", "stage 0 holds no position embedding")
                    })?;
                    let d_rows =
                        embedding_finish_backward(&emb, &mb.positions, g, dx.view(), gp, gg, gb);
                    if self.plan.placement.is_vocab_parallel() {
                        self.word_grad.insert(m, d_rows);
                    } else {
                        let grad = self.grads.word.as_mut().ok_or_else(|| {
                            Error::invalid("schedule", "stage 0 holds no word embedding")
                        })?;
                        word_grad_accumulate(&mb.ids, config.vocab, d_rows.view(), grad, 0)?;
                    }
                } else {
                    self.grad_in.insert(m, dx);
                }
            }
            Op::EmbedGrad(m) => {
                let mut buf = if self.rank == 0 {
                    take(&mut self.word_grad, m, "the word-row gradient")?
                } else {
                    self.zeros(m)
                };
                self.coll
                    .broadcast(0, buf.as_slice_mut().expect("contiguous"))?;
                let start = self.plan.map.shard(self.rank).start;
                let grad =
                    self.grads.word.as_mut().ok_or_else(|| {
                        Error::invalid("schedule", "this rank holds no word shard")
                    })?;
                word_grad_accumulate(&self.mbs[m].ids, config.vocab, buf.view(), grad, start)?;
            }
        }
        Ok(())
    }
}
