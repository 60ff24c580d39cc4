//! The [`Collective`] trait of `packshard-reference` over an MPI
//! communicator, and the trace of every communication a rank does.
//!
//! ## How each barrier is implemented
//!
//! One [`Collective::all_reduce`] call (one barrier, however many buffers)
//! is **one `MPI_Allgather`** of every rank's buffers laid end to end,
//! followed on every rank by the same left fold in rank order `0, 1, ..., p -
//! 1` that [`packshard_reference::vocab::InProcess`] does: element-wise max
//! (NaN stays NaN), element-wise sum, or the [`Reduce::Merge`] function
//! applied record by record.
//!
//! Why not `MPI_Allreduce` with a user-defined, non-commutative `MPI_Op` for
//! the merge: MPI leaves the association order of a reduction to the
//! implementation (a tree or a ring, different on different ranks), so the
//! merged statistics — and with alg2 the input-gradient partials rescaled
//! inside the merge — would agree across ranks only to rounding. The
//! all-gather and fold gives every rank bit-identical results, the same bits
//! as the in-process reference ranks, for `p` times the receive volume of a
//! reduction (the records are `[n]` or `[n, 2 hidden + 4]`, small next to the
//! `[n, v / p]` logits), and needs no libffi for callback operations.
//!
//! Each contribution starts with a signature of the call (the buffers'
//! kinds and lengths): ranks that issue different all-reduces get an error
//! naming the rank, never a silently wrong sum. Buffers of different total
//! length make `MPI_Allgather` itself fail, which aborts the job (MPI's
//! default error handler).
//!
//! [`Collective::broadcast`] is one `MPI_Bcast`.

use std::cell::{Cell, RefCell};

use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::traits::*;
use packshard_reference::vocab::collective::{check_records, Collective, CollectiveCounts, Reduce};
use packshard_reference::{Error, Result};

use crate::schedule::Op;

/// What a traced interval was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventClass {
    /// A schedule op (its whole span, communication inside included).
    Op,
    /// A collective (the k-th on every rank is the same collective).
    Collective,
    /// A point-to-point exchange with `peer`.
    P2p {
        /// The other rank.
        peer: usize,
    },
}

/// One traced interval of one rank, in seconds of `MPI_Wtime`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Event {
    /// What it was.
    pub class: EventClass,
    /// The schedule op it belongs to.
    pub op: Op,
    /// Start.
    pub start: f64,
    /// End.
    pub end: f64,
}

/// The events of one rank in one iteration.
#[derive(Debug, Default)]
pub struct Trace {
    events: RefCell<Vec<Event>>,
    current: Cell<Option<Op>>,
}

impl Trace {
    /// Now, in seconds (`MPI_Wtime`: one clock on one node).
    pub fn now() -> f64 {
        mpi::time()
    }

    /// Marks the schedule op now running.
    pub fn set_op(&self, op: Op) {
        self.current.set(Some(op));
    }

    /// Records an interval of the current op.
    pub fn record(&self, class: EventClass, start: f64, end: f64) {
        let op = self.current.get().unwrap_or(Op::Forward(0));
        self.events.borrow_mut().push(Event {
            class,
            op,
            start,
            end,
        });
    }

    /// The events so far.
    pub fn events(&self) -> Vec<Event> {
        self.events.borrow().clone()
    }

    /// Forgets the events.
    pub fn clear(&self) {
        self.events.borrow_mut().clear();
    }
}

/// One rank's [`Collective`] over an MPI communicator (see the module docs).
pub struct MpiCollective<'c> {
    comm: &'c SimpleCommunicator,
    counts: Cell<CollectiveCounts>,
    trace: &'c Trace,
}

impl<'c> MpiCollective<'c> {
    /// The collective of this process in `comm`, tracing into `trace`.
    pub fn new(comm: &'c SimpleCommunicator, trace: &'c Trace) -> Self {
        MpiCollective {
            comm,
            counts: Cell::new(CollectiveCounts::default()),
            trace,
        }
    }

