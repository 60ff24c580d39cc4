//! The tiled kernel's flash-attention options (window, softcap, ALiBi,
//! `seqused_k`) against its own dense form, bit for bit: the varlen form
//! visits only the key tiles some query of a block may see
//! ([`Item::block_keys`]), the dense form every tile of the row with the same
//! window as a boolean mask. A skipped tile holds only masked scores (exact
//! zeros after the exponential), so the two must agree to the bit; a tile
//! skipped wrongly at a tile boundary (a key in it visible to one query of
//! the block) changes that query's output. Their agreement with the f64
//! reference is the fuzz targets' (docs/FUZZING.md), this file checks the
//! tiling.

use half::bf16;
use ndarray::{s, Array2, Array3};
use packshard_reference::attention::options::visible_keys;
use packshard_reference::attention::Window;
use packshard_reference::ops::Varlen;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::*;

/// `[n, h, d]` uniform in [-2, 2].
fn tensor(rng: &mut ChaCha8Rng, (n, h, d): (usize, usize, usize)) -> Array3<f32> {
    Array3::from_shape_fn((n, h, d), |_| rng.random_range(-2.0f32..2.0))
}

fn rows<T: Clone>(x: &Array3<T>, a: usize, b: usize) -> Array3<T> {
    x.slice(s![a..b, .., ..]).to_owned()
}

/// One problem: self-attention segments of `lens` (their first `used`
/// keys), 4 query heads over 2 key heads of 8.
struct Case<'a> {
    lens: &'a [usize],
    used: Option<&'a [usize]>,
    causal: bool,
    window: (i64, i64),
    softcap: f64,
    alibi: bool,
}

/// ALiBi's standard slopes of 4 heads, `2^(-8 (a + 1) / 4)` (Press et al.).
const SLOPES: [f64; 4] = [0.25, 0.0625, 0.015625, 0.00390625];

/// Runs `c` through the varlen form on the pack and the dense form on each
/// segment alone (its window as the mask, its diagonal as the offsets);
/// every output, `lse` and gradient must be equal.
fn check_against_dense<T: Element>(c: &Case, round: impl Fn(f32) -> T) {
    let (h, h_kv, d) = (4, 2, 8);
    let mut cu = vec![0usize];
    for &l in c.lens {
        cu.push(cu.last().unwrap() + l);
    }
    let n = *cu.last().unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(n as u64);
    let q = tensor(&mut rng, (n, h, d)).mapv(&round);
    let k = tensor(&mut rng, (n, h_kv, d)).mapv(&round);
    let v = tensor(&mut rng, (n, h_kv, d)).mapv(&round);
    let go = tensor(&mut rng, (n, h, d));
    let window = Window::from_flash(c.window.0, c.window.1).unwrap();
    let slopes = c.alibi.then_some(&SLOPES[..]);
    let scale = 0.5;
    let p = Varlen::new(&cu, c.causal, scale)
        .with_window(window)
        .with_softcap(c.softcap)
        .with_alibi_slopes(slopes)
        .with_seqused_k(c.used);
    let f = varlen_attention_general(q.view(), k.view(), v.view(), &p).unwrap();
    let g =
        varlen_attention_general_backward(q.view(), k.view(), v.view(), &p, &f, go.view()).unwrap();
    for (s, w) in cu.windows(2).enumerate() {
        let (a, b) = (w[0], w[1]);
        let (lq, lk) = (b - a, p.used_keys(s));
        if lq == 0 {
            continue;
        }
        let mut mask = Array2::from_elem((lq, lq), false);
        for r in 0..lq {
            for key in visible_keys(r, lq, lk, c.causal, window) {
                mask[[r, key]] = true;
            }
        }
        let offsets = vec![lk as i64 - lq as i64; lq];
        let opts = ScoreOptions {
            softcap: c.softcap,
            alibi_slopes: slopes,
            diag_offsets: Some(&offsets),
        };
        let (qs, ks, vs, gs) = (
            rows(&q, a, b),
            rows(&k, a, b),
            rows(&v, a, b),
            rows(&go, a, b),
        );
        let masks = [mask.view()];
        let df = dense_masked_attention_with(
            qs.view(),
            ks.view(),
            vs.view(),
            (lq, &masks),
            scale as f32,
            opts,
        )
        .unwrap();
        let dg = dense_masked_attention_backward_with(
            qs.view(),
            ks.view(),
            vs.view(),
            (lq, &masks),
            scale as f32,
            opts,
            (&df, gs.view()),
        )
        .unwrap();
        let what = |t: &str| format!("{t} of segment {s} ({lq} tokens, {lk} keys used)");
        assert_eq!(rows(&f.output, a, b), df.output, "{}", what("output"));
        assert_eq!(
            f.lse.slice(s![.., a..b]).to_owned(),
            df.lse,
            "{}",
            what("lse")
        );
        assert_eq!(rows(&g.grad_q, a, b), dg.grad_q, "{}", what("grad_q"));
        assert_eq!(rows(&g.grad_k, a, b), dg.grad_k, "{}", what("grad_k"));
        assert_eq!(rows(&g.grad_v, a, b), dg.grad_v, "{}", what("grad_v"));
    }
}

/// Segments around the 64-key tiles: 2 tiles and 2 keys, an empty one, one
/// tile exactly, 4 tiles and 1 key, one token, 3 tiles and 8 keys.
const LENS: [usize; 6] = [130, 0, 64, 257, 1, 200];

/// Windows whose edges fall inside, on and across tile boundaries: 128 keys
/// left (2 tiles), the diagonal alone, 63 and 64 either side, unbounded on
/// one side.
const WINDOWS: [(i64, i64); 7] = [
    (128, 0),
    (0, 0),
    (63, 64),
    (64, -1),
    (-1, 1),
    (5, 3),
    (-1, -1),
];

