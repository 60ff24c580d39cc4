//! A counting global allocator: the heap bytes live and their peak, so that
//! memory figures (the fused cross-entropy's peak in `packshard bench`, a
//! pipeline rank's peak activations) are *measured*, not modelled.
//!
//! A binary installs [`CountingAlloc`] as its `#[global_allocator]`;
//! without it every count reads 0 and [`peak_since`] reports `None`.
//!
//! And how the kernels' large outputs get their memory (issue 37): a binary
//! may keep what the process frees ([`keep_freed_memory`]); a library in
//! someone else's process keeps its own freed blocks instead ([`KeptBlocks`],
//! the Python extension's allocator); outputs are cleared on every thread
//! ([`zeros_parallel`]) and advised onto huge pages ([`huge_pages`]).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
static ACTIVE: AtomicBool = AtomicBool::new(false);

/// The system allocator, counting the bytes it hands out.
#[derive(Debug, Default, Clone, Copy)]
pub struct CountingAlloc;

fn grow(bytes: usize) {
    ACTIVE.store(true, Ordering::Relaxed);
    let live = LIVE.fetch_add(bytes, Ordering::Relaxed) + bytes;
    PEAK.fetch_max(live, Ordering::Relaxed);
}

// SAFETY: every call forwards to `System` with the same layout; the counters
// are plain atomics and never affect what is returned.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract is `System`'s.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grow(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as above.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            grow(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as above.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
            grow(new_size);
        }
        p
    }
}

/// Whether [`CountingAlloc`] is the global allocator (it has counted an
/// allocation).
pub fn is_counting() -> bool {
    ACTIVE.load(Ordering::Relaxed)
}

/// Heap bytes live now.
pub fn live_bytes() -> usize {
    LIVE.load(Ordering::Relaxed)
}

/// The most heap bytes live since the last [`reset_peak`].
pub fn peak_bytes() -> usize {
    PEAK.load(Ordering::Relaxed)
}

/// Starts a new peak at the bytes live now.
pub fn reset_peak() {
    PEAK.store(LIVE.load(Ordering::Relaxed), Ordering::Relaxed);
}

/// Runs `f` and returns its result with the peak heap bytes allocated
/// during it above what was live before (`None` without [`CountingAlloc`]).
pub fn peak_since<T>(f: impl FnOnce() -> T) -> (T, Option<usize>) {
    let base = live_bytes();
    PEAK.store(base, Ordering::Relaxed);
    let out = f();
    let peak = peak_bytes().saturating_sub(base);
    (out, is_counting().then_some(peak))
}

/// The largest block [`keep_freed_memory`] has glibc serve from its heap
/// (1 GiB: the BERT-base layer's largest temporary at 128 sequences, the
/// `[34,434 x 3,072]` feed-forward activation, is 423 MB).
pub const KEPT_BLOCK: usize = 1 << 30;

/// Has glibc's malloc keep what the process frees for its next
/// allocations, instead of handing it back to the kernel: blocks up to
/// [`KEPT_BLOCK`] come from the heap rather than from a mapping of their own
/// (`M_MMAP_THRESHOLD`; glibc's default maps everything over 32 MiB afresh
/// and unmaps it at `free`), and the heap is never trimmed
/// (`M_TRIM_THRESHOLD` -1). A process that allocates the same large
/// temporaries call after call (a layer's activations) then reuses them
/// instead of paying, every call, the kernel's page faults, page clearing
/// and the cross-core TLB flushes of each unmap (issue 37: the BERT-base
/// layer's forward and backward at 128 sequences, 7.97 s -> 6.93 s on 2
/// cores). The price: the process keeps its peak heap until it exits. It
/// holds for the main thread's allocations (glibc's main arena; its other
/// arenas map blocks over 64 MiB themselves), where the binary allocates
/// its layers' and kernels' outputs (`tests/kept_memory.rs`).
///
/// A binary's choice, made once at its start (`packshard` makes it; the
/// library and the Python package do not, since it changes the whole
/// process). Returns whether glibc took both settings (`false` on other
/// systems: nothing changes).
pub fn keep_freed_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let threshold = i32::try_from(KEPT_BLOCK).unwrap_or(i32::MAX);
        // SAFETY: mallopt only sets malloc's parameters; called before any
        // thread of the binary allocates concurrently (at start).
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, threshold) == 1
                && libc::mallopt(libc::M_TRIM_THRESHOLD, -1) == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    false
}

