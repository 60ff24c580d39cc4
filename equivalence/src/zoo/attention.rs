//! A flash-attention-2 style tiled attention in f64 (Dao 2023, Algorithm 1
//! forward, Algorithm 2 backward), correct by default, with the mistakes of
//! [`AttentionBug`] one at a time.
//!
//! Per segment and query head `a` (key head `a / (h / h_kv)`): query tiles
//! of `br` rows; for each, key tiles of `bc` keys in order, the running row
//! maximum `m`, sum `l` and output accumulator `acc` rescaled by `exp(m_old -
//! m_new)` when the maximum grows (the online softmax of Milakov &
//! Gimelshein 2018); then `output = acc / l`, `lse = m + ln l` (natural
//! log; `-inf` and a zero row for a query with no visible key). Causal
//! segments are bottom-right aligned (query `r` sees key `c <= r + l_k -
//! l_q`): a query tile visits only the key tiles up to its last visible key
//! (`ceil`), and applies the per-element mask only on tiles that reach past
//! its first row's limit. The masked (dense) form runs the same tiles over
//! the whole `[n_q, n_k]` with the per-element mask on every tile.
//!
//! Shapes as the op's: `q: [n_q, h, d]`, `k, v: [n_k, h_kv, d]`, `output:
//! [n_q, h, d]`, `lse: [h, n_q]`.

use ndarray::{Array2, Array3, ArrayView2};
use packshard_reference::attention::options::Window;
use packshard_reference::attention::{
    check_grad_shapes, check_mask_shape2, check_qkv_shapes, check_scores, check_varlen,
    check_varlen_options, check_varlen_work, MAX_ATTENTION_WORK,
};
use packshard_reference::bert::{AttentionGrads, AttentionOutput};
use packshard_reference::ops::{AttentionOp, AttentionSupport, Grad, Masked, Qkv, Varlen};
use packshard_reference::{Error, Result};

/// One mistake of [`TiledAttention`], each one kernel authors have made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AttentionBug {
    /// The running sum `l` and accumulator `acc` are not rescaled by
    /// `exp(m_old - m_new)` when a later key tile raises the row maximum.
    NoRescale,
    /// The last key tile of a segment is bounded by the tensor's end, not
    /// the segment's: a bidirectional query reads the next document's keys.
    UnmaskedTail,
    /// The test that lets a key tile skip the causal element mask is off by
    /// one (`c1 - 1 <= r0 + off + 1`): at a tile edge, the first query of a
    /// query tile sees one future key.
    CausalTileEdge,
    /// The causal key-tile count rounds down (`(limit + 1) / bc`, not
    /// `ceil`): the partially visible diagonal tile is skipped.
    DiagonalTileSkipped,
    /// Causal masks aligned top-left (`c <= r`) when `l_q != l_k`.
    TopLeftCausal,
    /// Query head `a` reads key head `a % h_kv` (`repeat` for
    /// `repeat_interleave`).
    GqaModulo,
    /// The base-2 trick (`exp2(s log2 e)`) not undone: `lse` returned in
    /// log2 units.
    Log2Lse,
    /// The backward's `D_i = rowsum(dO_i * O_i)` formed per key tile, as
    /// `sum_{j in tile} P_ij dP_ij`.
    DeltaPerTile,
    /// `dK`/`dV` accumulators reset for each query tile: they hold the last
    /// query tile's share only.
    DkvLastQueryTile,
    /// The last key tile's length taken as `l_k % bc`: a segment whose
    /// length is a multiple of the tile loses its whole last tile (a
    /// one-tile segment sees no key).
    RemainderTile,
    /// `1/sqrt(d)` hard-coded: the caller's softmax scale is ignored.
    DefaultScale,
    /// Masked scores filled with a finite `-1e9` (`masked_fill`) instead of
    /// being left out: a query with no visible key averages the masked
    /// values instead of giving 0 and `lse = -inf`.
    FiniteMaskFill,
    /// Under GQA, `dK`/`dV` of a key head written (`=`) by each query head of
    /// its group instead of summed: the last query head wins.
    GqaGradOverwrite,
    /// `q . k` summed over the head dim in blocks of 32 with the last
    /// partial block dropped: head dims above 32 that are not a multiple of
    /// 32 (40, 80, 100) lose their last dims.
    HeadDimTail,
    /// The key-tile loop bounded by `max_seqlen_q` (the longest query
    /// segment) where `max_seqlen_k` belonged: in cross attention, keys past
    /// the longest query segment are never visited.
    MaxSeqlenQForK,
    /// W1: the window's left edge one key too far: query `r` sees key
    /// `c >= r + l_k - l_q - left - 1`.
    WindowOffByOne,
    /// W2: the window's diagonal taken as `c = r` (top-left, flash-attention
    /// < 2.1) instead of `r + l_k - l_q` when `l_q != l_k`.
    WindowTopLeft,
    /// W3: the window's left edge applied over the pack's keys: a document's
    /// first queries see the previous document's last `left` keys.
    WindowAcrossDocuments,
    /// W4: the softcap applied after the mask: a masked key scores
    /// `softcap * tanh(-inf) = -softcap` and takes a share.
    SoftcapAfterMask,
    /// W5: the softcap's backward without its chain factor `1 -
    /// tanh^2(raw / softcap)`.
    SoftcapNoChain,
    /// W6: ALiBi's distance over the pack's token indices `|i - j|` instead
    /// of the segment's bottom-right aligned `|r + l_k - l_q - c|`.
    AlibiPackStart,
    /// W6: ALiBi's bias added as `+slope * |...|`.
    AlibiSign,
}

