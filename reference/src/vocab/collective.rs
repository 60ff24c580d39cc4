//! Collectives between vocabulary shards: the [`Collective`] trait, written
//! per rank (SPMD, as MPI is), and [`InProcess`], which runs `p` ranks of the
//! same per-rank code in one process.
//!
//! ## What is counted
//!
//! - a **barrier** is one synchronisation point: one call of
//!   [`Collective::all_reduce`] (however many buffers it carries; they are
//!   reduced together, so none of them can depend on another's result) or of
//!   [`Collective::broadcast`]. This is the paper's *communication barrier*
//!   (arXiv:2411.05288 §4): a point where a rank must wait for all the others;
//! - a **call** is one reduced buffer (one [`Reduce`]) or one broadcast;
//! - **elements** are the f64 values a rank contributes to its calls (a
//!   buffer's length; a [`Reduce::Merge`] record of `width` values counts
//!   `width` per row). A ring all-reduce moves `2 (p - 1) / p` times that per
//!   rank over the wire.
//!
//! Counts are the same on every rank and do not depend on `p` (with `p = 1`
//! every collective is still issued, and is the identity).
//!
//! ## Determinism
//!
//! [`InProcess`] reduces contributions as a left fold in rank order `0, 1,
//! ..., p - 1`, once, and hands every rank the same result, so all ranks hold
//! bitwise-identical values whatever the thread scheduling. An MPI
//! implementation may associate differently; its results then agree to
//! rounding, not bitwise.
//!
//! ## Threads
//!
//! The reference crate has no threads except here: [`run_ranks`] runs the
//! ranks as scoped threads only to *simulate* `p` processes. Each rank's
//! compute is the plain single-threaded f64 code of [`super::sharded`].

use std::cell::Cell;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use serde::Serialize;

use crate::error::{Error, Result};

/// An associative merge of one record into another (both `width` values):
/// `acc = acc ⊕ next`. Used for reductions that are neither a sum nor a max,
/// such as the online-softmax merge of `(m, s)` pairs. MPI: a user-defined,
/// non-commutative `MPI_Op` over a contiguous type of `width` doubles.
pub type MergeFn = fn(acc: &mut [f64], next: &[f64]);

/// One buffer of an all-reduce and how it is reduced.
pub enum Reduce<'a> {
    /// Element-wise maximum (a NaN anywhere gives NaN: faults stay visible).
    Max(&'a mut [f64]),
    /// Element-wise sum, added in rank order.
    Sum(&'a mut [f64]),
    /// Records of `width` values (`data.len()` a multiple of `width`), each
    /// merged across ranks with `op` in rank order.
    Merge {
        /// The records, row after row.
        data: &'a mut [f64],
        /// Values per record.
        width: usize,
        /// The merge.
        op: MergeFn,
    },
}

impl Reduce<'_> {
    /// The buffer being reduced, whatever the reduction.
    pub fn data(&self) -> &[f64] {
        match self {
            Reduce::Max(d) | Reduce::Sum(d) | Reduce::Merge { data: d, .. } => d,
        }
    }

    fn data_mut(&mut self) -> &mut [f64] {
        match self {
            Reduce::Max(d) | Reduce::Sum(d) | Reduce::Merge { data: d, .. } => d,
        }
    }

    fn kind(&self) -> Kind {
        match self {
            Reduce::Max(_) => Kind::Max,
            Reduce::Sum(_) => Kind::Sum,
            Reduce::Merge { width, op, .. } => Kind::Merge(*width, *op),
        }
    }
}

/// Counters of the collectives one rank issued (see the module docs for
/// what each counts).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize)]
pub struct CollectiveCounts {
    /// Reduced buffers and broadcasts.
    pub calls: u64,
    /// Synchronisation points.
    pub barriers: u64,
    /// f64 values contributed.
    pub elements: u64,
}

impl CollectiveCounts {
    /// These counts after one more barrier that reduced `calls` buffers of
    /// `elements` values in all (what every [`Collective`] counts per call).
    #[must_use]
    pub fn barrier(self, calls: u64, elements: usize) -> Self {
        CollectiveCounts {
            calls: self.calls + calls,
            barriers: self.barriers + 1,
            elements: self.elements + elements as u64,
        }
    }
}

