//! The attention reference: gradients by central finite differences, P8
//! rows, dense == varlen bit for bit, grouped-query attention against
//! repeated key heads, bottom-right causal masks over other key lengths
//! (docs/FAULTS.md C5), typed errors.

use ndarray::{Array2, Array3, Axis, Slice};

use super::*;
use crate::testutil::{attention_fd, random3};

/// `[q, k, v, grad_output]` of one problem, from seeds `seed..seed + 4` in
/// that order: `q, grad_output: [n_q, h, d]`, `k, v: [n_k, h_kv, d]`.
fn random_inputs(
    (n_q, h): (usize, usize),
    (n_k, h_kv): (usize, usize),
    d: usize,
    seed: u64,
) -> [Array3<f64>; 4] {
    [
        random3(n_q, h, d, seed),
        random3(n_k, h_kv, d, seed + 1),
        random3(n_k, h_kv, d, seed + 2),
        random3(n_q, h, d, seed + 3),
    ]
}

#[test]
fn varlen_attention_gradients_match_finite_differences() {
    // Segments 3, 0 (empty), 1, 4: non-power-of-two sizes, an empty segment.
    let cu = [0usize, 3, 3, 4, 8];
    let [q, k, v, go] = random_inputs((8, 3), (8, 3), 5, 1);
    for causal in [false, true] {
        let scale = 0.7;
        let fwd = |q: &Array3<f64>, k: &Array3<f64>, v: &Array3<f64>| {
            varlen_attention(q.view(), k.view(), v.view(), &cu, causal, scale).unwrap()
        };
        let out = fwd(&q, &k, &v);
        let grads = varlen_attention_backward(
            q.view(),
            k.view(),
            v.view(),
            &cu,
            causal,
            scale,
            &out,
            go.view(),
        )
        .unwrap();
        attention_fd(
            &format!("varlen causal={causal}"),
            &q,
            &k,
            &v,
            &go,
            &fwd,
            &grads,
        );
        // A one-token segment attends to itself only: output = v, lse = score.
        for a in 0..3 {
            for c in 0..5 {
                assert_eq!(out.output[[3, a, c]], v[[3, a, c]]);
            }
            let s: f64 = (0..5).map(|c| q[[3, a, c]] * k[[3, a, c]]).sum::<f64>() * scale;
            assert!((out.lse[[a, 3]] - s).abs() <= 1e-15 * s.abs().max(1.0));
        }
    }
}

#[test]
fn masked_attention_gradients_match_finite_differences_and_empty_rows_are_zero() {
    // Sequence ids [1, 1, 2, 0, 2]: block-diagonal mask, the padding query 3
    // has no key (docs/FAULTS.md P8).
    let ids = [1, 1, 2, 0, 2];
    let mask = Array2::from_shape_fn((5, 5), |(i, j)| ids[i] != 0 && ids[i] == ids[j]);
    let [q, k, v, go] = random_inputs((5, 2), (5, 2), 3, 5);
    let fwd = |q: &Array3<f64>, k: &Array3<f64>, v: &Array3<f64>| {
        masked_attention(q.view(), k.view(), v.view(), mask.view(), 0.5).unwrap()
    };
    let out = fwd(&q, &k, &v);
    let grads = masked_attention_backward(
        q.view(),
        k.view(),
        v.view(),
        mask.view(),
        0.5,
        &out,
        go.view(),
    )
    .unwrap();
    attention_fd("masked", &q, &k, &v, &go, &fwd, &grads);
    for a in 0..2 {
        assert_eq!(out.lse[[a, 3]], f64::NEG_INFINITY);
        for c in 0..3 {
            assert_eq!(out.output[[3, a, c]], 0.0, "P8: padding row output");
            assert_eq!(grads.grad_q[[3, a, c]], 0.0, "P8: padding row grad_q");
            assert_eq!(grads.grad_k[[3, a, c]], 0.0, "masked key grad_k");
            assert_eq!(grads.grad_v[[3, a, c]], 0.0, "masked key grad_v");
        }
    }
    assert!(out.output.iter().all(|x| x.is_finite()));
    // P2: changing the tokens of sequence 1 leaves sequence 2's outputs unchanged.
    let mut q2 = q.clone();
    let mut v2 = v.clone();
    q2.index_axis_mut(ndarray::Axis(0), 0).fill(3.0);
    v2.index_axis_mut(ndarray::Axis(0), 1).fill(-2.0);
    let out2 = fwd(&q2, &k, &v2);
    for i in [2, 4] {
        assert_eq!(
            out2.output.index_axis(ndarray::Axis(0), i),
            out.output.index_axis(ndarray::Axis(0), i)
        );
    }
    assert_ne!(
        out2.output.index_axis(ndarray::Axis(0), 0),
        out.output.index_axis(ndarray::Axis(0), 0)
    );
    // The probabilities (an exposed intermediate) are rows of a softmax or all 0.
    let p = masked_attention_probs(q.view(), k.view(), mask.view(), 0.5).unwrap();
    for a in 0..2 {
        for i in 0..5 {
            let sum: f64 = (0..5).map(|j| p[[a, i, j]]).sum();
            let want = if ids[i] == 0 { 0.0 } else { 1.0 };
            assert!((sum - want).abs() < 1e-14, "row {i} sums to {sum}");
        }
    }
}

