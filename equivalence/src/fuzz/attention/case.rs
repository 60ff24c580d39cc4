//! The arbitrary attention case ([`AttentionFuzzCase`]): sizes drawn the way
//! kernels break ([`super::super::schedule`]), then values.

use arbitrary::{Arbitrary, Unstructured};
use ndarray::Array3;
use packshard_reference::attention::Window;
use packshard_reference::ops::{AttentionSupport, Varlen};

use super::super::brief;
use super::super::schedule::{boundary_len, slot, SizeClass, TILE_GRAINS};
use super::super::values::{plants, Gen, Style};
use crate::attention::AttentionCase;

mod sizes;
#[cfg(test)]
mod tests;
use sizes::{heads, large_sizes, small_sizes};

/// Most segments of a small case.
pub const SMALL_MAX_SEGMENTS: usize = 8;
/// Most queries (or keys) of a segment of a small case: past the second
/// 32-token tile (`boundary_len` on 16 and 32 reaches 63, 64, 65).
pub const SMALL_MAX_LEN: usize = 70;
/// Most work (`sum over segments of l_q l_k h d`) of a small case: a 70 x 70
/// segment at `h d = 6`, or 16-token ones at 8 heads of 16; a small case
/// takes a few milliseconds at most (the whole check, f64 reference as the
/// implementation: about 11 forward passes' worth of work and the terms).
pub const SMALL_MAX_WORK: usize = 1 << 15;
/// Short segments of a large case besides its long one.
pub const LARGE_MAX_SHORT: usize = 12;
/// Most queries (or keys) of a short segment of a large case.
pub const LARGE_SHORT_LEN: usize = 300;
/// The long segment of a large case: `1023..=1100` queries or keys (a
/// boundary of every tile grain at 1024 and 1088, flash-attention's `(1023,
/// 1024)` and `(1024, 1023)`).
pub const LONG_LEN: std::ops::RangeInclusive<usize> = 1023..=1100;
/// Most work of the long segment of a large case: 1,100 x 1,100 at one head
/// of dimension 1, a cross segment of 1,100 keys for 128 queries at `h d =
/// 9`. The reference's forward takes about 50 ns a unit of work on the
/// machine the times in docs/FAULTS.md were measured on ("How results are
/// judged"), the whole check with the reference as the implementation about
/// 11 times that, so about a second for a case at [`LARGE_MAX_WORK`].
pub const LONG_WORK: usize = 5 << 18;
/// Most work of the other segments of a large case (with what the long one
/// leaves): segments of 128 tokens at `h d = 32`, of 64 at `h d = 128`.
pub const SHORT_WORK: usize = 1 << 19;
/// Most work of a large case.
pub const LARGE_MAX_WORK: usize = LONG_WORK + SHORT_WORK;
/// The head dims of a large case: the common ones (Llama 128, GPT-2 64,
/// Gemma 256, Phi-2 80, flash-attention's hdim 160 and 192 paths, ...), one
/// odd one drawn besides ([`large_head_dim`]).
pub const HEAD_DIMS: [usize; 8] = [32, 64, 80, 96, 128, 160, 192, 256];
/// The head-dim classes of a large case: [`HEAD_DIMS`] and an odd one. A
/// large case's class is its [`slot`] modulo this, so the 12 large cases of
/// `Budget::DEFAULT` meet every class, `d > 128` (a kernel's second 128-wide
/// half) three times, in every seed (it met `d > 128` in 6 of 1,000 cases,
/// none of seed 0's 100, before).
pub const HEAD_DIM_CLASSES: usize = HEAD_DIMS.len() + 1;
/// The slots (modulo [`FORWARD_ONLY_PERIOD`]) of the forward-only large
/// cases (`want_grad` false, no `grad_output`): 3 of the 12 large cases of
/// `Budget::DEFAULT`, at head dims 64, 128 and 64, one libFuzzer large input
/// in four (8 of the 32 slots).
pub const FORWARD_ONLY_SLOTS: [usize; 3] = [1, 4, 10];
/// The period of [`FORWARD_ONLY_SLOTS`].
pub const FORWARD_ONLY_PERIOD: usize = 12;
/// A small case is forward-only when its last drawn byte is this modulo 8:
/// one in eight (bytes that run out read as 0: asks for gradients).
pub const SMALL_FORWARD_ONLY: u8 = 7;
/// The grouped-query ratios `h / h_kv` drawn (and `h`, multi-query).
pub const GQA_RATIOS: [usize; 4] = [1, 2, 4, 8];