/// Collective communication between the `p` ranks that hold the vocabulary
/// shards, as seen by one rank. Every rank calls the same collectives in the
/// same order with buffers of the same lengths (SPMD).
pub trait Collective {
    /// This rank, in `0..size()`.
    fn rank(&self) -> usize;
    /// The number of ranks `p`.
    fn size(&self) -> usize;
    /// One barrier: every buffer of `ops` is replaced by its reduction over
    /// all ranks.
    ///
    /// # Errors
    /// When the ranks disagree on the buffers, or a rank stopped.
    fn all_reduce(&self, ops: &mut [Reduce<'_>]) -> Result<()>;
    /// One barrier: `buf` is replaced by rank `root`'s `buf`.
    ///
    /// # Errors
    /// As [`Collective::all_reduce`]; `root >= size()`.
    fn broadcast(&self, root: usize, buf: &mut [f64]) -> Result<()>;
    /// What this rank has issued so far.
    fn counts(&self) -> CollectiveCounts;

    /// One barrier with one element-wise maximum.
    ///
    /// # Errors
    /// As [`Collective::all_reduce`].
    fn all_reduce_max(&self, buf: &mut [f64]) -> Result<()> {
        self.all_reduce(&mut [Reduce::Max(buf)])
    }

    /// One barrier with one element-wise sum.
    ///
    /// # Errors
    /// As [`Collective::all_reduce`].
    fn all_reduce_sum(&self, buf: &mut [f64]) -> Result<()> {
        self.all_reduce(&mut [Reduce::Sum(buf)])
    }
}

/// The most ranks [`run_ranks`] simulates (each is a thread).
pub const MAX_RANKS: usize = 64;

#[derive(Clone, Copy)]
enum Kind {
    Max,
    Sum,
    Merge(usize, MergeFn),
}

impl Kind {
    fn describe(&self) -> String {
        match self {
            Kind::Max => "max".into(),
            Kind::Sum => "sum".into(),
            Kind::Merge(w, _) => format!("merge(width {w})"),
        }
    }
}

/// What one rank brought to a collective.
struct Deposit {
    /// `None` for an all-reduce, `Some(root)` for a broadcast.
    root: Option<usize>,
    kinds: Vec<Kind>,
    buffers: Vec<Vec<f64>>,
}

impl Deposit {
    fn signature(&self) -> String {
        let bufs: Vec<String> = self
            .kinds
            .iter()
            .zip(&self.buffers)
            .map(|(k, b)| format!("{} of {}", k.describe(), b.len()))
            .collect();
        match self.root {
            None => format!("all_reduce[{}]", bufs.join(", ")),
            Some(r) => format!("broadcast(root {r}, {})", self.buffers[0].len()),
        }
    }
}

type Outcome = std::result::Result<Vec<Vec<f64>>, String>;

struct HubState {
    /// Completed collectives.
    generation: u64,
    arrived: usize,
    deposits: Vec<Option<Deposit>>,
    /// The result of the last completed collective.
    outcome: Option<Arc<Outcome>>,
    /// Ranks whose program has returned (or panicked).
    stopped: Vec<bool>,
    /// A rank whose program failed, and why.
    failure: Option<(usize, String)>,
}

/// The shared meeting point of the ranks of one [`run_ranks`].
struct Hub {
    size: usize,
    state: Mutex<HubState>,
    changed: Condvar,
}

impl Hub {
    fn new(size: usize) -> Self {
        Hub {
            size,
            state: Mutex::new(HubState {
                generation: 0,
                arrived: 0,
                deposits: (0..size).map(|_| None).collect(),
                outcome: None,
                stopped: vec![false; size],
                failure: None,
            }),
            changed: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, HubState> {
        // A panicking rank never holds the lock across user code, but stay
        // usable if it did: the state is only ever updated whole.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Brings `deposit` to the current collective and waits for the others.
    fn exchange(&self, rank: usize, deposit: Deposit) -> std::result::Result<Arc<Outcome>, String> {
        let mut st = self.lock();
        if let Some((r, why)) = &st.failure {
            return Err(format!("rank {r} failed ({why})"));
        }
        let generation = st.generation;
        st.deposits[rank] = Some(deposit);
        st.arrived += 1;
        if st.arrived == self.size {
            let deposits: Vec<Deposit> = st.deposits.iter_mut().filter_map(Option::take).collect();
            st.outcome = Some(Arc::new(reduce(&deposits)));
            st.arrived = 0;
            st.generation += 1;
            self.changed.notify_all();
        } else {
            while st.generation == generation {
                if let Some((r, why)) = &st.failure {
                    return Err(format!("rank {r} failed ({why})"));
                }
                if let Some(r) = st.stopped.iter().position(|&s| s) {
                    return Err(format!(
                        "rank {r} ended its program while rank {rank} waits at collective #{generation}"
                    ));
                }
                st = self.changed.wait(st).unwrap_or_else(|e| e.into_inner());
            }
        }
        Ok(st
            .outcome
            .clone()
            .expect("a completed collective has an outcome"))
    }

    fn stop(&self, rank: usize, failure: Option<String>) {
        let mut st = self.lock();
        st.stopped[rank] = true;
        if let Some(why) = failure {
            st.failure.get_or_insert((rank, why));
        }
        self.changed.notify_all();
    }
}

/// Reduces the deposits of all ranks (in rank order), or says how they disagree.
fn reduce(deposits: &[Deposit]) -> Outcome {
    let first = &deposits[0];
    for (r, d) in deposits.iter().enumerate().skip(1) {
        let same = d.root == first.root
            && d.buffers.len() == first.buffers.len()
            && d.buffers
                .iter()
                .zip(&first.buffers)
                .all(|(a, b)| a.len() == b.len())
            && d.kinds
                .iter()
                .zip(&first.kinds)
                .all(|(a, b)| a.describe() == b.describe());
        if !same {
            return Err(format!(
                "rank {r} issued {} where rank 0 issued {}",
                d.signature(),
                first.signature()
            ));
        }
    }
    if let Some(root) = first.root {
        return Ok(vec![deposits[root].buffers[0].clone()]);
    }
    let mut out = Vec::with_capacity(first.buffers.len());
    for (k, kind) in first.kinds.iter().enumerate() {
        let mut acc = first.buffers[k].clone();
        for d in &deposits[1..] {
            let next = &d.buffers[k];
            match kind {
                Kind::Max => {
                    for (a, &b) in acc.iter_mut().zip(next) {
                        *a = if a.is_nan() || b.is_nan() {
                            f64::NAN
                        } else {
                            a.max(b)
                        };
                    }
                }
                Kind::Sum => {
                    for (a, &b) in acc.iter_mut().zip(next) {
                        *a += b;
                    }
                }
                Kind::Merge(width, op) => {
                    for (a, b) in acc.chunks_mut(*width).zip(next.chunks(*width)) {
                        op(a, b);
                    }
                }
            }
        }
        out.push(acc);
    }
    Ok(out)
}

/// One rank of a [`run_ranks`] simulation: a [`Collective`] whose peers are
/// the other threads of the same call.
pub struct InProcess<'h> {
    hub: &'h Hub,
    rank: usize,
    counts: Cell<CollectiveCounts>,
    aborted: Cell<bool>,
}

impl InProcess<'_> {
    fn count(&self, calls: u64, elements: usize) {
        self.counts.set(self.counts.get().barrier(calls, elements));
    }

    fn run(&self, deposit: Deposit) -> Result<Vec<Vec<f64>>> {
        let generation = self.counts.get().barriers;
        let outcome = self.hub.exchange(self.rank, deposit).map_err(|why| {
            self.aborted.set(true);
            collective_error(self.rank, generation, &why)
        })?;
        match &*outcome {
            Ok(buffers) => Ok(buffers.clone()),
            Err(why) => Err(collective_error(self.rank, generation, why)),
        }
    }
}

fn collective_error(rank: usize, generation: u64, why: &str) -> Error {
    Error::invalid(
        "collective",
        format!("rank {rank}, collective #{generation}: {why}"),
    )
}

/// Refuses a [`Reduce::Merge`] buffer that is not whole records of its
/// width: the check every [`Collective`] makes before it reduces `ops`
/// (this in-process one and the pipeline's MPI one).
///
/// # Errors
/// [`Error::InvalidArgument`] naming `collective` and the buffer.
pub fn check_records(ops: &[Reduce<'_>]) -> Result<()> {
    for (k, op) in ops.iter().enumerate() {
        if let Reduce::Merge { data, width, .. } = op {
            if *width == 0 || data.len() % width != 0 {
                return Err(Error::invalid(
                    "collective",
                    format!(
                        "buffer {k}: {} values are not records of width {width}",
                        data.len()
                    ),
                ));
            }
        }
    }
    Ok(())
}

impl Collective for InProcess<'_> {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.hub.size
    }

    fn all_reduce(&self, ops: &mut [Reduce<'_>]) -> Result<()> {
        check_records(ops)?;
        let elements = ops.iter().map(|o| o.data().len()).sum();
        self.count(ops.len() as u64, elements);
        let deposit = Deposit {
            root: None,
            kinds: ops.iter().map(Reduce::kind).collect(),
            buffers: ops.iter().map(|o| o.data().to_vec()).collect(),
        };
        let reduced = self.run(deposit)?;
        for (op, r) in ops.iter_mut().zip(reduced) {
            op.data_mut().copy_from_slice(&r);
        }
        Ok(())
    }

    fn broadcast(&self, root: usize, buf: &mut [f64]) -> Result<()> {
        if root >= self.hub.size {
            return Err(Error::invalid(
                "root",
                format!(
                    "rank {root} does not exist; there are {} ranks",
                    self.hub.size
                ),
            ));
        }
        self.count(1, buf.len());
        let deposit = Deposit {
            root: Some(root),
            kinds: vec![Kind::Sum],
            buffers: vec![buf.to_vec()],
        };
        let out = self.run(deposit)?;
        buf.copy_from_slice(&out[0]);
        Ok(())
    }

    fn counts(&self) -> CollectiveCounts {
        self.counts.get()
    }
}

/// Marks a rank stopped when its program ends, also by panic, so that no
/// peer waits for it forever.
struct StopGuard<'h> {
    hub: &'h Hub,
    rank: usize,
    failure: Option<String>,
}

impl Drop for StopGuard<'_> {
    fn drop(&mut self) {
        let failure = if std::thread::panicking() {
            Some("panicked".to_string())
        } else {
            self.failure.take()
        };
        self.hub.stop(self.rank, failure);
    }
}

/// What one simulated rank returned.
#[derive(Debug, Clone, PartialEq)]
pub struct RankResult<T> {
    /// The rank's output.
    pub output: T,
    /// The collectives it issued.
    pub counts: CollectiveCounts,
}

/// Runs `program` as `p` ranks (SPMD): rank `r` gets an [`InProcess`]
/// collective whose peers are the other ranks. Returns every rank's output in
/// rank order.
///
/// # Errors
/// `p` outside `1..=MAX_RANKS`; otherwise the error of the lowest rank whose
/// program failed on its own (ranks that failed only because a peer did are
/// skipped). A collective that the ranks issue differently (other buffers, or
/// a rank that stops early) is an error on every rank waiting for it, never a
/// hang.
///
/// # Panics
/// Re-raises the panic of the lowest rank that panicked, after all ranks have
/// stopped.
pub fn run_ranks<T, F>(p: usize, program: F) -> Result<Vec<RankResult<T>>>
where
    T: Send,
    F: Fn(&dyn Collective) -> Result<T> + Sync,
{
    if p == 0 || p > MAX_RANKS {
        return Err(Error::invalid(
            "num_shards",
            format!("{p} ranks; 1..={MAX_RANKS} can be simulated"),
        ));
    }
    let hub = Hub::new(p);
    let joined: Vec<_> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..p)
            .map(|rank| {
                let hub = &hub;
                let program = &program;
                scope.spawn(move || {
                    let mut guard = StopGuard {
                        hub,
                        rank,
                        failure: None,
                    };
                    let comm = InProcess {
                        hub,
                        rank,
                        counts: Cell::new(CollectiveCounts::default()),
                        aborted: Cell::new(false),
                    };
                    let out = program(&comm);
                    if let Err(e) = &out {
                        if !comm.aborted.get() {
                            guard.failure = Some(e.to_string());
                        }
                    }
                    (out, comm.counts.get(), comm.aborted.get())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join()).collect()
    });
    let mut results = Vec::with_capacity(p);
    let mut panic = None;
    for j in joined {
        match j {
            Ok(r) => results.push(r),
            Err(payload) => {
                panic.get_or_insert(payload);
            }
        }
    }
    if let Some(payload) = panic {
        std::panic::resume_unwind(payload);
    }
    let genuine = results
        .iter()
        .position(|(out, _, aborted)| out.is_err() && !aborted)
        .or_else(|| results.iter().position(|(out, _, _)| out.is_err()));
    if let Some(r) = genuine {
        let (out, _, _) = results.swap_remove(r);
        return Err(out.err().expect("position found an error"));
    }
    Ok(results
        .into_iter()
        .map(|(out, counts, _)| RankResult {
            output: out.expect("no rank failed"),
            counts,
        })
        .collect())
}
