//! The code that turns bad input into an error, tested where it lives (issue
//! #19: cargo-mutants found these guard rails unprotected by the crate's own
//! tests): `check_finite`, the packing config's limits, the names and parsers
//! of `Algorithm` and `Overlong`, `canonicalize` and `check_strategies`.
//! Each test asserts both sides of its boundary, so that a flipped
//! comparison or a guard replaced by `Ok(())` fails here.

use packshard_reference::error::check_finite;
use packshard_reference::packing::{
    canonicalize, check_strategies, pack_histogram, pack_lengths, Algorithm, Histogram, Overlong,
    PackingConfig, Strategy, MAX_SEQ_LEN_LIMIT,
};
use packshard_reference::Error;

fn field_of(e: &Error) -> String {
    match e {
        Error::InvalidArgument { field, .. } => field.clone(),
        Error::NonFiniteInput { field, .. } => field.clone(),
        other => panic!("unexpected error kind: {other}"),
    }
}

#[test]
fn check_finite_names_the_first_non_finite_value() {
    assert!(check_finite("x", &[0.0, -1.5, f64::MAX, f64::MIN_POSITIVE]).is_ok());
    assert!(check_finite("x", &[]).is_ok());
    for bad in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
        let e = check_finite("logits", &[1.0, 2.0, bad, f64::NAN]).unwrap_err();
        match e {
            Error::NonFiniteInput {
                field,
                index,
                value,
            } => {
                assert_eq!(field, "logits");
                assert_eq!(index, 2, "the first non-finite value, by flat index");
                assert!(value.is_nan() == bad.is_nan() && (bad.is_nan() || value == bad));
            }
            other => panic!("{other}"),
        }
    }
}

#[test]
fn algorithm_names_parse_back_and_nothing_else_does() {
    let want = ["none", "spfhp", "lpfhp", "nnlshp", "ffd", "bfd", "lphp"];
    let names: Vec<&str> = Algorithm::ALL.iter().map(|a| a.name()).collect();
    assert_eq!(names, want, "the names are the CLI and JSON contract");
    for a in Algorithm::ALL {
        assert_eq!(a.to_string(), a.name());
        assert_eq!(a.name().parse::<Algorithm>().unwrap(), a);
    }
    for bad in ["", "SPFHP", "spfhp ", "nnls", "lphp3", "all"] {
        let e = bad.parse::<Algorithm>().unwrap_err();
        assert_eq!(e.kind(), "invalid_argument");
        assert_eq!(field_of(&e), "algorithm");
        let text = e.to_string();
        assert!(text.contains("known: none, spfhp"), "{text}");
    }
}

#[test]
fn overlong_policies_parse_and_unknown_ones_are_refused() {
    for (s, want) in [
        ("error", Overlong::Error),
        ("split", Overlong::Split),
        ("truncate", Overlong::Truncate),
        ("drop", Overlong::Drop),
    ] {
        assert_eq!(s.parse::<Overlong>().unwrap(), want);
    }
    for bad in ["", "Error", "cut", "splits"] {
        let e = bad.parse::<Overlong>().unwrap_err();
        assert_eq!(field_of(&e), "overlong");
    }
    assert_eq!(Overlong::default(), Overlong::Error);
}

#[test]
fn packing_config_limits_hold_on_both_sides() {
    let lengths = [3, 1, 2];
    let cfg = |max_seq_len| PackingConfig::new(Algorithm::Spfhp, max_seq_len);
    // max_seq_len: 0 refused, 1 and up accepted.
    let e = pack_lengths(&[1], &cfg(0)).unwrap_err();
    assert_eq!(field_of(&e), "max_seq_len");
    assert!(pack_lengths(&[1, 1], &cfg(1)).is_ok());
    // Over the limit refused; at the limit accepted (the padding baseline
    // allocates nothing per length).
    let over = PackingConfig::new(Algorithm::None, MAX_SEQ_LEN_LIMIT + 1);
    let e = pack_lengths(&lengths, &over).unwrap_err();
    assert_eq!(field_of(&e), "max_seq_len");
    assert!(e.to_string().contains(&MAX_SEQ_LEN_LIMIT.to_string()));
    let at = PackingConfig::new(Algorithm::None, MAX_SEQ_LEN_LIMIT);
    assert!(pack_lengths(&lengths, &at).is_ok());
    // max_sequences_per_pack: 0 refused, 1 accepted and obeyed.
    let e = pack_lengths(&lengths, &cfg(8).with_max_sequences_per_pack(Some(0))).unwrap_err();
    assert_eq!(field_of(&e), "max_sequences_per_pack");
    let one = pack_lengths(&lengths, &cfg(8).with_max_sequences_per_pack(Some(1))).unwrap();
    assert_eq!(one.metrics.num_packs, 3, "one sequence per pack");
    let two = pack_lengths(&lengths, &cfg(8).with_max_sequences_per_pack(Some(2))).unwrap();
    assert_eq!(two.metrics.num_packs, 2);
}

