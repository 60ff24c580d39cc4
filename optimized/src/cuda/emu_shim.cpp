// A CPU emulation of the CUDA execution model, just enough to run the
// kernels of optimized/src/cuda/*.cu unchanged on a machine without a GPU.
// optimized/src/cuda/emu.rs writes this file and the kernel sources into a
// cache folder, builds them with $CXX (or g++) into a shared library at
// first use, and calls `emu_launch` with cuLaunchKernel's argument layout.
//
// Each launch starts blockDim threads (std::thread); they walk the grid's
// blocks in order, one block at a time, with __syncthreads() a
// std::barrier over the block's threads and a barrier between blocks, so
// `extern __shared__` memory (one static buffer) is per block as on a GPU.
// Kernel arguments arrive as cuLaunchKernel's `void** kernelParams`.
//
// What it does not model: warps, memory ordering without __syncthreads,
// and the GPU's own rounding of expf/logf (glibc's are used; both are
// within a few ulp). It checks the kernels' logic, not their speed.

#include <barrier>
#include <cmath>
#include <cstring>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
static thread_local dim3 threadIdx, blockIdx;
static dim3 blockDim, gridDim;
static std::barrier<>* g_barrier = nullptr;

static inline void __syncthreads() { g_barrier->arrive_and_wait(); }
static inline float __int_as_float(unsigned int i) {
    float f;
    std::memcpy(&f, &i, sizeof f);
    return f;
}
static inline int min(int a, int b) { return a < b ? a : b; }

// Dynamic shared memory: one buffer, used by one block at a time.
constexpr unsigned SHARED_FLOATS = 1u << 16;
alignas(16) float smem[SHARED_FLOATS];

#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __shared__

#include "attention.cu"
#include "vocab.cu"

template <class... P, std::size_t... I>
static void call(void (*k)(P...), void** a, std::index_sequence<I...>) {
    k(*static_cast<std::remove_cv_t<std::remove_reference_t<P>>*>(a[I])...);
}

template <class... P>
static void launch(void (*k)(P...), dim3 grid, dim3 block, void** args) {
    gridDim = grid;
    blockDim = block;
    const unsigned nt = block.x * block.y * block.z;
    std::barrier<> bar(nt);
    g_barrier = &bar;
    std::vector<std::thread> ts;
    ts.reserve(nt);
    for (unsigned t = 0; t < nt; ++t) {
        ts.emplace_back([&, t] {
            threadIdx = {t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
            for (unsigned z = 0; z < grid.z; ++z)
                for (unsigned y = 0; y < grid.y; ++y)
                    for (unsigned x = 0; x < grid.x; ++x) {
                        blockIdx = {x, y, z};
                        call(k, args, std::index_sequence_for<P...>{});
                        bar.arrive_and_wait();
                    }
        });
    }
    for (auto& t : ts) t.join();
    g_barrier = nullptr;
}

// Returns 0, or 1 for an unknown kernel, 2 for too much shared memory.
extern "C" int emu_launch(const char* name, unsigned gx, unsigned gy, unsigned gz,
                          unsigned bx, unsigned shared_bytes, void** args) {
    if (shared_bytes > sizeof smem) return 2;
    const dim3 g{gx, gy, gz}, b{bx, 1, 1};
    const std::string n(name);
    if (n == "attn_fwd") launch(attn_fwd, g, b, args);
    else if (n == "attn_bwd_delta") launch(attn_bwd_delta, g, b, args);
    else if (n == "attn_bwd_dq") launch(attn_bwd_dq, g, b, args);
    else if (n == "attn_bwd_dkv") launch(attn_bwd_dkv, g, b, args);
    else if (n == "lce_stats") launch(lce_stats, g, b, args);
    else if (n == "lce_dx") launch(lce_dx, g, b, args);
    else if (n == "lce_dw") launch(lce_dw, g, b, args);
    else return 1;
    return 0;
}