#[test]
fn dense_and_varlen_attention_agree_bit_for_bit() {
    // Segments of 2 and 3 tokens padded into rows of 4: the same sums in the same order.
    let [q, k, v, _] = random_inputs((5, 2), (5, 2), 3, 9);
    let var = varlen_attention(q.view(), k.view(), v.view(), &[0, 2, 5], false, 0.6).unwrap();
    for (seg, range) in [(0usize, 0..2usize), (1, 2..5)] {
        let len = range.len();
        let pad = |x: &Array3<f64>| {
            Array3::from_shape_fn((4, 2, 3), |(i, a, c)| {
                if i < len {
                    x[[range.start + i, a, c]]
                } else {
                    9.0
                }
            })
        };
        let mask = Array2::from_shape_fn((4, 4), |(_, j)| j < len);
        let dense = masked_attention(
            pad(&q).view(),
            pad(&k).view(),
            pad(&v).view(),
            mask.view(),
            0.6,
        )
        .unwrap();
        for i in 0..len {
            for a in 0..2 {
                assert_eq!(
                    dense.lse[[a, i]],
                    var.lse[[a, range.start + i]],
                    "segment {seg}"
                );
                for c in 0..3 {
                    assert_eq!(dense.output[[i, a, c]], var.output[[range.start + i, a, c]]);
                }
            }
        }
    }
}

#[test]
fn bad_attention_inputs_are_typed_errors() {
    let q = random3(4, 1, 2, 1);
    let e = varlen_attention(q.view(), q.view(), q.view(), &[0, 3, 2, 4], false, 1.0).unwrap_err();
    assert_eq!(e.kind(), "invalid_argument");
    assert!(e.to_string().contains("cu_seqlens[2]"), "{e}");
    let e = varlen_attention(q.view(), q.view(), q.view(), &[0, 3], false, 1.0).unwrap_err();
    assert!(e.to_string().contains("cu_seqlens[1]"), "{e}");
    let e = varlen_attention(q.view(), q.view(), q.view(), &[1, 4], false, 1.0).unwrap_err();
    assert!(e.to_string().contains("cu_seqlens[0]"), "{e}");
    let k = random3(3, 1, 2, 2);
    let e = varlen_attention(q.view(), k.view(), q.view(), &[0, 4], false, 1.0).unwrap_err();
    assert_eq!(e.kind(), "shape_mismatch");
}

/// `k: [n, h_kv, d]` with every head repeated `group` times (Hugging Face's
/// `repeat_kv`): head `a` of the result is head `a / group` of `k`.
fn repeat_kv(k: &Array3<f64>, group: usize) -> Array3<f64> {
    let (n, h_kv, d) = k.dim();
    Array3::from_shape_fn((n, h_kv * group, d), |(i, a, c)| k[[i, a / group, c]])
}

