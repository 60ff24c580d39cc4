//! The counting allocator measures what it is given: a known allocation, a
//! growth by `realloc` and a free move the live and peak counts by their
//! sizes (the memory figures of `packshard bench` rest on these counts).

use packshard_optimized::alloc::{
    is_counting, live_bytes, peak_bytes, peak_since, reset_peak, CountingAlloc,
};

#[global_allocator]
static COUNTING: CountingAlloc = CountingAlloc;

const MIB: usize = 1 << 20;

/// One test in this binary, so no other test thread allocates meanwhile
/// (the harness's own allocations are small beside the MiBs asserted).
#[test]
fn live_and_peak_follow_alloc_realloc_and_free() {
    let _warm = std::hint::black_box(Vec::<u8>::with_capacity(16));
    assert!(is_counting());

    // alloc: the live count rises by the size, the peak with it.
    reset_peak();
    let base = live_bytes();
    let a = vec![1u8; 4 * MIB];
    assert!(live_bytes() >= base + 4 * MIB, "{} {base}", live_bytes());
    assert!(peak_bytes() >= base + 4 * MIB);

    // realloc: a vector grown in place or moved counts its new size once.
    let mut b: Vec<u8> = Vec::with_capacity(MIB);
    b.resize(MIB, 2);
    let before = live_bytes();
    b.reserve_exact(7 * MIB);
    let grown = live_bytes() - before;
    assert!(
        (7 * MIB..7 * MIB + MIB / 2).contains(&grown),
        "realloc to 8 MiB counted {grown} bytes more"
    );
    assert!(peak_bytes() >= base + 12 * MIB);

    // free: the live count falls back; the peak stays.
    drop(a);
    drop(b);
    assert!(live_bytes() < base + MIB, "{} {base}", live_bytes());
    assert!(peak_bytes() >= base + 12 * MIB);

    // peak_since: the peak of a closure above what was live before it.
    let ((), peak) = peak_since(|| {
        let c = vec![3u8; 2 * MIB];
        std::hint::black_box(&c);
    });
    let peak = peak.expect("counting");
    assert!((2 * MIB..3 * MIB).contains(&peak), "{peak}");
}