#[test]
fn windowed_tiles_skipped_change_no_bit() {
    for causal in [false, true] {
        for window in WINDOWS {
            let c = Case {
                lens: &LENS,
                used: None,
                causal,
                window,
                softcap: 0.0,
                alibi: false,
            };
            check_against_dense(&c, |x| x);
        }
    }
}

#[test]
fn softcap_alibi_and_seqused_k_equal_the_dense_form() {
    // Used keys: fewer than the queries by 1 tile and 2 (the diagonal moves
    // 66 keys left), all, none, 1 of 1, 3 tiles of 200 keys.
    let used = [64usize, 0, 64, 255, 1, 192];
    for (causal, window, softcap, alibi) in [
        (true, (128, 0), 0.7, true),
        (false, (63, 64), 5.0, false),
        (false, (-1, -1), 0.0, true),
        (true, (-1, -1), 30.0, true),
        (false, (20, 0), 0.5, true),
    ] {
        for used in [None, Some(&used[..])] {
            let c = Case {
                lens: &LENS,
                used,
                causal,
                window,
                softcap,
                alibi,
            };
            check_against_dense(&c, |x| x);
        }
    }
}

#[test]
fn the_bf16_form_takes_the_same_options() {
    let c = Case {
        lens: &LENS,
        used: Some(&[100, 0, 60, 257, 1, 130]),
        causal: true,
        window: (64, 0),
        softcap: 0.7,
        alibi: true,
    };
    check_against_dense(&c, bf16::from_f32);
}

/// The benchmark's work: one row of 512 tokens, causal, 64 x 64 tiles.
/// Without a window query block `b` (queries `64 b..64 b + 64`) visits the
/// key tiles `0..=b`, all 64 keys of each: `64 * 64 * (1 + 2 + .. + 8) =
/// 4096 * 36` pairs. With `window_size = (128, 0)` its first query sees keys
/// from `64 b - 128`: the tiles `b - 2..=b`, 3 (1 and 2 for `b = 0, 1`):
/// `4096 * (1 + 2 + 3 * 6) = 4096 * 21`.
#[test]
fn a_sliding_window_skips_the_tiles_outside_it() {
    let cu = [0usize, 512];
    let p = Varlen::new(&cu, true, 1.0);
    assert_eq!(varlen_scored_pairs(&p), 4096 * 36);
    let w = p.with_window(Window::from_flash(128, 0).unwrap());
    assert_eq!(varlen_scored_pairs(&w), 4096 * 21);
    // Bidirectional with (128, 0): the same tiles as causal with it.
    let b = Varlen::new(&cu, false, 1.0).with_window(Window::from_flash(128, 0).unwrap());
    assert_eq!(varlen_scored_pairs(&b), 4096 * 21);
}

/// Bad options are typed errors naming the field, never a panic or an
/// index out of bounds in the kernel's loops.
#[test]
fn bad_options_are_refused_with_their_field() {
    let x = Array3::<f32>::from_elem((3, 2, 2), 0.5);
    let go = Array3::<f32>::from_elem((3, 2, 2), 1.0);
    let cu = [0usize, 3];
    let base = Varlen::new(&cu, false, 1.0);
    let fwd = varlen_attention_general(x.view(), x.view(), x.view(), &base).unwrap();
    let one = [0.5];
    let nan = [0.5, f64::NAN];
    let four = [4usize];
    for (p, field) in [
        (base.with_alibi_slopes(Some(&one)), "alibi_slopes"),
        (base.with_alibi_slopes(Some(&nan)), "alibi_slopes[1]"),
        (base.with_seqused_k(Some(&four)), "seqused_k[0]"),
        (base.with_softcap(-1.0), "softcap"),
    ] {
        let e = varlen_attention_general(x.view(), x.view(), x.view(), &p).unwrap_err();
        assert!(e.to_string().starts_with(field), "{field}: {e}");
        let e =
            varlen_attention_general_backward(x.view(), x.view(), x.view(), &p, &fwd, go.view())
                .unwrap_err();
        assert!(e.to_string().starts_with(field), "{field}: {e}");
    }
}

/// A cap past f32's range is the identity (bit for bit the uncapped
/// kernel), and a cap below f32's smallest subnormal still caps (rounded to
/// 0 it was silently dropped): every score `±cap`, the softmax uniform, the
/// output the mean of the visible values, as the f64 reference computes.
#[test]
fn caps_outside_f32s_range_are_kept() {
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let t = |rng: &mut ChaCha8Rng| tensor(rng, (9, 1, 4));
    let (q, k, v) = (t(&mut rng), t(&mut rng), t(&mut rng));
    let cu = [0usize, 9];
    let p = Varlen::new(&cu, false, 1.0);
    let run = |p: &Varlen| varlen_attention_general(q.view(), k.view(), v.view(), p).unwrap();
    assert_eq!(run(&p.with_softcap(1e300)), run(&p));
    let tiny = p.with_softcap(1e-60);
    let ours = run(&tiny);
    let f64_of = |x: &Array3<f32>| x.mapv(f64::from);
    let reference = packshard_reference::attention::varlen_attention_general(
        f64_of(&q).view(),
        f64_of(&k).view(),
        f64_of(&v).view(),
        &tiny,
    )
    .unwrap();
    // 9 values of |v| <= 2 summed in f32: at most (9 - 1) u sum |v| = 8 x
    // 6e-8 x 18 = 8.6e-6 off before the division by 9 (exact weights 1).
    for (a, b) in ours.output.iter().zip(&reference.output) {
        assert!((f64::from(*a) - b).abs() < 1e-5, "{a} {b}");
    }
}
