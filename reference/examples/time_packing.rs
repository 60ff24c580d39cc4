//! Times one packing algorithm in process, warm: one untimed call, then
//! `repeats` timed calls of `pack_histogram`; prints one JSON line with the
//! median and the pack count. The Rust side of
//! `scripts/bench_python_reference.sh` (docs/PACKING.md).
//!
//!     cargo run --release -p packshard-reference --example time_packing -- DATASET ALGORITHM LIMIT REPEATS

use packshard_reference::packing::{pack_histogram, Algorithm, Histogram, PackingConfig};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [dataset, algorithm, limit, repeats] = &args[..] else {
        eprintln!("usage: time_packing DATASET ALGORITHM LIMIT REPEATS");
        std::process::exit(2);
    };
    let fail = |e: String| -> ! {
        eprintln!("error: {e}");
        std::process::exit(2)
    };
    let histogram = Histogram::embedded(dataset).unwrap_or_else(|e| fail(e.to_string()));
    let algorithm: Algorithm = algorithm.parse().unwrap_or_else(|e| fail(format!("{e}")));
    let limit: usize = limit
        .parse()
        .unwrap_or_else(|_| fail(format!("limit {limit:?}")));
    let repeats: usize = repeats
        .parse()
        .unwrap_or_else(|_| fail(format!("repeats {repeats:?}")));
    let msl = histogram.max_length();
    let config = PackingConfig::new(algorithm, msl).with_max_sequences_per_pack(Some(limit));
    let first = pack_histogram(&histogram, &config).unwrap_or_else(|e| fail(e.to_string()));
    let mut times: Vec<f64> = (0..repeats.max(1))
        .map(|_| {
            let start = std::time::Instant::now();
            let r = pack_histogram(&histogram, &config).unwrap_or_else(|e| fail(e.to_string()));
            let t = start.elapsed().as_secs_f64();
            assert_eq!(
                r.metrics.num_packs, first.metrics.num_packs,
                "deterministic"
            );
            t
        })
        .collect();
    times.sort_by(f64::total_cmp);
    println!(
        "{{\"seconds\": {:.9}, \"packs\": {}}}",
        times[times.len() / 2],
        first.metrics.num_packs
    );
}
