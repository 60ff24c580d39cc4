//! The loss options' names as users write them (CLI flags, eval JSON, Python
//! keywords): each name parses to its option and back, and an unknown name
//! is refused with a message listing the known ones. The names are spelled
//! out here, not read from the `named_options!` tables that define them.

use packshard_reference::vocab::{Reduction, ShardLayout, ShardedAlgorithm, SmoothingConvention};

#[test]
fn option_names_round_trip_and_unknown_ones_list_the_known() {
    fn spelled<T>(cases: &[(T, &str)], name: impl Fn(&T) -> &'static str)
    where
        T: std::str::FromStr<Err: std::fmt::Debug> + PartialEq + std::fmt::Debug + Copy,
    {
        for &(x, want) in cases {
            assert_eq!(name(&x), want);
            assert_eq!(want.parse::<T>().unwrap(), x, "{want}");
        }
    }
    use Reduction as R;
    use ShardedAlgorithm as A;
    spelled(
        &[(R::Mean, "mean"), (R::Sum, "sum"), (R::None, "none")],
        |r| r.name(),
    );
    let conventions = [
        (SmoothingConvention::PyTorch, "pytorch"),
        (SmoothingConvention::Megatron, "megatron"),
    ];
    spelled(&conventions, |c| c.name());
    let layouts = [
        (ShardLayout::Uneven, "uneven"),
        (ShardLayout::Padded, "padded"),
    ];
    spelled(&layouts, |l| l.name());
    spelled(
        &[(A::Naive, "naive"), (A::Alg1, "alg1"), (A::Alg2, "alg2")],
        |a| a.name(),
    );
    let shown = [R::Mean, R::Sum, R::None].map(|r| (r.to_string(), r.name()));
    let shown = shown
        .into_iter()
        .chain(A::ALL.map(|a| (a.to_string(), a.name())));
    for (display, name) in shown {
        assert_eq!(display, name);
    }
    let unknown = [
        (
            "max".parse::<Reduction>().map(|_| ()),
            "reduction: unknown reduction \"max\"; expected mean, sum or none",
        ),
        (
            "x".parse::<SmoothingConvention>().map(|_| ()),
            "smoothing: unknown label-smoothing convention \"x\"; expected pytorch or megatron",
        ),
        (
            "striped".parse::<ShardLayout>().map(|_| ()),
            "layout: unknown shard layout \"striped\"; expected uneven or padded",
        ),
        (
            "alg3".parse::<ShardedAlgorithm>().map(|_| ()),
            "algorithm: unknown sharded algorithm \"alg3\"; expected naive, alg1 or alg2",
        ),
    ];
    for (got, want) in unknown {
        assert_eq!(got.unwrap_err().to_string(), want);
    }
}
