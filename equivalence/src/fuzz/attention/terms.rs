//! The magnitude of the terms of each attention output: the absolute floor
//! of the fuzz comparison ([`AttentionTerms`]).

#[cfg(test)]
use ndarray::Array3;
use ndarray::ArrayView3;
use packshard_reference::attention::options::{alibi_bias, cap, visible_keys};
use packshard_reference::attention::Window;

/// flash-attention's options of one segment, as [`AttentionTerms::of_with`]
/// takes them.
#[derive(Debug, Clone, Copy, Default)]
pub struct SegmentOptions<'a> {
    /// `window_size`.
    pub window: Window,
    /// `softcap` (0: none).
    pub softcap: f64,
    /// `alibi_slopes: [h]`.
    pub alibi_slopes: Option<&'a [f64]>,
    /// The keys used (`seqused_k[s]`; `None`: all `l_k`).
    pub used_keys: Option<usize>,
}

/// The magnitude of the terms of each attention output of one segment: a
/// running error bound, in units of the f64 epsilon, of the softmax
/// attention computed from the segment's inputs (its largest element per
/// tensor). A tolerance `64 x eps x T` (the project's 64 ulp of the terms)
/// then holds any f64 implementation that rounds differently — another
/// summation order, the scale applied before or after the dot product, an
/// online softmax — and nothing that computes something else.
///
/// The segment is `l_q` queries over `l_k` keys, `h` query heads over
/// `h_kv` key heads (query head `a` reads key head `a / (h / h_kv)`), keys
/// after a query's bottom-right aligned position masked when `causal` (query
/// `r` sees keys `c <= r + l_k - l_q`). Per query `i` (one head), with `a_j =
/// |scale| d sum_c |q_ic k_jc|` the rounding of score `s_j`, `m` the row
/// maximum, `l` its `lse`, `p_j` the probabilities and `L = max(l_k, l_q
/// h / h_kv)` the most terms of any sum (a row's keys; a key gradient's
/// queries over the heads of its group):
///
/// - a probability carries a relative error of `r_j = a_j + max_k a_k + |l|
///   + |s_j - l| + L + 3` ulp: its score's rounding and the maximum's, `lse`
///   rounded relative to its own size and the `L` terms of its sum, and the
///   subtraction in `exp(s_j - lse)` — the form flash-attention and the
///   reference use, in which nothing renormalises the probabilities, so a
///   score of 5000 really does move them by thousands of ulp;
///   `b_j = p_j r_j`;
/// - `output_c`: `sum_j ((L + 1) p_j + b_j) |v_jc|`;
/// - `lse`: `|l| + max_k a_k + L`;
/// - `dS_j = p_j (dO.v_j - D)`, with `D = dO.O`: `b_j |dO.v_j - D| + p_j (d
///   sum_c |dO_c v_jc| + D's terms + (L + 1) |dO.v_j - D|)`;
/// - `grad_q_c = scale sum_j dS_j k_jc`: `|scale| sum_j (dS_j's terms)
///   |k_jc|`; `grad_k` the same with `|q_ic|` summed over the queries and
///   the query heads of the key head's group; `grad_v_jc`: `sum_i ((L + 1)
///   p_ij + b_ij) |dO_ic|` over the same.
///
/// With flash-attention's options ([`AttentionTerms::of_with`]) a query's
/// keys are its window's (bottom-right aligned, within `seqused_k`), and the
/// score is `s_j = cap(raw_j) + bias_j`: `cap' = 1 - tanh^2` is at most 1, so
/// `raw_j`'s rounding `a_j` passes through at most unchanged, and the cap
/// (a division, `tanh`, a product: 3 ulp of `|cap(raw_j)|`) and the bias (a
/// product and the sum: `|bias_j| + |s_j|` ulp) add theirs, so `a_j` becomes
/// `a_j + 3 |cap(raw_j)| + |bias_j| + |s_j|`. In the backward the chain
/// factor `1 - t^2` (`t = tanh(raw_j / softcap)`, off by `a_j / softcap +
/// 2` ulp) is off by `2 (a_j / softcap + 2) + 1` ulp absolutely: `dS_j`'s
/// terms gain `p_j |dO.v_j - D| (2 a_j / softcap + 5)`; multiplying by a
/// factor at most 1 only shrinks the rest.
///
/// With `l_q == l_k` and `h_kv == h`, `L` is the segment's length (the
/// bound of the self-attention harness this generalises). Empty segments,
/// and queries that see no key, have no terms.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct AttentionTerms {
    /// Of `output: [l_q, h, d]`.
    pub output: f64,
    /// Of `lse: [h, l_q]`.
    pub lse: f64,
    /// Of `grad_q: [l_q, h, d]`.
    pub grad_q: f64,
    /// Of `grad_k: [l_k, h_kv, d]`.
    pub grad_k: f64,
    /// Of `grad_v: [l_k, h_kv, d]`.
    pub grad_v: f64,
}

