//! The CUDA output layer's op (`CudaLinearCrossEntropy` through the loss
//! boundary): bad input, other algorithms, options beyond f32 and the
//! undeclared refused, on both backends, before anything is launched.

use super::*;

/// Bad input gets the reference's error before any kernel runs, and an
/// algorithm the kernels do not implement is refused, never handed on.
#[test]
fn the_op_refuses_bad_input_and_other_algorithms() {
    static CPU: CpuShard = CpuShard;
    let op = CudaLinearCrossEntropy::new(&CPU);
    let c = linear_case(4, 3, 10, 9);
    let h = Array2::from_shape_vec((4, 3), c.hidden.clone())
        .unwrap()
        .mapv(f64::from);
    let w = Array2::from_shape_vec((10, 3), c.weight.clone())
        .unwrap()
        .mapv(f64::from);
    let map = ShardMap::new(10, 2, ShardLayout::Uneven).unwrap();
    let cfg = LossConfig::default();
    let mut t = c.targets.clone();
    t[2] = 10;
    let sharded = |h: &Array2<f64>, w: &Array2<f64>, t: &[i64], a: ShardedAlgorithm| {
        op.sharded_linear_cross_entropy(
            ShardPlan::new(a, map),
            LinearCall::new(
                LinearInput::new(h.view(), w.view()),
                LossCall::with_flag(t, &cfg, true),
            ),
        )
    };
    match sharded(&h, &w, &t, ShardedAlgorithm::Alg2) {
        Err(Error::IndexOutOfRange {
            field,
            index,
            value,
            ..
        }) => assert_eq!((field.as_str(), index, value), ("targets", 2, 10)),
        other => panic!("{other:?}"),
    }
    let input = LinearInput::new(h.view(), w.view());
    match op.linear_cross_entropy(LinearCall::new(input, LossCall::with_flag(&t, &cfg, true))) {
        Err(Error::IndexOutOfRange { index, .. }) => assert_eq!(index, 2),
        other => panic!("{other:?}"),
    }
    let mut w_bad = w.clone();
    w_bad[[2, 1]] = f64::INFINITY;
    match sharded(&h, &w_bad, &c.targets, ShardedAlgorithm::Alg2) {
        Err(Error::NonFiniteInput { field, index, .. }) => {
            assert_eq!((field.as_str(), index), ("weight", 7))
        }
        other => panic!("{other:?}"),
    }
    for a in [ShardedAlgorithm::Naive, ShardedAlgorithm::Alg1] {
        match sharded(&h, &w, &c.targets, a) {
            Err(Error::InvalidArgument { field, .. }) => assert_eq!(field, "algorithm"),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(op.algorithms(), vec![ShardedAlgorithm::Alg2]);
    // The softcap (docs/FAULTS.md O1) is declared unsupported and refused by
    // name in both forms, never answered with the uncapped loss.
    assert!(!op.options().softcap);
    let capped = LossConfig::default().with_softcap(30.0);
    let refused = [
        op.sharded_linear_cross_entropy(
            ShardPlan::new(ShardedAlgorithm::Alg2, map),
            LinearCall::new(input, LossCall::with_flag(&c.targets, &capped, true)),
        )
        .map(|_| ()),
        op.linear_cross_entropy(LinearCall::new(
            input,
            LossCall::with_flag(&c.targets, &capped, false),
        ))
        .map(|_| ()),
    ];
    for r in refused {
        match r {
            Err(Error::InvalidArgument { field, .. }) => assert_eq!(field, "softcap"),
            other => panic!("{other:?}"),
        }
    }
}

/// The f32 option checks the CPU kernels make (`check_call_f32`), in the
/// CUDA adapter too (issue #32): a `z_loss` or an upstream gradient beyond
/// f32's range is refused by name in both forms, never rounded to inf.
#[test]
fn the_op_refuses_options_beyond_f32() {
    use packshard_reference::vocab::GradRequest;
    static CPU: CpuShard = CpuShard;
    let op = CudaLinearCrossEntropy::new(&CPU);
    let c = linear_case(4, 3, 10, 9);
    let h = Array2::from_shape_vec((4, 3), c.hidden.clone())
        .unwrap()
        .mapv(f64::from);
    let w = Array2::from_shape_vec((10, 3), c.weight.clone())
        .unwrap()
        .mapv(f64::from);
    let input = LinearInput::new(h.view(), w.view());
    let map = ShardMap::new(10, 2, ShardLayout::Uneven).unwrap();
    // 1e39: just past f32's 3.4e38.
    let (big_z, plain) = (
        LossConfig::default().with_z_loss(1e39),
        LossConfig::default(),
    );
    let (up, one) = ([1e39], [1.0]);
    // Both forms of one call (a macro: the call borrows the case's values).
    macro_rules! run {
        ($call:expr) => {{
            let call = $call;
            [
                op.linear_cross_entropy(LinearCall::new(input, call))
                    .map(|_| ()),
                op.sharded_linear_cross_entropy(
                    ShardPlan::new(ShardedAlgorithm::Alg2, map),
                    LinearCall::new(input, call),
                )
                .map(|_| ()),
            ]
        }};
    }
    for (call, field) in [
        (LossCall::with_flag(&c.targets, &big_z, true), "z_loss"),
        (
            LossCall::new(&c.targets, &plain, GradRequest::Upstream(&up)),
            "grad_output[0]",
        ),
    ] {
        for r in run!(call) {
            match r {
                Err(Error::InvalidArgument { field: f, .. }) => assert_eq!(f, field),
                other => panic!("{field}: {other:?}"),
            }
        }
    }
    // A negative control: an upstream gradient of 1 is taken.
    for r in run!(LossCall::new(
        &c.targets,
        &plain,
        GradRequest::Upstream(&one)
    )) {
        r.unwrap();
    }
}

/// The CUDA output layer goes through the f32 loss boundary
/// (`packshard_optimized::ops::boundary::losses`) in its order: what the
/// kernel does not declare (the softcap) is refused by name before the
/// inputs are read, in both forms, as for every f32 loss kernel; without the
/// softcap the same inputs get the reference's error (the negative control).
#[test]
fn the_op_refuses_the_undeclared_before_reading_the_inputs() {
    static CPU: CpuShard = CpuShard;
    let op = CudaLinearCrossEntropy::new(&CPU);
    let c = linear_case(4, 3, 10, 9);
    let h = Array2::from_shape_vec((4, 3), c.hidden.clone())
        .unwrap()
        .mapv(f64::from);
    let mut w = Array2::from_shape_vec((10, 3), c.weight.clone())
        .unwrap()
        .mapv(f64::from);
    w[[2, 1]] = f64::NAN;
    let input = LinearInput::new(h.view(), w.view());
    let map = ShardMap::new(10, 2, ShardLayout::Uneven).unwrap();
    let capped = LossConfig {
        softcap: Some(30.0),
        ..LossConfig::default()
    };
    let plain = LossConfig::default();
    for (config, field) in [(&capped, "softcap"), (&plain, "weight")] {
        let call = LossCall::with_flag(&c.targets, config, true);
        let results = [
            op.linear_cross_entropy(LinearCall::new(input, call))
                .map(|_| ()),
            op.sharded_linear_cross_entropy(
                ShardPlan::new(ShardedAlgorithm::Alg2, map),
                LinearCall::new(input, call),
            )
            .map(|_| ()),
        ];
        for r in results {
            match r {
                Err(Error::InvalidArgument { field: f, .. }) if field == "softcap" => {
                    assert_eq!(f, field)
                }
                Err(Error::NonFiniteInput {
                    field: f, index, ..
                }) if field == "weight" => {
                    assert_eq!((f.as_str(), index), ("weight", 7))
                }
                other => panic!("{field}: {other:?}"),
            }
        }
    }
}
