//! The training step across ranks over MPI (issue #34; docs/STEP.md): one
//! process per rank, `C` context-parallel ranks times `D` data-parallel
//! ranks, each data-parallel rank running its `G` microbatches in turn.
//! World rank `w` is context-parallel rank `w mod C` of data-parallel rank
//! `w / C`; each data-parallel rank's `C` processes form one CP
//! communicator (`MPI_Comm_split`).
//!
//! Each rank runs the f64 decoder ([`packshard_reference::decoder`]) on its
//! share of each microbatch ([`packshard_reference::step::cp_partition`])
//! with [`MpiRing`] as the attention: the key/value chunks go point to point
//! around the CP ring (`MPI_Sendrecv` to `c + 1`, from `c - 1`), each
//! arriving chunk's partial result merged by log-sum-exp
//! ([`packshard_reference::step::ring`], the kernels the single-process
//! reference runs); in the backward the chunk travels with its key/value
//! gradients and arrives home after `C` hops. The loss, the token losses and
//! the parameter gradients are summed over every rank by one
//! `MPI_Allreduce` (sum).
//!
//! Why a thread: the decoder calls its attention through
//! [`AttentionOp`], which is `Send + Sync`, and an MPI communicator is
//! neither. The decoder runs on a scoped worker thread; the rank's main
//! thread owns the communicators and serves the worker's ring shifts
//! through channels ([`serve_ring`]), so no MPI call leaves the thread that
//! initialised MPI and no `unsafe` is needed.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Mutex;

use mpi::collective::SystemOperation;
use mpi::point_to_point::send_receive_into;
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::traits::*;
use ndarray::{Array3, ArrayView3};
use packshard_reference::attention::{AttentionGrads, AttentionOutput};
use packshard_reference::decoder::{DecoderAttention, DecoderInput, DecoderModel};
use packshard_reference::ops::{AttentionOp, AttentionSupport, Grad, Masked, Qkv, Varlen};
use packshard_reference::step::ring::{chunk_backward, delta, finish, merge, partial_forward};
use packshard_reference::step::{
    rank_meta, step_weights, Layout, StepBatch, StepFault, StepResult, TokenMeta,
};
use packshard_reference::{Error, Result};

/// The worker's end of the ring: a shift sends a buffer to the next CP rank
/// and returns the previous rank's buffer of the same length.
#[derive(Debug)]
pub struct RingChannel {
    to_comm: Mutex<Sender<Vec<f64>>>,
    from_comm: Mutex<Receiver<Vec<f64>>>,
}

impl RingChannel {
    fn shift(&self, buf: Vec<f64>) -> Result<Vec<f64>> {
        let gone = || Error::invalid("ring", "the communication thread has stopped");
        self.to_comm
            .lock()
            .map_err(|_| gone())?
            .send(buf)
            .map_err(|_| gone())?;
        self.from_comm
            .lock()
            .map_err(|_| gone())?
            .recv()
            .map_err(|_| gone())
    }
}

/// Serves the worker's ring shifts on `cp_comm` until the worker drops its
/// end: each buffer is sent to CP rank `c + 1` and replaced by the one from
/// `c - 1` (one `MPI_Sendrecv`).
pub fn serve_ring(
    cp_comm: &SimpleCommunicator,
    requests: Receiver<Vec<f64>>,
    replies: Sender<Vec<f64>>,
) {
    let (c, size) = (cp_comm.rank(), cp_comm.size());
    let (next, prev) = ((c + 1) % size, (c + size - 1) % size);
    while let Ok(buf) = requests.recv() {
        let mut got = vec![0.0; buf.len()];
        send_receive_into(
            &buf[..],
            &cp_comm.process_at_rank(next),
            &mut got[..],
            &cp_comm.process_at_rank(prev),
        );
        if replies.send(got).is_err() {
            break;
        }
    }
}

/// Ring attention of one CP rank: its queries stay, the key/value chunks
/// (and in the backward their gradients) travel around the ring.
/// `metas[c]: [n_local]` is CP rank `c`'s token metadata (every rank derives
/// every rank's from the same `cu_seqlens`).
#[derive(Debug)]
pub struct MpiRing {
    /// This CP rank.
    pub rank: usize,
    /// Per CP rank.
    pub metas: Vec<Vec<TokenMeta>>,
    /// Merge with the max rescale (false: docs/FAULTS.md D6).
    pub rescale: bool,
    channel: RingChannel,
}

