// Host shim: lets g++ compile the kernels/*.cu sources unchanged, for tests that check the
// kernels' logic on a machine without a GPU (tests/host_kernels/).
//
// Build with HOST_CXX_FLAGS of hvdcompress/_native.py (g++ -std=c++17 -O2 -ffp-contract=off
// -fno-fast-math), so that float arithmetic is IEEE round-to-nearest-even without FMA
// contraction, like the CUDA intrinsics __fadd_rn & co. and the CPU backend.
//
// A launch runs every thread of every block one after another on the calling thread, so a
// kernel is correct here only if it is correct under any interleaving of its threads and
// needs no two threads to run at once: no barriers, no shared memory, no warp collectives
// (kernels/threelc.cu keeps its warp reductions under #ifdef __CUDACC__). __syncthreads()
// aborts with a message instead of silently doing nothing.
//
// launch_blocks() runs only some blocks of a big grid: tests/host_kernels/index64.cpp uses
// it to check, with blockIdx.x * blockDim.x > 2^32, that kernels index in 64 bits.
#ifndef HVDCOMPRESS_CUDA_HOST_H
#define HVDCOMPRESS_CUDA_HOST_H

#ifdef __CUDACC__
#error "cuda_host.h is for host (g++) builds of the kernels only"
#endif

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
// g++ knows __restrict__ already.

struct hvd_uint3 {
    unsigned int x, y, z;
};

inline thread_local hvd_uint3 threadIdx = {0, 0, 0};
inline thread_local hvd_uint3 blockIdx = {0, 0, 0};
inline thread_local hvd_uint3 blockDim = {1, 1, 1};
inline thread_local hvd_uint3 gridDim = {1, 1, 1};

inline void __syncthreads()
{
    fprintf(stderr, "cuda_host.h: __syncthreads() is not supported by the sequential host "
                    "shim; write the kernel without barriers\n");
    abort();
}

// Atomics: plain read-modify-write (threads run one at a time). Return the old value.
inline unsigned int atomicMax(unsigned int* p, unsigned int v)
{
    unsigned int old = *p;
    if (v > old) *p = v;
    return old;
}
inline unsigned int atomicAdd(unsigned int* p, unsigned int v)
{
    unsigned int old = *p;
    *p = old + v;
    return old;
}
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v)
{
    unsigned long long old = *p;
    *p = old + v;
    return old;
}
inline unsigned int atomicOr(unsigned int* p, unsigned int v)
{
    unsigned int old = *p;
    *p = old | v;
    return old;
}

// IEEE round-to-nearest-even float ops; with -ffp-contract=off none is fused.
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }

// The high 64 bits of the 128-bit product (CUDA's integer intrinsic).
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b)
{
    return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}

inline unsigned int __float_as_uint(float f)
{
    unsigned int u;
    memcpy(&u, &f, sizeof u);
    return u;
}
inline float __uint_as_float(unsigned int u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

// Runs blocks [first_block, first_block + num_blocks) of a grid of `grid` blocks of `block`
// threads, each thread to completion, in order.
template <typename... Params, typename... Args>
void launch_blocks(void (*kernel)(Params...), unsigned int grid, unsigned int block,
                   unsigned long long first_block, unsigned long long num_blocks,
                   Args... args)
{
    gridDim = {grid, 1, 1};
    blockDim = {block, 1, 1};
    for (unsigned long long b = first_block; b < first_block + num_blocks && b < grid; ++b) {
        blockIdx = {(unsigned int)b, 0, 0};
        for (unsigned int t = 0; t < block; ++t) {
            threadIdx = {t, 0, 0};
            kernel(args...);
        }
    }
    threadIdx = {0, 0, 0};
    blockIdx = {0, 0, 0};
}

// Runs the whole grid.
template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), unsigned int grid, unsigned int block, Args... args)
{
    launch_blocks(kernel, grid, block, 0ull, (unsigned long long)grid, args...);
}

#endif  // HVDCOMPRESS_CUDA_HOST_H
