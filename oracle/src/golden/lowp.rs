//! The reference computed in a lower precision: where the tolerance of a
//! golden output in f32 or bf16 comes from.
//!
//! Following flash-attention's test rule (and `docs/CONTRIBUTING.md`), a
//! kernel in precision `D` may be off the f64 ground truth by at most `k`
//! times the error of *the reference computed in `D`*. These functions are
//! that reference: the same math as `packshard_reference`, written plainly,
//! with f32 arithmetic (as every f32 and bf16 kernel accumulates) and every
//! tensor a kernel would store — attention scores, probabilities, outputs,
//! `lse`, the gradients, logits, losses — rounded to `D` (PyTorch's
//! reference in low precision, `attention_ref(upcast=False)`, does the same).
//! For `D = f32` the rounding is the identity. Sums run in index order,
//! without compensation.
//!
//! Inputs are the stored (already rounded) golden inputs, as f64.

use ndarray::{Array2, Array3, ArrayView2, ArrayView3};
use packshard_reference::attention::options::{alibi_bias, visible_keys};
use packshard_reference::attention::{AttentionGrads, AttentionOutput};
use packshard_reference::ops::Varlen;
use packshard_reference::vocab::{LossCall, Reduction};

use super::io::Dtype;

fn st(dtype: Dtype, x: f32) -> f32 {
    dtype.round(f64::from(x)) as f32
}