impl AttentionTerms {
    /// The terms of one segment: `q, grad_output: [l_q, h, d]`, `k, v: [l_k,
    /// h_kv, d]`, bottom-right causal when `causal`. Shapes that do not fit
    /// (`h_kv` not dividing `h`, other head dims, `v` unlike `k`) have no
    /// terms (all 0): the reference refuses them before anything is judged.
    pub fn of(
        q: ArrayView3<f64>,
        k: ArrayView3<f64>,
        v: ArrayView3<f64>,
        grad_output: ArrayView3<f64>,
        scale: f64,
        causal: bool,
    ) -> Self {
        Self::of_with(
            q,
            k,
            v,
            grad_output,
            (scale, causal),
            SegmentOptions::default(),
        )
    }

    /// [`AttentionTerms::of`] with flash-attention's options `o`.
    pub fn of_with(
        q: ArrayView3<f64>,
        k: ArrayView3<f64>,
        v: ArrayView3<f64>,
        grad_output: ArrayView3<f64>,
        (scale, causal): (f64, bool),
        opt: SegmentOptions<'_>,
    ) -> Self {
        let (lq, h, d) = q.dim();
        let (lk, h_kv, dk) = k.dim();
        let mut t = AttentionTerms::default();
        if h_kv == 0
            || h % h_kv != 0
            || dk != d
            || v.dim() != k.dim()
            || grad_output.dim() != q.dim()
        {
            return t;
        }
        let group = h / h_kv;
        // Contiguous copies: the loops below index flat slices.
        let (q, k, v, go) = (flat(q), flat(k), flat(v), flat(grad_output));
        let (c, df) = (scale.abs(), d as f64);
        let lf = lk.max(lq * group) as f64;
        let used = opt.used_keys.map_or(lk, |u| u.min(lk));
        if opt.alibi_slopes.is_some_and(|a| a.len() != h) {
            return t;
        }
        let mut gk = vec![0.0; lk * h_kv * d];
        let mut gv = vec![0.0; lk * h_kv * d];
        let (mut s, mut a, mut b) = (Vec::new(), Vec::new(), Vec::new());
        let (mut o, mut o_terms, mut gq) = (vec![0.0; d], vec![0.0; d], vec![0.0; d]);
        for head in 0..h {
            let kv = head / group;
            for i in 0..lq {
                let keys = visible_keys(i, lq, used, causal, opt.window);
                if keys.is_empty() {
                    continue;
                }
                let slope = opt.alibi_slopes.map(|a| a[head]);
                let qi = &q[(i * h + head) * d..][..d];
                let gi = &go[(i * h + head) * d..][..d];
                let key = |j: usize| ((keys.start + j) * h_kv + kv) * d;
                s.clear();
                a.clear();
                let mut cap_terms = Vec::new();
                for j in 0..keys.len() {
                    let kj = &k[key(j)..][..d];
                    let (mut dot, mut abs) = (0.0, 0.0);
                    for x in 0..d {
                        let y = qi[x] * kj[x];
                        dot += y;
                        abs += y.abs();
                    }
                    let (raw, raw_terms) = (scale * dot, c * df * abs);
                    if opt.softcap > 0.0 || slope.is_some() {
                        let capped = cap(raw, opt.softcap);
                        let bias =
                            slope.map_or(0.0, |x| alibi_bias(x, i, keys.start + j, lq, used));
                        let sj = capped + bias;
                        s.push(sj);
                        a.push(raw_terms + 3.0 * capped.abs() + bias.abs() + sj.abs());
                    } else {
                        s.push(raw);
                        a.push(raw_terms);
                    }
                    cap_terms.push(if opt.softcap > 0.0 {
                        2.0 * raw_terms / opt.softcap + 5.0
                    } else {
                        0.0
                    });
                }
                let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let l: f64 = s.iter().map(|x| (x - m).exp()).sum();
                let lse = m + l.ln();
                let max_a = a.iter().copied().fold(0.0, f64::max);
                let p = |j: usize| (s[j] - m).exp() / l;
                b.clear();
                for j in 0..keys.len() {
                    b.push(p(j) * (a[j] + max_a + lse.abs() + (s[j] - lse).abs() + lf + 3.0));
                }
                t.lse = t.lse.max(lse.abs() + max_a + lf);
                o.iter_mut().for_each(|x| *x = 0.0);
                o_terms.iter_mut().for_each(|x| *x = 0.0);
                for j in 0..keys.len() {
                    let (pj, vj) = (p(j), &v[key(j)..][..d]);
                    let w = (lf + 1.0) * pj + b[j];
                    for x in 0..d {
                        o[x] += pj * vj[x];
                        o_terms[x] += w * vj[x].abs();
                    }
                }
                t.output = o_terms.iter().fold(t.output, |m, x| m.max(*x));
                let dd: f64 = (0..d).map(|x| gi[x] * o[x]).sum();
                let dd_terms: f64 = (0..d)
                    .map(|x| df * (gi[x] * o[x]).abs() + gi[x].abs() * o_terms[x])
                    .sum();
                gq.iter_mut().for_each(|x| *x = 0.0);
                for (j, &bj) in b.iter().enumerate() {
                    let at = key(j);
                    let (vj, kj) = (&v[at..][..d], &k[at..][..d]);
                    let (mut dp, mut dp_abs) = (0.0, 0.0);
                    for x in 0..d {
                        let y = gi[x] * vj[x];
                        dp += y;
                        dp_abs += y.abs();
                    }
                    let pj = p(j);
                    let diff = (dp - dd).abs();
                    let ds = bj * diff
                        + pj * (df * dp_abs + dd_terms + (lf + 1.0 + cap_terms[j]) * diff);
                    let w = (lf + 1.0) * pj + bj;
                    for x in 0..d {
                        gq[x] += c * ds * kj[x].abs();
                        gk[at + x] += c * ds * qi[x].abs();
                        gv[at + x] += w * gi[x].abs();
                    }
                }
                t.grad_q = gq.iter().fold(t.grad_q, |m, x| m.max(*x));
            }
        }
        t.grad_k = gk.iter().fold(0.0, |m, x| m.max(*x));
        t.grad_v = gv.iter().fold(0.0, |m, x| m.max(*x));
        t
    }

