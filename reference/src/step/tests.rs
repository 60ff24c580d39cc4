//! The CP split's invariants and the balance figure's arithmetic.

use super::balance::{balance, max_over_min};
use super::partition::{cp_partition, rank_meta};
use super::{microbatch_docs, Layout, StepFault};

/// Every slot of the padded pack is on exactly one rank, each document's
/// real tokens are a prefix of its local slots, and the ring's metadata
/// (derived from the `cu_seqlens` alone) agrees with the split.
#[test]
fn every_slot_once_and_the_ring_metadata_agrees() {
    let lengths = [1usize, 2, 3, 4, 5, 7, 8, 9, 13, 16, 17];
    let docs: Vec<Vec<i64>> = lengths.iter().map(|&l| (0..l as i64).collect()).collect();
    for cp in 1..=5 {
        let p = cp_partition(&docs, cp, None, None).unwrap();
        let n_pad = *p.cu_seqlens_padded.last().unwrap();
        let mut seen = vec![0; n_pad];
        for s in &p.ranks {
            assert_eq!(s.token_index.len(), n_pad / cp);
            for &t in &s.token_index {
                seen[t] += 1;
            }
            for j in 0..lengths.len() {
                let (a, b) = (s.cu_seqlens_padded[j], s.cu_seqlens_padded[j + 1]);
                let real = s.cu_seqlens[j + 1] - s.cu_seqlens[j];
                assert!(s.real[a..a + real].iter().all(|&r| r), "cp {cp} doc {j}");
                assert!(s.real[a + real..b].iter().all(|&r| !r), "cp {cp} doc {j}");
            }
            let meta = rank_meta(s.rank, cp, &p.cu_seqlens, &p.cu_seqlens_padded, None).unwrap();
            for (t, m) in meta.iter().enumerate() {
                assert_eq!(
                    (m.doc, m.pos, m.real),
                    (s.doc[t], s.position_ids[t], s.real[t])
                );
            }
        }
        assert!(seen.iter().all(|&c| c == 1), "cp {cp}");
        let real: usize = p.ranks.iter().map(|s| s.cu_seqlens.last().unwrap()).sum();
        assert_eq!(real, lengths.iter().sum::<usize>());
    }
}

#[test]
fn bad_layouts_are_refused_by_name() {
    let e = |l: Layout| microbatch_docs(&l, 3).unwrap_err().to_string();
    assert!(e(Layout {
        grad_accum: 0,
        dp: 1,
        cp: 1
    })
    .contains("grad_accum"));
    assert!(e(Layout {
        grad_accum: 1,
        dp: 1,
        cp: 0
    })
    .contains("cp"));
    assert!(e(Layout {
        grad_accum: 2,
        dp: 2,
        cp: 1
    })
    .contains("docs"));
    assert!(e(Layout {
        grad_accum: usize::MAX,
        dp: 3,
        cp: 1
    })
    .contains("docs"));
    let f = cp_partition(&[vec![1, 2]], 2, None, Some(StepFault::D3RoundDown)).unwrap();
    assert_eq!(f.cu_seqlens, [0, 0], "D3 loses the whole short document");
}

/// One document of 16 tokens at cp 2: chunks of 4; rank 0 holds positions
/// 0..4 and 12..16 (`10 + 58` pairs), rank 1 4..12 (`68`); the contiguous
/// split gives `36` and `100`.
#[test]
fn the_load_balanced_split_evens_the_causal_work() {
    let b = balance(&[16], 2).unwrap();
    assert_eq!(b.balanced, [68, 68]);
    assert_eq!(b.contiguous, [36, 100]);
    assert_eq!(max_over_min(&b.balanced), 1.0);
    assert!(max_over_min(&b.contiguous) > 2.7);
}

/// Ring attention over three ranks gives the one-rank result: rank `r`
/// merges the blocks of ranks `r, r - 1, ..., r + 1` (mod `cp`), each once
/// (at `cp = 2` any order of the two blocks visits both, so three ranks).
#[test]
fn ring_attention_over_three_ranks_is_the_one_rank_result() {
    use super::partition::TokenMeta;
    use super::RingAttention;
    use crate::ops::{AttentionOp, Qkv, Varlen};
    use crate::testutil::random3;
    // Two documents of 4 and 2 tokens in 6 slots, 2 slots a rank.
    let meta: Vec<TokenMeta> = (0..6)
        .map(|i| TokenMeta {
            doc: usize::from(i >= 4),
            pos: i % 4,
            real: true,
        })
        .collect();
    let (q, k, v) = (
        random3(6, 2, 3, 1),
        random3(6, 2, 3, 2),
        random3(6, 2, 3, 3),
    );
    let x = Qkv {
        q: q.view(),
        k: k.view(),
        v: v.view(),
    };
    let p = Varlen::new(&[0, 6], true, 0.5);
    let ring = |ranks: Vec<Vec<TokenMeta>>| {
        RingAttention {
            ranks,
            rescale: true,
        }
        .varlen_forward(x, &p)
        .unwrap()
    };
    let one = ring(vec![meta.clone()]);
    let three = ring(meta.chunks(2).map(<[TokenMeta]>::to_vec).collect());
    // The merges reorder sums of a few terms of order 1: a few ulp. A block
    // missed or merged twice moves an output by order 1 and an lse by ln 2.
    let worst = |a: ndarray::ArrayViewD<f64>, b: ndarray::ArrayViewD<f64>| {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f64::max)
    };
    assert!(worst(one.output.view().into_dyn(), three.output.view().into_dyn()) < 1e-12);
    assert!(worst(one.lse.view().into_dyn(), three.lse.view().into_dyn()) < 1e-12);
}
