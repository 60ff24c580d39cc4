//! The 1F1B schedule of each rank, with the vocabulary layers' passes
//! inserted (arXiv:2411.05288 §5), and a simulator that proves a schedule
//! free of deadlock and draws its timeline.
//!
//! A schedule is one list of [`Op`]s per rank, executed in order. Point-to-
//! point operations pair up between neighbouring stages (Megatron-LM's
//! `send_forward_recv_backward` / `send_backward_recv_forward` become
//! `MPI_Sendrecv`); collectives (the vocabulary layers' broadcasts and
//! all-reduces) are issued by every rank in the same order. [`simulate`]
//! runs the lists with *synchronous* semantics — a send completes only when
//! its receive is posted, a collective only when every rank has reached it —
//! so a schedule it completes cannot deadlock under MPI, whose buffered sends
//! only relax that.
//!
//! ## The schedule (see `docs/PIPELINE.md` for the timelines)
//!
//! Stage `s` of `p` runs `w_s = min(p - 1 - s, M)` warm-up forwards, then
//! alternates one forward and one backward (steady 1F1B), then the
//! remaining backwards (cool-down): activations of at most `w_s + 1`
//! microbatches are alive on stage `s`.
//!
//! **baseline**: stage 0 also runs the input embedding inside its forward,
//! the last stage the output layer and the loss (`L(m)`) between its forward
//! and its backward of microbatch `m`.
//!
//! **vocab-parallel**: the input embedding and the output layer are split by
//! vocabulary over all `p` ranks, and every rank runs, for microbatch `m`:
//! - `O(m)`: the broadcast of the last stage's output `x_L(m)` (`H(m)`), then
//!   the S pass `S(m)` (local logits, `m_i`, `s_i`, alg2's `∂L/∂x` partials)
//!   with its merged all-reduce; alg1 runs its T pass `T(m)` (`∂L/∂z`, the
//!   `∂L/∂x` all-reduce, `∂L/∂W`) right after, as the last stage's backward
//!   needs the all-reduced `∂L/∂x`; with alg2 `∂L/∂x` is complete after the S
//!   barrier and `T(m)` (no communication) moves to the end of the rank's
//!   step `m`, after its backward and the gradient sends;
//! - `I(m)`: the masked local lookup of the input embedding and its
//!   all-reduce, before stage 0's forward of `m` (the first `w_0` at the
//!   start, then right after `O(m - w_0)`);
//! - `E(m)`: the broadcast of `∂L/∂(word rows)` from stage 0 after its
//!   backward of `m`, and the scatter into each rank's embedding shard.
//!
//! On the last stage `O(m)` sits between `F(m)` and `B(m)`; on stage `s <
//! p - 1` it comes right before the forward that step `m` of 1F1B runs (and
//! before the receive of `∂L/∂x_out(m)` in the cool-down), so every rank meets
//! the collectives of `m` after its activations of `m` have left and before
//! it waits for their gradients: the pairing proof is [`simulate`].

use std::fmt;

use packshard_reference::vocab::ShardedAlgorithm;

/// Where the vocabulary layers live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Placement {
    /// Input embedding on the first stage, output layer and loss on the last.
    Baseline,
    /// Both split by vocabulary over all ranks, with `algorithm` (alg1 or alg2).
    VocabParallel(ShardedAlgorithm),
}

impl Placement {
    /// `baseline`, `vocab-parallel alg1`, ...
    pub fn name(self) -> String {
        match self {
            Placement::Baseline => "baseline".into(),
            Placement::VocabParallel(a) => format!("vocab-parallel {a}"),
        }
    }

    /// Whether the vocabulary layers are split.
    pub fn is_vocab_parallel(self) -> bool {
        matches!(self, Placement::VocabParallel(_))
    }
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}

