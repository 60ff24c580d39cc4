// A CPU emulation of the CUDA execution model, just enough to run the
// kernels of optimized/src/cuda/*.cu unchanged on a machine without a GPU.
// optimized/src/cuda/emu.rs writes this file and the kernel sources into a
// cache folder, builds them with $CXX (or g++) into a shared library at
// first use, and calls `emu_launch` with cuLaunchKernel's argument layout.
//
// Each CUDA thread of a block is a fiber (ucontext for its stack, then
// _setjmp/_longjmp to switch, which costs no system call), all on the
// calling OS thread. A block runs in rounds: every thread that has not
// finished runs until its next __syncthreads() or its end; a round ends
// when all have, so __syncthreads() is a barrier over the block's threads
// and `extern __shared__` memory (one static buffer) is per block. Blocks
// run one after another in grid order (x fastest).
//
// What it does not model: warps, concurrent blocks, memory ordering
// without __syncthreads, and the GPU's own rounding of expf/logf (glibc's
// are used; both are within a few ulp). It checks the kernels' logic and
// indexing, not their speed. Not reentrant: the Rust side serialises
// launches.

#include <setjmp.h>
#include <ucontext.h>

#include <cmath>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
// One OS thread runs every fiber: these are set before a fiber resumes.
static dim3 threadIdx, blockIdx, blockDim, gridDim;

namespace emu {
constexpr unsigned MAX_THREADS = 1024;
constexpr size_t STACK_BYTES = 64 * 1024;  // kernels hold <= 4 x MAX_D floats each

struct Fiber {
    ucontext_t start;  // the first entry only
    jmp_buf at;        // where it waits (a barrier, or its end)
    bool started = false;
    bool done = false;
};

static std::vector<Fiber> fibers;
static std::vector<char> stacks;
static jmp_buf scheduler;
static ucontext_t scheduler_uc;
static unsigned current = 0;
static void (*body)(void**) = nullptr;  // the kernel, argument list bound
static void** body_args = nullptr;

// Back to the scheduler; returns when the scheduler resumes this fiber.
__attribute__((noinline)) static void yield() {
    if (!_setjmp(fibers[current].at)) _longjmp(scheduler, 1);
}

// A fiber runs the kernel once per block, then waits; it never returns
// (its first context's link would be a stale frame).
static void fiber_main() {
    for (;;) {
        body(body_args);
        fibers[current].done = true;
        yield();
    }
}

__attribute__((noinline)) static void resume(unsigned t) {
    current = t;
    threadIdx = {t % blockDim.x, (t / blockDim.x) % blockDim.y, t / (blockDim.x * blockDim.y)};
    if (!_setjmp(scheduler)) {
        Fiber& f = fibers[t];
        if (!f.started) {
            f.started = true;
            swapcontext(&scheduler_uc, &f.start);
        } else {
            _longjmp(f.at, 1);
        }
    }
}

// Returns 0, or 3 when the block has too many threads.
static int run(dim3 grid, dim3 block, void (*k)(void**), void** args) {
    const unsigned nt = block.x * block.y * block.z;
    if (nt == 0 || nt > MAX_THREADS) return 3;
    gridDim = grid;
    blockDim = block;
    body = k;
    body_args = args;
    fibers.assign(nt, Fiber{});
    stacks.resize(size_t(nt) * STACK_BYTES);
    for (unsigned t = 0; t < nt; ++t) {
        Fiber& f = fibers[t];
        getcontext(&f.start);
        f.start.uc_stack.ss_sp = &stacks[size_t(t) * STACK_BYTES];
        f.start.uc_stack.ss_size = STACK_BYTES;
        f.start.uc_link = nullptr;
        makecontext(&f.start, fiber_main, 0);
    }
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; ++x) {
                blockIdx = {x, y, z};
                for (auto& f : fibers) f.done = false;
                for (bool left = true; left;) {
                    left = false;
                    for (unsigned t = 0; t < nt; ++t) {
                        if (fibers[t].done) continue;
                        resume(t);
                        left |= !fibers[t].done;
                    }
                }
            }
    return 0;
}
}  // namespace emu

static inline void __syncthreads() { emu::yield(); }
static inline float __int_as_float(unsigned int i) {
    float f;
    std::memcpy(&f, &i, sizeof f);
    return f;
}
static inline int min(int a, int b) { return a < b ? a : b; }

// Dynamic shared memory: one buffer, used by one block at a time.
constexpr unsigned SHARED_FLOATS = 1u << 16;
alignas(16) static float smem[SHARED_FLOATS];

#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __shared__

#include "attention.cu"
#include "vocab.cu"

namespace emu {
template <class... P, std::size_t... I>
static void call(void (*k)(P...), void** a, std::index_sequence<I...>) {
    k(*static_cast<std::remove_cv_t<std::remove_reference_t<P>>*>(a[I])...);
}

template <class... P>
static constexpr std::size_t arity(void (*)(P...)) {
    return sizeof...(P);
}

// The kernel `K` with its parameter list read from cuLaunchKernel's `void**`.
template <auto K>
static void entry(void** args) {
    call(K, args, std::make_index_sequence<arity(K)>{});
}
}  // namespace emu

// Runs kernel `name` over grid (gx, gy, gz) with `bx` threads per block.
// Returns 0; 1 for an unknown kernel, 2 for more shared memory than the
// emulator has, 3 for a block of 0 or more than 1024 threads.
extern "C" int emu_launch(const char* name, unsigned gx, unsigned gy, unsigned gz,
                          unsigned bx, unsigned shared_bytes, void** args) {
    if (shared_bytes > sizeof smem) return 2;
    const dim3 g{gx, gy, gz}, b{bx, 1, 1};
    const std::string n(name);
    void (*k)(void**) = nullptr;
    if (n == "attn_fwd") k = emu::entry<attn_fwd>;
    else if (n == "attn_bwd_delta") k = emu::entry<attn_bwd_delta>;
    else if (n == "attn_bwd_dq") k = emu::entry<attn_bwd_dq>;
    else if (n == "attn_bwd_dkv") k = emu::entry<attn_bwd_dkv>;
    else if (n == "lce_stats") k = emu::entry<lce_stats>;
    else if (n == "lce_dx") k = emu::entry<lce_dx>;
    else if (n == "lce_dw") k = emu::entry<lce_dw>;
    else return 1;
    if (gx == 0 || gy == 0 || gz == 0) return 0;
    return emu::run(g, b, k, args);
}
