//! docs/FAULTS.md W1-W6 planted in the tiled kernel's own way of doing each
//! (its per-query key range, which also decides the key tiles a block
//! visits; its items' key rows; its score transform and the backward's
//! chain factor), and caught by the attention fuzz target under the judge
//! the registry gives `attention_varlen_tiled` (`Judge::Rewrite(F32_REWRITE)`),
//! on the default budget's cases (seed 0), where the kernel itself passes
//! the same case (the negative control).
//!
//! A planted fault lives in an [`Item`]'s `transform.planted` (a field that
//! exists in the tests only); the kernel's code reads it at the three places
//! marked `#[cfg(test)]` ([`key_range`], [`cap_after_mask`], [`no_chain`]);
//! the item-level faults (W3, W6) are items built wrongly here.

use ndarray::Array3;
use packshard_equivalence::compare::{Judge, Tolerance};
use packshard_equivalence::fuzz::attention as fa;
use packshard_equivalence::fuzz::schedule::{budgeted_input, Budget};
use packshard_reference::attention::{AttentionGrads, AttentionOutput};
use packshard_reference::ops::{AttentionOp, Grad, Masked, Qkv};

use super::*;
use crate::convert::to_f64;
use crate::ops::TiledAttention;

/// A docs/FAULTS.md W fault, as the tiled kernel would make it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Planted {
    /// W1: the window's left side one key too wide (`left + 1`).
    WindowOffByOne,
    /// W2: the window aligned on key `r` (flash-attention < 2.1), not on
    /// the bottom-right diagonal `r + l_k - l_q`.
    WindowTopLeft,
    /// W3: the item's keys extended back by the window's left side over the
    /// previous document's last keys (the window over the pack's keys).
    WindowAcrossDocuments,
    /// W4: the mask before the cap: `-inf` becomes `-softcap`.
    CapAfterMask,
    /// W5: the backward without the cap's chain factor.
    CapNoChain,
    /// W6: ALiBi's distance between the pack's token indices.
    AlibiFromPackStart,
    /// W6: `+slope |r + l_k - l_q - c|`.
    AlibiWrongSign,
}

const ALL: [Planted; 7] = [
    Planted::WindowOffByOne,
    Planted::WindowTopLeft,
    Planted::WindowAcrossDocuments,
    Planted::CapAfterMask,
    Planted::CapNoChain,
    Planted::AlibiFromPackStart,
    Planted::AlibiWrongSign,
];

/// The planted key range of query `i` of `it` (W1, W2), `None` otherwise.
pub(super) fn key_range(it: &Item, i: usize, causal: bool, w: Window) -> Option<Range<usize>> {
    match it.transform.planted? {
        Planted::WindowOffByOne => {
            let wider = Window {
                left: w.left.map(|l| l + 1),
                ..w
            };
            Some(visible_keys(i, it.q_len, it.k_len, causal, wider))
        }
        Planted::WindowTopLeft => {
            // Causal stays bottom-right; the window's sides count from key i.
            let keys = visible_keys(i, it.q_len, it.k_len, causal, Window::UNBOUNDED);
            let lo = w.left.map_or(0, |l| i.saturating_sub(l)).max(keys.start);
            let hi = w.right.map_or(it.k_len, |r| i + r + 1).min(keys.end);
            Some(if lo < hi { lo..hi } else { 0..0 })
        }
        _ => None,
    }
}

/// W4 planted in `it`.
pub(super) fn cap_after_mask(it: &Item) -> bool {
    it.transform.planted == Some(Planted::CapAfterMask)
}

/// W5 planted in `it`.
pub(super) fn no_chain(it: &Item) -> bool {
    it.transform.planted == Some(Planted::CapNoChain)
}

/// Runs `f` on the items of `p` with `fault` planted.
fn with_planted<R>(
    p: &Varlen<'_>,
    heads: (usize, usize),
    fault: Planted,
    f: impl FnOnce(&[Item]) -> R,
) -> R {
    let items: Vec<Item<'static>> = segment_items(p, heads);
    let plant = |it: &Item<'static>| -> Item<'static> {
        Item {
            transform: Transform {
                planted: Some(fault),
                ..it.transform
            },
            ..*it
        }
    };
    match fault {
        Planted::WindowAcrossDocuments => {
            let items: Vec<Item> = items
                .iter()
                .map(|it| {
                    let back = p.window.left.map_or(0, |l| l.min(it.k_start));
                    Item {
                        k_start: it.k_start - back,
                        k_len: it.k_len + back,
                        ..*it
                    }
                })
                .collect();
            f(&items)
        }
        Planted::AlibiFromPackStart => {
            // |(q_start + i) - (k_start + j)| = |i + (q_start - k_start) - j|.
            let offsets: Vec<Vec<i64>> = items
                .iter()
                .map(|it| vec![it.q_start as i64 - it.k_start as i64; it.q_len])
                .collect();
            // The same items again (one order), borrowing the offsets.
            let items: Vec<Item> = segment_items(p, heads)
                .into_iter()
                .zip(&offsets)
                .map(|(mut it, o)| {
                    it.transform.offsets = Some(o);
                    it
                })
                .collect();
            f(&items)
        }
        Planted::AlibiWrongSign => {
            let items: Vec<Item> = items
                .iter()
                .map(|it| Item {
                    transform: Transform {
                        slope: it.transform.slope.map(|s| -s),
                        ..it.transform
                    },
                    ..*it
                })
                .collect();
            f(&items)
        }
        _ => f(&items.iter().map(plant).collect::<Vec<_>>()),
    }
}