    fn count(&self, calls: u64, elements: usize) {
        self.counts.set(self.counts.get().barrier(calls, elements));
    }
}

/// The signature of an all-reduce: kinds and lengths, hashed (FNV-1a) into
/// the bits of one f64 that leads every contribution.
fn signature(ops: &[Reduce<'_>]) -> f64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut mix = |x: u64| {
        for b in x.to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    };
    for op in ops.iter() {
        let (kind, len) = match op {
            Reduce::Max(d) => (1, d.len()),
            Reduce::Sum(d) => (2, d.len()),
            Reduce::Merge { data, width, .. } => (3 + 16 * *width as u64, data.len()),
        };
        mix(kind);
        mix(len as u64);
    }
    // Keep it a finite value so no MPI layer ever sees a signalling NaN.
    f64::from_bits((h >> 12) | 0x3ff0_0000_0000_0000)
}

impl Collective for MpiCollective<'_> {
    fn rank(&self) -> usize {
        self.comm.rank() as usize
    }

    fn size(&self) -> usize {
        self.comm.size() as usize
    }

    fn all_reduce(&self, ops: &mut [Reduce<'_>]) -> Result<()> {
        check_records(ops)?;
        let generation = self.counts.get().barriers;
        let elements: usize = ops.iter().map(|o| o.data().len()).sum();
        self.count(ops.len() as u64, elements);
        let sig = signature(ops);
        let len = 1 + elements;
        let mut send = Vec::with_capacity(len);
        send.push(sig);
        for op in ops.iter() {
            send.extend_from_slice(op.data());
        }
        let p = self.size();
        let mut recv = vec![0.0f64; len * p];
        let start = Trace::now();
        self.comm.all_gather_into(&send[..], &mut recv[..]);
        self.trace
            .record(EventClass::Collective, start, Trace::now());
        if let Some(r) = (0..p).find(|&r| recv[r * len].to_bits() != sig.to_bits()) {
            return Err(Error::invalid(
                "collective",
                format!(
                    "rank {}, collective #{generation}: rank {r} issued a different all-reduce (other buffer kinds or lengths)",
                    self.rank()
                ),
            ));
        }
        let mut offset = 1;
        for op in ops.iter_mut() {
            let n = op.data().len();
            let part = |r: usize| &recv[r * len + offset..r * len + offset + n];
            match op {
                Reduce::Max(acc) => {
                    acc.copy_from_slice(part(0));
                    for r in 1..p {
                        for (a, &b) in acc.iter_mut().zip(part(r)) {
                            *a = if a.is_nan() || b.is_nan() {
                                f64::NAN
                            } else {
                                a.max(b)
                            };
                        }
                    }
                }
                Reduce::Sum(acc) => {
                    acc.copy_from_slice(part(0));
                    for r in 1..p {
                        for (a, &b) in acc.iter_mut().zip(part(r)) {
                            *a += b;
                        }
                    }
                }
                Reduce::Merge { data, width, op } => {
                    data.copy_from_slice(part(0));
                    for r in 1..p {
                        for (a, b) in data.chunks_mut(*width).zip(part(r).chunks(*width)) {
                            op(a, b);
                        }
                    }
                }
            }
            offset += n;
        }
        Ok(())
    }

    fn broadcast(&self, root: usize, buf: &mut [f64]) -> Result<()> {
        if root >= self.size() {
            return Err(Error::invalid(
                "root",
                format!(
                    "rank {root} does not exist; there are {} ranks",
                    self.size()
                ),
            ));
        }
        self.count(1, buf.len());
        let start = Trace::now();
        self.comm.process_at_rank(root as i32).broadcast_into(buf);
        self.trace
            .record(EventClass::Collective, start, Trace::now());
        Ok(())
    }

    fn counts(&self) -> CollectiveCounts {
        self.counts.get()
    }
}
