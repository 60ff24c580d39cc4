//! The causal / grouped-query / cross attention suite
//! (`attention_general`) on the reference, and its negative controls: key
//! heads mapped as `a % h_kv`, causal masks aligned top-left (docs/FAULTS.md
//! C5), a kernel leaking across segments — each passes the self-attention
//! checks that cannot see it and is caught here, for the right reason.

use packshard_equivalence::attention::run_attention_suite;
use packshard_equivalence::attention_general::{check_general, run_general_suite, GeneralCase};
use packshard_equivalence::planted::{ModuloKvHeads, Planted, TopLeftCausal};
use packshard_equivalence::{Judge, Mismatch, RelativeRule, Tolerance};
use packshard_reference::attention::ReferenceAttention;
use packshard_reference::ops::{AttentionSupport, Precision};

const F64: Judge = Judge::Rewrite(Tolerance::F64_REWRITE);

fn assert_names(m: &Mismatch, parts: &[&str]) {
    let text = m.to_string();
    for p in parts {
        assert!(text.contains(p), "{p:?} not in: {text}");
    }
}

#[test]
fn reference_passes_with_every_kind_of_case() {
    let r = run_general_suite(&ReferenceAttention, F64, 64)
        .unwrap()
        .expect("the reference declares everything");
    assert_eq!(r.cases, 6 + 64);
    assert!(r.gqa >= 20 && r.cross >= 20 && r.causal >= 20, "{r}");
    assert!(r.packed.values > 5_000, "{r}");
    // The f32 rule over the reference itself (f32 inputs): its error is 0.
    let relative = Judge::Relative {
        rule: RelativeRule::F32,
        inputs: Precision::F32,
        packed: Tolerance::EXACT,
    };
    let r = run_general_suite(&ReferenceAttention, relative, 16)
        .unwrap()
        .unwrap();
    assert!(r.relative.unwrap().nonzero_baseline > 20);
}

#[test]
fn an_implementation_without_the_kinds_is_not_asked() {
    struct Plain;
    impl packshard_equivalence::planted::AttentionHooks for Plain {
        fn support(&self) -> AttentionSupport {
            AttentionSupport::BIDIRECTIONAL
        }
    }
    assert!(run_general_suite(&Planted(Plain), F64, 4)
        .unwrap()
        .is_none());
}

#[test]
fn key_heads_mapped_modulo_are_caught_against_the_reference() {
    // Packed == padded and packed == alone hold: the fault is consistent.
    run_attention_suite(&Planted(ModuloKvHeads), 8).unwrap();
    let case = GeneralCase::seeded(&[(3, 3), (2, 2)], (4, 2, 3), false, 1);
    let m = check_general(&Planted(ModuloKvHeads), &case, F64).unwrap_err();
    assert_names(&m, &["against the reference: output"]);
    // With h_kv == h or 1 the two maps agree.
    let mha = GeneralCase::seeded(&[(3, 3)], (2, 2, 3), true, 2);
    let mqa = GeneralCase::seeded(&[(3, 3)], (3, 1, 3), true, 3);
    for c in [mha, mqa] {
        check_general(&Planted(ModuloKvHeads), &c, F64).unwrap();
    }
    let m = run_general_suite(&Planted(ModuloKvHeads), F64, 16).unwrap_err();
    assert_names(&m, &["against the reference"]);
}

#[test]
fn top_left_causal_alignment_is_caught_against_the_reference() {
    let self_attention = GeneralCase::seeded(&[(4, 4), (3, 3)], (2, 1, 3), true, 4);
    check_general(&Planted(TopLeftCausal), &self_attention, F64).unwrap();
    // C5: 2 queries over 5 keys see [1,1,1,1,0] and [1,1,1,1,1].
    let c5 = GeneralCase::seeded(&[(2, 5)], (1, 1, 2), true, 5);
    let m = check_general(&Planted(TopLeftCausal), &c5, F64).unwrap_err();
    assert_names(&m, &["against the reference: output"]);
    // More queries than keys: the top rows see nothing under bottom-right.
    let more = GeneralCase::seeded(&[(3, 1)], (1, 1, 2), true, 6);
    let m = check_general(&Planted(TopLeftCausal), &more, F64).unwrap_err();
    assert_names(&m, &["query 0 of 3 over 1 keys", "C5"]);
    let m = run_general_suite(&Planted(TopLeftCausal), F64, 16).unwrap_err();
    assert_names(&m, &["C5: 2 queries over 5 keys"]);
}

/// A seeded case draws every tensor uniform in `[-2, 2]`, as documented:
/// signs of both kinds (a generator shifted to `[0, 2]` would leave every
/// score positive and hide sign faults), each tensor the size of its shape.
#[test]
fn seeded_cases_draw_values_of_both_signs_within_two() {
    let c = GeneralCase::seeded(&[(5, 7), (3, 2)], (4, 2, 3), true, 9);
    assert_eq!(c.q.dim(), (8, 4, 3));
    assert_eq!(c.k.dim(), (9, 2, 3));
    for (name, t) in [
        ("q", &c.q),
        ("k", &c.k),
        ("v", &c.v),
        ("grad_output", &c.grad_output),
    ] {
        assert!(t.iter().all(|x| x.abs() <= 2.0), "{name}");
        let negative = t.iter().filter(|&&x| x < -0.5).count();
        assert!(
            negative * 8 >= t.len(),
            "{name}: {negative} of {} below -0.5",
            t.len()
        );
    }
    assert_eq!(c.scale, 1.0 / 3f64.sqrt());
}