/// One step of a rank's schedule; `usize` fields are microbatches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// `I(m)`: vocabulary-parallel input embedding (lookup + all-reduce).
    Embed(usize),
    /// Receive `x_in(m)` from the previous stage.
    RecvAct(usize),
    /// `F(m)`: the stage's forward (stage 0: the embedding's end first).
    Forward(usize),
    /// Send `x_out(m)` to the next stage.
    SendAct(usize),
    /// One `MPI_Sendrecv` with the next stage: send `x_out(send)`, receive
    /// `∂L/∂x_out(recv)`.
    SendActRecvGrad {
        /// Microbatch sent.
        send: usize,
        /// Microbatch received.
        recv: usize,
    },
    /// Receive `∂L/∂x_out(m)` from the next stage.
    RecvGrad(usize),
    /// `L(m)` (baseline, last stage): the unsharded output layer and loss,
    /// forward and backward.
    Loss(usize),
    /// `H(m)`: broadcast of the last stage's `x_L(m)` to every rank.
    BroadcastHidden(usize),
    /// `S(m)`: the output layer's S pass on this rank's shard (with its barrier).
    OutputS(usize),
    /// `T(m)`: the output layer's T pass (alg1: with the `∂L/∂x` barrier).
    OutputT(usize),
    /// `B(m)`: the stage's backward (stage 0: down to the word rows).
    Backward(usize),
    /// Send `∂L/∂x_in(m)` to the previous stage.
    SendGrad(usize),
    /// One `MPI_Sendrecv` with the previous stage: send `∂L/∂x_in(send)`,
    /// receive `x_in(recv)`.
    SendGradRecvAct {
        /// Microbatch sent.
        send: usize,
        /// Microbatch received.
        recv: usize,
    },
    /// `E(m)`: broadcast of stage 0's `∂L/∂(word rows)(m)` and the scatter
    /// into this rank's embedding shard.
    EmbedGrad(usize),
}

impl Op {
    /// Whether every rank takes part (a collective).
    pub fn is_collective(self) -> bool {
        matches!(
            self,
            Op::Embed(_) | Op::BroadcastHidden(_) | Op::OutputS(_) | Op::EmbedGrad(_)
        )
    }

    /// Whether it only moves data between neighbours.
    pub fn is_p2p(self) -> bool {
        matches!(
            self,
            Op::RecvAct(_)
                | Op::SendAct(_)
                | Op::SendActRecvGrad { .. }
                | Op::RecvGrad(_)
                | Op::SendGrad(_)
                | Op::SendGradRecvAct { .. }
        )
    }

    /// A short label for timelines: `F3`, `B0`, `S2`, ...
    pub fn label(self) -> String {
        match self {
            Op::Embed(m) => format!("I{m}"),
            Op::RecvAct(m) => format!("ra{m}"),
            Op::Forward(m) => format!("F{m}"),
            Op::SendAct(m) => format!("sa{m}"),
            Op::SendActRecvGrad { send, recv } => format!("sa{send}rg{recv}"),
            Op::RecvGrad(m) => format!("rg{m}"),
            Op::Loss(m) => format!("L{m}"),
            Op::BroadcastHidden(m) => format!("H{m}"),
            Op::OutputS(m) => format!("S{m}"),
            Op::OutputT(m) => format!("T{m}"),
            Op::Backward(m) => format!("B{m}"),
            Op::SendGrad(m) => format!("sg{m}"),
            Op::SendGradRecvAct { send, recv } => format!("sg{send}ra{recv}"),
            Op::EmbedGrad(m) => format!("E{m}"),
        }
    }
}

/// How many output-layer blocks `O(·)` stage `s` has run before it receives
/// `∂L/∂x_out(j)`: `j + leads[s]` (`leads[p - 1] = 1`: the last stage runs
/// `O(j)` between `F(j)` and `B(j)`).
///
/// Stage `s` gets the gradient of `j` about `(p - 1 - s) B` after the last
/// stage ran `O(j)`; with one `O` per step of `F + B + O` on every rank, the
/// blocks `O(j + 1), O(j + 2), ...` fall into that time, so the lead is
/// `ceil((O + (p - 1 - s) B) / (F + B + O))`, kept in `1..=p - 1 - s` and
/// growing by at most 1 per stage (what a synchronous send between stages
/// allows: the simulator proves every such choice free of deadlock).
pub fn leads(p: usize, costs: &Costs) -> Vec<usize> {
    let mut out = vec![1; p];
    let o = costs.output / p as f64 + 2.0 * costs.embedding / p as f64;
    let step = costs.forward + costs.backward + o;
    for s in (0..p.saturating_sub(1)).rev() {
        let want = ((o + (p - 1 - s) as f64 * costs.backward) / step).ceil() as usize;
        out[s] = want.clamp(out[s + 1], (out[s + 1] + 1).min(p - 1 - s).max(1));
    }
    out
}

