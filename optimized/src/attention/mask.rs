//! flash-attention's options in f32, as the kernels' loops call them: the
//! keys a query sees (window and causal bounds, bottom-right aligned, within
//! `seqused_k`), the score transform (`softcap`, ALiBi) and its chain
//! factor. The definitions are the reference's
//! (`packshard_reference::attention::options`); only the arithmetic is f32.

use std::ops::Range;

use packshard_reference::attention::options::visible_keys;
use packshard_reference::ops::Varlen;

/// The options of one segment of a varlen problem, in f32.
#[derive(Debug, Clone, Copy)]
pub struct SegmentMask<'a> {
    /// The problem.
    pub p: &'a Varlen<'a>,
    /// Queries of the segment.
    pub lq: usize,
    /// Keys the segment uses (`seqused_k[s]`, else its `l_k`).
    pub lk: usize,
}

impl<'a> SegmentMask<'a> {
    /// Segment `s` of `p` (after `check_varlen`).
    pub fn of(p: &'a Varlen<'a>, s: usize) -> Self {
        SegmentMask {
            p,
            lq: p.cu_seqlens_q[s + 1] - p.cu_seqlens_q[s],
            lk: p.used_keys(s),
        }
    }

    /// The keys (local indices) query `r` sees.
    pub fn keys(&self, r: usize) -> Range<usize> {
        visible_keys(r, self.lq, self.lk, self.p.causal, self.p.window)
    }

    /// True when the scores are transformed (softcap or ALiBi).
    pub fn transforms(&self) -> bool {
        self.p.softcap > 0.0 || self.p.alibi_slopes.is_some()
    }

    /// The score of query `r` over key `c` at query head `a` from the scaled
    /// dot product `raw`: `cap(raw) - slope_a |r + l_k - l_q - c|`.
    pub fn score(&self, a: usize, r: usize, c: usize, raw: f32) -> f32 {
        let s = cap(raw, softcap_f32(self.p.softcap));
        match self.p.alibi_slopes {
            Some(slopes) => {
                let dist = (r as i64 + self.lk as i64 - self.lq as i64 - c as i64).unsigned_abs();
                s - slopes[a] as f32 * dist as f32
            }
            None => s,
        }
    }

    /// `d score / d raw`: `1 - tanh(raw / softcap)^2`, or 1.
    pub fn chain(&self, raw: f32) -> f32 {
        cap_grad(raw, softcap_f32(self.p.softcap))
    }
}

/// flash-attention's `softcap` (checked: finite, at least 0) as the f32
/// kernels use it. 0 (none) stays 0. A cap past f32's range (3.4e38) is
/// none: the scores are at most `MAX_SCORE` = 1e30 (`check_scores`), so `c
/// tanh(s / c)` differs from `s` by a relative `(s / c)^2 / 3 < 3e-18`, far
/// below f32's rounding, where the cap rounded to `inf` gave `inf * 0 =
/// NaN`. A positive cap below f32's smallest subnormal (1.4e-45) becomes
/// that subnormal, where rounding it to 0 silently dropped the cap: every
/// score is then `±cap`, below 1e-44 in both, and both softmaxes are
/// uniform over the visible keys.
pub fn softcap_f32(softcap: f64) -> f32 {
    if softcap <= 0.0 {
        return 0.0;
    }
    let c = softcap as f32;
    if c.is_infinite() {
        0.0
    } else {
        c.max(f32::from_bits(1))
    }
}

/// `softcap * tanh(x / softcap)` in f32 (`softcap == 0`: `x`).
pub fn cap(x: f32, softcap: f32) -> f32 {
    if softcap > 0.0 {
        softcap * (x / softcap).tanh()
    } else {
        x
    }
}

/// `1 - tanh(x / softcap)^2` in f32 (`softcap == 0`: 1).
pub fn cap_grad(x: f32, softcap: f32) -> f32 {
    if softcap > 0.0 {
        let t = (x / softcap).tanh();
        1.0 - t * t
    } else {
        1.0
    }
}