/// The smallest block [`KeptBlocks`] keeps (bytes): below it glibc's heap
/// already serves a freed block again (its mapping threshold rises to 32
/// MiB after such frees), and small blocks are not worth a lock.
pub const KEPT_MIN: usize = 4 << 20;

/// How many freed blocks [`KeptBlocks`] holds at most.
pub const KEPT_SLOTS: usize = 8;

/// The bytes [`KeptBlocks`] holds at most unless `PACKSHARD_KEPT_BYTES`
/// says otherwise: a BERT-base attention forward and backward over 16,384
/// tokens frees about 260 MiB of outputs and gradients per call.
pub const KEPT_BYTES_DEFAULT: usize = 512 << 20;

/// A global allocator that keeps up to [`KEPT_SLOTS`] freed blocks of at
/// least [`KEPT_MIN`] bytes (together at most `PACKSHARD_KEPT_BYTES`, read
/// once, bytes or `KiB`/`MiB`/`GiB` as `PACKSHARD_MEMORY_BUDGET`, default
/// [`KEPT_BYTES_DEFAULT`]; `0`, or a value that is not a byte count, keeps
/// nothing), freeing the
/// oldest to make room for the newest, and hands one back when a block of
/// exactly its size and alignment is asked for again; everything else goes
/// straight to the system allocator.
///
/// For a library inside someone else's process (the Python extension
/// installs it), where [`keep_freed_memory`]'s process-wide `mallopt` is
/// not ours to set: the same outputs asked for call after call (an attention
/// forward's `[n, h, d]`, 50 MiB at a batch's size) are otherwise mapped
/// afresh by glibc every call, and each of their pages faulted and cleared
/// by the kernel on first write (issue 37, one core: a forward 0.244 s with
/// fresh outputs against 0.224 s with kept ones). A block handed out again
/// by `alloc_zeroed` is cleared here; a fresh one comes cleared from the
/// kernel. The price: up to the limit stays allocated after the arrays are
/// gone (`tests/kept_blocks.rs`).
#[derive(Debug, Default, Clone, Copy)]
pub struct KeptBlocks;

/// One block [`KeptBlocks`] holds (`size` 0: an empty slot), `stamp` the
/// order of its free (the oldest goes first when room is needed).
#[derive(Clone, Copy)]
struct Slot {
    addr: usize,
    size: usize,
    align: usize,
    stamp: u64,
}

const EMPTY: Slot = Slot {
    addr: 0,
    size: 0,
    align: 0,
    stamp: 0,
};

/// The blocks [`KeptBlocks`] holds, and the last stamp given. A `Mutex`
/// allocates nothing (a futex on Linux).
static KEPT: std::sync::Mutex<([Slot; KEPT_SLOTS], u64)> =
    std::sync::Mutex::new(([EMPTY; KEPT_SLOTS], 0));

/// `PACKSHARD_KEPT_BYTES`, read on the first large free (usize::MAX: not
/// read yet).
static KEPT_LIMIT: AtomicUsize = AtomicUsize::new(usize::MAX);

fn kept_limit() -> usize {
    let limit = KEPT_LIMIT.load(Ordering::Relaxed);
    if limit != usize::MAX {
        return limit;
    }
    // Reading the environment allocates: only from `dealloc`, outside the
    // lock. Until it is read the limit is 0, so that a large free inside the
    // read (a value of megabytes) keeps nothing instead of reading it again.
    // A value that is not a byte count keeps nothing (the Python package
    // refuses to import with it, naming the variable).
    KEPT_LIMIT.store(0, Ordering::Relaxed);
    let limit = packshard_reference::limits::kept_bytes(KEPT_BYTES_DEFAULT as u64)
        .map_or(0, |b| usize::try_from(b).unwrap_or(usize::MAX))
        .min(usize::MAX - 1);
    KEPT_LIMIT.store(limit, Ordering::Relaxed);
    limit
}

