//! `keep_freed_memory` keeps what the process frees for reuse: a large
//! block freed and asked for again on the main thread costs no page faults
//! (glibc's default unmaps it at `free` and maps it afresh, one fault per 4
//! KiB page on first touch). Its own test binary without libtest's harness
//! (`harness = false`): `mallopt` changes the whole process, and the main
//! thread is where the `packshard` binary allocates its large blocks
//! (glibc's other arenas map blocks over 64 MiB themselves, whatever the
//! threshold).

fn main() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    a_freed_large_block_is_reused_without_page_faults();
    println!("kept_memory: ok");
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn a_freed_large_block_is_reused_without_page_faults() {
    use packshard_optimized::alloc::keep_freed_memory;
    const BYTES: usize = 256 << 20;
    fn minor_faults() -> i64 {
        let mut u: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: getrusage writes the struct it is given.
        assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) }, 0);
        u.ru_minflt
    }
    /// Page faults of allocating `BYTES` zeroed, touching every page,
    /// and freeing them.
    fn faults_of_one_block() -> i64 {
        let before = minor_faults();
        let mut v = vec![0u8; BYTES];
        for page in v.chunks_mut(4096) {
            page[0] = 1;
        }
        std::hint::black_box(&v);
        drop(v);
        minor_faults() - before
    }
    // Control, before the change: every 4 KiB page of the fresh mapping
    // faults (transparent huge pages are advice-only here; with them on
    // for every mapping this control would fail and say so).
    let fresh = faults_of_one_block();
    assert!(
        fresh > (BYTES / 4096 / 2) as i64,
        "{fresh} faults for a fresh block"
    );
    assert!(keep_freed_memory());
    faults_of_one_block(); // the heap grows to hold it once
    let reused = faults_of_one_block();
    // A few for the harness's own small allocations; the block itself none
    // (65,536 pages).
    assert!(
        reused < 256,
        "{reused} faults for a reused block (fresh: {fresh})"
    );
}