fn flat(parts: &[ArrayView3<f64>]) -> Vec<f64> {
    parts.iter().flat_map(|a| a.iter().copied()).collect()
}

fn unflat(buf: &[f64], dims: (usize, usize, usize), count: usize) -> Result<Vec<Array3<f64>>> {
    let len = dims.0 * dims.1 * dims.2;
    if buf.len() != len * count {
        return Err(Error::ShapeMismatch {
            field: "ring buffer".into(),
            expected: format!("[{count} x {dims:?}]"),
            actual: vec![buf.len()],
        });
    }
    buf.chunks(len.max(1))
        .take(count)
        .map(|c| {
            Array3::from_shape_vec(dims, c.to_vec())
                .map_err(|e| Error::invalid("ring buffer", e.to_string()))
        })
        .collect()
}

impl MpiRing {
    fn cp(&self) -> usize {
        self.metas.len()
    }
}

impl AttentionOp for MpiRing {
    fn support(&self) -> AttentionSupport {
        AttentionSupport::ALL
    }

    fn varlen_forward(&self, x: Qkv<'_>, p: &Varlen<'_>) -> Result<AttentionOutput> {
        let cp = self.cp();
        let r = self.rank;
        let dims = x.k.dim();
        let mut acc = partial_forward(x.q, &self.metas[r], x.k, x.v, &self.metas[r], p.scale);
        let mut kv = flat(&[x.k, x.v]);
        for step in 1..cp {
            kv = self.channel.shift(kv)?;
            let src = (r + cp - step) % cp;
            let t = unflat(&kv, dims, 2)?;
            let part = partial_forward(
                x.q,
                &self.metas[r],
                t[0].view(),
                t[1].view(),
                &self.metas[src],
                p.scale,
            );
            merge(&mut acc, &part, self.rescale);
        }
        Ok(finish(acc))
    }

    fn varlen_backward(&self, x: Qkv<'_>, p: &Varlen<'_>, g: Grad<'_>) -> Result<AttentionGrads> {
        let cp = self.cp();
        let r = self.rank;
        let dims = x.k.dim();
        let d = delta(g.fwd, g.grad_output);
        let mut dq = Array3::zeros(x.q.dim());
        let zeros = Array3::<f64>::zeros(dims);
        // The bundle (k, v, dk, dv) of CP rank r - step.
        let mut bundle = vec![x.k.to_owned(), x.v.to_owned(), zeros.clone(), zeros];
        for step in 0..cp {
            let src = (r + cp - step) % cp;
            let [k, v, dk, dv] = &mut bundle[..] else {
                unreachable!("four tensors")
            };
            chunk_backward(
                Qkv::new(x.q, k.view(), v.view()),
                &self.metas[r],
                &self.metas[src],
                p.scale,
                &g.fwd.lse,
                &d,
                g.grad_output,
                &mut dq,
                dk,
                dv,
            );
            if cp > 1 {
                let views: Vec<ArrayView3<f64>> = bundle.iter().map(|a| a.view()).collect();
                bundle = unflat(&self.channel.shift(flat(&views))?, dims, 4)?;
            }
        }
        let mut it = bundle.into_iter().skip(2);
        let (grad_k, grad_v) = (it.next(), it.next());
        Ok(AttentionGrads {
            grad_q: dq,
            grad_k: grad_k.unwrap_or_else(|| Array3::zeros(dims)),
            grad_v: grad_v.unwrap_or_else(|| Array3::zeros(dims)),
        })
    }

    fn masked_forward(&self, _: Qkv<'_>, _: Masked<'_>) -> Result<AttentionOutput> {
        Err(Error::invalid(
            "attention",
            "ring attention runs the varlen (THD) layout only",
        ))
    }

    fn masked_backward(&self, _: Qkv<'_>, _: Masked<'_>, _: Grad<'_>) -> Result<AttentionGrads> {
        Err(Error::invalid(
            "attention",
            "ring attention runs the varlen (THD) layout only",
        ))
    }
}