/// The `[n, h_kv, d]` gradient of the repeated keys folded back: the sum over
/// each group.
fn fold_kv(g: &Array3<f64>, group: usize) -> Array3<f64> {
    let (n, h, d) = g.dim();
    let mut out = Array3::zeros((n, h / group, d));
    for a in 0..h {
        let mut dst = out.index_axis_mut(Axis(1), a / group);
        dst += &g.index_axis(Axis(1), a);
    }
    out
}

fn close(what: &str, a: &Array3<f64>, b: &Array3<f64>, tol: f64) {
    assert_eq!(a.dim(), b.dim(), "{what}");
    let scale = b.iter().fold(1.0f64, |m, x| m.max(x.abs()));
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= tol * scale, "{what}[{i}]: {x} vs {y}");
    }
}

#[test]
fn grouped_query_attention_equals_repeated_key_heads() {
    // h = 6 query heads over h_kv = 2 (GQA) and 1 (MQA); segments 3, 0, 5.
    let cu = [0usize, 3, 3, 8];
    for (h_kv, causal) in [(2usize, false), (2, true), (1, true), (3, false)] {
        let group = 6 / h_kv;
        let [q, k, v, go] = random_inputs((8, 6), (8, h_kv), 4, 21);
        let p = Varlen::new(&cu, causal, 0.45);
        let gqa = varlen_attention_general(q.view(), k.view(), v.view(), &p).unwrap();
        let (kr, vr) = (repeat_kv(&k, group), repeat_kv(&v, group));
        let mha = varlen_attention_general(q.view(), kr.view(), vr.view(), &p).unwrap();
        // Same operations in the same order per query head: bit for bit.
        assert_eq!(gqa, mha, "h_kv {h_kv} causal {causal}");
        let g =
            varlen_attention_general_backward(q.view(), k.view(), v.view(), &p, &gqa, go.view())
                .unwrap();
        let gm =
            varlen_attention_general_backward(q.view(), kr.view(), vr.view(), &p, &mha, go.view())
                .unwrap();
        assert_eq!(g.grad_q, gm.grad_q);
        assert_eq!(g.grad_k.dim(), (8, h_kv, 4));
        // Summed over the group in another order: a few ulp.
        close("grad_k", &g.grad_k, &fold_kv(&gm.grad_k, group), 1e-14);
        close("grad_v", &g.grad_v, &fold_kv(&gm.grad_v, group), 1e-14);
        let fwd = |q: &Array3<f64>, k: &Array3<f64>, v: &Array3<f64>| {
            varlen_attention_general(q.view(), k.view(), v.view(), &p).unwrap()
        };
        attention_fd(
            &format!("gqa h_kv={h_kv} causal={causal}"),
            &q,
            &k,
            &v,
            &go,
            &fwd,
            &g,
        );
    }
}

#[test]
fn causal_masks_are_bottom_right_aligned_over_other_key_lengths() {
    // docs/FAULTS.md C5: 2 queries over 5 keys.
    let p = Varlen::cross(&[0, 2], &[0, 5], true, 1.0);
    let mask = varlen_mask(&p, 2, 5).unwrap();
    let want = [
        [true, true, true, true, false],
        [true, true, true, true, true],
    ];
    assert_eq!(mask, Array2::from_shape_fn((2, 5), |(i, j)| want[i][j]));
    // More queries than keys: the top rows see no key.
    let p = Varlen::cross(&[0, 4], &[0, 2], true, 1.0);
    let mask = varlen_mask(&p, 4, 2).unwrap();
    let want = [[false, false], [false, false], [true, false], [true, true]];
    assert_eq!(mask, Array2::from_shape_fn((4, 2), |(i, j)| want[i][j]));
}