    /// The larger of each tensor's terms (the terms of several segments).
    pub fn max(self, o: AttentionTerms) -> AttentionTerms {
        AttentionTerms {
            output: self.output.max(o.output),
            lse: self.lse.max(o.lse),
            grad_q: self.grad_q.max(o.grad_q),
            grad_k: self.grad_k.max(o.grad_k),
            grad_v: self.grad_v.max(o.grad_v),
        }
    }
}

fn flat(x: ArrayView3<f64>) -> Vec<f64> {
    x.iter().copied().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The generalised bound is the self-attention one where both apply,
    /// and a grouped-query segment's terms are those of the same segment
    /// with the key heads repeated (`a / (h / h_kv)`), up to the larger `L`
    /// of its key gradients' sums.
    #[test]
    fn grouped_terms_reduce_to_repeated_heads() {
        let g = |shape: (usize, usize, usize), seed: usize| {
            Array3::from_shape_fn(shape, |(i, a, c)| {
                (((i * 7 + a * 3 + c * 5 + seed) % 11) as f64 - 5.0) / 4.0
            })
        };
        let (q, go) = (g((5, 4, 3), 1), g((5, 4, 3), 2));
        let (k, v) = (g((5, 2, 3), 3), g((5, 2, 3), 4));
        let rep = |x: &Array3<f64>| Array3::from_shape_fn((5, 4, 3), |(j, a, c)| x[[j, a / 2, c]]);
        let (kr, vr) = (rep(&k), rep(&v));
        let mha = AttentionTerms::of(q.view(), kr.view(), vr.view(), go.view(), 0.5, true);
        let gqa = AttentionTerms::of(q.view(), k.view(), v.view(), go.view(), 0.5, true);
        assert!(mha.output > 0.0 && mha.grad_k > 0.0);
        // L = 10 (5 queries x 2 heads) against 5: every bound at least as large.
        assert!(
            gqa.output >= mha.output && gqa.grad_q >= mha.grad_q,
            "{gqa:?} {mha:?}"
        );
        // A key head's gradient sums over both of its query heads.
        assert!(gqa.grad_v > 1.5 * mha.grad_v, "{gqa:?} {mha:?}");
        // Shapes that do not fit: no terms, no panic.
        let bad = AttentionTerms::of(
            q.view(),
            g((5, 3, 3), 0).view(),
            v.view(),
            go.view(),
            0.5,
            false,
        );
        assert_eq!(bad, AttentionTerms::default());
    }

    /// With one visible key the softmax is the constant 1 and its backward
    /// factor `dp - D` (`dp = g.v`, `D = g.o`, `o = v`) is exactly 0, so the
    /// bound reads the values only through their magnitudes: `v = (1, 1)`
    /// (`g.v = 2`) and `v = (1, -1)` (`g.v = 0`) under `g = (1, 1)` get the
    /// same terms. A sign slip in `dp` would add `2 |g.v|` to the first.
    #[test]
    fn one_key_terms_read_the_values_through_their_magnitudes() {
        let q = Array3::from_shape_vec((1, 1, 2), vec![0.5, -1.5]).unwrap();
        let k = Array3::from_shape_vec((1, 1, 2), vec![1.0, 2.0]).unwrap();
        let g = Array3::from_shape_vec((1, 1, 2), vec![1.0, 1.0]).unwrap();
        let terms = |v: [f64; 2]| {
            let v = Array3::from_shape_vec((1, 1, 2), v.to_vec()).unwrap();
            AttentionTerms::of(q.view(), k.view(), v.view(), g.view(), 0.5, true)
        };
        let (aligned, orthogonal) = (terms([1.0, 1.0]), terms([1.0, -1.0]));
        assert!(aligned.grad_q > 0.0, "{aligned:?}");
        assert_eq!(aligned, orthogonal);
    }
}