fn s(lengths: &[usize], count: u64) -> Strategy {
    Strategy {
        lengths: lengths.to_vec(),
        count,
    }
}

#[test]
fn canonicalize_merges_sorts_and_drops_what_holds_nothing() {
    let out = canonicalize(vec![
        s(&[1, 3], 2),
        s(&[3, 1], 1), // the same strategy: merged, counts summed
        s(&[2], 0),    // no packs: dropped
        s(&[], 4),     // no sequences: dropped
        s(&[2, 2, 4], 1),
    ]);
    assert_eq!(out, vec![s(&[4, 2, 2], 1), s(&[3, 1], 3)]);
    // Each drop condition alone suffices.
    assert!(canonicalize(vec![s(&[5], 0)]).is_empty());
    assert!(canonicalize(vec![s(&[], 7)]).is_empty());
    assert_eq!(canonicalize(vec![s(&[5], 1)]), vec![s(&[5], 1)]);
}

#[test]
fn check_strategies_refuses_every_violation_and_accepts_the_boundaries() {
    // Two sequences of length 2, one of length 4.
    let h = Histogram::from_counts(vec![0, 0, 2, 0, 1]);
    let field = |r: packshard_reference::Result<()>| field_of(&r.unwrap_err());
    // Exactly full packs at the limit: accepted.
    assert!(check_strategies(&h, &[s(&[2, 2], 1), s(&[4], 1)], 4, 2).is_ok());
    assert!(check_strategies(&h, &[s(&[4], 1), s(&[2], 2)], 4, 1).is_ok());
    // Over max_seq_len by one token.
    assert_eq!(
        field(check_strategies(&h, &[s(&[4, 2], 1), s(&[2], 1)], 5, 2)),
        "strategies"
    );
    assert!(check_strategies(&h, &[s(&[4, 2], 1), s(&[2], 1)], 6, 2).is_ok());
    // Over the sequence limit by one.
    assert!(check_strategies(&h, &[s(&[2, 2], 1), s(&[4], 1)], 4, 1).is_err());
    // An empty strategy.
    assert!(check_strategies(&h, &[s(&[2, 2], 1), s(&[4], 1), s(&[], 1)], 4, 2).is_err());
    // A sequence missing, one placed twice, a length the histogram lacks.
    assert!(check_strategies(&h, &[s(&[2, 2], 1)], 4, 2).is_err());
    assert!(check_strategies(&h, &[s(&[2, 2], 1), s(&[4], 2)], 4, 2).is_err());
    assert!(check_strategies(&h, &[s(&[2, 2], 1), s(&[4], 1), s(&[3], 1)], 4, 2).is_err());
    assert!(check_strategies(&h, &[s(&[2, 2], 1), s(&[4], 1), s(&[0], 1)], 4, 2).is_err());
}

#[test]
fn pack_histogram_refuses_a_bad_config_before_any_work() {
    let h = Histogram::from_counts(vec![0, 5, 5]);
    for algorithm in Algorithm::ALL {
        let e = pack_histogram(&h, &PackingConfig::new(algorithm, 0)).unwrap_err();
        assert_eq!(field_of(&e), "max_seq_len", "{algorithm}");
        let ok = pack_histogram(&h, &PackingConfig::new(algorithm, 4)).unwrap();
        assert_eq!(ok.metrics.num_sequences, 10, "{algorithm}");
    }
}