impl AttentionBug {
    /// Every attention bug of the zoo.
    pub const ALL: [AttentionBug; 22] = [
        AttentionBug::NoRescale,
        AttentionBug::UnmaskedTail,
        AttentionBug::CausalTileEdge,
        AttentionBug::DiagonalTileSkipped,
        AttentionBug::TopLeftCausal,
        AttentionBug::GqaModulo,
        AttentionBug::Log2Lse,
        AttentionBug::DeltaPerTile,
        AttentionBug::DkvLastQueryTile,
        AttentionBug::RemainderTile,
        AttentionBug::DefaultScale,
        AttentionBug::FiniteMaskFill,
        AttentionBug::GqaGradOverwrite,
        AttentionBug::HeadDimTail,
        AttentionBug::MaxSeqlenQForK,
        AttentionBug::WindowOffByOne,
        AttentionBug::WindowTopLeft,
        AttentionBug::WindowAcrossDocuments,
        AttentionBug::SoftcapAfterMask,
        AttentionBug::SoftcapNoChain,
        AttentionBug::AlibiPackStart,
        AttentionBug::AlibiSign,
    ];

    /// A short name (`no_rescale`).
    pub fn name(self) -> &'static str {
        match self {
            AttentionBug::NoRescale => "no_rescale",
            AttentionBug::UnmaskedTail => "unmasked_tail",
            AttentionBug::CausalTileEdge => "causal_tile_edge",
            AttentionBug::DiagonalTileSkipped => "diagonal_tile_skipped",
            AttentionBug::TopLeftCausal => "top_left_causal",
            AttentionBug::GqaModulo => "gqa_modulo",
            AttentionBug::Log2Lse => "log2_lse",
            AttentionBug::DeltaPerTile => "delta_per_tile",
            AttentionBug::DkvLastQueryTile => "dkv_last_query_tile",
            AttentionBug::RemainderTile => "remainder_tile",
            AttentionBug::DefaultScale => "default_scale",
            AttentionBug::FiniteMaskFill => "finite_mask_fill",
            AttentionBug::GqaGradOverwrite => "gqa_grad_overwrite",
            AttentionBug::HeadDimTail => "head_dim_tail",
            AttentionBug::MaxSeqlenQForK => "max_seqlen_q_for_k",
            AttentionBug::WindowOffByOne => "window_off_by_one",
            AttentionBug::WindowTopLeft => "window_top_left",
            AttentionBug::WindowAcrossDocuments => "window_across_documents",
            AttentionBug::SoftcapAfterMask => "softcap_after_mask",
            AttentionBug::SoftcapNoChain => "softcap_no_chain",
            AttentionBug::AlibiPackStart => "alibi_pack_start",
            AttentionBug::AlibiSign => "alibi_sign",
        }
    }

    /// The tiles `(br, bc)` the zoo's kernel with this bug uses (16, 32 or
    /// 64: the sizes of CPU kernels and of flash-attention's `kBlockN`).
    pub fn tiles(self) -> (usize, usize) {
        match self {
            AttentionBug::NoRescale | AttentionBug::GqaModulo | AttentionBug::DeltaPerTile => {
                (16, 16)
            }
            AttentionBug::CausalTileEdge | AttentionBug::DkvLastQueryTile => (16, 16),
            AttentionBug::UnmaskedTail | AttentionBug::TopLeftCausal => (32, 32),
            AttentionBug::RemainderTile | AttentionBug::Log2Lse => (32, 32),
            AttentionBug::FiniteMaskFill => (32, 32),
            AttentionBug::DiagonalTileSkipped | AttentionBug::DefaultScale => (64, 64),
            AttentionBug::HeadDimTail => (64, 64),
            AttentionBug::MaxSeqlenQForK => (16, 16),
            AttentionBug::WindowOffByOne | AttentionBug::WindowTopLeft => (16, 16),
            AttentionBug::WindowAcrossDocuments | AttentionBug::SoftcapAfterMask => (16, 16),
            AttentionBug::SoftcapNoChain | AttentionBug::AlibiPackStart => (16, 16),
            AttentionBug::AlibiSign => (16, 16),
            AttentionBug::GqaGradOverwrite => (64, 32),
        }
    }
}

