//! The attention suite on the reference, and negative controls: an attention
//! that ignores `cu_seqlens` (P2) and one whose fully masked rows give NaN
//! (P8) must both be rejected, for the right reason.

use ndarray::Axis;
use packshard_equivalence::attention::{
    check_attention, fault_cases, run_attention_suite, AttentionCase,
};
use packshard_equivalence::planted::{AttentionHooks, Planted};
use packshard_equivalence::{Mismatch, Tolerance};
use packshard_reference::attention::ReferenceAttention;
use packshard_reference::bert::{AttentionGrads, AttentionOutput};
use packshard_reference::ops::{AttentionOp, Grad, Masked, Qkv, Varlen};
use packshard_reference::Result;

#[test]
fn reference_passes_the_attention_suite() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static CALLS: AtomicUsize = AtomicUsize::new(0);
    struct Counting;
    impl AttentionHooks for Counting {
        fn varlen_forward(&self, x: Qkv<'_>, p: &Varlen<'_>) -> Result<AttentionOutput> {
            CALLS.fetch_add(1, Ordering::Relaxed);
            ReferenceAttention.varlen_forward(x, p)
        }
    }
    let seen = run_attention_suite(&Planted(Counting), 256).unwrap();
    // Fault cases twice (two head shapes) and 256 random cases, each run
    // once plus once more for the P2 perturbation when it has tokens.
    assert!(CALLS.load(Ordering::Relaxed) >= fault_cases().len() * 2 + 256);
    assert!(seen.values > 10_000, "compared only {} values", seen.values);
    // Packed and padded perform the same operations in the same order: we
    // measure bit-for-bit equality, well inside F64_REWRITE.
    eprintln!(
        "attention packed vs padded: max abs {:e}, max rel {:e} over {} values",
        seen.max_abs, seen.max_rel, seen.values
    );
    assert!(seen.max_rel <= Tolerance::F64_REWRITE.rel);
}

/// The reference with one fault planted.
#[derive(Default)]
struct Broken {
    /// P2: run the whole batch as one segment (an all-ones mask).
    ignore_cu_seqlens: bool,
    /// P8: rows with no allowed key get the NaN of a naive `exp(-inf - -inf)`.
    nan_on_empty_rows: bool,
}

impl AttentionHooks for Broken {
    fn varlen_forward(&self, x: Qkv<'_>, p: &Varlen<'_>) -> Result<AttentionOutput> {
        let whole = [0, x.q.dim().0];
        let one = Varlen::new(&whole, p.causal, p.scale);
        ReferenceAttention.varlen_forward(x, if self.ignore_cu_seqlens { &one } else { p })
    }
    fn varlen_backward(&self, x: Qkv<'_>, p: &Varlen<'_>, g: Grad<'_>) -> Result<AttentionGrads> {
        let whole = [0, x.q.dim().0];
        let one = Varlen::new(&whole, p.causal, p.scale);
        let p = if self.ignore_cu_seqlens { &one } else { p };
        ReferenceAttention.varlen_backward(x, p, g)
    }
    fn masked_forward(&self, x: Qkv<'_>, m: Masked<'_>) -> Result<AttentionOutput> {
        let mut out = ReferenceAttention.masked_forward(x, m)?;
        if self.nan_on_empty_rows {
            for (i, row) in m.allowed.rows().into_iter().enumerate() {
                if !row.iter().any(|&a| a) {
                    out.output.index_axis_mut(Axis(0), i).fill(f64::NAN);
                    out.lse.column_mut(i).fill(f64::NAN);
                }
            }
        }
        Ok(out)
    }
}

fn fault_case(prefix: &str) -> AttentionCase {
    let (_, lengths, pad) = fault_cases()
        .into_iter()
        .find(|c| c.0.starts_with(prefix))
        .unwrap();
    AttentionCase::seeded(&lengths, 2, 3, pad, 1)
}

/// `broken` on the fault case named `prefix`: the check catches it as a
/// mismatch of a tensor whose name contains `what` (returned for further
/// checks), the suite catches it, and the reference passes the same case
/// (the check is not failing for another reason).
fn negative_control(broken: Broken, prefix: &str, what: &str) -> Mismatch {
    let broken = Planted(broken);
    let err = check_attention(&broken, &fault_case(prefix)).expect_err("the fault must be caught");
    assert!(err.what.contains(what), "caught, but as {err}");
    assert!(run_attention_suite(&broken, 16).is_err());
    check_attention(&ReferenceAttention, &fault_case(prefix)).unwrap();
    err
}

#[test]
fn p2_negative_control_attention_across_sequences() {
    let broken = Broken {
        ignore_cu_seqlens: true,
        ..Broken::default()
    };
    negative_control(broken, "P2", "sequence 0: output");
}

#[test]
fn p8_negative_control_nan_on_fully_masked_rows() {
    let broken = Broken {
        nan_on_empty_rows: true,
        ..Broken::default()
    };
    let err = negative_control(broken, "P8", "padded output");
    assert!(
        err.detail.contains("P8") && err.detail.contains("NaN"),
        "{err}"
    );
}

/// The tile cases every blocked kernel is run on cross what their doc says
/// they cross: a segment over 128 tokens, one of exactly 64 and one of 65,
/// an empty one, and a head dimension of 64 (a kernel whose tiles are 64 or
/// 128 wide meets a full tile, a tile plus one and a partial last tile).
#[test]
fn tile_cases_cross_the_tile_boundaries() {
    let cases = packshard_equivalence::attention::tile_cases();
    let lengths: Vec<usize> = cases.iter().flat_map(|c| c.1.clone()).collect();
    assert!(lengths.iter().any(|&l| l > 128), "{lengths:?}");
    assert!(
        lengths.contains(&64) && lengths.contains(&65),
        "{lengths:?}"
    );
    assert!(lengths.contains(&0), "{lengths:?}");
    assert!(cases.iter().any(|c| c.3 == 64), "no head dim 64");
    for (name, lengths, h, d) in &cases {
        assert!(!name.is_empty() && *h >= 1 && *d >= 1, "{name}");
        assert!(lengths.iter().sum::<usize>() > 0, "{name}");
    }
}
