//! One rank of the pipeline: the execution
//! of its [`schedule`](crate::schedule) over MPI (its share of the
//! parameters: [`crate::share`]).

use std::collections::HashMap;

use mpi::point_to_point::send_receive_into_with_tags;
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::traits::*;
use ndarray::Array2;
use packshard_reference::bert::layer::LayerCache;
use packshard_reference::vocab::collective::Collective;
use packshard_reference::vocab::embedding::{embedding_forward, embedding_rank};
use packshard_reference::vocab::sharded::{linear_cross_entropy_rank_s, OutputSPass};
use packshard_reference::vocab::{linear_cross_entropy, LossCall};
use packshard_reference::{Error, Result};

use crate::collective::{EventClass, MpiCollective, Trace};
use crate::decoder::{stage_backward, stage_forward, StageCache};
use crate::model::{
    embedding_finish, embedding_finish_backward, layers_backward, layers_forward,
    scaled_output_grads, word_grad_accumulate, EmbeddingCache, Microbatch, ModelConfig,
};
use crate::schedule::{Op, Placement};

pub use crate::share::{Plan, RankParams};

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