/// The tiled attention kernel: query tiles of `br` rows, key tiles of `bc`
/// keys, with at most one [`AttentionBug`]. Declares
/// [`AttentionSupport::ALL`] (causal, GQA, cross, and flash-attention's
/// `window_size`, `softcap`, `alibi_slopes`, `seqused_k`:
/// `reference::attention::options`; a window visits every key tile and masks
/// each element).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TiledAttention {
    /// Query rows per tile (`kBlockM`).
    pub br: usize,
    /// Keys per tile (`kBlockN`).
    pub bc: usize,
    /// The mistake switched in; `None`: the correct kernel.
    pub bug: Option<AttentionBug>,
}

impl TiledAttention {
    /// The correct kernel with tiles `br x bc` (both at least 1).
    pub fn correct(br: usize, bc: usize) -> Self {
        TiledAttention {
            br: br.max(1),
            bc: bc.max(1),
            bug: None,
        }
    }

    /// The kernel with `bug`, at the bug's [`AttentionBug::tiles`].
    pub fn with(bug: AttentionBug) -> Self {
        let (br, bc) = bug.tiles();
        TiledAttention {
            br,
            bc,
            bug: Some(bug),
        }
    }

    /// The same kernel without its bug.
    pub fn fixed(self) -> Self {
        TiledAttention { bug: None, ..self }
    }

    pub(super) fn has(&self, bug: AttentionBug) -> bool {
        self.bug == Some(bug)
    }

    /// The key head of query head `a` (`h_kv` divides `h`).
    pub(super) fn kv_head(&self, a: usize, h: usize, h_kv: usize) -> usize {
        if self.has(AttentionBug::GqaModulo) {
            a % h_kv
        } else {
            a / (h / h_kv)
        }
    }

