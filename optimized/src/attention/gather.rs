//! The gathers of the tiled kernels: one (rows, head) of a `[n, h, d]`
//! tensor copied into a zero-padded tile (as rows, or transposed in panels
//! of [`BLOCK_Q`]), prefetching the rows ahead, and keeping the largest
//! [`magnitude_bits`] of what they read (the value checks, [`super::Seen`]).

use super::scan::magnitude_bits;
use super::{Element, Rows, BLOCK_Q};

/// Asks for the row `i` of `at` in `x` ahead of its use (a hint: no
/// effect on values, none past the rows).
#[inline(always)]
fn prefetch_row<T>(x: &[T], (h, d): (usize, usize), at: Rows, i: usize) {
    if i < at.len {
        let row = source_row(x, (h, d), at, i);
        let bytes = std::mem::size_of_val(row);
        #[cfg(target_arch = "x86_64")]
        for off in (0..bytes).step_by(64) {
            // SAFETY: a prefetch never faults; the address is within `row`.
            unsafe {
                use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
                _mm_prefetch::<_MM_HINT_T0>(row.as_ptr().cast::<i8>().add(off));
            }
        }
    }
}

/// Row `i` of the rows `at` of `x: [n, h, d]` (token `at.start + i`, head
/// `at.head`): `d` elements.
#[inline(always)]
fn source_row<T>(x: &[T], (h, d): (usize, usize), at: Rows, i: usize) -> &[T] {
    &x[((at.start + i) * h + at.head) * d..][..d]
}

/// How many rows ahead the gathers prefetch (issue 37, the 16,267-token
/// forward, three runs each: 8 rows 0.1319-0.1353 s, 16 rows 0.1309-0.1342
/// s, 4 rows 0.1331-0.1364 s; without prefetching 0.138 s: within this
/// machine's noise of each other, all ahead of none).
const AHEAD: usize = 16;

/// `out: [rows, dp]` (resized; its capacity kept, so a reused buffer
/// allocates nothing): the tile of the rows `at` of `x: [n, h, d]`,
/// zero-padded. Returns the largest [`magnitude_bits`] of the rows read.
#[inline(always)]
pub(super) fn gather_into<T: Element>(
    out: &mut Vec<f32>,
    x: &[T],
    (h, d): (usize, usize),
    at: Rows,
    (rows, dp): (usize, usize),
) -> u32 {
    // Every element is written below: the real rows' values and padding,
    // the padding rows' zeros (no clearing pass first).
    out.resize(rows * dp, 0.0);
    let mut seen = 0;
    for i in 0..at.len {
        prefetch_row(x, (h, d), at, i + AHEAD);
        let src = source_row(x, (h, d), at, i);
        let row = &mut out[i * dp..(i + 1) * dp];
        for (o, &s) in row.iter_mut().zip(src) {
            *o = s.to_f32();
            seen = seen.max(magnitude_bits(*o));
        }
        row[d..].fill(0.0);
    }
    out[at.len * dp..].fill(0.0);
    seen
}

/// The transpose of [`gather_into`] in panels of [`BLOCK_Q`] rows, into
/// `out` (as [`gather_into`]): `[rows / BLOCK_Q, dp, BLOCK_Q]`, panel `t`
/// the transpose `[dp, BLOCK_Q]` of the rows `t * BLOCK_Q..(t + 1) *
/// BLOCK_Q` (`rows` a multiple of [`BLOCK_Q`]): the `Q^T` and `dO^T` of a
/// query block, the transposed tiles' `B` operands (`S^T = K Q^T`, `dP^T = V
/// dO^T`), one contiguous 16 KiB block at `d` = 64. Returns the largest
/// [`magnitude_bits`] of the rows read.
#[inline(always)]
pub(super) fn gather_t_into<T: Element>(
    out: &mut Vec<f32>,
    x: &[T],
    (h, d): (usize, usize),
    at: Rows,
    (rows, dp): (usize, usize),
) -> u32 {
    debug_assert!(rows.is_multiple_of(BLOCK_Q));
    // Every element is written below (no clearing pass first): the real
    // rows' values, their padding columns `d..dp`, and the padding rows'
    // lanes of the last panel and the panels past it.
    out.resize(dp * rows, 0.0);
    let mut seen = 0;
    for i in 0..at.len {
        prefetch_row(x, (h, d), at, i + AHEAD);
        let src = source_row(x, (h, d), at, i);
        seen = src
            .iter()
            .fold(seen, |m, s| m.max(magnitude_bits(s.to_f32())));
        let panel = &mut out[(i / BLOCK_Q) * dp * BLOCK_Q..][..dp * BLOCK_Q];
        for (c, &s) in src.iter().enumerate() {
            panel[c * BLOCK_Q + i % BLOCK_Q] = s.to_f32();
        }
    }
    let panels = at.len.div_ceil(BLOCK_Q);
    for (t, panel) in out.chunks_exact_mut(dp * BLOCK_Q).enumerate() {
        let real = if t < panels {
            (at.len - t * BLOCK_Q).min(BLOCK_Q)
        } else {
            0
        };
        for (c, lanes) in panel.chunks_exact_mut(BLOCK_Q).enumerate() {
            lanes[if c < d { real } else { 0 }..].fill(0.0);
        }
    }
    seen
}