/// `attention_varlen_tiled` with a fault planted: the kernel's checks (its
/// own adapter's, so that it refuses what the kernel refuses), then the
/// planted items through the kernel's forward and backward.
struct PlantedTiled(Planted);

fn f32_of(x: &Qkv<'_>) -> [Array3<f32>; 3] {
    [x.q, x.k, x.v].map(|t| t.mapv(|v| v as f32))
}

impl AttentionOp for PlantedTiled {
    fn support(&self) -> AttentionSupport {
        TILED_SUPPORT
    }

    fn varlen_forward(&self, x: Qkv<'_>, p: &Varlen<'_>) -> Result<AttentionOutput> {
        TiledAttention::F32.varlen_forward(x, p)?;
        let [q, k, v] = f32_of(&x);
        let heads = (q.dim().1, k.dim().1);
        let out = with_planted(p, heads, self.0, |items| {
            forward((&q.view(), &k.view(), &v.view()), p.scale as f32, items)
        });
        Ok(AttentionOutput {
            output: to_f64(out.output.view()),
            lse: to_f64(out.lse.view()),
        })
    }

    fn varlen_backward(&self, x: Qkv<'_>, p: &Varlen<'_>, g: Grad<'_>) -> Result<AttentionGrads> {
        TiledAttention::F32.varlen_backward(x, p, g)?;
        let [q, k, v] = f32_of(&x);
        let heads = (q.dim().1, k.dim().1);
        let fwd = AttentionOutput32 {
            output: g.fwd.output.mapv(|x| x as f32),
            lse: g.fwd.lse.mapv(|x| x as f32),
        };
        let go = g.grad_output.mapv(|x| x as f32);
        let gr = with_planted(p, heads, self.0, |items| {
            let qkv = (&q.view(), &k.view(), &v.view());
            backward(qkv, p.scale as f32, items, &fwd, &go.view())
        });
        Ok(AttentionGrads {
            grad_q: to_f64(gr.grad_q.view()),
            grad_k: to_f64(gr.grad_k.view()),
            grad_v: to_f64(gr.grad_v.view()),
        })
    }

    fn masked_forward(&self, x: Qkv<'_>, m: Masked<'_>) -> Result<AttentionOutput> {
        TiledAttention::F32.masked_forward(x, m)
    }

    fn masked_backward(&self, x: Qkv<'_>, m: Masked<'_>, g: Grad<'_>) -> Result<AttentionGrads> {
        TiledAttention::F32.masked_backward(x, m, g)
    }
}

/// The registry's fuzz judge of `attention_varlen_tiled`
/// (`oracle/src/registry.rs`).
const JUDGE: Judge = Judge::Rewrite(Tolerance::F32_REWRITE);

#[test]
fn each_planted_option_fault_is_caught_by_the_fuzz_target() {
    let budget = Budget::DEFAULT;
    for fault in ALL {
        let imp = PlantedTiled(fault);
        let caught = (0..budget.cases).find_map(|i| {
            let data = budgeted_input(&budget, 0, i);
            fa::run(&imp, JUDGE, &data).err().map(|f| (i, data, f))
        });
        let Some((i, data, failure)) = caught else {
            panic!("{fault:?}: not caught in the {} cases", budget.cases);
        };
        // The negative control: the kernel itself passes the same case.
        if let Err(f) = fa::run(&TiledAttention::F32, JUDGE, &data) {
            panic!("{fault:?}: the unplanted kernel fails case {i} too: {f}");
        }
        // Caught by a value, not by an error or a panic.
        let what = &failure.mismatch.what;
        assert!(
            ["output", "lse", "grad_q", "grad_k", "grad_v"]
                .iter()
                .any(|t| what.contains(t)),
            "{fault:?}: caught on case {i} by {failure}"
        );
        eprintln!("{fault:?}: caught on case {i} ({what}): {}", failure.case);
    }
}