/// Each overlong policy on a histogram reports what it did: `truncate` drops
/// `count * (length - max_seq_len)` tokens, `drop` the whole sequences,
/// `split` none (docs/INTERFACE.md `overlong`).
#[test]
fn overlong_histogram_policies_count_what_they_drop() {
    // 3 sequences of 10 tokens and 2 of 4, max_seq_len 4.
    let mut counts = vec![0u64; 11];
    counts[10] = 3;
    counts[4] = 2;
    let h = Histogram::from_counts(counts);
    let cfg = |o| PackingConfig::new(Algorithm::Spfhp, 4).with_overlong(o);
    let t = pack_histogram(&h, &cfg(Overlong::Truncate))
        .unwrap()
        .metrics;
    assert_eq!(t.dropped_tokens, 3 * (10 - 4));
    assert_eq!((t.truncated_sequences, t.dropped_sequences), (3, 0));
    let d = pack_histogram(&h, &cfg(Overlong::Drop)).unwrap().metrics;
    assert_eq!(d.dropped_tokens, 3 * 10);
    assert_eq!((d.truncated_sequences, d.dropped_sequences), (0, 3));
    let s = pack_histogram(&h, &cfg(Overlong::Split)).unwrap().metrics;
    assert_eq!((s.dropped_tokens, s.split_sequences), (0, 3));
    let e = pack_histogram(&h, &cfg(Overlong::Error)).unwrap_err();
    assert_eq!(e.kind(), "sequence_too_long");
}

/// Rotary embeddings need an even, non-zero head dim: 0 and every odd size
/// are refused naming `head_dim`, even sizes give `d / 2` frequencies.
#[test]
fn rope_frequencies_refuse_odd_and_zero_head_dims() {
    use packshard_reference::decoder::ops::rope_inv_freq;
    for bad in [0usize, 1, 3, 7] {
        let e = rope_inv_freq(bad, 10_000.0).unwrap_err();
        assert_eq!(field_of(&e), "head_dim", "{bad}");
    }
    for good in [2usize, 4, 64] {
        let f = rope_inv_freq(good, 10_000.0).unwrap();
        assert_eq!(f.len(), good / 2);
        assert_eq!(f[0], 1.0);
    }
}

/// A dense mask must be `[n_q, n_k]` exactly: one row or column too many or
/// too few, or the two swapped, is refused naming `mask` (a kernel that took
/// a wrong-shaped mask would read past it or ignore keys).
#[test]
fn dense_masks_of_any_other_shape_are_refused_naming_mask() {
    use packshard_reference::attention::{check_mask_shape, check_mask_shape2};
    assert!(check_mask_shape2(&[3, 5], 3, 5).is_ok());
    assert!(check_mask_shape(&[4, 4], 4).is_ok());
    for (shape, n_q, n_k) in [
        (vec![3, 4], 3, 5),
        (vec![4, 5], 3, 5),
        (vec![5, 3], 3, 5),
        (vec![3, 5, 1], 3, 5),
        (vec![15], 3, 5),
        (vec![0, 0], 1, 1),
    ] {
        let e = check_mask_shape2(&shape, n_q, n_k)
            .expect_err(&format!("mask {shape:?} for [{n_q}, {n_k}] accepted"));
        assert!(
            matches!(&e, Error::ShapeMismatch { field, actual, .. } if field == "mask" && *actual == shape),
            "{e}"
        );
    }
    let e = check_mask_shape(&[4, 5], 4).expect_err("a [4, 5] mask for n = 4 accepted");
    assert!(
        matches!(&e, Error::ShapeMismatch { field, .. } if field == "mask"),
        "{e}"
    );
}