#[test]
fn varlen_over_other_keys_equals_its_dense_mask_and_has_exact_gradients() {
    // Segments (q, k): (2, 5) a continuation chunk, (4, 2) more queries than
    // keys, (0, 3) keys only, (3, 3) self; causal and not; GQA 4 over 2.
    let cu_q = [0usize, 2, 6, 6, 9];
    let cu_k = [0usize, 5, 7, 10, 13];
    let [q, k, v, go] = random_inputs((9, 4), (13, 2), 3, 31);
    for causal in [false, true] {
        let p = Varlen::cross(&cu_q, &cu_k, causal, 0.8);
        let var = varlen_attention_general(q.view(), k.view(), v.view(), &p).unwrap();
        let mask = varlen_mask(&p, 9, 13).unwrap();
        let dense = masked_attention(q.view(), k.view(), v.view(), mask.view(), 0.8).unwrap();
        assert_eq!(
            var, dense,
            "causal {causal}: varlen == dense with its mask, bit for bit"
        );
        let g =
            varlen_attention_general_backward(q.view(), k.view(), v.view(), &p, &var, go.view())
                .unwrap();
        let gd = masked_attention_backward(
            q.view(),
            k.view(),
            v.view(),
            mask.view(),
            0.8,
            &dense,
            go.view(),
        )
        .unwrap();
        assert_eq!(g, gd);
        if causal {
            // Queries 2 and 3 (the top rows of the (4, 2) segment) see no key: P8.
            for i in [2usize, 3] {
                assert!(var.lse.column(i).iter().all(|&l| l == f64::NEG_INFINITY));
                assert!(var.output.index_axis(Axis(0), i).iter().all(|&x| x == 0.0));
                assert!(g.grad_q.index_axis(Axis(0), i).iter().all(|&x| x == 0.0));
            }
        }
        // Keys 7..10 belong to an empty query segment: no gradient reaches them.
        assert!(g
            .grad_k
            .slice_axis(Axis(0), Slice::from(7..10))
            .iter()
            .all(|&x| x == 0.0));
        let fwd = |q: &Array3<f64>, k: &Array3<f64>, v: &Array3<f64>| {
            varlen_attention_general(q.view(), k.view(), v.view(), &p).unwrap()
        };
        attention_fd(&format!("cross causal={causal}"), &q, &k, &v, &go, &fwd, &g);
    }
}

#[test]
fn bad_grouped_and_cross_inputs_are_typed_errors() {
    let q = random3(4, 6, 2, 1);
    let k = random3(4, 4, 2, 2); // 4 does not divide 6
    let e = varlen_attention_general(
        q.view(),
        k.view(),
        k.view(),
        &Varlen::new(&[0, 4], false, 1.0),
    )
    .unwrap_err();
    assert_eq!(e.kind(), "shape_mismatch");
    assert!(e.to_string().contains("h_kv dividing h = 6"), "{e}");
    let k = random3(5, 3, 2, 3);
    // The error of `q` (one segment of 4) over `k` split by `cu_seqlens_k`.
    let cross_error = |cu_k: &[usize]| {
        let p = Varlen::cross(&[0, 4], cu_k, false, 1.0);
        varlen_attention_general(q.view(), k.view(), k.view(), &p).unwrap_err()
    };
    let e = cross_error(&[0, 2, 5]);
    assert!(e.to_string().starts_with("cu_seqlens_k"), "{e}");
    let e = cross_error(&[0, 4]);
    assert!(e.to_string().contains("self-attention"), "{e}");
    let e = cross_error(&[0, 6]);
    assert!(e.to_string().contains("cu_seqlens_k[1]"), "{e}");
}

/// The default scale is Vaswani et al.'s `1 / sqrt(d)` (flash-attention's
/// `softmax_scale=None`), which the BERT and decoder layers read.
#[test]
fn the_default_scale_is_one_over_the_root_of_the_head_dim() {
    assert_eq!(default_scale(64), 0.125);
    assert_eq!(default_scale(4), 0.5);
    assert_eq!(default_scale(128), 1.0 / 128f64.sqrt());
}