/// Varlen attention forward and backward in `dtype` (see the module docs),
/// with every option of `p` as the reference takes them
/// ([`packshard_reference::attention::options`]): `q, grad_output: [n_q, h,
/// d]`, `k, v: [n_k, h_kv, d]` (`h_kv` dividing `h`; query head `a` reads
/// key head `a / (h / h_kv)`), `p`'s offsets `cu_seqlens_q`, `cu_seqlens_k:
/// [b + 1]` (well-formed; segment `s` has `l_q` queries over `l_k` keys, or
/// `seqused_k[s]`), the causal mask and the window bottom-right aligned
/// (query `r` of a segment sees keys [`visible_keys`]), the score `s =
/// cap(scale q . k) + bias` (`cap(x) = softcap tanh(x / softcap)`, its
/// gradient `1 - tanh^2`; ALiBi's bias `-slope[a] |r + l_k - l_q - c|`),
/// each computed in f32 and the score rounded to `dtype` once. Returns what
/// [`varlen_pass`](packshard_reference::attention::varlen_pass) does, in the
/// low precision (as f64 values): `output: [n_q, h, d]`, `lse: [h, n_q]`
/// (`-inf` for a query that sees no key, whose output and gradients are 0),
/// `grad_q: [n_q, h, d]`, `grad_k`, `grad_v: [n_k, h_kv, d]`.
pub fn attention(
    q: ArrayView3<f64>,
    k: ArrayView3<f64>,
    v: ArrayView3<f64>,
    grad_output: ArrayView3<f64>,
    p: &Varlen<'_>,
    dtype: Dtype,
) -> (AttentionOutput, AttentionGrads) {
    let (n, h, d) = q.dim();
    let (n_k, h_kv, _) = k.dim();
    let group = h / h_kv;
    let r = |x: f32| st(dtype, x);
    let f = |x: f64| x as f32;
    let c = p.scale as f32;
    let softcap = p.softcap as f32;
    let mut out = Array3::<f32>::zeros((n, h, d));
    let mut lse = Array2::<f32>::zeros((h, n));
    let mut gq = Array3::<f32>::zeros((n, h, d));
    let mut gk = Array3::<f32>::zeros((n_k, h_kv, d));
    let mut gv = Array3::<f32>::zeros((n_k, h_kv, d));
    let segments = p.cu_seqlens_q.windows(2).zip(p.cu_seqlens_k.windows(2));
    for (seg, (wq, wk)) in segments.enumerate() {
        let (a, len, b) = (wq[0], wq[1] - wq[0], wk[0]);
        let lk = p.used_keys(seg);
        let keys_of = |i: usize| visible_keys(i, len, lk, p.causal, p.window);
        for head in 0..h {
            let kv = head / group;
            let slope = p.alibi_slopes.map(|s| s[head] as f32);
            // Forward: per query, its keys' raw scores (for the softcap's
            // gradient) and probabilities, stored in dtype.
            let mut raw = vec![Vec::new(); len];
            let mut prob = vec![Vec::new(); len];
            for i in 0..len {
                let keys = keys_of(i);
                if keys.is_empty() {
                    lse[[head, a + i]] = f32::NEG_INFINITY;
                    continue; // output row stays 0 (P8)
                }
                let s: Vec<f32> = keys
                    .clone()
                    .map(|j| {
                        let mut dot = 0f32;
                        for x in 0..d {
                            dot += f(q[[a + i, head, x]]) * f(k[[b + j, kv, x]]);
                        }
                        let x = c * dot;
                        raw[i].push(x);
                        let x = if softcap > 0.0 {
                            softcap * (x / softcap).tanh()
                        } else {
                            x
                        };
                        // The distance in f64 (an integer, exact), the product in f32.
                        r(slope.map_or(x, |m| x + m * alibi_bias(1.0, i, j, len, lk) as f32))
                    })
                    .collect();
                let m = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let e: Vec<f32> = s.iter().map(|&x| (x - m).exp()).collect();
                let l: f32 = e.iter().sum();
                lse[[head, a + i]] = r(m + l.ln());
                prob[i] = e.iter().map(|&x| r(x / l)).collect();
                for x in 0..d {
                    let mut o = 0f32;
                    for (pj, j) in prob[i].iter().zip(keys.clone()) {
                        o += pj * f(v[[b + j, kv, x]]);
                    }
                    out[[a + i, head, x]] = r(o);
                }
            }
            // Backward.
            for i in 0..len {
                let mut dd = 0f32;
                for x in 0..d {
                    dd += f(grad_output[[a + i, head, x]]) * out[[a + i, head, x]];
                }
                for ((&pj, &xj), j) in prob[i].iter().zip(&raw[i]).zip(keys_of(i)) {
                    let mut dp = 0f32;
                    for x in 0..d {
                        dp += f(grad_output[[a + i, head, x]]) * f(v[[b + j, kv, x]]);
                    }
                    let ds = pj * (r(dp) - dd);
                    // Through the cap: 1 - tanh^2, as (1 - t)(1 + t).
                    let ds = r(if softcap > 0.0 {
                        let t = (xj / softcap).tanh();
                        ds * ((1.0 - t) * (1.0 + t))
                    } else {
                        ds
                    });
                    for x in 0..d {
                        gq[[a + i, head, x]] += c * ds * f(k[[b + j, kv, x]]);
                        gk[[b + j, kv, x]] += c * ds * f(q[[a + i, head, x]]);
                        gv[[b + j, kv, x]] += pj * f(grad_output[[a + i, head, x]]);
                    }
                }
            }
        }
    }
    let back3 = |x: Array3<f32>| x.mapv(|y| f64::from(r(y)));
    let fwd = AttentionOutput {
        output: back3(out),
        lse: lse.mapv(f64::from),
    };
    let grads = AttentionGrads {
        grad_q: back3(gq),
        grad_k: back3(gk),
        grad_v: back3(gv),
    };
    (fwd, grads)
}

/// Cross-entropy outputs in the low precision (as f64 values).
#[derive(Debug, Clone)]
pub struct CrossEntropy {
    /// The reduced loss.
    pub loss: f64,
    /// `[n]`.
    pub per_token_loss: Vec<f64>,
    /// `[n]`.
    pub logsumexp: Vec<f64>,
    /// `[n, v]`.
    pub grad_logits: Array2<f64>,
}