/// Which offsets a malformed case breaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Malformed {
    /// `cu_seqlens_q` (and `cu_seqlens_k`, the same list, in a self-attention case).
    Queries(u8),
    /// `cu_seqlens_k` only (a cross case).
    Keys(u8),
}

/// One arbitrary attention case: `b` segments of `(l_q, l_k)` queries over
/// keys, `q, grad_output: [n_q, h, d]`, `k, v: [n_k, h_kv, d]` (`h_kv`
/// dividing `h`, query head `a` reading key head `a / (h / h_kv)`), causal
/// masks bottom-right aligned, and in about one case in 16 malformed offsets.
///
/// Small cases (the first byte below `0xE0`, [`SizeClass`]): 1 to
/// [`SMALL_MAX_SEGMENTS`] segments of 0, 1, 2, a dozen, or a 16/32 boundary
/// (`k 2^j - 1`, `k 2^j`, `k 2^j + 1`) up to [`SMALL_MAX_LEN`] tokens; `d` in
/// `1..=8`, 16, or 40, 80, 100 (a few tokens); at most [`SMALL_MAX_WORK`]. Large cases: in five of eight a
/// long segment ([`LONG_LEN`]; with a short side when cross) beside up to
/// [`LARGE_MAX_SHORT`] short ones at 16/32/64/128 boundaries up to
/// [`LARGE_SHORT_LEN`]; `d` from [`HEAD_DIMS`] or an odd one; within
/// [`LARGE_MAX_WORK`] (a long self-attention segment at one head and the
/// head dim that fits; the other segments cut to what is left). Both: `h` in `{1,
/// 2, 3, 4, 8}` with `h / h_kv` 1, 2, 4, 8 or `h` (each about one case in
/// six), cross segments (`l_q != l_k`, 0 keys included) in one case in three,
/// causal in one in two; values as the bytes choose ([`Gen`]: uniform, a
/// grid with ties, a constant), outliers x 8 and planted extremes (`±30`,
/// `±100`, `0`).
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionFuzzCase {
    /// Small or large (the input's first byte).
    pub class: SizeClass,
    /// `(l_q, l_k)` of each segment.
    pub segments: Vec<(usize, usize)>,
    /// Bottom-right causal masks.
    pub causal: bool,
    /// Softmax scale (mostly `1/sqrt(d)`).
    pub scale: f64,
    /// The scale is flash-attention's default (`softmax_scale=None`): the
    /// kernel is not given one and must use `1/sqrt(d)` (which `scale`
    /// holds). One case in four (the scale byte's 4 to 7 of 16).
    pub default_scale: bool,
    /// Whether the gradients are asked for (`grad_output` given): false in
    /// one small case in eight ([`SMALL_FORWARD_ONLY`]) and at the large
    /// cases' [`FORWARD_ONLY_SLOTS`], so a kernel's forward-only path (no
    /// saved state, split-KV decoding) is run. The Rust fuzz bodies call
    /// the forward and the backward of an implementation either way.
    pub want_grad: bool,
    /// `[n_q, h, d]`.
    pub q: Array3<f64>,
    /// `[n_k, h_kv, d]`.
    pub k: Array3<f64>,
    /// `[n_k, h_kv, d]`.
    pub v: Array3<f64>,
    /// `[n_q, h, d]`.
    pub grad_output: Array3<f64>,
    /// Padding slots after each segment in the padded form (0 to 3).
    pub extra_pad: usize,
    /// The offsets a malformed case breaks, and how (`None`: well formed).
    pub malformed: Option<Malformed>,
    /// How the values were drawn and what was planted, for reports.
    pub values: String,
    /// flash-attention's options (all absent in about half the cases).
    pub options: FuzzOptions,
}

