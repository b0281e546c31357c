// Shared primitives of the codecs (randomk, topkq, gspar, dqsg's packing, ...):
// counter-based uniforms, fixed-width bit packing / unpacking and order-fixed chunk sums.
// Byte for byte the same as the C twin kernels/primitives.c (CPU backend). signSGD,
// EF-signSGD, QSGD, TernGrad and DQSG's quantiser are single-pass kernels of their own
// (sign.cu, quant.cu, which inline the same uniform); the other codecs' element-wise math
// runs as torch ops on the tensor's device (hvdcompress/codecs/).
//
// Compiled three ways from this one file, like kernels/threelc.cu: by NVRTC through
// cupy.RawModule (hvdcompress/backends/cuda/, with NVRTC_OPTIONS of
// hvdcompress/_native.py: --fmad=false --ftz=false ...), by nvcc in
// scripts/check_kernels.sh, and by g++ for the host through kernels/cuda_host.h
// (tests/host_kernels/host_primitives.cpp). Hence plain C-like code, no #include under
// CUDA, no barriers or shared memory, no code that needs two threads at once.
//
// Names: kernels are primitives_<op> (as threelc.cu's are threelc_<op>), device helpers and
// macros hvd_prim_* / HVD_PRIM_* (the host build compiles both .cu files in one unit).
//
// Every index is 64-bit (blockIdx.x * blockDim.x and the grid stride formed in long
// long; bit offsets i * bits in long long). Every kernel is a grid-stride loop, so any
// grid size is correct; the backend launches 256 threads per block and at most 8 blocks
// per multiprocessor.
//
// `state` (when a kernel takes one) is the same zeroed 8-word uint32 array as threelc's;
// only word 3 (error bits, atomicOr) is used here.
#define HVD_PRIM_ST_ERROR 3
#define HVD_PRIM_ERR_PADDING 4u  // a padding bit after the last packed value is set

#ifndef __CUDACC__
#include "cuda_host.h"
#define hvd_prim_dadd(a, b) ((a) + (b))
#define hvd_prim_dmul(a, b) ((a) * (b))
#else
#define hvd_prim_dadd(a, b) __dadd_rn((a), (b))
#define hvd_prim_dmul(a, b) __dmul_rn((a), (b))
#endif

__device__ __forceinline__ long long hvd_prim_first_index()
{
    return (long long)blockIdx.x * (long long)blockDim.x + (long long)threadIdx.x;
}

__device__ __forceinline__ long long hvd_prim_grid_stride()
{
    return (long long)gridDim.x * (long long)blockDim.x;
}

// SplitMix64's output function.
__device__ __forceinline__ unsigned long long hvd_prim_mix64(unsigned long long z)
{
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// 1. out[i] = (mix64(key + (offset + i + 1) * golden) >> 40) * 2^-24 (exact float32 in
// [0, 1)): SplitMix64 output number offset + i + 1 of the stream seeded with key.
// grid: grid-stride over n elements. bytes: writes 4n.
extern "C" __global__ void primitives_uniform(unsigned long long key, long long offset,
                                              long long n, float* __restrict__ out)
{
    const long long stride = hvd_prim_grid_stride();
    for (long long i = hvd_prim_first_index(); i < n; i += stride) {
        const unsigned long long c = (unsigned long long)(offset + i) + 1ull;
        const unsigned long long z = hvd_prim_mix64(key + c * 0x9E3779B97F4A7C15ull);
        const unsigned int r = (unsigned int)(z >> 40);
        out[i] = __fmul_rn((float)r, 5.9604644775390625e-08f);  // 2^-24: exact
    }
}

// 2. Bit packing, LSB first: code i (its low `bits` bits, 1 <= bits <= 8) occupies bits
// [i bits, i bits + bits) of the little-endian stream; padding bits are zero. One thread
// per output byte j, gathering the codes that overlap bits [8j, 8j + 8), so no two
// threads write the same byte. grid: grid-stride over nbytes = ceil(n bits / 8).
// bytes: reads about n, writes nbytes.
extern "C" __global__ void primitives_bitpack(const unsigned char* __restrict__ codes,
                                              long long n, int bits,
                                              unsigned char* __restrict__ out, long long nbytes)
{
    const unsigned int mask = (1u << bits) - 1u;
    const long long stride = hvd_prim_grid_stride();
    for (long long j = hvd_prim_first_index(); j < nbytes; j += stride) {
        const long long lo_bit = 8ll * j;
        long long i = lo_bit / bits;
        long long last = (lo_bit + 7) / bits;
        if (last > n - 1) last = n - 1;
        unsigned int byte = 0u;
        for (; i <= last; ++i) {
            const long long pos = i * (long long)bits - lo_bit;  // -7 .. 7
            const unsigned int v = (unsigned int)codes[i] & mask;
            byte |= pos >= 0 ? v << pos : v >> (-pos);
        }
        out[j] = (unsigned char)(byte & 0xffu);
    }
}

// 3. Bit unpacking: one thread per code; nbytes == ceil(n bits / 8) is checked by the
// caller. The thread of code 0 checks the padding bits of the last byte and sets
// HVD_PRIM_ERR_PADDING. grid: grid-stride over n. bytes: reads about n bits / 8, writes n.
extern "C" __global__ void primitives_bitunpack(const unsigned char* __restrict__ in,
                                                long long nbytes, long long n, int bits,
                                                unsigned char* __restrict__ codes,
                                                unsigned int* __restrict__ state)
{
    const unsigned int mask = (1u << bits) - 1u;
    const long long stride = hvd_prim_grid_stride();
    const long long first = hvd_prim_first_index();
    if (first == 0 && n > 0) {
        const long long used = n * (long long)bits;
        if ((used & 7ll) && ((unsigned int)in[nbytes - 1] >> (used & 7ll)))
            atomicOr(state + HVD_PRIM_ST_ERROR, HVD_PRIM_ERR_PADDING);
    }
    for (long long i = first; i < n; i += stride) {
        const long long o = i * (long long)bits;
        const long long b = o >> 3;
        unsigned int w = (unsigned int)in[b];
        if (b + 1 < nbytes) w |= (unsigned int)in[b + 1] << 8;
        codes[i] = (unsigned char)((w >> (o & 7ll)) & mask);
    }
}

// 4. out[c] = sum over i in chunk c of |x_i| (square == 0) or x_i^2 (square != 0) in
// double, strictly left to right: one thread per chunk, so the order of the additions is
// the CPU's. grid: grid-stride over ceil(n / chunk) chunks. bytes: reads 4n, writes 8 per
// chunk (uncoalesced reads; chunks are 512..4096 elements).
extern "C" __global__ void primitives_chunk_sums(const float* __restrict__ x, long long n,
                                                 long long chunk, int square,
                                                 double* __restrict__ out)
{
    const long long chunks = (n + chunk - 1) / chunk;
    const long long stride = hvd_prim_grid_stride();
    for (long long c = hvd_prim_first_index(); c < chunks; c += stride) {
        const long long lo = c * chunk;
        const long long hi = lo + chunk < n ? lo + chunk : n;
        double s = 0.0;
        for (long long i = lo; i < hi; ++i) {
            const double v = (double)x[i];
            s = hvd_prim_dadd(s, square ? hvd_prim_dmul(v, v) : fabs(v));
        }
        out[c] = s;
    }
}
