//! A counting global allocator: the heap bytes live and their peak, so that
//! memory figures (the fused cross-entropy's peak in `packshard bench`, a
//! pipeline rank's peak activations) are *measured*, not modelled.
//!
//! A binary installs [`CountingAlloc`] as its `#[global_allocator]`;
//! without it every count reads 0 and [`peak_since`] reports `None`.

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

/// Asks the kernel to back the 2 MiB-aligned part of a fresh buffer with
/// transparent huge pages (`madvise(MADV_HUGEPAGE)`, Linux), before its
/// first write: an output of tens of MiB (attention's `[n, h, d]`) is
/// otherwise faulted in 4 KiB at a time, one page fault per 1,024 floats,
/// at every call (glibc maps allocations over 32 MiB afresh each time).
/// Advice only: on other systems, with huge pages off, or where the kernel
/// declines, nothing changes (the result of the call is ignored).
pub fn huge_pages(buf: &mut [f32]) {
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        let start = buf.as_mut_ptr() as usize;
        let end = start + std::mem::size_of_val(buf);
        let first = start.next_multiple_of(HUGE);
        let last = end / HUGE * HUGE;
        if last > first {
            // SAFETY: the range lies inside `buf` (whole pages within it);
            // MADV_HUGEPAGE changes no contents, only how pages are backed.
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
    let _ = buf;
}

#[cfg(test)]
mod tests {
    use super::huge_pages;

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