impl KeptBlocks {
    /// A kept block of exactly `layout`, taken out of its slot.
    fn take(layout: Layout) -> Option<*mut u8> {
        if layout.size() < KEPT_MIN {
            return None;
        }
        let mut kept = KEPT.lock().unwrap_or_else(|e| e.into_inner());
        // The newest of that layout (the likeliest still in the cache).
        let slot = kept
            .0
            .iter_mut()
            .filter(|s| s.size == layout.size() && s.align == layout.align())
            .max_by_key(|s| s.stamp)?;
        let ptr = slot.addr as *mut u8;
        *slot = EMPTY;
        Some(ptr)
    }

    /// Whether the freed `ptr` of `layout` went into a slot (false: the
    /// caller frees it). Room is made by freeing the oldest kept blocks: a
    /// process whose shapes change (a benchmark's second size, a last batch)
    /// keeps the blocks of its current shape, not of its first.
    fn keep(ptr: *mut u8, layout: Layout) -> bool {
        // The floor first: reading the limit frees small strings.
        if layout.size() < KEPT_MIN {
            return false;
        }
        let limit = kept_limit();
        if layout.size() > limit {
            return false;
        }
        let mut evicted = [EMPTY; KEPT_SLOTS];
        {
            let mut kept = KEPT.lock().unwrap_or_else(|e| e.into_inner());
            let (slots, stamp) = &mut *kept;
            for out in evicted.iter_mut() {
                let held: usize = slots.iter().map(|s| s.size).sum();
                let full = slots.iter().all(|s| s.size > 0);
                if !full && held + layout.size() <= limit {
                    break;
                }
                let Some(oldest) = slots
                    .iter_mut()
                    .filter(|s| s.size > 0)
                    .min_by_key(|s| s.stamp)
                else {
                    break;
                };
                *out = std::mem::replace(oldest, EMPTY);
            }
            *stamp += 1;
            let slot = slots
                .iter_mut()
                .find(|s| s.size == 0)
                .expect("a slot was emptied above");
            *slot = Slot {
                addr: ptr as usize,
                size: layout.size(),
                align: layout.align(),
                stamp: *stamp,
            };
        }
        Self::free(&evicted);
        true
    }

    /// Hands `blocks` (taken out of their slots) back to the system
    /// allocator; returns their bytes.
    fn free(blocks: &[Slot]) -> usize {
        let mut bytes = 0;
        for b in blocks.iter().filter(|b| b.size > 0) {
            // SAFETY: the block came from `System` with this layout (kept by
            // `dealloc`, never handed out since, now out of its slot).
            unsafe {
                System.dealloc(
                    b.addr as *mut u8,
                    Layout::from_size_align_unchecked(b.size, b.align),
                )
            };
            bytes += b.size;
        }
        bytes
    }

    /// The bytes held now (freed blocks kept for reuse).
    pub fn held_bytes() -> usize {
        let kept = KEPT.lock().unwrap_or_else(|e| e.into_inner());
        kept.0.iter().map(|s| s.size).sum()
    }

    /// Hands every kept block back to the system allocator; returns the
    /// bytes released.
    pub fn release() -> usize {
        let taken = {
            let mut kept = KEPT.lock().unwrap_or_else(|e| e.into_inner());
            std::mem::replace(&mut kept.0, [EMPTY; KEPT_SLOTS])
        };
        Self::free(&taken)
    }
}