/// One unit of a schedule under construction: an op, or an output block.
#[derive(Debug, Clone)]
enum Unit {
    Op(Op),
    /// `O(j)`: `H(j)`, `S(j)`, alg1's `T(j)`, then `I(j + w_0)` if any.
    Output(Vec<Op>),
}

/// The schedule of rank `s` of `p` for `m_count` microbatches with the
/// output-block `leads` of [`leads`] (see the module docs).
// The microbatch index `j` names ops and offsets (`j + warm`, `j + lead`)
// besides indexing `grad_sent`: a range loop reads best.
#[allow(clippy::needless_range_loop)]
pub fn rank_schedule(
    p: usize,
    s: usize,
    m_count: usize,
    placement: Placement,
    leads: &[usize],
) -> Vec<Op> {
    let last = p - 1;
    let vp = placement.is_vocab_parallel();
    let alg2 = placement == Placement::VocabParallel(ShardedAlgorithm::Alg2);
    let w0 = (p - 1).min(m_count);
    let mut units: Vec<Unit> = Vec::new();
    if vp {
        units.extend((0..w0).map(|k| Unit::Op(Op::Embed(k))));
    }
    let mut emitted = 0;
    // Emits output blocks until `count` have been (vocab-parallel only).
    let mut emit = |units: &mut Vec<Unit>, count: usize| {
        while vp && emitted < count.min(m_count) {
            let j = emitted;
            let mut block = vec![Op::BroadcastHidden(j), Op::OutputS(j)];
            if !alg2 {
                block.push(Op::OutputT(j));
            }
            if w0 > 0 && j + w0 < m_count {
                block.push(Op::Embed(j + w0));
            }
            units.push(Unit::Output(block));
            emitted += 1;
        }
    };
    let push = |units: &mut Vec<Unit>, op: Op| units.push(Unit::Op(op));
    // The op after which each microbatch's gradient has left this rank.
    let mut grad_sent = vec![Op::Backward(0); m_count];
    // The backward of `j`; above stage 0, then its input gradient up, in one
    // exchange with microbatch `next`'s activation while there is one.
    let backward = |units: &mut Vec<Unit>, grad_sent: &mut [Op], j: usize, next: usize| {
        push(units, Op::Backward(j));
        grad_sent[j] = Op::Backward(j);
        if s > 0 {
            let op = if next < m_count {
                Op::SendGradRecvAct {
                    send: j,
                    recv: next,
                }
            } else {
                Op::SendGrad(j)
            };
            push(units, op);
            grad_sent[j] = op;
        }
    };
    if s == last {
        for j in 0..m_count {
            if j == 0 && p > 1 {
                push(&mut units, Op::RecvAct(0));
            }
            if vp && p == 1 {
                push(&mut units, Op::Embed(j));
            }
            push(&mut units, Op::Forward(j));
            if vp {
                emit(&mut units, j + 1);
            } else {
                push(&mut units, Op::Loss(j));
            }
            backward(&mut units, &mut grad_sent, j, j + 1);
        }
    } else {
        let warm = (p - 1 - s).min(m_count);
        let lead = leads[s];
        let upstream_lead = if s == 0 { lead } else { leads[s - 1] };
        for k in 0..warm {
            if s > 0 {
                push(&mut units, Op::RecvAct(k));
            }
            push(&mut units, Op::Forward(k));
            push(&mut units, Op::SendAct(k));
        }
        for j in 0..m_count {
            let f = j + warm;
            if j == 0 && f < m_count && s > 0 {
                push(&mut units, Op::RecvAct(f));
            }
            // Every block the gradient of j waits for, as early as allowed.
            emit(&mut units, j + lead);
            if f < m_count {
                push(&mut units, Op::Forward(f));
                push(&mut units, Op::SendActRecvGrad { send: f, recv: j });
            } else {
                push(&mut units, Op::RecvGrad(j));
            }
            // The blocks the previous stage waits for before it gets ∂L/∂x_in(j).
            emit(&mut units, j + upstream_lead);
            backward(&mut units, &mut grad_sent, j, f + 1);
        }
    }
    emit(&mut units, m_count);
    if vp {
        // E(j) after the gradient of j has left this rank and after the
        // blocks stage 0 has run before its backward of j (so every rank
        // meets E(j) between the same two output blocks); alg2's T(j) right
        // after the gradient has left.
        let e_after = j_count_before_stage0_backward(p, leads);
        for j in 0..m_count {
            let sent_at = units
                .iter()
                .position(|u| matches!(u, Unit::Op(op) if *op == grad_sent[j]))
                .expect("every microbatch's gradient is sent");
            let mut at = sent_at + 1;
            if alg2 {
                units.insert(at, Unit::Op(Op::OutputT(j)));
                at += 1;
            }
            let need = (j + e_after).min(m_count);
            let mut blocks = units[..at]
                .iter()
                .filter(|u| matches!(u, Unit::Output(_)))
                .count();
            while blocks < need {
                if matches!(units[at], Unit::Output(_)) {
                    blocks += 1;
                }
                at += 1;
            }
            // After the E's of earlier microbatches placed here already.
            while matches!(units.get(at), Some(Unit::Op(Op::EmbedGrad(_)))) {
                at += 1;
            }
            units.insert(at, Unit::Op(Op::EmbedGrad(j)));
        }
    }
    units
        .into_iter()
        .flat_map(|u| match u {
            Unit::Op(op) => vec![op],
            Unit::Output(block) => block,
        })
        .collect()
}