/// flash-attention's options of a case: `window_size`, `softcap`,
/// `alibi_slopes: [h]`, `seqused_k: [b]`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct FuzzOptions {
    /// `window_size` (bottom-right aligned).
    pub window: Window,
    /// `softcap` (0: none).
    pub softcap: f64,
    /// `alibi_slopes: [h]`.
    pub alibi_slopes: Option<Vec<f64>>,
    /// `seqused_k: [b]`, each at most its segment's `l_k`.
    pub seqused_k: Option<Vec<usize>>,
}

impl FuzzOptions {
    /// `p` with these options.
    pub fn apply<'a>(&'a self, p: Varlen<'a>) -> Varlen<'a> {
        p.with_window(self.window)
            .with_softcap(self.softcap)
            .with_alibi_slopes(self.alibi_slopes.as_deref())
            .with_seqused_k(self.seqused_k.as_deref())
    }

    /// True when any is set.
    pub fn any(&self) -> bool {
        *self != FuzzOptions::default()
    }

    /// A few words for reports.
    pub fn describe(&self) -> String {
        let mut w = Vec::new();
        if !self.window.is_unbounded() {
            w.push(format!("window_size {:?}", self.window.to_flash()));
        }
        if self.softcap != 0.0 {
            w.push(format!("softcap {}", self.softcap));
        }
        if let Some(a) = &self.alibi_slopes {
            w.push(format!("alibi_slopes {}", brief(a)));
        }
        if let Some(u) = &self.seqused_k {
            w.push(format!("seqused_k {}", brief(u)));
        }
        w.join(", ")
    }
}

/// A window side: 0, 1, 2, a 16/32/64 tile boundary, past the longest
/// segment, or unbounded (-1).
fn window_side(u: &mut Unstructured<'_>, longest: usize) -> arbitrary::Result<Option<usize>> {
    const SIDES: [usize; 12] = [0, 1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65];
    Ok(match u.arbitrary::<u8>()? % 16 {
        x @ 0..=11 => Some(SIDES[x as usize]),
        12 => Some(longest + 3),
        _ => None,
    })
}

/// The options (from the bytes left after sizes and values, so every older
/// input keeps its case when none are left): a high first byte draws none;
/// else its low bits say which of window, softcap, ALiBi and `seqused_k`.
fn options(
    u: &mut Unstructured<'_>,
    segments: &[(usize, usize)],
    h: usize,
) -> arbitrary::Result<FuzzOptions> {
    let which = u.arbitrary::<u8>()?;
    let mut o = FuzzOptions::default();
    if which & 0x80 == 0 {
        return Ok(o);
    }
    let longest = segments.iter().map(|&(q, k)| q.max(k)).max().unwrap_or(0);
    if which & 1 != 0 {
        o.window = Window {
            left: window_side(u, longest)?,
            right: window_side(u, longest)?,
        };
    }
    if which & 2 != 0 {
        // Gemma 2's 50 and 30 (final logits / attention), and caps small
        // enough to bend every score.
        o.softcap = [50.0, 30.0, 5.0, 1.0, 0.5][u.arbitrary::<u8>()? as usize % 5];
    }
    if which & 4 != 0 {
        o.alibi_slopes = Some(if u.arbitrary::<bool>()? {
            // The standard slopes 2^(-8 (a + 1) / h) (Press et al. 2022).
            (0..h)
                .map(|a| (-8.0 * (a + 1) as f64 / h as f64).exp2())
                .collect()
        } else {
            let mut v = Vec::with_capacity(h);
            for _ in 0..h {
                v.push(f64::from(u.arbitrary::<u8>()?) / 64.0 - 1.0);
            }
            v
        });
    }
    if which & 8 != 0 {
        let mut used = Vec::with_capacity(segments.len());
        for &(_, lk) in segments {
            let cut = usize::from(u.arbitrary::<u8>()?);
            used.push(if cut % 2 == 0 {
                lk
            } else {
                lk - (cut / 2) % (lk + 1)
            });
        }
        o.seqused_k = Some(used);
    }
    Ok(o)
}

