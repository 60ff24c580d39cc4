//! `KeptBlocks` keeps freed large blocks for the next request of the same
//! layout: such a block costs no page faults the second time, comes back
//! zeroed from `alloc_zeroed`, and the limit (`PACKSHARD_KEPT_BYTES`, the
//! oldest blocks making room for the newest), the slots, the size floor and
//! `release` hold. Its own binary without libtest's harness
//! (`harness = false`): a global allocator is the whole process's, and the
//! limit is read once, at the first large free.

use packshard_optimized::alloc::{KeptBlocks, KEPT_MIN};

#[global_allocator]
static ALLOC: KeptBlocks = KeptBlocks;

const BYTES: usize = 64 << 20;

fn main() {
    // Set before the first large free (read once then): room for one block
    // of BYTES, not two.
    // SAFETY: no other thread exists yet.
    unsafe { std::env::set_var("PACKSHARD_KEPT_BYTES", (BYTES + BYTES / 2).to_string()) };
    a_freed_block_is_handed_back_zeroed_without_page_faults();
    the_limit_the_floor_and_release_hold();
    // Before any other thread exists (it sets the environment;
    // zeros_parallel starts rayon's).
    the_limit_is_read_as_the_memory_budget_is();
    zeros_parallel_clears_a_dirty_kept_block();
    println!("kept_blocks: ok");
}

#[cfg(target_os = "linux")]
fn minor_faults() -> i64 {
    // SAFETY: getrusage writes the struct it is given.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) }, 0);
    u.ru_minflt
}

#[cfg(not(target_os = "linux"))]
fn minor_faults() -> i64 {
    0
}

/// A zeroed block of `BYTES`, every page written (1s), its address, and the
/// page faults that took.
fn touched_block() -> (Vec<u8>, usize, i64) {
    let before = minor_faults();
    let mut v = vec![0u8; BYTES];
    assert!(
        v.iter().step_by(4093).all(|&x| x == 0),
        "a block came back dirty"
    );
    for page in v.chunks_mut(4096) {
        page[0] = 1;
    }
    let at = v.as_ptr() as usize;
    (std::hint::black_box(v), at, minor_faults() - before)
}

fn a_freed_block_is_handed_back_zeroed_without_page_faults() {
    let (v, first_at, fresh) = touched_block();
    // Control: a fresh block faults its pages (at least one per 2 MiB even
    // with huge pages; 16,384 with 4 KiB pages).
    if cfg!(target_os = "linux") {
        assert!(
            fresh >= (BYTES >> 21) as i64,
            "{fresh} faults for a fresh block"
        );
    }
    drop(v);
    assert_eq!(KeptBlocks::held_bytes(), BYTES);
    // Asked for again: the same block, written with 1s before, now zeroed
    // (checked in touched_block), and no fault for its pages.
    let (v, again_at, reused) = touched_block();
    assert_eq!(again_at, first_at);
    assert_eq!(KeptBlocks::held_bytes(), 0);
    assert!(
        reused < 16,
        "{reused} faults for a kept block (fresh: {fresh})"
    );
    drop(v);
}

fn the_limit_the_floor_and_release_hold() {
    use packshard_optimized::alloc::KEPT_SLOTS;
    KeptBlocks::release();
    // Two blocks freed: the limit (1.5 x BYTES) holds one, the newer.
    let (a, b) = (vec![1u8; BYTES], vec![2u8; BYTES]);
    drop(a);
    drop(b);
    assert_eq!(KeptBlocks::held_bytes(), BYTES);
    // Another size is not served from the kept block; freed, it takes the
    // older block's room (the newest blocks are kept, not the first ones).
    let other = vec![3u8; BYTES + 4096];
    assert_eq!(KeptBlocks::held_bytes(), BYTES);
    drop(other);
    assert_eq!(KeptBlocks::held_bytes(), BYTES + 4096);
    // The evicted block is not served: the one kept has another size.
    let again = vec![4u8; BYTES];
    assert_eq!(KeptBlocks::held_bytes(), BYTES + 4096);
    drop(again); // evicts `other` in turn
    assert_eq!(KeptBlocks::held_bytes(), BYTES);
    // Over the limit alone, or below the floor: never kept.
    drop(vec![5u8; 2 * BYTES]);
    drop(vec![6u8; KEPT_MIN - 1]);
    assert_eq!(KeptBlocks::held_bytes(), BYTES);
    assert_eq!(KeptBlocks::release(), BYTES);
    assert_eq!(KeptBlocks::held_bytes(), 0);
    // More blocks than slots: the oldest go.
    let small: Vec<Vec<u8>> = (0..KEPT_SLOTS + 2)
        .map(|i| vec![i as u8; KEPT_MIN])
        .collect();
    drop(small);
    assert_eq!(KeptBlocks::held_bytes(), KEPT_SLOTS * KEPT_MIN);
    assert_eq!(KeptBlocks::release(), KEPT_SLOTS * KEPT_MIN);
}

/// `zeros_parallel` asks for its block uninitialised (so a kept block comes
/// back without the allocator's clearing) and clears it itself: a block
/// freed full of 1s comes back as the array, every element 0.
fn zeros_parallel_clears_a_dirty_kept_block() {
    use packshard_optimized::alloc::zeros_parallel;
    KeptBlocks::release();
    let n = BYTES / 4;
    let dirty = vec![1.0f32; n];
    let at = dirty.as_ptr() as usize;
    drop(dirty);
    assert_eq!(KeptBlocks::held_bytes(), BYTES);
    let z = zeros_parallel(ndarray::Ix3(n / 64 / 4, 4, 64));
    assert_eq!(
        z.as_ptr() as usize,
        at,
        "the kept block was not the one reused"
    );
    assert!(z.iter().all(|&x| x.to_bits() == 0), "a nonzero element");
    assert_eq!(KeptBlocks::held_bytes(), 0);
}

/// `PACKSHARD_KEPT_BYTES` takes what `PACKSHARD_MEMORY_BUDGET` takes, and a
/// value that is not a byte count is an error naming the variable (the
/// Python package refuses to import with it). The allocator's own limit was
/// read at the first large free above and does not change.
fn the_limit_is_read_as_the_memory_budget_is() {
    use packshard_reference::limits::{kept_bytes, KEPT_BYTES_ENV};
    for (text, want) in [
        ("512MiB", Some(512u64 << 20)),
        (" 7 ", Some(7)),
        ("0", Some(0)),
    ] {
        // SAFETY: no other thread exists yet (main runs this before
        // zeros_parallel starts rayon's).
        unsafe { std::env::set_var(KEPT_BYTES_ENV, text) };
        assert_eq!(kept_bytes(1).ok(), want, "{text:?}");
    }
    for text in ["1.5GiB", "-1", "lots", ""] {
        // SAFETY: as above.
        unsafe { std::env::set_var(KEPT_BYTES_ENV, text) };
        let e = kept_bytes(1).expect_err(text).to_string();
        assert!(e.contains(KEPT_BYTES_ENV), "{text:?}: {e}");
    }
    // SAFETY: as above.
    unsafe { std::env::remove_var(KEPT_BYTES_ENV) };
    assert_eq!(kept_bytes(3).ok(), Some(3));
    let (a, b) = (vec![1u8; BYTES], vec![2u8; BYTES]);
    drop((a, b));
    assert_eq!(
        KeptBlocks::held_bytes(),
        BYTES,
        "the limit read at the start holds"
    );
    KeptBlocks::release();
}