/// The output blocks stage 0 has run before its backward of `j`: `j + leads[0]`.
fn j_count_before_stage0_backward(p: usize, leads: &[usize]) -> usize {
    if p == 1 {
        1
    } else {
        leads[0]
    }
}

/// Every rank's schedule, with the leads of [`leads`] for `costs`.
pub fn schedules(p: usize, m_count: usize, placement: Placement, costs: &Costs) -> Vec<Vec<Op>> {
    let l = leads(p, costs);
    (0..p)
        .map(|s| rank_schedule(p, s, m_count, placement, &l))
        .collect()
}

/// Time of each kind of work in a simulation, in arbitrary units.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Costs {
    /// A stage's forward.
    pub forward: f64,
    /// A stage's backward.
    pub backward: f64,
    /// The whole (unsharded) output layer and loss, forward and backward;
    /// split `1 / p` per rank and half S, half T when vocabulary-parallel.
    pub output: f64,
    /// The whole input embedding, forward or backward (split likewise).
    pub embedding: f64,
    /// One message or collective.
    pub comm: f64,
}

impl Costs {
    /// Estimated from the sizes of `config` over `p` stages, in units of one
    /// encoder layer's forward (about `12 hidden^2` multiply-adds per
    /// token): a stage's forward `L / p`, its backward twice that, the output
    /// layer forward and backward `3 v hidden / (12 hidden^2) = v / (4
    /// hidden)`; the embedding lookups and the messages are cheap next to
    /// them (0). Only the leads of [`leads`] depend on it.
    pub fn for_model(config: &crate::model::ModelConfig, p: usize) -> Self {
        let stage = config.layers as f64 / p as f64;
        Costs {
            forward: stage,
            backward: 2.0 * stage,
            output: config.vocab as f64 / (4.0 * config.hidden as f64),
            embedding: 0.0,
            comm: 0.0,
        }
    }
}

impl Default for Costs {
    /// The units of the timelines in the docs: F 2, B 4, output layer 8
    /// (about the six encoder layers of MiniLM over 2 stages), embedding 0,
    /// communication 0.
    fn default() -> Self {
        Costs {
            forward: 2.0,
            backward: 4.0,
            output: 8.0,
            embedding: 0.0,
            comm: 0.0,
        }
    }
}

/// One executed op in a simulation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Span {
    /// The op.
    pub op: Op,
    /// When it started (after waiting for its peers).
    pub start: f64,
    /// When it ended.
    pub end: f64,
}