/// `cu` broken the way `how` says (0: not starting at 0; 1: a decrease; 2:
/// not ending at the token count; 3: empty). A decrease keeps the number of
/// offsets where `cu` rises before its last one (the first rise's offset
/// raised past the next), so the order is the only thing wrong: a kernel
/// that checks only the count must still refuse it.
fn malform(mut cu: Vec<usize>, how: u8) -> Vec<usize> {
    let total = cu.last().copied().unwrap_or(0);
    match how % 4 {
        0 => cu[0] = 1,
        1 => {
            // A decrease: the first rise, lowered below its predecessor.
            if let Some(i) = (1..cu.len()).find(|&i| cu[i] > cu[i - 1]) {
                if i + 1 < cu.len() {
                    cu[i] = cu[i + 1] + 1;
                } else {
                    cu.push(0);
                }
            } else {
                cu.push(total + 1);
            }
        }
        2 => *cu.last_mut().expect("cu_seqlens holds [0] at least") += 1,
        _ => cu.clear(),
    }
    cu
}

impl AttentionFuzzCase {
    /// A small self-attention case from the suites' [`AttentionCase`]
    /// (bidirectional, `h_kv == h`, well formed).
    pub fn from_case(c: &AttentionCase, values: impl Into<String>) -> Self {
        AttentionFuzzCase {
            class: SizeClass::Small,
            segments: c.lengths.iter().map(|&l| (l, l)).collect(),
            causal: false,
            scale: c.scale,
            default_scale: false,
            want_grad: true,
            q: c.q.clone(),
            k: c.k.clone(),
            v: c.v.clone(),
            grad_output: c.grad_output.clone(),
            extra_pad: c.row_len - c.lengths.iter().copied().max().unwrap_or(0),
            malformed: None,
            values: values.into(),
            options: FuzzOptions::default(),
        }
    }

    /// The case `data` describes (every byte string describes one).
    ///
    /// # Errors
    /// Never in practice: bytes that run out read as zeros.
    pub fn from_bytes(data: &[u8]) -> arbitrary::Result<Self> {
        Self::arbitrary(&mut Unstructured::new(data))
    }

    /// `(h, h_kv, d)`.
    pub fn heads(&self) -> (usize, usize, usize) {
        let (_, h, d) = self.q.dim();
        (h, self.k.dim().1, d)
    }

    /// Whether every segment is self-attention (`l_q == l_k`): then
    /// `cu_seqlens_k == cu_seqlens_q` and the case is flash-attention's
    /// single-`cu_seqlens` form.
    pub fn is_self(&self) -> bool {
        self.segments.iter().all(|&(q, k)| q == k)
    }

    /// Whether it has grouped-query heads (`h_kv < h`), cross segments.
    pub fn kinds(&self) -> (bool, bool) {
        let (h, h_kv, _) = self.heads();
        (h_kv != h, !self.is_self())
    }

    /// The segments' own query offsets, `[b + 1]`.
    pub fn own_cu_q(&self) -> Vec<usize> {
        crate::cu_seqlens_of(self.segments.iter().map(|s| s.0))
    }

    /// The segments' own key offsets, `[b + 1]`.
    pub fn own_cu_k(&self) -> Vec<usize> {
        crate::cu_seqlens_of(self.segments.iter().map(|s| s.1))
    }

    /// `cu_seqlens_q` as handed to the implementation (malformed in about one
    /// case in 16).
    pub fn cu_seqlens_q(&self) -> Vec<usize> {
        match self.malformed {
            Some(Malformed::Queries(how)) => malform(self.own_cu_q(), how),
            _ => self.own_cu_q(),
        }
    }

    /// `cu_seqlens_k` as handed to the implementation: `cu_seqlens_q` in a
    /// self-attention case.
    pub fn cu_seqlens_k(&self) -> Vec<usize> {
        match self.malformed {
            Some(Malformed::Keys(how)) => malform(self.own_cu_k(), how),
            _ if self.is_self() => self.cu_seqlens_q(),
            _ => self.own_cu_k(),
        }
    }

