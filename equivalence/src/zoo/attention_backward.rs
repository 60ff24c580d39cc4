//! The backward of [`TiledAttention`] (flash-attention 2, Dao 2023,
//! Algorithm 2): per segment and query head, `D_i = rowsum(dO_i * O_i)` for
//! each query row from the forward's output; then key tiles in the outer
//! loop, each accumulating its `dK`, `dV` over the query tiles that visit it
//! (the forward's tile schedule), the probabilities recomputed from `lse` as
//! `P_ij = exp(s_ij - lse_i)`, `dP_ij = dO_i . v_j`, `dS_ij = P_ij (dP_ij -
//! D_i)` (times the softcap's `1 - tanh^2(raw / softcap)`), `dQ_i += scale dS_ij k_j`, `dK_j += scale dS_ij q_i`, `dV_j +=
//! P_ij dO_i`; a key head's `dK`, `dV` summed over the query heads of its
//! group.
//!
//! Shapes: `grad_q: [n_q, h, d]`, `grad_k, grad_v: [n_k, h_kv, d]`.

use ndarray::{Array2, Array3};
use packshard_reference::bert::AttentionGrads;
use packshard_reference::ops::{Grad, Qkv};
use packshard_reference::Result;

use super::attention::{segments, AttentionBug, Form, Seg, TiledAttention};

impl TiledAttention {
    pub(super) fn backward(
        &self,
        x: Qkv<'_>,
        form: Form<'_>,
        g: Grad<'_>,
    ) -> Result<AttentionGrads> {
        form.check(&x, Some(&g))?;
        let (n, h, d) = x.q.dim();
        let (n_k, h_kv, _) = x.k.dim();
        let mut grads = AttentionGrads {
            grad_q: Array3::zeros((n, h, d)),
            grad_k: Array3::zeros((n_k, h_kv, d)),
            grad_v: Array3::zeros((n_k, h_kv, d)),
        };
        let scale = self.scale(form.scale(), d);
        let across = self.has(AttentionBug::WindowAcrossDocuments);
        for s in segments(&form, n, n_k, across) {
            for a in 0..h {
                let kv = self.kv_head(a, h, h_kv);
                self.backward_tiles(&x, &s, (a, kv), scale, &g, &mut grads);
            }
        }
        Ok(grads)
    }

    /// Every key tile of segment `s` for query head `a` over key head `kv`.
    fn backward_tiles(
        &self,
        x: &Qkv<'_>,
        s: &Seg<'_>,
        (a, kv): (usize, usize),
        scale: f64,
        g: &Grad<'_>,
        grads: &mut AttentionGrads,
    ) {
        let d = x.q.dim().2;
        let (out, go, lse) = (&g.fwd.output, &g.grad_output, &g.fwd.lse);
        let row = |r: usize| s.q0 + r;
        // D_i = rowsum(dO_i * O_i): one number per query row.
        let delta: Vec<f64> = (0..s.lq)
            .map(|r| {
                (0..d)
                    .map(|e| go[[row(r), a, e]] * out[[row(r), a, e]])
                    .sum()
            })
            .collect();
        let mut probs: Vec<(usize, f64, f64, f64)> = Vec::with_capacity(self.bc);
        for kt in 0..s.lk.div_ceil(self.bc) {
            let (c0, c1) = self.key_tile(s, kt);
            let mut dk = Array2::<f64>::zeros((c1 - c0, d));
            let mut dv = Array2::<f64>::zeros((c1 - c0, d));
            for r0 in (0..s.lq).step_by(self.br) {
                let r1 = (r0 + self.br).min(s.lq);
                if kt >= self.key_tiles(s, r1) {
                    continue; // the forward never visited this tile
                }
                if self.has(AttentionBug::DkvLastQueryTile) {
                    dk.fill(0.0);
                    dv.fill(0.0);
                }
                let masked = self.tile_masked(s, r0, c1);
                for r in r0..r1 {
                    let l = lse[[a, row(r)]];
                    if l == f64::NEG_INFINITY {
                        continue; // no visible key: zero gradients (P8)
                    }
                    probs.clear();
                    for c in c0..c1 {
                        let (sc, chain) = if masked && !self.visible(s, r, c) {
                            match self.masked_fill(s) {
                                Some(fill) => (fill, 1.0),
                                None => continue,
                            }
                        } else {
                            let mut dot = 0.0;
                            for e in 0..self.dot_dims(d) {
                                dot += x.q[[row(r), a, e]] * x.k[[s.k0 + c, kv, e]];
                            }
                            self.score(s, a, (r, c), scale * dot)
                        };
                        let p = (sc - l).exp();
                        let mut dp = 0.0;
                        for e in 0..d {
                            dp += go[[row(r), a, e]] * x.v[[s.k0 + c, kv, e]];
                        }
                        probs.push((c, p, dp, chain));
                    }
                    let dd = if self.has(AttentionBug::DeltaPerTile) {
                        probs.iter().map(|&(_, p, dp, _)| p * dp).sum()
                    } else {
                        delta[r]
                    };
                    for &(c, p, dp, chain) in &probs {
                        // The cap's chain factor (1 without a cap).
                        let ds = p * (dp - dd) * chain;
                        let j = c - c0;
                        for e in 0..d {
                            dv[[j, e]] += p * go[[row(r), a, e]];
                            grads.grad_q[[row(r), a, e]] += scale * ds * x.k[[s.k0 + c, kv, e]];
                            dk[[j, e]] += scale * ds * x.q[[row(r), a, e]];
                        }
                    }
                }
            }
            let overwrite = self.has(AttentionBug::GqaGradOverwrite);
            for j in 0..c1 - c0 {
                for e in 0..d {
                    let at = [s.k0 + c0 + j, kv, e];
                    if overwrite {
                        grads.grad_k[at] = dk[[j, e]];
                        grads.grad_v[at] = dv[[j, e]];
                    } else {
                        grads.grad_k[at] += dk[[j, e]];
                        grads.grad_v[at] += dv[[j, e]];
                    }
                }
            }
        }
    }
}
