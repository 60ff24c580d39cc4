//! Writes from parallel work units straight into one output tensor.
//!
//! The work units of a problem own disjoint rows of each output (a query
//! head's rows of its segment; a key head's rows of its segment's keys), but
//! those rows interleave in memory (`[n, h, d]`: the heads of one token are
//! adjacent), so the output cannot be split into one `&mut` slice per unit.
//! Collecting every unit's rows and copying them in afterwards (what the
//! kernel did first) cost a serial pass over all three gradients and a fresh
//! allocation per unit (issue 37: about a third of the backward's time on the
//! BERT-base layer). [`Disjoint`] hands each unit its own rows instead.

use std::marker::PhantomData;

use super::Rows;

/// A flat `[n, heads, d]` output that parallel units write through, each to
/// rows no other unit writes (see [`Disjoint::rows_mut`]).
pub(super) struct Disjoint<'a> {
    ptr: *mut f32,
    len: usize,
    heads: usize,
    d: usize,
    _out: PhantomData<&'a mut [f32]>,
}

// SAFETY: a `Disjoint` is a `&mut [f32]` shared by units that write
// pairwise disjoint elements of it ([`Disjoint::rows_mut`]'s contract), and
// `f32` is `Send`.
unsafe impl Send for Disjoint<'_> {}
// SAFETY: as for `Send`.
unsafe impl Sync for Disjoint<'_> {}

impl<'a> Disjoint<'a> {
    /// `out: [n, heads, d]` flat, row-major.
    pub(super) fn new(out: &'a mut [f32], (heads, d): (usize, usize)) -> Self {
        Disjoint {
            ptr: out.as_mut_ptr(),
            len: out.len(),
            heads,
            d,
            _out: PhantomData,
        }
    }

    /// Calls `f(i, row)` with each row `i` of `at` (`row: [d]`, token
    /// `at.start + i`, head `at.head`).
    ///
    /// # Panics
    /// Rows past the end of the output.
    ///
    /// # Safety
    /// No other call may touch the same (token, head) rows while this one
    /// runs: the units of one problem own pairwise disjoint (token range,
    /// head) pairs (segments' tokens are disjoint ranges, checked before any
    /// unit runs, and each (segment, head) belongs to one unit).
    pub(super) unsafe fn rows_mut(&self, at: Rows, mut f: impl FnMut(usize, &mut [f32])) {
        let (heads, d) = (self.heads, self.d);
        assert!(at.head < heads && (at.start + at.len) * heads * d <= self.len);
        for i in 0..at.len {
            let start = ((at.start + i) * heads + at.head) * d;
            // SAFETY: `start + d <= len` (asserted above), and by the
            // contract nobody else reads or writes these `d` elements now.
            let row = unsafe { std::slice::from_raw_parts_mut(self.ptr.add(start), d) };
            f(i, row);
        }
    }

    /// Row `i` of the rows `at` ([`Disjoint::rows_mut`] for one row).
    ///
    /// # Panics
    /// A row past `at` or past the end of the output.
    ///
    /// # Safety
    /// As [`Disjoint::rows_mut`]: no other call touches the row meanwhile.
    #[allow(clippy::mut_from_ref)] // exclusive by the contract
    pub(super) unsafe fn row_mut(&self, at: Rows, i: usize) -> &mut [f32] {
        let (heads, d) = (self.heads, self.d);
        assert!(at.head < heads && i < at.len && (at.start + i + 1) * heads * d <= self.len);
        let start = ((at.start + i) * heads + at.head) * d;
        // SAFETY: `start + d <= len` (asserted above), and by the contract
        // nobody else reads or writes these `d` elements now.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(start), d) }
    }

    /// Asks for the rows `at` in the cache ahead of their writes: a hint,
    /// no effect on any value, nothing past the output. A query block's
    /// output rows lie `heads * d` floats apart, a stride the hardware
    /// prefetchers do not follow (issue 37, one core, 16,267 tokens: the
    /// forward 0.203 s, 0.200 s with the rows asked for at the block's
    /// start, 0.190 s writing no output at all).
    pub(super) fn prefetch_rows(&self, at: Rows) {
        let (heads, d) = (self.heads, self.d);
        for i in 0..at.len {
            let start = ((at.start + i) * heads + at.head) * d;
            if start + d > self.len {
                return;
            }
            #[cfg(target_arch = "x86_64")]
            for off in (0..d).step_by(16) {
                // SAFETY: a prefetch never faults, and the address is within
                // the output (`start + off < len`); nothing is read or written.
                unsafe {
                    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
                    _mm_prefetch::<_MM_HINT_T0>(self.ptr.add(start + off).cast::<i8>());
                }
            }
        }
    }

    /// The elements per head of an output `[heads, per]` (`lse: [h, n]`).
    pub(super) fn len_per(&self, heads: usize) -> usize {
        self.len / heads.max(1)
    }

    /// The elements `start..start + len` of the flat output.
    ///
    /// # Panics
    /// A span past the end of the output.
    ///
    /// # Safety
    /// As [`Disjoint::rows_mut`]: no other call touches the span meanwhile.
    #[allow(clippy::mut_from_ref)] // exclusive by the contract
    pub(super) unsafe fn span_mut(&self, start: usize, len: usize) -> &mut [f32] {
        assert!(start + len <= self.len);
        // SAFETY: in bounds (asserted), and exclusive by the contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(start), len) }
    }
}