    /// Whether the offsets are the segments' own.
    pub fn well_formed(&self) -> bool {
        self.malformed.is_none()
    }

    /// The work of the case: `sum over segments of l_q l_k h d`.
    pub fn work(&self) -> usize {
        let (h, _, d) = self.heads();
        self.segments.iter().map(|&(q, k)| q * k).sum::<usize>() * h * d
    }

    /// The longest segment's queries or keys.
    pub fn longest(&self) -> usize {
        self.segments
            .iter()
            .map(|&(q, k)| q.max(k))
            .max()
            .unwrap_or(0)
    }

    /// A one-line description for failure reports.
    pub fn describe(&self) -> String {
        let (h, h_kv, d) = self.heads();
        let (n_q, n_k) = (self.q.dim().0, self.k.dim().0);
        let cu = if self.well_formed() {
            String::new()
        } else {
            format!(
                " (malformed cu_seqlens_q {}, cu_seqlens_k {}; the lengths say {} and {})",
                brief(&self.cu_seqlens_q()),
                brief(&self.cu_seqlens_k()),
                brief(&self.own_cu_q()),
                brief(&self.own_cu_k())
            )
        };
        let layout = if self.is_self() {
            let lengths: Vec<usize> = self.segments.iter().map(|s| s.0).collect();
            format!("lengths {}{cu}, n_tok {n_q}", brief(&lengths))
        } else {
            format!(
                "segments (l_q, l_k) {}{cu}, n_q {n_q}, n_k {n_k}",
                brief(&self.segments)
            )
        };
        let causal = if self.causal {
            "causal (bottom-right)"
        } else {
            "bidirectional"
        };
        let options = if self.options.any() {
            format!(", {}", self.options.describe())
        } else {
            String::new()
        };
        let scale = if self.default_scale {
            format!("scale None (1/sqrt(d) = {:e})", self.scale)
        } else {
            format!("scale {:e}", self.scale)
        };
        let grad = if self.want_grad { "" } else { ", forward only" };
        format!(
            "{:?} case: {layout}, h {h}, h_kv {h_kv}, d {d}, {causal}{options}, {scale}{grad}; {}",
            self.class, self.values
        )
    }

