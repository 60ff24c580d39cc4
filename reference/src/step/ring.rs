//! Ring attention over the context-parallel ranks (Liu et al. 2023, "Ring
//! Attention with Blockwise Transformers"; TransformerEngine's
//! `AttnFuncWithCPAndKVP2P`): each rank keeps its queries, the key/value
//! chunks travel around the ring, and each arriving chunk's partial result
//! is merged into the running one by its log-sum-exp, rescaled by the
//! running maximum (Milakov & Gimelshein 2018, online softmax).
//!
//! A pair of a query and a key is allowed when both are real tokens of the
//! same document and the key's position is at or before the query's
//! ([`allowed`]): causal per document, whatever rank holds either.
//!
//! The kernels here ([`partial_forward`], [`merge`], [`finish`],
//! [`chunk_backward`]) are what a rank computes per step; [`RingAttention`]
//! runs all ranks in one process, in the order the ring delivers the chunks
//! (step `s`: rank `r` holds rank `r - s`'s keys), and the MPI runner
//! (`packshard-step`, `packshard_pipeline::step`) runs the same kernels with the chunks sent
//! point to point. Shapes: `q: [n_q, h, d]`, `k, v: [n_k, h_kv, d]`, per
//! query head `[h, n_q]` statistics.

use ndarray::{Array2, Array3, ArrayView1, ArrayView3, Axis, Slice};

use super::partition::TokenMeta;
use crate::attention::{AttentionGrads, AttentionOutput};
use crate::error::{Error, Result};
use crate::ops::{AttentionOp, AttentionSupport, Grad, Masked, Qkv, Varlen};

/// Whether query `q` may attend to key `k`: both real, the same document,
/// the key at or before the query.
pub fn allowed(q: &TokenMeta, k: &TokenMeta) -> bool {
    q.real && k.real && q.doc == k.doc && k.pos <= q.pos
}

/// A running attention result before normalisation: `acc = sum_j
/// exp(s_ij - m_i) v_j` (`[n_q, h, d]`), `m` the running maximum score and
/// `l = sum_j exp(s_ij - m_i)` (both `[h, n_q]`; `m = -inf`, `l = 0` for a
/// query that has seen no allowed key).
#[derive(Debug, Clone, PartialEq)]
pub struct Partial {
    /// `[n_q, h, d]`.
    pub acc: Array3<f64>,
    /// `[h, n_q]`.
    pub m: Array2<f64>,
    /// `[h, n_q]`.
    pub l: Array2<f64>,
}