    /// The softmax scale the kernel multiplies `q . k` by.
    pub(super) fn scale(&self, given: f64, d: usize) -> f64 {
        if self.has(AttentionBug::DefaultScale) {
            1.0 / (d as f64).sqrt()
        } else {
            given
        }
    }

    /// The head dims `q . k` sums over: all `d`, or under
    /// [`AttentionBug::HeadDimTail`] the whole blocks of 32 (all `d` when
    /// `d < 32`).
    pub(super) fn dot_dims(&self, d: usize) -> usize {
        // The head-dim block of the bug's kernel.
        const HEAD_BLOCK: usize = 32;
        if self.has(AttentionBug::HeadDimTail) && d > HEAD_BLOCK {
            d / HEAD_BLOCK * HEAD_BLOCK
        } else {
            d
        }
    }

    /// How a masked score enters the softmax: `None` left out (correct),
    /// `Some(fill)` as that score.
    pub(super) fn masked_fill(&self, s: &Seg<'_>) -> Option<f64> {
        if self.has(AttentionBug::SoftcapAfterMask) && s.softcap > 0.0 {
            // cap(-inf) = softcap * tanh(-inf).
            return Some(-s.softcap);
        }
        // The fill of `masked_fill(mask, -1e9)` in many hand-written kernels.
        self.has(AttentionBug::FiniteMaskFill).then_some(-1e9)
    }

    /// The score of query `r` over key `c` of `s` (local indices) from its
    /// raw `scale * q . k`: the cap, then ALiBi's bias; and `d score / d
    /// raw` (the cap's chain factor, 1 without a cap).
    pub(super) fn score(
        &self,
        s: &Seg<'_>,
        a: usize,
        (r, c): (usize, usize),
        raw: f64,
    ) -> (f64, f64) {
        let (mut sc, mut chain) = if s.softcap > 0.0 {
            let t = (raw / s.softcap).tanh();
            (s.softcap * t, 1.0 - t * t)
        } else {
            (raw, 1.0)
        };
        if self.has(AttentionBug::SoftcapNoChain) {
            chain = 1.0;
        }
        if let Some(slopes) = s.alibi {
            let dist = if self.has(AttentionBug::AlibiPackStart) {
                (s.q0 + r) as f64 - (s.k0 + c) as f64
            } else {
                r as f64 + s.lk as f64 - s.lq as f64 - c as f64
            };
            let sign = if self.has(AttentionBug::AlibiSign) {
                1.0
            } else {
                -1.0
            };
            sc += sign * slopes[a] * dist.abs();
        }
        (sc, chain)
    }

    /// `l_k - l_q` of a causal segment: query `r` sees key `c <= r + off`
    /// (0 under [`AttentionBug::TopLeftCausal`]).
    fn causal_offset(&self, s: &Seg<'_>) -> i64 {
        if self.has(AttentionBug::TopLeftCausal) {
            0
        } else {
            s.lk as i64 - s.lq as i64
        }
    }

    /// Key tiles the query tile `r0..r1` of `s` visits (the first ones).
    pub(super) fn key_tiles(&self, s: &Seg<'_>, r1: usize) -> usize {
        let all = if self.has(AttentionBug::MaxSeqlenQForK) {
            s.lk.min(s.max_lq).div_ceil(self.bc)
        } else {
            s.lk.div_ceil(self.bc)
        };
        if !matches!(s.mask, Mask::Causal) {
            return all;
        }
        // The last key the tile's last query sees.
        let limit = r1 as i64 - 1 + self.causal_offset(s);
        if limit < 0 {
            return 0;
        }
        let through = limit as usize + 1;
        let tiles = if self.has(AttentionBug::DiagonalTileSkipped) {
            through / self.bc
        } else {
            through.div_ceil(self.bc)
        };
        tiles.min(all)
    }