    /// The case within `support`, and what was changed to get there (empty
    /// when nothing was): without causal support the masks go; without
    /// grouped-query support the key heads are repeated (`k[:, a / (h /
    /// h_kv)]` at query head `a`, the same attention with `h_kv = h`);
    /// without cross support each segment becomes `l x l` with `l =
    /// min(l_q, l_k)`, its first `l` queries and keys (a segment without
    /// keys keeps one query, its key and value made from that query's row),
    /// so the work grows by at most one pair a segment; past the support's
    /// `max_head_dim`, the first `max_head_dim` dims of every head.
    /// The malformation, if any, stays.
    pub fn within(&self, support: AttentionSupport) -> (AttentionFuzzCase, Vec<&'static str>) {
        let mut c = self.clone();
        let mut changed = Vec::new();
        if c.causal && !support.causal {
            c.causal = false;
            changed.push("causal");
        }
        let (h, h_kv, d) = c.heads();
        if h_kv != h && !support.gqa {
            let group = h / h_kv;
            let rep = |x: &Array3<f64>| {
                Array3::from_shape_fn((x.dim().0, h, d), |(j, a, e)| x[[j, a / group, e]])
            };
            c.k = rep(&c.k);
            c.v = rep(&c.v);
            changed.push("gqa");
        }
        if !c.is_self() && !support.cross {
            // Segment s becomes l x l, l = min(l_q, l_k) (1 when it has no
            // keys): its first l queries over its first l keys (the
            // queries' first heads of each group where it has none), so
            // the work never grows past the case's own plus one row.
            let (h_kv, group) = (c.k.dim().1, h / c.k.dim().1);
            let (cu_q, cu_k) = (c.own_cu_q(), c.own_cu_k());
            let (mut rows_q, mut rows_k) = (Vec::new(), Vec::new());
            for (s, seg) in c.segments.iter_mut().enumerate() {
                let (lq, lk) = *seg;
                let l = if lk == 0 { lq.min(1) } else { lq.min(lk) };
                for r in 0..l {
                    rows_q.push(cu_q[s] + r);
                    rows_k.push(if lk > 0 {
                        Ok(cu_k[s] + r)
                    } else {
                        Err(cu_q[s] + r)
                    });
                }
                *seg = (l, l);
            }
            let n = rows_q.len();
            let take_q = |x: &Array3<f64>| {
                Array3::from_shape_fn((n, h, d), |(i, a, e)| x[[rows_q[i], a, e]])
            };
            let take_k = |x: &Array3<f64>, from_q: &Array3<f64>| {
                Array3::from_shape_fn((n, h_kv, d), |(i, a, e)| match rows_k[i] {
                    Ok(j) => x[[j, a, e]],
                    Err(j) => from_q[[j, a * group, e]],
                })
            };
            let (k, v) = (take_k(&c.k, &c.q), take_k(&c.v, &c.grad_output));
            let (q, go) = (take_q(&c.q), take_q(&c.grad_output));
            (c.q, c.k, c.v, c.grad_output) = (q, k, v, go);
            if let Some(Malformed::Keys(how)) = c.malformed {
                c.malformed = Some(Malformed::Queries(how));
            }
            changed.push("cross");
            if let Some(used) = &mut c.options.seqused_k {
                for (u, &(_, l)) in used.iter_mut().zip(&c.segments) {
                    *u = (*u).min(l);
                }
            }
        }
        // flash-attention's options: each one the support lacks goes.
        let o = &mut c.options;
        if !o.window.is_unbounded() && !support.window {
            o.window = Window::UNBOUNDED;
            changed.push("window");
        }
        if o.softcap != 0.0 && !support.softcap {
            o.softcap = 0.0;
            changed.push("softcap");
        }
        if o.alibi_slopes.is_some() && !support.alibi {
            o.alibi_slopes = None;
            changed.push("alibi");
        }
        if o.seqused_k.is_some() && !support.seqused_k {
            o.seqused_k = None;
            changed.push("seqused_k");
        }
        let d = c.q.dim().2;
        if d > support.max_head_dim {
            // The first `max_head_dim` dims of every head (the scale kept).
            let keep = support.max_head_dim;
            let cut = |x: &Array3<f64>| {
                x.slice_axis(ndarray::Axis(2), ndarray::Slice::from(0..keep))
                    .to_owned()
            };
            (c.q, c.k, c.v, c.grad_output) = (cut(&c.q), cut(&c.k), cut(&c.v), cut(&c.grad_output));
            changed.push("head_dim");
        }
        (c, changed)
    }
}

/// The softmax scale a case's scale byte gives, by its low four bits: 0 to
/// 3 give 1, 1/8, 2, 0.01; the rest `1/sqrt(d)`, which 4 to 7 leave to the
/// kernel's default (`true`: flash-attention's `softmax_scale=None`).
fn scale_of(byte: u8, d: usize) -> (f64, bool) {
    let low = byte % 16;
    let scale = match low {
        0 => 1.0,
        1 => 0.125,
        2 => 2.0,
        3 => 0.01,
        _ => 1.0 / (d as f64).sqrt(),
    };
    (scale, (4..=7).contains(&low))
}

/// Whether a case's malformation byte asks for malformed offsets: its low
/// four bits all set (one byte in 16).
fn malformed_byte(byte: u8) -> bool {
    byte % 16 == 15
}

/// A plant's tensor (0 to 3: `q`, `k`, `v`, `grad_output`) and value from
/// its choice byte: the tensor by `choice % 4`, the value (100, -100, 30,
/// -30, 0) by `choice / 4 % 5`, so bytes 0 to 19 give each pair once.
fn plant_choice(choice: u8) -> (usize, f64) {
    (
        usize::from(choice) % 4,
        [100.0, -100.0, 30.0, -30.0, 0.0][(usize::from(choice) / 4) % 5],
    )
}

