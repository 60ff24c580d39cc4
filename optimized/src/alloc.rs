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