/// A loss implementation that declares nothing gets the safe minimum (no
/// sharded algorithm, the basic options) and a typed refusal of anything
/// beyond it from the one check every caller shares
/// (`LossOp::check_declared`); the reference, which declares everything,
/// passes the same calls (the negative control).
#[test]
fn an_undeclared_loss_option_is_refused_by_name() {
    use packshard_reference::ops::{LossOp, LossSupport};
    use packshard_reference::vocab::{
        GradRequest, LossCall, LossConfig, ReferenceCrossEntropy, ShardedAlgorithm,
    };
    struct DeclaresNothing;
    impl LossOp for DeclaresNothing {}
    let bare = DeclaresNothing;
    assert!(bare.algorithms().is_empty());
    assert_eq!(bare.options(), LossSupport::BASIC);
    let targets = [0i64, 1];
    let plain = LossConfig::default();
    let capped = LossConfig {
        softcap: Some(30.0),
        ..LossConfig::default()
    };
    let upstream = [1.0, 0.5];
    let calls = [
        (
            LossCall::with_flag(&targets, &capped, true),
            None,
            "softcap",
        ),
        (
            LossCall::new(&targets, &plain, GradRequest::Upstream(&upstream)),
            None,
            "grad_output",
        ),
        (
            LossCall::with_flag(&targets, &plain, true),
            Some(ShardedAlgorithm::ALL[0]),
            "algorithm",
        ),
    ];
    for (call, algorithm, field) in &calls {
        let e = bare.check_declared(*algorithm, call).unwrap_err();
        assert_eq!(field_of(&e), *field);
        assert_eq!(e.kind(), "invalid_argument");
        ReferenceCrossEntropy
            .check_declared(*algorithm, call)
            .unwrap();
    }
    bare.check_declared(None, &LossCall::with_flag(&targets, &plain, true))
        .unwrap();
}

/// An embedding's upstream gradient of another width than the weight's is
/// refused naming `grad_output` (a `[n, h']` gradient would give a
/// `grad_weight` of width `h'`); `[0, 0]` stands for `[0, h]` (no ids).
#[test]
fn embedding_gradients_of_another_width_are_refused_naming_grad_output() {
    use ndarray::Array2;
    use packshard_reference::vocab::embedding::check_embedding_grad;
    let g = Array2::<f64>::zeros((2, 3));
    let e = check_embedding_grad(g.view(), 2, 4).unwrap_err();
    assert!(
        matches!(e, Error::ShapeMismatch { ref field, .. } if field == "grad_output"),
        "{e}"
    );
    assert!(check_embedding_grad(g.view(), 2, 3).is_ok());
    assert!(check_embedding_grad(Array2::<f64>::zeros((0, 0)).view(), 0, 4).is_ok());
}

/// `LossSupport::covers` (the suites' question: may this call be put to the
/// implementation?) answers exactly what `LossSupport::check` accepts, for
/// every support and every call of the two optional options, alone and
/// together; the reference's support covers them all, the basic one only the
/// plain call.
#[test]
fn a_loss_support_covers_exactly_the_calls_its_check_accepts() {
    use packshard_reference::ops::LossSupport;
    use packshard_reference::vocab::{GradRequest, LossCall, LossConfig};
    let targets = [0i64, 1];
    let plain = LossConfig::default();
    let capped = LossConfig {
        softcap: Some(30.0),
        ..LossConfig::default()
    };
    let upstream = [1.0, 0.5];
    let calls = [
        ("plain", LossCall::with_flag(&targets, &plain, true)),
        ("softcap", LossCall::with_flag(&targets, &capped, true)),
        (
            "grad_output",
            LossCall::new(&targets, &plain, GradRequest::Upstream(&upstream)),
        ),
        (
            "both",
            LossCall::new(&targets, &capped, GradRequest::Upstream(&upstream)),
        ),
    ];
    for softcap in [false, true] {
        for grad_output in [false, true] {
            let support = LossSupport {
                softcap,
                grad_output,
            };
            for (name, call) in &calls {
                let needs_softcap = matches!(*name, "softcap" | "both");
                let needs_grad_output = matches!(*name, "grad_output" | "both");
                let expected = (softcap || !needs_softcap) && (grad_output || !needs_grad_output);
                assert_eq!(
                    support.covers(call),
                    expected,
                    "{support:?} on the {name} call"
                );
                assert_eq!(
                    support.check(call).is_ok(),
                    expected,
                    "{support:?} on the {name} call"
                );
            }
        }
    }
    assert!(calls.iter().all(|(_, c)| LossSupport::ALL.covers(c)));
    assert!(LossSupport::BASIC.covers(&calls[0].1));
}
