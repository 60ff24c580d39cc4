//! The pricing problem by hand: which rows a pack may hold.

use super::{within_budget, Pricer, MAX_ROUNDS, MAX_TOTAL_LP_SIZE, MAX_TOTAL_PRICING_WORK};

/// The pricing table's items are the rows of positive price and positive cap:
/// a row of price 0 adds nothing to a pack (of two packs of one value the one
/// without it is offered), a row of cap 0 cannot be in one. Lengths 1 and 2
/// in packs of 5 tokens: at prices (0, 1) the best pack is two sequences of
/// length 2 (value 2), the spare token left empty; at prices (1, 1) with the
/// count of length 1 at 0 no candidate holds a length-1 sequence.
#[test]
fn packs_hold_only_rows_of_positive_price_and_cap() {
    let lengths = [1, 2];
    let pricer = Pricer {
        lengths: &lengths,
        max_seq_len: 5,
        depth: 8,
    };
    let priced = pricer.price(&[0.0, 1.0], &[10, 10], f64::NEG_INFINITY);
    assert_eq!(priced.best, 2.0);
    assert_eq!(priced.candidates, vec![vec![(1, 2)]]);
    let priced = pricer.price(&[1.0, 1.0], &[0, 10], f64::NEG_INFINITY);
    assert_eq!(priced.best, 2.0);
    assert_eq!(priced.candidates, vec![vec![(1, 2)]]);
}

/// Column generation's three caps stop it when reached, not one round later:
/// just under all three another round starts, at any one of them none does.
#[test]
fn column_generation_stops_at_each_cap() {
    assert!(within_budget(0, 0, 0));
    assert!(within_budget(
        MAX_ROUNDS - 1,
        MAX_TOTAL_PRICING_WORK - 1,
        MAX_TOTAL_LP_SIZE - 1
    ));
    assert!(!within_budget(MAX_ROUNDS, 0, 0));
    assert!(!within_budget(0, MAX_TOTAL_PRICING_WORK, 0));
    assert!(!within_budget(0, 0, MAX_TOTAL_LP_SIZE));
}