    /// Keys `c0..c1` (local) of key tile `kt` of `s`, `c1` past the segment
    /// under [`AttentionBug::UnmaskedTail`].
    pub(super) fn key_tile(&self, s: &Seg<'_>, kt: usize) -> (usize, usize) {
        let c0 = kt * self.bc;
        let last = kt + 1 == s.lk.div_ceil(self.bc);
        let c1 = if self.has(AttentionBug::UnmaskedTail) {
            (c0 + self.bc).min(s.n_k - s.k0)
        } else if self.has(AttentionBug::RemainderTile) && last {
            c0 + s.lk % self.bc
        } else {
            (c0 + self.bc).min(s.lk)
        };
        (c0, c1)
    }

    /// Whether the tile of queries from `r0` over keys ending at `c1` needs
    /// the per-element mask.
    pub(super) fn tile_masked(&self, s: &Seg<'_>, r0: usize, c1: usize) -> bool {
        if !s.window.is_unbounded() {
            return true;
        }
        match s.mask {
            Mask::Full => false,
            Mask::Dense(_) => true,
            Mask::Causal => {
                // Fully visible when the tile's last key is visible to its
                // first query.
                let slack = i64::from(self.has(AttentionBug::CausalTileEdge));
                c1 as i64 - 1 > r0 as i64 + self.causal_offset(s) + slack
            }
        }
    }

    /// Whether query `r` sees key `c` of `s` (local indices).
    pub(super) fn visible(&self, s: &Seg<'_>, r: usize, c: usize) -> bool {
        let base = match s.mask {
            Mask::Full => true,
            Mask::Causal => (c as i64) <= r as i64 + self.causal_offset(s),
            Mask::Dense(m) => m[[s.q0 + r, s.k0 + c]],
        };
        let (c, w) = (c as i64, s.window);
        let diag = if self.has(AttentionBug::WindowTopLeft) {
            r as i64
        } else {
            r as i64 + s.lk as i64 - s.lq as i64
        };
        let slack = i64::from(self.has(AttentionBug::WindowOffByOne));
        base && w.right.is_none_or(|x| c <= diag + x as i64)
            && w.left.is_none_or(|x| c >= diag - x as i64 - slack)
    }
}

/// How the keys of a segment are masked.
#[derive(Debug, Clone, Copy)]
pub(super) enum Mask<'a> {
    /// Every key (bidirectional).
    Full,
    /// Bottom-right causal.
    Causal,
    /// `allowed: [n_q, n_k]`, global indices.
    Dense(ArrayView2<'a, bool>),
}

/// One segment: queries `q0..q0 + lq` over keys `k0..k0 + lk` of a key
/// tensor of `n_k` tokens.
#[derive(Debug, Clone, Copy)]
pub(super) struct Seg<'a> {
    pub(super) q0: usize,
    pub(super) lq: usize,
    pub(super) k0: usize,
    pub(super) lk: usize,
    pub(super) n_k: usize,
    /// The longest query segment of the call (`max_seqlen_q`).
    pub(super) max_lq: usize,
    pub(super) mask: Mask<'a>,
    /// `window_size` (bottom-right aligned on the used keys `lk`).
    pub(super) window: Window,
    /// `softcap` (0: none).
    pub(super) softcap: f64,
    /// `alibi_slopes: [h]`.
    pub(super) alibi: Option<&'a [f64]>,
}

