//! What `tests/cuda.rs` and `tests/cuda_bench.rs` share: the device or a
//! skip, the `PACKSHARD_REQUIRE_*` switches, and the inputs' generator.
#![allow(dead_code)]

use packshard_optimized::cuda::{nvrtc_ready, Gpu};

/// Whether the environment variable `var` is `1`.
pub fn required(var: &str) -> bool {
    std::env::var(var).is_ok_and(|v| v == "1")
}

/// The device, or `None` after printing why the test skips. Any error other
/// than "no NVRTC" / "no device" fails the test.
pub fn gpu_or_skip(test: &str) -> Option<Gpu> {
    nvrtc_ready();
    match Gpu::new(0) {
        Ok(g) => {
            eprintln!("{test}: running on {} ({})", g.name(), g.arch());
            Some(g)
        }
        Err(e) if e.is_unavailable() => {
            eprintln!("{test}: skipped: {e}");
            None
        }
        Err(e) => panic!("{test}: the GPU is there but failed: {e}"),
    }
}

/// SplitMix64's next value as a uniform f64 in `[0, 1)`.
pub fn splitmix(state: &mut u64) -> f64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
}