// SAFETY: every block comes from `System` and goes back to it (kept blocks
// are handed out only for their exact layout, or released).
unsafe impl GlobalAlloc for KeptBlocks {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        match Self::take(layout) {
            Some(ptr) => ptr,
            // SAFETY: the caller's contract, passed on.
            None => unsafe { System.alloc(layout) },
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        match Self::take(layout) {
            Some(ptr) => {
                // SAFETY: the block is `layout.size()` bytes, ours now.
                unsafe { ptr.write_bytes(0, layout.size()) };
                ptr
            }
            // SAFETY: the caller's contract, passed on.
            None => unsafe { System.alloc_zeroed(layout) },
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if !Self::keep(ptr, layout) {
            // SAFETY: the caller's contract, passed on.
            unsafe { System.dealloc(ptr, layout) };
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: `ptr` came from `System` (fresh or kept), with `layout`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// Asks the kernel to back the 2 MiB-aligned part of a fresh buffer with
/// transparent huge pages (`madvise(MADV_HUGEPAGE)`, Linux), before its
/// first write: an output of tens of MiB (attention's `[n, h, d]`) is
/// otherwise faulted in 4 KiB at a time, one page fault per 1,024 floats,
/// at every call (glibc maps allocations over 32 MiB afresh each time).
/// Advice only: on other systems, with huge pages off, or where the kernel
/// declines, nothing changes (the result of the call is ignored).
pub fn huge_pages(buf: &mut [f32]) {
    advise_huge(buf.as_mut_ptr() as usize, std::mem::size_of_val(buf));
}

/// [`huge_pages`] of the `bytes` at address `start` (a block this process
/// owns, initialised or not: the advice reads and writes nothing).
fn advise_huge(start: usize, bytes: usize) {
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        let end = start + bytes;
        let first = start.next_multiple_of(HUGE);
        let last = end / HUGE * HUGE;
        if last > first {
            // SAFETY: the range lies inside the caller's block (whole pages
            // within it); MADV_HUGEPAGE changes no contents, only how pages
            // are backed.
            unsafe {
                libc::madvise(
                    first as *mut libc::c_void,
                    last - first,
                    libc::MADV_HUGEPAGE,
                );
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (start, bytes);
}

/// A zeroed `f32` array of `shape` for a kernel's output, cleared by all of
/// rayon's threads: the block is asked for uninitialised (a block kept by
/// [`KeptBlocks`] comes back without the allocator's one-thread clearing),
/// advised onto huge pages ([`huge_pages`]) before its first write, and its
/// chunks zeroed in parallel, so that a fresh mapping's page faults are
/// taken on every core too (issue 37: an attention forward's 50 MiB output,
/// its backward's three gradients).
pub fn zeros_parallel<D: ndarray::Dimension>(shape: D) -> ndarray::Array<f32, D> {
    use rayon::prelude::*;
    let mut a = ndarray::Array::<f32, D>::uninit(shape);
    let flat = a.as_slice_mut().expect("a fresh array is contiguous");
    advise_huge(flat.as_ptr() as usize, std::mem::size_of_val(flat));
    flat.par_chunks_mut(1 << 16).for_each(|chunk| {
        for x in chunk {
            x.write(0.0);
        }
    });
    // SAFETY: every element was written (zero) just above.
    unsafe { a.assume_init() }
}

#[cfg(test)]
mod tests {
    use super::{huge_pages, zeros_parallel};

    #[test]
    fn zeros_parallel_is_all_zeros_whatever_the_shape() {
        for shape in [(0, 3, 4), (1, 1, 1), (3, 5, 7), (1 << 10, 12, 64)] {
            let z = zeros_parallel(ndarray::Ix3(shape.0, shape.1, shape.2));
            assert_eq!(z.dim(), shape);
            assert!(z.iter().all(|&x| x.to_bits() == 0), "{shape:?}");
        }
    }

    /// The advice changes no value: written before and after it (the
    /// kernel's `MADV_DONTNEED` would zero them), on buffers with no whole
    /// huge page, one, and several, aligned anyhow.
    #[test]
    fn huge_pages_keeps_every_value() {
        for n in [0usize, 1, 1 << 19, (1 << 22) + 3] {
            let mut buf: Vec<f32> = (0..n).map(|i| i as f32 * 0.5 + 1.0).collect();
            huge_pages(&mut buf);
            assert!(
                buf.iter()
                    .enumerate()
                    .all(|(i, &x)| x == i as f32 * 0.5 + 1.0),
                "n {n}"
            );
            let mut fresh = vec![0.0f32; n];
            huge_pages(&mut fresh);
            for (i, x) in fresh.iter_mut().enumerate() {
                *x = i as f32;
            }
            assert!(
                fresh.iter().enumerate().all(|(i, &x)| x == i as f32),
                "n {n}"
            );
        }
    }

    /// This test binary keeps the system allocator, so nothing is counted
    /// and [`super::peak_since`] reports `None`, as its docs state (a peak
    /// of `Some(0)` would read as "no memory" in `packshard bench`; with
    /// [`super::CountingAlloc`] installed, `tests/alloc.rs` sees the bytes).
    #[test]
    fn without_the_counting_allocator_no_peak_is_reported() {
        let (v, peak) = super::peak_since(|| vec![1u8; 4096]);
        assert_eq!(v.len(), 4096);
        assert!(!super::is_counting());
        assert_eq!(peak, None);
    }
}