/// Row `[i, a, ..]` of a `[n, heads, d]` tensor.
fn row(x: ArrayView3<'_, f64>, i: usize, a: usize) -> ArrayView1<'_, f64> {
    x.index_axis_move(Axis(0), i).index_axis_move(Axis(0), a)
}

fn group(h: usize, h_kv: usize) -> usize {
    (h / h_kv.max(1)).max(1)
}

/// The partial result of queries `q` (metadata `mq`) over one key/value
/// chunk (`k, v`, metadata `mk`), scores `scale * q . k`.
pub fn partial_forward(
    q: ArrayView3<f64>,
    mq: &[TokenMeta],
    k: ArrayView3<f64>,
    v: ArrayView3<f64>,
    mk: &[TokenMeta],
    scale: f64,
) -> Partial {
    let (nq, h, d) = q.dim();
    let h_kv = k.dim().1;
    let g = group(h, h_kv);
    let mut p = Partial {
        acc: Array3::zeros((nq, h, d)),
        m: Array2::from_elem((h, nq), f64::NEG_INFINITY),
        l: Array2::zeros((h, nq)),
    };
    let mut scores = Vec::with_capacity(mk.len());
    for (i, qi) in mq.iter().enumerate() {
        for a in 0..h {
            let kh = a / g;
            scores.clear();
            let mut m = f64::NEG_INFINITY;
            for (j, kj) in mk.iter().enumerate() {
                if allowed(qi, kj) {
                    let sc = scale * row(q.view(), i, a).dot(&row(k.view(), j, kh));
                    m = m.max(sc);
                    scores.push((j, sc));
                }
            }
            if scores.is_empty() {
                continue;
            }
            let mut l = 0.0;
            for &(j, sc) in &scores {
                let e = (sc - m).exp();
                l += e;
                let mut out = p.acc.index_axis_mut(Axis(0), i).index_axis_move(Axis(0), a);
                out.scaled_add(e, &row(v.view(), j, kh));
            }
            p.m[[a, i]] = m;
            p.l[[a, i]] = l;
        }
    }
    p
}

/// Merges `b` into `a`: `m = max(m_a, m_b)`, `acc = acc_a e^(m_a - m) +
/// acc_b e^(m_b - m)`, `l` likewise. With `rescale == false` the factors are
/// dropped (docs/FAULTS.md D6: sums taken against different maxima added as
/// if against one), for the negative control.
pub fn merge(a: &mut Partial, b: &Partial, rescale: bool) {
    let (nq, h, _) = a.acc.dim();
    for i in 0..nq {
        for hd in 0..h {
            let (ma, mb) = (a.m[[hd, i]], b.m[[hd, i]]);
            let m = ma.max(mb);
            if m == f64::NEG_INFINITY {
                continue;
            }
            let (fa, fb) = if rescale {
                (factor(ma, m), factor(mb, m))
            } else {
                (1.0, 1.0)
            };
            a.l[[hd, i]] = a.l[[hd, i]] * fa + b.l[[hd, i]] * fb;
            let mut out = a
                .acc
                .index_axis_mut(Axis(0), i)
                .index_axis_move(Axis(0), hd);
            out *= fa;
            out.scaled_add(fb, &row(b.acc.view(), i, hd));
            a.m[[hd, i]] = m;
        }
    }
}

fn factor(x: f64, m: f64) -> f64 {
    if x == f64::NEG_INFINITY {
        0.0
    } else {
        (x - m).exp()
    }
}

/// The normalised result: `output = acc / l` and `lse = m + ln l`; a query
/// that saw no allowed key has output 0 and `lse = -inf` (docs/FAULTS.md P8).
pub fn finish(p: Partial) -> AttentionOutput {
    let Partial { mut acc, m, l } = p;
    let (nq, h, _) = acc.dim();
    let mut lse = Array2::from_elem((h, nq), f64::NEG_INFINITY);
    for i in 0..nq {
        for a in 0..h {
            let li = l[[a, i]];
            if li > 0.0 {
                lse[[a, i]] = m[[a, i]] + li.ln();
                acc.index_axis_mut(Axis(0), i)
                    .index_axis_move(Axis(0), a)
                    .mapv_inplace(|x| x / li);
            }
        }
    }
    AttentionOutput { output: acc, lse }
}

/// `delta = rowsum(grad_output * output)` per head: `[h, n_q]`
/// (flash-attention's `D`).
pub fn delta(fwd: &AttentionOutput, grad_output: ArrayView3<f64>) -> Array2<f64> {
    let (nq, h, _) = fwd.output.dim();
    Array2::from_shape_fn((h, nq), |(a, i)| {
        row(fwd.output.view(), i, a).dot(&row(grad_output.view(), i, a))
    })
}

/// One chunk's share of the backward (flash-attention 2's, Dao 2023, alg.
/// 2), from the merged forward: `p_ij = exp(s_ij - lse_i)`, `dv_j += p_ij
/// do_i`, `ds_ij = p_ij (do_i . v_j - delta_i)`, `dq_i += scale ds_ij k_j`,
/// `dk_j += scale ds_ij q_i`. Adds into `dq: [n_q, h, d]` and `dk, dv: [n_k,
/// h_kv, d]`; `lse, delta: [h, n_q]`.
#[allow(clippy::too_many_arguments)]
pub fn chunk_backward(
    x: Qkv<'_>,
    mq: &[TokenMeta],
    mk: &[TokenMeta],
    scale: f64,
    lse: &Array2<f64>,
    delta: &Array2<f64>,
    grad_output: ArrayView3<f64>,
    dq: &mut Array3<f64>,
    dk: &mut Array3<f64>,
    dv: &mut Array3<f64>,
) {
    let (_, h, _) = x.q.dim();
    let g = group(h, x.k.dim().1);
    for (i, qi) in mq.iter().enumerate() {
        for a in 0..h {
            let li = lse[[a, i]];
            if li == f64::NEG_INFINITY {
                continue;
            }
            let kh = a / g;
            let qrow = row(x.q.view(), i, a);
            let dorow = row(grad_output.view(), i, a);
            for (j, kj) in mk.iter().enumerate() {
                if !allowed(qi, kj) {
                    continue;
                }
                let krow = row(x.k.view(), j, kh);
                let p = (scale * qrow.dot(&krow) - li).exp();
                dv.index_axis_mut(Axis(0), j)
                    .index_axis_move(Axis(0), kh)
                    .scaled_add(p, &dorow);
                let ds = p * (dorow.dot(&row(x.v.view(), j, kh)) - delta[[a, i]]);
                dq.index_axis_mut(Axis(0), i)
                    .index_axis_move(Axis(0), a)
                    .scaled_add(scale * ds, &krow);
                dk.index_axis_mut(Axis(0), j)
                    .index_axis_move(Axis(0), kh)
                    .scaled_add(scale * ds, &qrow);
            }
        }
    }
}

/// All `cp` ranks' ring attention in one process: the tensors are the
/// ranks' local slots one after another (rank 0's, then rank 1's, ...), as
/// the step concatenates them; `ranks[r]` is rank `r`'s metadata. The decoder
/// calls it through its varlen form; the `cu_seqlens` it passes are the
/// ranks' local padded boundaries (only their total is read here).
#[derive(Debug, Clone, PartialEq)]
pub struct RingAttention {
    /// Per rank, `[n_local]`.
    pub ranks: Vec<Vec<TokenMeta>>,
    /// Merge with the max rescale (false: docs/FAULTS.md D6).
    pub rescale: bool,
}

impl RingAttention {
    fn offsets(&self, n: usize) -> Result<Vec<usize>> {
        let mut off = vec![0];
        for r in &self.ranks {
            off.push(off.last().unwrap_or(&0) + r.len());
        }
        if off.last() != Some(&n) {
            return Err(Error::ShapeMismatch {
                field: "q".into(),
                expected: format!("[n] = [{}] (the ranks' slots)", off.last().unwrap_or(&0)),
                actual: vec![n],
            });
        }
        Ok(off)
    }
}

impl AttentionOp for RingAttention {
    fn support(&self) -> AttentionSupport {
        AttentionSupport::ALL
    }

    fn varlen_forward(&self, x: Qkv<'_>, p: &Varlen<'_>) -> Result<AttentionOutput> {
        let (n, h, d) = x.q.dim();
        let off = self.offsets(n)?;
        self.offsets(x.k.dim().0)?;
        let cp = self.ranks.len();
        let mut output = Array3::zeros((n, h, d));
        let mut lse = Array2::zeros((h, n));
        for r in 0..cp {
            let q = x.q.slice_axis(Axis(0), (off[r]..off[r + 1]).into());
            let mut acc: Option<Partial> = None;
            for step in 0..cp {
                let src = (r + cp - step) % cp;
                let rows = (off[src]..off[src + 1]).into();
                let part = partial_forward(
                    q,
                    &self.ranks[r],
                    x.k.slice_axis(Axis(0), rows),
                    x.v.slice_axis(Axis(0), rows),
                    &self.ranks[src],
                    p.scale,
                );
                match acc.as_mut() {
                    None => acc = Some(part),
                    Some(a) => merge(a, &part, self.rescale),
                }
            }
            if let Some(a) = acc {
                let out = finish(a);
                output
                    .slice_axis_mut(Axis(0), Slice::from(off[r]..off[r + 1]))
                    .assign(&out.output);
                lse.slice_axis_mut(Axis(1), Slice::from(off[r]..off[r + 1]))
                    .assign(&out.lse);
            }
        }
        Ok(AttentionOutput { output, lse })
    }

    fn varlen_backward(&self, x: Qkv<'_>, p: &Varlen<'_>, g: Grad<'_>) -> Result<AttentionGrads> {
        let (n, h, d) = x.q.dim();
        let off = self.offsets(n)?;
        let cp = self.ranks.len();
        let h_kv = x.k.dim().1;
        let delta_all = delta(g.fwd, g.grad_output);
        let mut grad_q = Array3::zeros((n, h, d));
        let mut grad_k = Array3::zeros((n, h_kv, d));
        let mut grad_v = Array3::zeros((n, h_kv, d));
        // Step-major, as the ring runs: at step s rank r adds to the bundle
        // of rank r - s, which then moves on to rank r + 1.
        for step in 0..cp {
            for r in 0..cp {
                let src = (r + cp - step) % cp;
                let (qr, kr) = (off[r]..off[r + 1], off[src]..off[src + 1]);
                let mut dq = grad_q
                    .slice_axis(Axis(0), Slice::from(qr.clone()))
                    .to_owned();
                let mut dk = grad_k
                    .slice_axis(Axis(0), Slice::from(kr.clone()))
                    .to_owned();
                let mut dv = grad_v
                    .slice_axis(Axis(0), Slice::from(kr.clone()))
                    .to_owned();
                chunk_backward(
                    Qkv::new(
                        x.q.slice_axis(Axis(0), Slice::from(qr.clone())),
                        x.k.slice_axis(Axis(0), Slice::from(kr.clone())),
                        x.v.slice_axis(Axis(0), Slice::from(kr.clone())),
                    ),
                    &self.ranks[r],
                    &self.ranks[src],
                    p.scale,
                    &g.fwd
                        .lse
                        .slice_axis(Axis(1), Slice::from(qr.clone()))
                        .to_owned(),
                    &delta_all
                        .slice_axis(Axis(1), Slice::from(qr.clone()))
                        .to_owned(),
                    g.grad_output.slice_axis(Axis(0), Slice::from(qr.clone())),
                    &mut dq,
                    &mut dk,
                    &mut dv,
                );
                grad_q.slice_axis_mut(Axis(0), Slice::from(qr)).assign(&dq);
                grad_k
                    .slice_axis_mut(Axis(0), Slice::from(kr.clone()))
                    .assign(&dk);
                grad_v.slice_axis_mut(Axis(0), Slice::from(kr)).assign(&dv);
            }
        }
        Ok(AttentionGrads {
            grad_q,
            grad_k,
            grad_v,
        })
    }

    fn masked_forward(&self, _: Qkv<'_>, _: Masked<'_>) -> Result<AttentionOutput> {
        Err(Error::invalid(
            "attention",
            "ring attention runs the varlen (THD) layout only",
        ))
    }

    fn masked_backward(&self, _: Qkv<'_>, _: Masked<'_>, _: Grad<'_>) -> Result<AttentionGrads> {
        Err(Error::invalid(
            "attention",
            "ring attention runs the varlen (THD) layout only",
        ))
    }
}