/// The segments of a call: each varlen segment (its used keys,
/// `seqused_k`), or the whole dense problem. `across`
/// ([`AttentionBug::WindowAcrossDocuments`]): a bounded left window side
/// reaches up to `left` keys before the segment's first key.
pub(super) fn segments<'a>(form: &Form<'a>, n_q: usize, n_k: usize, across: bool) -> Vec<Seg<'a>> {
    match form {
        Form::Varlen(p) => {
            let max_lq = p.cu_seqlens_q.windows(2).map(|w| w[1] - w[0]).max();
            p.cu_seqlens_q
                .windows(2)
                .zip(p.cu_seqlens_k.windows(2))
                .enumerate()
                .map(|(i, (wq, wk))| {
                    // The bug's extension: the keys before the segment, as
                    // its first local columns (the diagonal moves with them).
                    let ext = match p.window.left {
                        Some(left) if across => left.min(wk[0]),
                        _ => 0,
                    };
                    Seg {
                        q0: wq[0],
                        lq: wq[1] - wq[0],
                        k0: wk[0] - ext,
                        lk: p.used_keys(i) + ext,
                        n_k,
                        max_lq: max_lq.unwrap_or(0),
                        mask: if p.causal { Mask::Causal } else { Mask::Full },
                        window: p.window,
                        softcap: p.softcap,
                        alibi: p.alibi_slopes,
                    }
                })
                .collect()
        }
        Form::Dense(m) => vec![Seg {
            q0: 0,
            lq: n_q,
            k0: 0,
            lk: n_k,
            n_k,
            max_lq: n_q,
            mask: Mask::Dense(m.allowed),
            window: Window::UNBOUNDED,
            softcap: 0.0,
            alibi: None,
        }],
    }
}

/// A call's form: varlen over `cu_seqlens`, or dense with a mask.
#[derive(Clone, Copy)]
pub(super) enum Form<'a> {
    Varlen(&'a Varlen<'a>),
    Dense(Masked<'a>),
}

impl Form<'_> {
    pub(super) fn scale(&self) -> f64 {
        match self {
            Form::Varlen(p) => p.scale,
            Form::Dense(m) => m.scale,
        }
    }

    /// The reference's checks in the reference's order (shapes, offsets or
    /// mask, the backward's inputs, scores, work), so that bad input is the
    /// reference's error.
    pub(super) fn check(&self, x: &Qkv<'_>, grad: Option<&Grad<'_>>) -> Result<()> {
        check_qkv_shapes(x.q.shape(), x.k.shape(), x.v.shape())?;
        let (n, h, d) = x.q.dim();
        let n_k = x.k.dim().0;
        match self {
            Form::Varlen(p) => check_varlen(p, n, n_k)?,
            Form::Dense(m) => check_mask_shape2(m.allowed.shape(), n, n_k)?,
        }
        if let Some(g) = grad {
            check_grad_shapes(
                g.grad_output.shape(),
                g.fwd.output.shape(),
                g.fwd.lse.shape(),
                (n, h, d),
            )?;
        }
        check_scores(&x.q, &x.k, self.scale())?;
        match self {
            Form::Varlen(p) => {
                check_varlen_options(p, h)?;
                check_varlen_work(p, h, d)
            }
            Form::Dense(_) => {
                let work = n as u128 * n_k as u128 * h as u128 * (d as u128 + 1);
                if work > u128::from(MAX_ATTENTION_WORK) {
                    return Err(Error::invalid(
                        "allowed",
                        format!("{work} units of work is over {MAX_ATTENTION_WORK}"),
                    ));
                }
                Ok(())
            }
        }
    }
}

impl TiledAttention {
    fn forward(&self, x: Qkv<'_>, form: Form<'_>) -> Result<AttentionOutput> {
        form.check(&x, None)?;
        let (n, h, d) = x.q.dim();
        let (n_k, h_kv, _) = x.k.dim();
        let mut output = Array3::zeros((n, h, d));
        let mut lse = Array2::zeros((h, n));
        let scale = self.scale(form.scale(), d);
        let across = self.has(AttentionBug::WindowAcrossDocuments);
        for s in segments(&form, n, n_k, across) {
            for a in 0..h {
                let kv = self.kv_head(a, h, h_kv);
                self.forward_tiles(&x, &s, (a, kv), scale, &mut output, &mut lse);
            }
        }
        Ok(AttentionOutput { output, lse })
    }