/// The element of a non-empty `(n, th, d)` tensor a plant drawn at `at`
/// lands on: the flat index `at % (n th d)` in row-major order, so the
/// bytes can steer a plant onto any element (and, under the 16-bit `at`,
/// onto every element of a tensor of up to 65,536).
fn plant_index(at: usize, (n, th, d): (usize, usize, usize)) -> (usize, usize, usize) {
    let flat = at % (n * th * d);
    (flat / (th * d), (flat / d) % th, flat % d)
}

impl<'a> Arbitrary<'a> for AttentionFuzzCase {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        // Sizes first.
        let first = u.arbitrary::<u8>()?;
        let (class, slot) = (SizeClass::of(&[first]), slot(&[first]));
        let large_forward_only =
            class == SizeClass::Large && FORWARD_ONLY_SLOTS.contains(&(slot % FORWARD_ONLY_PERIOD));
        let (h, h_kv) = heads(u)?;
        let cross = u.arbitrary::<u8>()? % 3 == 0;
        let causal = u.arbitrary::<bool>()?;
        let (segments, d, (h, h_kv)) = match class {
            SizeClass::Small => {
                let (segments, d) = small_sizes(u, h, cross)?;
                (segments, d, (h, h_kv))
            }
            SizeClass::Large => large_sizes(u, (h, h_kv), cross, slot, large_forward_only)?,
        };
        let extra_pad = u.int_in_range(0..=3)?;
        let (scale, default_scale) = scale_of(u.arbitrary::<u8>()?, d);
        let n_q: usize = segments.iter().map(|s| s.0).sum();
        let n_k: usize = segments.iter().map(|s| s.1).sum();
        // Then values.
        let mut gen = Gen::arbitrary(u)?;
        if large_forward_only {
            // Values that vary at magnitude 1 at least: a constant or
            // near-zero tensor gives every key tile the same row maximum,
            // so nothing needs rescaling.
            if gen.style == Style::Constant {
                gen.style = Style::Uniform;
            }
            gen.magnitude = gen.magnitude.max(1.0);
        }
        let mut tensor = |n, heads| Array3::from_shape_fn((n, heads, d), |_| gen.value(2.0));
        let mut t = [
            tensor(n_q, h),
            tensor(n_k, h_kv),
            tensor(n_k, h_kv),
            tensor(n_q, h),
        ];
        let mut planted = Vec::new();
        for (at, choice) in plants(u, 4)? {
            let (which, x) = plant_choice(choice);
            if t[which].is_empty() {
                continue;
            }
            let idx = plant_index(at, t[which].dim());
            t[which][idx] = x;
            planted.push(format!(
                "{}[{}, {}, {}] = {x}",
                ["q", "k", "v", "grad_output"][which],
                idx.0,
                idx.1,
                idx.2
            ));
        }
        let [q, k, v, grad_output] = t;
        let malformed = if malformed_byte(u.arbitrary::<u8>()?) {
            let how = u.arbitrary::<u8>()?;
            let self_attention = segments.iter().all(|&(a, b)| a == b);
            Some(if !self_attention && how & 4 != 0 {
                Malformed::Keys(how)
            } else {
                Malformed::Queries(how)
            })
        } else {
            None
        };
        let mut values = gen.describe();
        if !planted.is_empty() {
            values.push_str(&format!("; planted {}", planted.join(", ")));
        }
        let options = options(u, &segments, h)?;
        let want_grad = match class {
            SizeClass::Small => u.arbitrary::<u8>()? % 8 != SMALL_FORWARD_ONLY,
            SizeClass::Large => !large_forward_only,
        };
        Ok(AttentionFuzzCase {
            class,
            segments,
            causal,
            scale,
            default_scale,
            want_grad,
            q,
            k,
            v,
            grad_output,
            extra_pad,
            malformed,
            values,
            options,
        })
    }
}