/// This process's place: `(data-parallel rank, CP rank)` of world rank `w`.
pub fn place(layout: &Layout, w: usize) -> (usize, usize) {
    (w / layout.cp, w % layout.cp)
}

/// The step with one process per rank (module docs): every rank's result
/// summed over `world`, so every rank returns the whole step's loss, token
/// losses and gradients. `cp_comm` is this rank's CP communicator (its
/// data-parallel rank's `C` processes, in CP-rank order).
///
/// # Errors
/// [`Error::InvalidArgument`] naming `ranks` when the world is not `C D`
/// processes; the step's and the decoder's. An error on one rank leaves the
/// others waiting in MPI: the caller aborts the job.
pub fn mpi_step(
    world: &SimpleCommunicator,
    cp_comm: &SimpleCommunicator,
    model: &DecoderModel,
    batch: &StepBatch,
    layout: &Layout,
    fault: Option<StepFault>,
) -> Result<StepResult> {
    let size = world.size() as usize;
    if size != layout.cp * layout.dp {
        return Err(Error::invalid(
            "ranks",
            format!("{size} processes for C x D = {} x {}", layout.cp, layout.dp),
        ));
    }
    let (d, c) = place(layout, world.rank() as usize);
    let mbs = step_weights(batch, layout, fault)?;
    let mut grads = model.params.zeros_like();
    let mut loss = 0.0;
    let offsets: Vec<usize> = batch
        .docs
        .iter()
        .scan(0, |o, doc| {
            let at = *o;
            *o += doc.len();
            Some(at)
        })
        .collect();
    let mut token_losses = vec![0.0; batch.docs.iter().map(Vec::len).sum()];
    for mb in mbs.iter().filter(|m| m.d == d) {
        let part = &mb.partition;
        let share = &part.ranks[c];
        let metas = (0..layout.cp)
            .map(|r| {
                rank_meta(
                    r,
                    layout.cp,
                    &part.cu_seqlens,
                    &part.cu_seqlens_padded,
                    fault,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        let (to_comm, requests) = channel();
        let (replies, from_comm) = channel();
        let op = MpiRing {
            rank: c,
            metas,
            rescale: fault != Some(StepFault::D6NoRescale),
            channel: RingChannel {
                to_comm: Mutex::new(to_comm),
                from_comm: Mutex::new(from_comm),
            },
        };
        let attention = DecoderAttention::Varlen {
            cu_seqlens: share.cu_seqlens_padded.clone(),
        };
        let input = DecoderInput {
            input_ids: &share.input_ids,
            position_ids: &share.position_ids,
            attention: &attention,
            past: None,
        };
        let weights = &mb.weights[c];
        let run = std::thread::scope(|s| {
            let worker = s.spawn(move || model.run(&op, &input, &share.labels, weights));
            serve_ring(cp_comm, requests, replies);
            match worker.join() {
                Ok(r) => r,
                Err(panic) => std::panic::resume_unwind(panic),
            }
        })?;
        loss += run.loss;
        packshard_reference::step::run::add_grads(&mut grads, &run.grads.params);
        for (t, ((&j, &p), &real)) in share
            .doc
            .iter()
            .zip(&share.position_ids)
            .zip(&share.real)
            .enumerate()
        {
            if real {
                token_losses[offsets[mb.docs[j]] + p] = run.token_losses[t];
            }
        }
    }
    // One all-reduce of everything: [loss, token losses, gradients].
    let mut local = vec![loss];
    local.extend_from_slice(&token_losses);
    for (_, t) in grads.named() {
        local.extend(t.iter().copied());
    }
    let mut sum = vec![0.0; local.len()];
    world.all_reduce_into(&local[..], &mut sum[..], SystemOperation::sum());
    let mut at = 1 + token_losses.len();
    for (_, mut t) in grads.named_mut() {
        for (x, &y) in t.iter_mut().zip(&sum[at..]) {
            *x = y;
        }
        at += t.len();
    }
    let token_losses = batch
        .docs
        .iter()
        .zip(&offsets)
        .map(|(doc, &o)| sum[1 + o..1 + o + doc.len()].to_vec())
        .collect();
    Ok(StepResult {
        loss: sum[0],
        token_losses,
        grads,
    })
}
