//! The training step across ranks equals one unpacked batch, and each fault
//! D1..D8 is caught (issue #34; docs/STEP.md).

use packshard_equivalence::step::{check_step, fault_case, step_batch, step_model};
use packshard_reference::decoder::CausalReduction;
use packshard_reference::step::{Layout, StepFault};

/// `(G, D, C)`: one process, accumulation alone, data parallel alone, CP
/// of 2, 3 (odd) and 4, and all three at once.
const LAYOUTS: [(usize, usize, usize); 7] = [
    (1, 1, 1),
    (3, 1, 1),
    (1, 3, 1),
    (1, 1, 2),
    (1, 1, 3),
    (1, 1, 4),
    (2, 2, 2),
];

#[test]
fn the_step_equals_the_unpacked_batch() {
    let mut compared = 0;
    for (i, &(g, d, c)) in LAYOUTS.iter().enumerate() {
        let layout = Layout {
            grad_accum: g,
            dp: d,
            cp: c,
        };
        for (k, &reduction) in CausalReduction::ALL.iter().enumerate() {
            let seed = (10 * i + k) as u64;
            let batch = step_batch(&layout, reduction, seed);
            let model = step_model(seed);
            let seen = check_step(&model, &batch, &layout, None).unwrap_or_else(|m| {
                panic!("layout {g}x{d}x{c} {} seed {seed}: {m}", reduction.name())
            });
            compared += seen.values;
        }
    }
    assert!(compared > 0);
}

#[test]
fn each_step_fault_is_caught() {
    for fault in StepFault::ALL {
        let (layout, batch) = fault_case(fault, 1);
        let model = step_model(1);
        check_step(&model, &batch, &layout, None)
            .unwrap_or_else(|m| panic!("{}: the right step fails: {m}", fault.id()));
        let caught = check_step(&model, &batch, &layout, Some(fault))
            .expect_err(&format!("{} not caught", fault.id()));
        // Caught by a value, not refused by the step.
        assert_ne!(caught.what, "step", "{}: {caught}", fault.id());
        println!("{}: {caught}", fault.id());
    }
}

/// One seed in three (`seed % 3 == 2`) gives its batch an end-of-document
/// id (22), so the suites meet batches with and without one.
#[test]
fn step_batches_carry_an_eos_one_seed_in_three() {
    let layout = Layout {
        grad_accum: 1,
        dp: 1,
        cp: 1,
    };
    let eos: Vec<Option<i64>> = (0..6)
        .map(|s| step_batch(&layout, CausalReduction::PerToken, s).eos)
        .collect();
    assert_eq!(eos, [None, None, Some(22), None, None, Some(22)]);
}