/// A simulated run: per rank, its ops with times.
#[derive(Debug, Clone, PartialEq)]
pub struct Simulation {
    /// `[p]` lists of spans.
    pub ranks: Vec<Vec<Span>>,
}

impl Simulation {
    /// When the last rank finished.
    pub fn makespan(&self) -> f64 {
        self.ranks
            .iter()
            .filter_map(|r| r.last())
            .map(|s| s.end)
            .fold(0.0, f64::max)
    }

    /// The timeline, one row per rank, `scale` characters per time unit:
    /// each op fills its width with its label, waiting is `.`.
    pub fn render(&self, scale: f64) -> String {
        let mut out = String::new();
        let width = (self.makespan() * scale).round() as usize;
        for (r, spans) in self.ranks.iter().enumerate() {
            let mut row = vec!['.'; width];
            for sp in spans {
                let (a, b) = (
                    (sp.start * scale).round() as usize,
                    (sp.end * scale).round() as usize,
                );
                if b <= a || sp.op.is_p2p() {
                    continue;
                }
                let label: Vec<char> = sp.op.label().chars().collect();
                for (k, cell) in row[a..b.min(width)].iter_mut().enumerate() {
                    *cell = if k == 0 {
                        '|'
                    } else {
                        label.get(k - 1).copied().unwrap_or(' ')
                    };
                }
            }
            out.push_str(&format!("rank {r} {}\n", row.iter().collect::<String>()));
        }
        out
    }
}

/// Why a schedule cannot run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduleError(pub String);

impl fmt::Display for ScheduleError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The neighbour an op talks to and the op it must meet there.
fn partner(rank: usize, op: Op) -> Option<(usize, Op)> {
    Some(match op {
        Op::SendAct(m) => (rank + 1, Op::RecvAct(m)),
        Op::RecvAct(m) => (rank.checked_sub(1)?, Op::SendAct(m)),
        Op::SendActRecvGrad { send, recv } => (
            rank + 1,
            Op::SendGradRecvAct {
                send: recv,
                recv: send,
            },
        ),
        Op::SendGradRecvAct { send, recv } => (
            rank.checked_sub(1)?,
            Op::SendActRecvGrad {
                send: recv,
                recv: send,
            },
        ),
        Op::RecvGrad(m) => (rank + 1, Op::SendGrad(m)),
        Op::SendGrad(m) => (rank.checked_sub(1)?, Op::RecvGrad(m)),
        _ => return None,
    })
}

fn cost(op: Op, p: usize, placement: Placement, c: &Costs) -> f64 {
    let pf = p as f64;
    match op {
        Op::Forward(_) => c.forward,
        Op::Backward(_) => c.backward,
        Op::Loss(_) => c.output,
        Op::OutputS(_) | Op::OutputT(_) => c.output / pf / 2.0 + c.comm,
        Op::Embed(_) | Op::EmbedGrad(_) => c.embedding / pf + c.comm,
        Op::BroadcastHidden(_) => c.comm,
        _ if op.is_p2p() => c.comm,
        _ => {
            let _ = placement;
            0.0
        }
    }
}