/// Cross-entropy of `logits: [n, v]` (real columns only) in `dtype`, with
/// the options of `config` (the reference's semantics: ignored tokens 0,
/// smoothing conventions, z-loss, reductions). Targets must be valid and
/// no non-ignored row all `-inf` (the golden cases are).
pub fn cross_entropy(logits: ArrayView2<f64>, call: &LossCall, dtype: Dtype) -> CrossEntropy {
    let (targets, config) = (call.targets, call.config);
    let (n, v) = logits.dim();
    let r = |x: f32| st(dtype, x);
    let parsed: Vec<Option<usize>> = (0..n)
        .map(|i| config.target(targets, i, v).ok().flatten())
        .collect();
    let (qt, qo) = config.target_distribution(v);
    let (qt, qo) = (qt as f32, qo as f32);
    let weights = call.token_weights(&parsed);
    let zl = config.z_loss as f32;
    let mut per_token = vec![0f32; n];
    let mut lses = vec![0f32; n];
    let mut grad = Array2::<f64>::zeros((n, v));
    for i in 0..n {
        // The softcap first (docs/FAULTS.md O1), in f32; `-inf` kept.
        let cap = |x: f32| match config.softcap {
            Some(c) if x != f32::NEG_INFINITY => r(c as f32 * (x / c as f32).tanh()),
            _ => x,
        };
        let z: Vec<f32> = (0..v).map(|j| cap(logits[[i, j]] as f32)).collect();
        let m = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let s: f32 = z.iter().map(|&x| (x - m).exp()).sum();
        let lse = m + s.ln();
        lses[i] = r(lse);
        let Some(t) = parsed[i] else { continue };
        let mut loss = 0f32;
        for (j, &zj) in z.iter().enumerate() {
            let q = if j == t { qt } else { qo };
            if q > 0.0 {
                loss += q * (lse - zj);
            }
        }
        per_token[i] = r(loss + zl * lse * lse);
        let w = weights[i] as f32;
        for (j, &zj) in z.iter().enumerate() {
            let q = if j == t { qt } else { qo };
            let p = (zj - lse).exp();
            let dy = w * (p - q + 2.0 * zl * lse * p);
            let dz = match config.softcap {
                Some(c) if zj != f32::NEG_INFINITY => {
                    let t = zj / c as f32;
                    dy * ((1.0 - t) * (1.0 + t))
                }
                _ => dy,
            };
            grad[[i, j]] = f64::from(r(dz));
        }
    }
    let sum: f32 = per_token.iter().sum();
    let count = parsed.iter().filter(|t| t.is_some()).count();
    let loss = match config.reduction {
        Reduction::Mean if count > 0 => sum / count as f32,
        Reduction::Mean => 0.0,
        Reduction::Sum | Reduction::None => sum,
    };
    CrossEntropy {
        loss: f64::from(r(loss)),
        per_token_loss: per_token.into_iter().map(f64::from).collect(),
        logsumexp: lses.into_iter().map(f64::from).collect(),
        grad_logits: grad,
    }
}

/// `a @ b^T` (`a: [n, k]`, `b: [m, k]`) with f32 accumulation, rounded to `dtype`.
fn matmul_t(a: ArrayView2<f64>, b: ArrayView2<f64>, dtype: Dtype) -> Array2<f64> {
    let (n, k) = a.dim();
    let m = b.nrows();
    Array2::from_shape_fn((n, m), |(i, j)| {
        let mut s = 0f32;
        for x in 0..k {
            s += a[[i, x]] as f32 * b[[j, x]] as f32;
        }
        f64::from(st(dtype, s))
    })
}

/// The output layer in `dtype`: `logits = hidden @ weight^T` (`hidden: [n,
/// h]`, `weight: [v, h]` real rows), its cross-entropy, `grad_hidden: [n, h]`
/// and `grad_weight: [v, h]`.
pub fn linear_cross_entropy(
    hidden: ArrayView2<f64>,
    weight: ArrayView2<f64>,
    call: &LossCall,
    dtype: Dtype,
) -> (CrossEntropy, Array2<f64>, Array2<f64>) {
    let logits = matmul_t(hidden, weight, dtype);
    let ce = cross_entropy(logits.view(), call, dtype);
    let g = &ce.grad_logits;
    let grad_hidden = matmul_t(g.view(), weight.t(), dtype);
    let grad_weight = matmul_t(g.t(), hidden.t(), dtype);
    (ce, grad_hidden, grad_weight)
}

/// The embedding's weight gradient in `dtype`: rows of `grad_output: [n, h]`
/// summed (f32, in token order) into `[w, h]` at `ids`; `ids` valid.
pub fn embedding_grad(
    ids: &[i64],
    grad_output: ArrayView2<f64>,
    rows: usize,
    dtype: Dtype,
) -> Array2<f64> {
    let h = grad_output.ncols();
    let mut g = Array2::<f32>::zeros((rows, h));
    for (i, &id) in ids.iter().enumerate() {
        for x in 0..h {
            g[[id as usize, x]] += grad_output[[i, x]] as f32;
        }
    }
    g.mapv(|y| f64::from(st(dtype, y)))
}
