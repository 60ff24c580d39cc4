//! The options of flash-attention's `flash_attn_varlen_func` beyond `causal`:
//! the sliding window (`window_size`), the score soft cap (`softcap`), ALiBi
//! (`alibi_slopes`) and the key counts per segment (`seqused_k`), as
//! per-element functions every implementation shares.
//!
//! For query `r` (0-based, local to its segment) over key `c` of a segment of
//! `l_q` queries over `l_k` keys (`l_k` = `seqused_k[s]` when given; keys
//! past it are never seen) the diagonal is `r + l_k - l_q` (bottom-right
//! alignment, flash-attention >= 2.1) and:
//! - the window `(left, right)` allows `c >= r + l_k - l_q - left` (when
//!   `left` is bounded) and `c <= r + l_k - l_q + right` (when `right` is
//!   bounded); `causal` is `right = 0`;
//! - the score is `s = cap(scale * q . k) + bias`, `cap(x) = softcap *
//!   tanh(x / softcap)` (`softcap = 0`: none, flash-attention's default),
//!   applied before the mask (a masked key stays `-inf`, never `-softcap`);
//! - ALiBi's bias is `-slope[a] * |r + l_k - l_q - c|` for query head `a`
//!   (Press et al. 2022; flash-attention's documented convention; its causal
//!   kernel adds `slope * c` instead, which differs by a constant per row:
//!   the same output, an `lse` shifted by `slope * (r + l_k - l_q)`).

use std::ops::Range;

/// flash-attention's `window_size`: a type of the contract
/// ([`crate::ops`]), here with the functions that apply it.
pub use crate::ops::Window;

/// The keys (local indices) that query `r` of a segment of `lq` queries over
/// `lk` keys sees: `lo..hi`, empty when none. Causal is `right = 0`
/// (combined with a window's right side, the smaller wins).
pub fn visible_keys(r: usize, lq: usize, lk: usize, causal: bool, w: Window) -> Range<usize> {
    // In i128 so no sum of usizes overflows.
    let diag = r as i128 + lk as i128 - lq as i128;
    // Causal is right = 0, the smallest a side can be: it wins.
    let right = if causal { Some(0) } else { w.right };
    let hi = right.map_or(lk as i128, |x| (diag + x as i128 + 1).clamp(0, lk as i128));
    let lo = w
        .left
        .map_or(0, |x| (diag - x as i128).clamp(0, lk as i128));
    let (lo, hi) = (lo as usize, hi as usize);
    if lo < hi {
        lo..hi
    } else {
        0..0
    }
}

/// `softcap * tanh(x / softcap)`, or `x` when `softcap == 0` (none).
pub fn cap(x: f64, softcap: f64) -> f64 {
    if softcap > 0.0 {
        softcap * (x / softcap).tanh()
    } else {
        x
    }
}

/// `d cap(x) / dx = 1 - tanh(x / softcap)^2` (in `[0, 1]`), or 1 when
/// `softcap == 0`.
pub fn cap_grad(x: f64, softcap: f64) -> f64 {
    if softcap > 0.0 {
        let t = (x / softcap).tanh();
        1.0 - t * t
    } else {
        1.0
    }
}

/// ALiBi's bias of query `r` over key `c` in a segment of `lq` queries over
/// `lk` keys: `-slope * |r + lk - lq - c|`.
pub fn alibi_bias(slope: f64, r: usize, c: usize, lq: usize, lk: usize) -> f64 {
    let dist = (r as i128 + lk as i128 - lq as i128 - c as i128).unsigned_abs();
    -slope * dist as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_is_bottom_right_aligned_and_composes_with_causal() {
        let w = |l: i64, r: i64| Window::from_flash(l, r).unwrap();
        // Self segment of 5: query 2, window (1, 1): keys 1..=3.
        assert_eq!(visible_keys(2, 5, 5, false, w(1, 1)), 1..4);
        // Causal: the right side becomes 0.
        assert_eq!(visible_keys(2, 5, 5, true, w(1, 1)), 1..3);
        // 2 queries over 5 keys: the diagonal of query 0 is key 3.
        assert_eq!(visible_keys(0, 2, 5, false, w(0, 0)), 3..4);
        assert_eq!(visible_keys(1, 2, 5, true, w(2, -1)), 2..5);
        // 5 queries over 2 keys, causal: queries 0..3 see nothing.
        assert_eq!(visible_keys(2, 5, 2, true, Window::UNBOUNDED), 0..0);
        assert_eq!(visible_keys(3, 5, 2, true, Window::UNBOUNDED), 0..1);
        // A window larger than the segment is no window.
        assert_eq!(visible_keys(0, 3, 3, false, w(100, 100)), 0..3);
        // Left 0, right 0: the diagonal only.
        assert_eq!(visible_keys(4, 7, 7, false, w(0, 0)), 4..5);
    }

    #[test]
    fn window_refuses_sides_below_minus_one() {
        let e = Window::from_flash(-2, 0).unwrap_err();
        assert!(e.to_string().contains("window_size[0]"), "{e}");
        assert_eq!(Window::from_flash(-1, 3).unwrap().to_flash(), (-1, 3));
    }

    #[test]
    fn cap_and_its_gradient() {
        assert_eq!(cap(3.0, 0.0), 3.0);
        assert!((cap(50.0, 30.0) - 30.0 * (50.0f64 / 30.0).tanh()).abs() < 1e-15);
        // Central difference of cap at x = 20, c = 30: its derivative.
        let (x, c, e) = (20.0, 30.0, 1e-5);
        let fd = (cap(x + e, c) - cap(x - e, c)) / (2.0 * e);
        // 1e-9: the central difference's truncation (e^2 * cap''' ~ 1e-13)
        // and rounding (1e-16 * 30 / 1e-5 ~ 3e-10) errors.
        assert!(
            (fd - cap_grad(x, c)).abs() < 1e-9,
            "{fd} {}",
            cap_grad(x, c)
        );
    }

    #[test]
    fn alibi_is_minus_slope_times_the_bottom_right_distance() {
        // 2 queries over 5 keys: query 0's diagonal is key 3.
        assert_eq!(alibi_bias(0.5, 0, 3, 2, 5), 0.0);
        assert_eq!(alibi_bias(0.5, 0, 0, 2, 5), -1.5);
        assert_eq!(alibi_bias(0.5, 1, 4, 2, 5), 0.0);
        assert_eq!(alibi_bias(0.5, 0, 4, 2, 5), -0.5);
    }
}
