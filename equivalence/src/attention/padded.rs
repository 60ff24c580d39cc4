//! One sequence of an [`AttentionCase`] alone in a padded row (the padded
//! batch), run through an implementation's masked form: the packed == padded
//! check of the attention suite ([`super::check_attention_with`]) and of the
//! fuzz harness (`crate::fuzz::attention`).

use ndarray::{Array2, Array3, Axis};
use packshard_reference::bert::attention::{AttentionGrads, AttentionOutput};
use packshard_reference::ops::{AttentionOp, Grad, Masked, Qkv};
use packshard_reference::Error;

use super::AttentionCase;

/// Tokens `from..from + len` of `x` in a row of `row_len`, then padding
/// slots holding planted garbage: `fill x (1 + e)` at flat index `e` of the
/// row, large and distinct (a kernel that reads padding cannot have it
/// cancel out).
fn padded_row(x: &Array3<f64>, from: usize, len: usize, row_len: usize, fill: f64) -> Array3<f64> {
    let (_, h, d) = x.dim();
    Array3::from_shape_fn((row_len, h, d), |(i, a, c)| {
        if i < len {
            x[[from + i, a, c]]
        } else {
            fill * (1.0 + ((i * h + a) * d + c) as f64)
        }
    })
}

/// One sequence of a case alone in a row of `row_len` tokens (the padded
/// batch): its `len` tokens, then padding slots holding planted garbage,
/// under the block mask that lets only its real queries see its real keys.
pub(crate) struct PaddedSegment {
    q: Array3<f64>,
    k: Array3<f64>,
    v: Array3<f64>,
    grad_output: Array3<f64>,
    /// `[row_len, row_len]`.
    allowed: Array2<bool>,
    scale: f64,
    /// The sequence's tokens, the first rows.
    len: usize,
}

impl PaddedSegment {
    /// Tokens `at..at + len` of `case` padded to its `row_len`.
    pub(crate) fn of(case: &AttentionCase, at: usize, len: usize) -> Self {
        let t = [&case.q, &case.k, &case.v, &case.grad_output];
        Self::rows(t, case.scale, (at, len, case.row_len), false)
    }

    /// Tokens `at..at + len` of `[q, k, v, grad_output]` (all `[n, h, d]`)
    /// in a row of `row_len`, under the block mask, bottom-right causal
    /// within the sequence when `causal` (a square block: key `j <= i`).
    pub(crate) fn rows(
        [q, k, v, grad_output]: [&Array3<f64>; 4],
        scale: f64,
        (at, len, l): (usize, usize, usize),
        causal: bool,
    ) -> Self {
        let big = 1e3; // planted garbage in padding slots
        PaddedSegment {
            q: padded_row(q, at, len, l, big),
            k: padded_row(k, at, len, l, -big),
            v: padded_row(v, at, len, l, big),
            grad_output: padded_row(grad_output, at, len, l, 1.0),
            allowed: Array2::from_shape_fn((l, l), |(i, j)| {
                i < len && j < len && (!causal || j <= i)
            }),
            scale,
            len,
        }
    }

    fn qkv(&self) -> Qkv<'_> {
        Qkv::new(self.q.view(), self.k.view(), self.v.view())
    }

    /// `imp`'s masked forward on the row.
    pub(crate) fn forward(&self, imp: &dyn AttentionOp) -> Result<AttentionOutput, Error> {
        imp.masked_forward(self.qkv(), Masked::new(self.allowed.view(), self.scale))
    }

    /// `imp`'s masked backward of `fwd` on the row, with its `grad_output`.
    pub(crate) fn backward(
        &self,
        imp: &dyn AttentionOp,
        fwd: &AttentionOutput,
    ) -> Result<AttentionGrads, Error> {
        let m = Masked::new(self.allowed.view(), self.scale);
        imp.masked_backward(self.qkv(), m, Grad::new(fwd, self.grad_output.view()))
    }
}

/// A value a padding row of a [`PaddedSegment`]'s results holds where it
/// must hold none: a query with no allowed key has output and gradients
/// exactly 0 and `lse = -inf`, never NaN (docs/FAULTS.md P8).
pub(crate) enum PaddingLeak {
    /// Tensor `name`'s padding row `row` holds `x` at flat index `at` of the row.
    Value {
        name: &'static str,
        row: usize,
        at: usize,
        x: f64,
    },
    /// Padding row `row`, head `head`: `lse` is `x`, not `-inf`.
    Lse { row: usize, head: usize, x: f64 },
}

impl PaddedSegment {
    /// The first [`PaddingLeak`] in the padding rows of `imp`'s results on
    /// the row (`f`, `g`): the output and the gradients first, then `lse`.
    pub(crate) fn leak(&self, f: &AttentionOutput, g: &AttentionGrads) -> Option<PaddingLeak> {
        let (l, h, _) = self.q.dim();
        let len = self.len;
        for (name, t) in [
            ("output", &f.output),
            ("grad_q", &g.grad_q),
            ("grad_k", &g.grad_k),
            ("grad_v", &g.grad_v),
        ] {
            for row in len..l {
                let values = t.index_axis(Axis(0), row);
                if let Some((at, &x)) = values.iter().enumerate().find(|(_, x)| **x != 0.0) {
                    return Some(PaddingLeak::Value { name, row, at, x });
                }
            }
        }
        (len..l).find_map(|row| {
            (0..h).find_map(|head| {
                let x = f.lse[[head, row]];
                (x != f64::NEG_INFINITY).then_some(PaddingLeak::Lse { row, head, x })
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The row keeps the sequence's tokens and fills every padding slot with
    /// its own multiple of `fill`, so no two padding values are equal.
    #[test]
    fn padding_slots_hold_distinct_multiples_of_the_fill() {
        let (n, h, d) = (5, 3, 4);
        let x = Array3::from_shape_fn((n, h, d), |(i, a, c)| (i * 100 + a * 10 + c) as f64 * 0.5);
        let row = padded_row(&x, 1, 2, 6, 1e3);
        assert_eq!(row.dim(), (6, h, d));
        for a in 0..h {
            for c in 0..d {
                assert_eq!(row[[0, a, c]], x[[1, a, c]]);
                assert_eq!(row[[1, a, c]], x[[2, a, c]]);
            }
        }
        // And a row of padding only: its first slot is garbage too, not 0.
        let empty = padded_row(&x, 0, 0, 6, 1e3);
        for (t, real, slots) in [(&row, 2, 4), (&empty, 0, 6)] {
            let mut pad: Vec<f64> = t.iter().skip(real * h * d).copied().collect();
            assert!(pad.iter().all(|&p| p >= 1e3 && p % 1e3 == 0.0), "{pad:?}");
            pad.sort_by(f64::total_cmp);
            pad.dedup();
            assert_eq!(pad.len(), slots * h * d, "two padding slots share a value");
        }
    }
}