/// Runs `schedules` with synchronous semantics and `costs`: a compute op
/// takes its cost; a point-to-point op waits for its partner's matching op,
/// a collective for every rank to reach the same collective.
///
/// # Errors
/// A [`ScheduleError`] naming the stuck ops (a deadlock), ranks that reach
/// different collectives, or an op a rank cannot pair.
pub fn simulate(
    schedules: &[Vec<Op>],
    placement: Placement,
    costs: &Costs,
) -> Result<Simulation, ScheduleError> {
    let p = schedules.len();
    let mut pc = vec![0usize; p];
    let mut clock = vec![0.0f64; p];
    let mut spans: Vec<Vec<Span>> = vec![Vec::new(); p];
    let done = |pc: &[usize]| (0..p).all(|r| pc[r] == schedules[r].len());
    while !done(&pc) {
        let mut progressed = false;
        for r in 0..p {
            while pc[r] < schedules[r].len() {
                let op = schedules[r][pc[r]];
                if op.is_collective() {
                    break;
                }
                if let Some((q, want)) = partner(r, op) {
                    if q >= p {
                        return Err(ScheduleError(format!(
                            "rank {r}: {} has no partner",
                            op.label()
                        )));
                    }
                    if pc[q] < schedules[q].len() && schedules[q][pc[q]] == want {
                        let start = clock[r].max(clock[q]);
                        let end = start + cost(op, p, placement, costs);
                        for (k, o) in [(r, op), (q, want)] {
                            spans[k].push(Span { op: o, start, end });
                            clock[k] = end;
                            pc[k] += 1;
                        }
                        progressed = true;
                        continue;
                    }
                    break;
                }
                let start = clock[r];
                let end = start + cost(op, p, placement, costs);
                spans[r].push(Span { op, start, end });
                clock[r] = end;
                pc[r] += 1;
                progressed = true;
            }
        }
        // A collective completes when every rank is at it.
        let at: Vec<Option<Op>> = (0..p).map(|r| schedules[r].get(pc[r]).copied()).collect();
        if at.iter().all(|o| o.is_some_and(Op::is_collective)) {
            let first = at[0].expect("checked");
            if let Some(r) = at.iter().position(|o| *o != Some(first)) {
                return Err(ScheduleError(format!(
                    "rank {r} reaches {} where rank 0 reaches {}",
                    at[r].expect("checked").label(),
                    first.label()
                )));
            }
            let start = clock.iter().copied().fold(0.0, f64::max);
            for r in 0..p {
                let end = start + cost(first, p, placement, costs);
                spans[r].push(Span {
                    op: first,
                    start,
                    end,
                });
                clock[r] = end;
                pc[r] += 1;
            }
            progressed = true;
        }
        if !progressed && !done(&pc) {
            let stuck: Vec<String> = (0..p)
                .map(|r| match schedules[r].get(pc[r]) {
                    Some(op) => format!("rank {r} at {}", op.label()),
                    None => format!("rank {r} done"),
                })
                .collect();
            return Err(ScheduleError(format!("deadlock: {}", stuck.join(", "))));
        }
    }
    Ok(Simulation { ranks: spans })
}

#[cfg(test)]
mod tests {
    use super::*;

    const PLACEMENTS: [Placement; 3] = [
        Placement::Baseline,
        Placement::VocabParallel(ShardedAlgorithm::Alg1),
        Placement::VocabParallel(ShardedAlgorithm::Alg2),
    ];

    /// Every (p, M, placement) up to 8 ranks and 12 microbatches: no
    /// deadlock under synchronous semantics; each rank runs F(m) and B(m)
    /// once per microbatch, F before B; vocabulary-parallel ranks run every
    /// I, H, S, T and E once, in microbatch order, S before T, and the last
    /// stage's F(m) < S(m) and (alg1: T(m), alg2: S(m)) < B(m); at most
    /// `p - s` microbatches in flight on stage `s` (1F1B's memory bound).
    #[test]
    fn every_schedule_completes_and_respects_the_dependencies() {
        let mut checked = 0;
        for p in 1..=8 {
            for m_count in 1..=12 {
                for placement in PLACEMENTS {
                    let sched = schedules(p, m_count, placement, &Costs::default());
                    let sim = simulate(&sched, placement, &Costs::default())
                        .unwrap_or_else(|e| panic!("p {p} M {m_count} {placement}: {e}"));
                    assert!(sim.makespan() > 0.0);
                    for (s, ops) in sched.iter().enumerate() {
                        let pos = |want: Op| {
                            let found: Vec<usize> = ops
                                .iter()
                                .enumerate()
                                .filter(|(_, o)| **o == want)
                                .map(|(i, _)| i)
                                .collect();
                            assert_eq!(found.len(), 1, "p {p} M {m_count} rank {s} {want:?}");
                            found[0]
                        };
                        let mut in_flight = 0usize;
                        let mut most = 0usize;
                        for op in ops {
                            match op {
                                Op::Forward(_) => in_flight += 1,
                                Op::Backward(_) => in_flight -= 1,
                                _ => {}
                            }
                            most = most.max(in_flight);
                        }
                        assert!(most <= (p - s).min(m_count), "rank {s}: {most} in flight");
                        for m in 0..m_count {
                            assert!(pos(Op::Forward(m)) < pos(Op::Backward(m)));
                            if let Placement::VocabParallel(alg) = placement {
                                assert!(pos(Op::BroadcastHidden(m)) < pos(Op::OutputS(m)));
                                assert!(pos(Op::OutputS(m)) < pos(Op::OutputT(m)));
                                assert!(pos(Op::EmbedGrad(m)) > pos(Op::OutputS(m)));
                                if m + 1 < m_count {
                                    assert!(pos(Op::OutputS(m)) < pos(Op::OutputS(m + 1)));
                                }
                                if s == 0 {
                                    assert!(pos(Op::Embed(m)) < pos(Op::Forward(m)));
                                    assert!(pos(Op::Backward(m)) < pos(Op::EmbedGrad(m)));
                                }
                                if s == p - 1 {
                                    assert!(pos(Op::Forward(m)) < pos(Op::BroadcastHidden(m)));
                                    let ready = match alg {
                                        ShardedAlgorithm::Alg2 => pos(Op::OutputS(m)),
                                        _ => pos(Op::OutputT(m)),
                                    };
                                    assert!(ready < pos(Op::Backward(m)));
                                }
                            } else if s == p - 1 {
                                assert!(pos(Op::Forward(m)) < pos(Op::Loss(m)));
                                assert!(pos(Op::Loss(m)) < pos(Op::Backward(m)));
                            }
                        }
                    }
                    checked += 1;
                }
            }
        }
        assert_eq!(checked, 8 * 12 * 3);
    }