    /// Every query tile of segment `s` for query head `a` over key head `kv`.
    fn forward_tiles(
        &self,
        x: &Qkv<'_>,
        s: &Seg<'_>,
        (a, kv): (usize, usize),
        scale: f64,
        output: &mut Array3<f64>,
        lse: &mut Array2<f64>,
    ) {
        let d = x.q.dim().2;
        for r0 in (0..s.lq).step_by(self.br) {
            let r1 = (r0 + self.br).min(s.lq);
            let rows = r1 - r0;
            let mut m = vec![f64::NEG_INFINITY; rows];
            let mut l = vec![0.0; rows];
            let mut acc = Array2::<f64>::zeros((rows, d));
            let mut scores = Vec::with_capacity(self.bc);
            for kt in 0..self.key_tiles(s, r1) {
                let (c0, c1) = self.key_tile(s, kt);
                let masked = self.tile_masked(s, r0, c1);
                for r in r0..r1 {
                    let i = r - r0;
                    scores.clear();
                    for c in c0..c1 {
                        if masked && !self.visible(s, r, c) {
                            if let Some(fill) = self.masked_fill(s) {
                                scores.push((c, fill));
                            }
                            continue;
                        }
                        let mut dot = 0.0;
                        for e in 0..self.dot_dims(d) {
                            dot += x.q[[s.q0 + r, a, e]] * x.k[[s.k0 + c, kv, e]];
                        }
                        scores.push((c, self.score(s, a, (r, c), scale * dot).0));
                    }
                    let tile_max = scores
                        .iter()
                        .fold(f64::NEG_INFINITY, |mx, &(_, sc)| mx.max(sc));
                    if tile_max == f64::NEG_INFINITY {
                        continue;
                    }
                    let m_new = m[i].max(tile_max);
                    let alpha = if m[i] == f64::NEG_INFINITY {
                        0.0 // nothing summed yet
                    } else if self.has(AttentionBug::NoRescale) {
                        1.0
                    } else {
                        (m[i] - m_new).exp()
                    };
                    l[i] *= alpha;
                    for e in 0..d {
                        acc[[i, e]] *= alpha;
                    }
                    for &(c, sc) in &scores {
                        let p = (sc - m_new).exp();
                        l[i] += p;
                        for e in 0..d {
                            acc[[i, e]] += p * x.v[[s.k0 + c, kv, e]];
                        }
                    }
                    m[i] = m_new;
                }
            }
            for i in 0..rows {
                let row = s.q0 + r0 + i;
                if l[i] == 0.0 {
                    lse[[a, row]] = f64::NEG_INFINITY;
                    continue; // output row stays 0 (docs/FAULTS.md P8)
                }
                for e in 0..d {
                    output[[row, a, e]] = acc[[i, e]] / l[i];
                }
                let natural = m[i] + l[i].ln();
                lse[[a, row]] = if self.has(AttentionBug::Log2Lse) {
                    natural * std::f64::consts::LOG2_E
                } else {
                    natural
                };
            }
        }
    }
}

impl AttentionOp for TiledAttention {
    fn support(&self) -> AttentionSupport {
        AttentionSupport::ALL
    }

    fn varlen_forward(&self, x: Qkv<'_>, p: &Varlen<'_>) -> Result<AttentionOutput> {
        self.forward(x, Form::Varlen(p))
    }

    fn varlen_backward(&self, x: Qkv<'_>, p: &Varlen<'_>, g: Grad<'_>) -> Result<AttentionGrads> {
        self.backward(x, Form::Varlen(p), g)
    }

    fn masked_forward(&self, x: Qkv<'_>, m: Masked<'_>) -> Result<AttentionOutput> {
        self.forward(x, Form::Dense(m))
    }

    fn masked_backward(&self, x: Qkv<'_>, m: Masked<'_>, g: Grad<'_>) -> Result<AttentionGrads> {
        self.backward(x, Form::Dense(m), g)
    }
}