    /// A schedule with a collective out of order is caught (the simulator is
    /// not vacuous).
    #[test]
    fn the_simulator_finds_deadlocks_and_misordered_collectives() {
        let placement = Placement::VocabParallel(ShardedAlgorithm::Alg1);
        let mut sched = schedules(3, 4, placement, &Costs::default());
        // Rank 1 waits for a gradient before the output layer that makes it.
        // Where in `ops` the first op `is` stands.
        let at = |ops: &[Op], is: &dyn Fn(&Op) -> bool| ops.iter().position(is).unwrap();
        let i = at(&sched[1], &|o| *o == Op::BroadcastHidden(1));
        let j = at(&sched[1], &|o| {
            matches!(o, Op::SendActRecvGrad { recv: 1, .. })
        });
        sched[1].swap(i, j);
        let e = simulate(&sched, placement, &Costs::default()).unwrap_err();
        assert!(e.0.contains("deadlock") || e.0.contains("reaches"), "{e}");
        let mut sched = schedules(2, 3, placement, &Costs::default());
        let a = at(&sched[0], &|o| *o == Op::EmbedGrad(0));
        let b = at(&sched[0], &|o| *o == Op::BroadcastHidden(1));
        sched[0].swap(a, b);
        let e = simulate(&sched, placement, &Costs::default()).unwrap_err();
        assert!(e.0.contains("reaches") || e.0.contains("deadlock"), "{e}");
    }

    /// With the output layer as heavy as MiniLM's at two stages (about 2.2
    /// times a stage's forward and backward), vocabulary parallelism
    /// shortens the simulated iteration at `p = 2`. (At `p >= 3` the blocking
    /// collectives hold the stages in lockstep and the simulated iteration
    /// is longer than the baseline's: see docs/PIPELINE.md.)
    #[test]
    fn vocab_parallel_beats_the_baseline_at_two_stages_in_the_simulation() {
        let costs = Costs {
            output: 13.0,
            ..Costs::default()
        };
        let m = 8;
        let base = simulate(
            &schedules(2, m, Placement::Baseline, &costs),
            Placement::Baseline,
            &costs,
        )
        .unwrap()
        .makespan();
        for alg in [ShardedAlgorithm::Alg1, ShardedAlgorithm::Alg2] {
            let pl = Placement::VocabParallel(alg);
            let vp = simulate(&schedules(2, m, pl, &costs), pl, &costs)
                .unwrap()
                .makespan();
            assert!(vp < 0.9 * base, "{alg}: {vp} vs baseline {base}");
        }
    }
}
